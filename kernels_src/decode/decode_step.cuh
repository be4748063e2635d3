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

// ---- The head's state through shared memory (sm_90 and later): the whole 64 KB of a head is
// contiguous, so one thread moves it with one bulk copy each way (the tensor memory accelerator)
// instead of every thread issuing KDA_HEAD_DIM four-byte loads and stores, whose issue and
// queueing were most of the step's time. The values, and so every bit, are those of the
// register loads: the threads read their columns out of the stage (kda_recurrent_load on the
// shared copy) and write them back before the copy out.
#define KDA_HEAD_STATE_BYTES (KDA_HEAD_DIM * KDA_HEAD_DIM * 4)
#ifndef KDA_STAGED_STATE  // (a host emulation defines it and the copies)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KDA_STAGED_STATE 1
#else
#define KDA_STAGED_STATE 0
#endif
#endif

// Thread `d` == 0: start the copy of a head's state (16-byte aligned) into `stage`; the group
// must pass a barrier before anyone waits on `arrived` (kda_wait_staged_state).
__device__ __forceinline__ void kda_stage_state_in(float* stage, const float* head_state, unsigned long long* arrived,
                                                   int d)
{
#if KDA_STAGED_STATE
    if (d == 0) {
        const unsigned int barrier = shared_address(arrived);
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(barrier) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier),
                     "r"(KDA_HEAD_STATE_BYTES)
                     : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                shared_address(stage)),
            "l"(head_state), "r"(KDA_HEAD_STATE_BYTES), "r"(barrier)
            : "memory");
    }
#endif
}

// Every thread: wait until the copy started by kda_stage_state_in has landed.
__device__ __forceinline__ void kda_wait_staged_state(unsigned long long* arrived)
{
#if KDA_STAGED_STATE
    asm volatile(
        "{\n"
        ".reg .pred arrived;\n"
        "KDA_WAIT_STATE:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 arrived, [%0], 0;\n"
        "@!arrived bra KDA_WAIT_STATE;\n"
        "}\n" ::"r"(shared_address(arrived))
        : "memory");
#endif
}

