// The row projection of 17..64 rows a group on Hopper's warpgroup MMA (wgmma, sm_90a only): the
// bits of gemm_rows.cu's sweeps, several times fewer instructions per weight byte.
//
//   y[r, j] = bf16( sum_i x[r, i] * w[j, i] )   for r < rows (1..256), j < n
// with x [rows, k] (row stride ldx), w in the pair layout below, y [rows, n] (row stride ldy).
//
// The pair layout (glm_kda/gemm_rows.py, pack_pairs): for the tiles 2 p and 2 p + 1 of 8 columns
// (a pair), block kb of 32 k, k16 step s and lane 4 g + t, the 16 bytes a lane loads are the A
// fragment of that step exactly,
//   pairs[p][kb][s][lane] = { w[16 p + g, k0 + 4 s + 0..1], w[16 p + 8 + g, k0 + 4 s + 0..1],
//                             w[16 p + g, k0 + 4 s + 2..3], w[16 p + 8 + g, k0 + 4 s + 2..3] }
// with k0 = 32 kb + 8 t (zeros past n and k): the words interleave_pair forms from two loads of
// the packed layout, so the products and their slots are the same, and the loaded registers are
// the wgmma's operand with no move between. (With the packed layout the moves that interleave two
// loads were placed right behind the loads in the SASS: every step waited for the next step's
// weights before its own wgmma, one load latency a step.)
//
// Geometry: a warpgroup (4 warps) owns 64 weight columns (8 tiles of 8, tiles 2 v and 2 v + 1 for
// its warp v) and computes them for the N (32 or 64) rows of its row group in one wgmma m64nNk16
// per k16 step: w is the A operand, straight from the warp's registers, and x the B operand, from
// shared memory. A block of WG warpgroups (1 or 2) walks one or more groups of 64 WG columns; its
// threads copy x into a ring of shared-memory stages (CHUNK blocks of 32 k each) by 4-byte cp.async,
// while each warp keeps the weight loads of the next STEP blocks of 32 k in flight in registers.
//
// The bit contract is gemm_rows.cuh's: for every output, each of the k_split ranges of k (a
// function of k alone) is a chain from zero over its blocks of 32 k in ascending order, two k16
// steps a block, step s taking the products of physical k 8t + 4s + e (logical slot 2t + e) and
// 8t + 4s + 2 + e (slot 2t + 8 + e) for t = 0..3, e = 0, 1; the range sums are added in ascending
// range order. The A operand is the weight fragment of gemm_rows' transposed form (the pair layout
// holds interleave_pair's words: the same words in the same slots), and x is laid out in shared memory so that the B operand's
// logical k16 of step s are the same physical k in the same slots: for each row and block of 32 k,
// the 16 words of its 64 bytes as 4 x 4 (chunk c of 8 k, word q) stored transposed, piece h of step
// s holding word 2 s + h of chunks 0..3. The tensor cores sum a k16 step to the same bits through
// wgmma as through mma.sync m16n8k16: benchmarks/wgmma_forms.py, 0 of 4.7 million outputs differ on
// an H200 (chains of 16 to 128 k16 steps at 8, 32 and 64 rows; normal values, exponents over
// 2^-24 .. 2^24, near-cancelling pairs), and the GPU tests compare every row count with the
// mma.sync sweeps bit for bit.
//
// Shared memory of one k block (64 N bytes): [step 2][half 2][row N][16 bytes]: the B operand of
// step s is N rows of two 16-byte pieces, core matrices of 8 rows x 16 bytes; the descriptor's
// leading byte offset (between the two k halves) is 16 N and its stride byte offset (between
// groups of 8 rows) 128 (measured: the other reading gives other numbers, benchmarks/wgmma_forms.py).
#include "gemm_rows.cuh"
#include "wgmma.cuh"

