// The prefill conv pass: causal depthwise conv + SiLU (BF16 output), per-head L2 of q and k, split into
// FP32 q, k, v; conv_state [3 H D, K] FP32 left as T decode steps leave it, with decode's bits.
// Launch: grid (ceil(3 * heads / 4), ceil(T / 64)), 128 threads, no shared memory; a warp holds one head
// of q, k or v for 64 tokens, 4 channels a lane (docs/kernels.md, 'Prefill conv').
#include "common/conv_window.cuh"
#include "common/reduce.cuh"

// Tokens per block of the prefill conv; at least CONV_MAX_KERNEL (see the kernel).
#define CONV_PREFILL_TILE 64

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

// qkv_proj, conv_out [T, 3 H D] BF16 (8-byte aligned rows; conv_out may be null: not written), conv_w
// [3 H D, K] BF16, query, key, value [T, H D] FP32 (16-byte aligned rows). Warp w of block x holds
// head part 4x + w of q, then k, then v.
extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
kda_conv_prefill_silu_l2_bf16(float* __restrict__ conv_state, const bf16_t* __restrict__ qkv_proj,
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

    // Only tile 0 reaches t < 0 (a tile is >= K long): it reads the carried state before any write.
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
    // Conv input of token t: the loaded word for t >= 0, else the carried state (slot K + t).
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
            if (conv_out != nullptr) {  // a stage buffer no later kernel reads: written on request
                *reinterpret_cast<uint2*>(conv_out + static_cast<size_t>(t) * conv_dim + channel) =
                    make_uint2(bits[0] | (bits[1] << 16), bits[2] | (bits[3] << 16));
            }
            float4 result = make_float4(rounded[0], rounded[1], rounded[2], rounded[3]);
            if (normalize) {  // warp-uniform
                const float norm = sqrtf(warp_head_sum_squares(rounded) + l2_eps);
                result = make_float4(rounded[0] / norm, rounded[1] / norm, rounded[2] / norm, rounded[3] / norm);
            }
            *reinterpret_cast<float4*>(outputs + static_cast<size_t>(t) * qkv) = result;
        }
    }

    // Tile 0 alone writes the new state, so no block reads a slot another has overwritten.
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
