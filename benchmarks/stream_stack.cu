// A stack's one-token decode as one persistent kernel whose weight stream never waits for the data:
// the floor that benchmarks/stream_stack.py measures. Not a product kernel: the step is a stand-in
// (no conv, no gates, a fixed decay and beta) and the sums are plain FP32 FMAs.
//
// One block an SM (a cooperative launch, so every block is resident and the counters below always
// progress). Warp 0's first lane streams the block's share of every layer's weights, in the order
// they are used, into a ring of shared-memory slots by bulk copies; it waits only for a slot to be
// free. The other warps consume the slots: per layer,
//   q|k|v (and the low-rank chain's bytes, as extra rows)  x_L [hidden]   -> qkv [rows]
//   the step of head h on block h                           qkv, state    -> core [heads * D], state
//   o_proj                                                  core          -> x_{L+1} [hidden]
// each phase waiting on a counter that the phase before counts up in every block. While a block's
// consumers wait, its producer keeps the weight stream going, up to the ring's size ahead.
// Needs sm_90 (bulk copies, mbarriers). Headers prepended by the script: common/sync.cuh, common/mbarrier.cuh.

#define STREAM_CONSUMER_WARPS 8
#define STREAM_THREADS (32 * (1 + STREAM_CONSUMER_WARPS))
#define STREAM_HEAD_DIM 128

// Rows [first, last) of an n-row weight that block b of `blocks` streams, and its chunks of whole rows.
struct StreamShare {
    int first, last, rows_per_chunk, chunks;
};

__device__ __forceinline__ StreamShare stream_share(int n, int k, int block, int blocks, int slot_bytes)
{
    StreamShare share;
    share.first = static_cast<int>(static_cast<long long>(n) * block / blocks);
    share.last = static_cast<int>(static_cast<long long>(n) * (block + 1) / blocks);
    share.rows_per_chunk = slot_bytes / (2 * k);  // (the script keeps a row within a slot)
    share.chunks = (share.last - share.first + share.rows_per_chunk - 1) / share.rows_per_chunk;
    return share;
}

// n and k of a layer's phase 0 (q|k|v and the rest of the layer's bytes, from x) and phase 1 (o_proj, from
// core): the producer streams and the consumers use the same shares.
__device__ __forceinline__ void phase_shape(int phase, int qkv_rows, int hidden, int core_width, int& n, int& k)
{
    n = phase == 0 ? qkv_rows : hidden;
    k = phase == 0 ? hidden : core_width;
}

// A barrier of the consumer warps alone (named barrier 1; the producer warp never takes part).
__device__ __forceinline__ void consumers_sync()
{
    asm volatile("bar.sync 1, %0;" ::"n"(32 * STREAM_CONSUMER_WARPS) : "memory");
}

// The producer: every chunk of the block's share, layer by layer (q|k|v, then o_proj), into slot
// `sequence % slots` once the consumer of that slot's previous chunk has let it go.
__device__ void stream_weights(const unsigned short* qkv_w, const unsigned short* o_w, unsigned char* ring,
                               unsigned int full, unsigned int empty, int slots, int slot_bytes, int layers,
                               int qkv_rows, int hidden, int core_width)
{
    int sequence = 0;
    for (int layer = 0; layer < layers; ++layer) {
        for (int phase = 0; phase < 2; ++phase) {
            int n, k;
            phase_shape(phase, qkv_rows, hidden, core_width, n, k);
            const unsigned short* w =
                (phase == 0 ? qkv_w : o_w) + static_cast<size_t>(layer) * static_cast<size_t>(n) * k;
            const StreamShare share = stream_share(n, k, blockIdx.x, gridDim.x, slot_bytes);
            for (int chunk = 0; chunk < share.chunks; ++chunk, ++sequence) {
                const int slot = sequence % slots, round = sequence / slots;
                if (round > 0) {
                    mbarrier_wait(empty + 8 * slot, (round - 1) & 1);
                }
                const int row = share.first + chunk * share.rows_per_chunk;
                const int rows = min(share.rows_per_chunk, share.last - row);
                const unsigned int bytes = static_cast<unsigned int>(rows) * 2u * k;
                mbarrier_expect_bytes(full + 8 * slot, bytes);
                bulk_copy_to_shared(shared_address(ring + static_cast<size_t>(slot) * slot_bytes),
                                    w + static_cast<size_t>(row) * k, bytes, full + 8 * slot);
            }
        }
    }
}