#define GEMM_WGMMA_WARPGROUP 128
// Weight columns of one warpgroup: the 64 rows of wgmma's A operand.
#define GEMM_WGMMA_COLUMNS 64
// Blocks of 32 k per step: the weight loads a lane keeps in flight are 2 STEP (16 bytes each).
#ifndef GEMM_WGMMA_STEP
#define GEMM_WGMMA_STEP 2
#endif
// Blocks of 32 k of x per shared-memory stage, and stages in the ring. CHUNK is a multiple of STEP.
#ifndef GEMM_WGMMA_CHUNK
#define GEMM_WGMMA_CHUNK 4
#endif
#ifndef GEMM_WGMMA_STAGES
#define GEMM_WGMMA_STAGES 3
#endif
#ifndef GEMM_WGMMA_LOADS_FIRST
#define GEMM_WGMMA_LOADS_FIRST 0
#endif
#ifndef GEMM_WGMMA_NO_PROXY_FENCE
#define GEMM_WGMMA_NO_PROXY_FENCE 0
#endif
#ifndef GEMM_WGMMA_WARPGROUPS_PER_SM
#define GEMM_WGMMA_WARPGROUPS_PER_SM 3
#endif
// Elements of one (pair, k block) of the pair layout: 2 k16 steps x 32 lanes x 8.
#define GEMM_WGMMA_PAIR_BLOCK (2 * GEMM_ROWS_PACKED_BLOCK)
static_assert(GEMM_WGMMA_CHUNK % GEMM_WGMMA_STEP == 0, "a step never spans two stages");
static_assert(GEMM_WGMMA_STAGES >= 2, "at least one stage in flight");

// load_weight_16B where the address is known to be inside the weight: no predicate and no zeros,
// so the loaded registers are the asm's outputs and nothing reads them before their first use.
__device__ __forceinline__ uint4 load_weight_16B_unguarded(const bf16_t* pointer)
{
    uint4 value;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w)
        : "l"(pointer));
    return value;
}

// 4 bytes global -> shared, asynchronous; zeros where `valid` is false (nothing is read then).
__device__ __forceinline__ void copy_word_async(unsigned int destination, const void* source, bool valid)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(destination), "l"(source),
                 "r"(valid ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void copy_wait()
{
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// d[64 x N] += a[64 x 16] b[16 x N]: A from registers (the mma.sync A fragment of each warp's 16
// rows), B by descriptor. d: N / 2 floats a thread, fragment 4 i + e at A row 16 warp + g + 8 (e / 2),
// B column 8 i + 2 t + e % 2.
__device__ __forceinline__ void wgmma_m64nk16(float (&d)[32], const uint4& a, unsigned long long desc)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 WGMMA_D32 ", "
                 "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
                 : WGMMA_D32_OPERANDS(d)
                 : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "l"(desc));
}

__device__ __forceinline__ void wgmma_m64nk16(float (&d)[16], const uint4& a, unsigned long long desc)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15}, "
                 "{%16, %17, %18, %19}, %20, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "l"(desc));
}

// Bytes of x one block of 32 k takes in shared memory at N rows, and of the whole ring.
template <int N>
__device__ __host__ constexpr int gemm_wgmma_block_bytes()
{
    return 2 * 2 * N * 16;
}

// Copy the x of stage `chunk` (blocks chunk * CHUNK ..) into ring slot chunk % STAGES, by every
// thread of the block: word q = 4 c + 2 s + h of a row's block (k 8 c + 4 s + 2 h, + 1) goes to
// [step s][half h][row][word c]. Rows >= rows_here, k >= k and blocks past the matrix are zeros.
// A thread keeps one word q of the rows row0, row0 + THREADS / 16, ...: the loop is unrolled to
// constant offsets, a few instructions a 4-byte copy (with the index arithmetic done per copy, the
// sweep spent about 35 instructions on each and was bound by them).
template <int N, int THREADS>
__device__ __forceinline__ void gemm_wgmma_stage_x(unsigned int ring, const bf16_t* x, int ldx, int rows_here, int k,
                                                   int k_blocks, int chunk)
{
    static_assert(THREADS % 16 == 0 && N % (THREADS / 16) == 0, "whole rows of words a pass");
    constexpr int ROWS_PER_PASS = THREADS / 16;
    constexpr int PASSES = N / ROWS_PER_PASS;
    const int q = threadIdx.x & 15;
    const int c = q >> 2, s = (q >> 1) & 1, h = q & 1;
    const int row0 = threadIdx.x >> 4;
    const unsigned int first = ring + (chunk % GEMM_WGMMA_STAGES) * (GEMM_WGMMA_CHUNK * gemm_wgmma_block_bytes<N>()) +
                               ((2 * s + h) * N + row0) * 16 + 4 * c;
    const bf16_t* x_thread = x + static_cast<size_t>(row0) * ldx + 2 * q;  // k 8 c + 4 s + 2 h = 2 q
#pragma unroll
    for (int b = 0; b < GEMM_WGMMA_CHUNK; ++b) {
        const int kb = chunk * GEMM_WGMMA_CHUNK + b;
        const int kk = kb * GEMM_ROWS_K_BLOCK + 2 * q;
        const bool k_valid = kb < k_blocks && kk < k;
#pragma unroll
        for (int pass = 0; pass < PASSES; ++pass) {
            const bool valid = k_valid && row0 + pass * ROWS_PER_PASS < rows_here;
            const bf16_t* source = x_thread + static_cast<size_t>(pass * ROWS_PER_PASS) * ldx + kb * GEMM_ROWS_K_BLOCK;
            copy_word_async(first + b * gemm_wgmma_block_bytes<N>() + pass * ROWS_PER_PASS * 16, valid ? source : x,
                            valid);
        }
    }
}

