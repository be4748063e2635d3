// The tensor-core chunked prefill's kernels: the prepare (bounded and unbounded gate laws, gate and
// beta read) and the scan across chunks. Launch, shared memory and numerics: chunk_tc.cuh.
#include "chunk/chunk_tc_scan.cuh"

CHUNK_TC_PREPARE_ENTRY(kda_chunk_tc_prepare_f32, false)
CHUNK_TC_PREPARE_ENTRY(kda_chunk_tc_prepare_unbounded_f32, true)

extern "C" __global__ void __launch_bounds__(CHUNK_TC_SCAN_THREADS, 2)
kda_chunk_tc_scan_f32(const f16_t* __restrict__ q_decay, const f16_t* __restrict__ k_tail_t,
                      const f16_t* __restrict__ w, const float* __restrict__ u,
                      const f16_t* __restrict__ attn, const float* __restrict__ chunk_decay,
                      float* __restrict__ state, float* __restrict__ core, int tokens, int heads)
{
    chunk_tc_scan_block<false>(q_decay, k_tail_t, w, u, attn, chunk_decay, state, core, tokens, heads, nullptr,
                               nullptr, nullptr, 0.0f);
}
