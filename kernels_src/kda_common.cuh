// Code shared by every KDA kernel: BF16 storage without cuda_bf16.h (so NVRTC
// needs no CUDA headers), the one block reduction every per-head sum goes through,
// and the head size the register-resident kernels are compiled for.
//
// The loader (glm_kda/kernels.py) inlines this file where it is #included, so it
// must stay self-contained: no other #include.
#ifndef KDA_COMMON_CUH
#define KDA_COMMON_CUH

// Head dimension D. The recurrent and chunk-scan kernels keep a state column of
// D floats in registers, so D must be a compile-time constant.
#define KDA_HEAD_DIM 128

// Threads per block of every per-head kernel (one thread per channel of a head).
#define KDA_HEAD_BLOCK 128

#define KDA_FULL_WARP_MASK 0xffffffffu
// Tokens one block of the per-(head, token) elementwise kernels (gate, norm) walks:
// enough rows to amortise a block's start at prefill widths.
#define KDA_TOKENS_PER_BLOCK 8

// A BF16 value as its raw 16 bits: the upper half of the FP32 encoding.
typedef unsigned short bf16_t;

// Exact: every BF16 value is an FP32 value with 16 zero low bits.
__device__ __forceinline__ float bf16_to_f32(bf16_t value)
{
    return __uint_as_float(static_cast<unsigned int>(value) << 16);
}

// The low (half 0) or high (half 1) BF16 of a 32-bit word that packs two, as FP32 (exact): what
// a vector load of BF16 pairs unpacks to.
__device__ __forceinline__ float bf16_half_to_f32(unsigned int word, int half)
{
    return __uint_as_float(half ? (word & 0xFFFF0000u) : (word << 16));
}

// Round to nearest, ties to even, bit-identical to ml_dtypes' float32 -> bfloat16
// cast (what the NumPy oracle uses): finite values that round past the largest
// BF16 become infinity, subnormals are kept (no flush), and every NaN becomes the
// canonical quiet NaN with the input's sign (0x7FC0 / 0xFFC0; the payload is
// dropped, as ml_dtypes drops it).
__device__ __forceinline__ bf16_t f32_to_bf16(float value)
{
    const unsigned int bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return static_cast<bf16_t>(((bits >> 16) & 0x8000u) | 0x7fc0u);
    }
    const unsigned int lsb = (bits >> 16) & 1u;
    return static_cast<bf16_t>((bits + 0x7fffu + lsb) >> 16);
}

// The threads a per-head reduction spans: KDA_HEAD_BLOCK threads, each one channel of a
// head, and the barrier that joins them. KdaBlockSync is a whole block of KDA_HEAD_BLOCK
// threads (__syncthreads); a kernel that runs several heads per block passes a group of its
// own with the same interface (the persistent decode: half a block per head, joined by the
// block barrier). Which threads take part never
// changes an addition: the sums below depend only on the thread's index within the group.
struct KdaBlockSync {
    __device__ __forceinline__ int thread() const { return threadIdx.x; }
    __device__ __forceinline__ void sync() const { __syncthreads(); }
};

// One warp as the group of a per-column step (kda_recurrent_step's barrier is a fence there).
struct KdaWarpSync {
    __device__ __forceinline__ int thread() const { return threadIdx.x; }
    __device__ __forceinline__ void sync() const { __syncwarp(); }
};

// Sum of `value` over the KDA_HEAD_BLOCK (= 128) threads of a group (by default the whole
// block), returned to every one of them. Deterministic: a fixed xor-shuffle tree inside each
// warp, then the group's thread 0 adds the four warp sums in warp order. Every per-head
// reduction (decode conv + L2, prefill L2, gated RMSNorm) uses this one function, so the
// decode and prefill paths produce the same bits for the same inputs.
//
// `scratch` is at least 5 floats of shared memory, the group's own. All threads of the
// group must call it (it contains barriers); it may be called again right away.
// The sum of `value` over a warp, returned to every lane: the fixed xor-shuffle tree of
// block_sum_f32.
__device__ __forceinline__ float warp_sum_f32(float value)
{
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        value += __shfl_xor_sync(KDA_FULL_WARP_MASK, value, offset);
    }
    return value;
}

