"""Launch wrappers of the tensor-core chunked prefill (``kernels_src/chunk/chunk_tc.cu``, ``chunk_tc_gate.cu``).

``chunk_prefill_tc`` runs ``kda_chunk_tc_prepare_f32`` (grid (nchunks, H)) then
``kda_chunk_tc_scan_f32`` (grid (H, D / 32)) on the same inputs and outputs as the FP32 pair of
:mod:`glm_kda.gpu.ops.chunk`; :mod:`glm_kda.chunk_model` holds the constants.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ...chunk_model import (CHUNK, PREPARE_SMEM_BYTES, PREPARE_THREADS, SCAN_COLUMNS, SCAN_SMEM_BYTES, SCAN_THREADS,
                            SCRATCH_KINDS, chunk_count, require_lower_bound)
from .. import build
from .checks import (HEAD_DIM, _check_dtype, _f32, _i32, _require, _require_int32, _require_rows, beta_heads,
                     recurrent_state_heads, require_chunk_scratch)
from .gate import check_gate_sources


def _launch(name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int) -> None:
    """build.launch with the largest shared-memory carveout: two scan blocks of 93 KB per SM need more
    than the driver's default split leaves when it is free to favour L1."""
    build.launch(name, grid, block, args, shared_mem=shared_mem, carveout=100)


def _checked_call_needs_work(lower_bound: float | None, tokens: int) -> bool:
    """The checks every prefill call starts with (the bound, tokens); False for zero tokens (nothing
    to launch)."""
    require_lower_bound(lower_bound)
    _require_int32("tokens", tokens)
    return tokens != 0


def _require_scratch(q_decay, k_tail, w, u, attn, chunk_decay, tokens: int, heads: int) -> None:
    # Every scratch access is a 16-, 8- or 4-byte vector, attn's included.
    require_chunk_scratch(q_decay, k_tail, w, u, attn, chunk_decay, tokens, CHUNK, heads, kinds=SCRATCH_KINDS,
                          attn_aligned=True)


class GateSource(NamedTuple):
    """What the forget gate and beta are formed from (as ops.kda_gate_beta_f32 takes them):
    forget_proj [>= T, H*D] BF16, dt_bias [H*D] FP32, a_log [H] FP32, beta_logits [>= T, >= H]
    BF16 (a column slice of a wider buffer is fine)."""

    forget_proj: Any
    dt_bias: Any
    a_log: Any
    beta_logits: Any


def kda_chunk_tc_prepare_f32(query, key, value, gate, beta, q_decay, k_tail, w, u, attn, chunk_decay,
                             tokens: int, lower_bound: float | None, scale: float | None = None,
                             gate_source: GateSource | None = None) -> None:
    """Intra-chunk work of every chunk (no state): grid (nchunks, H), 256 threads.

    lower_bound: the bounded law's bound (-5 <= lower_bound <= 0), or None for gates with no lower
    bound: the unbounded prepare (docs/design.md, "Prefill"; docs/maths.md, "The chunked (WY) form").

    query, key, value, gate [>= T, H, D] and beta [>= T, H] FP32, 16-byte aligned; rows >= T are
    never read. With `gate_source` gate and beta are OUTPUTS, their T rows formed from the
    projections bit for bit as ops.kda_gate_beta_f32 writes them: by the bounded law, or (lower_bound
    None) by the softplus law; gate may then be None (not written).

    Writes the scratch of :func:`scratch_shapes`: q_decay = f16(tf32(scale q exp(G))),
    k_tail = f16(tf32(k exp(G_last - G))) chunk-transposed, w = f16(tf32(W)), u = Uc (FP32),
    attn = f16(tf32(B)) (zero above the diagonal), chunk_decay = exp(G_last) (FP32); padded
    rows zero.
    """
    if not _checked_call_needs_work(lower_bound, tokens):
        return
    heads = beta_heads(beta)
    _require_rows("beta", beta, "f32", tokens, (heads,))
    if gate is None and gate_source is None:
        raise ValueError("kda_chunk_tc_prepare_f32: gate is an input (no gate_source), got None")
    for name, array in (("query", query), ("key", key), ("value", value), ("gate", gate)):
        if array is not None:
            _require_rows(name, array, "f32", tokens, (heads, HEAD_DIM), aligned=True)
    _require_scratch(q_decay, k_tail, w, u, attn, chunk_decay, tokens, heads)
    if scale is None:
        scale = 1.0 / math.sqrt(HEAD_DIM)
    args = (query, key, value, gate, beta, q_decay, k_tail, w, u, attn, chunk_decay,
            _i32(tokens), _i32(heads), _f32(scale), _f32(0.0 if lower_bound is None else lower_bound))
    name = "kda_chunk_tc_prepare_f32" if lower_bound is not None else "kda_chunk_tc_prepare_unbounded_f32"
    if gate_source is not None:
        sources = GateSource(*gate_source)
        ld_beta = check_gate_sources(*sources, heads, HEAD_DIM, tokens)
        name = "kda_chunk_tc_prepare_gate_f32" if lower_bound is not None else "kda_chunk_tc_prepare_unbounded_gate_f32"
        args = (*args, *sources, _i32(ld_beta))
    _launch(name, (chunk_count(tokens), heads), (PREPARE_THREADS,), args, shared_mem=PREPARE_SMEM_BYTES)


