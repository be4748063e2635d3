"""Host side of the tensor-core chunked prefill: its constants, when it applies, and a float64
model of its blocked algorithm, step by step.

The kernels (``kernels_src/chunk/chunk_tc.cu``, launched by :mod:`glm_kda.gpu.ops.chunk_tc`) run
every matrix product of the chunked delta rule on mma.sync TF32 with FP32 accumulation, chunk 64,
sub-chunks of 16; the scratch the scan reads as mma operands is stored as FP16, which holds those
TF32 values exactly in its normal range. The bounded law with lower_bound >= -5 takes the bounded
prepare, which turns the pairwise decays exp(G_t - G_s) into matrix products through one reference
row per sub-chunk; any other gate takes the unbounded prepare, which forms a diagonal block whose
decay leaves that range as exact FP32 sums (docs/maths.md, section 3).

:func:`model_chunk_tc` follows the kernels in float64: the same sub-chunk reference rows, the same
block order of the triangular inverse, TF32 rounding (:func:`round_tf32`, bit-identical to the
kernel's) of exactly the operands the kernels round, and FP16 storage of the scratch. With
``emulate_rounding=False`` it is the exact blocked algorithm and equals
:func:`glm_kda.reference.chunk_scan` to float64 rounding.
"""

from __future__ import annotations

import math
from typing import Any

from .state import array_module

HEAD_DIM = 128  # the kernels' head dimension
CHUNK = 64
SUB_CHUNK = 16
# The smallest bounded-law lower bound for which the sub-chunk decay factors stay within
# FP32 range: exp(5 * 15) = 3.7e32 (the argument is in kernels_src/chunk_tc.cu).
MIN_LOWER_BOUND = -5.0
# The widest decay across a 16-row diagonal block that the unbounded prepare still forms by
# the reference-row products (the bounded law's range, 15 gates of at least -5); wider blocks
# take exact FP32 sums (CHUNK_TC_DIAGONAL_RANGE in the .cu file).
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
# in its normal range: kernels_src/chunk_tc.cu); U and the chunk decay stay FP32.
SCRATCH_KINDS = {"q_decay": "f16", "k_tail": "f16", "w": "f16", "u": "f32", "attn": "f16", "chunk_decay": "f32"}


def chunk_tc_supported(config: Any) -> tuple[bool, str]:
    """(usable, reason): whether the tensor-core prefill applies to this KdaConfig.

    Needs D = 128 and chunk 64 (the workspace's chunk scratch is sized by config.chunk and
    reused as is). The bounded law with -5 <= lower_bound <= 0 takes the bounded prepare;
    any other gate (the softplus law, or a bounded law below -5) takes the unbounded one
    (:func:`prepare_lower_bound`). Otherwise the layer keeps the FP32 path. Device
    requirement (checked at launch): 104,704 bytes of opt-in shared memory per block (sm_80,
    sm_90, sm_100; not sm_86 / sm_89 / sm_120).
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
    bound where -5 <= bound <= 0 (the bounded prepare, which may also form the gate itself),
    else None (the unbounded prepare, fed by the gate kernel: any gate <= 0)."""
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
    """Shapes of the scratch buffers of one call (any larger first dimension is fine); their
    dtypes are SCRATCH_KINDS: q_decay, k_tail, w, attn FP16, u and chunk_decay FP32.

    Shapes as the chunk scratch of ``KdaWorkspace`` at chunk 64: q_decay, k_tail, w
    (workspace ``chunk_w_f16``), u (``chunk_u``) [Tp, H, D]; attn [nchunks, H, 64, 64];
    chunk_decay [nchunks, H, D]. k_tail holds the same number of elements as [Tp, H, D] but
    in the chunk-transposed order [nchunks, H, D, 64].
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


def round_tf32(x: Any) -> Any:
    """x (float64) -> FP32 -> TF32 with round-to-nearest, ties away from zero, as a float64
    array: bit for bit the kernel's round_tf32 of the same FP32 value. Inf and NaN pass."""
    xp = array_module(x)
    bits = xp.asarray(x, dtype=xp.float32).view(xp.uint32)
    special = (bits & xp.uint32(0x7F800000)) == xp.uint32(0x7F800000)
    rounded = xp.where(special, bits, (bits + xp.uint32(0x1000)) & xp.uint32(0xFFFFE000))
    return rounded.view(xp.float32).astype(xp.float64)


