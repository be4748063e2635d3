"""Thin launch wrappers, one per kernel, named after the kernel they launch.

Each wrapper takes cupy arrays, checks dtype, shape, contiguity and alignment
against what its kernel assumes, computes the grid and hands everything to
:func:`glm_kda.kernels.launch` (ints as numpy.int32, floats as numpy.float32).
Nothing here allocates: outputs are caller-owned buffers, so one workspace can be
reused across layers and its stages compared one by one.

BF16 arrays may have dtype ``ml_dtypes.bfloat16`` or ``uint16`` (the raw bits);
both are passed to the kernels as the same pointer.

Where a wrapper takes ``tokens`` (or ``rows``), arrays with a token axis may hold more
rows than are used (a workspace sized for the longest prompt): it defaults to the first
dimension of the main input, and the kernels touch only the first ``tokens`` rows. The
decode-side wrappers without it (the decode conv, the recurrent and the fused step) take
exactly [rows, ...]; each docstring gives its shapes.
"""

from __future__ import annotations

import functools
import math

import cupy
import ml_dtypes
import numpy

from glm_kda import kernels

HEAD_DIM = 128  # KDA_HEAD_DIM of kernels_src/kda_common.cuh
HEAD_BLOCK = 128  # threads of every per-head kernel, one per channel
HEAD_SPLIT = 4  # KDA_HEAD_SPLIT of kernels_src/decode_step.cuh: blocks of a split head
TOKENS_PER_BLOCK = 8  # tokens per block of the norm kernel (KDA_TOKENS_PER_BLOCK)
GATE_TOKENS_PER_BLOCK = 32  # tokens per block of the gate kernel (kernels_src/gate.cu)
GATE_THREADS = 128
GEMV_MAX_ROWS = 16
GEMV_WARPS_PER_BLOCK = 8
CONV_MAX_KERNEL = 4
CONV_PREFILL_TILE = 64  # tokens per block of conv_prefill_silu_l2_bf16 (kernels_src/conv.cu)
CONV_PREFILL_HEADS_PER_BLOCK = 4  # heads of q, k or v per block of it: one per warp
RECURRENT_COLUMNS = 32
CHUNK_MAX = 64
# Largest gridDim.y: kernels with a token grid axis are launched in slices of this.
MAX_GRID_Y = 65535
# cudaDataType CUDA_R_16BF and CUDA_R_32F (library_types.h); cupy's cublas module does not export them.
CUDA_R_16BF = 14
CUDA_R_32F = 0

_BF16_DTYPES = (numpy.dtype(numpy.uint16), numpy.dtype(ml_dtypes.bfloat16))
_F32_DTYPE = numpy.dtype(numpy.float32)
_INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------


def _check_dtype(name: str, array, kind: str) -> None:
    if not isinstance(array, cupy.ndarray):
        raise TypeError(f"{name}: expected a cupy.ndarray, got {type(array).__name__}")
    if kind == "bf16":
        if array.dtype not in _BF16_DTYPES:
            raise TypeError(f"{name}: expected BF16 (bfloat16 or uint16 bits), got {array.dtype}")
    elif kind == "f16":
        if array.dtype != numpy.dtype(numpy.float16):
            raise TypeError(f"{name}: expected float16, got {array.dtype}")
    elif array.dtype != _F32_DTYPE:
        raise TypeError(f"{name}: expected float32, got {array.dtype}")


