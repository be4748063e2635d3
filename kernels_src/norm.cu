// Gated RMSNorm per head of the KDA core output, FP32 arithmetic, BF16 result:
//   y[t, h, d] = o / sqrt(mean_d(o * o) + eps) * norm_w[d] * sigmoid(out_gate[t, h, d])
// The gate activation is SIGMOID. The common gated RMSNorm applies SiLU to the
// gate instead and has the same shapes, dtypes and launch geometry, so swapping
// the two is silent.
//
// Launch: grid (heads, T), block head_dim = 128: one block per (head, token), one
// thread per channel, so the mean over the head is one block reduction (the same
// block_sum_f32 every per-head reduction uses).
#include "kda_common.cuh"

extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
gated_rmsnorm_sigmoid_bf16(const float* __restrict__ core, const bf16_t* __restrict__ out_gate,
                           const bf16_t* __restrict__ norm_w, bf16_t* __restrict__ o_norm_out,
                           int heads, int head_dim, float eps)
{
    __shared__ float scratch[8];
    // Uniform over the block: a wrong geometry leaves whole blocks, before any sync.
    if (head_dim != KDA_HEAD_DIM || blockDim.x != KDA_HEAD_BLOCK || blockIdx.x >= heads) {
        return;
    }
    const int d = threadIdx.x;
    const size_t index = static_cast<size_t>(blockIdx.y) * heads * head_dim +
                         static_cast<size_t>(blockIdx.x) * head_dim + d;

    const float o = core[index];
    // __fmul_rn: a product the compiler may not fuse into the first shuffle add.
    const float mean_square = block_sum_f32(__fmul_rn(o, o), scratch) / static_cast<float>(head_dim);
    const float y = o / sqrtf(mean_square + eps) * bf16_to_f32(norm_w[d]) *
                    sigmoid_f32(bf16_to_f32(out_gate[index]));
    o_norm_out[index] = f32_to_bf16(y);
}
