// A whole decode step of one sequence (1..16 consecutive tokens) in one persistent launch:
// the projections (f_a|g_a|b, q|k|v, f_b, g_b, o_proj), the fused step of every head and the
// output, each as tasks that the blocks take in a fixed order. The separate launches of that
// step (gemm_rows.cu, decode.cu) leave the memory idle at every kernel boundary: the q|k|v
// stream drains before the step starts, the step (one block per head, 64 KB of state each)
// leaves most SMs idle, and o_proj starts only after it. Here a block that has finished a task
// takes the next, so o_proj's weights stream while the last heads step and the tails of the
// kernels overlap.
//
// Tasks (a table built on the host, glm_kda/persistent.py, 8 ints each: kind, index, aux, the
// counter waited on and its target (-1: none), up to three counters signalled (-1: none)):
//   DOWN   column group `index` of down_proj = hidden W_down^T     (gemm_rows_group)
//   QKV    column group `index` of qkv_proj = hidden W_qkv^T
//   UP_F   column group `index` of forget_proj = down_proj[:, :D] W_fb^T
//   UP_G   column group `index` of out_gate = down_proj[:, D:2D] W_gb^T
//   STEP   heads index and index + 1: kda_decode_head, threads 0..127 and 128..255
//   OUT    columns of final_out group `index`, k range `aux` of o_proj: the range's partial
//          sums into out_partial; the last of the k ranges of a group to arrive adds them in
//          ascending range order and writes the BF16 output.
// Every projection computes exactly what gemm_rows_bf16 computes (the same k split, the same
// mma chains, the partial sums added in the same order) and every head exactly what
// kda_decode_fused_bf16 computes (the same device function), so the result is bit for bit
// that of the separate launches: decode, verify and batched decode stay bit-identical.
//
// Ordering: block b takes ticket t = atomicAdd(ticket) and runs task t once task t's
// counter has reached its target. A task only ever waits on tasks of lower tickets, which
// blocks already hold and are running (a block takes a ticket only while it runs), so the
// launch always completes, whatever the grid and however many blocks are resident. A
// producer's writes are made visible before its signal (barrier, then a gpu-scope fence and
// the atomic add by thread 0); a consumer's thread 0 reads the counter with acquire
// semantics before the barrier that lets its block read, and data written during the launch
// is read through L2 (ld.global.cg) or plain loads, never the read-only path. The last
// block to leave sets every counter back to zero for the next launch (a graph replays the
// same launch).
//
// Launch: grid = any number of blocks (the SM count: one block per SM), block
// DECODE_PERSISTENT_THREADS, dynamic shared memory rows x (o_proj's longest k range) BF16;
// counters [counter_count] int32, zero before the first launch.
// trace (null: none) receives per ticket the global timer (ns) when the block took it, when its
// wait ended and when it was done, and the block: [task_count][4] uint64.
#include "gemm_rows.cuh"
#include "decode_step.cuh"

#define DECODE_PERSISTENT_THREADS 256
// Weight loads in flight per lane and step: one block per SM (the step's state column takes
// the registers), so each lane keeps twice what gemm_rows.cu's two blocks per SM keep. On an
// H200 24 and 32 ran no faster (GLM 88.7 and 91.3 us against 89.2, with hidden staged in shared
// memory; 100.3 and 104.7 against 87.2 with it from global memory, then loaded a k block at a
// time): a block streams about 30 GB/s whatever it keeps in flight.
#define DECODE_PERSISTENT_LOADS 16
// Tiles of 8 columns per warp in every projection task but o_proj's, and in o_proj's (narrower:
// the last k range's tasks are the tail of the launch, and more of them run side by side; their
// x comes from shared memory). On an H200 2 tiles ran GLM 87.2 us against 89.1 (4) and 95.3 (1),
// Kimi 46.4 against 47.4 (4) and 46.0 (1).
#define DECODE_PERSISTENT_TILES 4
#define DECODE_PERSISTENT_OUT_TILES 2
#define DECODE_PERSISTENT_TASK_INTS 8

enum DecodeTask {
    TASK_DOWN = 0,
    TASK_QKV = 1,
    TASK_UP_F = 2,
    TASK_UP_G = 3,
    TASK_STEP = 4,
    TASK_OUT = 5,
};

// Fixed counters (the table names the others by index).
#define COUNTER_TICKET 0
#define COUNTER_EXIT 1

// The KDA_HEAD_BLOCK threads from `base` on, as the group of one head. Its barrier is the
// block's: a step task runs two heads, one per half of the block, through the same code (the
// same tokens), so every barrier of kda_decode_head is met by all the block's threads at once.
// (Named barriers per half let a block step one head, but compute-sanitizer's racecheck then
// reports hazards on the task record that no run has shown; the block barrier is clean.)
struct KdaHalfBlock {
    int base;
    __device__ __forceinline__ int thread() const { return static_cast<int>(threadIdx.x) - base; }
    __device__ __forceinline__ void sync() const { __syncthreads(); }
};