// One warp: y[row] = w[row, :] . x for the chunk's rows (BF16 weights in the slot, x FP32 in shared memory).
__device__ __forceinline__ void chunk_sums(const unsigned char* slot, const float* x, float* y, int first_row,
                                           int rows, int k, int lane)
{
    for (int r = 0; r < rows; ++r) {
        const uint4* w = reinterpret_cast<const uint4*>(slot + static_cast<size_t>(r) * 2 * k);
        float sum = 0.0f;
        for (int piece = lane; piece < k / 8; piece += 32) {
            const uint4 v = w[piece];
            const float4 x0 = reinterpret_cast<const float4*>(x)[2 * piece];
            const float4 x1 = reinterpret_cast<const float4*>(x)[2 * piece + 1];
            sum += __uint_as_float(v.x << 16) * x0.x + __uint_as_float(v.x & 0xffff0000u) * x0.y;
            sum += __uint_as_float(v.y << 16) * x0.z + __uint_as_float(v.y & 0xffff0000u) * x0.w;
            sum += __uint_as_float(v.z << 16) * x1.x + __uint_as_float(v.z & 0xffff0000u) * x1.y;
            sum += __uint_as_float(v.w << 16) * x1.z + __uint_as_float(v.w & 0xffff0000u) * x1.w;
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        }
        if (lane == 0) {
            y[first_row + r] = sum;
        }
    }
}

// The consumers of phase `phase` (phase_shape's) of a layer: x (k floats, written by other blocks) into
// shared memory once `counter` reaches `target`, then the warp's chunks (every STREAM_CONSUMER_WARPS-th
// of the block's sequence), then one count per warp in `done`. Returns the sequence number after the phase.
__device__ int consume_phase(const unsigned char* ring, unsigned int full, unsigned int empty, int slots,
                             int slot_bytes, int sequence, const int* counter, int target, const float* x_in,
                             float* x_shared, int phase, int qkv_rows, int hidden, int core_width, float* y,
                             int* done, int warp, int lane, int consumer)
{
    int n, k;
    phase_shape(phase, qkv_rows, hidden, core_width, n, k);
    consumers_sync();  // every warp is done with x_shared's previous contents
    if (consumer == 0 && counter != nullptr) {
        wait_for_counter(counter, target);
    }
    consumers_sync();
    for (int i = consumer; i < k; i += 32 * STREAM_CONSUMER_WARPS) {
        x_shared[i] = x_in[i];
    }
    consumers_sync();
    const StreamShare share = stream_share(n, k, blockIdx.x, gridDim.x, slot_bytes);
    for (int chunk = 0; chunk < share.chunks; ++chunk) {
        const int at = sequence + chunk;
        if (at % STREAM_CONSUMER_WARPS != warp) {
            continue;
        }
        const int slot = at % slots;
        mbarrier_wait(full + 8 * slot, (at / slots) & 1);
        const int row = share.first + chunk * share.rows_per_chunk;
        chunk_sums(ring + static_cast<size_t>(slot) * slot_bytes, x_shared, y, row,
                   min(share.rows_per_chunk, share.last - row), k, lane);
        __syncwarp();
        if (lane == 0) {
            mbarrier_arrive(empty + 8 * slot);
        }
    }
    __syncwarp();
    if (lane == 0) {
        kda_count_release(done);
    }
    return sequence + share.chunks;
}

// The stand-in step of head `head`: consumer threads 2 d and 2 d + 1 step value column d of the
// head's FP32 state [D_k, D_v], each over half of the k rows: s = decay s; s += k (beta (v - s^T k))^T;
// core = s^T q (q and k scaled by 1/sqrt(D)).
__device__ void step_head(const float* qkv, float* state, float* core, float* shared, int head, int core_width,
                          int consumer)
{
    constexpr int HALF = STREAM_HEAD_DIM / 2;
    const float scale = rsqrtf(static_cast<float>(STREAM_HEAD_DIM));
    float* q_s = shared;
    float* k_s = shared + STREAM_HEAD_DIM;
    if (consumer < STREAM_HEAD_DIM) {
        q_s[consumer] = qkv[head * STREAM_HEAD_DIM + consumer] * scale;
        k_s[consumer] = qkv[core_width + head * STREAM_HEAD_DIM + consumer] * scale;
    }
    consumers_sync();
    const int d = consumer / 2, first = HALF * (consumer % 2);
    const float v = qkv[2 * core_width + head * STREAM_HEAD_DIM + d];
    float* column = state + (static_cast<size_t>(head) * STREAM_HEAD_DIM + first) * STREAM_HEAD_DIM + d;
    float s[HALF];
    float kv = 0.0f;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
        s[i] = 0.9f * column[i * STREAM_HEAD_DIM];
        kv += s[i] * k_s[first + i];
    }
    kv += __shfl_xor_sync(0xffffffffu, kv, 1);
    const float delta = 0.5f * (v - kv);
    float out = 0.0f;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
        s[i] += k_s[first + i] * delta;
        out += s[i] * q_s[first + i];
        column[i * STREAM_HEAD_DIM] = s[i];
    }
    out += __shfl_xor_sync(0xffffffffu, out, 1);
    if (consumer % 2 == 0) {
        core[head * STREAM_HEAD_DIM + d] = out;
    }
}

