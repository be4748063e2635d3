// Projection GEMV for decode and speculative verify:
//   y[r, j] = bf16( sum_i x[r, i] * w[j, i] )   for r < rows (1..16), j < n
// with x [rows, k] (row stride ldx), w [n, k] (torch Linear layout, contiguous)
// and y [rows, n] (row stride ldy, so y may be a column slice of a wider buffer).
//
// Launch: grid ceil(n / 8), block 256 = 8 warps; one warp owns one output column
// j. Lane l reads w[j, 8l .. 8l+7], then strides by 32 * 8 elements, so one
// warp-wide step is a 512-byte contiguous read of the weight row: the weight is
// streamed exactly once for all rows, which is what decode is bound by.
//
// Bit contract: the arithmetic of row r does not depend on `rows`. Each row has
// its own FP32 accumulator, fed by fmaf in the same k order (lane-strided, 8
// elements per step, ascending) whatever the number of rows, and reduced by the
// same xor-shuffle tree. So y[r] from a 16-row verify call equals, bit for bit,
// y[0] from a 1-row decode call on that row alone.
//
// Requires k % 8 == 0, ldx % 8 == 0 and 16-byte aligned x and w (checked by the
// Python wrapper): every load is one 16-byte vector of 8 BF16.
#include "kda_common.cuh"

#define GEMV_MAX_ROWS 16
#define GEMV_WARPS_PER_BLOCK 8
#define GEMV_VECTOR 8

// Widen 8 packed BF16 (one 16-byte load) to FP32.
__device__ __forceinline__ void unpack_bf16x8(const uint4 packed, float out[GEMV_VECTOR])
{
    const unsigned int words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        out[2 * e] = bf16_half_to_f32(words[e], 0);
        out[2 * e + 1] = bf16_half_to_f32(words[e], 1);
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS_PER_BLOCK * 32)
gemv_bf16(const bf16_t* __restrict__ x, int ldx, const bf16_t* __restrict__ w,
          bf16_t* __restrict__ y, int ldy, int rows, int n, int k)
{
    const int lane = threadIdx.x & 31;
    const int column = blockIdx.x * GEMV_WARPS_PER_BLOCK + (threadIdx.x >> 5);
    // Whole warps leave together; nothing below synchronises the block.
    if (column >= n) {
        return;
    }

    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        acc[r] = 0.0f;
    }

    const bf16_t* weight_row = w + static_cast<size_t>(column) * k;
    for (int i = lane * GEMV_VECTOR; i + GEMV_VECTOR <= k; i += 32 * GEMV_VECTOR) {
        float wf[GEMV_VECTOR];
        unpack_bf16x8(*reinterpret_cast<const uint4*>(weight_row + i), wf);
#pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
            if (r < rows) {
                float xf[GEMV_VECTOR];
                unpack_bf16x8(
                    *reinterpret_cast<const uint4*>(x + static_cast<size_t>(r) * ldx + i), xf);
#pragma unroll
                for (int e = 0; e < GEMV_VECTOR; ++e) {
                    acc[r] = fmaf(xf[e], wf[e], acc[r]);
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        // `rows` is uniform across the warp, so the shuffles stay converged.
        if (r < rows) {
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) {
                acc[r] += __shfl_xor_sync(KDA_FULL_WARP_MASK, acc[r], offset);
            }
            if (lane == 0) {
                y[static_cast<size_t>(r) * ldy + column] = f32_to_bf16(acc[r]);
            }
        }
    }
}
