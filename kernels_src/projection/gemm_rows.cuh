// Device code of the row projection (the gemm_rows*.cu entries run it), on mma.sync m16n8k16:
//   y[r, j] = bf16( sum_i x[r, i] * w[j, i] )   for r < rows (1..256), j < n
// x [rows, k] (row stride ldx), w [n, k] (torch Linear layout, or packed), y [rows, n] (row stride ldy).
// A row's bits depend on k alone, never on the rows or the launch. Requires k % 8 == 0, ldx % 8 == 0 and
// 16-byte aligned x and w. Bit contract, fragment trick and forms: docs/kernels.md, 'Row projection'.
#pragma once

#include "common/bf16.cuh"
#include "common/sync.cuh"

#define GEMM_ROWS_WARPS 8
#define GEMM_ROWS_THREADS (GEMM_ROWS_WARPS * 32)
#define GEMM_ROWS_K_BLOCK 32
#define GEMM_ROWS_M_TILE 16
#define GEMM_ROWS_N_TILE 8
// Rows per blockIdx.y: 4 m-tiles swept together over one read of w.
#define GEMM_ROWS_M_GROUP 64
// Weight loads per lane and step with one m-tile (8 / M_TILES with more), for 2 blocks per SM.
#define GEMM_ROWS_LOADS 8

// The PTX of the predicated 16-byte loads below: zeros, then LOAD (opcode and cache qualifiers) where valid.
#define GEMM_ROWS_LOAD_16B(LOAD)                                                                  \
    "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t"                                             \
    "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"                    \
    "@p " LOAD ".v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
#define GEMM_ROWS_LOAD_16B_OPERANDS(value, pointer, valid)                                          \
    "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w) : "l"(pointer), "r"(static_cast<int>(valid))

// 16 bytes of w, streamed once. Zeros where not `valid`, as for every load below.
__device__ __forceinline__ uint4 load_weight_16B(const bf16_t* pointer, bool valid)
{
    uint4 value;
    asm(GEMM_ROWS_LOAD_16B("ld.global.nc.L1::no_allocate.L2::256B")
        : GEMM_ROWS_LOAD_16B_OPERANDS(value, pointer, valid));
    return value;
}

// load_weight_16B kept in program order (volatile): a load issued ahead of a wait must stay there.
__device__ __forceinline__ uint4 load_weight_16B_in_order(const bf16_t* pointer, bool valid)
{
    uint4 value;
    asm volatile(GEMM_ROWS_LOAD_16B("ld.global.nc.L1::no_allocate.L2::256B")
                 : GEMM_ROWS_LOAD_16B_OPERANDS(value, pointer, valid));
    return value;
}

// 16 bytes of a block's shared-memory copy of its weights or of x (the staged entries).
__device__ __forceinline__ uint4 load_shared_16B(const bf16_t* pointer, bool valid)
{
    return valid ? *reinterpret_cast<const uint4*>(pointer) : uint4{0u, 0u, 0u, 0u};
}

// Ask L2 for one 128-byte line (no register, no wait).
__device__ __forceinline__ void prefetch_l2(const void* pointer)
{
    asm volatile("prefetch.global.L2 [%0];" ::"l"(pointer));
}

// 16 bytes of x, read by every block: cached in L1. Coherent and in program order, since a read-only
// load may be scheduled ahead of a programmatic launch's wait.
__device__ __forceinline__ uint4 load_activation_16B(const bf16_t* pointer, bool valid)
{
    uint4 value;
    asm volatile(GEMM_ROWS_LOAD_16B("ld.global") : GEMM_ROWS_LOAD_16B_OPERANDS(value, pointer, valid));
    return value;
}

// 16 bytes of x that a kernel still running wrote: from L2, never a stale L1 line.
__device__ __forceinline__ uint4 load_produced_16B(const bf16_t* pointer, bool valid)
{
    return valid ? __ldcg(reinterpret_cast<const uint4*>(pointer)) : uint4{0u, 0u, 0u, 0u};
}

__device__ __forceinline__ unsigned int word_of(const uint4& v, int index)
{
    return index == 0 ? v.x : index == 1 ? v.y : index == 2 ? v.z : v.w;
}

// acc[16 x 8] += A[16 x 16] * B[16 x 8], FP32 accumulate, in PTX's fragment layout.
__device__ __forceinline__ void mma_bf16_m16n8k16(float acc[4], unsigned int a0, unsigned int a1,
                                                  unsigned int a2, unsigned int a3,
                                                  unsigned int b0, unsigned int b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// k16 step `step` (0, 1) of a 32-k block by the fragment trick: words 2 step, 2 step + 1 of each load.
__device__ __forceinline__ void mma_bf16_step(float acc[4], const uint4& low, const uint4& high, const uint4& b,
                                              int step)
{
    mma_bf16_m16n8k16(acc, word_of(low, 2 * step), word_of(high, 2 * step), word_of(low, 2 * step + 1),
                      word_of(high, 2 * step + 1), word_of(b, 2 * step), word_of(b, 2 * step + 1));
}

template <class Floats>
__device__ __forceinline__ void zero_floats(Floats& values)
{
    float* flat = reinterpret_cast<float*>(&values);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(Floats) / sizeof(float)); ++i) {
        flat[i] = 0.0f;
    }
}

