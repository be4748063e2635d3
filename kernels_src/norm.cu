// Gated RMSNorm per head of a prefill's KDA core output, FP32 arithmetic, BF16 result:
//   y[t, h, d] = o / sqrt(mean_d(o * o) + eps) * norm_w[d] * sigmoid(out_gate[t, h, d])
// The gate is a SIGMOID: the common gated RMSNorm's SiLU has the same shapes, so a swap is silent.
//
// Launch: grid (heads, ceil(T / NORM_TOKENS_PER_BLOCK)), block head_dim = 128, no dynamic shared
// memory: a block per head and group of 8 tokens, a thread per channel, so the mean over the head is
// one block reduction per token (gated_rmsnorm_sigmoid, the fused decode step's). The group's loads
// are issued before its first reduction (enough rows to amortise a block's start at prefill widths);
// an element's arithmetic does not depend on the grouping.
#include "common/bf16.cuh"
#include "common/reduce.cuh"

#define NORM_TOKENS_PER_BLOCK 8

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
