"""Every script under benchmarks/ answers -h without a GPU; every GPU script parses its default
arguments and, on a machine without a GPU, stops with one ``error: ... needs a CUDA GPU`` line and
status 2 (no traceback from inside CUDA); benchmarks/ and the package stay apart (glm_kda imports
nothing from benchmarks/, and benchmarks/ is no package of the install)."""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

import pytest

from glm_kda.device import gpu_status

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from lib.script import exit_unless_gpu  # noqa: E402
import sanitizer_report  # noqa: E402
import stream_stack  # noqa: E402
from kernel_report import source_resources  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"

# script -> the arguments of a run (none: its defaults).
GPU_SCRIPTS = {
    "block.py": [], "cold_start.py": [], "compare_versions.py": ["--old", str(REPO)], "decode.py": [], "decode_breakdown.py": [],
    "gemm_rows.py": [], "host_cost.py": [], "kernel_versions.py": ["--old", str(REPO / "kernels_src")], "prefill.py": [], "profile_kernels.py": ["decode", "glm"],
    "projections.py": [], "stack.py": [], "stream_floor.py": [], "stream_stack.py": [],
}
# Scripts that run without a GPU here: fla_compare prints a note and exits 0 without fla (or torch,
# or a GPU); summarize_breakdown reads decode_breakdown's lines.
WITHOUT_GPU = {"fla_compare.py", "sanitizer_report.py", "summarize_breakdown.py"}


def test_every_gpu_script_is_listed():
    """A new script that runs kernels must join the list above (or say it runs without a GPU here)."""
    found = {p.name for p in BENCHMARKS.glob("*.py")}
    assert found - WITHOUT_GPU == set(GPU_SCRIPTS), f"unlisted: {sorted(found - WITHOUT_GPU - set(GPU_SCRIPTS))}"


@pytest.mark.skipif(gpu_status()[0], reason="a GPU is present: these scripts would run")
@pytest.mark.parametrize("script", sorted(GPU_SCRIPTS))
def test_script_without_gpu_stops_with_one_line(script, monkeypatch, capsys):
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