__device__ __forceinline__ unsigned long long global_timer_ns()
{
    unsigned long long value;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(value));
    return value;
}

// Every thread's writes so far, then +1 on each of the three counters `named` names
// (negative: none). `named` is the task in shared memory, which only thread 0 rewrites.
__device__ __forceinline__ void signal_counters(int* counters, const int* named)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
#pragma unroll
        for (int i = 0; i < 3; ++i) {
            if (named[i] >= 0) {
                atomicAdd(counters + named[i], 1);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(DECODE_PERSISTENT_THREADS, 1)
kda_decode_persistent_bf16(int* counters, int counter_count, const int* tasks, int task_count, int rows,
                           const bf16_t* hidden, int hidden_size, const bf16_t* down_w, bf16_t* down_proj,
                           int down_dim, const bf16_t* qkv_w, bf16_t* qkv_proj, const bf16_t* f_b_w,
                           bf16_t* forget_proj, const bf16_t* g_b_w, bf16_t* out_gate, const bf16_t* o_w,
                           float* out_partial, bf16_t* final_out, float* conv_state, float* state,
                           const int* slots, const bf16_t* conv_w, const float* dt_bias, const float* a_log,
                           const bf16_t* norm_w, bf16_t* conv_out, float* query, float* key, float* value,
                           float* gate, float* beta, float* core, bf16_t* o_norm_out, int heads, int kernel_size,
                           int bounded, float lower_bound, float scale, float l2_eps, float norm_eps,
                           unsigned long long* trace)
{
    constexpr int TILES = DECODE_PERSISTENT_TILES;
    constexpr int LOADS = DECODE_PERSISTENT_LOADS;
    __shared__ float partial[GEMM_ROWS_PARTIAL_FLOATS(1, TILES)];
    __shared__ KdaStepShared step_shared[2];
    __shared__ int task_s[DECODE_PERSISTENT_TASK_INTS];
    __shared__ int last_s;
    // o_proj's x over one k range (rows x the longest k range BF16), sized by the launch.
    extern __shared__ __align__(16) bf16_t out_x_shared[];

    // Uniform over the block: a wrong launch leaves before any barrier.
    if (blockDim.x != DECODE_PERSISTENT_THREADS || rows < 1 || rows > GEMM_ROWS_M_TILE || kernel_size < 1 ||
        kernel_size > CONV_MAX_KERNEL) {
        return;
    }
    const int dim = KDA_HEAD_DIM;
    const int qkv = heads * dim;
    const KdaStepArgs step_args{conv_state, state, slots, qkv_proj, conv_w, forget_proj, dt_bias, a_log,
                                down_proj + 2 * dim, down_dim, out_gate, norm_w, conv_out, query, key, value,
                                gate, beta, core, o_norm_out, heads, kernel_size, rows, bounded, lower_bound,
                                scale, l2_eps, norm_eps, 0, 0, nullptr, nullptr, 1, nullptr};
    const int out_split = k_split_for(qkv);

    int next = 0;
    int ticket = 0;
    if (threadIdx.x == 0) {
        next = atomicAdd(counters + COUNTER_TICKET, 1);
    }
    for (;;) {
        if (threadIdx.x == 0) {
            ticket = next;
            if (trace != nullptr && ticket < task_count) {
                trace[4 * ticket] = global_timer_ns();
                trace[4 * ticket + 3] = blockIdx.x;
            }
            if (ticket < task_count) {
                const int* task = tasks + static_cast<size_t>(ticket) * DECODE_PERSISTENT_TASK_INTS;
#pragma unroll
                for (int i = 0; i < DECODE_PERSISTENT_TASK_INTS; ++i) {
                    task_s[i] = task[i];
                }
                // The next ticket's atomic in flight while this task runs.
                next = atomicAdd(counters + COUNTER_TICKET, 1);
                if (task_s[3] >= 0) {
                    wait_for_counter(counters + task_s[3], task_s[4]);
                }
                if (trace != nullptr) {
                    trace[4 * ticket + 1] = global_timer_ns();
                }
            } else {
                task_s[0] = -1;
            }
        }
        __syncthreads();
        const int kind = task_s[0];
        const int index = task_s[1];
        const int aux = task_s[2];
        // task_s is rewritten (by thread 0, at the next ticket) only after every thread has read it.
        __syncthreads();
        if (kind < 0) {
            break;
        }
        if (kind == TASK_DOWN || kind == TASK_QKV) {
            // One call for both projections of hidden: one inlined copy of the sweep.
            const bool down = kind == TASK_DOWN;
            const int n = down ? down_dim : 3 * qkv;
            gemm_rows_group<1, TILES, LOADS, GEMM_X_INPUT>(hidden, hidden_size, down ? down_w : qkv_w,
                                                           down ? down_proj : qkv_proj, n, 0, rows, n, hidden_size,
                                                           k_split_for(hidden_size), index, partial);
        } else if (kind == TASK_UP_F || kind == TASK_UP_G) {
            const bool forget = kind == TASK_UP_F;
            gemm_rows_group<1, TILES, LOADS, GEMM_X_PRODUCED>(down_proj + (forget ? 0 : dim), down_dim,
                                                              forget ? f_b_w : g_b_w, forget ? forget_proj : out_gate,
                                                              qkv, 0, rows, qkv, dim, k_split_for(dim), index,
                                                              partial);
        } else if (kind == TASK_STEP) {
            // Heads index and index + 1, one per half of the block.
            const int half = threadIdx.x / KDA_HEAD_BLOCK;
            kda_decode_head(step_args, index + half, 0, 1, KdaHalfBlock{half * KDA_HEAD_BLOCK}, step_shared[half]);
        } else if (kind == TASK_OUT) {
            // Every warp the same k range `aux`, side by side along n: the partial sums that
            // gemm_rows_group's warp aux would hold for these columns.
            const int warp = threadIdx.x >> 5;
            const int lane = threadIdx.x & 31;
            constexpr int OUT_TILES = DECODE_PERSISTENT_OUT_TILES;
            const int group_columns = GEMM_ROWS_WARPS * OUT_TILES * GEMM_ROWS_N_TILE;
            const int warp_column = index * group_columns + warp * OUT_TILES * GEMM_ROWS_N_TILE;
            int kb_begin, kb_end;
            gemm_rows_k_range(qkv, out_split, aux, kb_begin, kb_end);
            // The rows' x over this k range, copied once into shared memory for all 8 warps (16
            // bytes a thread and step, from L2: another block wrote it).
            const int k_origin = kb_begin * GEMM_ROWS_K_BLOCK;
            const int range_k = max(min(kb_end * GEMM_ROWS_K_BLOCK, qkv) - k_origin, 0);
            const int chunks = range_k / 8;
            for (int chunk = threadIdx.x; chunk < rows * chunks; chunk += DECODE_PERSISTENT_THREADS) {
                const int row = chunk / chunks;
                const int offset = 8 * (chunk % chunks);
                *reinterpret_cast<uint4*>(out_x_shared + row * range_k + offset) =
                    load_produced_16B(o_norm_out + static_cast<size_t>(row) * qkv + k_origin + offset, true);
            }
            __syncthreads();
            float acc[1][OUT_TILES][4];
            gemm_rows_accumulate<1, OUT_TILES, LOADS, GEMM_X_SHARED>(acc, out_x_shared, range_k, o_w, hidden_size, qkv,
                                                                    0, rows, warp_column, kb_begin, kb_end,
                                                                    k_origin);
            float* range_partial = out_partial + static_cast<size_t>(aux) * rows * hidden_size;
#pragma unroll
            for (int j = 0; j < OUT_TILES; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = (lane >> 2) + 8 * (e >> 1);
                    const int column = warp_column + j * GEMM_ROWS_N_TILE + 2 * (lane & 3) + (e & 1);
                    if (row < rows && column < hidden_size) {
                        range_partial[static_cast<size_t>(row) * hidden_size + column] = acc[0][j][e];
                    }
                }
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                __threadfence();
                last_s = atomicAdd(counters + task_s[5], 1) == out_split - 1;
                if (last_s) {
                    __threadfence();
                }
            }
            __syncthreads();
            if (last_s) {
                // Every range's partial of these columns is in: add them in ascending range order,
                // as gemm_rows_group adds its warps' partials.
                for (int output = threadIdx.x; output < rows * group_columns; output += DECODE_PERSISTENT_THREADS) {
                    const int row = output / group_columns;
                    const int column = index * group_columns + output % group_columns;
                    if (column < hidden_size) {
                        const float* source = out_partial + static_cast<size_t>(row) * hidden_size + column;
                        float sum = __ldcg(source);
                        for (int split = 1; split < out_split; ++split) {
                            sum += __ldcg(source + static_cast<size_t>(split) * rows * hidden_size);
                        }
                        final_out[static_cast<size_t>(row) * hidden_size + column] = f32_to_bf16(sum);
                    }
                }
            }
        }
        if (kind != TASK_OUT) {
            signal_counters(counters, task_s + 5);
        }
        if (trace != nullptr && threadIdx.x == 0) {
            trace[4 * ticket + 2] = global_timer_ns();
        }
    }

    // The last block out resets the counters for the next launch: every other block has
    // finished its last task (and will read no counter again) before it counts itself out.
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(counters + COUNTER_EXIT, 1) == static_cast<int>(gridDim.x) - 1) {
            for (int i = 0; i < counter_count; ++i) {
                counters[i] = 0;
            }
            __threadfence();
        }
    }
}
