// The row projection on tensor cores, y[r, :] = bf16(x[r, :] @ w.T) for r < rows (1..256): every
// decode-side projection. Device code in gemm_rows.cuh. Launch: 256 threads; grid.y = ceil(rows / 64),
// grid.x any (a block loops over column groups). One entry point per (M_TILES, N_TILES) and form, so
// that one variant's code is in the instruction cache; no choice changes a bit (docs/kernels.md).
#include "projection/gemm_rows.cuh"

#define GEMM_ROWS_ENTRY_OF(NAME, M_TILES, N_TILES, PACKED)                                         \
    extern "C" __global__ void __launch_bounds__(GEMM_ROWS_THREADS, GEMM_ROWS_MIN_BLOCKS)          \
        NAME(GEMM_ROWS_PARAMETERS(prefetch))                                                       \
    {                                                                                              \
        gemm_rows_entry<M_TILES, N_TILES, PACKED>(x, ldx, w, y, ldy, rows, n, k, prefetch);        \
    }
// kda_gemm_rows_bf16_m<M>_n<N> reads w in torch Linear layout, kda_gemm_rows_packed_bf16_m<M>_n<N> packed.
#define GEMM_ROWS_ENTRY(M_TILES, N_TILES)                                                          \
    GEMM_ROWS_ENTRY_OF(kda_gemm_rows_bf16_m##M_TILES##_n##N_TILES, M_TILES, N_TILES, false)            \
    GEMM_ROWS_ENTRY_OF(kda_gemm_rows_packed_bf16_m##M_TILES##_n##N_TILES, M_TILES, N_TILES, true)

GEMM_ROWS_TILINGS(GEMM_ROWS_ENTRY)
