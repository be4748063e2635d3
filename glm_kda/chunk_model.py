"""Host side of the tensor-core chunked prefill: its constants and when it applies.

The kernels and their bounded and unbounded prepares: docs/design.md, "Prefill"; tests/chunk_tc_model.py
holds a float64 model of their blocked algorithm.
"""

from __future__ import annotations

import math
from typing import Any

from .state import array_module

HEAD_DIM = 128  # the kernels' head dimension
CHUNK = 64
SUB_CHUNK = 16
# The smallest bounded-law lower bound for which the sub-chunk decay factors stay within
# FP32 range: exp(5 * 15) = 3.7e32 (the argument: docs/maths.md, "The chunked (WY) form").
MIN_LOWER_BOUND = -5.0
# The widest decay across a diagonal block that the unbounded prepare forms by the reference-row products
# (CHUNK_TC_DIAGONAL_RANGE; docs/maths.md, "The chunked (WY) form").
DIAGONAL_RANGE = -MIN_LOWER_BOUND * (SUB_CHUNK - 1)
PREPARE_THREADS = 256
SCAN_THREADS = 128
SCAN_COLUMNS = 32
D_STRIDE = HEAD_DIM + 4
C_STRIDE = CHUNK + 4
# Three reusable units of a [D][C + 4] tile, plus beta [C]: 104,704 bytes, two blocks per SM.
PREPARE_SMEM_BYTES = 4 * (3 * HEAD_DIM * C_STRIDE + CHUNK)
# FP16 row stride (halves) of the scan's W and q_decay tiles.
H_STRIDE = HEAD_DIM + 32
# W and q_decay FP16 [C][D + 32], the TF32 state copy [32][D + 4], U^T [32][C + 4]: 66,560 bytes.
SCAN_SMEM_BYTES = 2 * 2 * CHUNK * H_STRIDE + 4 * (SCAN_COLUMNS * D_STRIDE + SCAN_COLUMNS * C_STRIDE)
# The scratch the scan reads as mma operands is FP16 (TF32 values, which FP16 holds exactly
# in its normal range: docs/kernels.md, "FP16 scratch"); U and the chunk decay stay FP32.
SCRATCH_KINDS = {"q_decay": "f16", "k_tail": "f16", "w": "f16", "u": "f32", "attn": "f16", "chunk_decay": "f32"}


def chunk_tc_supported(config: Any) -> tuple[bool, str]:
    """(usable, reason): whether the tensor-core prefill applies to this KdaConfig: D = 128 and chunk 64
    (any gate law: :func:`prepare_lower_bound` picks the prepare). The device must also grant
    PREPARE_SMEM_BYTES of shared memory a block (docs/design.md, "GPUs without Hopper features").
    """
    if config.head_dim != HEAD_DIM:
        return False, f"head_dim={config.head_dim}: the kernels are compiled for D = {HEAD_DIM}"
    if config.chunk != CHUNK:
        return False, (f"chunk={config.chunk}: the tensor-core path runs chunk {CHUNK} on the workspace's "
                       f"chunk scratch")
    bound = prepare_lower_bound(config)
    if bound is None:
        law = (f"gate law {config.gate_law!r}" if not config.bounded
               else f"bounded law with gate_lower_bound={config.gate_lower_bound} < {MIN_LOWER_BOUND}")
        return True, f"{law}: the unbounded prepare (exact FP32 sums for wide diagonal blocks), chunk {CHUNK}"
    return True, f"bounded law, lower_bound={bound}, chunk {CHUNK}"


def prepare_lower_bound(config: Any) -> float | None:
    """The lower_bound a tensor-core prefill of this KdaConfig passes: the bounded law's
    bound where -5 <= bound <= 0 (the bounded prepare), else None (the unbounded prepare: any gate
    <= 0). Either may form the gate itself, the unbounded one by the softplus law only."""
    if config.bounded and MIN_LOWER_BOUND <= config.gate_lower_bound <= 0.0:
        return float(config.gate_lower_bound)
    return None


def require_lower_bound(lower_bound: float | None) -> None:
    """ValueError unless lower_bound is None (no bound: the unbounded prepare) or the bounded law's
    bound that the tensor-core prefill takes (MIN_LOWER_BOUND <= lower_bound <= 0)."""
    if lower_bound is None:
        return
    try:
        bound = float(lower_bound)
    except (TypeError, ValueError):
        bound = math.nan
    if not MIN_LOWER_BOUND <= bound <= 0.0:
        raise ValueError(
            f"lower_bound = {lower_bound!r}: the tensor-core prefill needs the bounded gate law with "
            f"{MIN_LOWER_BOUND} <= lower_bound <= 0, or lower_bound=None for gates without a bound (the softplus "
            f"law; a bound below {MIN_LOWER_BOUND} is such a gate)"
        )


def chunk_count(tokens: int) -> int:
    """nchunks = ceil(T / 64); the padded length is nchunks * 64."""
    return (tokens + CHUNK - 1) // CHUNK


def scratch_shapes(tokens: int, heads: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the scratch buffers of one call (any larger first dimension is fine; dtypes SCRATCH_KINDS):
    q_decay, k_tail, w, u [Tp, H, D]; attn [nchunks, H, 64, 64]; chunk_decay [nchunks, H, D]. k_tail holds
    [Tp, H, D] elements in the chunk-transposed order [nchunks, H, D, 64].
    """
    nchunks = chunk_count(tokens)
    padded = nchunks * CHUNK
    return {
        "q_decay": (padded, heads, HEAD_DIM),
        "k_tail": (padded, heads, HEAD_DIM),
        "w": (padded, heads, HEAD_DIM),
        "u": (padded, heads, HEAD_DIM),
        "attn": (nchunks, heads, CHUNK, CHUNK),
        "chunk_decay": (nchunks, heads, HEAD_DIM),
    }


def f16_view(buffer: Any) -> Any:
    """An FP16 view of the first half of a C-contiguous FP32 buffer's bytes, of the buffer's
    shape: the workspace keeps one allocation per scratch for both chunk paths."""
    flat = buffer.reshape(-1)
    return flat[: flat.size // 2].view(array_module(buffer).float16).reshape(buffer.shape)


def new_scratch(xp: Any, tokens: int, heads: int, fill: float = 0.0) -> dict[str, Any]:
    """Scratch buffers of :func:`scratch_shapes` and SCRATCH_KINDS, filled with `fill`."""
    dtypes = {"f16": xp.float16, "f32": xp.float32}
    return {name: xp.full(shape, fill, dtypes[SCRATCH_KINDS[name]])
            for name, shape in scratch_shapes(tokens, heads).items()}