// The weight loads of one step (STEP blocks of 32 k from kb_step on) of the warp's tile pair: the
// A operands of its two k16 steps a block. Never predicated (a predicated load that gives zeros
// off the matrix compiles to a load into scratch registers and a select right behind it, which
// waits for the load): the pointer is clamped into the matrix instead. A block past k is loaded
// and never multiplied (its wgmma is skipped); a pair past n (w_pair repeats the last pair) only
// feeds output columns >= n, which are never stored.
__device__ __forceinline__ void gemm_wgmma_load_step(uint4 (&w_frag)[GEMM_WGMMA_STEP][2], const bf16_t* w_pair,
                                                     int kb_step, int k_blocks)
{
#pragma unroll
    for (int u = 0; u < GEMM_WGMMA_STEP; ++u) {
        const bf16_t* block = w_pair + static_cast<size_t>(min(kb_step + u, k_blocks - 1)) * GEMM_WGMMA_PAIR_BLOCK;
        w_frag[u][0] = load_weight_16B_unguarded(block);
        w_frag[u][1] = load_weight_16B_unguarded(block + GEMM_WGMMA_PAIR_BLOCK / 2);
    }
}

// The weight ring of one warp: `depth` steps of weight it keeps in flight through shared memory,
// copied by the bulk copy engine on one mbarrier a slot and read into the A registers just before
// their wgmma (0: no ring, the warp loads its weight into registers one step ahead; the registers
// hold the same words either way). `data` the shared address of its `depth` slots of STEP (pair,
// k block) blocks, `barriers` of their mbarriers, `w_warp` the warp's pair in global memory,
// `step_base` the steps of earlier groups (slot and phase of step j of this group: (step_base + j)
// % depth and (step_base + j) / depth % 2).
struct GemmWgmmaWeightRing {
    int depth;
    unsigned int data;
    unsigned int barriers;
    const bf16_t* w_warp;
    int step_base;
};

#define GEMM_WGMMA_SLOT_BYTES (GEMM_WGMMA_STEP * GEMM_WGMMA_PAIR_BLOCK * 2)

// Lane 0: start the copy of step j's blocks (those inside the matrix) into its slot.
__device__ __forceinline__ void gemm_wgmma_ring_issue(const GemmWgmmaWeightRing& wr, int j, int k_blocks)
{
    const int kb = j * GEMM_WGMMA_STEP;
    if (kb >= k_blocks) {
        return;
    }
    const int slot = (wr.step_base + j) % wr.depth;
    const unsigned int bytes = min(GEMM_WGMMA_STEP, k_blocks - kb) * GEMM_WGMMA_PAIR_BLOCK * 2;
    const unsigned int barrier = wr.barriers + 8 * slot;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     wr.data + slot * GEMM_WGMMA_SLOT_BYTES),
                 "l"(wr.w_warp + static_cast<size_t>(kb) * GEMM_WGMMA_PAIR_BLOCK), "r"(bytes), "r"(barrier)
                 : "memory");
}

// Every lane: wait for step j's slot, then read its A fragments (this lane's 16 bytes of each step
// of each block) into registers.
__device__ __forceinline__ void gemm_wgmma_ring_read(uint4 (&w_frag)[GEMM_WGMMA_STEP][2], const GemmWgmmaWeightRing& wr,
                                                     int j, int lane)
{
    const int use = wr.step_base + j;
    const int slot = use % wr.depth;
    asm volatile(
        "{\n"
        ".reg .pred ready;\n"
        "GEMM_WGMMA_RING_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
        "@!ready bra GEMM_WGMMA_RING_WAIT;\n"
        "}\n" ::"r"(wr.barriers + 8 * slot),
        "r"((use / wr.depth) & 1)
        : "memory");
    const unsigned int base = wr.data + slot * GEMM_WGMMA_SLOT_BYTES + 16 * lane;
#pragma unroll
    for (int u = 0; u < GEMM_WGMMA_STEP; ++u) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint4& v = w_frag[u][h];
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(base + (2 * u + h) * GEMM_WGMMA_PAIR_BLOCK)
                         : "memory");
        }
    }
}

