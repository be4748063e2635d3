// The fused decode step of one head of one sequence (see decode.cu for what it computes and
// why), as a device function over a group of KDA_HEAD_BLOCK threads: decode.cu runs one head
// per block, the persistent decode kernel two heads per block, through the same code, so the
// two agree bit for bit.
#ifndef DECODE_STEP_CUH
#define DECODE_STEP_CUH

#include "kda_common.cuh"

// Ask L2 for `count` contiguous floats from `first` (16-byte aligned, count a multiple of 4),
// thread d of the block's KDA_HEAD_BLOCK taking part: one bulk request (thread 0) on sm_90 and
// later, a 128-byte line per thread and request before.
__device__ __forceinline__ void prefetch_floats_l2(const float* first, int count, int d)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (d == 0) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(first),
                     "r"(static_cast<unsigned int>(count * sizeof(float)))
                     : "memory");
    }
#else
    for (int line = d; line < (count + 31) / 32; line += KDA_HEAD_BLOCK) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(first + 32 * line));
    }
#endif
}

// A block that walks several sequences (decode.cu) stages the next one's state: a bulk copy of the
// head's 64 KB state (contiguous, row-major) into shared memory, on an mbarrier, while the block
// steps the present sequence. sm_90 only (cp.async.bulk; for sm_100 and sm_120 NVRTC 13 spills
// the walking kernel's registers with it): elsewhere a walking block reads every state column
// from global memory (KDA_STAGE_STATE 0). The staged copy holds the values global memory holds,
// read in the same layout, so no bit depends on it.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ == 900
#define KDA_STAGE_STATE 1
#else
#define KDA_STAGE_STATE 0
#endif

__device__ __forceinline__ unsigned int kda_shared_address(const void* pointer)
{
    return static_cast<unsigned int>(__cvta_generic_to_shared(pointer));
}

// One thread: the barrier expects one arrival (with the copy's bytes) per phase.
__device__ __forceinline__ void kda_stage_init(unsigned long long* barrier)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(kda_shared_address(barrier)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// One thread: copy `bytes` (a multiple of 16, both ends 16-byte aligned) from global `source` to
// shared `buffer`, completing the barrier's present phase when they have landed. The block's
// earlier reads of the buffer must be behind a barrier.
__device__ __forceinline__ void kda_stage_copy(float* buffer, const float* source, unsigned int bytes,
                                               unsigned long long* barrier)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(kda_shared_address(barrier)),
                 "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     kda_shared_address(buffer)),
                 "l"(source), "r"(bytes), "r"(kda_shared_address(barrier))
                 : "memory");
#endif
}

// Every thread: until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void kda_stage_wait(unsigned long long* barrier, unsigned int parity)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned int done = 0;
    do {
        asm volatile(
            "{\n\t.reg .pred complete;\n\t"
            "mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n\t"
            "selp.u32 %0, 1, 0, complete;\n\t}"
            : "=r"(done)
            : "r"(kda_shared_address(barrier)), "r"(parity)
            : "memory");
    } while (done == 0);
#endif
}

// The staging of one (head, sequence) of a walking block: `buffer` (shared, KDA_HEAD_DIM^2 floats
// and then the copies' mbarrier; null: no staging) holds this sequence's state once the barrier's
// phase of parity `wait_parity` has completed (-1: it does not, read global memory), and
// receives the head's state of sequence `next` (the block's next; -1: none) once every thread
// has read it.
#define KDA_STAGE_FLOATS (KDA_HEAD_DIM * KDA_HEAD_DIM)
#define KDA_STAGE_BYTES (KDA_STAGE_FLOATS * 4 + 16)  // the dynamic shared memory of a walking block
struct KdaStateStage {
    float* buffer;
    int wait_parity;
    int next;
};

__device__ __forceinline__ unsigned long long* kda_stage_barrier(float* buffer)
{
    return reinterpret_cast<unsigned long long*>(buffer + KDA_STAGE_FLOATS);
}

// The operands of the fused step: states, inputs, stage outputs and scalars, as the kernel
// parameters of kda_decode_fused_bf16 name them.
struct KdaStepArgs {
    float* conv_state;
    float* state;
    const int* slots;
    const bf16_t* qkv_proj;
    const bf16_t* conv_w;
    const bf16_t* forget_proj;
    const float* dt_bias;
    const float* a_log;
    const bf16_t* beta_logits;
    int ld_beta;
    const bf16_t* out_gate;
    const bf16_t* norm_w;
    bf16_t* conv_out;
    float* query;
    float* key;
    float* value;
    float* gate;
    float* beta;
    float* core;
    bf16_t* o_norm_out;
    int heads;
    int kernel_size;
    int tokens;
    int bounded;
    float lower_bound;
    float scale;
    float l2_eps;
    float norm_eps;
    int prefetch_ahead;

    // The slot sequence `sequence` advances (slots[sequence], or the sequence itself).
    __device__ __forceinline__ size_t slot_of(size_t sequence) const
    {
        return slots != nullptr ? static_cast<size_t>(slots[sequence]) : sequence;
    }

    // The state [D_k, D_v] of head `head` in slot `slot` (KDA_STAGE_FLOATS contiguous floats).
    __device__ __forceinline__ float* head_state(size_t slot, int head) const
    {
        return state + (slot * heads + head) * static_cast<size_t>(KDA_STAGE_FLOATS);
    }
};

// The shared memory of one head group.
struct KdaStepShared {
    float scratch[10];
    float decay[KDA_HEAD_DIM];
    float key[KDA_HEAD_DIM];
    float query[KDA_HEAD_DIM];
};

