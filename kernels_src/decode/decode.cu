// The stateful half of decode in one launch (docs/design.md): for each sequence, `tokens` consecutive tokens
// and each head, conv + SiLU, L2, gate, beta, delta-rule step and gated RMSNorm, each with prefill's bits.
// Launch: grid (heads, sequences), 128 threads, no dynamic shared memory; thread d owns channel d of the
// head's q, k, v and value column d of the state. Options: docs/kernels.md, 'Fused decode step'.
#include "decode/decode_head.cuh"

extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
kda_decode_fused_bf16(float* __restrict__ conv_state, float* __restrict__ state, const int* __restrict__ slots,
                      const bf16_t* __restrict__ qkv_proj, const bf16_t* __restrict__ conv_w,
                      const bf16_t* __restrict__ forget_proj, const float* __restrict__ dt_bias,
                      const float* __restrict__ a_log, const bf16_t* __restrict__ beta_logits, int ld_beta,
                      const bf16_t* __restrict__ out_gate, const bf16_t* __restrict__ norm_w,
                      bf16_t* __restrict__ conv_out, float* __restrict__ query, float* __restrict__ key,
                      float* __restrict__ value, float* __restrict__ gate, float* __restrict__ beta,
                      float* __restrict__ core, bf16_t* __restrict__ o_norm_out, int heads, int kernel_size,
                      int tokens, int gate_law, float lower_bound, float scale, float l2_eps, float norm_eps,
                      int prefetch_ahead, int dependents_after, bf16_t* __restrict__ x_tiles, int* outputs_ready)
{
    __shared__ KdaStepShared shared;
    const int head = blockIdx.x;

    if (dependents_after == KDA_DEPENDENTS_AT_START) {
        kda_let_next_kernel_launch();
    }
    // Uniform over the block: a wrong geometry leaves whole blocks, before any sync.
    if (head >= heads || blockDim.x != KDA_HEAD_BLOCK || kernel_size < 1 || kernel_size > CONV_MAX_KERNEL ||
        tokens < 1) {
        return;
    }
    kda_decode_head(conv_state, state, slots, qkv_proj, conv_w, forget_proj, dt_bias, a_log, beta_logits, ld_beta,
                    out_gate, norm_w, conv_out, query, key, value, gate, beta, core, o_norm_out, heads, kernel_size,
                    tokens, gate_law, lower_bound, scale, l2_eps, norm_eps, prefetch_ahead, dependents_after,
                    x_tiles, outputs_ready, head, blockIdx.y, gridDim.y, threadIdx.x, shared);
}
