"""benchmarks/timeline.py without a GPU: the traced kernel sources compile for every
architecture, and a replay's records turn into the per-launch timeline."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import timeline  # noqa: E402

from glm_kda.gpu import build as kernels  # noqa: E402


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100", "sm_120"])
def test_traced_kernels_compile(tmp_path, arch):
    folder = timeline.write_traced_sources(tmp_path / "kernels")
    assert (folder / timeline.TRACE_HEADER).read_text().startswith("#define KDA_TRACE 1\n")
    for stem in timeline.TRACED_STEMS:
        own = kernels.ARCH_ENTRY_POINTS.get(stem)
        if own is not None and own[0].rstrip("a") != arch:
            continue  # a family of one architecture's instructions, traced for that one alone
        try:
            compiled = kernels.compile_file(stem, own[0] if own else arch, folder)
        except kernels.KernelCompileError as error:
            if "NVRTC" in str(error) and "not supported" in str(error):
                pytest.skip(f"this NVRTC has no {arch}: {error}")
            raise
        assert compiled.cubin, f"{stem} traced for {arch}: no cubin"
    assert timeline.trace_capacity() == 65536
    # The package's own sources are untouched.
    assert not (kernels.kernels_dir() / timeline.TRACE_HEADER).read_text().startswith("#define KDA_TRACE")


def test_traced_stems_are_kernel_files():
    """Every module timeline reads records from is a kernel family of the build, and every traced
    family holds the trace scope (else its launches would be missing from the timeline)."""
    families = set(kernels.ENTRY_POINTS) | set(kernels.ARCH_ENTRY_POINTS)
    assert set(timeline.TRACED_STEMS) <= families, sorted(set(timeline.TRACED_STEMS) - families)
    for stem in timeline.TRACED_STEMS:
        assert "KDA_TRACE_SCOPE(" in kernels.kernel_source(stem), stem


def _record(tag: int, sm: int, start: int, waited: int, end: int) -> list[int]:
    return [tag | (sm << 48), start, waited, end]


def test_replay_records_become_a_timeline():
    qkv, step, out = 0x7F0000001000, 0x7F0000002000, 0x7F0000003000
    records = np.array([
        _record(qkv, 0, 1_000, 0, 20_000), _record(qkv, 1, 1_500, 0, 21_000),
        _record(step, 2, 21_500, 0, 29_000),
        _record(out, 3, 22_000, 29_500, 33_000), _record(out, 4, 23_000, 29_400, 34_000),
        _record(0x7F0000009000, 5, 2_000, 0, 3_000),  # a launch with no name
    ], dtype=np.uint64)
    got = timeline.replay_timeline(records, {qkv: "q|k|v", step: "fused step", out: "o_proj"})
    assert got["q|k|v"] == {"start_us": 0.0, "last_start_us": 0.5, "first_wait_us": None, "last_wait_us": None,
                            "first_end_us": 19.0, "end_us": 20.0, "blocks": 2}
    assert got["o_proj"]["last_wait_us"] == 28.5 and got["o_proj"]["end_us"] == 33.0
    assert got["o_proj"]["first_wait_us"] == 28.4 and got["o_proj"]["last_start_us"] == 22.0
    assert got["fused step"]["start_us"] == 20.5 and got["_step_us"] == 33.0
    assert "0x7f0000009000" in got and got["_tick_ns"] == 100
    summary = timeline.median_timeline([got, got])
    assert list(summary)[:3] == ["q|k|v", "0x7f0000009000", "fused step"]
    assert summary["o_proj"]["blocks"] == 2
    text = timeline.table({"geometry": "kimi", "rows": 1, "step_us": 33.0, "roofline_us": 20.0, "timer_tick_ns": 100,
                           "launches": summary})
    assert "o_proj      starts    21.0 .. 22.0, waits 28.4 .. 28.5, ends 32.0 .. 33.0 us" in text, text


def test_replay_records_become_blocks():
    qkv, out = 0x7F0000001000, 0x7F0000003000
    records = np.array([
        _record(out, 131, 22_000, 29_500, 33_000), _record(qkv, 7, 1_000, 0, 20_000),
        _record(0x7F0000009000, 5, 2_000, 0, 3_000),
    ], dtype=np.uint64)
    got = timeline.replay_blocks(records, {qkv: "q|k|v", out: "o_proj"})
    assert got == [["q|k|v", 7, 0.0, None, 19.0], ["0x7f0000009000", 5, 1.0, None, 2.0],
                   ["o_proj", 131, 21.0, 28.5, 32.0]], got


def test_no_replays_is_refused():
    with pytest.raises(SystemExit):
        timeline.main(["kimi", "--replays", "0"])


def test_variants_are_kda_options_fields_only(capsys):
    """--variant takes KdaOptions fields (values Python literals); anything else is refused by
    argparse, naming the fields there are, before any GPU work."""
    pytest.importorskip("glm_kda.options")
    args = timeline.parse_arguments(["kimi", "--variant", "hopper=False", "--variant", "packed_weights=False"])
    assert args.geometries == ["kimi"] and args.options == {"hopper": False, "packed_weights": False}
    assert timeline.parse_arguments([]).geometries == ["glm", "kimi"]
    for bad in ("SIDE_CHAIN_FIRST=False", "hopper", "gemm_rows.BULK_SPLIT_WARPGROUPS=2", "nope=1"):
        with pytest.raises(SystemExit) as stop:
            timeline.parse_arguments(["--variant", bad])
        assert stop.value.code == 2
        assert "KdaOptions fields" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        timeline.parse_arguments(["llama"])
