// The one-sequence decode forms of the row projection, up to 16 rows of a packed weight with the bits of
// kda_gemm_rows_packed_bf16_m1_n<N>: the pair entry (two projections of one shape), the awaiting entries
// (x read once ready[0] reaches ready_target) and their *_sums_* forms (sums, ld_sums after the words).
// Launch: 256 threads, grid as gemm_rows.cu's (docs/kernels.md, 'Row projection').
#include "projection/gemm_rows.cuh"

#define GEMM_ROWS_DECODE_ENTRIES(N_TILES)                                                          \
    extern "C" __global__ void __launch_bounds__(GEMM_ROWS_THREADS, GEMM_ROWS_MIN_BLOCKS)          \
        kda_gemm_rows_packed_pair_bf16_m1_n##N_TILES(GEMM_ROWS_PARAMETERS(prefetch),                     \
                                                 const bf16_t* __restrict__ x2,                       \
                                                 const bf16_t* __restrict__ w2, bf16_t* __restrict__ y2) \
    {                                                                                              \
        gemm_rows_entry<1, N_TILES, true>(x, ldx, w, y, ldy, rows, n, k, prefetch, GemmRowsSecond{x2, w2, y2}); \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(GEMM_ROWS_THREADS, GEMM_ROWS_MIN_BLOCKS)          \
        kda_gemm_rows_packed_awaiting_bf16_m1_n##N_TILES(GEMM_ROWS_PARAMETERS(prefetch),                 \
                                                     GEMM_ROWS_AWAIT_PARAMETERS)                      \
    {                                                                                              \
        gemm_rows_entry<1, N_TILES, true, GEMM_X_PRODUCED>(x, ldx, w, y, ldy, rows, n, k, prefetch,   \
                                                           GemmRowsSecond{nullptr, nullptr, nullptr}, \
                                                           GemmRowsAwait{ready, ready_target});       \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(GEMM_ROWS_THREADS, GEMM_ROWS_MIN_BLOCKS)          \
        kda_gemm_rows_packed_awaiting_sums_bf16_m1_n##N_TILES(GEMM_ROWS_PARAMETERS(prefetch),            \
                                                          GEMM_ROWS_AWAIT_PARAMETERS,                 \
                                                          GEMM_ROWS_SUMS_PARAMETERS)                  \
    {                                                                                              \
        gemm_rows_entry<1, N_TILES, true, GEMM_X_PRODUCED, true>(                                   \
            x, ldx, w, y, ldy, rows, n, k, prefetch, GemmRowsSecond{nullptr, nullptr, nullptr},     \
            GemmRowsAwait{ready, ready_target}, GemmRowsSums{sums, ld_sums});                       \
    }
GEMM_ROWS_DECODE_ENTRIES(1)
GEMM_ROWS_DECODE_ENTRIES(2)
GEMM_ROWS_DECODE_ENTRIES(4)
