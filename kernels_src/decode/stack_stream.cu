// One token of one sequence through every layer of a stack in one persistent launch (sm_90 and later),
// with the bits of the layers' own launches: each projection's column groups are gemm_rows_group's
// (the same k split, mma chains and fold), each head's step is kda_decode_head.
//
// Why one launch: between separate launches the weight stream stops at every dependency (the step
// waits for q|k|v's last block, o_proj for the step, the next layer for o_proj). Here each block
// streams its share of every layer's weights, in the order it uses them, into a ring of shared-memory
// slots by bulk copies, and a slot is refilled as soon as the block has used it, whatever the block
// then waits for: the stream runs a ring ahead of the data's dependencies.
//
// Launch: cooperative (every block resident: the counters below always progress), one block an SM,
// KDA_STREAM_THREADS threads, dynamic shared memory as the kernel lays it out. Per layer and block:
//   down_proj and q|k|v of the layer's input (the stack's input, or the previous layer's final_out),
//   f_b and g_b of down_proj's first two D-wide parts (once every block's down_proj share is out),
//   the step of heads 2b and 2b + 1 on block b < heads / 2 (once q|k|v and the chain are out),
//   o_proj of o_norm_out (once every step is out), into final_out.
// Every block counts each phase done in counters[layer][phase]; the last block out sets them back to 0.
#include "common/mbarrier.cuh"
#include "common/sync.cuh"
#include "decode/decode_head.cuh"
#include "projection/gemm_rows.cuh"

#define KDA_STREAM_THREADS GEMM_ROWS_THREADS

// The projections of a layer, in the order a block streams and uses them.
enum KdaStreamProjection : int {
    KDA_STREAM_DOWN = 0,
    KDA_STREAM_QKV = 1,
    KDA_STREAM_F_B = 2,
    KDA_STREAM_G_B = 3,
    KDA_STREAM_O_PROJ = 4,
    KDA_STREAM_PROJECTIONS = 5,
};

// The phases counted per layer (counters[layer * KDA_STREAM_PHASES + phase]).
enum KdaStreamPhase : int {
    KDA_STREAM_DOWN_DONE = 0,
    KDA_STREAM_QKV_DONE = 1,
    KDA_STREAM_CHAIN_DONE = 2,
    KDA_STREAM_STEP_DONE = 3,
    KDA_STREAM_O_PROJ_DONE = 4,
    KDA_STREAM_PHASES = 5,
};

// The call's table of device pointers (glm_kda.gpu.ops.stack_stream builds it, 8 bytes each, no padding):
// KdaStreamRows, then one KdaStreamLayer a layer.
struct KdaStreamRows {
    bf16_t* down_proj;
    bf16_t* qkv_proj;
    bf16_t* forget_proj;
    bf16_t* out_gate;
    bf16_t* final_out;
    bf16_t* conv_out;
    float* query;
    float* key;
    float* value;
    float* gate;
    float* beta;
    float* core;
    bf16_t* o_norm_out;
};

// A layer's packed weights of the five projections, its step's parameters and the sequence's states.
struct KdaStreamLayer {
    const bf16_t* weights[KDA_STREAM_PROJECTIONS];
    const bf16_t* conv_w;
    const float* dt_bias;
    const float* a_log;
    const bf16_t* norm_w;
    float* conv_state;
    float* state;
};

// What every layer shares: the geometry and the step's scalars.
struct KdaStreamShape {
    int hidden, heads, down_dim, kernel_size, gate_law;
    float lower_bound, scale, l2_eps, norm_eps;
};

// n and k of a projection.
__device__ __forceinline__ void kda_stream_dims(const KdaStreamShape& shape, int projection, int& n, int& k)
{
    const int width = shape.heads * KDA_HEAD_DIM;
    n = projection == KDA_STREAM_DOWN ? shape.down_dim
        : projection == KDA_STREAM_QKV ? 3 * width
        : projection == KDA_STREAM_O_PROJ ? shape.hidden
                                          : width;
    k = projection == KDA_STREAM_F_B || projection == KDA_STREAM_G_B ? KDA_HEAD_DIM
        : projection == KDA_STREAM_O_PROJ                            ? width
                                                                     : shape.hidden;
}

