// Gated RMSNorm per head of a prefill's core output, FP32 arithmetic, BF16 result, the gate a SIGMOID:
//   y[t, h, d] = o / sqrt(mean_d(o * o) + eps) * norm_w[d] * sigmoid(out_gate[t, h, d])
// Launch: grid (ceil(heads / 4), ceil(T / 4)), 128 threads, no shared memory: warp w of block x holds
// head 4x + w of 4 tokens, lane L its channels 4L .. 4L+3; the head's sum is a warp reduction in the
// fused decode step's order (docs/kernels.md, 'Gated RMSNorm').
#include "common/bf16.cuh"
#include "common/reduce.cuh"

#define NORM_TOKENS_PER_BLOCK 4

// Heads per block: one per warp.
#define NORM_HEADS_PER_BLOCK 4
static_assert(NORM_HEADS_PER_BLOCK * 32 == KDA_HEAD_BLOCK, "a warp per head");

// core [T, H, D] FP32 (16-byte aligned rows), out_gate [T, H D] BF16, norm_w [D] BF16 (8-byte aligned
// rows) -> o_norm_out [T, H D] BF16 (8-byte aligned rows).
extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
kda_gated_rmsnorm_sigmoid_bf16(const float* __restrict__ core, const bf16_t* __restrict__ out_gate,
                           const bf16_t* __restrict__ norm_w, bf16_t* __restrict__ o_norm_out,
                           int heads, int head_dim, float eps, int tokens)
{
    const int head = blockIdx.x * NORM_HEADS_PER_BLOCK + (threadIdx.x >> 5);
    // Uniform over the warp (there is no block barrier): a wrong geometry leaves whole warps.
    if (head_dim != KDA_HEAD_DIM || blockDim.x != KDA_HEAD_BLOCK || head >= heads) {
        return;
    }
    const int lane = threadIdx.x & 31;
    const int first = blockIdx.y * NORM_TOKENS_PER_BLOCK;
    const int count = min(NORM_TOKENS_PER_BLOCK, tokens - first);
    const size_t row_stride = static_cast<size_t>(heads) * KDA_HEAD_DIM;
    const size_t base = static_cast<size_t>(first) * row_stride + static_cast<size_t>(head) * KDA_HEAD_DIM + 4 * lane;
    const uint2 packed_weight = *reinterpret_cast<const uint2*>(norm_w + 4 * lane);
    float weight[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        weight[c] = bf16_half_to_f32(c < 2 ? packed_weight.x : packed_weight.y, c & 1);
    }
    // Every load issued before the first reduction.
    float4 o[NORM_TOKENS_PER_BLOCK];
    uint2 z[NORM_TOKENS_PER_BLOCK];
#pragma unroll
    for (int i = 0; i < NORM_TOKENS_PER_BLOCK; ++i) {
        if (i < count) {
            o[i] = *reinterpret_cast<const float4*>(core + base + i * row_stride);
            z[i] = *reinterpret_cast<const uint2*>(out_gate + base + i * row_stride);
        }
    }
#pragma unroll
    for (int i = 0; i < NORM_TOKENS_PER_BLOCK; ++i) {
        if (i < count) {  // count is uniform over the warp, so every lane meets the same shuffles
            const float v[4] = {o[i].x, o[i].y, o[i].z, o[i].w};
            const float sum_squares = warp_head_sum_squares(v);
            unsigned int bits[4];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const float gate = bf16_half_to_f32(c < 2 ? z[i].x : z[i].y, c & 1);
                bits[c] = f32_to_bf16(gated_rmsnorm_sigmoid_of_sum(v[c], sum_squares, weight[c], gate, eps));
            }
            *reinterpret_cast<uint2*>(o_norm_out + base + i * row_stride) =
                make_uint2(bits[0] | (bits[1] << 16), bits[2] | (bits[3] << 16));
        }
    }
}