// After every thread of the group wrote its column into `stage` and passed a barrier that
// follows kda_stage_fence: thread `d` == 0 copies the stage out to the head's state and waits
// until the stage has been read (the block's shared memory must outlive the copy).
__device__ __forceinline__ void kda_stage_fence()
{
#if KDA_STAGED_STATE
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

__device__ __forceinline__ void kda_stage_state_out(const float* stage, float* head_state, int d)
{
#if KDA_STAGED_STATE
    if (d == 0) {
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(head_state),
                     "r"(shared_address(stage)), "r"(KDA_HEAD_STATE_BYTES)
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
#endif
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
    // Where the step lets the next kernel of its stream launch (kda_let_next_kernel_launch):
    // 0 not here (the caller's business), 1 once the first token's inputs are formed (the state
    // column and the inputs have arrived), 2 after the first token's recurrent step, 3 (with
    // inputs_ready) once past the wait for the inputs, before they are read.
    int dependents_after;
    // Null, or o_norm_out a second time in the bulk-copy sweep's tile layout of x (bulk_tile_element,
    // k = heads * KDA_HEAD_DIM): the output projection's input, so that it needs no tiling launch.
    // Only the rows written are touched.
    bf16_t* x_tiles;
    // Null: qkv_proj and the other inputs are written by earlier kernels of the stream. Else the
    // step is a programmatic dependent of the last kernel of the low-rank chain, and qkv_proj is
    // written on another stream, after which inputs_ready[0] reaches inputs_target
    // (kda_signal_inputs_ready, or the q|k|v launch's own count): the step loads its state column
    // and conv windows, waits for both (kda_await_inputs), then loads the token's inputs.
    int* inputs_ready;
    // The count inputs_ready[0] must reach: 1 after kda_signal_inputs_ready, or the blocks of a q|k|v
    // launch that counts its outputs out itself (gemm_rows_packed_counting).
    int inputs_target;
    // Null, or the words the next kernel of the stream (the output projection, launched once every
    // block of this one is resident) waits on instead of this kernel's end: each block adds 1 to
    // outputs_ready[0] once its outputs are written, before it stores its states.
    int* outputs_ready;
};

// Thread `d` of every block: wait for the previous kernel of the stream and for inputs_ready[0] to
// reach `target` (thread 0 polls it; kda_await_words, whose count it returns there, for
// kda_clear_words_if_last at the block's end); the caller then passes the group's barrier.
__device__ __forceinline__ int kda_await_inputs(int* inputs_ready, int target, int d)
{
    kda_wait_for_previous_kernel();
    return d == 0 ? kda_await_words(inputs_ready, target) : 0;
}

// The shared memory of one head group. `state_arrived`: the mbarrier of the staged state copy.
// The head's vectors 16-byte aligned: the recurrent step reads them as broadcasts, four floats a
// load instead of two.
struct KdaStepShared {
    unsigned long long state_arrived;
    float scratch[10];
    float partials[2][4];  // a split head's warp sums for the norm, by token parity
    __align__(16) float decay[KDA_HEAD_DIM];
    __align__(16) float key[KDA_HEAD_DIM];
    __align__(16) float query[KDA_HEAD_DIM];
};

// ---- One head over the KDA_HEAD_SPLIT blocks of a thread-block cluster (sm_90 and later). A
// block of KDA_HEAD_BLOCK threads reads a head's state at about the rate one SM moves data, so a
// one-sequence step spent most of its time waiting for its 64 KB: split, block `rank` of the
// cluster steps the value columns of its warp `rank` (16 KB), while every block forms the head's
// q, k, gate and beta (the L2 sums need all the channels) by the same code and reductions. The
// gated norm's sum over the head's columns adds the four warp sums, exchanged through the
// blocks' shared memory, in block_sum_f32's order: the same bits as one block per head.
#define KDA_HEAD_SPLIT 4
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KDA_CLUSTERS 1
#else
#define KDA_CLUSTERS 0
#endif

// The barrier of the cluster's threads, in two halves: arrive (release: this thread's earlier
// memory operations, shared memory of other blocks included, become visible to threads that
// have waited) and wait (acquire). Every thread of every block of the cluster takes part.
__device__ __forceinline__ void cluster_arrive_relaxed()
{
#if KDA_CLUSTERS
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_arrive()
{
#if KDA_CLUSTERS
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait()
{
#if KDA_CLUSTERS
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// *address in the shared memory of block `rank` of the cluster (address: this block's copy).
__device__ __forceinline__ void store_shared_cluster(float* address, int rank, float value)
{
#if KDA_CLUSTERS
    unsigned int remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(address)), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(value) : "memory");
#endif
}

// gated_rmsnorm_sigmoid of a head split over a cluster: the threads of warp `rank` of each block
// (`owner`) hold the head's channels 32 rank ..; `partials` (4 floats, the same offset in every
// block) receives the warp sums. Every thread of the cluster calls it; the result means something
// in the owners only.
__device__ __forceinline__ float cluster_gated_rmsnorm_sigmoid(float o, float weight, float z, float eps,
                                                               float* partials, int rank, bool owner)
{
    if (owner) {
        const float warp_total = warp_sum_f32(__fmul_rn(o, o));
        if ((threadIdx.x & 31) == 0) {
#pragma unroll
            for (int to = 0; to < KDA_HEAD_SPLIT; ++to) {
                store_shared_cluster(&partials[rank], to, warp_total);
            }
        }
    }
    cluster_arrive();
    cluster_wait();
    // block_sum_f32's order: the warp sums in warp order.
    float total = partials[0];
    total += partials[1];
    total += partials[2];
    total += partials[3];
    const float mean_square = total / static_cast<float>(KDA_HEAD_DIM);
    return o / sqrtf(mean_square + eps) * weight * sigmoid_f32(z);
}

// One token's inputs of channel `channel` of head `head` (BF16 bits as stored): its q, k and v
// projections, forget projection, b_proj logit and output gate, all written by earlier kernels.
struct KdaTokenInputs {
    bf16_t projected[3];
    bf16_t forget;
    bf16_t beta_logit;
    bf16_t out_gate;
};

// Coherent: q|k|v and the output gate through L2 only (the step awaiting them, their writers ran
// beside it, and a read-only load may be served from before their writes).
__device__ __forceinline__ KdaTokenInputs kda_load_token_inputs(const KdaStepArgs& p, size_t row, size_t qkv,
                                                                size_t channel, int head, bool coherent = false)
{
    KdaTokenInputs inputs;
    const bf16_t* projected = p.qkv_proj + row * 3 * qkv;
#pragma unroll
    for (int part = 0; part < 3; ++part) {
        inputs.projected[part] = coherent ? __ldcg(projected + part * qkv + channel) : projected[part * qkv + channel];
    }
    inputs.forget = p.forget_proj[row * qkv + channel];
    inputs.beta_logit = p.beta_logits[row * p.ld_beta + head];
    inputs.out_gate = coherent ? __ldcg(p.out_gate + row * qkv + channel) : p.out_gate[row * qkv + channel];
    return inputs;
}

// Head `head` of sequence `sequence` (of `sequences`), `tokens` tokens, by the KDA_HEAD_BLOCK
// threads of `group` (thread d owns channel d of the head). Staged false: each thread loads its
// state column into registers; true (sm_90 and later; before, the register loads): the head's
// state moves by bulk copies through `stage`, KDA_HEAD_STATE_BYTES of the group's shared memory
// (128-byte aligned; the state 16-byte aligned). Split (KDA_HEAD_SPLIT, sm_90, the group a block
// of a cluster of that many, `rank` its place): the head split over the cluster's blocks, each
// stepping the columns of its warp `rank`. The same bits every way.
template <class Sync, bool Staged = false, int Split = 1>
__device__ __forceinline__ void kda_decode_head(const KdaStepArgs& p, int head, size_t sequence, size_t sequences,
                                                Sync group, KdaStepShared& shared, float* stage = nullptr,
                                                int rank = 0)
{
    constexpr bool split = Split > 1;
    static_assert(!split || (Split == KDA_HEAD_SPLIT && !Staged), "a split head has KDA_HEAD_SPLIT blocks, unstaged");
    const int d = group.thread();
    // Whether this thread steps value column d and writes channel d's outputs (in a split head,
    // the blocks other than the owner form the same values and drop them).
    const bool owner = !split || (d >> 5) == rank;
    const int heads = p.heads;
    const int kernel_size = p.kernel_size;
    const size_t qkv = static_cast<size_t>(heads) * KDA_HEAD_DIM;
    const size_t channel = static_cast<size_t>(head) * KDA_HEAD_DIM + d;  // within q, k or v
    if constexpr (split) {
        // Another block's shared memory may be written only once that block runs.
        cluster_arrive_relaxed();
    }

    // Every load that does not depend on the slot is issued first, in one go: the first token's
    // inputs, the conv taps and the head's parameters. Then the slot's state column (64 KB per
    // head, the bulk of the traffic) and conv windows. So the step waits for the memory about
    // twice (the slot, then everything), not once per value a later load was queued behind.
    const size_t ahead = sequence + p.prefetch_ahead;
    const bool prefetch = p.prefetch_ahead > 0 && ahead < sequences && rank == 0;
    const size_t slot = p.slots != nullptr ? static_cast<size_t>(p.slots[sequence]) : sequence;
    const size_t ahead_slot = prefetch && p.slots != nullptr ? static_cast<size_t>(p.slots[ahead]) : ahead;
    // (Awaiting another stream's q|k|v, the inputs come after the state column and conv windows.)
    const bool awaits = p.inputs_ready != nullptr;
    KdaTokenInputs inputs;
    if (!awaits) {
        inputs = kda_load_token_inputs(p, sequence * p.tokens, qkv, channel, head);
    }
    bf16_t taps[3][CONV_MAX_KERNEL];
#pragma unroll
    for (int part = 0; part < 3; ++part) {
        conv_slots_load(taps[part], p.conv_w + (part * qkv + channel) * kernel_size, kernel_size);
    }
    const float a_log = p.a_log[head];
    const float bias = p.dt_bias[channel];
    const bf16_t norm_weight = p.norm_w[d];

    float* head_state = p.state + (slot * heads + head) * static_cast<size_t>(KDA_HEAD_DIM) * KDA_HEAD_DIM;
    constexpr bool staged = KDA_STAGED_STATE && Staged;
    float s[KDA_HEAD_DIM];
    if constexpr (staged) {
        kda_stage_state_in(stage, head_state, &shared.state_arrived, d);
    } else {
        if (owner) {
            kda_recurrent_load(s, head_state + d);
        }
    }
    float* conv_slot = p.conv_state + slot * 3 * qkv * kernel_size;
    float window[3][CONV_MAX_KERNEL];
#pragma unroll
    for (int part = 0; part < 3; ++part) {
        conv_window_load(window[part], conv_slot + (part * qkv + channel) * kernel_size, kernel_size);
    }
    // A batch runs many waves of blocks, each of which waits on its state column: ask L2 for the
    // head's state of sequence + prefetch_ahead (a block of a later wave) now, so that its loads
    // hit, and for its conv windows (the head's channels of q, k and v: three runs of D K floats).
    if (prefetch) {
        prefetch_floats_l2(p.state + (ahead_slot * heads + head) * static_cast<size_t>(KDA_HEAD_DIM) * KDA_HEAD_DIM,
                           KDA_HEAD_DIM * KDA_HEAD_DIM, d);
        for (int part = 0; part < 3; ++part) {
            prefetch_floats_l2(p.conv_state + (ahead_slot * 3 + part) * qkv * kernel_size +
                                   static_cast<size_t>(head) * KDA_HEAD_DIM * kernel_size,
                               KDA_HEAD_DIM * kernel_size, d);
        }
    }
    int passed = 0;  // (thread 0 of a block awaiting its inputs: the blocks past the wait before it)
    if (awaits) {
        passed = kda_await_inputs(p.inputs_ready, p.inputs_target, d);
        group.sync();
        if (p.dependents_after == 3) {
            kda_let_next_kernel_launch();
        }
        inputs = kda_load_token_inputs(p, sequence * p.tokens, qkv, channel, head, true);
    }
    const float a = expf(a_log);
    const float weight = bf16_to_f32(norm_weight);

    for (int t = 0; t < p.tokens; ++t) {
        const size_t row = sequence * p.tokens + t;
        const size_t out_index = row * qkv + channel;
        float conv_input[3];
#pragma unroll
        for (int part = 0; part < 3; ++part) {
            conv_input[part] = bf16_to_f32(inputs.projected[part]);
        }
        const float u = bf16_to_f32(inputs.forget) + bias;
        const float beta_head = sigmoid_f32(bf16_to_f32(inputs.beta_logit));
        const float z = bf16_to_f32(inputs.out_gate);
        if (t + 1 < p.tokens) {
            // The next token's inputs, in flight while this one is stepped.
            inputs = kda_load_token_inputs(p, row + 1, qkv, channel, head, awaits);
        }

        // Conv + SiLU, rounded to BF16 (the conv output stage), then L2 of q and k.
        float rounded[3];
#pragma unroll
        for (int part = 0; part < 3; ++part) {
            const size_t c = part * qkv + channel;
            conv_window_push(window[part], conv_input[part], kernel_size);
            const bf16_t out = f32_to_bf16(conv_silu_taps(window[part], taps[part], kernel_size));
            if (owner) {
                p.conv_out[row * 3 * qkv + c] = out;
            }
            rounded[part] = bf16_to_f32(out);
        }
        float q = rounded[0];
        float k = rounded[1];
        l2_normalize_pair(q, k, p.l2_eps, shared.scratch, group);
        const float v = rounded[2];
        const float g = kda_forget_gate(u, a, p.bounded != 0, p.lower_bound);

        if (owner) {
            p.query[out_index] = q;
            p.key[out_index] = k;
            p.value[out_index] = v;
            p.gate[out_index] = g;
        }
        if (d == 0 && rank == 0) {
            p.beta[row * heads + head] = beta_head;
        }
        // The previous token's step has read the vectors (the norm's reductions since hold
        // barriers), so they may be replaced.
        shared.decay[d] = expf(g);
        shared.key[d] = k;
        shared.query[d] = q * p.scale;
        group.sync();
        if (t == 0 && p.dependents_after == 1) {
            kda_let_next_kernel_launch();
        }

        if constexpr (staged) {
            if (t == 0) {
                // The barrier above also published the mbarrier's initialisation.
                kda_wait_staged_state(&shared.state_arrived);
                kda_recurrent_load(s, stage + d);
            }
        }
        float o = 0.0f;
        if constexpr (split) {
            if (owner) {
                o = kda_recurrent_step(s, shared.decay, shared.key, shared.query, v, beta_head, KdaWarpSync());
            }
        } else {
            o = kda_recurrent_step(s, shared.decay, shared.key, shared.query, v, beta_head, group);
        }
        if (t == 0 && p.dependents_after == 2) {
            kda_let_next_kernel_launch();
        }
        float normed;
        if constexpr (split) {
            if (t == 0) {
                cluster_wait();  // the arrive at the start: every block of the cluster runs
            }
            // Two sets of partial sums, by token parity: a block may write the next token's before
            // a slower one has read this token's, never the one after (it waits on that block).
            normed = cluster_gated_rmsnorm_sigmoid(o, weight, z, p.norm_eps, shared.partials[t & 1], rank, owner);
        } else {
            normed = gated_rmsnorm_sigmoid(o, weight, z, p.norm_eps, shared.scratch, group);
        }
        if (owner) {
            p.core[out_index] = o;
            const bf16_t out = f32_to_bf16(normed);
            p.o_norm_out[out_index] = out;
            if (p.x_tiles != nullptr) {
                p.x_tiles[bulk_tile_element(row, static_cast<int>(channel), static_cast<int>(qkv >> 5))] = out;
            }
        }
    }

    // The block timeline's second stamp (benchmarks/timeline.py; nothing without KDA_TRACE): for
    // the step, when this block's outputs are written, before its state stores.
    KDA_TRACE_WAITED();
    if (p.outputs_ready != nullptr) {
        group.sync();  // every thread's outputs are out before thread 0 releases them
        if (threadIdx.x == 0) {
            kda_count_release(p.outputs_ready);
        }
    }

    // (A split head: every block has read its conv windows before the last token's barrier.)
    if constexpr (staged) {
        kda_recurrent_store(s, stage + d);
        kda_stage_fence();
        group.sync();
        kda_stage_state_out(stage, head_state, d);
    } else {
        if (owner) {
            kda_recurrent_store(s, head_state + d);
        }
    }
    if (owner) {
#pragma unroll
        for (int part = 0; part < 3; ++part) {
            conv_window_store(window[part], conv_slot + (part * qkv + channel) * kernel_size, kernel_size);
        }
    }
    if (awaits && d == 0) {
        kda_clear_words_if_last(p.inputs_ready, passed, static_cast<int>(gridDim.x * gridDim.y));
    }
}

#endif  // DECODE_STEP_CUH