// The per-group state of one warpgroup: the running sum of the finished k ranges, the range being
// summed, and where the next range starts.
template <int N>
struct GemmWgmmaSums {
    float total[N / 2];
    float acc[N / 2];
    int range;       // index of the range acc belongs to
    int next_start;  // first block of range + 1
};

// One step: STEP blocks of 32 k from kb_step on, their weights in w_frag (the next step's are
// loaded into w_next first, so that they are in flight while this step's wgmma run). At a stage
// boundary the block waits for the stage's copies and starts the copies of the stage STAGES - 1
// ahead (into the slot of the stage every warp has just finished).
template <int N, int THREADS>
__device__ __forceinline__ void gemm_wgmma_step(GemmWgmmaSums<N>& sums, uint4 (&w_frag)[GEMM_WGMMA_STEP][2],
                                                uint4 (&w_next)[GEMM_WGMMA_STEP][2], const bf16_t* w_pair,
                                                int kb_step,
                                                int k_blocks, int k_range, unsigned int ring, const bf16_t* x, int ldx,
                                                int rows_here, int k, const GemmWgmmaWeightRing& wr)
{
    if (wr.depth > 0) {
        gemm_wgmma_ring_read(w_frag, wr, kb_step / GEMM_WGMMA_STEP, threadIdx.x & 31);
    } else if (GEMM_WGMMA_LOADS_FIRST) {
        gemm_wgmma_load_step(w_next, w_pair, kb_step + GEMM_WGMMA_STEP, k_blocks);
    }
    if (kb_step % GEMM_WGMMA_CHUNK == 0) {
        const int chunk = kb_step / GEMM_WGMMA_CHUNK;
        copy_wait<GEMM_WGMMA_STAGES - 2>();
#if !GEMM_WGMMA_NO_PROXY_FENCE
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
        __syncthreads();
        const int ahead = chunk + GEMM_WGMMA_STAGES - 1;
        if (ahead * GEMM_WGMMA_CHUNK < k_blocks) {
            gemm_wgmma_stage_x<N, THREADS>(ring, x, ldx, rows_here, k, k_blocks, ahead);
        }
        copy_commit();  // empty past the matrix: one group per stage keeps the count of copy_wait
    }
    if (wr.depth == 0 && !GEMM_WGMMA_LOADS_FIRST) {
        gemm_wgmma_load_step(w_next, w_pair, kb_step + GEMM_WGMMA_STEP, k_blocks);
    }
    wgmma_fence();
#pragma unroll
    for (int u = 0; u < GEMM_WGMMA_STEP; ++u) {
        const int kb = kb_step + u;
        if (kb < k_blocks) {  // warpgroup-uniform
            if (kb == sums.next_start) {
                // A new k range: fold the finished one into the total, start from zero.
                if (kb > 0) {
                    wgmma_commit();
                    wgmma_wait_all();
                    wgmma_hold(sums.acc);
#pragma unroll
                    for (int i = 0; i < N / 2; ++i) {
                        sums.total[i] = sums.range == 0 ? sums.acc[i] : sums.total[i] + sums.acc[i];
                    }
                    ++sums.range;
                }
#pragma unroll
                for (int i = 0; i < N / 2; ++i) {
                    sums.acc[i] = 0.0f;
                }
                sums.next_start += k_range;
                wgmma_fence();
            }
            const unsigned int block = ring + ((kb / GEMM_WGMMA_CHUNK) % GEMM_WGMMA_STAGES) *
                                                  (GEMM_WGMMA_CHUNK * gemm_wgmma_block_bytes<N>()) +
                                       (kb % GEMM_WGMMA_CHUNK) * gemm_wgmma_block_bytes<N>();
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                wgmma_m64nk16(sums.acc, w_frag[u][s],
                              wgmma_descriptor(block + s * 2 * N * 16, N * 16, 128));
            }
        }
    }
    wgmma_commit();
    wgmma_wait_all();
    wgmma_hold(sums.acc);
