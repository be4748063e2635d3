// The head geometry every per-head kernel is compiled for.
#ifndef KDA_COMMON_HEAD_CUH
#define KDA_COMMON_HEAD_CUH

// Head dimension D. The decode step and the chunk scans keep a state column of D floats in
// registers, so D must be a compile-time constant.
#define KDA_HEAD_DIM 128

// Threads per block of every per-head kernel (one thread per channel of a head).
#define KDA_HEAD_BLOCK 128

#endif  // KDA_COMMON_HEAD_CUH
