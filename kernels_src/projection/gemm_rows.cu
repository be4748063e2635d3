// The row projection on tensor cores, y[r, :] = bf16(x[r, :] @ w.T) for r < rows (1..256): every
// decode-side projection of the block, a stream of the weight bound by memory. The device code, its
// layout and its bit contract (one k order per k, whatever the rows, tiles or grid) are in
// gemm_rows.cuh.
//
// Launch: block 256 threads (8 warps); grid.y = ceil(rows / 64), grid.x = any number of blocks (a block
// loops over the column groups blockIdx.x + i gridDim.x). One entry point per (M_TILES, N_TILES) and
// form, so that one variant's code is in the instruction cache, not all of them: the wrapper picks
// M_TILES from the rows (1: <= 16, 2: <= 32, 4: more) and N_TILES and the grid from the shape.
// `prefetch`: k blocks per weight row asked of L2 before the wait on the previous kernel (0: none).
// None of these changes a bit.
#include "projection/gemm_rows.cuh"

#define GEMM_ROWS_ENTRY_OF(NAME, M_TILES, N_TILES, PACKED)                                         \
    extern "C" __global__ void __launch_bounds__(GEMM_ROWS_THREADS, GEMM_ROWS_MIN_BLOCKS)          \
        NAME(GEMM_ROWS_PARAMETERS(prefetch))                                                       \
    {                                                                                              \
        gemm_rows_entry<M_TILES, N_TILES, PACKED>(x, ldx, w, y, ldy, rows, n, k, prefetch);        \
    }
// kda_gemm_rows_bf16_m<M>_n<N> reads w in torch Linear layout, kda_gemm_rows_packed_bf16_m<M>_n<N> in the
// packed layout of gemm_rows.cuh (the same bits); gemm_rows_sums.cu has the forms that write the FP32
// sums too (a file of their own: the two files compile side by side).
#define GEMM_ROWS_ENTRY(M_TILES, N_TILES)                                                          \
    GEMM_ROWS_ENTRY_OF(kda_gemm_rows_bf16_m##M_TILES##_n##N_TILES, M_TILES, N_TILES, false)            \
    GEMM_ROWS_ENTRY_OF(kda_gemm_rows_packed_bf16_m##M_TILES##_n##N_TILES, M_TILES, N_TILES, true)

GEMM_ROWS_TILINGS(GEMM_ROWS_ENTRY)
