// The tensor-core chunk prepare that forms the forget gate and beta itself, as chunk_tc_gate.cu does,
// for the softplus gate law (Kimi-Linear: no lower bound, the unbounded prepare's diagonal blocks).
// Launch, algorithm and numerics: chunk_tc.cuh.
#include "chunk/chunk_tc.cuh"

CHUNK_TC_PREPARE_GATE_ENTRY(kda_chunk_tc_prepare_unbounded_gate_f32, true)
