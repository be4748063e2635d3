// The awaiting entries of gemm_rows_decode.cu that stage their weight in shared memory while the awaited
// kernel runs, same bits: the staged form copies its column group whole, the tail form each warp's last k
// blocks. Launch: 256 threads, grid (column groups, 1); shared memory: docs/kernels.md, 'Row projection'.
#include "projection/gemm_rows.cuh"

template <int N_TILES, bool TAIL, bool SUMS = false>
__device__ __forceinline__ void gemm_rows_staged_entry(const bf16_t* __restrict__ x, int ldx,
                                                       const bf16_t* __restrict__ w, bf16_t* __restrict__ y,
                                                       int ldy, int rows, int n, int k, GemmRowsAwait awaited,
                                                       int tail_blocks = 0, GemmRowsSums sums = {nullptr, 0})
{
    extern __shared__ __align__(128) unsigned char gemm_rows_stage[];

    kda_let_next_kernel_launch();
    const int k_split = k_split_for(k);
    const int group_tiles = gemm_rows_group_columns<N_TILES>(k_split) / GEMM_ROWS_N_TILE;
    const int tiles = (n + GEMM_ROWS_N_TILE - 1) / GEMM_ROWS_N_TILE;
    const int first_tile = blockIdx.x * group_tiles;
    // (Block-uniform. A block without a group still counts itself past the wait.)
    const bool sweeps = rows <= GEMM_ROWS_M_TILE && blockIdx.y == 0 && blockDim.x == GEMM_ROWS_THREADS &&
                        first_tile < tiles;
    const size_t tile_elements = static_cast<size_t>(gemm_rows_k_blocks(k)) * GEMM_ROWS_PACKED_BLOCK;
    if (sweeps) {
        if constexpr (TAIL) {
            gemm_rows_stage_tail<N_TILES>(reinterpret_cast<bf16_t*>(gemm_rows_stage), w, n, k, k_split, blockIdx.x,
                                          tail_blocks);
        } else {
            const int stage_tiles = min(group_tiles, tiles - first_tile);
            gemm_rows_stage_weights(gemm_rows_stage, w + first_tile * tile_elements,
                                    static_cast<unsigned int>(stage_tiles * tile_elements * sizeof(bf16_t)),
                                    threadIdx.x, blockDim.x);
        }
    }
    const bf16_t* stage = reinterpret_cast<const bf16_t*>(gemm_rows_stage);
    // (TAIL: the first step of each warp's range, loaded before the wait; else unused.)
    uint4 first[TAIL ? gemm_rows_k_unroll<1, N_TILES>() : 1][N_TILES];
    if constexpr (TAIL) {
        if (sweeps) {
            gemm_rows_first_step<N_TILES>(first, w, n, k, k_split, blockIdx.x, tail_blocks);
        }
    }
    const int passed = gemm_rows_await(awaited);
    if (sweeps) {
        // A 16-byte zero chunk, then x's rows padded to whole k blocks, where the largest stage ends.
        const size_t stage_elements =
            TAIL ? static_cast<size_t>(GEMM_ROWS_WARPS) * N_TILES * tail_blocks * GEMM_ROWS_PACKED_BLOCK
                 : min(group_tiles, tiles) * tile_elements;
        bf16_t* region = reinterpret_cast<bf16_t*>(gemm_rows_stage + stage_elements * sizeof(bf16_t));
        bf16_t* x_copy = region + 8;
        const int padded_k = gemm_rows_k_blocks(k) * GEMM_ROWS_K_BLOCK;
        const int vectors = padded_k / 8;  // 16-byte pieces of a row (k % 8 == 0, ldx % 8 == 0)
        if (threadIdx.x == 0) {
            *reinterpret_cast<uint4*>(region) = uint4{0u, 0u, 0u, 0u};
        }
        for (int index = threadIdx.x; index < rows * vectors; index += GEMM_ROWS_THREADS) {
            const int row = index / vectors, column = 8 * (index % vectors);
            *reinterpret_cast<uint4*>(x_copy + static_cast<size_t>(row) * padded_k + column) =
                load_produced_16B(x + static_cast<size_t>(row) * ldx + column, column < k);
        }
        if constexpr (!TAIL) {
            gemm_rows_wait_weights();  // (TAIL: each warp waits for its own copies where it reads them)
        }
        __syncthreads();
        if constexpr (TAIL) {
            gemm_rows_group<1, N_TILES, GEMM_X_SHARED, true, true, SUMS>(
                x_copy, padded_k, w, y, ldy, 0, rows, n, k, k_split, blockIdx.x, reinterpret_cast<float*>(region), 0,
                stage, tail_blocks, &first[0][0], sums);
        } else {
            gemm_rows_group<1, N_TILES, GEMM_X_STAGED, true, false, SUMS>(
                x_copy, padded_k, stage, y, ldy, 0, rows, n, k, k_split, blockIdx.x, reinterpret_cast<float*>(region),
                first_tile, nullptr, 0, nullptr, sums);
        }
    }
    gemm_rows_end_awaited(awaited, passed);
}

