"""Every GPU script under benchmarks/ parses its default arguments and, on a machine without a GPU, stops
with one ``error: ... needs a CUDA GPU`` line and status 2 (no traceback from inside CUDA)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from glm_kda.device import exit_unless_gpu, gpu_status

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

# script -> the arguments of a run (none: its defaults).
GPU_SCRIPTS = {
    "block.py": [], "decode.py": [], "decode_breakdown.py": [], "gemm_rows.py": [], "host_cost.py": [],
    "mma_forms.py": [], "prefill.py": [], "profile_kernels.py": ["decode", "glm"], "sm_intake.py": [],
    "stream_floor.py": [], "timeline.py": [], "wgmma_forms.py": [],
}


def test_every_gpu_script_is_listed():
    """A new script that runs kernels must join the list above (or say it runs without a GPU here)."""
    without_gpu = {"fla_compare.py", "oracle_consistency.py", "summarize_breakdown.py", "wgmma_variants.py"}
    found = {p.name for p in BENCHMARKS.glob("*.py")}
    assert found - without_gpu == set(GPU_SCRIPTS), f"unlisted: {sorted(found - without_gpu - set(GPU_SCRIPTS))}"


@pytest.mark.skipif(gpu_status()[0], reason="a GPU is present: these scripts would run (see tests/test_gpu.py)")
@pytest.mark.parametrize("script", sorted(GPU_SCRIPTS))
def test_script_without_gpu_stops_with_one_line(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [script, *GPU_SCRIPTS[script]])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    err = capsys.readouterr().err
    assert stop.value.code == 2, f"{script} exited with {stop.value.code!r}; stderr: {err[-500:]}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "needs a CUDA GPU" in lines[0], err[-500:]


@pytest.mark.skipif(gpu_status()[0], reason="a GPU is present")
def test_exit_unless_gpu_names_the_work(capsys):
    with pytest.raises(SystemExit) as stop:
        exit_unless_gpu("the widget benchmark")
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("error: the widget benchmark needs a CUDA GPU: ")


def test_host_cost_refuses_an_unknown_geometry(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["host_cost.py", "kimi", "llama"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(BENCHMARKS / "host_cost.py"), run_name="__main__")
    assert stop.value.code == 2
    assert "unknown geometry 'llama'" in capsys.readouterr().err



@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_every_script_answers_help_without_a_gpu(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    captured = capsys.readouterr()
    assert stop.value.code in (0, None), f"{script} --help exited with {stop.value.code!r}: {captured.err[-300:]}"
    assert len(captured.out.strip().splitlines()) >= 2, f"{script} --help printed: {captured.out!r}"
