// The pieces of the fused decode step (decode.cu): the delta-rule step of one value column of a head's
// state held in registers, one token's inputs of a channel, and the L2 request for a later state.
#pragma once

#include "common/bf16.cuh"
#include "common/head.cuh"

// Ask L2 for `count` floats from `first` (16-byte aligned, count a multiple of 4), thread d taking part.
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

// Delta-rule steps of one value column of a head's FP32 state S [D_k, D_v] (row i at state_column +
// i * KDA_HEAD_DIM), kept in registers from a load to a store across the tokens (docs/kernels.md).
// decay_s, key_s, query_s: exp(gate), k, q * scale in shared memory. Every thread must call the step.
__device__ __forceinline__ void kda_recurrent_load(float (&s)[KDA_HEAD_DIM], const float* state_column)
{
#pragma unroll
    for (int i = 0; i < KDA_HEAD_DIM; ++i) {
        s[i] = state_column[static_cast<size_t>(i) * KDA_HEAD_DIM];
    }
}

__device__ __forceinline__ float kda_recurrent_step(float (&s)[KDA_HEAD_DIM], const float* decay_s,
                                                    const float* key_s, const float* query_s, float value,
                                                    float beta)
{
    float pred = 0.0f;
#pragma unroll
    for (int i = 0; i < KDA_HEAD_DIM; ++i) {
        s[i] = s[i] * decay_s[i];
        pred = fmaf(s[i], key_s[i], pred);
    }
    const float delta = beta * (value - pred);
    // A barrier is a shared-memory fence: without it the key values stay in registers and spill.
    __syncthreads();

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

// The step's shared memory: the reductions' scratch and the head's vectors (16-byte broadcast loads).
struct KdaStepShared {
    float scratch[10];
    __align__(16) float decay[KDA_HEAD_DIM];
    __align__(16) float key[KDA_HEAD_DIM];
    __align__(16) float query[KDA_HEAD_DIM];
};

// One token's inputs (BF16 bits) of channel `channel` of head `head`.
struct KdaTokenInputs {
    bf16_t projected[3];
    bf16_t forget;
    bf16_t beta_logit;
    bf16_t out_gate;
};

__device__ __forceinline__ KdaTokenInputs kda_load_token_inputs(const bf16_t* qkv_proj, const bf16_t* forget_proj,
                                                                const bf16_t* beta_logits, int ld_beta,
                                                                const bf16_t* out_gate, size_t row, size_t qkv,
                                                                size_t channel, int head)
{
    KdaTokenInputs inputs;
    const bf16_t* projected = qkv_proj + row * 3 * qkv;
#pragma unroll
    for (int part = 0; part < 3; ++part) {
        inputs.projected[part] = projected[part * qkv + channel];
    }
    inputs.forget = forget_proj[row * qkv + channel];
    inputs.beta_logit = beta_logits[row * ld_beta + head];
    inputs.out_gate = out_gate[row * qkv + channel];
    return inputs;
}
