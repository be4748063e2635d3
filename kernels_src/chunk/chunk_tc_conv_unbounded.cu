// kda_chunk_tc_prepare_unbounded_f32 (chunk_tc.cu) reading q, k and v from the BF16 conv output
// instead of the FP32 rows the conv kernel splits it into (ChunkRowsConv in chunk_tc.cuh). Launch as
// that entry's: grid (nchunks, H), 256 threads, CHUNK_TC_PREPARE_SMEM_BYTES of dynamic shared memory.
#include "chunk/chunk_tc.cuh"

CHUNK_TC_PREPARE_ENTRY(kda_chunk_tc_prepare_unbounded_conv_f32, true, CONV)
