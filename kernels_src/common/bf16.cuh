// BF16 storage without cuda_bf16.h (so NVRTC needs no CUDA headers): a value as its raw 16 bits,
// the upper half of the FP32 encoding.
#pragma once

typedef unsigned short bf16_t;

// Exact: every BF16 value is an FP32 value with 16 zero low bits.
__device__ __forceinline__ float bf16_to_f32(bf16_t value)
{
    return __uint_as_float(static_cast<unsigned int>(value) << 16);
}

// The low (half 0) or high (half 1) BF16 of a 32-bit word that packs two, as FP32 (exact).
__device__ __forceinline__ float bf16_half_to_f32(unsigned int word, int half)
{
    return __uint_as_float(half ? (word & 0xFFFF0000u) : (word << 16));
}

// Round to nearest, ties to even, bit-identical to ml_dtypes' float32 -> bfloat16 cast (the NumPy
// oracle's), overflow to infinity, subnormals kept, every NaN the canonical quiet NaN of its sign.
__device__ __forceinline__ bf16_t f32_to_bf16(float value)
{
    const unsigned int bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return static_cast<bf16_t>(((bits >> 16) & 0x8000u) | 0x7fc0u);
    }
    const unsigned int lsb = (bits >> 16) & 1u;
    return static_cast<bf16_t>((bits + 0x7fffu + lsb) >> 16);
}
