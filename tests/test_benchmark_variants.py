"""benchmarks/decode_breakdown.py's variants resolve against the package's settings, and the decode timings' helpers
and floors (no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import decode_breakdown  # noqa: E402


def test_every_variant_changes_known_settings_only():
    base = decode_breakdown.defaults()
    resolved = [decode_breakdown.settings_of(v, base) for v in decode_breakdown.VARIANTS]
    assert resolved[0] == base, "the first variant is the package's defaults"
    assert len({tuple(sorted(map(str, r.items()))) for r in resolved}) == len(resolved), "two variants are the same"
    assert resolved[1]["packed_decode"] is False
    assert decode_breakdown.parse_variant("packed_decode=False, step_dependents_after=1") == (
        ("packed_decode", False), ("step_dependents_after", 1))
    arguments = ["glm", "--variant", "packed_decode=False", "--against", "dir", "--variant", "fused_decode=False"]
    assert decode_breakdown.take_option(arguments, "--against", "a folder") == "dir"
    assert decode_breakdown.take_option(arguments, "--variant", "settings") == "packed_decode=False"
    assert decode_breakdown.take_option(arguments, "--variant", "settings") == "fused_decode=False"
    assert decode_breakdown.take_option(arguments, "--variant", "settings") is None
    assert arguments == ["glm"]
    with pytest.raises(SystemExit, match="--against needs a folder"):
        decode_breakdown.take_option(["--against"], "--against", "a folder")
    with pytest.raises(ValueError, match="unknown variant settings \\['tiles'\\]"):
        decode_breakdown.settings_of(decode_breakdown.variant(tiles=4), base)


def test_apply_sets_every_setting():
    """Every name of the defaults is one that apply() reads."""
    import inspect

    source = inspect.getsource(decode_breakdown.apply)
    for name in decode_breakdown.defaults():
        assert f'settings["{name}"]' in source, f"apply() ignores the setting {name}"


def test_replay_timings_are_one_per_call_between_its_own_events(monkeypatch):
    """selftest.replay_ms times each call between its own pair of events and synchronises once at
    the end: one figure per call (here, calls of 1, 2, 3, ... ms on a stand-in clock), none of the
    warm-up calls among them."""
    import types

    from glm_kda import selftest

    clock = {"now": 0.0, "synchronised": 0}

    class Event:
        def record(self):
            self.at = clock["now"]

        def synchronize(self):
            clock["synchronised"] += 1

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event,
                                                            get_elapsed_time=lambda start, end: end.at - start.at))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    durations = iter(range(1, 1000))

    def call():
        clock["now"] += next(durations)

    times = selftest.replay_ms(call, calls=200, warmup=3)
    assert times == [float(ms) for ms in range(4, 204)] and clock["synchronised"] == 1
    scrubs = []
    times = selftest.replay_ms(call, calls=5, warmup=0, between=lambda: scrubs.append(clock.update(now=clock["now"] + 1e6)))
    assert times == [float(ms) for ms in range(204, 209)] and len(scrubs) == 5, "the scrub was timed, or not issued"


def test_timed_call_counts_below_the_floor_are_refused():
    import argparse

    from glm_kda import bench_decode, bench_fla

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
