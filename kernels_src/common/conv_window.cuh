// The causal conv of one channel, one definition for the prefill conv (conv.cu) and the fused decode
// step, so both agree bit for bit: a window of the last K <= CONV_MAX_KERNEL inputs, oldest in slot 0,
// kept in registers (compile-time indices only).
#pragma once

#include "common/bf16.cuh"

#define CONV_MAX_KERNEL 4

// Shift the window left by one and put `input` in slot kernel_size - 1.
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

// The first K of CONV_MAX_KERNEL values from `stored` (slots K.. zero): stored inputs or conv taps.
template <class T>
__device__ __forceinline__ void conv_slots_load(T (&slots)[CONV_MAX_KERNEL], const T* stored, int kernel_size)
{
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        slots[j] = T(0);
        if (j < kernel_size) {
            slots[j] = stored[j];
        }
    }
}

// The window back to the K stored inputs of a channel (conv_slots_load reads them).
__device__ __forceinline__ void conv_window_store(const float window[CONV_MAX_KERNEL], float* stored,
                                                  int kernel_size)
{
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j < kernel_size) {
            stored[j] = window[j];
        }
    }
}

// silu( sum_j taps[j] * window[j] ), FP32 fma in ascending j, the taps (BF16 values) already FP32 in registers.
__device__ __forceinline__ float conv_silu_f32_taps(const float window[CONV_MAX_KERNEL],
                                                    const float taps[CONV_MAX_KERNEL], int kernel_size)
{
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        if (j < kernel_size) {
            acc = fmaf(taps[j], window[j], acc);
        }
    }
    return acc / (1.0f + expf(-acc));
}

// The BF16 taps of a channel widened to FP32 (exact), slots K.. zero.
__device__ __forceinline__ void conv_taps_f32(float (&taps)[CONV_MAX_KERNEL], const bf16_t* stored, int kernel_size)
{
    bf16_t loaded[CONV_MAX_KERNEL];
    conv_slots_load(loaded, stored, kernel_size);
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        taps[j] = bf16_to_f32(loaded[j]);
    }
}

// conv_silu_f32_taps with BF16 taps in registers.
__device__ __forceinline__ float conv_silu_taps(const float window[CONV_MAX_KERNEL],
                                                const bf16_t taps[CONV_MAX_KERNEL], int kernel_size)
{
    float wide[CONV_MAX_KERNEL];
#pragma unroll
    for (int j = 0; j < CONV_MAX_KERNEL; ++j) {
        wide[j] = bf16_to_f32(taps[j]);
    }
    return conv_silu_f32_taps(window, wide, kernel_size);
}