template <class Sync = KdaBlockSync>
__device__ __forceinline__ float block_sum_f32(float value, float* scratch, Sync group = Sync())
{
    value = warp_sum_f32(value);
    const int thread = group.thread();
    const int warp = thread >> 5;
    if ((thread & 31) == 0) {
        scratch[warp] = value;
    }
    group.sync();
    if (thread == 0) {
        float total = scratch[0];
        total += scratch[1];
        total += scratch[2];
        total += scratch[3];
        scratch[4] = total;
    }
    group.sync();
    const float total = scratch[4];
    // Nobody may overwrite scratch for the next call before every thread read it.
    group.sync();
    return total;
}

// block_sum_f32 of two values at once, by the same tree each (so the same bits as two calls),
// with the barriers of one call. `scratch` is at least 10 floats of the group's shared memory.
template <class Sync = KdaBlockSync>
__device__ __forceinline__ void block_sum2_f32(float& a, float& b, float* scratch, Sync group = Sync())
{
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        a += __shfl_xor_sync(KDA_FULL_WARP_MASK, a, offset);
        b += __shfl_xor_sync(KDA_FULL_WARP_MASK, b, offset);
    }
    const int thread = group.thread();
    const int warp = thread >> 5;
    if ((thread & 31) == 0) {
        scratch[warp] = a;
        scratch[5 + warp] = b;
    }
    group.sync();
    if (thread == 0 || thread == 32) {
        const float* sums = scratch + (thread == 0 ? 0 : 5);
        float total = sums[0];
        total += sums[1];
        total += sums[2];
        total += sums[3];
        scratch[(thread == 0 ? 0 : 5) + 4] = total;
    }
    group.sync();
    a = scratch[4];
    b = scratch[9];
    // Nobody may overwrite scratch for the next call before every thread read it.
    group.sync();
}

// Programmatic dependent launch (sm_90 and later; no-ops before). A kernel launched with the
// programmatic-serialization attribute may start while the kernel before it in the stream
// still runs, once every block of that one has called kda_let_next_kernel_launch (or
// exited); kda_wait_for_previous_kernel then returns when the previous kernel has finished
// and its writes are visible. Without the attribute the wait returns at once. Whatever a
// kernel reads or writes that the previous kernel may touch must come after the wait.
__device__ __forceinline__ void kda_let_next_kernel_launch()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- Block timeline, compiled in only where KDA_TRACE is defined (benchmarks/timeline.py builds
// such a kernel set; the package's own build has none of it). Thread 0 of every block of a traced
// entry writes one record of four words: the launch's tag (a pointer the launch writes, which names
// it) with the block's SM in the top 16 bits, and the global timer (ns) at the block's start, after
// its wait on the previous kernel (0 if it never waited; with KDA_TRACE_WAITED_HERE, the wait of the
// one thread that moves the data waited for) and at its end.
#ifdef KDA_TRACE
#define KDA_TRACE_RECORDS 65536
__device__ unsigned long long kda_trace_records[KDA_TRACE_RECORDS][4];
__device__ unsigned int kda_trace_count;
__shared__ unsigned long long kda_trace_waited;

__device__ __forceinline__ unsigned long long kda_global_time()
{
    unsigned long long time;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(time));
    return time;
}

struct KdaTraceScope {
    unsigned long long tag;
    unsigned long long start;
    __device__ explicit KdaTraceScope(const void* launch_tag)
        : tag(reinterpret_cast<unsigned long long>(launch_tag)), start(0ull)
    {
        if (threadIdx.x == 0) {
            start = kda_global_time();
            kda_trace_waited = 0ull;
        }
    }
    __device__ ~KdaTraceScope()
    {
        if (threadIdx.x == 0) {
            const unsigned long long end = kda_global_time();
            unsigned int sm;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
            const unsigned int slot = atomicAdd(&kda_trace_count, 1u);
            if (slot < KDA_TRACE_RECORDS) {
                kda_trace_records[slot][0] = (tag & 0xFFFFFFFFFFFFull) | (static_cast<unsigned long long>(sm) << 48);
                kda_trace_records[slot][1] = start;
                kda_trace_records[slot][2] = kda_trace_waited;
                kda_trace_records[slot][3] = end;
            }
        }
    }
};
#define KDA_TRACE_SCOPE(launch_tag) KdaTraceScope kda_trace_scope(launch_tag)
#define KDA_TRACE_WAITED()                      \
    do {                                        \
        if (threadIdx.x == 0) {                 \
            kda_trace_waited = kda_global_time(); \
        }                                       \
    } while (0)