// The entries of a form, writing y alone or the FP32 sums too. LAST: the name of the ninth int
// parameter (unnamed where unused), TAIL_BLOCKS what the form passes for tail_blocks.
#define GEMM_ROWS_STAGED_FORM(FORM, MIN_BLOCKS, TAIL, LAST, TAIL_BLOCKS, N_TILES)                          \
    extern "C" __global__ void __launch_bounds__(GEMM_ROWS_THREADS, MIN_BLOCKS)                             \
        kda_gemm_rows_##FORM##_awaiting_bf16_m1_n##N_TILES(GEMM_ROWS_PARAMETERS(LAST),                      \
                                                           GEMM_ROWS_AWAIT_PARAMETERS)                      \
    {                                                                                                      \
        gemm_rows_staged_entry<N_TILES, TAIL>(x, ldx, w, y, ldy, rows, n, k, GemmRowsAwait{ready, ready_target}, \
                                              TAIL_BLOCKS);                                                \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(GEMM_ROWS_THREADS, MIN_BLOCKS)                             \
        kda_gemm_rows_##FORM##_awaiting_sums_bf16_m1_n##N_TILES(GEMM_ROWS_PARAMETERS(LAST),                 \
                                                                GEMM_ROWS_AWAIT_PARAMETERS,                 \
                                                                GEMM_ROWS_SUMS_PARAMETERS)                  \
    {                                                                                                      \
        gemm_rows_staged_entry<N_TILES, TAIL, true>(x, ldx, w, y, ldy, rows, n, k,                          \
                                                    GemmRowsAwait{ready, ready_target}, TAIL_BLOCKS,        \
                                                    GemmRowsSums{sums, ld_sums});                           \
    }

// 3 blocks per SM (at most 85 registers): three 64 KB stages fit an SM's shared memory.
#define GEMM_ROWS_STAGED_MIN_BLOCKS 3
#define GEMM_ROWS_STAGED_ENTRY(N_TILES) \
    GEMM_ROWS_STAGED_FORM(staged, GEMM_ROWS_STAGED_MIN_BLOCKS, false, /* prefetch */, 0, N_TILES)
GEMM_ROWS_STAGED_ENTRY(1)
GEMM_ROWS_STAGED_ENTRY(2)

// 2 blocks per SM (up to 128 registers, the sweep's): two tails of about 96 KB and x's rows fit an SM.
#define GEMM_ROWS_TAIL_MIN_BLOCKS 2
#define GEMM_ROWS_TAIL_STAGED_ENTRY(N_TILES) \
    GEMM_ROWS_STAGED_FORM(tail_staged, GEMM_ROWS_TAIL_MIN_BLOCKS, true, tail_blocks, tail_blocks, N_TILES)
GEMM_ROWS_TAIL_STAGED_ENTRY(1)
GEMM_ROWS_TAIL_STAGED_ENTRY(2)
GEMM_ROWS_TAIL_STAGED_ENTRY(4)
