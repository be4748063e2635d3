// Projection GEMM for decode, speculative verify and batched decode, on tensor cores: the
// entry points. The device code, its layout and its bit contract are in gemm_rows.cuh.
#include "gemm_rows.cuh"

// Launch: block 256 threads, no dynamic shared memory; grid.y = ceil(rows / 64), grid.x =
// any number of blocks (a block loops over the column groups blockIdx.x + i gridDim.x).
// One entry point per (M_TILES, N_TILES), named gemm_rows_bf16_m<M>_n<N>: the wrapper picks
// M_TILES from the rows (1: <= 16, 2: <= 32, 4: more; a row group with fewer rows leaves the
// extra m-tiles predicated off) and N_TILES and the grid from the shape. Separate entries
// keep each kernel's code small: one variant in the instruction cache, not all of them.
// `prefetch` (k blocks per weight row, 0 for none) asks L2 for the first weights before the
// wait on the previous kernel; like the tiles and the grid it changes no bit.
template <int M_TILES, int N_TILES, bool PACKED>
__device__ __forceinline__ void gemm_rows_entry(const bf16_t* __restrict__ x, int ldx,
                                                const bf16_t* __restrict__ w, bf16_t* __restrict__ y,
                                                int ldy, int rows, int n, int k, int prefetch)
{
    __shared__ float partial[GEMM_ROWS_PARTIAL_FLOATS(M_TILES, N_TILES)];
    KDA_TRACE_SCOPE(y);

    kda_let_next_kernel_launch();
    const int row_begin = blockIdx.y * GEMM_ROWS_M_GROUP;
    if (row_begin >= rows || blockDim.x != GEMM_ROWS_THREADS) {
        return;
    }
    const int row_end = min(rows, row_begin + GEMM_ROWS_M_GROUP);
    gemm_rows_sweep<M_TILES, N_TILES, PACKED>(x, ldx, w, y, ldy, row_begin, row_end, n, k, k_split_for(k),
                                              prefetch, partial);
}

#define GEMM_ROWS_ENTRY_OF(NAME, M_TILES, N_TILES, PACKED)                                         \
    extern "C" __global__ void __launch_bounds__(GEMM_ROWS_THREADS, GEMM_ROWS_MIN_BLOCKS)          \
        NAME(const bf16_t* __restrict__ x, int ldx, const bf16_t* __restrict__ w,                  \
             bf16_t* __restrict__ y, int ldy, int rows, int n, int k, int prefetch)                \
    {                                                                                              \
        gemm_rows_entry<M_TILES, N_TILES, PACKED>(x, ldx, w, y, ldy, rows, n, k, prefetch);        \
    }
// gemm_rows_bf16_m<M>_n<N> reads w in torch Linear layout, gemm_rows_packed_bf16_m<M>_n<N> in the
// packed layout of gemm_rows.cuh (the same bits).
#define GEMM_ROWS_ENTRY(M_TILES, N_TILES)                                                          \
    GEMM_ROWS_ENTRY_OF(gemm_rows_bf16_m##M_TILES##_n##N_TILES, M_TILES, N_TILES, false)            \
    GEMM_ROWS_ENTRY_OF(gemm_rows_packed_bf16_m##M_TILES##_n##N_TILES, M_TILES, N_TILES, true)

// Every variant is compiled for 2 blocks per SM (up to 128 registers per thread; 3 blocks
// of the narrow variants, at 80, measured no faster on an H200); GEMM_ROWS_BLOCKS_PER_SM in
// glm_kda/gemm_rows.py mirrors it.
#define GEMM_ROWS_MIN_BLOCKS 2
GEMM_ROWS_ENTRY(1, 1)
GEMM_ROWS_ENTRY(1, 2)
GEMM_ROWS_ENTRY(1, 4)
GEMM_ROWS_ENTRY(2, 1)
GEMM_ROWS_ENTRY(2, 2)
GEMM_ROWS_ENTRY(2, 4)
GEMM_ROWS_ENTRY(4, 1)
GEMM_ROWS_ENTRY(4, 2)

// The serial sweep of gemm_rows.cuh (33..64 rows of a wide weight): block GEMM_ROWS_SERIAL_THREADS
// threads, no shared memory, grid.x any number of blocks (each loops over the column groups of
// GEMM_ROWS_SERIAL_WARPS * N_TILES tiles), grid.y the row groups of 64. The same bits as the entries
// above. `prefetch` is accepted and unused: its warps' first weights are those of k range 0 only.
template <int M_TILES, int N_TILES, bool PACKED>
__device__ __forceinline__ void gemm_rows_serial_entry(const bf16_t* __restrict__ x, int ldx,
                                                       const bf16_t* __restrict__ w, bf16_t* __restrict__ y,
                                                       int ldy, int rows, int n, int k)
{
    KDA_TRACE_SCOPE(y);
    kda_let_next_kernel_launch();
    const int row_begin = blockIdx.y * GEMM_ROWS_M_GROUP;
    if (row_begin >= rows || blockDim.x != GEMM_ROWS_SERIAL_THREADS) {
        return;
    }
    const int row_end = min(rows, row_begin + GEMM_ROWS_M_GROUP);
    gemm_rows_serial_sweep<M_TILES, N_TILES, PACKED>(x, ldx, w, y, ldy, row_begin, row_end, n, k, k_split_for(k));
}

// Serial blocks per SM the entries are compiled for: 3 (up to 168 registers; the running total
// beside the accumulators spills at 128, the bound of 4).
#ifndef GEMM_ROWS_SERIAL_MIN_BLOCKS
#define GEMM_ROWS_SERIAL_MIN_BLOCKS 3
#endif
#define GEMM_ROWS_SERIAL_ENTRY_OF(NAME, M_TILES, N_TILES, PACKED)                                  \
    extern "C" __global__ void __launch_bounds__(GEMM_ROWS_SERIAL_THREADS, GEMM_ROWS_SERIAL_MIN_BLOCKS) \
        NAME(const bf16_t* __restrict__ x, int ldx, const bf16_t* __restrict__ w,                  \
             bf16_t* __restrict__ y, int ldy, int rows, int n, int k, int /* prefetch */)          \
    {                                                                                              \
        gemm_rows_serial_entry<M_TILES, N_TILES, PACKED>(x, ldx, w, y, ldy, rows, n, k);           \
    }
#define GEMM_ROWS_SERIAL_ENTRY(M_TILES, N_TILES)                                                   \
    GEMM_ROWS_SERIAL_ENTRY_OF(gemm_rows_serial_bf16_m##M_TILES##_n##N_TILES, M_TILES, N_TILES, false) \
    GEMM_ROWS_SERIAL_ENTRY_OF(gemm_rows_packed_serial_bf16_m##M_TILES##_n##N_TILES, M_TILES, N_TILES, true)

GEMM_ROWS_SERIAL_ENTRY(4, 2)