// The same stamp by whichever thread calls it (one thread of the block: a copy warp's lane).
#define KDA_TRACE_WAITED_HERE() (kda_trace_waited = kda_global_time())
#else
#define KDA_TRACE_SCOPE(launch_tag)
#define KDA_TRACE_WAITED()
#define KDA_TRACE_WAITED_HERE()
#endif

__device__ __forceinline__ void kda_grid_dependency_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void kda_wait_for_previous_kernel()
{
    kda_grid_dependency_wait();
    KDA_TRACE_WAITED();
}

// ---- Words one kernel waits on while another, running beside it, finishes its part: a count of
// producers done (each adds 1 with release once its writes are out) and a count of the waiting
// blocks that have seen it. A wait longer than KDA_MAX_POLLS polls (tens of seconds with their
// sleeps and round trips) is a broken schedule: trap instead of hanging.
#define KDA_MAX_POLLS (1 << 26)

__device__ __forceinline__ int load_acquire(const int* counter)
{
    int value;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(counter) : "memory");
    return value;
}

// *word += 1, released at GPU scope: whatever this thread has seen written before (a finished
// kernel's outputs; its block's writes, after a block barrier) is visible to a thread that reads
// the new count by load_acquire.
__device__ __forceinline__ void kda_count_release(int* word)
{
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(word) : "memory");
}

// Thread 0: until counter >= target.
__device__ __forceinline__ void wait_for_counter(const int* counter, int target)
{
    int polls = 0;
    while (load_acquire(counter) < target) {
        __nanosleep(64);
        if (++polls > KDA_MAX_POLLS) {
            __trap();
        }
    }
}

// Thread 0 of every block of a grid of `blocks` that waits on the words: kda_await_words until
// words[0] >= target (the producers' count), then the caller passes a block barrier before it reads
// what the producers wrote, through L2. The block counts itself in words[1] as it passes
// (kda_await_words returns the count before it) and, at its end, kda_clear_words_if_last: the last
// block past the wait sets both words back to zero, so the next launch waits again (a block counts
// itself only once it has seen the producers done). The count's answer is read only at the block's
// end, so its round trip is not waited for in between.
__device__ __forceinline__ int kda_await_words(int* words, int target)
{
    wait_for_counter(words, target);
    return atomicAdd(words + 1, 1);
}

__device__ __forceinline__ void kda_clear_words_if_last(int* words, int passed, int blocks)
{
    if (passed == blocks - 1) {
        words[1] = 0;
        words[0] = 0;
    }
}