#pragma unroll
    for (int u = 0; u < GEMM_WGMMA_STEP; ++u) {
        wgmma_hold(w_frag[u][0]);
        wgmma_hold(w_frag[u][1]);
    }
    if (wr.depth > 0) {
        // Every lane has read the slot (its registers fed the finished wgmma): refill it with the
        // step `depth` ahead.
        __syncwarp();
        if ((threadIdx.x & 31) == 0) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            gemm_wgmma_ring_issue(wr, kb_step / GEMM_WGMMA_STEP + wr.depth, k_blocks);
        }
    }
}

// One block's share of the output: rows [row_begin, row_end) (at most N) and the column groups of
// 64 WG columns blockIdx.x, blockIdx.x + gridDim.x, ... `ring`: GEMM_WGMMA_STAGES * CHUNK blocks of
// x in shared memory.
template <int N, int WG>
__device__ __forceinline__ void gemm_wgmma_sweep(const bf16_t* __restrict__ x, int ldx, const bf16_t* __restrict__ w,
                                                 bf16_t* __restrict__ y, int ldy, int row_begin, int row_end, int n,
                                                 int k, unsigned int ring, int ring_depth)
{
    constexpr int THREADS = WG * GEMM_WGMMA_WARPGROUP;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warpgroup = warp >> 2, warp_in_group = warp & 3;
    const int k_blocks = gemm_rows_k_blocks(k);
    const int k_split = k_split_for(k);
    const int k_range = (k_blocks + k_split - 1) / k_split;
    const int n_pairs = (n + 2 * GEMM_ROWS_N_TILE - 1) / (2 * GEMM_ROWS_N_TILE);
    const int groups = (n + WG * GEMM_WGMMA_COLUMNS - 1) / (WG * GEMM_WGMMA_COLUMNS);
    const int pair_stride = k_blocks * GEMM_WGMMA_PAIR_BLOCK;
    const int rows_here = row_end - row_begin;
    const bf16_t* x_rows = x + static_cast<size_t>(row_begin) * ldx;
    const int steps = (k_blocks + GEMM_WGMMA_STEP - 1) / GEMM_WGMMA_STEP;  // of one group

    // After x's ring: each warp's weight slots, then their mbarriers.
    const unsigned int weight_ring = ring + GEMM_WGMMA_STAGES * GEMM_WGMMA_CHUNK * gemm_wgmma_block_bytes<N>();
    GemmWgmmaWeightRing wr;
    wr.depth = ring_depth;
    wr.data = weight_ring + warp * ring_depth * GEMM_WGMMA_SLOT_BYTES;
    wr.barriers = weight_ring + WG * 4 * ring_depth * GEMM_WGMMA_SLOT_BYTES + warp * ring_depth * 8;
    if (ring_depth > 0) {
        if (lane == 0) {
            for (int slot = 0; slot < ring_depth; ++slot) {
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(wr.barriers + 8 * slot) : "memory");
            }
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncwarp();
    }
    wr.step_base = 0;
    bool waited = false;

    for (int group = blockIdx.x; group < groups; group += gridDim.x) {
        const int tile = (group * WG + warpgroup) * (GEMM_WGMMA_COLUMNS / GEMM_ROWS_N_TILE) + 2 * warp_in_group;
        const bf16_t* w_warp = w + static_cast<size_t>(min(tile / 2, n_pairs - 1)) * pair_stride;
        const bf16_t* w_pair = w_warp + 8 * lane;
        wr.w_warp = w_warp;
        // The weight is no kernel's output: its first steps start before the wait below.
        if (ring_depth > 0 && lane == 0) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // after the last group's reads
            for (int j = 0; j < ring_depth && j < steps; ++j) {
                gemm_wgmma_ring_issue(wr, j, k_blocks);
            }
        }
        if (!waited) {
            // x (and y) may belong to the previous kernel: nothing below runs before it is done.
            kda_wait_for_previous_kernel();
            waited = true;
        }

        for (int chunk = 0; chunk < GEMM_WGMMA_STAGES - 1; ++chunk) {
            gemm_wgmma_stage_x<N, THREADS>(ring, x_rows, ldx, rows_here, k, k_blocks, chunk);
            copy_commit();
        }
        GemmWgmmaSums<N> sums;
        sums.range = 0;
        sums.next_start = 0;
        uint4 w_a[GEMM_WGMMA_STEP][2], w_b[GEMM_WGMMA_STEP][2];
        if (ring_depth == 0) {
            gemm_wgmma_load_step(w_a, w_pair, 0, k_blocks);
        }
        for (int kb_step = 0; kb_step < k_blocks; kb_step += 2 * GEMM_WGMMA_STEP) {
            gemm_wgmma_step<N, THREADS>(sums, w_a, w_b, w_pair, kb_step, k_blocks,
                                        k_range, ring, x_rows, ldx, rows_here, k, wr);
            if (kb_step + GEMM_WGMMA_STEP < k_blocks) {
                gemm_wgmma_step<N, THREADS>(sums, w_b, w_a, w_pair,
                                            kb_step + GEMM_WGMMA_STEP, k_blocks, k_range, ring, x_rows, ldx,
                                            rows_here, k, wr);
            }
        }
        wr.step_base += steps;
        // The last range, then the ranges past the matrix (empty: a partial sum of zero, added as
        // gemm_rows_group adds it).
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            sums.total[i] = sums.range == 0 ? sums.acc[i] : sums.total[i] + sums.acc[i];
        }
        for (int range = sums.range + 1; range < k_split; ++range) {
#pragma unroll
            for (int i = 0; i < N / 2; ++i) {
                sums.total[i] += 0.0f;
            }
        }
        const int g = lane >> 2, t = lane & 3;
        const int column_base = tile * GEMM_ROWS_N_TILE + g;
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const int e = i & 3;
            const int column = column_base + 8 * (e >> 1);
            const int row = 8 * (i >> 2) + 2 * t + (e & 1);
            if (row < rows_here && column < n) {
                y[static_cast<size_t>(row_begin + row) * ldy + column] = f32_to_bf16(sums.total[i]);
            }
        }
        // Every stage's copies landed and were read before the next group's copies reuse the ring.
        copy_wait<0>();
        __syncthreads();
    }
}