// A block's share of a projection: column groups [first, last) of gemm_rows_group (one tile a warp),
// `tiles` tiles of `tile_elements` BF16 each a group.
struct KdaStreamShare {
    int n, k, k_split, first, last, group_tiles;
    size_t tile_elements;
};

__device__ __forceinline__ KdaStreamShare kda_stream_share(const KdaStreamShape& shape, int projection)
{
    KdaStreamShare share;
    kda_stream_dims(shape, projection, share.n, share.k);
    share.k_split = k_split_for(share.k);
    share.group_tiles = gemm_rows_group_columns<1>(share.k_split) / GEMM_ROWS_N_TILE;
    const int tiles = (share.n + GEMM_ROWS_N_TILE - 1) / GEMM_ROWS_N_TILE;
    const int groups = (tiles + share.group_tiles - 1) / share.group_tiles;
    share.first = static_cast<int>(static_cast<long long>(groups) * blockIdx.x / gridDim.x);
    share.last = static_cast<int>(static_cast<long long>(groups) * (blockIdx.x + 1) / gridDim.x);
    share.tile_elements = static_cast<size_t>(gemm_rows_k_blocks(share.k)) * GEMM_ROWS_PACKED_BLOCK;
    return share;
}

// The producer's place in the block's chunk sequence (thread 0): layer, projection, group.
struct KdaStreamCursor {
    int layer, projection, group;
    KdaStreamShare share;
};

// Move to the next group the block streams (projections with no group of this block's skipped);
// false past the last layer.
__device__ __forceinline__ bool kda_stream_next(KdaStreamCursor& cursor, const KdaStreamShape& shape, int layers,
                                                bool first)
{
    if (!first && ++cursor.group < cursor.share.last) {
        return true;
    }
    for (;;) {
        if (!first) {
            if (++cursor.projection == KDA_STREAM_PROJECTIONS) {
                cursor.projection = 0;
                ++cursor.layer;
            }
        }
        first = false;
        if (cursor.layer >= layers) {
            return false;
        }
        cursor.share = kda_stream_share(shape, cursor.projection);
        cursor.group = cursor.share.first;
        if (cursor.group < cursor.share.last) {
            return true;
        }
    }
}

// Thread 0: the bulk copy of the cursor's group into slot `issued % slots`.
__device__ __forceinline__ void kda_stream_issue(const KdaStreamCursor& cursor, const KdaStreamLayer* table,
                                                 unsigned char* ring, unsigned int full, int slots, int slot_bytes,
                                                 int issued)
{
    const KdaStreamShare& share = cursor.share;
    const int tiles = (share.n + GEMM_ROWS_N_TILE - 1) / GEMM_ROWS_N_TILE;
    const int first_tile = cursor.group * share.group_tiles;
    const int group_tiles = min(share.group_tiles, tiles - first_tile);
    const unsigned int bytes = static_cast<unsigned int>(group_tiles * share.tile_elements * sizeof(bf16_t));
    const int slot = issued % slots;
    mbarrier_expect_bytes(full + 8 * slot, bytes);
    bulk_copy_to_shared(shared_address(ring + static_cast<size_t>(slot) * slot_bytes),
                        table[cursor.layer].weights[cursor.projection] + first_tile * share.tile_elements, bytes,
                        full + 8 * slot);
}

// x's row into shared memory as gemm_rows_group's staged x takes it: k padded with zeros to whole k
// blocks, after a 16-byte zero chunk (x_region). Coherent loads: the row was written in this launch.
__device__ __forceinline__ void kda_stream_load_x(bf16_t* x_region, const bf16_t* x, int k)
{
    const int padded = gemm_rows_k_blocks(k) * GEMM_ROWS_K_BLOCK;
    if (threadIdx.x == 0) {
        *reinterpret_cast<uint4*>(x_region) = uint4{0u, 0u, 0u, 0u};
    }
    for (int column = 8 * threadIdx.x; column < padded; column += 8 * KDA_STREAM_THREADS) {
        *reinterpret_cast<uint4*>(x_region + 8 + column) = load_produced_16B(x + column, column < k);
    }
    __syncthreads();
}