// The shared-memory (state-space) address of a pointer into this block's shared memory, as the
// asynchronous copies, mbarriers and cluster instructions take it.
__device__ __forceinline__ unsigned int shared_address(const void* pointer)
{
    return static_cast<unsigned int>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ float sigmoid_f32(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

// Above this the softplus equals its argument to FP32 precision (the usual
// threshold of the reference implementations).
#define KDA_SOFTPLUS_THRESHOLD 20.0f

// The forget gate's log-decay of one channel: u = forget_proj + dt_bias (FP32), a =
// exp(A_log[head]). One definition for every kernel that forms it (gate.cu, the
// tensor-core chunk prepare), so they agree bit for bit.
__device__ __forceinline__ float kda_forget_gate(float u, float a, bool bounded, float lower_bound)
{
    if (bounded) {
        // lower_bound * sigmoid(a u). __fdividef (reciprocal and product, 2 ulp) rather than
        // the IEEE division: the prepare that forms the gate inline evaluates this 32 times
        // per thread, and every IEEE division brings its own call of the slow path.
        return __fdividef(lower_bound, 1.0f + expf(-(a * u)));
    }
    const float softplus = (u > KDA_SOFTPLUS_THRESHOLD) ? u : log1pf(expf(u));
    return -a * softplus;
}

// ---- The bulk-copy projection sweep's tile layout of its x (gemm_rows_bulk.cu, glm_kda.gemm_rows.
// tile_layout): for the group of rows 64 G .. 64 G + 63 and block kb of 32 columns,
//   tile[G][kb][s][h][r][8 t + e] = x[64 G + r, 32 kb + 8 t + 4 s + 2 h + e]   (t < 4, e < 2)
// in tiles of 2048 elements. The element index of x[row, column] for k_blocks blocks of 32 a row.
__device__ __forceinline__ size_t bulk_tile_element(size_t row, int column, int k_blocks)
{
    const int kk = column & 31;  // 8 t + 4 s + 2 h + e
    const size_t tile = (row >> 6) * static_cast<size_t>(k_blocks) + static_cast<size_t>(column >> 5);
    return tile * 2048 + ((((kk >> 1) & 3) * 64 + (row & 63)) * 8) + 2 * (kk >> 3) + (kk & 1);
}

// ---- Per-token arithmetic of the decode step, one definition for the separate kernels
// (conv.cu, recurrent.cu, norm.cu) and the fused step (decode.cu), so both agree bit for bit.

// Causal conv window: the last CONV_MAX_KERNEL inputs of a channel, oldest in slot 0.
#define CONV_MAX_KERNEL 4
// Shift the window left by one and put `input` in slot kernel_size - 1.
// Compile-time indices only, so the window stays in registers.
__device__ __forceinline__ void conv_window_push(float window[CONV_MAX_KERNEL], float input,
                                                 int kernel_size)
{
#pragma unroll
    for (int j = 0; j + 1 < CONV_MAX_KERNEL; ++j) {
        if (j + 1 < kernel_size) {
            window[j] = window[j + 1];
        }
    }
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j == kernel_size - 1) {
            window[j] = input;
        }
    }
}

// The first K of CONV_MAX_KERNEL values from `stored` (slots K.. zero): a conv window's K stored
// inputs, or a channel's K conv taps.
template <class T>
__device__ __forceinline__ void conv_slots_load(T (&slots)[CONV_MAX_KERNEL], const T* stored, int kernel_size)
{
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        slots[j] = T(0);
        if (j < kernel_size) {
            slots[j] = stored[j];
        }
    }
}

// The window from the K stored inputs of a channel, and back.
__device__ __forceinline__ void conv_window_load(float (&window)[CONV_MAX_KERNEL], const float* stored,
                                                 int kernel_size)
{
    conv_slots_load(window, stored, kernel_size);
}

__device__ __forceinline__ void conv_window_store(const float window[CONV_MAX_KERNEL], float* stored,
                                                  int kernel_size)
{
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j < kernel_size) {
            stored[j] = window[j];
        }
    }
}

// silu( sum_j taps[j] * window[j] ), FP32 fma in ascending j, the taps already in registers.
// The one place the conv arithmetic is written, so decode and prefill agree bit for bit.
__device__ __forceinline__ float conv_silu_taps(const float window[CONV_MAX_KERNEL],
                                                const bf16_t taps[CONV_MAX_KERNEL], int kernel_size)
{
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j < kernel_size) {
            acc = fmaf(bf16_to_f32(taps[j]), window[j], acc);
        }
    }
    return acc / (1.0f + expf(-acc));
}

// conv_silu_taps with the taps read from memory.
__device__ __forceinline__ float conv_silu(const float window[CONV_MAX_KERNEL],
                                           const bf16_t* taps, int kernel_size)
{
    bf16_t loaded[CONV_MAX_KERNEL];
    conv_slots_load(loaded, taps, kernel_size);
    return conv_silu_taps(window, loaded, kernel_size);
}

