// Gated RMSNorm per head of a prefill's core output, FP32 arithmetic, BF16 result, the gate a SIGMOID:
//   y[t, h, d] = o / sqrt(mean_d(o * o) + eps) * norm_w[d] * sigmoid(out_gate[t, h, d])
// Launch: grid (heads, ceil(T / 8)), 128 threads, no dynamic shared memory: a thread a channel, one
// block reduction a token (the fused decode step's).
#include "common/bf16.cuh"
#include "common/reduce.cuh"

#define NORM_TOKENS_PER_BLOCK 8

// core [T, H, D] FP32, out_gate [T, H D] BF16, norm_w [D] BF16 -> o_norm_out [T, H D] BF16.
extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
kda_gated_rmsnorm_sigmoid_bf16(const float* __restrict__ core, const bf16_t* __restrict__ out_gate,
                           const bf16_t* __restrict__ norm_w, bf16_t* __restrict__ o_norm_out,
                           int heads, int head_dim, float eps, int tokens)
{
    __shared__ float scratch[8];
    // Uniform over the block: a wrong geometry leaves whole blocks, before any sync.
    if (head_dim != KDA_HEAD_DIM || blockDim.x != KDA_HEAD_BLOCK || blockIdx.x >= heads) {
        return;
    }
    const int d = threadIdx.x;
    const int first = blockIdx.y * NORM_TOKENS_PER_BLOCK;
    const int count = min(NORM_TOKENS_PER_BLOCK, tokens - first);
    const size_t row_stride = static_cast<size_t>(heads) * head_dim;
    const size_t base = static_cast<size_t>(first) * row_stride + static_cast<size_t>(blockIdx.x) * head_dim + d;
    const float weight = bf16_to_f32(norm_w[d]);
    float o[NORM_TOKENS_PER_BLOCK];
    float z[NORM_TOKENS_PER_BLOCK];
#pragma unroll
    for (int i = 0; i < NORM_TOKENS_PER_BLOCK; ++i) {
        o[i] = i < count ? core[base + i * row_stride] : 0.0f;
        z[i] = i < count ? bf16_to_f32(out_gate[base + i * row_stride]) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < NORM_TOKENS_PER_BLOCK; ++i) {
        // count is uniform over the block, so every thread meets the same barriers.
        if (i < count) {
            const float y = gated_rmsnorm_sigmoid(o[i], weight, z[i], eps, scratch);
            o_norm_out[base + i * row_stride] = f32_to_bf16(y);
        }
    }
}
