// The one-sequence decode forms of the row projection: up to 16 rows of a packed weight, launched as
// kda_gemm_rows_packed_bf16_m1_n<N> (the same bits; gemm_rows.cu, device code in gemm_rows.cuh).
//   kda_gemm_rows_packed_pair_bf16_m1_n<N>: a second projection of the same shapes in the same launch,
//     y2 = x2 @ w2.T after y = x @ w.T: one launch and one wait for two small projections.
//   kda_gemm_rows_packed_awaiting_bf16_m1_n<N>: launched as a programmatic dependent of a kernel that
//     counts its blocks' outputs out in ready[0] (the fused decode step's outputs_ready), it reads x
//     (through L2) once ready[0] reaches ready_target, not once that kernel ends; the last block past
//     the wait sets ready[0..1] back to zero, and each block ends only after that kernel has.
//   kda_gemm_rows_packed_awaiting_sums_bf16_m1_n<N>: the awaiting entry writing the FP32 sums too
//     (sums, ld_sums after its words), as gemm_rows_sums.cu's entries do.
// gemm_rows_staged.cu has the awaiting forms that stage their weights (a file of its own so that the
// two compile side by side). Launch: 256 threads, grid as gemm_rows.cu's.
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