__device__ __forceinline__ int gemm_rows_k_blocks(int k)
{
    return (k + GEMM_ROWS_K_BLOCK - 1) / GEMM_ROWS_K_BLOCK;
}

// Warps splitting the k axis of a block: a function of k alone, since it fixes every output's summation
// order (glm_kda.gpu.projection mirrors it).
__device__ __forceinline__ int k_split_for(int k)
{
    const int k_blocks = gemm_rows_k_blocks(k);
    int split = GEMM_ROWS_WARPS;
    while (split > 1 && k_blocks < 4 * split) {
        split >>= 1;
    }
    return split;
}

// The weight fragments of one step (K_UNROLL k blocks from kb_step on), zeros past the range or matrix.
template <int K_UNROLL, int N_TILES, bool W_SHARED = false, bool IN_ORDER = false>
__device__ __forceinline__ void load_weight_step(uint4 (&w_frag)[K_UNROLL][N_TILES], const bf16_t* w_lane,
                                                 int tile_stride, int block_stride, const bool (&w_valid)[N_TILES],
                                                 int kb_step, int kb_end, int k, int thread_in_group)
{
#pragma unroll
    for (int u = 0; u < K_UNROLL; ++u) {
        const int k_offset = (kb_step + u) * GEMM_ROWS_K_BLOCK;
        const bool k_valid = kb_step + u < kb_end && k_offset + 8 * thread_in_group < k;
#pragma unroll
        for (int j = 0; j < N_TILES; ++j) {
            const bf16_t* pointer = w_lane + (j * tile_stride + (kb_step + u) * block_stride);
            if constexpr (W_SHARED) {
                w_frag[u][j] = load_shared_16B(pointer, w_valid[j] && k_valid);
            } else if constexpr (IN_ORDER) {
                w_frag[u][j] = load_weight_16B_in_order(pointer, w_valid[j] && k_valid);
            } else {
                w_frag[u][j] = load_weight_16B(pointer, w_valid[j] && k_valid);
            }
        }
    }
}

// The packed weight layout: packed[tile][kb][lane][e] = w[8 tile + lane / 4, 32 kb + 8 (lane % 4) + e].
#define GEMM_ROWS_PACKED_BLOCK (GEMM_ROWS_N_TILE * GEMM_ROWS_K_BLOCK)  // elements per (tile, k block)

// Blocks of 32 k per step of gemm_rows_accumulate: GEMM_ROWS_LOADS (m-tile, n-tile, k block) products a lane.
template <int M_TILES, int N_TILES>
__device__ __forceinline__ constexpr int gemm_rows_k_unroll()
{
    return GEMM_ROWS_LOADS / (M_TILES * N_TILES);
}

// Where one lane's weight is: tile j's k block kb at lane + j * tile_stride + kb * block_stride (one
// pointer, so that the registers go to loads in flight).
template <int N_TILES>
struct GemmRowsWeightLane {
    const bf16_t* lane;
    int tile_stride;
    int block_stride;
    bool valid[N_TILES];
};

template <int N_TILES>
__device__ __forceinline__ GemmRowsWeightLane<N_TILES> gemm_rows_weight_at(const bf16_t* lane, int tile_stride,
                                                                           int block_stride, int n, int warp_column)
{
    GemmRowsWeightLane<N_TILES> weight{lane, tile_stride, block_stride, {}};
    const int group_lane = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int j = 0; j < N_TILES; ++j) {
        weight.valid[j] = warp_column + GEMM_ROWS_N_TILE * j + group_lane < n;
    }
    return weight;
}

// With more than one m-tile and an even number of tiles a warp the operands swap (w as A, x as B): the
// same products and bits, fewer register moves.
template <int M_TILES, int N_TILES>
__device__ __forceinline__ constexpr bool gemm_rows_transposed()
{
    return M_TILES > 1 && N_TILES % 2 == 0;
}

// The row and column (among the warp's) of accumulator `fragment` (flat index) of `lane`.
template <int M_TILES, int N_TILES>
__device__ __forceinline__ void gemm_rows_fragment_place(int fragment, int lane, int& row, int& column)
{
    const int e = fragment & 3;
    if constexpr (gemm_rows_transposed<M_TILES, N_TILES>()) {
        const int h = (fragment >> 2) % (2 * M_TILES), p = (fragment >> 2) / (2 * M_TILES);
        row = 8 * h + 2 * (lane & 3) + (e & 1);
        column = (2 * p + (e >> 1)) * GEMM_ROWS_N_TILE + (lane >> 2);
    } else {
        const int j = (fragment >> 2) % N_TILES, m = (fragment >> 2) / N_TILES;
        row = GEMM_ROWS_M_TILE * m + (lane >> 2) + 8 * (e >> 1);
        column = j * GEMM_ROWS_N_TILE + 2 * (lane & 3) + (e & 1);
    }
}

