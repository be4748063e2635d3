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
// conv_prefill_silu_l2_bf16: T tokens. grid (ceil(3 * heads / 4), ceil(T / 64)), block 128:
//   a warp holds one head of q, k or v for a tile of 64 tokens, 4 channels a lane, so the
//   tokens run in parallel (a lane rebuilds its windows from the K - 1 inputs before its
//   tile), each token is a few vector loads and stores, and the L2 sum of a token's head is a
//   warp reduction in block_sum_f32's order; conv + SiLU + L2 + split fuse into one pass.
//   Leaves conv_state as T decode steps would. Per token the arithmetic is decode's (the
//   same device functions and the same order of the L2 sum), so prefill and decode agree
//   bit for bit on the conv output and q, k, v.
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

// The L2 sum of a head's 128 squares held 4 per lane (lane L: channels 4L .. 4L+3) with the
// additions of block_sum_f32 over 128 threads of one channel each, in the same order: its warp
// w (channels 32w ..) is lanes 8w .. 8w+7 here, its xor steps 16, 8 and 4 are xor steps 4, 2 and
// 1 between lanes, its steps 2 and 1 the pairs of a lane's own registers, and the four warp sums
// are added in warp order. So q and k come out bit for bit as in decode.
__device__ __forceinline__ float warp_head_sum_squares(const float (&v)[4])
{
    float s[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        s[i] = __fmul_rn(v[i], v[i]);
    }
#pragma unroll
    for (int offset = 4; offset > 0; offset >>= 1) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            s[i] += __shfl_xor_sync(KDA_FULL_WARP_MASK, s[i], offset);
        }
    }
    float pair[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        pair[i] = s[i] + s[i ^ 2];
    }
    const float warp_sum = pair[0] + pair[1];
    float total = __shfl_sync(KDA_FULL_WARP_MASK, warp_sum, 0);
    total += __shfl_sync(KDA_FULL_WARP_MASK, warp_sum, 8);
    total += __shfl_sync(KDA_FULL_WARP_MASK, warp_sum, 16);
    total += __shfl_sync(KDA_FULL_WARP_MASK, warp_sum, 24);
    return total;
}

// old[slot] for the one slot < CONV_MAX_KERNEL equal to `slot` (selects, no indexed load).
__device__ __forceinline__ float conv_carried_input(const float (&old)[CONV_MAX_KERNEL], int slot)
{
    float carried = 0.0f;
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        carried = j == slot ? old[j] : carried;
    }
    return carried;
}

// Tokens a warp loads ahead of their arithmetic.
#define CONV_PREFILL_AHEAD 4

