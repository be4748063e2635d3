// The stateful half of decode in one launch (docs/design.md): for each sequence, `tokens` consecutive tokens
// and each head, conv + SiLU, L2, gate, beta, delta-rule step and gated RMSNorm, each with prefill's bits.
// Launch: grid (heads, sequences), 128 threads, no dynamic shared memory; thread d owns channel d of the
// head's q, k, v and value column d of the state. Options: docs/kernels.md, 'Fused decode step'.
#include "common/conv_window.cuh"
#include "common/reduce.cuh"
#include "common/sync.cuh"
#include "decode/decode_step.cuh"
#include "projection/tile_layout.cuh"

// Where the blocks let the next kernel of the stream launch (the dependents_after parameter;
// glm_kda.gpu.ops.decode_step's _DEPENDENTS_* match).
enum KdaDependentsAfter : int {
    KDA_DEPENDENTS_AT_START = 0,      // at once
    KDA_DEPENDENTS_AFTER_INPUTS = 1,  // once the first token's inputs are formed
    KDA_DEPENDENTS_AFTER_STEP = 2,    // after the first token's recurrent step
};

extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
kda_decode_fused_bf16(float* __restrict__ conv_state, float* __restrict__ state, const int* __restrict__ slots,
                      const bf16_t* __restrict__ qkv_proj, const bf16_t* __restrict__ conv_w,
                      const bf16_t* __restrict__ forget_proj, const float* __restrict__ dt_bias,
                      const float* __restrict__ a_log, const bf16_t* __restrict__ beta_logits, int ld_beta,
                      const bf16_t* __restrict__ out_gate, const bf16_t* __restrict__ norm_w,
                      bf16_t* __restrict__ conv_out, float* __restrict__ query, float* __restrict__ key,
                      float* __restrict__ value, float* __restrict__ gate, float* __restrict__ beta,
                      float* __restrict__ core, bf16_t* __restrict__ o_norm_out, int heads, int kernel_size,
                      int tokens, int gate_law, float lower_bound, float scale, float l2_eps, float norm_eps,
                      int prefetch_ahead, int dependents_after, bf16_t* __restrict__ x_tiles, int* outputs_ready)
{
    __shared__ KdaStepShared shared;
    const int head = blockIdx.x;

    if (dependents_after == KDA_DEPENDENTS_AT_START) {
        kda_let_next_kernel_launch();
    }
    // Uniform over the block: a wrong geometry leaves whole blocks, before any sync.
    if (head >= heads || blockDim.x != KDA_HEAD_BLOCK || kernel_size < 1 || kernel_size > CONV_MAX_KERNEL ||
        tokens < 1) {
        return;
    }
    const size_t sequence = blockIdx.y, sequences = gridDim.y;
    const int d = threadIdx.x;
    const size_t qkv = static_cast<size_t>(heads) * KDA_HEAD_DIM;
    const size_t channel = static_cast<size_t>(head) * KDA_HEAD_DIM + d;  // within q, k or v

    // Every load that does not depend on the slot first, then the slot's state column and conv windows:
    // the step waits for memory about twice, not once a value.
    const size_t ahead = sequence + prefetch_ahead;
    const bool prefetch = prefetch_ahead > 0 && ahead < sequences;
    const size_t slot = slots != nullptr ? static_cast<size_t>(slots[sequence]) : sequence;
    const size_t ahead_slot = prefetch && slots != nullptr ? static_cast<size_t>(slots[ahead]) : ahead;
    KdaTokenInputs inputs =
        kda_load_token_inputs(qkv_proj, forget_proj, beta_logits, ld_beta, out_gate, sequence * tokens, qkv, channel,
                              head);
    bf16_t taps[3][CONV_MAX_KERNEL];
#pragma unroll
    for (int part = 0; part < 3; ++part) {
        conv_slots_load(taps[part], conv_w + (part * qkv + channel) * kernel_size, kernel_size);
    }
    const float a_log_head = a_log[head];
    const float bias = dt_bias[channel];
    const bf16_t norm_weight = norm_w[d];

    float* head_state = state + (slot * heads + head) * static_cast<size_t>(KDA_HEAD_DIM) * KDA_HEAD_DIM;
    float s[KDA_HEAD_DIM];
    kda_recurrent_load(s, head_state + d);
    float* conv_slot = conv_state + slot * 3 * qkv * kernel_size;
    float window[3][CONV_MAX_KERNEL];
#pragma unroll
    for (int part = 0; part < 3; ++part) {
        conv_slots_load(window[part], conv_slot + (part * qkv + channel) * kernel_size, kernel_size);
    }
    // L2 requests for the state and conv windows of sequence + prefetch_ahead, a block of a later wave.
    if (prefetch) {
        prefetch_floats_l2(state + (ahead_slot * heads + head) * static_cast<size_t>(KDA_HEAD_DIM) * KDA_HEAD_DIM,
                           KDA_HEAD_DIM * KDA_HEAD_DIM, d);
        for (int part = 0; part < 3; ++part) {
            prefetch_floats_l2(conv_state + (ahead_slot * 3 + part) * qkv * kernel_size +
                                   static_cast<size_t>(head) * KDA_HEAD_DIM * kernel_size,
                               KDA_HEAD_DIM * kernel_size, d);
        }
    }
    const float a = expf(a_log_head);
    const float weight = bf16_to_f32(norm_weight);

    for (int t = 0; t < tokens; ++t) {
        const size_t row = sequence * tokens + t;
        const size_t out_index = row * qkv + channel;
        float conv_input[3];
#pragma unroll
        for (int part = 0; part < 3; ++part) {
            conv_input[part] = bf16_to_f32(inputs.projected[part]);
        }
        const float u = bf16_to_f32(inputs.forget) + bias;
        const float beta_head = sigmoid_f32(bf16_to_f32(inputs.beta_logit));
        const float z = bf16_to_f32(inputs.out_gate);
        if (t + 1 < tokens) {
            // The next token's inputs, in flight while this one is stepped.
            inputs = kda_load_token_inputs(qkv_proj, forget_proj, beta_logits, ld_beta, out_gate, row + 1, qkv,
                                           channel, head);
        }

        // Conv + SiLU, rounded to BF16 (the conv output stage), then L2 of q and k.
        float rounded[3];
#pragma unroll
        for (int part = 0; part < 3; ++part) {
            const size_t c = part * qkv + channel;
            conv_window_push(window[part], conv_input[part], kernel_size);
            const bf16_t out = f32_to_bf16(conv_silu_taps(window[part], taps[part], kernel_size));
            conv_out[row * 3 * qkv + c] = out;
            rounded[part] = bf16_to_f32(out);
        }
        float q = rounded[0];
        float k = rounded[1];
        l2_normalize_pair(q, k, l2_eps, shared.scratch);
        const float v = rounded[2];
        const float g = kda_forget_gate(u, a, gate_law != KDA_GATE_SOFTPLUS, lower_bound);

        query[out_index] = q;
        key[out_index] = k;
        value[out_index] = v;
        gate[out_index] = g;
        if (d == 0) {
            beta[row * heads + head] = beta_head;
        }
        // The previous token's step has read the vectors (barriers since), so they may be replaced.
        shared.decay[d] = expf(g);
        shared.key[d] = k;
        shared.query[d] = q * scale;
        __syncthreads();
        if (t == 0 && dependents_after == KDA_DEPENDENTS_AFTER_INPUTS) {
            kda_let_next_kernel_launch();
        }

        const float o = kda_recurrent_step(s, shared.decay, shared.key, shared.query, v, beta_head);
        if (t == 0 && dependents_after == KDA_DEPENDENTS_AFTER_STEP) {
            kda_let_next_kernel_launch();
        }
        const float normed = gated_rmsnorm_sigmoid(o, weight, z, norm_eps, shared.scratch);
        core[out_index] = o;
        const bf16_t out = f32_to_bf16(normed);
        o_norm_out[out_index] = out;
        if (x_tiles != nullptr) {
            x_tiles[bulk_tile_element(row, static_cast<int>(channel), static_cast<int>(qkv >> 5))] = out;
        }
    }

    if (outputs_ready != nullptr) {
        __syncthreads();  // every thread's outputs are out before thread 0 releases them
        if (threadIdx.x == 0) {
            kda_count_release(outputs_ready);
        }
    }
    kda_recurrent_store(s, head_state + d);
#pragma unroll
    for (int part = 0; part < 3; ++part) {
        conv_window_store(window[part], conv_slot + (part * qkv + channel) * kernel_size, kernel_size);
    }
}