// Where x comes from: memory written before, memory a running kernel writes, shared memory, staged.
enum GemmXFrom : int { GEMM_X_INPUT = 0, GEMM_X_PRODUCED = 1, GEMM_X_SHARED = 2, GEMM_X_STAGED = 3 };

// The x fragments of k block kb (rows g and g + 8 of each m-tile), zeros past the range, matrix or rows.
template <int M_TILES, int X_FROM = GEMM_X_INPUT>
__device__ __forceinline__ void load_x_block(uint4 (&x_frag)[M_TILES][2], const bf16_t* x_lane, int ldx,
                                             const bool (&x_valid)[M_TILES][2], int kb, int kb_end, int k,
                                             int thread_in_group)
{
    const int k_offset = kb * GEMM_ROWS_K_BLOCK;
    const bool k_valid = kb < kb_end && k_offset + 8 * thread_in_group < k;
#pragma unroll
    for (int m = 0; m < M_TILES; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const bf16_t* pointer = x_lane + static_cast<size_t>(GEMM_ROWS_M_TILE * m + 8 * half) * ldx + k_offset;
            const bool valid = x_valid[m][half] && k_valid;
            if constexpr (X_FROM == GEMM_X_SHARED) {
                x_frag[m][half] = load_shared_16B(pointer, valid);
            } else if constexpr (X_FROM == GEMM_X_PRODUCED) {
                x_frag[m][half] = load_produced_16B(pointer, valid);
            } else {
                x_frag[m][half] = load_activation_16B(pointer, valid);
            }
        }
    }
}

// gemm_rows_accumulate with both operands in shared memory, zero padding in place of predicates (the
// same mma in the same order). HIGH: rows 8 .. 15 of the m-tile hold some row.
template <int N_TILES, bool HIGH>
__device__ __forceinline__ void gemm_rows_accumulate_staged(float (&acc)[1][N_TILES][4], const bf16_t* x, int ldx,
                                                            const bf16_t* w, int n, int k, int row_begin,
                                                            int row_end, int warp_column, int kb_begin, int kb_end,
                                                            int w_tile_origin)
{
    const int lane = threadIdx.x & 31;
    const int group_lane = lane >> 2, thread_in_group = lane & 3;
    const int tile_stride = gemm_rows_k_blocks(k) * GEMM_ROWS_PACKED_BLOCK, block_stride = GEMM_ROWS_PACKED_BLOCK;
    const bf16_t* w_lane = w + (warp_column / GEMM_ROWS_N_TILE - w_tile_origin) * tile_stride + 8 * lane;
    zero_floats(acc);
    const bf16_t* zeros = x - 8;
    const bf16_t* x_half[2];
    int x_step[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = row_begin + 8 * half + group_lane;
        const bool present = row < row_end;
        x_half[half] = present ? x + static_cast<size_t>(row - row_begin) * ldx + 8 * thread_in_group +
                                     kb_begin * GEMM_ROWS_K_BLOCK
                               : zeros;
        x_step[half] = present ? GEMM_ROWS_K_BLOCK : 0;
    }
    const bf16_t* w_tile[N_TILES];
    int w_step[N_TILES];
#pragma unroll
    for (int j = 0; j < N_TILES; ++j) {
        const bool present = warp_column + GEMM_ROWS_N_TILE * j < n;  // warp-uniform
        w_tile[j] = present ? w_lane + j * tile_stride + kb_begin * block_stride : zeros;
        w_step[j] = present ? block_stride : 0;
    }
#pragma unroll 4
    for (int kb = kb_begin; kb < kb_end; ++kb) {
        const uint4 x_low = *reinterpret_cast<const uint4*>(x_half[0]);
        const uint4 x_high = HIGH ? *reinterpret_cast<const uint4*>(x_half[1]) : uint4{0u, 0u, 0u, 0u};
        uint4 w_frag[N_TILES];
#pragma unroll
        for (int j = 0; j < N_TILES; ++j) {
            w_frag[j] = *reinterpret_cast<const uint4*>(w_tile[j]);
            w_tile[j] += w_step[j];
        }
        x_half[0] += x_step[0];
        x_half[1] += x_step[1];
#pragma unroll
        for (int step = 0; step < 2; ++step) {
#pragma unroll
            for (int j = 0; j < N_TILES; ++j) {
                mma_bf16_step(acc[0][j], x_low, x_high, w_frag[j], step);
            }
        }
    }
}