// x [layers + 1, hidden] (row 0 the input; row L + 1 layer L's output), qkv [layers, qkv_rows],
// core [layers, core_width], state [layers, heads, D, D], counters [layers, 3] (q|k|v, step, o_proj
// counts, never reset: launch e waits for e times each phase's count), weights [layers, n, k] BF16 bits.
// slots: ring slots of slot_bytes each (a multiple of 16 holding a row of either weight). waits == 0: no
// phase waits for the one before (the stream and the sums alone).
extern "C" __global__ void __launch_bounds__(STREAM_THREADS, 1)
    stream_stack(const unsigned short* __restrict__ qkv_w, const unsigned short* __restrict__ o_w, float* x,
                 float* qkv, float* core, float* state, int* counters, int layers, int qkv_rows, int hidden,
                 int heads, int launch, int waits, int slots, int slot_bytes)
{
    extern __shared__ __align__(128) unsigned char stream_ring[];
    const int core_width = heads * STREAM_HEAD_DIM;
    float* x_shared = reinterpret_cast<float*>(stream_ring + static_cast<size_t>(slots) * slot_bytes);
    // (x's copy: hidden or core_width floats; the step's q and k: 2 D.)
    unsigned char* barriers =
        reinterpret_cast<unsigned char*>(x_shared + max(max(hidden, core_width), 2 * STREAM_HEAD_DIM));
    const unsigned int full = shared_address(barriers), empty = full + 8 * slots;
    if (threadIdx.x == 0) {
        for (int slot = 0; slot < slots; ++slot) {
            mbarrier_init(full + 8 * slot, 1);
            mbarrier_init(empty + 8 * slot, 1);
        }
        mbarrier_init_fence();
    }
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp == 0) {
        if (lane == 0) {
            stream_weights(qkv_w, o_w, stream_ring, full, empty, slots, slot_bytes, layers, qkv_rows, hidden,
                           core_width);
        }
        return;
    }
    const int consumer = threadIdx.x - 32, consumer_warp = warp - 1;
    const int warp_counts = gridDim.x * STREAM_CONSUMER_WARPS;
    int sequence = 0;
    for (int layer = 0; layer < layers; ++layer) {
        int* count = counters + 3 * layer;
        const int* input_ready = waits && layer > 0 ? counters + 3 * (layer - 1) + 2 : nullptr;  // o_proj's
        float* layer_qkv = qkv + static_cast<size_t>(layer) * qkv_rows;
        float* layer_core = core + static_cast<size_t>(layer) * core_width;
        sequence = consume_phase(stream_ring, full, empty, slots, slot_bytes, sequence, input_ready,
                                 launch * warp_counts, x + static_cast<size_t>(layer) * hidden, x_shared, 0,
                                 qkv_rows, hidden, core_width, layer_qkv, count, consumer_warp, lane, consumer);
        if (blockIdx.x < heads) {
            consumers_sync();
            if (consumer == 0 && waits) {
                wait_for_counter(count, launch * warp_counts);
            }
            consumers_sync();
            step_head(layer_qkv, state + static_cast<size_t>(layer) * core_width * STREAM_HEAD_DIM, layer_core,
                      x_shared, blockIdx.x, core_width, consumer);
            consumers_sync();
            if (consumer == 0) {
                kda_count_release(count + 1);
            }
        }
        sequence = consume_phase(stream_ring, full, empty, slots, slot_bytes, sequence, waits ? count + 1 : nullptr,
                                 launch * heads, layer_core, x_shared, 1, qkv_rows, hidden, core_width,
                                 x + static_cast<size_t>(layer + 1) * hidden, count + 2, consumer_warp, lane,
                                 consumer);
    }
}
