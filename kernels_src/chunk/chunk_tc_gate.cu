// The tensor-core chunk prepare that forms the forget gate and beta from the projections (the
// low-rank gate's output forget_proj, dt_bias, A_log and the beta logits) and writes them out
// beside its other outputs; the bounded gate law. Launch, algorithm and numerics: chunk_tc.cuh.
#include "chunk/chunk_tc.cuh"

// The prepare with the forget gate and beta formed from the projections and written out.
extern "C" __global__ void __launch_bounds__(CHUNK_TC_PREPARE_THREADS, 2)
kda_chunk_tc_prepare_gate_f32(const float* __restrict__ query, const float* __restrict__ key,
                              const float* __restrict__ value, float* __restrict__ gate,
                              float* __restrict__ beta, f16_t* __restrict__ q_decay,
                              f16_t* __restrict__ k_tail_t, f16_t* __restrict__ w,
                              float* __restrict__ u, f16_t* __restrict__ attn,
                              float* __restrict__ chunk_decay, int tokens, int heads, float scale,
                              float lower_bound, const bf16_t* __restrict__ forget_proj,
                              const float* __restrict__ dt_bias, const float* __restrict__ a_log,
                              const bf16_t* __restrict__ beta_logits, int ld_beta)
{
    chunk_tc_prepare<true>(ChunkRowsF32{query, key, value, 0.0f}, nullptr,
                           nullptr, gate, beta, q_decay, k_tail_t, w, u, attn, chunk_decay, tokens, heads, scale,
                           lower_bound, forget_proj, dt_bias, a_log, beta_logits, ld_beta);
}
