// The sums over a head's KDA_HEAD_BLOCK threads (thread d: channel d) and the per-head normalisations built
// on them, all in block_sum_f32's one order, so that decode and prefill produce the same bits.
#pragma once

#include "common/head.cuh"
#include "common/math.cuh"

#define KDA_FULL_WARP_MASK 0xffffffffu

// The four warp sums of a block, added in warp order.
__device__ __forceinline__ float sum_of_warps(const float* sums)
{
    float total = sums[0];
    total += sums[1];
    total += sums[2];
    total += sums[3];
    return total;
}

// Sum of `value` over the block's 128 threads, returned to every one of them: a fixed xor-shuffle tree in
// each warp, then the warp sums in warp order. `scratch`: at least 5 floats; every thread must call it.
__device__ __forceinline__ float block_sum_f32(float value, float* scratch)
{
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        value += __shfl_xor_sync(KDA_FULL_WARP_MASK, value, offset);
    }
    const int thread = threadIdx.x;
    const int warp = thread >> 5;
    if ((thread & 31) == 0) {
        scratch[warp] = value;
    }
    __syncthreads();
    if (thread == 0) {
        scratch[4] = sum_of_warps(scratch);
    }
    __syncthreads();
    const float total = scratch[4];
    // Nobody may overwrite scratch for the next call before every thread read it.
    __syncthreads();
    return total;
}

// block_sum_f32 of two values, the bits of two calls with the barriers of one; scratch of 10 floats.
__device__ __forceinline__ void block_sum2_f32(float& a, float& b, float* scratch)
{
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        a += __shfl_xor_sync(KDA_FULL_WARP_MASK, a, offset);
        b += __shfl_xor_sync(KDA_FULL_WARP_MASK, b, offset);
    }
    const int thread = threadIdx.x;
    const int warp = thread >> 5;
    if ((thread & 31) == 0) {
        scratch[warp] = a;
        scratch[5 + warp] = b;
    }
    __syncthreads();
    if (thread == 0 || thread == 32) {
        scratch[(thread == 0 ? 0 : 5) + 4] = sum_of_warps(scratch + (thread == 0 ? 0 : 5));
    }
    __syncthreads();
    a = scratch[4];
    b = scratch[9];
    // Nobody may overwrite scratch for the next call before every thread read it.
    __syncthreads();
}

// q / sqrt(sum over the head of q^2 + eps) and the same of k, one reduction's barriers; 10 floats scratch.
__device__ __forceinline__ void l2_normalize_pair(float& q, float& k, float l2_eps, float* scratch)
{
    // __fmul_rn: a product the compiler may not fuse into the first shuffle add.
    float q_squares = __fmul_rn(q, q);
    float k_squares = __fmul_rn(k, k);
    block_sum2_f32(q_squares, k_squares, scratch);
    q = q / sqrtf(q_squares + l2_eps);
    k = k / sqrtf(k_squares + l2_eps);
}

// Gated RMSNorm of one channel of a head, the gate a SIGMOID (docs/maths.md, section 3), given the sum
// over the head of o * o (block_sum_f32's bits).
__device__ __forceinline__ float gated_rmsnorm_sigmoid_of_sum(float o, float sum_squares, float weight, float z,
                                                              float eps)
{
    const float mean_square = sum_squares / static_cast<float>(KDA_HEAD_DIM);
    return o / sqrtf(mean_square + eps) * weight * sigmoid_f32(z);
}

// gated_rmsnorm_sigmoid_of_sum of a channel a thread; every thread calls it.
__device__ __forceinline__ float gated_rmsnorm_sigmoid(float o, float weight, float z, float eps, float* scratch)
{
    // __fmul_rn: a product the compiler may not fuse into the first shuffle add.
    return gated_rmsnorm_sigmoid_of_sum(o, block_sum_f32(__fmul_rn(o, o), scratch), weight, z, eps);
}

// The L2 sum of a head's 128 squares held 4 per lane (lane L: channels 4L .. 4L+3) with block_sum_f32's
// additions in its order, so that the prefill conv's q and k and the prefill norm's sums are decode's
// (docs/kernels.md, 'Shared pieces').
__device__ __forceinline__ float warp_head_sum_squares(const float (&v)[4])
{
    float s[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        s[i] = __fmul_rn(v[i], v[i]);
    }
#pragma unroll
    for (int offset = 4; offset > 0; offset >>= 1) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            s[i] += __shfl_xor_sync(KDA_FULL_WARP_MASK, s[i], offset);
        }
    }
    float pair[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        pair[i] = s[i] + s[i ^ 2];
    }
    const float warp_sum = pair[0] + pair[1];
    float total = __shfl_sync(KDA_FULL_WARP_MASK, warp_sum, 0);
    total += __shfl_sync(KDA_FULL_WARP_MASK, warp_sum, 8);
    total += __shfl_sync(KDA_FULL_WARP_MASK, warp_sum, 16);
    total += __shfl_sync(KDA_FULL_WARP_MASK, warp_sum, 24);
    return total;
}