// One warp's chain of mma over its k blocks [kb_begin, kb_end), ascending, for N_TILES tiles from
// warp_column on and rows [row_begin, row_end). W_SHARED: w is a shared copy of the packed tiles from
// w_tile_origin. FROM_ZERO false: go on from acc. `given`, FIRST_GIVEN: weight place, first step loaded.
template <int M_TILES, int N_TILES, int X_FROM = GEMM_X_INPUT, bool PACKED = false, bool W_SHARED = false,
          bool FROM_ZERO = true, bool FIRST_GIVEN = false>
__device__ __forceinline__ void gemm_rows_accumulate(float (&acc)[M_TILES][N_TILES][4], const bf16_t* x, int ldx,
                                                     const bf16_t* w, int n, int k, int row_begin, int row_end,
                                                     int warp_column, int kb_begin, int kb_end, int w_tile_origin = 0,
                                                     const GemmRowsWeightLane<N_TILES>* given = nullptr,
                                                     const uint4* first = nullptr)
{
    static_assert(PACKED || !W_SHARED, "a shared-memory copy of the weight is of the packed layout");
    constexpr int K_UNROLL = gemm_rows_k_unroll<M_TILES, N_TILES>();
    static_assert(K_UNROLL >= 1, "a step must cover one k block of every (m-tile, n-tile)");

    const int lane = threadIdx.x & 31;
    const int group_lane = lane >> 2;   // g: row of A / C, column of B
    const int thread_in_group = lane & 3;  // t: which 8 k of a 32-k block

    // This lane's x rows: row_begin + 16 m + g (half 0) and + 8 (half 1).
    const bf16_t* x_lane = x + static_cast<size_t>(row_begin + group_lane) * ldx + 8 * thread_in_group;
    bool x_valid[M_TILES][2];
#pragma unroll
    for (int m = 0; m < M_TILES; ++m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            x_valid[m][half] = row_begin + GEMM_ROWS_M_TILE * m + 8 * half + group_lane < row_end;
        }
    }

    const bf16_t* w_lane;
    int tile_stride, block_stride;
    bool w_valid[N_TILES];
    if (given != nullptr) {
        w_lane = given->lane;
        tile_stride = given->tile_stride;
        block_stride = given->block_stride;
#pragma unroll
        for (int j = 0; j < N_TILES; ++j) {
            w_valid[j] = given->valid[j];
        }
    } else {
        if constexpr (PACKED) {
            tile_stride = gemm_rows_k_blocks(k) * GEMM_ROWS_PACKED_BLOCK;
            block_stride = GEMM_ROWS_PACKED_BLOCK;
            w_lane = w + static_cast<size_t>(warp_column / GEMM_ROWS_N_TILE - w_tile_origin) * tile_stride + 8 * lane;
        } else {
            tile_stride = GEMM_ROWS_N_TILE * k;
            block_stride = GEMM_ROWS_K_BLOCK;
            w_lane = w + static_cast<size_t>(warp_column + group_lane) * k + 8 * thread_in_group;
        }
#pragma unroll
        for (int j = 0; j < N_TILES; ++j) {
            w_valid[j] = warp_column + GEMM_ROWS_N_TILE * j + group_lane < n;
        }
    }

    if constexpr (FROM_ZERO) {
        zero_floats(acc);
    }
    for (int kb_step = kb_begin; kb_step < kb_end; kb_step += K_UNROLL) {
        // Every weight load of the step first: they are what the kernel waits on.
        uint4 w_frag[K_UNROLL][N_TILES];
        if (FIRST_GIVEN && kb_step == kb_begin) {
#pragma unroll
            for (int i = 0; i < K_UNROLL * N_TILES; ++i) {
                (&w_frag[0][0])[i] = first[i];
            }
        } else {
            load_weight_step<K_UNROLL, N_TILES, W_SHARED>(w_frag, w_lane, tile_stride, block_stride, w_valid,
                                                          kb_step, kb_end, k, thread_in_group);
        }
        // The step's x fragments with its weights (hits that would otherwise wait behind them), up to 4.
        constexpr bool X_AHEAD = X_FROM != GEMM_X_SHARED && K_UNROLL * M_TILES <= 4;
        constexpr int X_STEPS = X_AHEAD ? K_UNROLL : 1;
        uint4 x_frag[X_STEPS][M_TILES][2];
        if constexpr (X_AHEAD) {
#pragma unroll
            for (int u = 0; u < K_UNROLL; ++u) {
                load_x_block<M_TILES, X_FROM>(x_frag[u], x_lane, ldx, x_valid, kb_step + u, kb_end, k,
                                              thread_in_group);
            }
        }
#pragma unroll
        for (int u = 0; u < K_UNROLL; ++u) {
            // Warp-uniform: the chain is exactly the range's blocks whatever K_UNROLL is.
            if (kb_step + u < kb_end) {
                if constexpr (!X_AHEAD) {
                    load_x_block<M_TILES, X_FROM>(x_frag[0], x_lane, ldx, x_valid, kb_step + u, kb_end, k,
                                                  thread_in_group);
                }
                const int xu = X_AHEAD ? u : 0;
                if constexpr (gemm_rows_transposed<M_TILES, N_TILES>()) {
                    // acc as [pair][row tile][4]; row tile h is x_frag[h / 2][h % 2].
                    auto& acc_t = reinterpret_cast<float(&)[N_TILES / 2][2 * M_TILES][4]>(acc);
#pragma unroll
                    for (int step = 0; step < 2; ++step) {
#pragma unroll
                        for (int p = 0; p < N_TILES / 2; ++p) {
#pragma unroll
                            for (int h = 0; h < 2 * M_TILES; ++h) {
                                mma_bf16_step(acc_t[p][h], w_frag[u][2 * p], w_frag[u][2 * p + 1],
                                              x_frag[xu][h >> 1][h & 1], step);
                            }
                        }
                    }
                } else {
#pragma unroll
                    for (int m = 0; m < M_TILES; ++m) {
#pragma unroll
                        for (int step = 0; step < 2; ++step) {
#pragma unroll
                            for (int j = 0; j < N_TILES; ++j) {
                                mma_bf16_step(acc[m][j], x_frag[xu][m][0], x_frag[xu][m][1], w_frag[u][j], step);
                            }
                        }
                    }
                }
            }
        }
    }
}

