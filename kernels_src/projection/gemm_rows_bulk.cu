// The row projection of more than 16 rows on Hopper's warpgroup MMA (sm_90a), gemm_rows.cu's bits: both
// operands come by bulk copy as the wgmma's shared-memory image; one copy of x feeds every warpgroup.
// Launch (kda_gemm_rows_bulk_g<WG>): WG * 128 + 32 threads (WG consumer warpgroups, then one copy warp),
// grid.y the row groups of 64. Tile layout, ring and walk: docs/kernels.md, 'Bulk-copy sweep'.
#include "projection/gemm_rows.cuh"
#include "projection/tile_layout.cuh"
#include "common/mbarrier.cuh"
#include "projection/wgmma.cuh"

#define GEMM_BULK_WARPGROUP 128
#define GEMM_BULK_COLUMNS 64
#define GEMM_BULK_ROWS 64
// Elements and bytes of one (group of 64, block of 32 k) tile.
#define GEMM_BULK_TILE_ELEMENTS (GEMM_BULK_COLUMNS * GEMM_ROWS_K_BLOCK)
#define GEMM_BULK_TILE_BYTES (GEMM_BULK_TILE_ELEMENTS * 2)
// Blocks of 32 k a ring slot holds of each operand (glm_kda.gpu.projection._BULK_CHUNK).
#define GEMM_BULK_CHUNK 4

// x [rows, k] BF16 (row stride ldx) -> tiles [row group][kb][2048], zeros past rows and k; a thread per
// (row group, kb, row of 64). Launch: 256 threads, grid ceil(row_groups * k_blocks * 64 / 256).
extern "C" __global__ void __launch_bounds__(256) kda_gemm_rows_tile_x_bf16(const bf16_t* x, int ldx,
                                                                      int rows, int k, bf16_t* __restrict__ tiles)
{
    kda_let_next_kernel_launch();
    const int k_blocks = gemm_rows_k_blocks(k);
    const int row_groups = (rows + GEMM_BULK_ROWS - 1) / GEMM_BULK_ROWS;
    const long long index = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (index >= static_cast<long long>(row_groups) * k_blocks * GEMM_BULK_ROWS) {
        return;
    }
    const int r = static_cast<int>(index % GEMM_BULK_ROWS);
    const int kb = static_cast<int>((index / GEMM_BULK_ROWS) % k_blocks);
    const int group = static_cast<int>(index / (static_cast<long long>(GEMM_BULK_ROWS) * k_blocks));
    const int row = group * GEMM_BULK_ROWS + r;
    // x may be the previous kernel's output, and the tiles the input of a kernel before it.
    kda_grid_dependency_wait();
    uint4 chunk[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const int kk = kb * GEMM_ROWS_K_BLOCK + 8 * t;
        // Coherent loads kept after the wait (load_activation_16B).
        chunk[t] = load_activation_16B(x + static_cast<size_t>(row) * ldx + kk, row < rows && kk < k);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        // Word q of chunk t holds k 32 kb + 8 t + 2 q, + 1 (q = 2 s + h).
        *reinterpret_cast<uint4*>(tiles + bulk_tile_element(row, kb * GEMM_ROWS_K_BLOCK + 2 * q, k_blocks)) =
            uint4{word_of(chunk[0], q), word_of(chunk[1], q), word_of(chunk[2], q), word_of(chunk[3], q)};
    }
}

// d[64 x 64] += a[64 x 16] b[16 x 64], both operands by descriptor (K-major); d: 32 floats a thread.
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], unsigned long long desc_a,
                                                   unsigned long long desc_b)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 WGMMA_D32 ", "
                 "%32, %33, 1, 1, 1, 0, 0;"
                 : WGMMA_D32_OPERANDS(d)
                 : "l"(desc_a), "l"(desc_b));
}

// The descriptor of k16 step s of the tile at shared address `tile`.
__device__ __forceinline__ unsigned long long gemm_bulk_step_descriptor(unsigned int tile, int s)
{
    return wgmma_descriptor(tile + s * (GEMM_BULK_TILE_BYTES / 2), GEMM_BULK_TILE_BYTES / 4, 128);
}

