// The stateful half of decode in one launch: for each of `sequences` sequences, `tokens`
// consecutive tokens (rows s * tokens .. s * tokens + tokens - 1 of the per-token buffers),
// and every head h, token after token:
//   conv + SiLU of the head's q, k and v channels,
//   L2 of q and k,
//   forget gate and beta (from forget_proj, dt_bias, A_log and the b_proj logits),
//   one delta-rule step of the head's FP32 state,
//   gated RMSNorm (sigmoid gate) of the core output, BF16 result.
// What conv_decode_silu_l2_bf16, gate_beta_f32, kda_recurrent_step_f32 and
// gated_rmsnorm_sigmoid_bf16 compute one after the other, token by token, through the same
// device functions (kda_common.cuh) with the same reductions, so the two paths agree bit for
// bit; this one saves three launches per token and the round trips of q, k, v, the gate
// and the core output through memory between them, and a walk of several tokens (the
// rows of a speculative verify) keeps the conv window and the state column in registers
// from the first token to the last: the states are read once and written once. Every
// stage buffer is still written, so a fused step can be inspected stage by stage like the
// separate kernels.
//
// Launch: grid (heads, sequences), block KDA_HEAD_BLOCK = 128, thread d owns channel d of
// the head: conv channels h D + d of q, k and v, and value column d of the state. One block
// holds a whole head, because the L2 sums of q and k and the norm's mean reduce over the
// head, and because the conv window of a q or k channel must be read before it is written:
// several blocks per head would each need it. Sequence s advances slot slots[s] of a pool
// (slot s when slots is null); sequences never interact, so a sequence's bits do not depend
// on the batch. The block lets the next kernel launch at once (the output projection,
// launched as a programmatic dependent, starts its weight stream while this one runs). A batch
// of many sequences runs many waves of blocks, each waiting on its own 64 KB state column:
// the block of sequence s asks L2 for the column of sequence s + prefetch_ahead (a block of a
// later wave; 0: none), which it never reads itself, so no bit depends on it.
#include "decode_step.cuh"

extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
kda_decode_fused_bf16(float* __restrict__ conv_state, float* __restrict__ state,
                      const int* __restrict__ slots, const bf16_t* __restrict__ qkv_proj,
                      const bf16_t* __restrict__ conv_w, const bf16_t* __restrict__ forget_proj,
                      const float* __restrict__ dt_bias, const float* __restrict__ a_log,
                      const bf16_t* __restrict__ beta_logits, int ld_beta,
                      const bf16_t* __restrict__ out_gate, const bf16_t* __restrict__ norm_w,
                      bf16_t* __restrict__ conv_out, float* __restrict__ query,
                      float* __restrict__ key, float* __restrict__ value, float* __restrict__ gate,
                      float* __restrict__ beta, float* __restrict__ core,
                      bf16_t* __restrict__ o_norm_out, int heads, int kernel_size, int tokens, int bounded,
                      float lower_bound, float scale, float l2_eps, float norm_eps, int prefetch_ahead)
{
    __shared__ KdaStepShared shared;

    kda_let_next_kernel_launch();
    // Uniform over the block: a wrong geometry leaves whole blocks, before any sync.
    if (blockIdx.x >= heads || blockDim.x != KDA_HEAD_BLOCK || kernel_size < 1 ||
        kernel_size > CONV_MAX_KERNEL || tokens < 1) {
        return;
    }
    const KdaStepArgs args{conv_state, state, slots, qkv_proj, conv_w, forget_proj, dt_bias, a_log, beta_logits,
                           ld_beta, out_gate, norm_w, conv_out, query, key, value, gate, beta, core, o_norm_out,
                           heads, kernel_size, tokens, bounded, lower_bound, scale, l2_eps, norm_eps, prefetch_ahead};
    kda_decode_head(args, blockIdx.x, blockIdx.y, gridDim.y, KdaBlockSync(), shared);
}

// ---- The same step with each head split over KDA_SPLIT_PARTS blocks of one warp.
//
// One block holds a quarter of a head's state (value columns 32 part .. 32 part + 31, 16 KB),
// so a step of few sequences spreads its state over four times the SMs: a single SM streams
// a 64 KB column in several microseconds, which at one sequence is the whole step.
//
// Same bits as kda_decode_fused_bf16. Lane l of part p owns value column c = 32 p + l, with
// the same per-column arithmetic (kda_recurrent_step over all D key rows). The L2 norms of q
// and k need every channel of the head, so each part forms all D of them (lane l holds
// channels 32 j + l, j = 0..3) and sums them with warp_head_sum_f32, block_sum_f32's tree and
// order; the gate likewise. A part writes only its own channels of the stage buffers and of
// v's conv window. The gated norm needs the whole head's core output, and the q and k conv
// windows may only be written once every part has read them: so each part counts itself in
// arrivals[sequence, head] after its writes, and the last to arrive (the counter then reads
// KDA_SPLIT_PARTS - 1) stores the q and k windows, forms the norm of every token from the
// core outputs the four parts wrote (read from L2) and sets the counter back to zero.
//
// Launch: grid (heads * KDA_SPLIT_PARTS, sequences), block KDA_SPLIT_COLUMNS = 32; arrivals
// [sequences, heads] int32, zero before the launch (and zero after it).
#define KDA_SPLIT_PARTS 4
#define KDA_SPLIT_COLUMNS (KDA_HEAD_DIM / KDA_SPLIT_PARTS)

