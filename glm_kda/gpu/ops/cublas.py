"""The wide projections of a prefill (cuBLAS, BF16 in, FP32 compute) and the FP32 -> BF16 rounding."""

from __future__ import annotations

import functools

import cupy
import numpy

from .checks import _F32_DTYPE, _require, _require_int32, _row_stride

# cudaDataType CUDA_R_16BF (library_types.h), which cupy's cublas module does not export.
_CUDA_R_16BF = 14
# cudaDataType CUDA_R_32F, likewise.
_CUDA_R_32F = 0


def gemm_bf16_cublas(x, w, out) -> None:
    """out[T, n] = bf16(x[T, k] @ w[n, k]^T) through cuBLAS, BF16 in/out, FP32 compute; a
    float32 `out` receives the FP32 result unrounded (a tensor-parallel rank's partial output).

    For prefill widths: it reassociates, so it is never used where decode bits must be reproduced. x and
    out may be row slices or column slices of wider row-major buffers: their row strides are passed.
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
        # cuBLAS is column-major, so out = x w^T runs as out^T [n, T] = op_T(W) X: A = W stored [k, n] (lda = k),
        # B = X stored [k, T] (ldb = ldx), C = out^T stored [n, T] (ldc = ldo).
        cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, tokens, k, alpha.ctypes.data,
                      w.data.ptr, _CUDA_R_16BF, k,
                      x.data.ptr, _CUDA_R_16BF, ldx, beta.ctypes.data,
                      out.data.ptr, _CUDA_R_32F if out_f32 else _CUDA_R_16BF, ldo,
                      cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, pointer_mode)


# FP32 -> BF16 bits as ml_dtypes rounds (nearest even, NaN quiet); public: the TP tests check it.
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