def round_f16(x: Any) -> Any:
    """x (float64) -> FP32 -> FP16 (nearest even, subnormals kept, overflow to inf) as float64."""
    xp = array_module(x)
    return xp.asarray(x, dtype=xp.float32).astype(xp.float16).astype(xp.float64)


def _round_f16_of_tf32(x: Any) -> Any:
    return round_f16(round_tf32(x))


def _exact(x: Any) -> Any:
    return array_module(x).asarray(x, dtype=array_module(x).float64)


def _blocks(matrix: Any, i: int, j: int) -> Any:
    """Sub-chunk block (i, j) of [..., C, C] (a view)."""
    return matrix[..., SUB_CHUNK * i : SUB_CHUNK * (i + 1), SUB_CHUNK * j : SUB_CHUNK * (j + 1)]


def diagonal_in_range(cumgate: Any, i: int) -> Any:
    """[nchunks, H] bool: whether diagonal block i of each chunk may take the reference-row
    products in the unbounded prepare: G_r - G_last <= DIAGONAL_RANGE in every channel, r and
    last its first and last rows, as the kernel's FP32 difference (a NaN is out of range).
    cumgate [nchunks, H, 64, D], the chunk's cumulative (FP32) gate."""
    xp = array_module(cumgate)
    first_row = cumgate[:, :, SUB_CHUNK * i, :].astype(xp.float32)
    last_row = cumgate[:, :, SUB_CHUNK * (i + 1) - 1, :].astype(xp.float32)
    return ((first_row - last_row) <= DIAGONAL_RANGE).all(-1)


