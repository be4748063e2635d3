"""The fused decode step (kernels_src/decode/decode.cu): conv + SiLU + L2, gate, beta, the recurrent
step and the gated norm of every head of every sequence in one launch."""

from __future__ import annotations

import numpy

from .. import build
from .checks import (HEAD_BLOCK, HEAD_DIM, _f32, _i32, _require, _slot_rows, _state_or_pool_heads, check_scratch,
                     conv_kernel_size)
from .gate import check_gate_sources, gate_law_args

# dependents_after (KdaDependentsAfter of decode.cu): the next kernel launches at once, once the first
# token's inputs are formed, or after its recurrent step.
_DEPENDENTS_AT_START, _DEPENDENTS_AFTER_INPUTS, _DEPENDENTS_AFTER_STEP = 0, 1, 2


def kda_decode_fused_bf16(
    conv_state, recurrent_state, qkv_proj, conv_w, forget_proj, dt_bias, a_log, beta_logits, out_gate, o_norm_w,
    conv_out, query, key, value, gate, beta, core, o_norm_out, *, bounded: bool, lower_bound: float,
    scale: float, l2_eps: float, norm_eps: float, slots=None, tokens: int = 1, prefetch_ahead: int = 0,
    dependents_after: int = 0, x_tiles=None, outputs_ready=None,
) -> int:
    """The stateful half of decode in one launch (docs/design.md, "The fused decode step"): for each
    sequence, `tokens` consecutive tokens of conv + SiLU + L2, forget gate and beta, one delta-rule step,
    gated RMSNorm, every stage's output written. rows = sequences * tokens, sequence s's tokens in order
    from row s * tokens.

    States, in place: conv_state [3*H*D, K] FP32 and recurrent_state [H, D, D] FP32 (one
    sequence), or pools [N, 3*H*D, K] and [N, H, D, D]; sequence s uses slot slots[s] (device int32)
    or, without slots, state s.
    Inputs: qkv_proj [rows, 3*H*D] BF16, conv_w [3*H*D, K] BF16, forget_proj [rows, H*D]
    BF16, dt_bias [H*D] FP32, a_log [H] FP32, beta_logits [>= rows, >= H] BF16 (a column
    slice is fine), out_gate [rows, H*D] BF16, o_norm_w [D] BF16.
    Stage outputs: conv_out [rows, 3*H*D] BF16; query, key (L2-normalised), value, gate,
    core [rows, H, D] FP32; beta [rows, H] FP32; o_norm_out [rows, H*D] BF16.

    None of these changes a bit (docs/design.md, "The fused decode step" and "Output projection"):
        prefetch_ahead    the block of sequence s asks L2 for the states of sequence s + prefetch_ahead (0: none)
        dependents_after  when the next kernel of the stream may launch: 0 at once, 1 once the first
                          token's inputs are formed, 2 after its recurrent step
        x_tiles           None, or contiguous BF16 of at least projection.x_tiles_size(rows, H*D) elements:
                          o_norm_out's rows again in the bulk sweep's tile layout, for an o_proj with x_tiled=True
        outputs_ready     None, or contiguous int32 of at least 2 elements, both zero: each block adds 1 to
                          outputs_ready[0] once its outputs are written, before it stores its states, for
                          projection.gemm_rows_bf16(..., ready=outputs_ready, ready_target=<blocks launched>)

    Returns the blocks launched (the count outputs_ready reaches).
    """
    heads = _state_or_pool_heads(recurrent_state)
    qkv = heads * HEAD_DIM
    conv_dim = 3 * qkv
    rows = 1 if qkv_proj.ndim == 1 else qkv_proj.shape[0]
    if tokens < 1 or rows % tokens:
        raise ValueError(f"tokens = {tokens}: the {rows} rows must be whole sequences of tokens rows")
    sequences = rows // tokens
    kernel_size = conv_kernel_size(conv_state[0] if conv_state.ndim == 3 else conv_state, conv_w, conv_dim)
    _slot_rows("conv_state", conv_state, (conv_dim, kernel_size), sequences, slots)
    _slot_rows("state", recurrent_state, (heads, HEAD_DIM, HEAD_DIM), sequences, slots)
    _require("qkv_proj", qkv_proj, "bf16", (rows, conv_dim))
    _require("conv_out", conv_out, "bf16", (rows, conv_dim))
    ld_beta = check_gate_sources(forget_proj, dt_bias, a_log, beta_logits, heads, HEAD_DIM, rows)
    for name, array in (("forget_proj", forget_proj), ("out_gate", out_gate), ("o_norm_out", o_norm_out)):
        _require(name, array, "bf16", (rows, qkv))
    _require("norm_w", o_norm_w, "bf16", (HEAD_DIM,))
    for name, array in (("query", query), ("key", key), ("value", value), ("gate", gate), ("core", core)):
        _require(name, array, "f32", (rows, heads, HEAD_DIM))
    _require("beta", beta, "f32", (rows, heads))
    law = gate_law_args(bounded, lower_bound)
    if prefetch_ahead < 0:
        raise ValueError(f"prefetch_ahead must be >= 0, got {prefetch_ahead}")
    if conv_state.data.ptr % 16 or recurrent_state.data.ptr % 16:
        prefetch_ahead = 0  # the L2 requests take 16-byte aligned ranges; a hint, so none
    if dependents_after not in (_DEPENDENTS_AT_START, _DEPENDENTS_AFTER_INPUTS, _DEPENDENTS_AFTER_STEP):
        raise ValueError(f"dependents_after must be 0, 1 or 2, got {dependents_after}")
    if x_tiles is not None:
        from ..projection import check_x_tiles  # (projection imports this package)

        check_x_tiles(x_tiles, o_norm_out.dtype, rows, qkv, "kda_decode_fused_bf16")
    if outputs_ready is not None:
        check_scratch(outputs_ready, numpy.int32, "int32", 2, "outputs_ready", "kda_decode_fused_bf16")
    build.launch(
        "kda_decode_fused_bf16", (heads, sequences), (HEAD_BLOCK,),
        (conv_state, recurrent_state, slots, qkv_proj, conv_w, forget_proj, dt_bias, a_log, beta_logits,
         _i32(ld_beta), out_gate, o_norm_w, conv_out, query, key, value, gate, beta, core, o_norm_out, _i32(heads),
         _i32(kernel_size), _i32(tokens), *law, _f32(scale), _f32(l2_eps), _f32(norm_eps), _i32(prefetch_ahead),
         _i32(dependents_after), x_tiles, outputs_ready),
    )
    return heads * sequences
