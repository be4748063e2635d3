// Causal depthwise conv over time + SiLU on the q|k|v projection (conv_dim =
// 3 * heads * head_dim channels), then the per-head L2 normalisation of q and k.
//
// conv_state [conv_dim, K] FP32 keeps the last K conv INPUTS per channel, oldest
// first. Each token shifts the window left by one (slot 0 falls out unread) and
// puts the new input in slot K-1, then
//   conv_out[c] = bf16( silu( sum_{j=0..K-1} conv_w[c, j] * window[j] ) ).
// L2 reads the ROUNDED conv output: x / sqrt(sum(x * x) + eps), eps inside the
// sqrt; v is never normalised.
//
// conv_decode_silu_l2_bf16: one token of each of `rows` sequences. grid (3 * heads,
//   rows), block head_dim = 128: one block per head of q, k or v, so the L2 sum of a
//   q/k head is one block reduction and conv + SiLU + L2 fuse into a single launch.
//   Row r reads and writes the conv state of slot slots[r] (slot r when slots is
//   null) of a pool of [conv_dim, K] states; the arithmetic of a row does not
//   depend on the other rows, so a sequence's bits do not depend on the batch.
// conv_prefill_silu_l2_bf16: T tokens. grid (3 * heads, ceil(T / 64)), block head_dim =
//   128: a block holds one head of q, k or v for a tile of 64 tokens, so the tokens run
//   in parallel (a thread rebuilds its window from the K - 1 inputs before its tile) and
//   the L2 sum of each token's head is one block reduction; conv + SiLU + L2 + split
//   fuse into one pass. Leaves conv_state as T decode steps would. Per token the
//   arithmetic is decode's (the same device functions), so prefill and decode agree bit
//   for bit on the conv output and q, k, v.
//
// K <= CONV_MAX_KERNEL = 4: the window lives in four registers (the conv_window_* helpers,
// conv_silu and l2_normalize_head are in kda_common.cuh, shared with the fused decode step).
#include "kda_common.cuh"

// Tokens per block of the prefill conv; at least CONV_MAX_KERNEL (see the kernel).
#define CONV_PREFILL_TILE 64

// Block b of 3 * heads: heads of q (b < heads), k (b < 2 * heads), then v.
// Writes query / key (normalised) or value (as is) at [head, d] of `row` outputs.
__device__ __forceinline__ void split_normalize_head(float conv_value, int block_head, int heads,
                                                     int head_dim, float l2_eps, float* query,
                                                     float* key, float* value, float* scratch)
{
    const int head = block_head % heads;
    const int index = head * head_dim + threadIdx.x;
    // block_head is uniform over the block, so the whole block takes one branch.
    if (block_head < 2 * heads) {
        const float normalized = l2_normalize_head(conv_value, l2_eps, scratch);
        if (block_head < heads) {
            query[index] = normalized;
        } else {
            key[index] = normalized;
        }
    } else {
        value[index] = conv_value;
    }
}

extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
conv_decode_silu_l2_bf16(float* __restrict__ conv_state, const int* __restrict__ slots,
                         const bf16_t* __restrict__ qkv_proj, const bf16_t* __restrict__ conv_w,
                         bf16_t* __restrict__ conv_out, float* __restrict__ query,
                         float* __restrict__ key, float* __restrict__ value, int heads,
                         int head_dim, int kernel_size, float l2_eps)
{
    __shared__ float scratch[8];
    // Uniform over the block: a wrong geometry leaves whole blocks, before any sync.
    if (head_dim != KDA_HEAD_DIM || blockDim.x != KDA_HEAD_BLOCK || blockIdx.x >= 3 * heads ||
        kernel_size < 1 || kernel_size > CONV_MAX_KERNEL) {
        return;
    }
    const size_t row = blockIdx.y;
    const size_t slot = slots != nullptr ? static_cast<size_t>(slots[row]) : row;
    const size_t qkv = static_cast<size_t>(heads) * head_dim;
    qkv_proj += row * 3 * qkv;
    conv_out += row * 3 * qkv;
    query += row * qkv;
    key += row * qkv;
    value += row * qkv;
    const int channel = blockIdx.x * head_dim + threadIdx.x;
    float* state = conv_state + (slot * 3 * qkv + channel) * kernel_size;

    float window[CONV_MAX_KERNEL];
    conv_window_load(window, state, kernel_size);
    conv_window_push(window, bf16_to_f32(qkv_proj[channel]), kernel_size);
    const bf16_t rounded =
        f32_to_bf16(conv_silu(window, conv_w + static_cast<size_t>(channel) * kernel_size,
                              kernel_size));
    conv_out[channel] = rounded;
    conv_window_store(window, state, kernel_size);

    split_normalize_head(bf16_to_f32(rounded), blockIdx.x, heads, head_dim, l2_eps, query, key,
                         value, scratch);
}

extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
conv_prefill_silu_l2_bf16(float* __restrict__ conv_state, const bf16_t* __restrict__ qkv_proj,
                          const bf16_t* __restrict__ conv_w, bf16_t* __restrict__ conv_out,
                          float* __restrict__ query, float* __restrict__ key,
                          float* __restrict__ value, int heads, int head_dim, int kernel_size,
                          int tokens, float l2_eps)
{
    __shared__ float scratch[8];
    if (head_dim != KDA_HEAD_DIM || blockDim.x != KDA_HEAD_BLOCK || blockIdx.x >= 3 * heads ||
        kernel_size < 1 || kernel_size > CONV_MAX_KERNEL) {
        return;
    }
    const size_t qkv = static_cast<size_t>(heads) * head_dim;
    const size_t conv_dim = 3 * qkv;
    const int channel = blockIdx.x * head_dim + threadIdx.x;
    const int first = blockIdx.y * CONV_PREFILL_TILE;
    const int last = min(first + CONV_PREFILL_TILE, tokens);
    float* state = conv_state + static_cast<size_t>(channel) * kernel_size;
    const bf16_t* taps = conv_w + static_cast<size_t>(channel) * kernel_size;

    // The conv input of token t: qkv_proj for t >= 0, the carried state before the first
    // token (state slot K-1 is token -1). Only tile 0 reaches t < 0 (the tile is >= K long).
    float old_state[CONV_MAX_KERNEL] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (blockIdx.y == 0) {
#pragma unroll
        for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
            if (j < kernel_size) {
                old_state[j] = state[j];
            }
        }
    }
    auto input = [&](int t) -> float {
        if (t >= 0) {
            return bf16_to_f32(qkv_proj[static_cast<size_t>(t) * conv_dim + channel]);
        }
        float carried = 0.0f;
#pragma unroll
        for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
            if (j == kernel_size + t) {
                carried = old_state[j];
            }
        }
        return carried;
    };

    // The window before token `first` holds its K predecessors, oldest in slot 0.
    float window[CONV_MAX_KERNEL] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j < kernel_size) {
            window[j] = input(first - kernel_size + j);
        }
    }
    for (int t = first; t < last; ++t) {
        const size_t row = static_cast<size_t>(t);
        conv_window_push(window, input(t), kernel_size);
        const bf16_t rounded = f32_to_bf16(conv_silu(window, taps, kernel_size));
        conv_out[row * conv_dim + channel] = rounded;
        split_normalize_head(bf16_to_f32(rounded), blockIdx.x, heads, head_dim, l2_eps,
                             query + row * qkv, key + row * qkv, value + row * qkv, scratch);
    }

    // Tile 0 alone writes the new state (the last K inputs), so no block reads a slot that
    // another has already overwritten; its old values are in registers by now.
    if (blockIdx.y == 0) {
#pragma unroll
        for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
            if (j < kernel_size) {
                state[j] = input(tokens - kernel_size + j);
            }
        }
    }
}
