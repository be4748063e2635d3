// Forget gate (per-channel log-decay) and beta (per-head write strength), FP32.
//   u = forget_proj[t, c] + dt_bias[c],  c = h * head_dim + d
//   a = exp(A_log[h])
//   bounded law:  gate = lower_bound * sigmoid(a * u)
//   softplus law: gate = -a * softplus(u),  softplus(u) = u for u > 20
//   beta[t, h] = sigmoid(beta_logits[t, h])
//
// Launch: grid (heads, ceil(T / KDA_TOKENS_PER_BLOCK)), block head_dim = 128: one
// thread per channel, one block per head and group of 8 tokens, so exp(A_log[h]) is a
// block-uniform value and thread 0 can write the head's beta without a second launch;
// the group amortises a block's start over 8 rows (the arithmetic of an element does
// not depend on the grouping).
#include "kda_common.cuh"

extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
gate_beta_f32(const bf16_t* __restrict__ forget_proj, const float* __restrict__ dt_bias,
              const float* __restrict__ a_log, const bf16_t* __restrict__ beta_logits,
              int ld_beta, float* __restrict__ gate, float* __restrict__ beta, int heads,
              int head_dim, int bounded, float lower_bound, int tokens)
{
    const int head = blockIdx.x;
    const int d = threadIdx.x;
    if (head >= heads || d >= head_dim) {
        return;
    }
    const int channel = head * head_dim + d;
    // dt_bias is per CHANNEL ([heads * head_dim]), A_log is per HEAD ([heads]).
    // Indexing A_log by channel (or dt_bias by head) reads valid memory and gives a
    // plausible-looking gate: the highest-risk line of the block.
    const float bias = dt_bias[channel];
    const float a = expf(a_log[head]);
    const int first = blockIdx.y * KDA_TOKENS_PER_BLOCK;
#pragma unroll
    for (int i = 0; i < KDA_TOKENS_PER_BLOCK; ++i) {
        const size_t token = static_cast<size_t>(first + i);
        if (first + i >= tokens) {
            break;
        }
        const size_t index = token * heads * head_dim + channel;
        gate[index] = kda_forget_gate(bf16_to_f32(forget_proj[index]) + bias, a, bounded != 0, lower_bound);
        if (d == 0) {
            beta[token * heads + head] =
                sigmoid_f32(bf16_to_f32(beta_logits[token * ld_beta + head]));
        }
    }
}