// T tokens: grid (ceil(3 heads / 4), ceil(T / CONV_PREFILL_TILE)), block 128 = 4 warps. Warp w of
// block x holds head part p = 4x + w of q, k or v (heads of q, then k, then v) for one tile of
// tokens, lane L its channels 4L .. 4L+3: each token is one 8-byte load and one 8-byte store of
// BF16 per lane, one 16-byte store of q, k or v, and for q and k a warp reduction (no block
// barrier). The conv and SiLU of a channel are decode's (conv_silu), the L2 sum is
// block_sum_f32's order (warp_head_sum_squares): prefill and decode agree bit for bit.
// Requires 8-byte aligned qkv_proj and conv_out rows and 16-byte aligned q, k, v rows.
extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
conv_prefill_silu_l2_bf16(float* __restrict__ conv_state, const bf16_t* __restrict__ qkv_proj,
                          const bf16_t* __restrict__ conv_w, bf16_t* __restrict__ conv_out,
                          float* __restrict__ query, float* __restrict__ key,
                          float* __restrict__ value, int heads, int head_dim, int kernel_size,
                          int tokens, float l2_eps)
{
    const int part = blockIdx.x * (KDA_HEAD_BLOCK / 32) + (threadIdx.x >> 5);
    // Uniform over the warp (there is no block barrier): a wrong geometry leaves whole warps.
    if (head_dim != KDA_HEAD_DIM || blockDim.x != KDA_HEAD_BLOCK || part >= 3 * heads ||
        kernel_size < 1 || kernel_size > CONV_MAX_KERNEL) {
        return;
    }
    const int lane = threadIdx.x & 31;
    const size_t qkv = static_cast<size_t>(heads) * head_dim;
    const size_t conv_dim = 3 * qkv;
    const int channel = part * KDA_HEAD_DIM + 4 * lane;  // the first of this lane's four
    const int head = part % heads;
    const int first = blockIdx.y * CONV_PREFILL_TILE;
    const int last = min(first + CONV_PREFILL_TILE, tokens);
    float* state = conv_state + static_cast<size_t>(channel) * kernel_size;  // 4 K floats
    float* outputs = part < heads ? query : part < 2 * heads ? key : value;
    outputs += static_cast<size_t>(head) * KDA_HEAD_DIM + 4 * lane;

    // Tile 0 reads the carried state (the conv inputs of tokens -K .. -1) before anything is
    // written; only tile 0 reaches t < 0 (a tile is >= K long).
    float old_state[4][CONV_MAX_KERNEL] = {};
    if (blockIdx.y == 0) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
            for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
                if (j < kernel_size) {
                    old_state[c][j] = state[c * kernel_size + j];
                }
            }
        }
    }
    auto load_inputs = [&](int t) -> uint2 {
        return *reinterpret_cast<const uint2*>(qkv_proj + static_cast<size_t>(t) * conv_dim + channel);
    };
    // Conv input of channel c of token t: the loaded word for t >= 0, else the carried state
    // (slot K + t holds token t).
    auto input = [&](const uint2& packed, int t, int c) -> float {
        if (t >= 0) {
            return bf16_half_to_f32(c < 2 ? packed.x : packed.y, c & 1);
        }
        return conv_carried_input(old_state[c], kernel_size + t);
    };

    // The windows before token `first` hold its K predecessors, oldest in slot 0.
    float window[4][CONV_MAX_KERNEL] = {};
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j < kernel_size) {
            const int t = first - kernel_size + j;
            const uint2 packed = t >= 0 ? load_inputs(t) : make_uint2(0u, 0u);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                window[c][j] = input(packed, t, c);
            }
        }
    }
    const bool normalize = part < 2 * heads;
    for (int t0 = first; t0 < last; t0 += CONV_PREFILL_AHEAD) {
        uint2 packed[CONV_PREFILL_AHEAD];
#pragma unroll
        for (int u = 0; u < CONV_PREFILL_AHEAD; ++u) {
            packed[u] = t0 + u < last ? load_inputs(t0 + u) : make_uint2(0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < CONV_PREFILL_AHEAD; ++u) {
            const int t = t0 + u;
            if (t >= last) {
                break;
            }
            float rounded[4];
            unsigned int bits[4];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                conv_window_push(window[c], input(packed[u], t, c), kernel_size);
                const bf16_t out =
                    f32_to_bf16(conv_silu(window[c], conv_w + static_cast<size_t>(channel + c) * kernel_size,
                                          kernel_size));
                bits[c] = out;
                rounded[c] = bf16_to_f32(out);
            }
            *reinterpret_cast<uint2*>(conv_out + static_cast<size_t>(t) * conv_dim + channel) =
                make_uint2(bits[0] | (bits[1] << 16), bits[2] | (bits[3] << 16));
            float4 result = make_float4(rounded[0], rounded[1], rounded[2], rounded[3]);
            if (normalize) {  // warp-uniform
                const float norm = sqrtf(warp_head_sum_squares(rounded) + l2_eps);
                result = make_float4(rounded[0] / norm, rounded[1] / norm, rounded[2] / norm, rounded[3] / norm);
            }
            *reinterpret_cast<float4*>(outputs + static_cast<size_t>(t) * qkv) = result;
        }
    }

    // Tile 0 alone writes the new state (the last K inputs), so no block reads a slot that
    // another has already overwritten; its old values are in registers by now.
    if (blockIdx.y == 0) {
#pragma unroll
        for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
            if (j < kernel_size) {
                const int t = tokens - kernel_size + j;
                const uint2 packed = t >= 0 ? load_inputs(t) : make_uint2(0u, 0u);
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    state[c * kernel_size + j] = input(packed, t, c);
                }
            }
        }
    }
}
