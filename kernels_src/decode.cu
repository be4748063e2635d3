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

// ---- The same step with each head split over a cluster of KDA_SPLIT_PARTS blocks of one warp
// (sm_90 and later; the entry point does nothing before).
//
// A block holds a quarter of a head's state (value columns 32 part .. 32 part + 31, 16 KB), so a
// step of one sequence spreads its state over four times the SMs. Block `part` owns the q, k and
// v channels 32 part + lane of the head as well: conv, SiLU, gate and stage writes of its own
// channels only, each conv window read and written by its owner alone.
//
// Same bits as kda_decode_fused_bf16. Each block pushes what the others need into every block's
// shared memory (its conv outputs of q and k, exp(gate), the warp sums of q^2 and k^2), then one
// cluster barrier per token; after it every read is local. The head sums are block_sum_f32's:
// each block's warp tree over its 32 channels is that function's warp sum for warp `part`, and
// every block adds the four in ascending order. The vectors alternate between two buffers by
// token: a block may push token t + 1's while another still steps with token t's. The gated norm
// needs the sum of o^2 over the head: each block pushes its warp sum of every token, and after
// the walk one more barrier makes them visible, so a walk of T tokens costs T + 1 barriers;
// after the last one nobody touches another block's memory, so a block may leave.
//
// Launch: grid (heads * KDA_SPLIT_PARTS, sequences), block KDA_SPLIT_COLUMNS = 32, clusters of
// KDA_SPLIT_PARTS along x (compiled in); tokens <= KDA_CLUSTER_MAX_TOKENS.
#define KDA_SPLIT_PARTS 4
#define KDA_SPLIT_COLUMNS (KDA_HEAD_DIM / KDA_SPLIT_PARTS)
// Most tokens of one launch (a verify walk's rows).
#define KDA_CLUSTER_MAX_TOKENS 16