@pytest.mark.parametrize("script", ["host_cost.py", "decode_breakdown.py"])
def test_unknown_geometry_is_refused(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "kimi", "llama"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    assert stop.value.code == 2
    assert "unknown geometry 'llama'" in capsys.readouterr().err


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_every_script_answers_help_without_a_gpu(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    captured = capsys.readouterr()
    assert stop.value.code in (0, None), f"{script} --help exited with {stop.value.code!r}: {captured.err[-300:]}"
    assert len(captured.out.strip().splitlines()) >= 2, f"{script} --help printed: {captured.out!r}"


def _imports(path: Path) -> set[str]:
    """Top-level module names a Python file imports (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_package_imports_nothing_from_benchmarks():
    for path in sorted((REPO / "glm_kda").rglob("*.py")):
        found = _imports(path) & {"benchmarks", "lib", "bench_decode", "bench_prefill", "bench_fla"}
        assert not found, f"{path.relative_to(REPO)} imports {sorted(found)} (benchmarks/ is no part of the package)"
    assert not (BENCHMARKS / "__init__.py").exists(), "benchmarks/ must not be an importable package"
    for name in ("bench_decode", "bench_prefill", "bench_fla"):
        assert not (REPO / "glm_kda" / f"{name}.py").exists(), f"glm_kda/{name}.py is back: it lives in benchmarks/lib"


def test_scripts_reach_their_helpers_by_their_own_folder():
    """Each script puts its own folder first on sys.path and imports lib.<module>: it runs from any
    working directory, with PYTHONPATH naming only the package's checkout."""
    for path in sorted(BENCHMARKS.glob("*.py")):
        text = path.read_text()
        if "lib" in _imports(path):
            assert "sys.path.insert(0, str(Path(__file__).resolve().parent))" in text, path.name


# benchmarks/compare_versions.py without a GPU ---------------------------------------------------
def _compare_versions():
    sys.path.insert(0, str(BENCHMARKS))
    return runpy.run_path(str(BENCHMARKS / "compare_versions.py"), run_name="compare_versions")


def _row(key: str, us: float, bandwidth: float, out: str = "a" * 64, state: str = "b" * 64) -> dict:
    case = key.split("_")[0]
    timings = {"prefill_us": us} if case == "prefill" else {"graph_replay_us": us, "call_us": 2 * us}
    return {"case": case, "key": key, "rows": 1, "sequences": 1, "bytes": 10**6, "copy_bandwidth_GBs": bandwidth,
            "out_sha256": out, "state_sha256": state, **timings}


def test_compare_versions_lines_carry_ratios_rooflines_and_bits():
    combine = _compare_versions()["combine"]
    runs = {"old": [[_row("decode_B1", 100.0, 4000.0)], [_row("decode_B1", 120.0, 4000.0)]],
            "new": [[_row("decode_B1", 80.0, 3000.0)], [_row("decode_B1", 90.0, 3000.0)]]}
    line = combine("glm", "decode_B1", runs)
    assert line["old"]["graph_replay_us"] == 110.0 and line["new"]["graph_replay_us"] == 85.0  # medians of rounds
    assert line["ratio"] == {"graph_replay_us": 85.0 / 110.0, "call_us": 85.0 / 110.0}
    # Each version's roofline against its own copy bandwidth: 1 MB at 3000 GB/s is 1/3 us.
    assert line["new"]["graph_replay_roofline_ratio"] == 10**6 / 1e3 / 3000.0 / 85.0
    assert line["bits_identical"] and line["bits_repeatable"]
    runs["new"][1][0]["out_sha256"] = "c" * 64  # the new version's second round gave other bits
    line = combine("glm", "decode_B1", runs)
    assert line["bits_identical"] and not line["bits_repeatable"]
    runs["new"][0][0]["state_sha256"] = "d" * 64
    line = combine("glm", "decode_B1", runs)
    assert line["out_bits_identical"] and not line["state_bits_identical"] and not line["bits_identical"]
    prefill = combine("kimi", "prefill_T16384", {"old": [[_row("prefill_T16384", 9000.0, 4000.0)]],
                                                 "new": [[_row("prefill_T16384", 8100.0, 4000.0)]]})
    assert prefill["ratio"] == {"prefill_us": 0.9}


def test_compare_versions_bits_differences(tmp_path):
    import ml_dtypes
    import numpy as np

    differences = _compare_versions()["differences"]
    old, new = tmp_path / "old", tmp_path / "new"
    for folder, last in ((old, 1.0), (new, 1.5)):
        folder.mkdir()
        np.save(folder / "decode_B1_out.npy", np.array([[1.0, last]], ml_dtypes.bfloat16).view(np.uint16))
        np.save(folder / "decode_B1_conv.npy", np.zeros((3, 4), np.float32).view(np.uint32))
        np.save(folder / "decode_B1_recurrent.npy", np.full((2, 2), last, np.float32).view(np.uint32))
    got = differences(old, new, "decode_B1")
    assert got == {"out": {"differing": 1, "of": 2, "max_abs_diff": 0.5},
                   "recurrent": {"differing": 4, "of": 4, "max_abs_diff": 0.5}}


def test_compare_versions_refuses_a_folder_without_the_package(tmp_path, capsys):
    parse = _compare_versions()["parse_arguments"]
    with pytest.raises(SystemExit) as stop:
        parse(["--old", str(tmp_path)])
    assert stop.value.code == 2 and "no glm_kda/__init__.py there" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse([])
    assert "--old DIR is required" in capsys.readouterr().err
    args = parse(["--old", str(REPO), "--geometry", "kimi"])
    assert args.old == REPO and args.new == REPO and args.geometry == ["kimi"] and args.repeats == 200


@pytest.mark.parametrize("api", ["old", "new"])
def test_compare_versions_finds_either_layer_api(api, tmp_path):
    """lib.versions.Api.load on a stand-in package of each shape, imported in a subprocess from
    PYTHONPATH as the measuring side is: the old glm_kda.layer (3d65311) or the new glm_kda.gpu."""
    import os
    import subprocess

    package = tmp_path / "glm_kda"
    package.mkdir()
    (package / "__init__.py").write_text("")
    body = "class KdaLayer:\n    pass\n\ndef to_device_bf16(a):\n    return a\n"
    if api == "old":
        (package / "layer.py").write_text(body)
    else:
        (package / "gpu").mkdir()
        (package / "gpu" / "__init__.py").write_text("")
        (package / "gpu" / "layer.py").write_text("class KdaLayer:\n    pass\n")
        (package / "gpu" / "arrays.py").write_text("def to_device_bf16(a):\n    return a\n")
    code = (f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); from lib.versions import Api; a = Api.load(); "
            "print(a.name, a.package, a.KdaLayer.__module__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    name, where, module = done.stdout.split()
    assert name == api and where == str(package.resolve())
    assert module == ("glm_kda.layer" if api == "old" else "glm_kda.gpu.layer")


_SANITIZER_LOG = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 4 bytes
=========     at kda_chunk_scan_f32+0x1a0
=========     by thread (0,0,0) in block (0,0,0)
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at void cublasLt::splitKreduce_kernel<32, 16, int, float>(cublasSplitKParams<float>)+0x460
=========     by thread (1,0,0) in block (0,0,0)
=========
========= Error: Race reported between Write access at kda_gemm_rows_packed_pair_bf16_m1_n2+0x80
=========     and Read access at kda_gemm_rows_packed_pair_bf16_m1_n2+0x90 [16 hazards]
========= ERROR SUMMARY: 3 errors
"""


def test_sanitizer_report_sorts_ours_from_the_libraries(tmp_path):
    """Reports naming one of our entry points count as ours, a library kernel's do not; the
    tool's own total is read and compared with the reports printed."""
    log = tmp_path / "memcheck.log"
    log.write_text(_SANITIZER_LOG)
    row = sanitizer_report.summarize(log, sanitizer_report.our_kernels())
    assert row["tool_total"] == 3 and row["printed"] == 3 and row["all_printed"]
    assert row["our_kernels"] == {"kda_chunk_scan_f32": 1, "kda_gemm_rows_packed_pair_bf16_m1_n2": 1}, row
    assert list(row["library_kernels"]) == ["void cublasLt::splitKreduce_kernel<32, 16, int, float>(cublasSplitKParams<float>)"]
    log.write_text(_SANITIZER_LOG.replace("3 errors", "900 errors"))
    assert not sanitizer_report.summarize(log, sanitizer_report.our_kernels())["all_printed"]


def test_sanitizer_report_counts_passed_tests_and_a_process_that_ended_badly(tmp_path):
    """pytest -v's PASSED lines are counted; the tool's word that the process ended badly is a flag,
    not a report of a kernel."""
    log = tmp_path / "racecheck.log"
    log.write_text("========= COMPUTE-SANITIZER\ntests/a.py::t[x] PASSED [ 50%]\ntests/a.py::u PASSED      [100%]\n"
                   "tests/a.py::v FAILED [100%]\n========= Error: process didn't terminate successfully\n"
                   "========= Target application returned an error\n"
                   "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
    row = sanitizer_report.summarize(log, sanitizer_report.our_kernels())
    assert row["passed_tests"] == 2 and row["ended_badly"], row
    assert row["printed"] == 0 and row["library_kernels"] == {} and row["tool_total"] == 0, row


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_120"])
def test_stream_stack_kernel_compiles_without_spills(arch):
    """stream_stack.py's persistent kernel (bulk copies and mbarriers: sm_90 and later) compiles
    with the product's headers in front, and keeps its state column in registers."""
    resources = source_resources(stream_stack.kernel_source(), "stream_stack.cu", arch)["stream_stack"]
    assert resources["stack_frame"] == 0 and resources["spill_stores"] == 0, f"{arch}: {resources}"
