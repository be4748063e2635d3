// The tensor-core chunk prepare that forms the forget gate and beta from the projections (the low-rank
// gate's output forget_proj, dt_bias, A_log and the beta logits) and writes them out beside its other
// outputs; the bounded gate law. Launch, algorithm and numerics: chunk_tc.cuh.
#include "chunk/chunk_tc.cuh"

CHUNK_TC_PREPARE_GATE_ENTRY(kda_chunk_tc_prepare_gate_f32, false)
