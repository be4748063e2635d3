"""benchmarks/decode_breakdown.py's variants are KdaOptions fields only; the timing helpers of
benchmarks/lib and their byte counts; the decode targets (no GPU)."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import decode_breakdown  # noqa: E402
from lib import timing  # noqa: E402

from glm_kda.config import GLM_5_3_FLASH, KIMI_LINEAR_48B, KdaConfig  # noqa: E402
from glm_kda.options import KdaOptions  # noqa: E402


def test_every_variant_changes_kda_options_fields_only():
    from lib.layers import option_fields, parse_options

    base = option_fields()
    assert base == {f: getattr(KdaOptions(), f) for f in base}, "the defaults are KdaOptions()'s"
    resolved = [decode_breakdown.settings_of(v, base) for v in decode_breakdown.VARIANTS]
    assert resolved[0] == base, "the first variant is the package's defaults"
    assert resolved[1]["packed_weights"] is False
    for settings in resolved:
        KdaOptions(**settings)  # each one a valid KdaOptions
    assert parse_options("packed_weights=False, hopper=False") == {"packed_weights": False, "hopper": False}
    assert parse_options("chunk_impl=fp32") == {"chunk_impl": "fp32"}
    assert parse_options("chunk_impl='tensor'") == {"chunk_impl": "tensor"}
    for bad in ("fused_decode=False", "STEP_SPLIT_WAVES=1.0", "hopper", "kernel_sources='/tmp/k'"):
        with pytest.raises(argparse.ArgumentTypeError, match="KdaOptions fields"):
            parse_options(bad)
    with pytest.raises(ValueError, match="unknown variant settings \\['tiles'\\]"):
        decode_breakdown.settings_of(decode_breakdown.variant(tiles=4), base)
    # --variant adds to the defaults and packed_weights=False, each once.
    assert decode_breakdown.variants_of([{"hopper": False}, {"packed_weights": False}]) == (
        (), (("packed_weights", False),), (("hopper", False),))


def test_breakdown_arguments(capsys):
    args = decode_breakdown.parse_arguments(["glm", "--variant", "hopper=False", "--variant", "graphs=False"])
    assert args.geometry == ["glm"] and args.variant == [{"hopper": False}, {"graphs": False}]
    assert decode_breakdown.parse_arguments([]).geometry == ["glm", "kimi"]
    with pytest.raises(SystemExit) as stop:
        decode_breakdown.parse_arguments(["--variant", "counting_ahead=True"])
    assert stop.value.code == 2 and "KdaOptions fields" in capsys.readouterr().err


def _stand_in_cupy(monkeypatch, clock):
    class Event:
        def record(self):
            self.at = clock["now"]

        def synchronize(self):
            clock["synchronised"] += 1

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event,
                                                            get_elapsed_time=lambda start, end: end.at - start.at))
    monkeypatch.setitem(sys.modules, "cupy", fake)


def test_replay_timings_are_one_per_call_between_its_own_events(monkeypatch):
    """timing.replay_ms times each call between its own pair of events and synchronises once at
    the end: one figure per call (here, calls of 1, 2, 3, ... ms on a stand-in clock), none of the
    warm-up calls among them."""
    clock = {"now": 0.0, "synchronised": 0}
    _stand_in_cupy(monkeypatch, clock)
    durations = iter(range(1, 1000))

    def call():
        clock["now"] += next(durations)

    times = timing.replay_ms(call, calls=200, warmup=3)
    assert times == [float(ms) for ms in range(4, 204)] and clock["synchronised"] == 1
    scrubs = []
    times = timing.replay_ms(call, calls=5, warmup=0, between=lambda: scrubs.append(clock.update(now=clock["now"] + 1e6)))
    assert times == [float(ms) for ms in range(204, 209)] and len(scrubs) == 5, "the scrub was timed, or not issued"
    # median_ms: each call synchronised (warm-up 209 and 210 ms, then 211 .. 215).
    assert timing.median_ms(call, repeats=5, warmup=2) == 213.0 and clock["synchronised"] == 1 + 1 + 5


def test_byte_counts_and_roofline_by_hand():
    cfg = KdaConfig(**KIMI_LINEAR_48B)
    d, h, qkv, hidden = cfg.head_dim, cfg.heads, cfg.qkv, cfg.hidden
    weights = 2 * (3 * qkv * hidden + (2 * d + h) * hidden + 2 * qkv * d + 3 * qkv * cfg.conv_kernel + d
                   + hidden * qkv) + 4 * (qkv + h)
    assert timing.weight_bytes(cfg) == weights
    state = 2 * 4 * (h * d * d + 3 * qkv * cfg.conv_kernel)
    assert timing.state_bytes(cfg) == state
    assert timing.decode_bytes(cfg) == weights + state
    assert timing.decode_bytes(cfg, 64) == weights + 64 * state
    assert timing.prefill_bytes(cfg, 1000) == weights + state + 4 * 1000 * hidden
    # 1 GB at 1000 GB/s is 1000 us: a call of 2000 us runs at half the copy's rate.
    assert timing.roofline(10**9, 1000.0, 2000.0) == pytest.approx(0.5)
    fields = timing.roofline_fields(10**9, 1000.0, graph_us=2000.0, call_us=4000.0)
    assert fields == {"bytes": 10**9, "copy_bandwidth_GBs": 1000.0, "roofline_us": 1000.0,
                      "graph_roofline_ratio": 0.5, "call_roofline_ratio": 0.25}
    glm = KdaConfig(**GLM_5_3_FLASH)
    assert timing.weight_bytes(glm) > timing.weight_bytes(cfg)


def test_timed_call_counts_below_the_floor_are_refused():
    from lib import bench_decode, bench_fla

    for module in (bench_decode, bench_fla):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        assert parser.parse_args([]).repeats == 200
        with pytest.raises(SystemExit):
            parser.parse_args(["--repeats", "199"])


def test_breakdown_targets_mark_what_is_met():
    """summarize_breakdown's targets on figures of an H200 run (GLM's defaults, Kimi's): each item
    against its bound, a ratio at least / a verify factor at most."""
    import summarize_breakdown

    glm = {"geometry": "glm", "graph_replay_roofline_ratio": 0.859, "B64_roofline_ratio": 0.806,
           "verify_replay_over_decode": {"K4": 1.115, "K16": 1.436}}
    kimi = {"geometry": "kimi", "graph_replay_roofline_ratio": 0.623, "B64_roofline_ratio": 0.699,
            "verify_replay_over_decode": {"K4": 1.41, "K16": 2.025}}
    assert [met for *_, met in summarize_breakdown.acceptance(glm)] == [True, True, True, True]
    assert [met for *_, met in summarize_breakdown.acceptance(kimi)] == [False, False, False, True]
    line = summarize_breakdown.acceptance_line({**glm, "B64_roofline_ratio": None})
    assert "B=64 roofline - (>= 0.75) NOT MET" in line and "B=1 roofline 0.859 (>= 0.85) met" in line
    summary = summarize_breakdown.summary({
        **glm, "changed": {"hopper": False}, "copy_bandwidth_GBs": 4000.0, "graph_replay_us": 80.0,
        "B64_graph_replay_us": 300.0, "public_call_back_to_back_us": 82.0})
    assert summary.startswith("glm {'hopper': False} | copy 4000 GB/s | B1 80.00 us (0.859)"), summary
