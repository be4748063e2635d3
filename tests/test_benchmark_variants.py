"""benchmarks/decode_breakdown.py's variants resolve against the package's settings (no GPU)."""

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
