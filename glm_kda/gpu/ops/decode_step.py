"""The fused decode step (kernels_src/decode.cu): conv + SiLU + L2, gate, beta, the recurrent step and the gated norm."""

from __future__ import annotations

import functools
import math

import cupy
import ml_dtypes
import numpy

from .. import build as kernels
from .checks import *  # noqa: F403
from .checks import _F32_DTYPE, _check_dtype, _f32, _i32, _require, _require_aligned, _require_head_dim, _require_int32, _require_rows, _row_stride, _slot_rows, _state_or_pool_heads, _token_slices  # noqa: F401

def kda_decode_fused_bf16(
    conv_state, state, qkv_proj, conv_w, forget_proj, dt_bias, a_log, beta_logits, out_gate, norm_w,
    conv_out, query, key, value, gate, beta, core, o_norm_out, *, bounded: bool, lower_bound: float,
    scale: float, l2_eps: float, norm_eps: float, slots=None, tokens: int = 1, prefetch_ahead: int = 0,
    dependents_after: int = 0, staged: bool = False, carveout: int = -1, split: bool = False, x_tiles=None,
    inputs_ready=None, inputs_target: int = 1, outputs_ready=None,
) -> int:
    """The stateful half of decode in one launch: for each sequence, `tokens` consecutive
    tokens of conv + SiLU + L2, forget gate and beta, one delta-rule step, gated RMSNorm.

    What conv_decode_silu_l2_bf16, gate_beta_f32, kda_recurrent_step_f32 and
    gated_rmsnorm_sigmoid_bf16 compute in turn, token by token, bit for bit (the same device
    functions), and every one of their outputs is written. rows = sequences * tokens: rows
    s * tokens .. s * tokens + tokens - 1 are sequence s's tokens in order (tokens > 1 is a
    speculative verify's walk: the states stay in registers from the first token to the last).

    States, in place: conv_state [3*H*D, K] FP32 and state [H, D, D] FP32 (one sequence),
    or pools [N, 3*H*D, K] and [N, H, D, D]; sequence s uses slot slots[s] (device int32) or,
    without slots, state s.
    Inputs: qkv_proj [rows, 3*H*D] BF16, conv_w [3*H*D, K] BF16, forget_proj [rows, H*D]
    BF16, dt_bias [H*D] FP32, a_log [H] FP32, beta_logits [>= rows, >= H] BF16 (a column
    slice is fine), out_gate [rows, H*D] BF16, norm_w [D] BF16.
    Stage outputs: conv_out [rows, 3*H*D] BF16; query, key (L2-normalised), value, gate,
    core [rows, H, D] FP32; beta [rows, H] FP32; o_norm_out [rows, H*D] BF16.

    prefetch_ahead: the block of sequence s asks L2 for the state of sequence s + prefetch_ahead
    (0: none), a block of a later wave when that many sequences fill the resident blocks; it
    changes no bit.

    dependents_after: where the blocks let the next kernel of the stream launch (a programmatic
    dependent such as the output projection): 0 at once, 1 once the first token's inputs are
    formed, 2 after its recurrent step, 3 (with inputs_ready only) once past the wait for
    inputs_ready, before the inputs are read. It changes no bit.

    staged: on sm_90 and later, move each head's state (64 KB) by one bulk copy each way through
    shared memory instead of a load and a store per value and thread (ignored before sm_90 or
    for a state not 16-byte aligned); ``carveout`` is then the shared-memory split it asks for
    (percent, -1 the driver's choice). It changes no bit.

    x_tiles: None, or a contiguous BF16 array of at least gemm_rows.x_tiles_size(rows, H*D) elements
    that receives o_norm_out's rows again in the tile layout of the bulk-copy projection sweep
    (gemm_rows.tile_layout; the rows past `rows` of the last group of 64 are not touched): the
    output projection then reads it with gemm_rows_bulk(x_tiled=True). It changes no bit.

    split: on sm_90 and later, run each head on a cluster of HEAD_SPLIT blocks, block r stepping
    value columns 32 r .. 32 r + 31 (a quarter of the state each, so four SMs move a head's
    state), every block forming the head's q, k and gate (ignored before sm_90, or with staged).
    It changes no bit.

    inputs_ready: None, or a contiguous int32 array of at least 2 elements, both zero, for a step
    whose qkv_proj is written on another stream that then counts inputs_ready[0] up to
    ``inputs_target``: :func:`signal_inputs_ready` after the writer (target 1), or the writer's own
    blocks (``gemm_rows.gemm_rows_bf16(..., counted=inputs_ready)``, target the blocks it returns).
    The step launches as a programmatic dependent of the kernel before it on this stream (its
    other inputs' last writer): its blocks load their state column and conv windows, wait for that
    kernel and for inputs_ready[0] to reach the target, then read their inputs; the last block past
    the wait sets both words back to zero. dependents_after must then be 1, 2 or 3 (the next kernel of this
    stream may launch only once every block has its inputs), unless that kernel awaits
    ``outputs_ready`` and may launch at once. The caller must leave room for every
    block of the writer of qkv_proj, of the signal and of this step to be resident at once (the
    step's blocks wait, holding their SMs; a wait of 2^26 polls, tens of seconds, traps). It
    changes no bit.

    outputs_ready: None, or a contiguous int32 array of at least 2 elements, both zero: each block
    adds 1 to outputs_ready[0] once its outputs are written, before it stores its states. The
    next kernel of the stream, an output projection launched by ``gemm_rows.gemm_rows_bf16(...,
    ready=outputs_ready, ready_target=<this launch's blocks>)``, waits for that count instead of for
    this launch's end and sets the words back to zero. Such a dependent launches only once every
    block of this launch has started (whatever dependents_after), so the blocks it waits for are
    all resident. It changes no bit.

    Returns the blocks launched (the count outputs_ready reaches).
    """
    heads = _state_or_pool_heads(state)
    qkv = heads * HEAD_DIM
    conv_dim = 3 * qkv
    rows = 1 if qkv_proj.ndim == 1 else qkv_proj.shape[0]
    if tokens < 1 or rows % tokens:
        raise ValueError(f"tokens = {tokens}: the {rows} rows must be whole sequences of tokens rows")
    sequences = rows // tokens
    kernel_size = _conv_kernel_size(conv_state[0] if conv_state.ndim == 3 else conv_state, conv_w, conv_dim)
    _slot_rows("conv_state", conv_state, (conv_dim, kernel_size), sequences, slots)
    _slot_rows("state", state, (heads, HEAD_DIM, HEAD_DIM), sequences, slots)
    _require("qkv_proj", qkv_proj, "bf16", (rows, conv_dim))
    _require("conv_out", conv_out, "bf16", (rows, conv_dim))
    ld_beta = check_gate_sources(forget_proj, dt_bias, a_log, beta_logits, heads, HEAD_DIM, rows)
    _require("forget_proj", forget_proj, "bf16", (rows, qkv))
    for name, array in (("out_gate", out_gate), ("o_norm_out", o_norm_out)):
        _require(name, array, "bf16", (rows, qkv))
    _require("norm_w", norm_w, "bf16", (HEAD_DIM,))
    for name, array in (("query", query), ("key", key), ("value", value), ("gate", gate), ("core", core)):
        _require(name, array, "f32", (rows, heads, HEAD_DIM))
    _require("beta", beta, "f32", (rows, heads))
    if bounded and not math.isfinite(lower_bound):
        raise ValueError(f"bounded gate needs a finite lower_bound, got {lower_bound}")
    if prefetch_ahead < 0:
        raise ValueError(f"prefetch_ahead must be >= 0, got {prefetch_ahead}")
    if conv_state.data.ptr % 16 or state.data.ptr % 16:
        prefetch_ahead = 0  # the L2 requests take 16-byte aligned ranges; a hint, so none
    if dependents_after not in (0, 1, 2, 3):
        raise ValueError(f"dependents_after must be 0, 1, 2 or 3, got {dependents_after}")
    if dependents_after == 3 and inputs_ready is None:
        raise ValueError("kda_decode_fused_bf16: dependents_after 3 (once past the wait for inputs_ready) needs "
                         "inputs_ready")
    if x_tiles is not None:
        from glm_kda import gemm_rows

        gemm_rows.check_x_tiles(x_tiles, o_norm_out.dtype, rows, qkv, "kda_decode_fused_bf16")
    if inputs_ready is not None:
        _require_words(inputs_ready, "kda_decode_fused_bf16")
        if inputs_target < 1:
            raise ValueError(f"kda_decode_fused_bf16: inputs_target must be >= 1 (the count awaited), got "
                             f"{inputs_target}")
        if dependents_after == 0 and outputs_ready is None:
            raise ValueError("kda_decode_fused_bf16: inputs_ready needs dependents_after 1, 2 or 3, or outputs_ready (the "
                             "next kernel must not launch before every block has its inputs, unless it awaits "
                             "their count of outputs)")
    if outputs_ready is not None:
        _require_words(outputs_ready, "kda_decode_fused_bf16", "outputs_ready")
    staged = staged and state.data.ptr % 16 == 0 and bulk_copies_available()
    split = split and not staged and bulk_copies_available()
    name = "kda_decode_fused_staged_bf16" if staged else "kda_decode_fused_split_bf16" if split else "kda_decode_fused_bf16"
    grid = (heads * HEAD_SPLIT if split else heads, sequences)
    kernels.launch(
        name,
        grid,
        (HEAD_BLOCK,),
        (conv_state, state, slots, qkv_proj, conv_w, forget_proj, dt_bias, a_log, beta_logits, _i32(ld_beta),
         out_gate, norm_w, conv_out, query, key, value, gate, beta, core, o_norm_out, _i32(heads),
         _i32(kernel_size), _i32(tokens), _i32(1 if bounded else 0), _f32(lower_bound if bounded else 0.0), _f32(scale),
         _f32(l2_eps), _f32(norm_eps), _i32(prefetch_ahead), _i32(dependents_after), x_tiles, inputs_ready,
         _i32(inputs_target), outputs_ready),
        HEAD_DIM * HEAD_DIM * 4 if staged else 0,
        carveout=carveout if staged else -1,
        programmatic=inputs_ready is not None,
    )
    return grid[0] * grid[1]


def _require_words(words, what: str, name: str = "inputs_ready") -> None:
    """The check of a pair of awaited words (inputs_ready, outputs_ready): a contiguous int32 array of
    at least 2 elements, else ValueError naming `what` and `name`."""
    from glm_kda import gemm_rows

    gemm_rows.check_scratch(words, numpy.int32, "int32", 2, name, what)


def bulk_copies_available() -> bool:
    """Whether the current device has the bulk copies (the tensor memory accelerator) and the
    thread-block clusters of sm_90 and later, which kda_decode_fused_bf16(staged=True) and
    (split=True) use."""
    import cupy

    return int(cupy.cuda.Device().compute_capability) >= 90
