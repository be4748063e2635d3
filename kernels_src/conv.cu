// The prefill conv pass: causal depthwise conv + SiLU (BF16 output), per-head L2 of q and k, split into
// FP32 q, k, v; conv_state [3 H D, K] FP32 left as T decode steps leave it, with decode's bits.
// Launch: grid (ceil(3 * heads / 4), ceil(T / 64)), 128 threads, no shared memory; a warp holds one head
// of q, k or v for 64 tokens, 4 channels a lane (docs/kernels.md, 'Prefill conv').
#include "common/conv_window.cuh"
#include "common/reduce.cuh"

// Tokens per block of the prefill conv; at least CONV_MAX_KERNEL (see the kernel).
#define CONV_PREFILL_TILE 64

// Tokens a warp works as one group; the next group's loads are in flight meanwhile.
#define CONV_PREFILL_AHEAD 4

// Resident blocks an SM the register budget is cut for (80 registers a thread, no spill).
#define CONV_PREFILL_BLOCKS_PER_SM 6

// One warp's tile (see the kernel below); kernel_size is FIXED_K where that is > 0, so that the window
// shifts and the tap loop unroll without a branch, else the run-time argument.
template <int FIXED_K>
__device__ __forceinline__ void conv_prefill_tile(float* __restrict__ conv_state, const bf16_t* __restrict__ qkv_proj,
                                                  const bf16_t* __restrict__ conv_w, bf16_t* __restrict__ conv_out,
                                                  float* __restrict__ outputs, int part, int heads, int run_time_k,
                                                  int tokens, float l2_eps)
{
    const int kernel_size = FIXED_K > 0 ? FIXED_K : run_time_k;
    const int lane = threadIdx.x & 31;
    const size_t qkv = static_cast<size_t>(heads) * KDA_HEAD_DIM;
    const size_t conv_dim = 3 * qkv;
    const int channel = part * KDA_HEAD_DIM + 4 * lane;  // the first of this lane's four
    const int first = blockIdx.y * CONV_PREFILL_TILE;
    const int last = min(first + CONV_PREFILL_TILE, tokens);
    float* state = conv_state + static_cast<size_t>(channel) * kernel_size;  // 4 K floats
    const bool normalize = part < 2 * heads;

    auto load_inputs = [&](int t) -> uint2 {
        return *reinterpret_cast<const uint2*>(qkv_proj + static_cast<size_t>(t) * conv_dim + channel);
    };
    auto unpack = [](const uint2& packed, int c) -> float {
        return bf16_half_to_f32(c < 2 ? packed.x : packed.y, c & 1);
    };
    // The conv inputs of token t in the lane's four channels: loaded for t >= 0, else the carried
    // state's slot K + t (only tile 0 asks for t < 0; a tile is >= K long).
    auto inputs_at = [&](int t, float (&inputs)[4]) {
        const uint2 packed = t >= 0 ? load_inputs(t) : make_uint2(0u, 0u);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            inputs[c] = t >= 0 ? unpack(packed, c) : state[c * kernel_size + kernel_size + t];
        }
    };
    // The taps once, in registers: the loop below reads no weight.
    float taps[4][CONV_MAX_KERNEL];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        conv_taps_f32(taps[c], conv_w + static_cast<size_t>(channel + c) * kernel_size, kernel_size);
    }

    // The windows before token `first` hold its K predecessors, oldest in slot 0 (tile 0 reads the
    // carried state before it writes any).
    float window[4][CONV_MAX_KERNEL] = {};
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j < kernel_size) {
            float inputs[4];
            inputs_at(first - kernel_size + j, inputs);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                window[c][j] = inputs[c];
            }
        }
    }
    // A group's arithmetic would otherwise wait for its own loads in full: the next group's loads go
    // out before the present group's arithmetic (docs/performance.md, "The conv pass's loads a group ahead").
    // The conv inputs of tokens t0 .. t0 + CONV_PREFILL_AHEAD - 1, zero past the tile.
    auto load_group = [&](int t0, uint2 (&group)[CONV_PREFILL_AHEAD]) {
#pragma unroll
        for (int u = 0; u < CONV_PREFILL_AHEAD; ++u) {
            group[u] = t0 + u < last ? load_inputs(t0 + u) : make_uint2(0u, 0u);
        }
    };
    uint2 packed[CONV_PREFILL_AHEAD];
    load_group(first, packed);
    for (int t0 = first; t0 < last; t0 += CONV_PREFILL_AHEAD) {
        uint2 next[CONV_PREFILL_AHEAD];
        load_group(t0 + CONV_PREFILL_AHEAD, next);
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
                conv_window_push(window[c], unpack(packed[u], c), kernel_size);
                const bf16_t out = f32_to_bf16(conv_silu_f32_taps(window[c], taps[c], kernel_size));
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
#pragma unroll
        for (int u = 0; u < CONV_PREFILL_AHEAD; ++u) {
            packed[u] = next[u];
        }
    }

    // Tile 0 alone writes the new state, so no block reads a slot another has overwritten. Where
    // T < K, slot j takes the old slot T + j, which is above j: not yet rewritten.
    if (blockIdx.y == 0) {
#pragma unroll
        for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
            if (j < kernel_size) {
                float inputs[4];
                inputs_at(tokens - kernel_size + j, inputs);
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    state[c * kernel_size + j] = inputs[c];
                }
            }
        }
    }
}

// qkv_proj, conv_out [T, 3 H D] BF16 (8-byte aligned rows; conv_out may be null: not written), conv_w
// [3 H D, K] BF16, query, key, value [T, H D] FP32 (16-byte aligned rows). Warp w of block x holds
// head part 4x + w of q, then k, then v. The register cap keeps six blocks an SM beside the two
// groups of loads a warp holds; it needs no spill on any architecture (docs/performance.md).
extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK, CONV_PREFILL_BLOCKS_PER_SM)
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
    float* outputs = part < heads ? query : part < 2 * heads ? key : value;
    outputs += static_cast<size_t>(part % heads) * KDA_HEAD_DIM + 4 * (threadIdx.x & 31);
    // Both models' K is CONV_MAX_KERNEL: its own copy of the loop; any other K takes the general one.
    if (kernel_size == CONV_MAX_KERNEL) {
        conv_prefill_tile<CONV_MAX_KERNEL>(conv_state, qkv_proj, conv_w, conv_out, outputs, part, heads, kernel_size,
                                           tokens, l2_eps);
    } else {
        conv_prefill_tile<0>(conv_state, qkv_proj, conv_w, conv_out, outputs, part, heads, kernel_size, tokens, l2_eps);
    }
}
