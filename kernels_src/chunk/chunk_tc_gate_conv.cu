// kda_chunk_tc_prepare_gate_f32 (chunk_tc_gate.cu) reading q, k and v from the BF16 conv output
// [T, 3 H D] instead of the FP32 rows the conv kernel splits it into: q and k are normalised here with
// l2_eps (ChunkRowsConv in chunk_tc.cuh), bit for bit the values of that split, so its outputs are
// that entry's on it. A file of its own so that it compiles beside the others. Launch as that entry's:
// grid (nchunks, H), 256 threads, CHUNK_TC_PREPARE_SMEM_BYTES of dynamic shared memory.
#include "chunk/chunk_tc.cuh"

extern "C" __global__ void __launch_bounds__(CHUNK_TC_PREPARE_THREADS, 2)
kda_chunk_tc_prepare_gate_conv_f32(const bf16_t* __restrict__ conv_out, float l2_eps, float* __restrict__ gate,
                                   float* __restrict__ beta, f16_t* __restrict__ q_decay,
                                   f16_t* __restrict__ k_tail_t, f16_t* __restrict__ w, float* __restrict__ u,
                                   f16_t* __restrict__ attn, float* __restrict__ chunk_decay, int tokens, int heads,
                                   float scale, float lower_bound, const bf16_t* __restrict__ forget_proj,
                                   const float* __restrict__ dt_bias, const float* __restrict__ a_log,
                                   const bf16_t* __restrict__ beta_logits, int ld_beta)
{
    chunk_tc_prepare<true, false, ChunkRowsConv>(ChunkRowsConv{conv_out, l2_eps}, nullptr, nullptr,
                                                 gate, beta, q_decay, k_tail_t, w, u, attn, chunk_decay, tokens,
                                                 heads, scale, lower_bound, forget_proj, dt_bias, a_log, beta_logits,
                                                 ld_beta);
}
