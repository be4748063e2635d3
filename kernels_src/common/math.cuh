// Scalar activations shared by the kernels, one definition each so every kernel that forms a
// value forms the same bits.
#ifndef KDA_COMMON_MATH_CUH
#define KDA_COMMON_MATH_CUH

__device__ __forceinline__ float sigmoid_f32(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

// The forget gate's law, as the kernels' `gate_law` parameter takes it (glm_kda.gpu.ops.gate's
// _GATE_SOFTPLUS / _GATE_BOUNDED).
enum KdaGateLaw : int {
    KDA_GATE_SOFTPLUS = 0,  // gate = -exp(A_log) softplus(u)
    KDA_GATE_BOUNDED = 1,   // gate = lower_bound sigmoid(exp(A_log) u)
};

// Above this the softplus equals its argument to FP32 precision (the reference implementations' threshold).
#define KDA_SOFTPLUS_THRESHOLD 20.0f

// The forget gate's log-decay of one channel: u = forget_proj + dt_bias (FP32), a = exp(A_log[head]).
// One definition for every kernel that forms it, so they agree bit for bit.
__device__ __forceinline__ float kda_forget_gate(float u, float a, bool bounded, float lower_bound)
{
    if (bounded) {
        // lower_bound * sigmoid(a u). __fdividef (reciprocal and product, 2 ulp), not the IEEE
        // division: the prepare that forms the gate inline evaluates this 32 times a thread, and
        // every IEEE division brings its own call of the slow path.
        return __fdividef(lower_bound, 1.0f + expf(-(a * u)));
    }
    const float softplus = (u > KDA_SOFTPLUS_THRESHOLD) ? u : log1pf(expf(u));
    return -a * softplus;
}

#endif  // KDA_COMMON_MATH_CUH