// Head `head` of sequence `sequence` (of `sequences`), `tokens` tokens, by the KDA_HEAD_BLOCK
// threads of `group` (thread d owns channel d of the head). STAGED: `stage` (see KdaStateStage)
// says where the state comes from and what to stage next; a compile-time switch, because the
// stage's branches in the one-block-per-sequence step cost it 2 - 5 % on an H200.
template <class Sync, bool STAGED = false>
__device__ __forceinline__ void kda_decode_head(const KdaStepArgs& p, int head, size_t sequence, size_t sequences,
                                                Sync group, KdaStepShared& shared,
                                                const KdaStateStage& stage = KdaStateStage{nullptr, -1, -1})
{
    const int d = group.thread();
    const size_t slot = p.slot_of(sequence);
    const int heads = p.heads;
    const int kernel_size = p.kernel_size;
    const size_t qkv = static_cast<size_t>(heads) * KDA_HEAD_DIM;
    const size_t channel = static_cast<size_t>(head) * KDA_HEAD_DIM + d;  // within q, k or v

    // The sequence's state column (64 KB per head, the bulk of the traffic) and conv windows
    // first: in flight while the first token's inputs are formed.
    float* state_column = p.head_state(slot, head) + d;
    float s[KDA_HEAD_DIM];
    if constexpr (STAGED) {
        if (stage.wait_parity >= 0) {
            kda_stage_wait(kda_stage_barrier(stage.buffer), static_cast<unsigned int>(stage.wait_parity));
            kda_recurrent_load(s, stage.buffer + d);
        } else {
            kda_recurrent_load(s, state_column);
        }
        if (stage.next >= 0) {
            // Every thread has its column of the buffer in registers: the next state may land there.
            group.sync();
            if (d == 0) {
                kda_stage_copy(stage.buffer, p.head_state(p.slot_of(stage.next), head),
                               KDA_STAGE_FLOATS * sizeof(float), kda_stage_barrier(stage.buffer));
            }
        }
    } else {
        kda_recurrent_load(s, state_column);
    }
    // A batch runs many waves of blocks, each of which waits on its state column: ask L2 for the
    // head's state of sequence + prefetch_ahead (a block of a later wave) now, so that its loads
    // hit, and for its conv windows (the head's channels of q, k and v: three runs of D K floats).
    if (p.prefetch_ahead > 0 && sequence + p.prefetch_ahead < sequences) {
        const size_t ahead_slot = p.slot_of(sequence + p.prefetch_ahead);
        prefetch_floats_l2(p.head_state(ahead_slot, head), KDA_STAGE_FLOATS, d);
        for (int part = 0; part < 3; ++part) {
            prefetch_floats_l2(p.conv_state + (ahead_slot * 3 + part) * qkv * kernel_size +
                                   static_cast<size_t>(head) * KDA_HEAD_DIM * kernel_size,
                               KDA_HEAD_DIM * kernel_size, d);
        }
    }
    float* conv_slot = p.conv_state + slot * 3 * qkv * kernel_size;
    float window[3][CONV_MAX_KERNEL];
#pragma unroll
    for (int part = 0; part < 3; ++part) {
        conv_window_load(window[part], conv_slot + (part * qkv + channel) * kernel_size, kernel_size);
    }
    const float a = expf(p.a_log[head]);
    const float bias = p.dt_bias[channel];
    const float weight = bf16_to_f32(p.norm_w[d]);

    for (int t = 0; t < p.tokens; ++t) {
        const size_t row = sequence * p.tokens + t;
        const bf16_t* projected = p.qkv_proj + row * 3 * qkv;
        const size_t out_index = row * qkv + channel;
        float conv_input[3];
#pragma unroll
        for (int part = 0; part < 3; ++part) {
            conv_input[part] = bf16_to_f32(projected[part * qkv + channel]);
        }
        const float u = bf16_to_f32(p.forget_proj[out_index]) + bias;
        const float beta_head = sigmoid_f32(bf16_to_f32(p.beta_logits[row * p.ld_beta + head]));
        const float z = bf16_to_f32(p.out_gate[out_index]);

        // Conv + SiLU, rounded to BF16 (the conv output stage), then L2 of q and k.
        float rounded[3];
#pragma unroll
        for (int part = 0; part < 3; ++part) {
            const size_t c = part * qkv + channel;
            conv_window_push(window[part], conv_input[part], kernel_size);
            const bf16_t out = f32_to_bf16(conv_silu(window[part], p.conv_w + c * kernel_size, kernel_size));
            p.conv_out[row * 3 * qkv + c] = out;
            rounded[part] = bf16_to_f32(out);
        }
        float q = rounded[0];
        float k = rounded[1];
        l2_normalize_pair(q, k, p.l2_eps, shared.scratch, group);
        const float v = rounded[2];
        const float g = kda_forget_gate(u, a, p.bounded != 0, p.lower_bound);

        p.query[out_index] = q;
        p.key[out_index] = k;
        p.value[out_index] = v;
        p.gate[out_index] = g;
        if (d == 0) {
            p.beta[row * heads + head] = beta_head;
        }
        // The previous token's step has read the vectors (the norm's reductions since hold
        // barriers), so they may be replaced.
        shared.decay[d] = expf(g);
        shared.key[d] = k;
        shared.query[d] = q * p.scale;
        group.sync();

        const float o = kda_recurrent_step(s, shared.decay, shared.key, shared.query, v, beta_head, group);
        p.core[out_index] = o;
        p.o_norm_out[out_index] = f32_to_bf16(gated_rmsnorm_sigmoid(o, weight, z, p.norm_eps, shared.scratch, group));
    }

    kda_recurrent_store(s, state_column);
#pragma unroll
    for (int part = 0; part < 3; ++part) {
        conv_window_store(window[part], conv_slot + (part * qkv + channel) * kernel_size, kernel_size);
    }
}

#endif  // DECODE_STEP_CUH
