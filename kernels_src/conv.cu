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
// conv_prefill_silu_bf16: T tokens. grid ceil(conv_dim / 256), block 256: one
//   thread per channel walks the tokens in order with the window in registers,
//   so prefill of T tokens leaves the state T decode steps would leave; reads
//   and writes of a token row are coalesced across the channels.
// l2norm_split_f32: prefill's separate L2 over the [T, conv_dim] conv output.
//   grid (3 * heads, T), block head_dim = 128, the same per-head arithmetic as
//   decode (shared device function), output [T, heads, head_dim] FP32 each.
//
// K <= 4: the window lives in four registers.
#include "kda_common.cuh"

#define CONV_MAX_KERNEL 4
#define CONV_PREFILL_BLOCK 256

// Shift the window left by one and put `input` in slot kernel_size - 1.
// Compile-time indices only, so the window stays in registers.
__device__ __forceinline__ void conv_window_push(float window[CONV_MAX_KERNEL], float input,
                                                 int kernel_size)
{
#pragma unroll
    for (int j = 0; j + 1 < CONV_MAX_KERNEL; ++j) {
        if (j + 1 < kernel_size) {
            window[j] = window[j + 1];
        }
    }
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j == kernel_size - 1) {
            window[j] = input;
        }
    }
}

// silu( sum_j taps[j] * window[j] ), FP32 fma in ascending j. The one place the
// conv arithmetic is written, so decode and prefill agree bit for bit.
__device__ __forceinline__ float conv_silu(const float window[CONV_MAX_KERNEL],
                                           const bf16_t* taps, int kernel_size)
{
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j < kernel_size) {
            acc = fmaf(bf16_to_f32(taps[j]), window[j], acc);
        }
    }
    return acc / (1.0f + expf(-acc));
}

// value / sqrt(sum over the head of value^2 + eps). All KDA_HEAD_BLOCK threads of
// the block call it (it reduces across the block).
__device__ __forceinline__ float l2_normalize_head(float value, float l2_eps, float* scratch)
{
    // __fmul_rn: a product the compiler may not fuse into the first shuffle add.
    const float sum_squares = block_sum_f32(__fmul_rn(value, value), scratch);
    return value / sqrtf(sum_squares + l2_eps);
}

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

    float window[CONV_MAX_KERNEL] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j < kernel_size) {
            window[j] = state[j];
        }
    }
    conv_window_push(window, bf16_to_f32(qkv_proj[channel]), kernel_size);
    const bf16_t rounded =
        f32_to_bf16(conv_silu(window, conv_w + static_cast<size_t>(channel) * kernel_size,
                              kernel_size));
    conv_out[channel] = rounded;
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j < kernel_size) {
            state[j] = window[j];
        }
    }

    split_normalize_head(bf16_to_f32(rounded), blockIdx.x, heads, head_dim, l2_eps, query, key,
                         value, scratch);
}

extern "C" __global__ void __launch_bounds__(CONV_PREFILL_BLOCK)
conv_prefill_silu_bf16(float* __restrict__ conv_state, const bf16_t* __restrict__ qkv_proj,
                       const bf16_t* __restrict__ conv_w, bf16_t* __restrict__ conv_out,
                       int conv_dim, int kernel_size, int tokens)
{
    const int channel = blockIdx.x * blockDim.x + threadIdx.x;
    if (channel >= conv_dim || kernel_size < 1 || kernel_size > CONV_MAX_KERNEL) {
        return;
    }
    float* state = conv_state + static_cast<size_t>(channel) * kernel_size;
    const bf16_t* taps = conv_w + static_cast<size_t>(channel) * kernel_size;

    float window[CONV_MAX_KERNEL] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j < kernel_size) {
            window[j] = state[j];
        }
    }
    for (int t = 0; t < tokens; ++t) {
        const size_t index = static_cast<size_t>(t) * conv_dim + channel;
        conv_window_push(window, bf16_to_f32(qkv_proj[index]), kernel_size);
        conv_out[index] = f32_to_bf16(conv_silu(window, taps, kernel_size));
    }
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j < kernel_size) {
            state[j] = window[j];
        }
    }
}

extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
l2norm_split_f32(const bf16_t* __restrict__ conv_out, float* __restrict__ query,
                 float* __restrict__ key, float* __restrict__ value, int heads, int head_dim,
                 float l2_eps)
{
    __shared__ float scratch[8];
    if (head_dim != KDA_HEAD_DIM || blockDim.x != KDA_HEAD_BLOCK || blockIdx.x >= 3 * heads) {
        return;
    }
    const size_t token = blockIdx.y;
    const size_t qkv = static_cast<size_t>(heads) * head_dim;
    const float conv_value =
        bf16_to_f32(conv_out[token * 3 * qkv + static_cast<size_t>(blockIdx.x) * head_dim +
                             threadIdx.x]);
    split_normalize_head(conv_value, blockIdx.x, heads, head_dim, l2_eps, query + token * qkv,
                         key + token * qkv, value + token * qkv, scratch);
}
