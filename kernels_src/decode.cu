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
// Launch: grid (heads, sequences) (or fewer blocks per head, see below), block KDA_HEAD_BLOCK =
// 128, thread d owns channel d of the head: conv channels h D + d of q, k and v, and value
// column d of the state. One block
// holds a whole head, because the L2 sums of q and k and the norm's mean reduce over the
// head, and because the conv window of a q or k channel must be read before it is written:
// several blocks per head would each need it. Sequence s advances slot slots[s] of a pool
// (slot s when slots is null); sequences never interact, so a sequence's bits do not depend
// on the batch. The block lets the next kernel launch at once (the output projection, launched
// as a programmatic dependent, starts while this one runs; letting it launch only once the first
// token's inputs were formed, or after its recurrent step, measured no different). A batch
// of many sequences runs many waves of blocks, each waiting on its own 64 KB state column:
// the block of sequence s asks L2 for the column of sequence s + prefetch_ahead (a block of a
// later wave; 0: none), which it never reads itself, so no bit depends on it.
//
// With gridDim.y < sequences the blocks of a head walk the sequences instead: block y steps
// sequences y, y + gridDim.y, ... in turn, one wave of resident blocks for the whole batch, and
// while it steps one sequence a bulk copy brings the next one's state into shared memory
// (KdaStateStage; the launch passes KDA_STAGE_BYTES of dynamic shared memory). Each
// sequence's arithmetic is the one above, on the same values, so the bits are the same.
#include "decode_step.cuh"

// The parameters of both entry points, in order (sequences: the batch; gridDim.y of them for
// kda_decode_fused_bf16, any number >= gridDim.y for kda_decode_fused_walk_bf16).
#define KDA_DECODE_FUSED_PARAMETERS                                                                      \
    float *__restrict__ conv_state, float *__restrict__ state, const int *__restrict__ slots,            \
        const bf16_t *__restrict__ qkv_proj, const bf16_t *__restrict__ conv_w,                          \
        const bf16_t *__restrict__ forget_proj, const float *__restrict__ dt_bias,                       \
        const float *__restrict__ a_log, const bf16_t *__restrict__ beta_logits, int ld_beta,            \
        const bf16_t *__restrict__ out_gate, const bf16_t *__restrict__ norm_w, bf16_t *__restrict__ conv_out, \
        float *__restrict__ query, float *__restrict__ key, float *__restrict__ value,                   \
        float *__restrict__ gate, float *__restrict__ beta, float *__restrict__ core,                    \
        bf16_t *__restrict__ o_norm_out, int heads, int kernel_size, int tokens, int bounded,            \
        float lower_bound, float scale, float l2_eps, float norm_eps, int prefetch_ahead, int sequences

// The blocks' common start: lets the next kernel launch, leaves on a wrong geometry (uniform over
// the block, before any sync), packs the operands.
#define KDA_DECODE_FUSED_START(SEQUENCES_OK)                                                               \
    kda_let_next_kernel_launch();                                                                          \
    if (blockIdx.x >= heads || blockDim.x != KDA_HEAD_BLOCK || kernel_size < 1 ||                          \
        kernel_size > CONV_MAX_KERNEL || tokens < 1 || !(SEQUENCES_OK)) {                                  \
        return;                                                                                            \
    }                                                                                                      \
    const KdaStepArgs args{conv_state, state, slots, qkv_proj, conv_w, forget_proj, dt_bias, a_log,       \
                           beta_logits, ld_beta, out_gate, norm_w, conv_out, query, key, value, gate, beta, \
                           core, o_norm_out, heads, kernel_size, tokens, bounded, lower_bound, scale,       \
                           l2_eps, norm_eps, prefetch_ahead}

// One block per (head, sequence).
extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK) kda_decode_fused_bf16(KDA_DECODE_FUSED_PARAMETERS)
{
    __shared__ KdaStepShared shared;
    KDA_DECODE_FUSED_START(sequences == static_cast<int>(gridDim.y));
    kda_decode_head(args, blockIdx.x, blockIdx.y, gridDim.y, KdaBlockSync(), shared);
}

// gridDim.y blocks per head walking the sequences, the next one's state staged (see above).
extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
    kda_decode_fused_walk_bf16(KDA_DECODE_FUSED_PARAMETERS)
{
    __shared__ KdaStepShared shared;
    extern __shared__ __align__(128) float staged_state[];
    KDA_DECODE_FUSED_START(sequences >= static_cast<int>(gridDim.y));
    KdaStateStage stage{nullptr, -1, -1};
#if KDA_STAGE_STATE
    stage.buffer = staged_state;
    if (threadIdx.x == 0) {
        kda_stage_init(kda_stage_barrier(staged_state));
    }
    __syncthreads();
#endif
    int walked = 0;
#pragma unroll 1
    for (int sequence = blockIdx.y; sequence < sequences; sequence += gridDim.y, ++walked) {
        // The copy issued while stepping the k-th sequence of the walk (k = 1, 2, ...) completes
        // the barrier's phase k - 1 and is waited for by the (k + 1)-th.
        stage.wait_parity = stage.buffer != nullptr && walked > 0 ? (walked - 1) & 1 : -1;
        const int next = sequence + static_cast<int>(gridDim.y);
        stage.next = stage.buffer != nullptr && next < sequences ? next : -1;
        kda_decode_head<KdaBlockSync, KDA_STAGE_STATE != 0>(args, blockIdx.x, sequence, sequences, KdaBlockSync(),
                                                             shared, stage);
    }
}