// The reductions' barrier for a group of one warp.
struct KdaWarpSync {
    __device__ __forceinline__ int thread() const { return threadIdx.x & 31; }
    __device__ __forceinline__ void sync() const { __syncwarp(); }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KDA_CLUSTER_OF_PARTS __cluster_dims__(KDA_SPLIT_PARTS, 1, 1)
#define KDA_HAS_CLUSTERS 1
#else
#define KDA_CLUSTER_OF_PARTS
#define KDA_HAS_CLUSTERS 0
#endif

// Every block of the cluster arrives, then waits for the others; shared-memory writes before it
// are visible to the cluster after it.
__device__ __forceinline__ void kda_cluster_sync()
{
#if KDA_HAS_CLUSTERS
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// Store `value` at `local` (an address of this block's shared memory) in block `rank` of the
// cluster: no wait, visible to that block after the next kda_cluster_sync.
__device__ __forceinline__ void kda_cluster_store(float* local, unsigned int rank, float value)
{
#if KDA_HAS_CLUSTERS
    const unsigned int address = static_cast<unsigned int>(__cvta_generic_to_shared(local));
    unsigned int remote;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(value) : "memory");
#endif
}

extern "C" __global__ void KDA_CLUSTER_OF_PARTS __launch_bounds__(KDA_SPLIT_COLUMNS)
kda_decode_cluster_bf16(float* __restrict__ conv_state, float* __restrict__ state,
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
    // [buffer][channel of the head]: the conv outputs of q and k (normalised in place once the
    // sums are in), exp(gate); [buffer][q or k][part]: the warp sums of q^2 and k^2.
    __shared__ float query_s[2][KDA_HEAD_DIM];
    __shared__ float key_s[2][KDA_HEAD_DIM];
    __shared__ float decay_s[2][KDA_HEAD_DIM];
    __shared__ float qk_sums[2][2][KDA_SPLIT_PARTS];
    // [token][part]: the warp sums of o^2; [token][lane]: this block's own core outputs.
    __shared__ float o_sums[KDA_CLUSTER_MAX_TOKENS][KDA_SPLIT_PARTS];
    __shared__ float o_own[KDA_CLUSTER_MAX_TOKENS][KDA_SPLIT_COLUMNS];

    kda_let_next_kernel_launch();
    // Uniform over the grid: nobody waits on a block that left.
    if (!KDA_HAS_CLUSTERS || gridDim.x != static_cast<unsigned int>(heads * KDA_SPLIT_PARTS) ||
        blockDim.x != KDA_SPLIT_COLUMNS || kernel_size < 1 || kernel_size > CONV_MAX_KERNEL || tokens < 1 ||
        tokens > KDA_CLUSTER_MAX_TOKENS) {
        return;
    }
    const int head = blockIdx.x / KDA_SPLIT_PARTS;
    const int part = blockIdx.x % KDA_SPLIT_PARTS;  // the rank in the cluster
    const int lane = threadIdx.x;
    const size_t sequence = blockIdx.y;
    const size_t slot = slots != nullptr ? static_cast<size_t>(slots[sequence]) : sequence;
    const size_t qkv = static_cast<size_t>(heads) * KDA_HEAD_DIM;
    const size_t head_base = static_cast<size_t>(head) * KDA_HEAD_DIM;
    const int column = KDA_SPLIT_COLUMNS * part + lane;
    const size_t channel = head_base + column;  // of q, k and v, this lane's own

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
    float* conv_slot = conv_state + slot * 3 * qkv * kernel_size;
    float window[3][CONV_MAX_KERNEL];
#pragma unroll
    for (int p = 0; p < 3; ++p) {
        conv_window_load(window[p], conv_slot + (p * qkv + channel) * kernel_size, kernel_size);
    }
    const float a = expf(a_log[head]);
    const float bias = dt_bias[channel];

    for (int t = 0; t < tokens; ++t) {
        const int buffer = t & 1;
        const size_t row = sequence * tokens + t;
        const bf16_t* projected = qkv_proj + row * 3 * qkv;
        const size_t own = row * qkv + channel;
        float rounded[3];
#pragma unroll
        for (int p = 0; p < 3; ++p) {
            const size_t c = p * qkv + channel;
            conv_window_push(window[p], bf16_to_f32(projected[c]), kernel_size);
            const bf16_t out = f32_to_bf16(conv_silu(window[p], conv_w + c * kernel_size, kernel_size));
            conv_out[row * 3 * qkv + c] = out;
            rounded[p] = bf16_to_f32(out);
        }
        const float g = kda_forget_gate(bf16_to_f32(forget_proj[own]) + bias, a, bounded != 0, lower_bound);
        const float beta_head = sigmoid_f32(bf16_to_f32(beta_logits[row * ld_beta + head]));
        const float q_part = warp_tree_sum_f32(__fmul_rn(rounded[0], rounded[0]));
        const float k_part = warp_tree_sum_f32(__fmul_rn(rounded[1], rounded[1]));
        const float decay = expf(g);
#pragma unroll
        for (int r = 0; r < KDA_SPLIT_PARTS; ++r) {
            kda_cluster_store(&query_s[buffer][column], r, rounded[0]);
            kda_cluster_store(&key_s[buffer][column], r, rounded[1]);
            kda_cluster_store(&decay_s[buffer][column], r, decay);
            if (lane == 0) {
                kda_cluster_store(&qk_sums[buffer][0][part], r, q_part);
                kda_cluster_store(&qk_sums[buffer][1][part], r, k_part);
            }
        }
        kda_cluster_sync();
        // block_sum_f32's order: the four quarters' warp sums in ascending order.
        float q_sum = qk_sums[buffer][0][0];
        float k_sum = qk_sums[buffer][1][0];
#pragma unroll
        for (int r = 1; r < KDA_SPLIT_PARTS; ++r) {
            q_sum += qk_sums[buffer][0][r];
            k_sum += qk_sums[buffer][1][r];
        }
        // Normalise the gathered vectors in place (each lane its four channels: no other lane reads
        // them before the warp barrier below).
#pragma unroll
        for (int r = 0; r < KDA_SPLIT_PARTS; ++r) {
            const int d = KDA_SPLIT_COLUMNS * r + lane;
            query_s[buffer][d] = l2_apply(query_s[buffer][d], q_sum, l2_eps) * scale;
            key_s[buffer][d] = l2_apply(key_s[buffer][d], k_sum, l2_eps);
        }
        const float q = l2_apply(rounded[0], q_sum, l2_eps);
        const float k = l2_apply(rounded[1], k_sum, l2_eps);
        const float v = rounded[2];
        query[own] = q;
        key[own] = k;
        value[own] = v;
        gate[own] = g;
        if (part == 0 && lane == 0) {
            beta[row * heads + head] = beta_head;
        }
        __syncwarp();
        const float o = kda_recurrent_step(s, decay_s[buffer], key_s[buffer], query_s[buffer], v, beta_head,
                                           KdaWarpSync());
        core[own] = o;
        o_own[t][lane] = o;
        const float o_part = warp_tree_sum_f32(__fmul_rn(o, o));
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < KDA_SPLIT_PARTS; ++r) {
                kda_cluster_store(&o_sums[t][part], r, o_part);
            }
        }
    }
    kda_recurrent_store(s, state_column);
#pragma unroll
    for (int p = 0; p < 3; ++p) {
        conv_window_store(window[p], conv_slot + (p * qkv + channel) * kernel_size, kernel_size);
    }
    kda_cluster_sync();
    const float weight = bf16_to_f32(norm_w[column]);
    for (int t = 0; t < tokens; ++t) {
        float o_sum = o_sums[t][0];
#pragma unroll
        for (int r = 1; r < KDA_SPLIT_PARTS; ++r) {
            o_sum += o_sums[t][r];
        }
        const size_t own = (sequence * tokens + t) * qkv + channel;
        o_norm_out[own] = f32_to_bf16(gated_rmsnorm_apply(o_own[t][lane], o_sum, weight, bf16_to_f32(out_gate[own]),
                                                          norm_eps));
    }
}
