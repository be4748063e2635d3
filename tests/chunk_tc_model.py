"""A float64 model of the tensor-core chunk kernels (kernels_src/chunk/chunk_tc.cu), step by step:
the same sub-chunk reference rows, the same block order of the triangular inverse, TF32 rounding
(round_tf32, bit-identical to the kernel's) of exactly the operands the kernels round, and FP16
storage of the scratch. With emulate_rounding=False it is the exact blocked algorithm and equals
glm_kda.reference.chunk_scan to float64 rounding. Test infrastructure: the library never runs it."""

from __future__ import annotations

import math
from typing import Any

from glm_kda.chunk_model import (CHUNK, DIAGONAL_RANGE, SUB_CHUNK, chunk_count,
                                 require_lower_bound)
from glm_kda.state import array_module


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

    def exp_factor(x):
        # The kernel's e^x of a factor it rounds to TF32 (exp_tf32_factor): ex2 of the FP32 product
        # x log2(e), whose rounding (3e-6 relative at e^75) would otherwise flip TF32 roundings too.
        if not emulate_rounding:
            return xp.exp(x)
        return xp.exp2((xp.asarray(x, xp.float32) * xp.float32(math.log2(math.e))).astype(xp.float64))

    def difference(a, b):
        return (a.astype(gate_dtype) - b.astype(gate_dtype)).astype(xp.float64)

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
    q_decay = stored(scale * q * exp_factor(cumgate))
    k_tail = stored(k * exp_factor(difference(last, cumgate)))
    chunk_decay = xp.exp(last[:, :, 0, :])

    # 2. A and B by row block i, reference row 16 i (range argument in the .cu file).
    pair_kk = xp.zeros((nchunks, heads, CHUNK, CHUNK))
    pair_qk = xp.zeros((nchunks, heads, CHUNK, CHUNK))
    for i in range(CHUNK // SUB_CHUNK):
        rows = slice(SUB_CHUNK * i, SUB_CHUNK * (i + 1))
        columns = slice(0, SUB_CHUNK * (i + 1))
        reference = cumgate[:, :, SUB_CHUNK * i : SUB_CHUNK * i + 1, :]
        factor = exp_factor(difference(cumgate[:, :, rows], reference))
        key_row = rnd(k[:, :, rows] * factor)
        query_row = rnd(q[:, :, rows] * factor)
        source_exponent = difference(reference, cumgate[:, :, columns])
        if lower_bound is None:
            # Only a diagonal block wider than DIAGONAL_RANGE reaches the cap (the earlier
            # columns' exponents are <= 0), and its products are replaced below.
            source_exponent = xp.minimum(source_exponent, DIAGONAL_RANGE)
        key_source = rnd(k[:, :, columns] * exp_factor(source_exponent))
        pair_kk[:, :, rows, columns] = key_row @ xp.swapaxes(key_source, -1, -2)
        pair_qk[:, :, rows, columns] = query_row @ xp.swapaxes(key_source, -1, -2)
        if lower_bound is None:
            # The unbounded prepare's diagonal block where its decay exceeds DIAGONAL_RANGE:
            # sum_d x_t k_s exp(G_t - G_s) with no TF32 operands.
            in_range = diagonal_in_range(cumgate, i)[..., None, None]
            decayed = k[:, :, None, rows] * xp.exp(difference(cumgate[:, :, rows, None], cumgate[:, :, None, rows]))
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
    key_beta = rnd(b[..., None] * k * exp_factor(cumgate))
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