// value / sqrt(sum over the head of value^2 + eps). All KDA_HEAD_BLOCK threads of
// the group call it (it reduces across the group).
template <class Sync = KdaBlockSync>
__device__ __forceinline__ float l2_normalize_head(float value, float l2_eps, float* scratch, Sync group = Sync())
{
    // __fmul_rn: a product the compiler may not fuse into the first shuffle add.
    const float sum_squares = block_sum_f32(__fmul_rn(value, value), scratch, group);
    return value / sqrtf(sum_squares + l2_eps);
}

// l2_normalize_head of q and of k (channel d of each) with the barriers of one reduction: the
// same bits as two calls. `scratch` is at least 10 floats.
template <class Sync = KdaBlockSync>
__device__ __forceinline__ void l2_normalize_pair(float& q, float& k, float l2_eps, float* scratch,
                                                  Sync group = Sync())
{
    float q_squares = __fmul_rn(q, q);
    float k_squares = __fmul_rn(k, k);
    block_sum2_f32(q_squares, k_squares, scratch, group);
    q = q / sqrtf(q_squares + l2_eps);
    k = k / sqrtf(k_squares + l2_eps);
}

// Delta-rule steps of one value column of a head's state S [D_k, D_v] (K-major, row i at
// state_column + i * KDA_HEAD_DIM), FP32, kept in registers between a load and a store so
// that a kernel can issue the loads before it has formed the gate and walk several tokens:
//   kda_recurrent_load:   s = the column, as stored
//   kda_recurrent_step:   s *= exp(gate);  pred = s . k;  s += k (beta (v - pred));
//                         returns out = s . (q scale), read after the update
//   kda_recurrent_store:  the column = s
// decay_s, key_s, query_s (exp(gate), k, q * scale) are the head's vectors in shared
// memory, read as broadcasts. Every thread of the group must call the step (it holds a
// barrier).
__device__ __forceinline__ void kda_recurrent_load(float (&s)[KDA_HEAD_DIM], const float* state_column)
{
#pragma unroll
    for (int i = 0; i < KDA_HEAD_DIM; ++i) {
        s[i] = state_column[static_cast<size_t>(i) * KDA_HEAD_DIM];
    }
}

template <class Sync = KdaBlockSync>
__device__ __forceinline__ float kda_recurrent_step(float (&s)[KDA_HEAD_DIM], const float* decay_s,
                                                    const float* key_s, const float* query_s, float value,
                                                    float beta, Sync group = Sync())
{
    float pred = 0.0f;
#pragma unroll
    for (int i = 0; i < KDA_HEAD_DIM; ++i) {
        s[i] = s[i] * decay_s[i];
        pred = fmaf(s[i], key_s[i], pred);
    }
    const float delta = beta * (value - pred);
    // A barrier is a shared-memory fence: it stops the compiler from keeping the D key
    // values of the first pass in registers for the second, which with the D state values
    // would exceed the 255-register budget and spill.
    group.sync();

    float out = 0.0f;
#pragma unroll
    for (int i = 0; i < KDA_HEAD_DIM; ++i) {
        s[i] = fmaf(key_s[i], delta, s[i]);
        out = fmaf(s[i], query_s[i], out);
    }
    return out;
}

__device__ __forceinline__ void kda_recurrent_store(const float (&s)[KDA_HEAD_DIM], float* state_column)
{
#pragma unroll
    for (int i = 0; i < KDA_HEAD_DIM; ++i) {
        state_column[static_cast<size_t>(i) * KDA_HEAD_DIM] = s[i];
    }
}

// Gated RMSNorm of one channel of a head, the gate a SIGMOID:
//   o / sqrt(mean over the head of o^2 + eps) * weight * sigmoid(z)
// All KDA_HEAD_BLOCK threads of the group call it (it reduces across the group).
template <class Sync = KdaBlockSync>
__device__ __forceinline__ float gated_rmsnorm_sigmoid(float o, float weight, float z, float eps, float* scratch,
                                                       Sync group = Sync())
{
    // __fmul_rn: a product the compiler may not fuse into the first shuffle add.
    const float mean_square = block_sum_f32(__fmul_rn(o, o), scratch, group) / static_cast<float>(KDA_HEAD_DIM);
    return o / sqrtf(mean_square + eps) * weight * sigmoid_f32(z);
}

#endif  // KDA_COMMON_CUH
