// The tensor-core scan with the gated RMSNorm in its epilogue (sm_90a): the head's four blocks form a
// cluster and exchange each row's partial sums of squares through distributed shared memory, so that the
// scan writes o_proj's BF16 input directly and the FP32 core need not be written or read back
// (docs/kernels.md, 'The scan with the norm'). Launch: (heads, D / 32) x 128 threads, clusters of
// (1, 4, 1), CHUNK_TC_SCAN_NORM_SMEM_BYTES of dynamic shared memory.
#include "chunk/chunk_tc_scan.cuh"

// q_decay .. heads as kda_chunk_tc_scan_f32 (core may be null: not written); out_gate [T, H D] BF16,
// norm_w [D] BF16, o_norm_out [T, H D] BF16 (4-byte aligned rows).
extern "C" __global__ void __cluster_dims__(1, KDA_HEAD_DIM / CHUNK_TC_SCAN_COLUMNS, 1)
__launch_bounds__(CHUNK_TC_SCAN_THREADS, 2)
kda_chunk_tc_scan_norm_bf16(const f16_t* __restrict__ q_decay, const f16_t* __restrict__ k_tail_t,
                            const f16_t* __restrict__ w, const float* __restrict__ u,
                            const f16_t* __restrict__ attn, const float* __restrict__ chunk_decay,
                            float* __restrict__ state, float* __restrict__ core, const bf16_t* __restrict__ out_gate,
                            const bf16_t* __restrict__ norm_w, bf16_t* __restrict__ o_norm_out, int tokens,
                            int heads, float norm_eps)
{
    chunk_tc_scan_block<true>(q_decay, k_tail_t, w, u, attn, chunk_decay, state, core, tokens, heads, out_gate,
                              norm_w, o_norm_out, norm_eps);
}
