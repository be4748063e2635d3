"""A plain tiled GEMM for the GPU tests: what tests/conftest.py's --gemm-without-cublas runs in place
of cuBLAS for the prefill's wide projections (compute-sanitizer's racecheck stops with an internal
error at the first cuBLAS kernel when it instruments our kernels alone)."""

from __future__ import annotations

import functools

import numpy as np

# out[t, j] = sum_i x[t, i] w[j, i], BF16 in, FP32 sums in k order, 16 x 16 tiles through shared
# memory; out BF16 (rounded to nearest even) or FP32. Launch: block (16, 16), grid (ceil(n / 16), ceil(T / 16)).
TILED_GEMM_SOURCE = r"""
extern "C" __global__ void tiled_gemm_bf16(const unsigned short* x, long long ldx, const unsigned short* w,
                                           void* out, long long ldo, int tokens, int n, int k, int out_f32)
{
    __shared__ float xs[16][17], ws[16][17];
    const int t = blockIdx.y * 16 + threadIdx.y, j = blockIdx.x * 16 + threadIdx.x;
    const int wrow = blockIdx.x * 16 + threadIdx.y;
    float sum = 0.0f;
    for (int base = 0; base < k; base += 16) {
        const int i = base + threadIdx.x;
        xs[threadIdx.y][threadIdx.x] = t < tokens && i < k ? __uint_as_float((unsigned int)x[t * ldx + i] << 16) : 0.0f;
        ws[threadIdx.y][threadIdx.x] = wrow < n && i < k ? __uint_as_float((unsigned int)w[(long long)wrow * k + i] << 16) : 0.0f;
        __syncthreads();
        for (int e = 0; e < 16; ++e) {
            sum += xs[threadIdx.y][e] * ws[threadIdx.x][e];
        }
        __syncthreads();
    }
    if (t < tokens && j < n) {
        if (out_f32) {
            ((float*)out)[t * ldo + j] = sum;
        } else {
            ((unsigned short*)out)[t * ldo + j] = kda_float_to_bf16_bits(sum);
        }
    }
}
"""


@functools.lru_cache(maxsize=None)
def _kernel():
    import cupy

    from glm_kda.gpu.ops import BF16_ROUND_SOURCE

    return cupy.RawKernel(BF16_ROUND_SOURCE + TILED_GEMM_SOURCE, "tiled_gemm_bf16")


def tiled_gemm_bf16(x, w, out) -> None:
    """out[T, n] = x[T, k] @ w[n, k]^T: BF16 x and w (row slices or column slices of wider buffers),
    out BF16 (rounded to nearest even) or FP32, as glm_kda.gpu.ops.gemm_bf16_cublas takes them."""
    import cupy

    n, k = w.shape
    tokens = x.shape[0]
    if tokens == 0 or n == 0:
        return
    ldx, ldo = x.strides[0] // x.itemsize, out.strides[0] // out.itemsize
    _kernel()((-(-n // 16), -(-tokens // 16)), (16, 16),
              (x, np.int64(ldx), w, out, np.int64(ldo), np.int32(tokens), np.int32(n), np.int32(k),
               np.int32(out.dtype == cupy.float32)))