// The k range of split part `warp_k` of `k_split`: k blocks [kb_begin, kb_end).
__device__ __forceinline__ void gemm_rows_k_range(int k, int k_split, int warp_k, int& kb_begin, int& kb_end)
{
    const int k_blocks = gemm_rows_k_blocks(k);
    const int k_range = (k_blocks + k_split - 1) / k_split;
    kb_begin = warp_k * k_range;
    kb_end = min(kb_begin + k_range, k_blocks);
}

// Columns of one column group: the warps side by side along n, N_TILES tiles of 8 each.
template <int N_TILES>
__device__ __forceinline__ int gemm_rows_group_columns(int k_split)
{
    return GEMM_ROWS_WARPS / k_split * N_TILES * GEMM_ROWS_N_TILE;
}

// The first column of the calling warp's tiles in column group `group` (its k range: warp % k_split).
template <int N_TILES>
__device__ __forceinline__ int gemm_rows_warp_column(int k_split, int group)
{
    return group * gemm_rows_group_columns<N_TILES>(k_split) + (threadIdx.x >> 5) / k_split * N_TILES * GEMM_ROWS_N_TILE;
}

// Shared-memory floats of gemm_rows_group's partial sums.
#define GEMM_ROWS_PARTIAL_FLOATS(M_TILES, N_TILES) (GEMM_ROWS_WARPS * (M_TILES) * (N_TILES) * 4 * 32)