def _strip_leading_ones(shape) -> tuple[int, ...]:
    shape = tuple(shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def _require(name: str, array, kind: str, shape: tuple[int, ...], *, aligned: bool = False) -> None:
    """A contiguous array of exactly `shape` (leading axes of size 1 ignored)."""
    _check_dtype(name, array, kind)
    if _strip_leading_ones(array.shape) != _strip_leading_ones(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(array.shape)}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    if aligned:
        _require_aligned(name, array)


def _require_rows(
    name: str, array, kind: str, rows: int, row_shape: tuple[int, ...], *, aligned: bool = False
) -> None:
    """A contiguous [>= rows, *row_shape] array; the row may also be flattened."""
    _check_dtype(name, array, kind)
    row_elements = math.prod(row_shape)
    if (
        array.ndim < 2
        or array.shape[0] < rows
        or math.prod(array.shape[1:]) != row_elements
    ):
        raise ValueError(
            f"{name}: expected shape [>= {rows}, {', '.join(map(str, row_shape))}], "
            f"got {list(array.shape)}"
        )
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    if aligned:
        _require_aligned(name, array)


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


def _i32(value) -> numpy.int32:
    return numpy.int32(value)


def _f32(value) -> numpy.float32:
    return numpy.float32(value)


# --------------------------------------------------------------------------------------
# 1. Projections
# --------------------------------------------------------------------------------------


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
        # A gemm_rows.PackedWeight: its array must still be what packing made.
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


def gemv_bf16(x, w, out, rows: int | None = None) -> None:
    """out[r, :] = bf16(x[r, :] @ w.T) for r < rows (1..16), FP32 accumulation.

    x [>= rows, k] BF16 (row stride a multiple of 8, 16-byte aligned), w [n, k]
    BF16 torch Linear layout, out [>= rows, n] BF16 (may be a column slice of a
    wider buffer). Row r's bits do not depend on `rows`: a 16-row verify equals
    16 one-row decodes.
    """
    rows, n, k, ldx, ldy = projection_args("gemv_bf16", x, w, out, rows, GEMV_MAX_ROWS)
    grid = ((n + GEMV_WARPS_PER_BLOCK - 1) // GEMV_WARPS_PER_BLOCK,)
    kernels.launch(
        "gemv_bf16",
        grid,
        (GEMV_WARPS_PER_BLOCK * 32,),
        (x, _i32(ldx), w, out, _i32(ldy), _i32(rows), _i32(n), _i32(k)),
    )


def gemm_bf16_cublas(x, w, out) -> None:
    """out[T, n] = bf16(x[T, k] @ w[n, k]^T) through cuBLAS, BF16 in/out, FP32 compute; a
    float32 `out` receives the FP32 result unrounded (a tensor-parallel rank's partial output).

    For prefill widths (T > 16). Reassociates differently from gemv_bf16, so it is
    never used where decode bits must be reproduced. x and out may be row slices
    or column slices of wider row-major buffers: their row strides are passed.

    cuBLAS is column-major. A row-major [R, C] matrix with row stride ld is the
    column-major [C, R] matrix with leading dimension ld, so the row-major
    out = x w^T is computed as the column-major out^T = w^T-op(...) product
        out^T [n, T] = op_T(W) [n, k] * X [k, T]
    where W is w read column-major ([k, n], ld = k, transposed by OP_T) and X is
    x read column-major ([k, T], ld = ldx, OP_N); C = out^T, ldc = ldo.
    """
    from cupy.cuda import cublas  # loading cuBLAS needs the library; not at import

    _require("w", w, "bf16", tuple(w.shape))
    if w.ndim != 2 or x.ndim != 2 or out.ndim != 2:
        raise ValueError("gemm_bf16_cublas: x [T, k], w [n, k] and out [T, n] must be 2-D")
    n, k = w.shape
    tokens = x.shape[0]
    ldx = _row_stride("x", x, "bf16", tokens, k)
    out_f32 = isinstance(out, cupy.ndarray) and out.dtype == _F32_DTYPE
    ldo = _row_stride("out", out, "f32" if out_f32 else "bf16", tokens, n)
    if out.shape[0] != tokens:
        raise ValueError(f"out: expected {tokens} rows like x, got {out.shape[0]}")
    if tokens == 0 or n == 0:
        return
    for name, value in (("T", tokens), ("n", n), ("k", k), ("ldx", ldx), ("ldo", ldo)):
        _require_int32(name, value)

    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    # Host scalars, FP32 because the compute type is CUBLAS_COMPUTE_32F.
    alpha = numpy.array(1.0, dtype=numpy.float32)
    beta = numpy.array(0.0, dtype=numpy.float32)
    pointer_mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        cublas.gemmEx(
            handle,
            cublas.CUBLAS_OP_T,  # op(A): W column-major [k, n] -> [n, k]
            cublas.CUBLAS_OP_N,  # op(B): X column-major [k, T]
            n,  # m: rows of C = out^T
            tokens,  # n: columns of C
            k,  # k: the reduction
            alpha.ctypes.data,
            w.data.ptr,
            CUDA_R_16BF,
            k,  # lda >= k: A is stored [k, n]
            x.data.ptr,
            CUDA_R_16BF,
            ldx,  # ldb >= k: B is stored [k, T] with x's row stride
            beta.ctypes.data,
            out.data.ptr,
            CUDA_R_32F if out_f32 else CUDA_R_16BF,
            ldo,  # ldc >= n: C is stored [n, T] with out's row stride
            cublas.CUBLAS_COMPUTE_32F,
            cublas.CUBLAS_GEMM_DEFAULT,
        )
    finally:
        cublas.setPointerMode(handle, pointer_mode)


# FP32 -> BF16 bits, round to nearest, ties to even, as ml_dtypes and __float2bfloat16_rn do; NaN stays
# a quiet NaN and values past the BF16 range round to inf. Plain bit arithmetic needs no cuda_bf16.h.
BF16_ROUND_SOURCE = r"""
__device__ __forceinline__ unsigned short kda_float_to_bf16_bits(float value) {
    unsigned int bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((bits >> 16) | 0x0040u);
    }
    return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
"""


@functools.lru_cache(maxsize=None)
def _round_kernel() -> cupy.ElementwiseKernel:
    return cupy.ElementwiseKernel("float32 value", "uint16 bits", "bits = kda_float_to_bf16_bits(value)",
                                  "kda_round_f32_bf16", preamble=BF16_ROUND_SOURCE)


def round_to_bf16(values, out) -> None:
    """out = values rounded to BF16 (nearest even): values FP32 and out BF16 of one shape, each
    C-contiguous (rows of a wider buffer are fine). What the projections do to their FP32 sums."""
    _require("values", values, "f32", tuple(values.shape))
    _require("out", out, "bf16", tuple(values.shape))
    _round_kernel()(values, out.view(numpy.uint16))


# --------------------------------------------------------------------------------------
# 2. Conv + SiLU, L2
# --------------------------------------------------------------------------------------


def _conv_kernel_size(conv_state, conv_w, conv_dim: int) -> int:
    _check_dtype("conv_state", conv_state, "f32")
    if conv_state.ndim != 2 or conv_state.shape[0] != conv_dim:
        raise ValueError(f"conv_state: expected [{conv_dim}, K], got {list(conv_state.shape)}")
    kernel_size = conv_state.shape[1]
    if not 1 <= kernel_size <= CONV_MAX_KERNEL:
        raise ValueError(f"conv kernel size must be 1..{CONV_MAX_KERNEL}, got {kernel_size}")
    _require("conv_state", conv_state, "f32", (conv_dim, kernel_size))
    _check_dtype("conv_w", conv_w, "bf16")
    # [conv_dim, K] or the checkpoint's [conv_dim, 1, K]: the same bytes.
    if tuple(conv_w.shape) not in ((conv_dim, kernel_size), (conv_dim, 1, kernel_size)):
        raise ValueError(
            f"conv_w: expected [{conv_dim}, {kernel_size}] (conv_state's K), got {list(conv_w.shape)}"
        )
    if not conv_w.flags.c_contiguous:
        raise ValueError("conv_w: must be C-contiguous")
    return kernel_size


def recurrent_state_heads(state, *, aligned: bool = False) -> int:
    """Check one sequence's recurrent state, a contiguous FP32 [H, D, D], and return H."""
    _check_dtype("state", state, "f32")
    if state.ndim != 3:
        raise ValueError(f"state: expected [H, {HEAD_DIM}, {HEAD_DIM}], got {list(state.shape)}")
    heads = state.shape[0]
    _require("state", state, "f32", (heads, HEAD_DIM, HEAD_DIM), aligned=aligned)
    return heads


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
        raise ValueError(f"{name}: expected [{', '.join(map(str, per_state))}] or [N, ...] of it, got {list(state.shape)}")
    if not state.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    count = 1 if state.ndim == len(per_state) else state.shape[0]
    if slots is None:
        if rows > count:
            raise ValueError(f"{name}: {rows} rows but only {count} state(s) and no slots")
        return
    if slots.dtype != numpy.int32 or slots.ndim != 1 or slots.shape[0] < rows or not slots.flags.c_contiguous:
        raise ValueError(f"slots: expected a contiguous int32 device array of >= {rows} entries, got "
                         f"{slots.dtype} {list(slots.shape)}")


def conv_decode_silu_l2_bf16(
    conv_state, qkv_proj, conv_w, conv_out, query, key, value, heads: int, head_dim: int, l2_eps: float,
    slots=None,
) -> None:
    """One decode token of each of `rows` sequences: conv + SiLU (conv states updated in
    place), then L2 of q, k.

    conv_state [3*H*D, K] FP32 (one sequence) or a pool [N, 3*H*D, K]; qkv_proj
    [rows, 3*H*D] (or [3*H*D]) BF16; conv_w [3*H*D, K] BF16; conv_out like qkv_proj;
    query, key (normalised) and value [rows, H, D] (or [H, D]) FP32. Row r uses state
    slots[r] (device int32) or, without slots, state r.
    """
    _require_head_dim(head_dim)
    conv_dim = 3 * heads * head_dim
    kernel_size = _conv_kernel_size(conv_state[0] if conv_state.ndim == 3 else conv_state, conv_w, conv_dim)
    rows = 1 if qkv_proj.ndim == 1 else qkv_proj.shape[0]
    _slot_rows("conv_state", conv_state, (conv_dim, kernel_size), rows, slots)
    _require("qkv_proj", qkv_proj, "bf16", (rows, conv_dim))
    _require("conv_out", conv_out, "bf16", (rows, conv_dim))
    for name, array in (("query", query), ("key", key), ("value", value)):
        _require(name, array, "f32", (rows, heads, head_dim))
    kernels.launch(
        "conv_decode_silu_l2_bf16",
        (3 * heads, rows),
        (HEAD_BLOCK,),
        (conv_state, slots, qkv_proj, conv_w, conv_out, query, key, value,
         _i32(heads), _i32(head_dim), _i32(kernel_size), _f32(l2_eps)),
    )


def conv_prefill_silu_l2_bf16(
    conv_state, qkv_proj, conv_w, conv_out, query, key, value, heads: int, head_dim: int, l2_eps: float,
    tokens: int | None = None,
) -> None:
    """T tokens of conv + SiLU + L2 + split in one pass, leaving conv_state as T decode steps would.

    conv_state [conv_dim, K] FP32 (in place), qkv_proj [>= T, conv_dim] BF16, conv_w
    [conv_dim, K] BF16; writes conv_out [>= T, conv_dim] BF16 and query, key (L2-normalised
    per head), value [>= T, H, D] FP32, conv_dim = 3 * H * D; qkv_proj, conv_out, query, key
    and value 16-byte aligned (vector loads and stores). Grid (ceil(3H / 4), ceil(T / 64)),
    one warp per head of q, k or v and tile of tokens.
    """
    _require_head_dim(head_dim)
    _check_dtype("conv_state", conv_state, "f32")
    conv_dim = 3 * heads * head_dim
    kernel_size = _conv_kernel_size(conv_state, conv_w, conv_dim)
    if tokens is None:
        tokens = qkv_proj.shape[0]
    _require_rows("qkv_proj", qkv_proj, "bf16", tokens, (conv_dim,), aligned=True)
    _require_rows("conv_out", conv_out, "bf16", tokens, (conv_dim,), aligned=True)
    for name, array in (("query", query), ("key", key), ("value", value)):
        _require_rows(name, array, "f32", tokens, (heads, head_dim), aligned=True)
    _require_int32("tokens", tokens)
    if tokens == 0:
        return
    kernels.launch(
        "conv_prefill_silu_l2_bf16",
        (-(-3 * heads // CONV_PREFILL_HEADS_PER_BLOCK), -(-tokens // CONV_PREFILL_TILE)),
        (HEAD_BLOCK,),
        (conv_state, qkv_proj, conv_w, conv_out, query, key, value, _i32(heads), _i32(head_dim),
         _i32(kernel_size), _i32(tokens), _f32(l2_eps)),
    )


# --------------------------------------------------------------------------------------
# 3. Forget gate and beta
# --------------------------------------------------------------------------------------


def check_gate_sources(forget_proj, dt_bias, a_log, beta_logits, heads: int, head_dim: int, tokens: int) -> int:
    """Checks the forget gate's and beta's sources (see :func:`gate_beta_f32`) for `tokens`
    rows (forget_proj 16-byte aligned: both readers load it in vectors); returns the beta
    logits' row stride in elements."""
    qkv = heads * head_dim
    _require_rows("forget_proj", forget_proj, "bf16", tokens, (qkv,), aligned=True)
    _check_dtype("dt_bias", dt_bias, "f32")
    if dt_bias.size != qkv or not dt_bias.flags.c_contiguous:
        raise ValueError(f"dt_bias: expected {qkv} contiguous values (per channel), got {list(dt_bias.shape)}")
    _check_dtype("a_log", a_log, "f32")
    if a_log.size != heads or not a_log.flags.c_contiguous:
        raise ValueError(f"a_log: expected {heads} contiguous values (per head), got {list(a_log.shape)}")
    _check_dtype("beta_logits", beta_logits, "bf16")
    if beta_logits.ndim != 2 or beta_logits.shape[0] < tokens or beta_logits.shape[1] < heads:
        raise ValueError(f"beta_logits: expected [>= {tokens}, >= {heads}], got {list(beta_logits.shape)}")
    return _row_stride("beta_logits", beta_logits, "bf16", tokens, beta_logits.shape[1])


def gate_beta_f32(
    forget_proj,
    dt_bias,
    a_log,
    beta_logits,
    gate,
    beta,
    heads: int,
    head_dim: int,
    bounded: bool,
    lower_bound: float,
    tokens: int | None = None,
) -> None:
    """Forget-gate log-decay and beta.

    forget_proj [>= T, H*D] BF16, dt_bias [H*D] FP32 (per channel), a_log [H] FP32
    (per head; Kimi's [1, 1, H, 1] is accepted), beta_logits [>= T, >= H] BF16 (may
    be a column slice of a wider buffer), gate [>= T, H, D] FP32, beta [>= T, H]
    FP32. bounded: gate = lower_bound * sigmoid(exp(A_log) u); else the softplus
    law (lower_bound ignored).
    """
    if tokens is None:
        tokens = forget_proj.shape[0]
    if head_dim != HEAD_DIM:
        raise ValueError(f"head_dim = {head_dim}: the gate kernel is compiled for D = {HEAD_DIM}")
    ld_beta = check_gate_sources(forget_proj, dt_bias, a_log, beta_logits, heads, head_dim, tokens)
    _require_aligned("dt_bias", dt_bias)
    _require_rows("gate", gate, "f32", tokens, (heads, head_dim), aligned=True)
    _require_rows("beta", beta, "f32", tokens, (heads,))
    if bounded and not math.isfinite(lower_bound):
        raise ValueError(f"bounded gate needs a finite lower_bound, got {lower_bound}")
    for start, end in _token_slices(tokens):
        kernels.launch(
            "gate_beta_f32",
            (heads, -(-(end - start) // GATE_TOKENS_PER_BLOCK)),
            (GATE_THREADS,),
            (
                forget_proj[start:end],
                dt_bias,
                a_log,
                beta_logits[start:end],
                _i32(ld_beta),
                gate[start:end],
                beta[start:end],
                _i32(heads),
                _i32(head_dim),
                _i32(1 if bounded else 0),
                _f32(lower_bound if bounded else 0.0),
                _i32(end - start),
            ),
        )


# --------------------------------------------------------------------------------------
# 4. Recurrent step (decode)
# --------------------------------------------------------------------------------------


def kda_recurrent_step_f32(query, key, value, gate, beta, state, core, scale: float, slots=None) -> None:
    """One decode token of the delta rule for each of `rows` sequences, states in place.

    state [H, D, D] FP32 K-major (one sequence) or a pool [N, H, D, D]; query, key, value,
    gate, core [rows, H, D] (or [H, D]) FP32; beta [rows, H] (or [H]) FP32. Row r uses
    state slots[r] (device int32) or, without slots, state r.
    """
    heads = _state_or_pool_heads(state)
    rows = 1 if query.ndim == 2 else query.shape[0]
    _slot_rows("state", state, (heads, HEAD_DIM, HEAD_DIM), rows, slots)
    for name, array in (("query", query), ("key", key), ("value", value), ("gate", gate), ("core", core)):
        _require(name, array, "f32", (rows, heads, HEAD_DIM))
    _require("beta", beta, "f32", (rows, heads))
    kernels.launch(
        "kda_recurrent_step_f32",
        (heads, HEAD_DIM // RECURRENT_COLUMNS, rows),
        (RECURRENT_COLUMNS,),
        (query, key, value, gate, beta, state, slots, core, _i32(heads), _f32(scale)),
    )


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


def signal_inputs_ready(inputs_ready) -> None:
    """inputs_ready[0] += 1 once the kernel before this launch on the current stream has finished
    (launched as its programmatic dependent: the one block waits resident): the signal a
    :func:`kda_decode_fused_bf16` launch with ``inputs_ready`` waits for. inputs_ready: a contiguous
    int32 array of at least 2 elements."""
    _require_words(inputs_ready, "signal_inputs_ready")
    kernels.launch("kda_signal_inputs_ready", (1,), (32,), (inputs_ready,), programmatic=True)


def bulk_copies_available() -> bool:
    """Whether the current device has the bulk copies (the tensor memory accelerator) and the
    thread-block clusters of sm_90 and later, which kda_decode_fused_bf16(staged=True) and
    (split=True) use."""
    import cupy

    return int(cupy.cuda.Device().compute_capability) >= 90


# --------------------------------------------------------------------------------------
# 5. Chunked prefill
# --------------------------------------------------------------------------------------


def chunk_prepare_smem_bytes(chunk: int) -> int:
    """Dynamic shared memory of kda_chunk_prepare_f32: three [C][D + 1] FP32 tiles
    (k, q, cumulative gate), the [C][C] matrix A and beta [C]."""
    return 4 * (3 * chunk * (HEAD_DIM + 1) + chunk * chunk + chunk)


def chunk_count(tokens: int, chunk: int) -> int:
    """nchunks = ceil(T / C); the padded length is nchunks * C."""
    return (tokens + chunk - 1) // chunk


def _require_chunk(chunk: int) -> None:
    if not 1 <= chunk <= CHUNK_MAX:
        raise ValueError(f"chunk must be 1..{CHUNK_MAX}, got {chunk}")


def kda_chunk_prepare_f32(
    query, key, value, gate, beta, q_decay, k_tail, w, u, attn, chunk_decay, tokens: int, chunk: int, scale: float
) -> None:
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
    _check_dtype("beta", beta, "f32")
    if beta.ndim != 2:
        raise ValueError(f"beta: expected [>= T, H], got {list(beta.shape)}")
    heads = beta.shape[1]
    nchunks = chunk_count(tokens, chunk)
    padded = nchunks * chunk
    _require_rows("beta", beta, "f32", tokens, (heads,))
    for name, array in (("query", query), ("key", key), ("value", value), ("gate", gate)):
        _require_rows(name, array, "f32", tokens, (heads, HEAD_DIM))
    for name, array in (("q_decay", q_decay), ("k_tail", k_tail), ("w", w), ("u", u)):
        _require_rows(name, array, "f32", padded, (heads, HEAD_DIM), aligned=True)
    _require_rows("attn", attn, "f32", nchunks, (heads, chunk, chunk))
    _require_rows("chunk_decay", chunk_decay, "f32", nchunks, (heads, HEAD_DIM), aligned=True)
    kernels.launch(
        "kda_chunk_prepare_f32",
        (nchunks, heads),
        (HEAD_BLOCK,),
        (
            query,
            key,
            value,
            gate,
            beta,
            q_decay,
            k_tail,
            w,
            u,
            attn,
            chunk_decay,
            _i32(tokens),
            _i32(heads),
            _i32(chunk),
            _f32(scale),
        ),
        shared_mem=chunk_prepare_smem_bytes(chunk),
    )


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
    nchunks = chunk_count(tokens, chunk)
    padded = nchunks * chunk
    # q_decay, w, k_tail and chunk_decay rows are read as float4 vectors.
    for name, array in (("q_decay", q_decay), ("k_tail", k_tail), ("w", w), ("u", u)):
        _require_rows(name, array, "f32", padded, (heads, HEAD_DIM), aligned=True)
    _require_rows("attn", attn, "f32", nchunks, (heads, chunk, chunk))
    _require_rows("chunk_decay", chunk_decay, "f32", nchunks, (heads, HEAD_DIM), aligned=True)
    _require_rows("core", core, "f32", tokens, (heads, HEAD_DIM))
    kernels.launch(
        "kda_chunk_scan_f32",
        (heads, HEAD_DIM // RECURRENT_COLUMNS),
        (RECURRENT_COLUMNS,),
        (
            q_decay,
            k_tail,
            w,
            u,
            attn,
            chunk_decay,
            state,
            core,
            _i32(tokens),
            _i32(heads),
            _i32(chunk),
            _i32(nchunks),
        ),
    )


# --------------------------------------------------------------------------------------
# 6. Gated RMSNorm
# --------------------------------------------------------------------------------------


def gated_rmsnorm_sigmoid_bf16(
    core, out_gate, norm_w, o_norm_out, heads: int, head_dim: int, eps: float, tokens: int | None = None
) -> None:
    """o_norm_out = bf16(core / sqrt(mean(core^2) + eps) * norm_w * sigmoid(out_gate)) per head.

    core [>= T, H, D] FP32, out_gate [>= T, H*D] BF16, norm_w [D] BF16,
    o_norm_out [>= T, H*D] BF16. The gate is a SIGMOID, not SiLU.
    """
    _require_head_dim(head_dim)
    if tokens is None:
        tokens = out_gate.shape[0]
    _require_rows("core", core, "f32", tokens, (heads, head_dim))
    _require_rows("out_gate", out_gate, "bf16", tokens, (heads * head_dim,))
    _require_rows("o_norm_out", o_norm_out, "bf16", tokens, (heads * head_dim,))
    _require("norm_w", norm_w, "bf16", (head_dim,))
    for start, end in _token_slices(tokens):
        kernels.launch(
            "gated_rmsnorm_sigmoid_bf16",
            (heads, -(-(end - start) // TOKENS_PER_BLOCK)),
            (HEAD_BLOCK,),
            (core[start:end], out_gate[start:end], norm_w, o_norm_out[start:end], _i32(heads), _i32(head_dim), _f32(eps),
             _i32(end - start)),
        )