// Thread 0 waits until counters[index] reaches target, then the block goes on (its later reads see what
// the counted blocks wrote before they counted).
__device__ __forceinline__ void kda_stream_wait(const int* counters, int index, int target)
{
    if (threadIdx.x == 0) {
        wait_for_counter(counters + index, target);
    }
    __syncthreads();
}

// Every thread: the block's writes so far are out; thread 0 counts the phase in counters[index].
__device__ __forceinline__ void kda_stream_count(int* counters, int index)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        kda_count_release(counters + index);
    }
}

extern "C" __global__ void __launch_bounds__(KDA_STREAM_THREADS, 1)
    kda_stack_stream_bf16(const bf16_t* __restrict__ input, const KdaStreamRows* __restrict__ call, int layers,
                          int hidden, int heads, int down_dim, int kernel_size, int gate_law, float lower_bound,
                          float scale, float l2_eps, float norm_eps, int* counters, int slots, int slot_bytes)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    // (No bulk copies or mbarriers before sm_90: glm_kda.gpu.ops.stack_stream launches it on sm_90 and later.)
    return;
#else
    // Dynamic shared memory, in this order (glm_kda.gpu.ops.stack_stream.shared_bytes adds it up): the ring
    // of `slots` slots of slot_bytes; the column groups' partial sums; the step's shared memory of each of a
    // block's two heads; one `full` mbarrier a slot; x's copy (a 16-byte zero chunk, then the widest k
    // padded to whole k blocks).
    extern __shared__ __align__(128) unsigned char kda_stream_ring[];
    unsigned char* after_ring = kda_stream_ring + static_cast<size_t>(slots) * slot_bytes;
    float* partial = reinterpret_cast<float*>(after_ring);
    KdaStepShared* step_shared = reinterpret_cast<KdaStepShared*>(partial + GEMM_ROWS_PARTIAL_FLOATS(1, 1));
    unsigned char* barriers = reinterpret_cast<unsigned char*>(step_shared + 2);
    bf16_t* x_region = reinterpret_cast<bf16_t*>(barriers + 16 * ((slots + 1) / 2));
    const unsigned int full = shared_address(barriers);
    const KdaStreamRows rows = *call;
    const KdaStreamLayer* table = reinterpret_cast<const KdaStreamLayer*>(call + 1);
    const KdaStreamShape shape{hidden, heads, down_dim, kernel_size, gate_law, lower_bound, scale, l2_eps, norm_eps};

    KdaStreamCursor cursor{0, 0, 0, {}};
    int issued = 0;
    bool more = false;
    if (threadIdx.x == 0) {
        for (int slot = 0; slot < slots; ++slot) {
            mbarrier_init(full + 8 * slot, 1);
        }
        mbarrier_init_fence();
        more = kda_stream_next(cursor, shape, layers, true);
        for (; more && issued < slots; ++issued) {
            kda_stream_issue(cursor, table, kda_stream_ring, full, slots, slot_bytes, issued);
            more = kda_stream_next(cursor, shape, layers, false);
        }
    }
    __syncthreads();

    int used = 0;  // chunks of the sequence consumed
    for (int layer = 0; layer < layers; ++layer) {
        const KdaStreamLayer& arrays = table[layer];
        int* count = counters + layer * KDA_STREAM_PHASES;
        for (int projection = 0; projection < KDA_STREAM_PROJECTIONS; ++projection) {
            const bf16_t* x;
            bf16_t* y;
            if (projection == KDA_STREAM_DOWN) {
                if (layer > 0) {
                    kda_stream_wait(count - KDA_STREAM_PHASES, KDA_STREAM_O_PROJ_DONE, gridDim.x);
                }
                x = layer == 0 ? input : rows.final_out;
                y = rows.down_proj;
            } else if (projection == KDA_STREAM_QKV) {
                x = nullptr;  // the same row as down_proj's, in shared memory already
                y = rows.qkv_proj;
            } else if (projection == KDA_STREAM_F_B) {
                kda_stream_wait(count, KDA_STREAM_DOWN_DONE, gridDim.x);
                x = rows.down_proj;
                y = rows.forget_proj;
            } else if (projection == KDA_STREAM_G_B) {
                x = rows.down_proj + KDA_HEAD_DIM;
                y = rows.out_gate;
            } else {
                kda_stream_wait(count, KDA_STREAM_STEP_DONE, shape.heads / 2);
                x = rows.o_norm_out;
                y = rows.final_out;
            }
            const KdaStreamShare share = kda_stream_share(shape, projection);
            if (x != nullptr) {
                kda_stream_load_x(x_region, x, share.k);
            }
            const int padded_k = gemm_rows_k_blocks(share.k) * GEMM_ROWS_K_BLOCK;
            for (int group = share.first; group < share.last; ++group, ++used) {
                const int slot = used % slots;
                mbarrier_wait(full + 8 * slot, (used / slots) & 1);
                const bf16_t* stage =
                    reinterpret_cast<const bf16_t*>(kda_stream_ring + static_cast<size_t>(slot) * slot_bytes);
                gemm_rows_group<1, 1, GEMM_X_STAGED, true>(x_region + 8, padded_k, stage, y, share.n, 0, 1,
                                                           share.n, share.k, share.k_split, group, partial,
                                                           group * share.group_tiles);
                // (The group ended with a barrier: every warp is done with the slot.)
                if (threadIdx.x == 0 && more) {
                    kda_stream_issue(cursor, table, kda_stream_ring, full, slots, slot_bytes, issued++);
                    more = kda_stream_next(cursor, shape, layers, false);
                }
            }
            if (projection == KDA_STREAM_DOWN) {
                kda_stream_count(count, KDA_STREAM_DOWN_DONE);
            } else if (projection == KDA_STREAM_QKV) {
                kda_stream_count(count, KDA_STREAM_QKV_DONE);
            } else if (projection == KDA_STREAM_G_B) {
                kda_stream_count(count, KDA_STREAM_CHAIN_DONE);
                if (static_cast<int>(blockIdx.x) < shape.heads / 2) {
                    kda_stream_wait(count, KDA_STREAM_QKV_DONE, gridDim.x);
                    kda_stream_wait(count, KDA_STREAM_CHAIN_DONE, gridDim.x);
                    const int pair = threadIdx.x / KDA_HEAD_BLOCK, d = threadIdx.x % KDA_HEAD_BLOCK;
                    kda_decode_head<true>(arrays.conv_state, arrays.state, nullptr, rows.qkv_proj, arrays.conv_w,
                                          rows.forget_proj, arrays.dt_bias, arrays.a_log,
                                          rows.down_proj + 2 * KDA_HEAD_DIM, shape.down_dim, rows.out_gate,
                                          arrays.norm_w, rows.conv_out, rows.query, rows.key, rows.value, rows.gate,
                                          rows.beta, rows.core, rows.o_norm_out, shape.heads, shape.kernel_size, 1,
                                          shape.gate_law, shape.lower_bound, shape.scale, shape.l2_eps,
                                          shape.norm_eps, 0, -1, nullptr, nullptr, 2 * blockIdx.x + pair, 0, 1, d,
                                          step_shared[pair]);
                    kda_stream_count(count, KDA_STREAM_STEP_DONE);
                }
            } else if (projection == KDA_STREAM_O_PROJ) {
                kda_stream_count(count, KDA_STREAM_O_PROJ_DONE);
            }
        }
    }

    // The last block out sets every count back to zero for the next launch (counters[layers * phases]:
    // the blocks out).
    __syncthreads();
    if (threadIdx.x == 0) {
        int* out = counters + layers * KDA_STREAM_PHASES;
        if (atomicAdd(out, 1) == static_cast<int>(gridDim.x) - 1) {
            for (int i = 0; i <= layers * KDA_STREAM_PHASES; ++i) {
                counters[i] = 0;
            }
        }
    }
#endif
}
