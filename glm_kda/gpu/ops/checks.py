"""What every launch wrapper checks, and the constants the kernels share.

Each wrapper checks its CuPy arrays' dtype, shape, contiguity and alignment against what its kernel
assumes, and allocates nothing (outputs are caller-owned). BF16 arrays may have dtype ``ml_dtypes.bfloat16``
or ``uint16`` (the raw bits). Arrays with a token axis may hold more rows than the ``tokens`` (or ``rows``)
used; the kernels touch only those.
"""

from __future__ import annotations

import math

import cupy
import ml_dtypes
import numpy

# KDA_HEAD_DIM of the kernels (kernels_src/common/head.cuh): the one head size they are built for.
HEAD_DIM = 128
# KDA_HEAD_BLOCK: threads of every per-head kernel, one per channel.
HEAD_BLOCK = 128
# Largest gridDim.y: kernels with a token grid axis are launched in slices of this.
MAX_GRID_Y = 65535

_F32_DTYPE = numpy.dtype(numpy.float32)
# kind -> (the dtypes an operand of that kind may have, their name): BF16 as its raw bits or as
# ml_dtypes' bfloat16.
_KINDS = {"bf16": ((numpy.dtype(numpy.uint16), numpy.dtype(ml_dtypes.bfloat16)), "BF16 (bfloat16 or uint16 bits)"),
          "f16": ((numpy.dtype(numpy.float16),), "float16"), "f32": ((_F32_DTYPE,), "float32")}
# The kernels take their sizes as int32.
_INT32_MAX = 2**31 - 1
# CONV_MAX_KERNEL of kernels_src/common/conv_window.cuh: the conv taps its registers hold.
_CONV_MAX_KERNEL = 4


def _check_dtype(name: str, array, kind: str) -> None:
    if not isinstance(array, cupy.ndarray):
        raise TypeError(f"{name}: expected a cupy.ndarray, got {type(array).__name__}")
    dtypes, expected = _KINDS[kind]
    if array.dtype not in dtypes:
        raise TypeError(f"{name}: expected {expected}, got {array.dtype}")