// The reductions' barrier for a group of one warp.
struct KdaWarpSync {
    __device__ __forceinline__ int thread() const { return threadIdx.x & 31; }
    __device__ __forceinline__ void sync() const { __syncwarp(); }
};

extern "C" __global__ void __launch_bounds__(KDA_SPLIT_COLUMNS)
kda_decode_split_bf16(float* __restrict__ conv_state, float* __restrict__ state,
                      const int* __restrict__ slots, const bf16_t* __restrict__ qkv_proj,
                      const bf16_t* __restrict__ conv_w, const bf16_t* __restrict__ forget_proj,
                      const float* __restrict__ dt_bias, const float* __restrict__ a_log,
                      const bf16_t* __restrict__ beta_logits, int ld_beta,
                      const bf16_t* __restrict__ out_gate, const bf16_t* __restrict__ norm_w,
                      bf16_t* __restrict__ conv_out, float* __restrict__ query,
                      float* __restrict__ key, float* __restrict__ value, float* __restrict__ gate,
                      float* __restrict__ beta, float* __restrict__ core,
                      bf16_t* __restrict__ o_norm_out, int heads, int kernel_size, int tokens, int bounded,
                      float lower_bound, float scale, float l2_eps, float norm_eps, int prefetch_ahead,
                      int* __restrict__ arrivals)
{
    __shared__ float decay_s[KDA_HEAD_DIM];
    __shared__ float key_s[KDA_HEAD_DIM];
    __shared__ float query_s[KDA_HEAD_DIM];
    // The q and k conv windows of the lane's four channels (in shared memory: with the state
    // column in registers they would spill), padded against bank conflicts.
    __shared__ float windows[2][KDA_SPLIT_PARTS][KDA_SPLIT_COLUMNS][CONV_MAX_KERNEL + 1];

    kda_let_next_kernel_launch();
    if (blockIdx.x >= heads * KDA_SPLIT_PARTS || blockDim.x != KDA_SPLIT_COLUMNS || kernel_size < 1 ||
        kernel_size > CONV_MAX_KERNEL || tokens < 1) {
        return;
    }
    const int head = blockIdx.x / KDA_SPLIT_PARTS;
    const int part = blockIdx.x % KDA_SPLIT_PARTS;
    const int lane = threadIdx.x;
    const size_t sequence = blockIdx.y;
    const size_t slot = slots != nullptr ? static_cast<size_t>(slots[sequence]) : sequence;
    const size_t qkv = static_cast<size_t>(heads) * KDA_HEAD_DIM;
    const size_t head_base = static_cast<size_t>(head) * KDA_HEAD_DIM;
    const int column = KDA_SPLIT_COLUMNS * part + lane;  // value column, and this lane's own channel

    float* state_column = state + (slot * heads + head) * static_cast<size_t>(KDA_HEAD_DIM) * KDA_HEAD_DIM + column;
    float s[KDA_HEAD_DIM];
    kda_recurrent_load(s, state_column);
    if (part == 0) {
        const KdaStepArgs args{conv_state, state, slots, qkv_proj, conv_w, forget_proj, dt_bias, a_log, beta_logits,
                               ld_beta, out_gate, norm_w, conv_out, query, key, value, gate, beta, core, o_norm_out,
                               heads, kernel_size, tokens, bounded, lower_bound, scale, l2_eps, norm_eps,
                               prefetch_ahead};
        kda_prefetch_ahead(args, head, sequence, gridDim.y, lane, KDA_SPLIT_COLUMNS);
    }

    // Channel j of this lane (q and k): head_base + 32 j + lane. v: only its own, `column`.
    float* conv_slot = conv_state + slot * 3 * qkv * kernel_size;
    float* window_q[KDA_SPLIT_PARTS];
    float* window_k[KDA_SPLIT_PARTS];
    float window_v[CONV_MAX_KERNEL];
#pragma unroll
    for (int j = 0; j < KDA_SPLIT_PARTS; ++j) {
        const size_t channel = head_base + KDA_SPLIT_COLUMNS * j + lane;
        window_q[j] = windows[0][j][lane];
        window_k[j] = windows[1][j][lane];
        conv_window_load(window_q[j], conv_slot + channel * kernel_size, kernel_size);
        conv_window_load(window_k[j], conv_slot + (qkv + channel) * kernel_size, kernel_size);
    }
    conv_window_load(window_v, conv_slot + (2 * qkv + head_base + column) * kernel_size, kernel_size);
    const float a = expf(a_log[head]);

    for (int t = 0; t < tokens; ++t) {
        const size_t row = sequence * tokens + t;
        const bf16_t* projected = qkv_proj + row * 3 * qkv;
        bf16_t* conv_row = conv_out + row * 3 * qkv;
        const size_t own = row * qkv + head_base + column;
        float q[KDA_SPLIT_PARTS], k[KDA_SPLIT_PARTS], g[KDA_SPLIT_PARTS];
        float q_squares[KDA_SPLIT_PARTS], k_squares[KDA_SPLIT_PARTS];
#pragma unroll
        for (int j = 0; j < KDA_SPLIT_PARTS; ++j) {
            const size_t channel = head_base + KDA_SPLIT_COLUMNS * j + lane;
            conv_window_push(window_q[j], bf16_to_f32(projected[channel]), kernel_size);
            conv_window_push(window_k[j], bf16_to_f32(projected[qkv + channel]), kernel_size);
            const bf16_t q_out = f32_to_bf16(conv_silu(window_q[j], conv_w + channel * kernel_size, kernel_size));
            const bf16_t k_out =
                f32_to_bf16(conv_silu(window_k[j], conv_w + (qkv + channel) * kernel_size, kernel_size));
            if (j == part) {
                conv_row[channel] = q_out;
                conv_row[qkv + channel] = k_out;
            }
            q[j] = bf16_to_f32(q_out);
            k[j] = bf16_to_f32(k_out);
            q_squares[j] = __fmul_rn(q[j], q[j]);
            k_squares[j] = __fmul_rn(k[j], k[j]);
            g[j] = kda_forget_gate(bf16_to_f32(forget_proj[row * qkv + channel]) + dt_bias[channel], a, bounded != 0,
                                   lower_bound);
        }
        const size_t v_channel = 2 * qkv + head_base + column;
        conv_window_push(window_v, bf16_to_f32(projected[v_channel]), kernel_size);
        const bf16_t v_out = f32_to_bf16(conv_silu(window_v, conv_w + v_channel * kernel_size, kernel_size));
        conv_row[v_channel] = v_out;
        const float v = bf16_to_f32(v_out);
        const float q_sum = warp_head_sum_f32(q_squares);
        const float k_sum = warp_head_sum_f32(k_squares);
        const float beta_head = sigmoid_f32(bf16_to_f32(beta_logits[row * ld_beta + head]));

        // The previous token's step has read the vectors.
        __syncwarp();
#pragma unroll
        for (int j = 0; j < KDA_SPLIT_PARTS; ++j) {
            q[j] = l2_apply(q[j], q_sum, l2_eps);
            k[j] = l2_apply(k[j], k_sum, l2_eps);
            const int d = KDA_SPLIT_COLUMNS * j + lane;
            decay_s[d] = expf(g[j]);
            key_s[d] = k[j];
            query_s[d] = q[j] * scale;
            if (j == part) {
                query[own] = q[j];
                key[own] = k[j];
                gate[own] = g[j];
            }
        }
        value[own] = v;
        if (part == 0 && lane == 0) {
            beta[row * heads + head] = beta_head;
        }
        __syncwarp();
        core[own] = kda_recurrent_step(s, decay_s, key_s, query_s, v, beta_head, KdaWarpSync());
    }
    kda_recurrent_store(s, state_column);
    conv_window_store(window_v, conv_slot + (2 * qkv + head_base + column) * kernel_size, kernel_size);

    // Count this part in; every lane's writes before the count.
    __threadfence();
    __syncwarp();
    int arrived = 0;
    int* counter = arrivals + sequence * heads + head;
    if (lane == 0) {
        arrived = atomicAdd(counter, 1);
    }
    arrived = __shfl_sync(KDA_FULL_WARP_MASK, arrived, 0);
    if (arrived != KDA_SPLIT_PARTS - 1) {
        return;
    }
    // The last part: every other part has read the q and k windows and written its core outputs.
    __threadfence();
    if (lane == 0) {
        *counter = 0;
    }
    float weight[KDA_SPLIT_PARTS];
#pragma unroll
    for (int j = 0; j < KDA_SPLIT_PARTS; ++j) {
        const size_t channel = head_base + KDA_SPLIT_COLUMNS * j + lane;
        conv_window_store(window_q[j], conv_slot + channel * kernel_size, kernel_size);
        conv_window_store(window_k[j], conv_slot + (qkv + channel) * kernel_size, kernel_size);
        weight[j] = bf16_to_f32(norm_w[KDA_SPLIT_COLUMNS * j + lane]);
    }
    for (int t = 0; t < tokens; ++t) {
        const size_t row = sequence * tokens + t;
        float o[KDA_SPLIT_PARTS], o_squares[KDA_SPLIT_PARTS];
#pragma unroll
        for (int j = 0; j < KDA_SPLIT_PARTS; ++j) {
            o[j] = __ldcg(core + row * qkv + head_base + KDA_SPLIT_COLUMNS * j + lane);
            o_squares[j] = __fmul_rn(o[j], o[j]);
        }
        const float o_sum = warp_head_sum_f32(o_squares);
#pragma unroll
        for (int j = 0; j < KDA_SPLIT_PARTS; ++j) {
            const size_t index = row * qkv + head_base + KDA_SPLIT_COLUMNS * j + lane;
            o_norm_out[index] = f32_to_bf16(gated_rmsnorm_apply(o[j], o_sum, weight[j], bf16_to_f32(out_gate[index]),
                                                                norm_eps));
        }
    }
}
