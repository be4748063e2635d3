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
// on the batch. The block lets the next kernel launch (the output projection, launched as a
// programmatic dependent, starts while this one runs) at once, or with dependents_after 1 / 2
// only once the first token's inputs are formed / its recurrent step is done: then that
// projection's first weight requests do not queue in front of the state column's loads; 3 (a
// step awaiting inputs_ready) once past that wait, before it reads the inputs. A batch
// of many sequences runs many waves of blocks, each waiting on its own 64 KB state column:
// the block of sequence s asks L2 for the column of sequence s + prefetch_ahead (a block of a
// later wave; 0: none), which it never reads itself, so no bit depends on it.
//
// x_tiles (null: none) receives o_norm_out a second time, in the tile layout the output
// projection's bulk-copy sweep reads (bulk_tile_element), so that no launch lays it out there.
//
// outputs_ready (null: none): each block adds 1 to outputs_ready[0] once its outputs are written,
// before it stores its states; an output projection launched on gemm_rows' awaiting entry waits
// for that count instead of for this kernel's end.
//
// kda_decode_fused_staged_bf16 is the same step with the head's 64 KB state moved by one bulk
// copy each way through KDA_HEAD_STATE_BYTES of dynamic shared memory (sm_90 and later, the
// state 16-byte aligned; before sm_90 it compiles to the register loads): the same bits.
#include "decode_step.cuh"

// Head `head` (block `rank` of its KDA_HEAD_SPLIT when Split) of sequence blockIdx.y.
template <bool Staged, int Split = 1>
__device__ __forceinline__ void kda_decode_fused_block(const KdaStepArgs& args, float* stage, int head, int rank = 0)
{
    __shared__ KdaStepShared shared;
    KDA_TRACE_SCOPE(args.o_norm_out);

    if (args.dependents_after == 0) {
        kda_let_next_kernel_launch();
    }
    // Uniform over the block: a wrong geometry leaves whole blocks, before any sync (and a
    // cluster's blocks share the head, so they leave together).
    if (head >= args.heads || blockDim.x != KDA_HEAD_BLOCK || args.kernel_size < 1 ||
        args.kernel_size > CONV_MAX_KERNEL || args.tokens < 1) {
        return;
    }
    kda_decode_head<KdaBlockSync, Staged, Split>(args, head, blockIdx.y, gridDim.y, KdaBlockSync(), shared, stage,
                                                 rank);
}

#define KDA_DECODE_FUSED_PARAMETERS                                                                                  \
    float *__restrict__ conv_state, float *__restrict__ state, const int *__restrict__ slots,                         \
        const bf16_t *__restrict__ qkv_proj, const bf16_t *__restrict__ conv_w,                                       \
        const bf16_t *__restrict__ forget_proj, const float *__restrict__ dt_bias, const float *__restrict__ a_log,   \
        const bf16_t *__restrict__ beta_logits, int ld_beta, const bf16_t *__restrict__ out_gate,                     \
        const bf16_t *__restrict__ norm_w, bf16_t *__restrict__ conv_out, float *__restrict__ query,                  \
        float *__restrict__ key, float *__restrict__ value, float *__restrict__ gate, float *__restrict__ beta,       \
        float *__restrict__ core, bf16_t *__restrict__ o_norm_out, int heads, int kernel_size, int tokens,            \
        int bounded, float lower_bound, float scale, float l2_eps, float norm_eps, int prefetch_ahead,                \
        int dependents_after, bf16_t *__restrict__ x_tiles, int *inputs_ready, int inputs_target, int *outputs_ready
#define KDA_DECODE_FUSED_ARGS                                                                                        \
    KdaStepArgs{conv_state, state, slots, qkv_proj, conv_w, forget_proj, dt_bias, a_log, beta_logits,                \
                ld_beta, out_gate, norm_w, conv_out, query, key, value, gate, beta, core, o_norm_out,                \
                heads, kernel_size, tokens, bounded, lower_bound, scale, l2_eps, norm_eps, prefetch_ahead,           \
                dependents_after, x_tiles, inputs_ready, inputs_target, outputs_ready}

extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK) kda_decode_fused_bf16(KDA_DECODE_FUSED_PARAMETERS)
{
    kda_decode_fused_block<false>(KDA_DECODE_FUSED_ARGS, nullptr, blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
kda_decode_fused_staged_bf16(KDA_DECODE_FUSED_PARAMETERS)
{
    extern __shared__ __align__(128) float kda_state_stage[];
    kda_decode_fused_block<true>(KDA_DECODE_FUSED_ARGS, kda_state_stage, blockIdx.x);
}

// The head split over a cluster of KDA_HEAD_SPLIT blocks (grid: heads * KDA_HEAD_SPLIT along x).
// Before sm_90 there are no clusters: the first block of each KDA_HEAD_SPLIT runs the whole head.
#if KDA_CLUSTERS
#define KDA_SPLIT_CLUSTER_DIMS __cluster_dims__(KDA_HEAD_SPLIT, 1, 1)
#else
#define KDA_SPLIT_CLUSTER_DIMS
#endif

extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK) KDA_SPLIT_CLUSTER_DIMS
kda_decode_fused_split_bf16(KDA_DECODE_FUSED_PARAMETERS)
{
#if KDA_CLUSTERS
    kda_decode_fused_block<false, KDA_HEAD_SPLIT>(KDA_DECODE_FUSED_ARGS, nullptr, blockIdx.x / KDA_HEAD_SPLIT,
                                                  blockIdx.x % KDA_HEAD_SPLIT);
#else
    if (blockIdx.x % KDA_HEAD_SPLIT == 0) {
        kda_decode_fused_block<false>(KDA_DECODE_FUSED_ARGS, nullptr, blockIdx.x / KDA_HEAD_SPLIT);
    }
#endif
}

// Adds 1 to inputs_ready[0] once the kernel before it in the stream has finished and its writes
// are visible (a programmatic dependent of it: its one block waits resident): the signal a fused
// step with inputs_ready waits for. Launch: one block of 32 threads.
extern "C" __global__ void __launch_bounds__(32) kda_signal_inputs_ready(int* inputs_ready)
{
    kda_let_next_kernel_launch();
    kda_wait_for_previous_kernel();
    if (threadIdx.x == 0) {
        kda_count_release(inputs_ready);
    }
}