def _strip_leading_ones(shape) -> tuple[int, ...]:
    shape = tuple(shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def _require_dense(name: str, array, aligned: bool) -> None:
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    if aligned:
        _require_aligned(name, array)


def _require(name: str, array, kind: str, shape: tuple[int, ...], *, aligned: bool = False) -> None:
    """A contiguous array of exactly `shape` (leading axes of size 1 ignored)."""
    _check_dtype(name, array, kind)
    if _strip_leading_ones(array.shape) != _strip_leading_ones(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(array.shape)}")
    _require_dense(name, array, aligned)


def _require_rows(name: str, array, kind: str, rows: int, row_shape: tuple[int, ...], *, aligned: bool = False) -> None:
    """A contiguous [>= rows, *row_shape] array; the row may also be flattened."""
    _check_dtype(name, array, kind)
    if array.ndim < 2 or array.shape[0] < rows or math.prod(array.shape[1:]) != math.prod(row_shape):
        shape = ", ".join(map(str, row_shape))
        raise ValueError(f"{name}: expected shape [>= {rows}, {shape}], got {list(array.shape)}")
    _require_dense(name, array, aligned)


def _row_stride(name: str, array, kind: str, rows: int, columns: int) -> int:
    """Row stride in elements of a 2-D [>= rows, columns] array with unit column
    stride (a column slice of a wider row-major buffer is fine). A 1-D array is one row."""
    _check_dtype(name, array, kind)
    if array.ndim == 1:
        if rows != 1 or array.shape[0] != columns or array.strides[0] != array.itemsize:
            raise ValueError(f"{name}: expected one contiguous row of {columns}, got {list(array.shape)}")
        return columns
    if array.ndim != 2 or array.shape[0] < rows or array.shape[1] != columns:
        raise ValueError(f"{name}: expected shape [>= {rows}, {columns}], got {list(array.shape)}")
    if array.strides[1] != array.itemsize:
        raise ValueError(f"{name}: columns must be contiguous (stride {array.strides[1]} bytes)")
    stride = array.strides[0] // array.itemsize
    if array.shape[0] > 1 and (array.strides[0] % array.itemsize or stride < columns):
        raise ValueError(f"{name}: row stride {array.strides[0]} bytes overlaps its rows")
    # A single row's stride is not observable; treat it as dense.
    return stride if array.shape[0] > 1 else max(stride, columns)


def _require_aligned(name: str, array, alignment: int = 16) -> None:
    if array.data.ptr % alignment:
        raise ValueError(f"{name}: data pointer must be {alignment}-byte aligned")


def _require_int32(name: str, value: int) -> None:
    if not 0 <= value <= _INT32_MAX:
        raise ValueError(f"{name} = {value} does not fit the kernel's int32")


def _require_head_dim(head_dim: int) -> None:
    if head_dim != HEAD_DIM:
        raise ValueError(f"head_dim must be {HEAD_DIM} (KDA_HEAD_DIM), got {head_dim}")


def _token_slices(tokens: int):
    """[start, end) ranges of at most MAX_GRID_Y tokens (the grid's y axis limit)."""
    for start in range(0, tokens, MAX_GRID_Y):
        yield start, min(tokens, start + MAX_GRID_Y)


# The kernels' int and float scalars.
_i32, _f32 = numpy.int32, numpy.float32


def check_scratch(array, dtype, kind: str, size: int, name: str, what: str) -> None:
    """Raises ValueError, naming `what` and the scratch `name`, unless `array` is a contiguous array of
    `dtype` (called `kind` in the message) with at least `size` elements."""
    if array.dtype != dtype or not array.flags.c_contiguous or array.size < size:
        raise ValueError(f"{what}: {name} must be a contiguous {kind} array of at least {size} elements, "
                         f"got {array.dtype} of {array.size} (contiguous: {array.flags.c_contiguous})")


def conv_kernel_size(conv_state, conv_w, conv_dim: int) -> int:
    """Check one conv state FP32 [conv_dim, K] and its taps BF16 [conv_dim, K] (or the checkpoint's
    [conv_dim, 1, K]) and return K."""
    _check_dtype("conv_state", conv_state, "f32")
    if conv_state.ndim != 2 or conv_state.shape[0] != conv_dim:
        raise ValueError(f"conv_state: expected [{conv_dim}, K], got {list(conv_state.shape)}")
    kernel_size = conv_state.shape[1]
    if not 1 <= kernel_size <= _CONV_MAX_KERNEL:
        raise ValueError(f"conv kernel size must be 1..{_CONV_MAX_KERNEL}, got {kernel_size}")
    _require("conv_state", conv_state, "f32", (conv_dim, kernel_size))
    _check_dtype("conv_w", conv_w, "bf16")
    if tuple(conv_w.shape) not in ((conv_dim, kernel_size), (conv_dim, 1, kernel_size)):
        raise ValueError(f"conv_w: expected [{conv_dim}, {kernel_size}] (conv_state's K), got {list(conv_w.shape)}")
    _require_dense("conv_w", conv_w, False)
    return kernel_size


def projection_args(kernel: str, x, w, out, rows: int | None, max_rows: int) -> tuple[int, int, int, int, int]:
    """Check the operands of a row projection out[r] = x[r] @ w^T and return (rows, n, k,
    ldx, ldy): w [n, k] contiguous and 16-byte aligned with k % 8 == 0; x [>= rows, k] and out
    [>= rows, n] BF16 with row strides (out may be a column slice), x's stride a multiple of 8
    and x 16-byte aligned: every load is one 16-byte vector of 8 BF16."""
    if rows is None:
        rows = 1 if x.ndim == 1 else x.shape[0]
    if not 1 <= rows <= max_rows:
        raise ValueError(f"{kernel}: rows must be 1..{max_rows}, got {rows}")
    packed = getattr(w, "packed_shape", None)
    if packed is not None:
        # A projection.PackedWeight: its array must still be what packing made.
        _require("w.data", w.data, "bf16", packed, aligned=True)
        n, k = w.shape
    else:
        _require("w", w, "bf16", tuple(w.shape), aligned=True)
        if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
            raise ValueError(f"w: expected [n, k] with n, k >= 1, got {list(w.shape)}")
        n, k = w.shape
    if k % 8:
        raise ValueError(f"w: k = {k} must be a multiple of 8 ({kernel} loads 16-byte vectors)")
    ldx = _row_stride("x", x, "bf16", rows, k)
    ldy = _row_stride("out", out, "bf16", rows, n)
    if ldx % 8:
        raise ValueError(f"x: row stride {ldx} must be a multiple of 8 ({kernel} loads 16-byte vectors)")
    _require_aligned("x", x)
    # int32 inside a row; the kernels widen row offsets to size_t.
    for name, value in (("n", n), ("k", k), ("ldx", ldx), ("ldy", ldy)):
        _require_int32(name, value)
    return rows, n, k, ldx, ldy


def recurrent_state_heads(state, *, aligned: bool = False) -> int:
    """Check one sequence's recurrent state, a contiguous FP32 [H, D, D], and return H."""
    _check_dtype("state", state, "f32")
    if state.ndim != 3:
        raise ValueError(f"state: expected [H, {HEAD_DIM}, {HEAD_DIM}], got {list(state.shape)}")
    heads = state.shape[0]
    _require("state", state, "f32", (heads, HEAD_DIM, HEAD_DIM), aligned=aligned)
    return heads


def require_chunk_scratch(q_decay, k_tail, w, u, attn, chunk_decay, tokens: int, chunk: int, heads: int, *,
                          kinds: dict[str, str] | None = None, attn_aligned: bool = False) -> None:
    """The chunk kernels' scratch for T tokens in chunks of `chunk`: q_decay, k_tail, w, u [>= Tp, H, D],
    attn [>= Tp / chunk, H, chunk, chunk], chunk_decay [>= Tp / chunk, H, D], Tp = T rounded up to the chunk.
    kinds: each buffer's dtype kind (default "f32"); every buffer but attn (unless attn_aligned) is read as
    16-byte vectors."""
    kinds = kinds or {}
    nchunks = -(-tokens // chunk)
    for name, array in (("q_decay", q_decay), ("k_tail", k_tail), ("w", w), ("u", u)):
        _require_rows(name, array, kinds.get(name, "f32"), nchunks * chunk, (heads, HEAD_DIM), aligned=True)
    _require_rows("attn", attn, kinds.get("attn", "f32"), nchunks, (heads, chunk, chunk), aligned=attn_aligned)
    _require_rows("chunk_decay", chunk_decay, "f32", nchunks, (heads, HEAD_DIM), aligned=True)


def beta_heads(beta) -> int:
    """H of beta FP32 [>= T, H] (its rows are checked by the caller)."""
    _check_dtype("beta", beta, "f32")
    if beta.ndim != 2:
        raise ValueError(f"beta: expected [>= T, H], got {list(beta.shape)}")
    return beta.shape[1]


def _state_or_pool_heads(state) -> int:
    """H of a recurrent state FP32 [H, D, D] or a pool of them [N, H, D, D] (the dtype and
    rank checked here, the rest by _slot_rows)."""
    _check_dtype("state", state, "f32")
    if state.ndim not in (3, 4):
        raise ValueError(f"state: expected [H, {HEAD_DIM}, {HEAD_DIM}] or [N, H, ...], got {list(state.shape)}")
    return state.shape[-3]


def _slot_rows(name: str, state, per_state: tuple[int, ...], rows: int, slots) -> None:
    """Check a state (one [*per_state]) or a pool ([N, *per_state]) against `rows` rows and
    their `slots` (a device int32 [rows] array, or None: row r uses state r)."""
    _check_dtype(name, state, "f32")
    if tuple(state.shape[-len(per_state):]) != per_state or state.ndim not in (len(per_state), len(per_state) + 1):
        shape = ", ".join(map(str, per_state))
        raise ValueError(f"{name}: expected [{shape}] or [N, ...] of it, got {list(state.shape)}")
    _require_dense(name, state, False)
    count = 1 if state.ndim == len(per_state) else state.shape[0]
    if slots is None:
        if rows > count:
            raise ValueError(f"{name}: {rows} rows but only {count} state(s) and no slots")
        return
    if slots.dtype != numpy.int32 or slots.ndim != 1 or slots.shape[0] < rows or not slots.flags.c_contiguous:
        raise ValueError(f"slots: expected a contiguous int32 device array of >= {rows} entries, got "
                         f"{slots.dtype} {list(slots.shape)}")