def kda_chunk_tc_scan_f32(q_decay, k_tail, w, u, attn, chunk_decay, state, core, tokens: int) -> None:
    """The inter-chunk scan: grid (H, D / 32), 128 threads; state [H, D, D] FP32 in place,
    core [>= T, H, D] FP32 written for the T real tokens only. The scratch comes from
    :func:`kda_chunk_tc_prepare_f32` with the same tokens."""
    _require_int32("tokens", tokens)
    if tokens == 0:
        return
    heads = recurrent_state_heads(state, aligned=True)
    _require_scratch(q_decay, k_tail, w, u, attn, chunk_decay, tokens, heads)
    _require_rows("core", core, "f32", tokens, (heads, HEAD_DIM), aligned=True)
    _launch(
        "kda_chunk_tc_scan_f32",
        (heads, HEAD_DIM // SCAN_COLUMNS),
        (SCAN_THREADS,),
        (q_decay, k_tail, w, u, attn, chunk_decay, state, core, _i32(tokens), _i32(heads)),
        shared_mem=SCAN_SMEM_BYTES,
    )


def chunk_prefill_tc(query, key, value, gate, beta, state, core, tokens: int, lower_bound: float | None,
                     q_decay, k_tail, w, u, attn, chunk_decay, scale: float | None = None,
                     gate_source: GateSource | None = None) -> None:
    """The chunked prefill core on tensor cores: core [>= T, H, D] and the carried state
    [H, D, D] (in place) from query, key, value, gate [>= T, H, D] and beta [>= T, H].

    Scratch (C-contiguous, 16-byte aligned) of :func:`glm_kda.chunk_model.scratch_shapes` and SCRATCH_KINDS:
    the workspace's q_decay_f16, k_tail_f16, chunk_w_f16, chunk_u, attn_f16 and chunk_decay at chunk 64.

    lower_bound and `gate_source` (:class:`GateSource`) as :func:`kda_chunk_tc_prepare_f32` takes
    them. Every argument is checked before the first launch, so a refused call leaves the state untouched.
    """
    if not _checked_call_needs_work(lower_bound, tokens):
        return
    heads = beta_heads(beta)
    _check_dtype("state", state, "f32")
    if tuple(state.shape) != (heads, HEAD_DIM, HEAD_DIM):
        raise ValueError(f"state: expected [{heads}, {HEAD_DIM}, {HEAD_DIM}] (H from beta), got {list(state.shape)}")
    _require("state", state, "f32", (heads, HEAD_DIM, HEAD_DIM), aligned=True)
    _require_rows("core", core, "f32", tokens, (heads, HEAD_DIM), aligned=True)
    _require_scratch(q_decay, k_tail, w, u, attn, chunk_decay, tokens, heads)
    # The gate sources are the prepare's alone: it checks them before its launch.
    kda_chunk_tc_prepare_f32(query, key, value, gate, beta, q_decay, k_tail, w, u, attn, chunk_decay,
                             tokens, lower_bound, scale, gate_source)
    kda_chunk_tc_scan_f32(q_decay, k_tail, w, u, attn, chunk_decay, state, core, tokens)
