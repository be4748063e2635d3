// kda_chunk_tc_prepare_gate_f32 (chunk_tc_gate.cu) reading q, k and v from the BF16 conv output
// [T, 3 H D] instead of the FP32 rows the conv kernel splits it into: q and k are normalised here
// (ChunkRowsConv in chunk_tc.cuh), bit for bit the values of that split, so its outputs are that
// entry's on it. Launch as that entry's: grid (nchunks, H), 256 threads, CHUNK_TC_PREPARE_SMEM_BYTES
// of dynamic shared memory.
#include "chunk/chunk_tc.cuh"

CHUNK_TC_PREPARE_GATE_ENTRY(kda_chunk_tc_prepare_gate_conv_f32, CONV)
