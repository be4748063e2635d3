"""The FP32 chunked delta rule (kernels_src/chunk/chunk.cu): any chunk length up to 64."""

from __future__ import annotations

from .. import build
from .checks import (HEAD_BLOCK, HEAD_DIM, _f32, _i32, _require_int32, _require_rows, beta_heads,
                     recurrent_state_heads, require_chunk_scratch)

# The largest chunk the kernels' shared memory holds (CHUNK_MAX of kernels_src/chunk/chunk.cu).
_CHUNK_MAX = 64
# Value columns of the state per block of the scan (SCAN_COLUMNS), one thread each.
_SCAN_COLUMNS = 32


def chunk_prepare_smem_bytes(chunk: int) -> int:
    """Dynamic shared memory of kda_chunk_prepare_f32: three [C][D + 1] FP32 tiles
    (k, q, cumulative gate), the [C][C] matrix A and beta [C]."""
    return 4 * (3 * chunk * (HEAD_DIM + 1) + chunk * chunk + chunk)


def chunk_count(tokens: int, chunk: int) -> int:
    """nchunks = ceil(T / C); the padded length is nchunks * C."""
    return (tokens + chunk - 1) // chunk


def _require_chunk(chunk: int) -> None:
    if not 1 <= chunk <= _CHUNK_MAX:
        raise ValueError(f"chunk must be 1..{_CHUNK_MAX}, got {chunk}")


def kda_chunk_prepare_f32(query, key, value, gate, beta, q_decay, k_tail, w, u, attn, chunk_decay, tokens: int,
                          chunk: int, scale: float) -> None:
    """Per-chunk WY preparation (intra-chunk work, no state).

    Inputs query, key, value, gate [>= T, H, D] FP32 and beta [>= T, H] FP32; rows
    >= T are never read. Outputs q_decay, k_tail, w, u [>= Tp, H, D], attn
    [nchunks, H, C, C] (the matrix B), chunk_decay [nchunks, H, D], all FP32, with
    Tp = nchunks * C; padded rows are written as zeros.
    """
    _require_chunk(chunk)
    _require_int32("tokens", tokens)
    if tokens == 0:
        return
    heads = beta_heads(beta)
    _require_rows("beta", beta, "f32", tokens, (heads,))
    for name, array in (("query", query), ("key", key), ("value", value), ("gate", gate)):
        _require_rows(name, array, "f32", tokens, (heads, HEAD_DIM))
    require_chunk_scratch(q_decay, k_tail, w, u, attn, chunk_decay, tokens, chunk, heads)
    build.launch("kda_chunk_prepare_f32", (chunk_count(tokens, chunk), heads), (HEAD_BLOCK,),
                 (query, key, value, gate, beta, q_decay, k_tail, w, u, attn, chunk_decay, _i32(tokens), _i32(heads),
                  _i32(chunk), _f32(scale)),
                 shared_mem=chunk_prepare_smem_bytes(chunk))


def kda_chunk_scan_f32(q_decay, k_tail, w, u, attn, chunk_decay, state, core, tokens: int, chunk: int) -> None:
    """The inter-chunk scan: state [H, D, D] FP32 (in place) carried over all chunks,
    core [>= T, H, D] FP32 written for the T real tokens only.

    q_decay, k_tail, w, u [>= Tp, H, D], attn [nchunks, H, C, C] and chunk_decay
    [nchunks, H, D] come from kda_chunk_prepare_f32 with the same tokens and chunk.
    """
    _require_chunk(chunk)
    _require_int32("tokens", tokens)
    if tokens == 0:
        return
    heads = recurrent_state_heads(state)
    require_chunk_scratch(q_decay, k_tail, w, u, attn, chunk_decay, tokens, chunk, heads)
    _require_rows("core", core, "f32", tokens, (heads, HEAD_DIM))
    build.launch("kda_chunk_scan_f32", (heads, HEAD_DIM // _SCAN_COLUMNS), (_SCAN_COLUMNS,),
                 (q_decay, k_tail, w, u, attn, chunk_decay, state, core, _i32(tokens), _i32(heads), _i32(chunk),
                  _i32(chunk_count(tokens, chunk))))
