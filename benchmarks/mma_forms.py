"""Do the two operand orders of mma.sync m16n8k16 give the same bits? One JSON line.

gemm_rows computes y = x w^T with x as the A operand (16 rows) and w as B (8 columns). The
transposed order, w as A (16 columns) and x as B (8 rows), computes the same products, gathered
in the same k slots of the same chain of mma; if the tensor cores add them the same way whichever
operand holds them, the two orders give the same bits and a kernel may use either for any row
count without breaking batch invariance. This measures it: for random x [16, K] and w [16, K]
(BF16; values over a wide exponent range, so that the alignment of the products matters, and
plain normal values) both orders run the same chain of K / 16 mma from zero with the same k slot
of every physical k, and every one of the 256 outputs is compared bit for bit.

    PYTHONPATH=. python benchmarks/mma_forms.py
"""

from __future__ import annotations

import json

import cupy
import numpy as np

from glm_kda.cli import script_help
from glm_kda.device import exit_unless_gpu

# The mma.sync m16n8k16 and the BF16 pair of a row, device code benchmarks/wgmma_forms.py shares.
MMA_HELPERS = r"""
__device__ __forceinline__ void mma16816(float acc[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two BF16 of row `row` at physical k `k` and k + 1, as one 32-bit word.
__device__ __forceinline__ unsigned pair_at(const unsigned short* m, int k_total, int row, int k)
{
    return static_cast<unsigned>(m[row * k_total + k]) | (static_cast<unsigned>(m[row * k_total + k + 1]) << 16);
}
"""

_SOURCE = r"""
#include <cuda_bf16.h>
""" + MMA_HELPERS + r"""
// One warp per case: x [16, K], w [16, K]. out_xw[r * 16 + c] from x as A (two n-tiles of w),
// out_wx[r * 16 + c] from w as A (two n-tiles of x rows), c a column of w, r a row of x.
// The k slots of lane (g, t) in step s of a 32-k block: logical 2t, 2t+1 <- physical 8t+4s, +1;
// logical 2t+8, 2t+9 <- physical 8t+4s+2, +3 (gemm_rows' mapping), for both orders.
extern "C" __global__ void mma_forms(const unsigned short* x_all, const unsigned short* w_all, int k_total,
                                     float* out_xw, float* out_wx)
{
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int case_index = blockIdx.x;
    const unsigned short* x = x_all + static_cast<size_t>(case_index) * 16 * k_total;
    const unsigned short* w = w_all + static_cast<size_t>(case_index) * 16 * k_total;
    float xw[2][4] = {}, wx[2][4] = {};
    for (int kb = 0; kb < k_total; kb += 32) {
        for (int s = 0; s < 2; ++s) {
            const int p0 = kb + 8 * t + 4 * s, p1 = p0 + 2;
            for (int j = 0; j < 2; ++j) {
                // x as A (rows g, g + 8), w columns 8 j + g as B.
                mma16816(xw[j], pair_at(x, k_total, g, p0), pair_at(x, k_total, g + 8, p0), pair_at(x, k_total, g, p1),
                         pair_at(x, k_total, g + 8, p1), pair_at(w, k_total, 8 * j + g, p0),
                         pair_at(w, k_total, 8 * j + g, p1));
                // w as A (columns g, g + 8), x rows 8 j + g as B.
                mma16816(wx[j], pair_at(w, k_total, g, p0), pair_at(w, k_total, g + 8, p0), pair_at(w, k_total, g, p1),
                         pair_at(w, k_total, g + 8, p1), pair_at(x, k_total, 8 * j + g, p0),
                         pair_at(x, k_total, 8 * j + g, p1));
            }
        }
    }
    float* o_xw = out_xw + case_index * 256;
    float* o_wx = out_wx + case_index * 256;
    for (int j = 0; j < 2; ++j) {
        for (int e = 0; e < 4; ++e) {
            // Accumulator e: row g + 8 (e >> 1) of A, column 2t + (e & 1) of B.
            const int a_row = g + 8 * (e >> 1), b_col = 8 * j + 2 * t + (e & 1);
            o_xw[a_row * 16 + b_col] = xw[j][e];   // x row a_row, w column b_col
            o_wx[b_col * 16 + a_row] = wx[j][e];   // x row b_col, w column a_row
        }
    }
}
"""


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even BF16 bits of float32 values."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def main() -> None:
    kernel = cupy.RawModule(code=_SOURCE, options=("-std=c++17",)).get_function("mma_forms")
    rng = np.random.default_rng(2026)
    results = {}
    for name, k_total, cases in (("normal", 4096, 2048), ("wide_exponents", 4096, 2048), ("cancelling", 512, 4096)):
        shape = (cases, 16, k_total)
        if name == "normal":
            x, w = rng.standard_normal(shape), rng.standard_normal(shape)
        elif name == "wide_exponents":
            x = rng.choice([-1.0, 1.0], shape) * np.exp2(rng.integers(-24, 24, shape)) * rng.uniform(1, 2, shape)
            w = rng.choice([-1.0, 1.0], shape) * np.exp2(rng.integers(-24, 24, shape)) * rng.uniform(1, 2, shape)
        else:
            # Pairs of products that cancel up to their last bits, beside small ones.
            x = rng.standard_normal(shape)
            w = rng.standard_normal(shape)
            x[..., 1::2] = -x[..., 0::2] * (1 + rng.integers(-4, 5, x[..., 1::2].shape) * 2.0 ** -8)
            w[..., 1::2] = w[..., 0::2]
            x[..., ::7] *= 2.0 ** -20
        x_device = cupy.asarray(bf16_bits(x))
        w_device = cupy.asarray(bf16_bits(w))
        out_xw = cupy.empty((cases, 256), cupy.float32)
        out_wx = cupy.empty((cases, 256), cupy.float32)
        kernel((cases,), (32,), (x_device, w_device, np.int32(k_total), out_xw, out_wx))
        a, b = out_xw.get().view(np.uint32), out_wx.get().view(np.uint32)
        results[name] = {"outputs": int(a.size), "differing_bits": int((a != b).sum()), "k": k_total}
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print(json.dumps({"device": device["name"].decode(), "cc": f"{device['major']}.{device['minor']}", **results}))


if __name__ == "__main__":
    script_help(__doc__)
    exit_unless_gpu("the mma forms check")
    main()
