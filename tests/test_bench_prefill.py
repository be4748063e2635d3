"""The prefill benchmark's geometries and FLOP counts, without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from glm_kda.chunk_model import chunk_tc_supported, prepare_lower_bound

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from lib.bench_prefill import PREFILL_GEOMETRIES, block_flops, core_flops, geometry_config, kernel_bytes  # noqa: E402


def test_geometries_and_which_chunk_kernels_they_take():
    glm, kimi, kimi_bounded = (geometry_config(name) for name in PREFILL_GEOMETRIES)
    assert (glm.hidden, glm.heads, glm.gate_lower_bound) == (4096, 64, -5.0)
    assert (kimi.hidden, kimi.heads, kimi.bounded) == (2304, 32, False)
    # Kimi's shapes with the bounded law flash-linear-attention's safe-gate path is timed with.
    assert (kimi_bounded.hidden, kimi_bounded.heads, kimi_bounded.gate_lower_bound) == (2304, 32, -5.0)
    assert [chunk_tc_supported(c)[0] for c in (glm, kimi, kimi_bounded)] == [True, True, True]
    # The softplus law takes the unbounded prepare (no lower bound), the other two the bounded one.
    assert [prepare_lower_bound(c) for c in (glm, kimi, kimi_bounded)] == [-5.0, None, -5.0]
    with pytest.raises(ValueError, match="geometry must be one of"):
        geometry_config("glm-5")


def test_flop_counts_by_hand():
    config = geometry_config("kimi-bounded")
    c, d, heads, tokens = config.chunk, config.head_dim, config.heads, 1000
    core = tokens * heads * (8 * c * d + (2 * c * c) // 3 + 6 * d * d)
    assert core_flops(config, tokens) == core
    qkv, hidden = heads * d, config.hidden
    projections = 2 * tokens * (hidden * (3 * qkv + 2 * d + heads) + 2 * d * qkv + qkv * hidden)
    assert block_flops(config, tokens) == projections + core


def test_comparison_note_says_why_there_are_no_fla_rows():
    from lib.bench_fla import comparison_note, fla_available

    assert comparison_note(False) == (False, {"note": "no flash-linear-attention rows: --no-fla"})
    ok, why = fla_available()
    wanted_ok, note = comparison_note(True)
    assert wanted_ok == ok and why in note["note"]


def test_kernel_bytes_by_hand_and_by_gate_law():
    """The bytes each prefill kernel must move: the kernels of the geometry's gate law, each an entry
    point, and the conv's and the norm's counts worked by hand at Kimi-Linear geometry."""
    from glm_kda.gpu.build import ENTRY_POINTS

    entries = {name for names in ENTRY_POINTS.values() for name in names}
    tokens = 1000
    for geometry in PREFILL_GEOMETRIES:
        moved = kernel_bytes(geometry_config(geometry), tokens)
        assert set(moved) <= entries, f"{geometry}: {set(moved) - entries} are not entry points"
        bounded = prepare_lower_bound(geometry_config(geometry)) is not None
        assert ("kda_chunk_tc_prepare_gate_f32" in moved) == bounded
        assert ("kda_chunk_tc_prepare_unbounded_gate_f32" in moved) == (not bounded)
        assert "kda_gate_beta_f32" not in moved, f"{geometry}: every prepare here forms the gate itself"
    moved, recorded = (kernel_bytes(geometry_config("kimi"), tokens, record) for record in (False, True))
    qkv = 32 * 128
    # qkv_proj in (BF16 [T, 3*qkv]), q, k and v out (FP32 [T, qkv] each); recorded, conv_out out (as qkv_proj)
    assert moved["kda_conv_prefill_silu_l2_bf16"] == tokens * 3 * qkv * 2 + 3 * tokens * qkv * 4
    assert recorded["kda_conv_prefill_silu_l2_bf16"] == moved["kda_conv_prefill_silu_l2_bf16"] + tokens * 3 * qkv * 2
    # recorded, the prepare also writes the gate it forms (FP32 [T, qkv])
    gated = "kda_chunk_tc_prepare_unbounded_gate_f32"
    assert recorded[gated] == moved[gated] + tokens * qkv * 4
    # core in (FP32), out_gate in and o_norm_out out (BF16)
    assert moved["kda_gated_rmsnorm_sigmoid_bf16"] == tokens * qkv * 4 + 2 * tokens * qkv * 2
