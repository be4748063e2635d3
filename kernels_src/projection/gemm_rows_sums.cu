// The row projection of gemm_rows.cu also writing each output's FP32 sum to sums[row * ld_sums + column]:
// a tensor-parallel rank's partial output. w row-major (kda_gemm_rows_sums_bf16_m<M>_n<N>) or packed
// (kda_gemm_rows_packed_sums_bf16_m<M>_n<N>). Launch and parameters: gemm_rows.cu's, then sums, ld_sums.
#include "projection/gemm_rows.cuh"

#define GEMM_ROWS_SUMS_ENTRY_OF(NAME, M_TILES, N_TILES, PACKED)                                    \
    extern "C" __global__ void __launch_bounds__(GEMM_ROWS_THREADS, GEMM_ROWS_MIN_BLOCKS)          \
        NAME(GEMM_ROWS_PARAMETERS(prefetch), GEMM_ROWS_SUMS_PARAMETERS)                            \
    {                                                                                              \
        gemm_rows_entry<M_TILES, N_TILES, PACKED, GEMM_X_INPUT, true>(                             \
            x, ldx, w, y, ldy, rows, n, k, prefetch, GemmRowsSecond{nullptr, nullptr, nullptr},    \
            GemmRowsAwait{nullptr, 0}, GemmRowsSums{sums, ld_sums});                               \
    }
#define GEMM_ROWS_SUMS_ENTRY(M_TILES, N_TILES)                                                     \
    GEMM_ROWS_SUMS_ENTRY_OF(kda_gemm_rows_sums_bf16_m##M_TILES##_n##N_TILES, M_TILES, N_TILES, false)  \
    GEMM_ROWS_SUMS_ENTRY_OF(kda_gemm_rows_packed_sums_bf16_m##M_TILES##_n##N_TILES, M_TILES, N_TILES, true)

GEMM_ROWS_TILINGS(GEMM_ROWS_SUMS_ENTRY)