def model_chunk_tc_prepare(query, key, value, gate, beta, lower_bound: float | None, scale: float | None = None,
                           emulate_rounding: bool = True, pad_value: float = 0.0) -> dict[str, Any]:
    """kda_chunk_tc_prepare_f32 in float64: the scratch it writes, in its layouts
    (see :func:`scratch_shapes`; k_tail as [nchunks, H, D, 64]).

    The inputs are padded to a multiple of 64 rows with `pad_value` and the padding is then
    replaced BY INDEX (q = k = v = 0, g = 0, beta = 0) before any arithmetic, as the kernel
    never reads those rows. lower_bound None: the unbounded prepare (a diagonal block of A and B
    wider than DIAGONAL_RANGE as exact sums, see :func:`diagonal_in_range`; the gate only
    capped at 0).
    """
    require_lower_bound(lower_bound)
    xp = array_module(query)
    rnd = round_tf32 if emulate_rounding else _exact
    # The scratch the scan reads as mma operands is stored FP16 (exact for TF32 values in
    # FP16's normal range; rounded to nearest even below it, as cvt.rn.f16.f32 does).
    stored = _round_f16_of_tf32 if emulate_rounding else _exact
    # The kernel's cumulative gate is an FP32 running sum and every exponent argument an FP32
    # difference; emulated, because their FP32 error (1e-5 relative in exp at |G| ~ 300)
    # would otherwise flip many TF32 roundings between kernel and model.
    gate_dtype = xp.float32 if emulate_rounding else xp.float64

    def exp_of_difference(a, b):
        return xp.exp((a.astype(gate_dtype) - b.astype(gate_dtype)).astype(xp.float64))

    tokens, heads, dim = query.shape
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    nchunks = chunk_count(tokens)
    padded = nchunks * CHUNK
    valid = xp.arange(padded) < tokens

    def chunked(x):
        # [T, H, ...] -> [nchunks, H, C, ...], padding zero by index.
        full = xp.full((padded,) + x.shape[1:], pad_value, dtype=xp.float64)
        full[:tokens] = x
        full = xp.where(valid.reshape((padded,) + (1,) * (x.ndim - 1)), full, 0.0)
        full = full.reshape((nchunks, CHUNK) + x.shape[1:])
        return xp.moveaxis(full, 1, 2)

    q, k, v, g = (chunked(x) for x in (query, key, value, gate))
    b = chunked(beta)  # [nchunks, H, C]
    # The kernel's clamp to [lower_bound, 0]: the identity on the bounded law's gates.
    g = xp.where(g > 0.0, 0.0, g)
    if lower_bound is not None:
        g = xp.where(g < lower_bound, lower_bound, g)
    # G_t = G_{t-1} + g_t in row order, as the kernel sums (CuPy's cumsum is a parallel scan).
    cumgate = g.astype(gate_dtype)
    for t in range(1, CHUNK):
        cumgate[:, :, t] += cumgate[:, :, t - 1]
    cumgate = cumgate.astype(xp.float64)
    last = cumgate[:, :, -1:, :]

    # 1. Elementwise outputs.
    q_decay = stored(scale * q * xp.exp(cumgate))
    k_tail = stored(k * exp_of_difference(last, cumgate))
    chunk_decay = xp.exp(last[:, :, 0, :])

    # 2. A and B by row block i, reference row 16 i (range argument in the .cu file).
    pair_kk = xp.zeros((nchunks, heads, CHUNK, CHUNK))
    pair_qk = xp.zeros((nchunks, heads, CHUNK, CHUNK))
    for i in range(CHUNK // SUB_CHUNK):
        rows = slice(SUB_CHUNK * i, SUB_CHUNK * (i + 1))
        columns = slice(0, SUB_CHUNK * (i + 1))
        reference = cumgate[:, :, SUB_CHUNK * i : SUB_CHUNK * i + 1, :]
        factor = exp_of_difference(cumgate[:, :, rows], reference)
        key_row = rnd(k[:, :, rows] * factor)
        query_row = rnd(q[:, :, rows] * factor)
        source_exponent = (reference.astype(gate_dtype) - cumgate[:, :, columns].astype(gate_dtype)).astype(xp.float64)
        if lower_bound is None:
            # Only a diagonal block wider than DIAGONAL_RANGE reaches the cap (the earlier
            # columns' exponents are <= 0), and its products are replaced below.
            source_exponent = xp.minimum(source_exponent, DIAGONAL_RANGE)
        key_source = rnd(k[:, :, columns] * xp.exp(source_exponent))
        pair_kk[:, :, rows, columns] = key_row @ xp.swapaxes(key_source, -1, -2)
        pair_qk[:, :, rows, columns] = query_row @ xp.swapaxes(key_source, -1, -2)
        if lower_bound is None:
            # The unbounded prepare's diagonal block where its decay exceeds DIAGONAL_RANGE:
            # sum_d x_t k_s exp(G_t - G_s) with no TF32 operands.
            in_range = diagonal_in_range(cumgate, i)[..., None, None]
            decayed = k[:, :, None, rows] * exp_of_difference(cumgate[:, :, rows, None], cumgate[:, :, None, rows])
            for pair, x in ((pair_kk, k), (pair_qk, q)):
                pair[:, :, rows, rows] = xp.where(in_range, pair[:, :, rows, rows], (x[:, :, rows, None] * decayed).sum(-1))
    position = xp.arange(CHUNK)
    strict = position[:, None] > position[None, :]
    inclusive = position[:, None] >= position[None, :]
    lower = xp.where(strict, b[..., :, None] * pair_kk, 0.0)
    attn = stored(xp.where(inclusive, scale * pair_qk, 0.0))

    # 3. T = (I + L)^-1: exact diagonal blocks (the kernel's FP32 forward substitution),
    # then the blocks below the diagonal in waves of distance 1, 2, 3.
    inverse = xp.zeros((nchunks, heads, CHUNK, CHUNK))
    eye = xp.eye(SUB_CHUNK)
    subs = CHUNK // SUB_CHUNK
    for i in range(subs):
        _blocks(inverse, i, i)[...] = xp.linalg.inv(eye + _blocks(lower, i, i))
    for distance in range(1, subs):
        for i in range(distance, subs):
            j = i - distance
            total = sum(rnd(_blocks(lower, i, k_)) @ rnd(_blocks(inverse, k_, j)) for k_ in range(j, i))
            _blocks(inverse, i, j)[...] = -(rnd(_blocks(inverse, i, i)) @ rnd(total))

    # 4. W and Uc.
    key_beta = rnd(b[..., None] * k * xp.exp(cumgate))
    value_beta = rnd(b[..., None] * v)
    w = stored(rnd(inverse) @ key_beta)
    u = rnd(inverse) @ value_beta

    def rows_major(x):  # [nchunks, H, C, D] -> [Tp, H, D]
        return xp.moveaxis(x, 2, 1).reshape(padded, heads, dim)

    return {
        "q_decay": rows_major(q_decay),
        "k_tail": xp.swapaxes(k_tail, -1, -2).copy(),  # [nchunks, H, D, C]
        "w": rows_major(w),
        "u": rows_major(u),
        "attn": attn,
        "chunk_decay": chunk_decay,
    }


def model_chunk_tc_scan(scratch: dict[str, Any], recurrent: Any, tokens: int,
                        emulate_rounding: bool = True) -> tuple[Any, Any]:
    """kda_chunk_tc_scan_f32 in float64 on a prepare's scratch (the model's or a kernel's,
    host or device arrays): returns (core [T, H, D], state [H, D, D])."""
    rnd = round_tf32 if emulate_rounding else _exact
    q_decay = _exact(scratch["q_decay"])
    xp = array_module(q_decay)
    k_tail, w, u = (_exact(scratch[name]) for name in ("k_tail", "w", "u"))
    attn, chunk_decay = _exact(scratch["attn"]), _exact(scratch["chunk_decay"])
    heads, dim = recurrent.shape[0], recurrent.shape[1]
    nchunks = chunk_count(tokens)
    k_tail = k_tail.reshape(-1)[: nchunks * heads * dim * CHUNK].reshape(nchunks, heads, dim, CHUNK)
    state = xp.asarray(recurrent, dtype=xp.float64).copy()
    core = xp.zeros((nchunks * CHUNK, heads, dim))
    position = xp.arange(CHUNK)
    for n in range(nchunks):
        rows = slice(n * CHUNK, (n + 1) * CHUNK)
        valid = (position < tokens - n * CHUNK)[None, :, None]
        state_operand = rnd(state)
        w_chunk, u_chunk, q_chunk = (xp.swapaxes(x[rows], 0, 1) for x in (w, u, q_decay))  # [H, C, D]
        new_value = xp.where(valid, u_chunk - w_chunk @ state_operand, 0.0)
        new_value_operand = rnd(new_value)
        out = q_chunk @ state_operand + attn[n] @ new_value_operand
        state = chunk_decay[n][:, :, None] * state + k_tail[n] @ new_value_operand
        core[rows] = xp.swapaxes(out, 0, 1)
    return core[:tokens], state


def model_chunk_tc(query, key, value, gate, beta, recurrent, lower_bound: float | None, scale: float | None = None,
                   emulate_rounding: bool = True, pad_value: float = 0.0) -> tuple[Any, Any]:
    """The whole tensor-core prefill in float64: (core [T, H, D], state [H, D, D]).

    query, key, value, gate [T, H, D], beta [T, H], recurrent [H, D, D] (NumPy, or CuPy to
    run on a GPU). With emulate_rounding=False, equal to reference.chunk_scan(..., chunk=64) up
    to float64 rounding (for gates inside [lower_bound, 0]; lower_bound None: any gate <= 0).
    """
    scratch = model_chunk_tc_prepare(query, key, value, gate, beta, lower_bound, scale, emulate_rounding, pad_value)
    return model_chunk_tc_scan(scratch, recurrent, query.shape[0], emulate_rounding)


__all__ = [
    "CHUNK", "MIN_LOWER_BOUND", "PREPARE_SMEM_BYTES", "SCAN_SMEM_BYTES", "chunk_count", "chunk_tc_supported",
    "prepare_lower_bound", "require_lower_bound", "diagonal_in_range", "DIAGONAL_RANGE", "model_chunk_tc",
    "model_chunk_tc_prepare", "model_chunk_tc_scan", "round_tf32", "round_f16", "scratch_shapes", "SCRATCH_KINDS",
    "f16_view", "new_scratch",
]