// The walk of a block, the same for its copy warp and its warpgroups (docs/kernels.md, 'Bulk-copy sweep').
struct GemmBulkWalk {
    int k_blocks, k_range, ranges, parts, tasks;
};

__device__ __forceinline__ GemmBulkWalk gemm_bulk_walk(int k, int super_groups, bool split)
{
    GemmBulkWalk walk;
    walk.k_blocks = gemm_rows_k_blocks(k);
    const int k_split = k_split_for(k);
    walk.k_range = (walk.k_blocks + k_split - 1) / k_split;
    walk.ranges = (walk.k_blocks + walk.k_range - 1) / walk.k_range;  // those that hold blocks
    walk.parts = split ? walk.ranges : 1;
    walk.tasks = super_groups * walk.parts;
    return walk;
}

// The copy warp's lane 0 over the block's walk: before the wait on the previous kernel (`early`) the
// weight copies of chunks i < stages; after it the rest, each once its slot is free.
template <int WG>
__device__ __forceinline__ void gemm_bulk_produce(const GemmBulkWalk& walk, bool early, int stages,
                                                  unsigned int ring, unsigned int slot_bytes,
                                                  unsigned int full_barriers, unsigned int empty_barriers,
                                                  const bf16_t* x_tiles, const bf16_t* w_tiles, int row_group,
                                                  int groups)
{
    int i = 0;
    for (int task = blockIdx.x; task < walk.tasks; task += gridDim.x) {
        const int super_group = task / walk.parts;
        const int first_range = walk.parts == 1 ? 0 : task % walk.parts;
        const int last_range = walk.parts == 1 ? walk.ranges : first_range + 1;
        const int present = min(WG, groups - super_group * WG);
        for (int range = first_range; range < last_range; ++range) {
            const int range_end = min((range + 1) * walk.k_range, walk.k_blocks);
            for (int kb = range * walk.k_range; kb < range_end; kb += GEMM_BULK_CHUNK, ++i) {
                if (early && i >= stages) {
                    return;
                }
                const int slot = i % stages;
                const unsigned int full = full_barriers + 8 * slot;
                const unsigned int bytes = min(GEMM_BULK_CHUNK, range_end - kb) * GEMM_BULK_TILE_BYTES;
                const unsigned int slot_address = ring + slot * slot_bytes;
                const bool weights = early || i >= stages;
                if (i >= stages) {
                    // Every consumer warp has finished with use i / stages - 1 of the slot.
                    mbarrier_wait(empty_barriers + 8 * slot, (i / stages - 1) & 1);
                }
                if (weights) {
                    mbarrier_expect_bytes(full, (1 + present) * bytes);
                    for (int g = 0; g < present; ++g) {
                        const int group = super_group * WG + g;
                        bulk_copy_to_shared(slot_address + (1 + g) * GEMM_BULK_CHUNK * GEMM_BULK_TILE_BYTES,
                                            w_tiles + (static_cast<size_t>(group) * walk.k_blocks + kb) * GEMM_BULK_TILE_ELEMENTS,
                                            bytes, full);
                    }
                }
                if (!early) {
                    bulk_copy_to_shared(slot_address,
                                        x_tiles + (static_cast<size_t>(row_group) * walk.k_blocks + kb) * GEMM_BULK_TILE_ELEMENTS,
                                        bytes, full);
                }
            }
        }
    }
}

// A warpgroup's 64 x 64 result into out[row_begin + row][column] (row stride ld), rows < rows_here and
// columns < n only, each value through `convert`.
template <class T, class Convert>
__device__ __forceinline__ void gemm_bulk_store(const float (&values)[32], T* out, size_t ld, int row_begin,
                                                int rows_here, int column_base, int n, int t, Convert convert)
{
#pragma unroll
    for (int f = 0; f < 32; ++f) {
        const int e = f & 3;
        const int column = column_base + 8 * (e >> 1);
        const int row = 8 * (f >> 2) + 2 * t + (e & 1);
        if (row < rows_here && column < n) {
            out[static_cast<size_t>(row_begin + row) * ld + column] = convert(values[f]);
        }
    }
}

