"""The prefill benchmark's geometries and FLOP counts, without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from glm_kda.chunk_model import chunk_tc_supported, prepare_lower_bound

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from lib.bench_prefill import (PREFILL_GEOMETRIES, block_flops, core_flops, geometry_config, kernel_bytes,  # noqa: E402
                               middle_against_fla)


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


# One run's lines at GLM-5.3-Flash geometry, T = 16384 (one H100), the kernel names as torch.profiler gave them.
_OURS_KERNELS = {"impl": "glm_kda-tensor", "case": "block_kernels", "geometry": "glm", "T": 16384, "options": {},
                 "total_ms": {"[front_end]": 4.547, "[recurrence]": 4.389, "[back_end]": 1.774,
                              "kda_conv_prefill_silu_l2_bf16": 1.212, "kda_chunk_tc_prepare_gate_f32": 1.951,
                              "kda_chunk_tc_scan_f32": 1.203, "kda_gated_rmsnorm_sigmoid_bf16": 0.367}}
_FLA_GEMMS = {"nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN": 4.233,
              "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": 1.384,
              "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": 0.111,
              "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT": 0.111,
              "nvjet_sm90_tst_128x128_64x6_1x2_h_bz_TNT": 0.105,
              "nvjet_sm90_tst_64x128_64x8_1x2_h_bz_TNN": 0.058}
# How cuBLAS names its kernels before Hopper (a name made up in that form, not from the run).
_OLDER_GEMM = {"sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x32_stage4": 0.5}
_FLA_REST = {"recompute_w_u_fwd_kda_kernel": 0.727, "chunk_kda_fwd_kernel_inter_solve_fused": 0.686,
             "chunk_gla_fwd_kernel_o": 0.684, "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": 0.640,
             "causal_conv1d_fwd_kernel": 0.640, "chunk_kda_fwd_kernel_intra_sub_chunk": 0.596,
             "l2norm_fwd_kernel": 0.353, "kda_gate_chunk_cumsum_vector_kernel": 0.296,
             "layer_norm_gated_fwd_kernel": 0.264,
             "void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>, std::a": 0.125}


def test_middle_against_fla_sets_kernel_time_beside_kernel_time():
    """Our kda_ kernels against fla's layer's kernels that are not cuBLAS's, at the T both broke down
    (ours also breaks down a longer T); the sections and a variant's breakdown left out, and fla's
    kernel sum over its median call."""
    kernels = {**_FLA_GEMMS, **_OLDER_GEMM, **_FLA_REST}
    fla = {"impl": "fla", "case": "prefill_kernels", "geometry": "glm", "T": 16384, "kernel_ms": kernels,
           "kernel_total_ms": sum(kernels.values())}
    fla_block = {"impl": "fla", "case": "block", "fla_case": "prefill", "geometry": "glm", "T": 16384,
                 "median_us": 11278.2}
    variant = {**_OURS_KERNELS, "options": {"hopper": False}, "total_ms": {"kda_chunk_tc_scan_f32": 99.0}}
    longer = {**_OURS_KERNELS, "T": 65536, "total_ms": {"kda_chunk_tc_scan_f32": 4.8}}
    row = middle_against_fla([longer, variant, _OURS_KERNELS, fla_block, fla])
    assert row["ours_ms"] == pytest.approx(1.212 + 1.951 + 1.203 + 0.367)
    assert row["fla_gemm_ms"] == pytest.approx(sum(_FLA_GEMMS.values()) + 0.5)
    assert row["fla_ms"] == pytest.approx(sum(_FLA_REST.values()))
    assert row["ratio"] == pytest.approx(sum(_FLA_REST.values()) / (1.212 + 1.951 + 1.203 + 0.367))
    assert row["fla_gpu_busy"] == pytest.approx(sum(kernels.values()) / 11.2782)
    assert (row["geometry"], row["T"]) == ("glm", 16384)
    assert middle_against_fla([_OURS_KERNELS, fla_block]) is None, "no breakdown of fla's layer: no line"
    assert middle_against_fla([fla, fla_block]) is None, "no breakdown of ours: no line"
    other_t = {**fla, "T": 4096}
    assert middle_against_fla([_OURS_KERNELS, other_t]) is None, "breakdowns at different T are not compared"
