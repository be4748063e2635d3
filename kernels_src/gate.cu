// Forget gate (per-channel log-decay) and beta of a prefill, FP32, by the bounded or softplus law
// (docs/maths.md, section 3; kda_forget_gate of common/math.cuh, the one definition).
// Launch: grid (heads, ceil(T / 32)), 128 threads, no shared memory: a head and 32 tokens a block
// (docs/kernels.md, 'Forget gate and beta').
#include "common/bf16.cuh"
#include "common/head.cuh"
#include "common/math.cuh"

#define GATE_TOKENS_PER_BLOCK 32
#define GATE_THREADS 128
#define GATE_ROWS (GATE_THREADS / (KDA_HEAD_DIM / 4))
#define GATE_STEPS (GATE_TOKENS_PER_BLOCK / GATE_ROWS)

// forget_proj [T, H D] BF16, dt_bias [H D] and a_log [H] FP32, beta_logits [T, ld_beta] BF16 ->
// gate [T, H D] and beta [T, H] FP32.
extern "C" __global__ void __launch_bounds__(GATE_THREADS)
kda_gate_beta_f32(const bf16_t* __restrict__ forget_proj, const float* __restrict__ dt_bias,
              const float* __restrict__ a_log, const bf16_t* __restrict__ beta_logits,
              int ld_beta, float* __restrict__ gate, float* __restrict__ beta, int heads,
              int head_dim, int gate_law, float lower_bound, int tokens)
{
    const int head = blockIdx.x;
    if (head >= heads || head_dim != KDA_HEAD_DIM || blockDim.x != GATE_THREADS) {
        return;
    }
    const int row = threadIdx.x / (KDA_HEAD_DIM / 4);
    const int d = 4 * (threadIdx.x % (KDA_HEAD_DIM / 4));
    const size_t channel = static_cast<size_t>(head) * KDA_HEAD_DIM + d;
    const size_t row_stride = static_cast<size_t>(heads) * KDA_HEAD_DIM;
    // dt_bias is per CHANNEL ([heads * head_dim]), A_log per HEAD ([heads]): swapped, they read valid
    // memory and give a plausible-looking gate, the highest-risk line of the block.
    const float4 bias = *reinterpret_cast<const float4*>(dt_bias + channel);
    const float a = expf(a_log[head]);
    const int first = blockIdx.y * GATE_TOKENS_PER_BLOCK + row;
    uint2 projected[GATE_STEPS];
#pragma unroll
    for (int step = 0; step < GATE_STEPS; ++step) {
        const int token = first + GATE_ROWS * step;
        projected[step].x = 0u;
        projected[step].y = 0u;
        if (token < tokens) {
            projected[step] = *reinterpret_cast<const uint2*>(forget_proj + token * row_stride + channel);
        }
    }
#pragma unroll
    for (int step = 0; step < GATE_STEPS; ++step) {
        const size_t token = static_cast<size_t>(first + GATE_ROWS * step);
        if (first + GATE_ROWS * step >= tokens) {
            break;
        }
        const float4 u = make_float4(bf16_to_f32(static_cast<bf16_t>(projected[step].x & 0xffffu)) + bias.x,
                                     bf16_to_f32(static_cast<bf16_t>(projected[step].x >> 16)) + bias.y,
                                     bf16_to_f32(static_cast<bf16_t>(projected[step].y & 0xffffu)) + bias.z,
                                     bf16_to_f32(static_cast<bf16_t>(projected[step].y >> 16)) + bias.w);
        const bool is_bounded = gate_law != KDA_GATE_SOFTPLUS;
        *reinterpret_cast<float4*>(gate + token * row_stride + channel) =
            make_float4(kda_forget_gate(u.x, a, is_bounded, lower_bound), kda_forget_gate(u.y, a, is_bounded, lower_bound),
                        kda_forget_gate(u.z, a, is_bounded, lower_bound), kda_forget_gate(u.w, a, is_bounded, lower_bound));
        if (d == 0) {
            beta[token * heads + head] = sigmoid_f32(bf16_to_f32(beta_logits[token * ld_beta + head]));
        }
    }
}
