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
    __shared__ float scratch[8];
    __shared__ float decay_s[KDA_HEAD_DIM];
    __shared__ float key_s[KDA_HEAD_DIM];
    __shared__ float query_s[KDA_HEAD_DIM];

    kda_let_next_kernel_launch();
    // Uniform over the block: a wrong geometry leaves whole blocks, before any sync.
    if (blockIdx.x >= heads || blockDim.x != KDA_HEAD_BLOCK || kernel_size < 1 ||
        kernel_size > CONV_MAX_KERNEL || tokens < 1) {
        return;
    }
    const int head = blockIdx.x;
    const int d = threadIdx.x;
    const size_t sequence = blockIdx.y;
    const size_t slot = slots != nullptr ? static_cast<size_t>(slots[sequence]) : sequence;
    const size_t qkv = static_cast<size_t>(heads) * KDA_HEAD_DIM;
    const size_t channel = static_cast<size_t>(head) * KDA_HEAD_DIM + d;  // within q, k or v

    // The sequence's state column (64 KB per block, the bulk of the traffic) and conv windows
    // first: in flight while the first token's inputs are formed.
    float* state_column =
        state + (slot * heads + head) * static_cast<size_t>(KDA_HEAD_DIM) * KDA_HEAD_DIM + d;
    float s[KDA_HEAD_DIM];
    kda_recurrent_load(s, state_column);
    // A batch runs many waves of blocks, each of which waits on its state column: ask L2 for the
    // head's state of sequence + prefetch_ahead (a block of a later wave) now, so that its loads
    // hit, and for its conv windows (the head's channels of q, k and v: three runs of D K floats).
    if (prefetch_ahead > 0 && sequence + prefetch_ahead < gridDim.y) {
        const size_t ahead = sequence + prefetch_ahead;
        const size_t ahead_slot = slots != nullptr ? static_cast<size_t>(slots[ahead]) : ahead;
        prefetch_floats_l2(state + (ahead_slot * heads + head) * static_cast<size_t>(KDA_HEAD_DIM) * KDA_HEAD_DIM,
                           KDA_HEAD_DIM * KDA_HEAD_DIM, d);
        for (int part = 0; part < 3; ++part) {
            prefetch_floats_l2(conv_state + (ahead_slot * 3 + part) * qkv * kernel_size +
                                   static_cast<size_t>(head) * KDA_HEAD_DIM * kernel_size,
                               KDA_HEAD_DIM * kernel_size, d);
        }
    }
    float* conv_slot = conv_state + slot * 3 * qkv * kernel_size;
    float window[3][CONV_MAX_KERNEL];
#pragma unroll
    for (int part = 0; part < 3; ++part) {
        conv_window_load(window[part], conv_slot + (part * qkv + channel) * kernel_size, kernel_size);
    }
    const float a = expf(a_log[head]);
    const float bias = dt_bias[channel];
    const float weight = bf16_to_f32(norm_w[d]);

    for (int t = 0; t < tokens; ++t) {
        const size_t row = sequence * tokens + t;
        const bf16_t* projected = qkv_proj + row * 3 * qkv;
        const size_t out_index = row * qkv + channel;
        float conv_input[3];
#pragma unroll
        for (int part = 0; part < 3; ++part) {
            conv_input[part] = bf16_to_f32(projected[part * qkv + channel]);
        }
        const float u = bf16_to_f32(forget_proj[out_index]) + bias;
        const float beta_head = sigmoid_f32(bf16_to_f32(beta_logits[row * ld_beta + head]));
        const float z = bf16_to_f32(out_gate[out_index]);

        // Conv + SiLU, rounded to BF16 (the conv output stage), then L2 of q and k.
        float rounded[3];
#pragma unroll
        for (int part = 0; part < 3; ++part) {
            const size_t c = part * qkv + channel;
            conv_window_push(window[part], conv_input[part], kernel_size);
            const bf16_t out = f32_to_bf16(conv_silu(window[part], conv_w + c * kernel_size, kernel_size));
            conv_out[row * 3 * qkv + c] = out;
            rounded[part] = bf16_to_f32(out);
        }
        const float q = l2_normalize_head(rounded[0], l2_eps, scratch);
        const float k = l2_normalize_head(rounded[1], l2_eps, scratch);
        const float v = rounded[2];
        const float g = kda_forget_gate(u, a, bounded != 0, lower_bound);

        query[out_index] = q;
        key[out_index] = k;
        value[out_index] = v;
        gate[out_index] = g;
        if (d == 0) {
            beta[row * heads + head] = beta_head;
        }
        // The previous token's step has read the vectors (the norm's reductions since hold
        // barriers), so they may be replaced.
        decay_s[d] = expf(g);
        key_s[d] = k;
        query_s[d] = q * scale;
        __syncthreads();

        const float o = kda_recurrent_step(s, decay_s, key_s, query_s, v, beta_head);
        core[out_index] = o;
        o_norm_out[out_index] = f32_to_bf16(gated_rmsnorm_sigmoid(o, weight, z, norm_eps, scratch));
    }

    kda_recurrent_store(s, state_column);
#pragma unroll
    for (int part = 0; part < 3; ++part) {
        conv_window_store(window[part], conv_slot + (part * qkv + channel) * kernel_size, kernel_size);
    }
}