// `bytes` (a multiple of 16, aligned) into shared memory by `threads` threads, who all call this, then
// gemm_rows_wait_weights and a barrier among them.
__device__ __forceinline__ void gemm_rows_stage_weights(void* stage, const bf16_t* source, unsigned int bytes,
                                                        unsigned int thread, unsigned int threads)
{
    const unsigned int base = shared_address(stage);
    for (unsigned int offset = 16 * thread; offset < bytes; offset += 16 * threads) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(base + offset),
                     "l"(reinterpret_cast<const char*>(source) + offset)
                     : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Every thread: wait until its own copies of gemm_rows_stage_weights have landed.
__device__ __forceinline__ void gemm_rows_wait_weights()
{
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// The tail stage: for each warp in order, its N_TILES tiles' last tail_blocks k blocks of its range.
__device__ __forceinline__ int gemm_rows_tail_begin(int kb_begin, int kb_end, int tail_blocks)
{
    return max(kb_begin, kb_end - tail_blocks);
}

// Where a warp's tail starts, less tail_begin k blocks (perhaps negative).
template <int N_TILES>
__device__ __forceinline__ long long gemm_rows_tail_offset(int warp, int tail_begin, int tail_blocks)
{
    return (static_cast<long long>(warp) * N_TILES * tail_blocks - tail_begin) * GEMM_ROWS_PACKED_BLOCK;
}

// Each warp: the first step of its k range in column group `group`, in program order (before a wait).
template <int N_TILES>
__device__ __forceinline__ void gemm_rows_first_step(uint4 (&first)[gemm_rows_k_unroll<1, N_TILES>()][N_TILES],
                                                     const bf16_t* w, int n, int k, int k_split, int group,
                                                     int tail_blocks)
{
    const int warp = threadIdx.x >> 5;
    int kb_begin, kb_end;
    gemm_rows_k_range(k, k_split, warp % k_split, kb_begin, kb_end);
    const int tail_begin = gemm_rows_tail_begin(kb_begin, kb_end, tail_blocks);
    const int warp_column = gemm_rows_warp_column<N_TILES>(k_split, group);
    const int tile_stride = gemm_rows_k_blocks(k) * GEMM_ROWS_PACKED_BLOCK;
    const GemmRowsWeightLane<N_TILES> weight = gemm_rows_weight_at<N_TILES>(
        w + static_cast<size_t>(warp_column / GEMM_ROWS_N_TILE) * tile_stride + 8 * (threadIdx.x & 31), tile_stride,
        GEMM_ROWS_PACKED_BLOCK, n, warp_column);
    load_weight_step<gemm_rows_k_unroll<1, N_TILES>(), N_TILES, false, true>(
        first, weight.lane, weight.tile_stride, weight.block_stride, weight.valid, kb_begin, tail_begin, k,
        threadIdx.x & 3);
}

// Where a sweep also writes its FP32 sums: sums.y[row * sums.ld + column], unrounded y.
struct GemmRowsSums {
    float* y;
    int ld;
};

// One column group of the output by the block's 8 warps, split-k partials added in ascending warp order;
// ends with a barrier. GEMM_X_STAGED: w a shared copy from w_tile_origin, `partial` overwriting x. TAIL:
// each warp's last k blocks from `tail`, its first step from `first`. SUMS: FP32 sums too.
template <int M_TILES, int N_TILES, int X_FROM = GEMM_X_INPUT, bool PACKED = false, bool TAIL = false,
          bool SUMS = false>
__device__ __forceinline__ void gemm_rows_group(const bf16_t* x, int ldx, const bf16_t* w, bf16_t* y, int ldy,
                                                int row_begin, int row_end, int n, int k, int k_split, int group,
                                                float* partial, int w_tile_origin = 0, const bf16_t* tail = nullptr,
                                                int tail_blocks = 0, const uint4* first = nullptr,
                                                GemmRowsSums sums = {nullptr, 0})
{
    constexpr int FRAGMENTS = M_TILES * N_TILES * 4;  // accumulators per lane
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps_n = GEMM_ROWS_WARPS / k_split;
    const int warp_k = warp % k_split;
    const int warp_n = warp / k_split;
    int kb_begin, kb_end;
    gemm_rows_k_range(k, k_split, warp_k, kb_begin, kb_end);
    const int group_columns = gemm_rows_group_columns<N_TILES>(k_split);
    const int warp_column = group * group_columns + warp_n * N_TILES * GEMM_ROWS_N_TILE;

    float acc[M_TILES][N_TILES][4];
    if constexpr (X_FROM == GEMM_X_STAGED) {
        static_assert(PACKED && M_TILES == 1, "staged x: one m-tile of a staged packed weight");
        if (row_end - row_begin > GEMM_ROWS_M_TILE / 2) {
            gemm_rows_accumulate_staged<N_TILES, true>(acc, x, ldx, w, n, k, row_begin, row_end, warp_column, kb_begin,
                                                       kb_end, w_tile_origin);
        } else {
            gemm_rows_accumulate_staged<N_TILES, false>(acc, x, ldx, w, n, k, row_begin, row_end, warp_column,
                                                        kb_begin, kb_end, w_tile_origin);
        }
    } else if constexpr (TAIL) {
        static_assert(PACKED, "a tail stage of a packed weight");
        const int tail_begin = gemm_rows_tail_begin(kb_begin, kb_end, tail_blocks);
        gemm_rows_accumulate<M_TILES, N_TILES, X_FROM, true, false, true, true>(
            acc, x, ldx, w, n, k, row_begin, row_end, warp_column, kb_begin, tail_begin, w_tile_origin, nullptr, first);
        // The warp's own copies (no other warp's): landed, and each lane's seen by the others.
        gemm_rows_wait_weights();
        __syncwarp();
        const GemmRowsWeightLane<N_TILES> staged = gemm_rows_weight_at<N_TILES>(
            tail + gemm_rows_tail_offset<N_TILES>(warp, tail_begin, tail_blocks) + 8 * lane,
            tail_blocks * GEMM_ROWS_PACKED_BLOCK, GEMM_ROWS_PACKED_BLOCK, n, warp_column);
        gemm_rows_accumulate<M_TILES, N_TILES, X_FROM, true, true, false>(
            acc, x, ldx, nullptr, n, k, row_begin, row_end, warp_column, tail_begin, kb_end, 0, &staged);
    } else {
        gemm_rows_accumulate<M_TILES, N_TILES, X_FROM, PACKED>(
            acc, x, ldx, w, n, k, row_begin, row_end, warp_column, kb_begin, kb_end, w_tile_origin);
    }
    if constexpr (X_FROM == GEMM_X_SHARED || X_FROM == GEMM_X_STAGED) {
        __syncthreads();  // every warp has read its x before `partial` overwrites it
    }
#pragma unroll
    for (int fragment = 0; fragment < FRAGMENTS; ++fragment) {
        partial[(warp * FRAGMENTS + fragment) * 32 + lane] = (&acc[0][0][0])[fragment];
    }
    __syncthreads();
    for (int output = threadIdx.x; output < warps_n * FRAGMENTS * 32; output += GEMM_ROWS_THREADS) {
        const int out_lane = output & 31;
        const int fragment = (output >> 5) % FRAGMENTS;
        const int out_warp_n = (output >> 5) / FRAGMENTS;
        const float* source = partial + (out_warp_n * k_split * FRAGMENTS + fragment) * 32 + out_lane;
        float sum = source[0];
        for (int split = 1; split < k_split; ++split) {
            sum += source[split * FRAGMENTS * 32];
        }
        int row, column;
        gemm_rows_fragment_place<M_TILES, N_TILES>(fragment, out_lane, row, column);
        row += row_begin;
        column += group * group_columns + out_warp_n * N_TILES * GEMM_ROWS_N_TILE;
        if (row < row_end && column < n) {
            y[static_cast<size_t>(row) * ldy + column] = f32_to_bf16(sum);
            if constexpr (SUMS) {
                sums.y[static_cast<size_t>(row) * sums.ld + column] = sum;
            }
        }
    }
    // The next column group overwrites `partial`.
    __syncthreads();
}

// A second projection swept by the same launch (the pair entries), of the first's shapes. Null w: none.
struct GemmRowsSecond {
    const bf16_t* x;
    const bf16_t* w;
    bf16_t* y;
};

// What a sweep's blocks wait on before they read x: null words, the previous kernel's end; else words[0]
// reaching `target`, the count of outputs that kernel, still running, has written.
struct GemmRowsAwait {
    int* words;
    int target;
};

// An awaiting block's wait (every thread calls it); returns, in thread 0, the blocks past it before.
__device__ __forceinline__ int gemm_rows_await(const GemmRowsAwait& awaited)
{
    int passed = 0;
    if (threadIdx.x == 0) {
        passed = kda_await_words(awaited.words, awaited.target);
    }
    __syncthreads();
    return passed;
}

// An awaiting block's end: the words cleared, and the launch ends after the kernel before it ends.
__device__ __forceinline__ void gemm_rows_end_awaited(const GemmRowsAwait& awaited, int passed)
{
    if (threadIdx.x == 0) {
        kda_clear_words_if_last(awaited.words, passed, static_cast<int>(gridDim.x * gridDim.y));
    }
    kda_grid_dependency_wait();
}

// Each warp: start the copies of its part of column group `group`'s tail stage into `tail`.
template <int N_TILES>
__device__ __forceinline__ void gemm_rows_stage_tail(bf16_t* tail, const bf16_t* w, int n, int k, int k_split,
                                                     int group, int tail_blocks)
{
    const int tiles = (n + GEMM_ROWS_N_TILE - 1) / GEMM_ROWS_N_TILE;
    const int tile_elements = gemm_rows_k_blocks(k) * GEMM_ROWS_PACKED_BLOCK;
    const int warp = threadIdx.x >> 5;
    int kb_begin, kb_end;
    gemm_rows_k_range(k, k_split, warp % k_split, kb_begin, kb_end);
    const int tail_begin = gemm_rows_tail_begin(kb_begin, kb_end, tail_blocks);
    const int blocks = kb_end - tail_begin;
    const int first_tile = gemm_rows_warp_column<N_TILES>(k_split, group) / GEMM_ROWS_N_TILE;
    for (int j = 0; j < N_TILES && blocks > 0; ++j) {
        if (first_tile + j < tiles) {
            gemm_rows_stage_weights(
                tail + static_cast<size_t>(warp * N_TILES + j) * tail_blocks * GEMM_ROWS_PACKED_BLOCK,
                w + static_cast<size_t>(first_tile + j) * tile_elements +
                    static_cast<size_t>(tail_begin) * GEMM_ROWS_PACKED_BLOCK,
                static_cast<unsigned int>(blocks * GEMM_ROWS_PACKED_BLOCK * sizeof(bf16_t)), threadIdx.x & 31, 32);
        }
    }
}

// The body of every mma.sync entry point but the staged ones. `prefetch`: k blocks of the weight asked of
// L2 before the wait (the weight is no kernel's output).
template <int M_TILES, int N_TILES, bool PACKED, int X_FROM = GEMM_X_INPUT, bool SUMS = false>
__device__ __forceinline__ void gemm_rows_entry(const bf16_t* __restrict__ x, int ldx,
                                                const bf16_t* __restrict__ w, bf16_t* __restrict__ y,
                                                int ldy, int rows, int n, int k, int prefetch,
                                                GemmRowsSecond second = {nullptr, nullptr, nullptr},
                                                GemmRowsAwait awaited = {nullptr, 0},
                                                GemmRowsSums sums = {nullptr, 0})
{
    __shared__ float partial[GEMM_ROWS_PARTIAL_FLOATS(M_TILES, N_TILES)];

    kda_let_next_kernel_launch();
    const int row_begin = blockIdx.y * GEMM_ROWS_M_GROUP;
    if (row_begin >= rows || blockDim.x != GEMM_ROWS_THREADS) {
        return;
    }
    const int row_end = min(rows, row_begin + GEMM_ROWS_M_GROUP);
    const int k_split = k_split_for(k);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warp_n = warp / k_split;
    int kb_begin, kb_end;
    gemm_rows_k_range(k, k_split, warp % k_split, kb_begin, kb_end);
    const int group_columns = gemm_rows_group_columns<N_TILES>(k_split);
    const int column_groups = (n + group_columns - 1) / group_columns;

    if (prefetch != 0 && blockIdx.x < column_groups) {
        // The first `prefetch` blocks of this warp's k range, for every weight row of its first group.
        const int first_row = blockIdx.x * group_columns + warp_n * N_TILES * GEMM_ROWS_N_TILE;
        const int kb_last = min(kb_end, kb_begin + prefetch);
        if constexpr (PACKED) {
            // Each tile's blocks [kb_begin, kb_last) are one run of 512-byte pieces.
            const int tile_stride = gemm_rows_k_blocks(k) * GEMM_ROWS_PACKED_BLOCK;
            const int lines_per_tile = max(kb_last - kb_begin, 0) * (GEMM_ROWS_PACKED_BLOCK * 2 / 128);
            for (int index = lane; index < N_TILES * lines_per_tile; index += 32) {
                const int tile = first_row / GEMM_ROWS_N_TILE + index / lines_per_tile;
                if (tile * GEMM_ROWS_N_TILE < n) {
                    prefetch_l2(w + static_cast<size_t>(tile) * tile_stride + kb_begin * GEMM_ROWS_PACKED_BLOCK +
                                64 * (index % lines_per_tile));
                }
            }
        } else {
            const int lines_per_row = (max(kb_last - kb_begin, 0) * GEMM_ROWS_K_BLOCK * 2 + 127) / 128;
            for (int index = lane; index < N_TILES * GEMM_ROWS_N_TILE * lines_per_row; index += 32) {
                const int row = first_row + index / lines_per_row;
                const int k_offset = kb_begin * GEMM_ROWS_K_BLOCK + 64 * (index % lines_per_row);
                if (row < n && k_offset < k) {
                    prefetch_l2(w + static_cast<size_t>(row) * k + k_offset);
                }
            }
        }
    }
    // x (and y) may belong to the kernel before: nothing below runs before it is done or has counted out.
    int passed = 0;
    if (awaited.words != nullptr) {
        passed = gemm_rows_await(awaited);
    } else {
        kda_grid_dependency_wait();
    }

    int group = blockIdx.x;
    for (; group < column_groups; group += gridDim.x) {
        gemm_rows_group<M_TILES, N_TILES, X_FROM, PACKED, false, SUMS>(
            x, ldx, w, y, ldy, row_begin, row_end, n, k, k_split, group, partial, 0, nullptr, 0, nullptr, sums);
    }
    if (second.w != nullptr) {
        // (Two loops, not one choosing its pointers: one set live at a time.)
        for (group -= column_groups; group < column_groups; group += gridDim.x) {
            gemm_rows_group<M_TILES, N_TILES, X_FROM, PACKED>(
                second.x, ldx, second.w, second.y, ldy, row_begin, row_end, n, k, k_split, group, partial);
        }
    }
    if (awaited.words != nullptr) {
        gemm_rows_end_awaited(awaited, passed);
    }
}

// The parameters every gemm_rows entry point starts with (LAST: prefetch, or the tail form's
// tail_blocks); then, where an entry has them, the count it awaits and the FP32 sums it writes.
#define GEMM_ROWS_PARAMETERS(LAST)                                                                 \
    const bf16_t* __restrict__ x, int ldx, const bf16_t* __restrict__ w, bf16_t* __restrict__ y,  \
        int ldy, int rows, int n, int k, int LAST
#define GEMM_ROWS_AWAIT_PARAMETERS int* ready, int ready_target
#define GEMM_ROWS_SUMS_PARAMETERS float* __restrict__ sums, int ld_sums

// 2 blocks per SM (up to 128 registers); glm_kda.gpu.projection.GEMM_ROWS_BLOCKS_PER_SM mirrors it.
#define GEMM_ROWS_MIN_BLOCKS 2

// The (M_TILES, N_TILES) pairs of the general entries (glm_kda.gpu.build.ENTRY_POINTS lists them).
#define GEMM_ROWS_TILINGS(ENTRY)                                                                   \
    ENTRY(1, 1) ENTRY(1, 2) ENTRY(1, 4) ENTRY(2, 1) ENTRY(2, 2) ENTRY(2, 4) ENTRY(4, 1) ENTRY(4, 2)
