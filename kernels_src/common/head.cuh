// The head geometry every per-head kernel is compiled for.
#pragma once

// Head dimension D, a compile-time constant: state columns of D floats are kept in registers.
#define KDA_HEAD_DIM 128

// Threads per block of every per-head kernel (one thread per channel of a head).
#define KDA_HEAD_BLOCK 128