// The body of kda_gemm_rows_bulk_g<WG>: stages * (1 + WG) * CHUNK * 4096 bytes of ring, then 2 * stages
// mbarriers. x_tiles and w_tiles in the tile layout. `partial` null: y = the folded sums in BF16; else
// each range's FP32 sums go to partial[range][row][column] (for the fold) and y is not touched.
template <int WG>
__device__ __forceinline__ void gemm_bulk_entry(const bf16_t* __restrict__ x_tiles, const bf16_t* __restrict__ w_tiles,
                                                bf16_t* __restrict__ y, int ldy, int rows, int n, int k, int stages,
                                                float* __restrict__ partial)
{
    extern __shared__ __align__(128) unsigned char gemm_bulk_ring[];
    kda_let_next_kernel_launch();
    const int row_group = blockIdx.y;
    const int row_begin = row_group * GEMM_BULK_ROWS;
    if (row_begin >= rows || blockDim.x != WG * GEMM_BULK_WARPGROUP + 32 || stages < 1) {
        return;
    }
    const int rows_here = min(GEMM_BULK_ROWS, rows - row_begin);
    const int k_split = k_split_for(k);
    const int groups = (n + GEMM_BULK_COLUMNS - 1) / GEMM_BULK_COLUMNS;
    const GemmBulkWalk walk = gemm_bulk_walk(k, (groups + WG - 1) / WG, partial != nullptr);
    const unsigned int slot_bytes = (1 + WG) * GEMM_BULK_CHUNK * GEMM_BULK_TILE_BYTES;
    const unsigned int ring = shared_address(gemm_bulk_ring);
    const unsigned int full_barriers = ring + stages * slot_bytes;
    const unsigned int empty_barriers = full_barriers + 8 * stages;
    // Read from lane 0, so that the compiler knows every branch on it is warp-uniform and keeps a range's
    // wgmma in flight together.
    const int warp = __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0), lane = threadIdx.x & 31;
    const int consumer_warps = 4 * WG;

    if (threadIdx.x == 0) {
        for (int slot = 0; slot < stages; ++slot) {
            mbarrier_init(full_barriers + 8 * slot, 1);
            mbarrier_init(empty_barriers + 8 * slot, consumer_warps);
        }
        mbarrier_init_fence();
    }
    __syncthreads();

    if (warp == consumer_warps) {
        if (lane == 0) {
            gemm_bulk_produce<WG>(walk, true, stages, ring, slot_bytes, full_barriers, empty_barriers, x_tiles, w_tiles,
                                  row_group, groups);
            // x is the previous kernel's output (kda_gemm_rows_tile_x_bf16): nothing of it before this.
            kda_grid_dependency_wait();
            gemm_bulk_produce<WG>(walk, false, stages, ring, slot_bytes, full_barriers, empty_barriers, x_tiles,
                                  w_tiles, row_group, groups);
        }
        return;
    }

    // A consumer warpgroup: 64 columns of each task; accumulators touched only between ranges.
    const int warpgroup = warp >> 2, warp_in_group = warp & 3;
    const int g = lane >> 2, t = lane & 3;
    int i = 0;  // chunk of the block's walk
    bool waited = false;
    for (int task = blockIdx.x; task < walk.tasks; task += gridDim.x) {
        const int super_group = task / walk.parts;
        const int first_range = walk.parts == 1 ? 0 : task % walk.parts;
        const int last_range = walk.parts == 1 ? walk.ranges : first_range + 1;
        const int group = super_group * WG + warpgroup;
        const bool present = group < groups;  // warpgroup-uniform
        const int column_base = group * GEMM_BULK_COLUMNS + 16 * warp_in_group + g;
        float total[32], acc[32];
        for (int range = first_range; range < last_range; ++range) {
            const int range_end = min((range + 1) * walk.k_range, walk.k_blocks);
#pragma unroll
            for (int f = 0; f < 32; ++f) {
                acc[f] = 0.0f;
            }
            wgmma_fence();
            for (int kb0 = range * walk.k_range; kb0 < range_end; kb0 += GEMM_BULK_CHUNK, ++i) {
                const int slot = i % stages;
                mbarrier_wait(full_barriers + 8 * slot, (i / stages) & 1);
                if (present) {
                    const int count = min(GEMM_BULK_CHUNK, range_end - kb0);
                    for (int u = 0; u < count; ++u) {
                        const unsigned int x_tile = ring + slot * slot_bytes + u * GEMM_BULK_TILE_BYTES;
                        const unsigned int w_tile = x_tile + (1 + warpgroup) * GEMM_BULK_CHUNK * GEMM_BULK_TILE_BYTES;
                        wgmma_fence();
#pragma unroll
                        for (int s = 0; s < 2; ++s) {
                            wgmma_m64n64k16_ss(acc, gemm_bulk_step_descriptor(w_tile, s),
                                               gemm_bulk_step_descriptor(x_tile, s));
                        }
                    }
                    // Once the chunk's wgmma are done, this warp is done with the slot.
                    wgmma_commit();
                    wgmma_wait_all();
                }
                __syncwarp();
                if (lane == 0) {
                    mbarrier_arrive(empty_barriers + 8 * slot);
                }
            }
            if (!present) {
                continue;
            }
            wgmma_hold(acc);
            if (partial != nullptr) {
                if (!waited) {
                    // The partial sums may belong to the previous kernel.
                    kda_grid_dependency_wait();
                    waited = true;
                }
                gemm_bulk_store(acc, partial + static_cast<size_t>(range) * rows * n, n, row_begin, rows_here,
                                column_base, n, t, [](float value) { return value; });
            } else {
#pragma unroll
                for (int f = 0; f < 32; ++f) {
                    total[f] = range == 0 ? acc[f] : total[f] + acc[f];
                }
            }
        }
        if (!present || partial != nullptr) {
            continue;
        }
        // The ranges past the matrix (empty: a partial sum of zero, added as gemm_rows_group adds it).
        for (int r = walk.ranges; r < k_split; ++r) {
#pragma unroll
            for (int f = 0; f < 32; ++f) {
                total[f] += 0.0f;
            }
        }
        if (!waited) {
            // y may belong to the previous kernel.
            kda_grid_dependency_wait();
            waited = true;
        }
        gemm_bulk_store(total, y, ldy, row_begin, rows_here, column_base, n, t,
                        [](float value) { return f32_to_bf16(value); });
    }
}

