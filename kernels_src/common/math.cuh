// Scalar activations shared by the kernels, one definition each so every kernel that forms a
// value forms the same bits.
#pragma once

__device__ __forceinline__ float sigmoid_f32(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

// The forget gate's law, the kernels' `gate_law` parameter (glm_kda.gpu.ops.gate's _GATE_* match).
enum KdaGateLaw : int {
    KDA_GATE_SOFTPLUS = 0,  // gate = -exp(A_log) softplus(u)
    KDA_GATE_BOUNDED = 1,   // gate = lower_bound sigmoid(exp(A_log) u)
};

// Above this the softplus equals its argument to FP32 precision (the reference implementations' threshold).
#define KDA_SOFTPLUS_THRESHOLD 20.0f

// The forget gate's log-decay of one channel: u = forget_proj + dt_bias (FP32), a = exp(A_log[head]).
__device__ __forceinline__ float kda_forget_gate(float u, float a, bool bounded, float lower_bound)
{
    if (bounded) {
        // lower_bound * sigmoid(a u). __fdividef, not the IEEE division: the fused-gate prepare evaluates
        // this 32 times a thread, and each IEEE division brings its own slow-path call.
        return __fdividef(lower_bound, 1.0f + expf(-(a * u)));
    }
    const float softplus = (u > KDA_SOFTPLUS_THRESHOLD) ? u : log1pf(expf(u));
    return -a * softplus;
}