// Launch: block WG * 128 threads, dynamic shared memory as below, grid.y
// = row groups of 64, grid.x any number of blocks (each loops over the groups of 64 WG columns).
// `ring_depth` (the last argument, where the other sweeps take their L2 request): steps of weight a
// warp keeps in flight through shared memory (GemmWgmmaWeightRing; 0: into registers, one step
// ahead). Dynamic shared memory: STAGES * CHUNK blocks of x, then 4 WG ring_depth slots of
// GEMM_WGMMA_SLOT_BYTES and as many 8-byte mbarriers (glm_kda/gemm_rows.py sizes it). One entry
// per (N, WG): gemm_rows_wgmma_n<N>_g<WG>.
template <int N, int WG>
__device__ __forceinline__ void gemm_wgmma_entry(const bf16_t* __restrict__ x, int ldx, const bf16_t* __restrict__ w,
                                                 bf16_t* __restrict__ y, int ldy, int rows, int n, int k,
                                                 int ring_depth)
{
    extern __shared__ __align__(128) unsigned char gemm_wgmma_ring[];
    kda_let_next_kernel_launch();
    const int row_begin = blockIdx.y * GEMM_ROWS_M_GROUP;
    if (row_begin >= rows || blockDim.x != WG * GEMM_WGMMA_WARPGROUP) {
        return;
    }
    const int row_end = min(rows, row_begin + N);
    gemm_wgmma_sweep<N, WG>(x, ldx, w, y, ldy, row_begin, row_end, n, k, shared_address(gemm_wgmma_ring),
                            ring_depth);
}

#define GEMM_WGMMA_ENTRY(N, WG)                                                                   \
    extern "C" __global__ void __launch_bounds__(WG * GEMM_WGMMA_WARPGROUP, GEMM_WGMMA_WARPGROUPS_PER_SM / WG)               \
        gemm_rows_wgmma_n##N##_g##WG(const bf16_t* __restrict__ x, int ldx, const bf16_t* __restrict__ w, \
                                     bf16_t* __restrict__ y, int ldy, int rows, int n, int k,       \
                                     int ring_depth)                                                \
    {                                                                                               \
        gemm_wgmma_entry<N, WG>(x, ldx, w, y, ldy, rows, n, k, ring_depth);                         \
    }

GEMM_WGMMA_ENTRY(32, 1)
GEMM_WGMMA_ENTRY(64, 1)
GEMM_WGMMA_ENTRY(32, 2)
GEMM_WGMMA_ENTRY(64, 2)
