// FP16 storage without cuda_fp16.h (so NVRTC needs no CUDA headers): a value as its raw 16 bits.
#pragma once

typedef unsigned short f16_t;

// Round to nearest, ties to even (NumPy's float32 -> float16 cast).
__device__ __forceinline__ f16_t f32_to_f16(float x)
{
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// Exact: every FP16 value is an FP32 value.
__device__ __forceinline__ float f16_to_f32(f16_t h)
{
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}

__device__ __forceinline__ unsigned int pack_f16x2(float low, float high)
{
    return static_cast<unsigned int>(f32_to_f16(low)) | (static_cast<unsigned int>(f32_to_f16(high)) << 16);
}