// y[row, column] = bf16 of the k ranges' FP32 partial sums (partial[range][row][column]) folded in the
// unsplit sweep's order. Launch: 256 threads, a thread an output, grid ceil(rows * n / 256).
extern "C" __global__ void __launch_bounds__(256) kda_gemm_rows_bulk_fold_bf16(const float* partial,
                                                                         bf16_t* __restrict__ y, int ldy, int rows,
                                                                         int n, int k)
{
    kda_let_next_kernel_launch();
    const long long index = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const long long count = static_cast<long long>(rows) * n;
    if (index >= count) {
        return;
    }
    const int ranges = gemm_bulk_walk(k, 1, false).ranges;
    const int k_split = k_split_for(k);
    kda_grid_dependency_wait();
    // From L2 (the previous kernel wrote them while this one may already have started).
    float total = __ldcg(partial + index);
    for (int r = 1; r < ranges; ++r) {
        total = total + __ldcg(partial + r * count + index);
    }
    for (int r = ranges; r < k_split; ++r) {
        total += 0.0f;
    }
    const int row = static_cast<int>(index / n), column = static_cast<int>(index % n);
    y[static_cast<size_t>(row) * ldy + column] = f32_to_bf16(total);
}

#define GEMM_BULK_ENTRY(WG)                                                                               \
    extern "C" __global__ void __launch_bounds__(WG * GEMM_BULK_WARPGROUP + 32, 1)                         \
        kda_gemm_rows_bulk_g##WG(const bf16_t* __restrict__ x_tiles, const bf16_t* __restrict__ w_tiles,       \
                             bf16_t* __restrict__ y, int ldy, int rows, int n, int k, int stages,          \
                             float* __restrict__ partial)                                                 \
    {                                                                                                     \
        gemm_bulk_entry<WG>(x_tiles, w_tiles, y, ldy, rows, n, k, stages, partial);                       \
    }

GEMM_BULK_ENTRY(1)
GEMM_BULK_ENTRY(2)
GEMM_BULK_ENTRY(3)
