// Chunked (WY) prefill of the KDA delta rule on tensor cores (mma.sync m16n8k8, TF32 operands, FP32
// accumulation): the algorithm of chunk.cu in 16 x 16 blocks, C = 64, D = 128; tests/chunk_tc_model.py
// models it exactly. Numerics, padding, fragment layout, shared-memory maps and phases: docs/kernels.md,
// 'Tensor-core chunk kernels'. Launch: the prepare (nchunks, heads) x 256 threads, 104,704 B of
// dynamic shared memory; the scan (heads, D / 32) x 128 threads, 66,560 B.
#include "common/bf16.cuh"
#include "common/math.cuh"
#include "common/reduce.cuh"
#include "common/sync.cuh"

#define CHUNK_TC 64
#define CHUNK_TC_SUB 16
#define CHUNK_TC_SUBS (CHUNK_TC / CHUNK_TC_SUB)
// Smallest lower bound of the bounded gate law the exponent range argument allows.
#define CHUNK_TC_MIN_LOWER_BOUND (-5.0f)
#define CHUNK_TC_PREPARE_THREADS 256
#define CHUNK_TC_PREPARE_WARPS (CHUNK_TC_PREPARE_THREADS / 32)
// Rows of the cumulative gate whose loads a thread issues before adding them.
#define CHUNK_TC_CUMSUM_BATCH 16
#define CHUNK_TC_SCAN_COLUMNS 32
#define CHUNK_TC_SCAN_THREADS 128
// Row strides (floats) of the shared tiles: [*][D] and [*][C].
#define CHUNK_TC_D_STRIDE (KDA_HEAD_DIM + 4)
#define CHUNK_TC_C_STRIDE (CHUNK_TC + 4)
// Row stride (halves) of the scan's FP16 [C][D] tiles: 64 mod 128 bytes, conflict-free fragment loads.
#define CHUNK_TC_H_STRIDE (KDA_HEAD_DIM + 32)
// The prepare's shared memory: three units reused between phases, then beta.
#define CHUNK_TC_UNIT (KDA_HEAD_DIM * CHUNK_TC_C_STRIDE)
#define CHUNK_TC_PREPARE_SMEM_BYTES (4 * (3 * CHUNK_TC_UNIT + CHUNK_TC))
// float4 loads per thread to cover one [C][D] tile.
#define CHUNK_TC_TILE_LOADS (CHUNK_TC * KDA_HEAD_DIM / 4 / CHUNK_TC_PREPARE_THREADS)
#define CHUNK_TC_SCAN_SMEM_BYTES                                                              \
    (2 * 2 * CHUNK_TC * CHUNK_TC_H_STRIDE +                                                   \
     4 * (CHUNK_TC_SCAN_COLUMNS * CHUNK_TC_D_STRIDE + CHUNK_TC_SCAN_COLUMNS * CHUNK_TC_C_STRIDE))

// x rounded to TF32 as cvt.rna.tf32.f32 rounds, so that the mma sees exactly the model's round_tf32.
__device__ __forceinline__ float round_tf32(float x)
{
    const unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7f800000u) == 0x7f800000u) {
        return x;
    }
    return __uint_as_float((bits + 0x1000u) & 0xffffe000u);
}

// FP16 (raw bits) for the scan's operands: half the traffic, exact for TF32 values (docs/kernels.md).
typedef unsigned short f16_t;

__device__ __forceinline__ f16_t f32_to_f16(float x)
{
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

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

__device__ __forceinline__ void load8_f16(float out[8], const f16_t* pointer)
{
    const uint4 value = *reinterpret_cast<const uint4*>(pointer);
    const unsigned int words[4] = {value.x, value.y, value.z, value.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        out[2 * e] = f16_to_f32(static_cast<f16_t>(words[e] & 0xffffu));
        out[2 * e + 1] = f16_to_f32(static_cast<f16_t>(words[e] >> 16));
    }
}

// acc[16 x 8] += A[16 x 8] B[8 x 8], TF32 operands (already rounded), FP32 accumulate.
__device__ __forceinline__ void mma_tf32_m16n8k8(float acc[4], float a0, float a1, float a2,
                                                 float a3, float b0, float b1)
{
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(__float_as_uint(a0)), "r"(__float_as_uint(a1)), "r"(__float_as_uint(a2)),
          "r"(__float_as_uint(a3)), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

// One permuted k block of 8 STEPS (docs/kernels.md): a_low / a_high rows g and g + 8, b column g.
template <int STEPS>
__device__ __forceinline__ void mma_k_block(float acc[4], const float* a_low, const float* a_high,
                                            const float* b)
{
#pragma unroll
    for (int step = 0; step < STEPS; ++step) {
        mma_tf32_m16n8k8(acc, a_low[2 * step], a_high[2 * step], a_low[2 * step + 1],
                         a_high[2 * step + 1], b[2 * step], b[2 * step + 1]);
    }
}

__device__ __forceinline__ void load4(float out[4], const float* pointer)
{
    const float4 value = *reinterpret_cast<const float4*>(pointer);
    out[0] = value.x;
    out[1] = value.y;
    out[2] = value.z;
    out[3] = value.w;
}

__device__ __forceinline__ void load8(float out[8], const float* pointer)
{
    load4(out, pointer);
    load4(out + 4, pointer + 4);
}

template <int N>
__device__ __forceinline__ void round_tf32_all(float (&values)[N])
{
#pragma unroll
    for (int e = 0; e < N; ++e) {
        values[e] = round_tf32(values[e]);
    }
}

// The softplus law's gate (kda_forget_gate), called rather than inlined: its log1pf and expf, inlined
// 32 times a thread, would push the gate-forming unbounded prepare past the instruction cache.
__device__ __noinline__ float softplus_gate(float u, float a)
{
    return kda_forget_gate(u, a, false, 0.0f);
}

// The clamp makes the exponent range argument hold whatever the buffer holds; a NaN passes through.
__device__ __forceinline__ float clamp_gate(float g, float lower_bound)
{
    return g < lower_bound ? lower_bound : (g > 0.0f ? 0.0f : g);
}

// 16 bytes global -> shared, asynchronous (L2 only: the tile is read once per block).
__device__ __forceinline__ void copy_async_16B(void* shared_destination, const void* source)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(shared_destination)), "l"(source)
                 : "memory");
}

__device__ __forceinline__ void copy_async_commit()
{
    asm volatile("cp.async.commit_group;" ::: "memory");
}

__device__ __forceinline__ void copy_async_wait_all()
{
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}

// The A fragment rows g and g + 8 of a 16-k block (the lane's 4 k of each), rounded to TF32.
__device__ __forceinline__ void load4_pair_tf32(float a_low[4], float a_high[4], const float* low, const float* high)
{
    load4(a_low, low);
    load4(a_high, high);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        a_low[e] = round_tf32(a_low[e]);
        a_high[e] = round_tf32(a_high[e]);
    }
}

// T_ij = -T_ii sum_{j<=k<i} L_ik T_kj for one 16x16 block below the diagonal, by one warp.
__device__ __forceinline__ void inverse_block_below_diagonal(const float* lower_s, float* inverse_s,
                                                             int i, int j, int lane)
{
    const int group_lane = lane >> 2;
    const int thread_in_group = lane & 3;
    // This lane's A rows (block row i), its 4 k of a 16-k block, its B / C column.
    const float* lower_low =
        lower_s + (CHUNK_TC_SUB * i + group_lane) * CHUNK_TC_C_STRIDE + 4 * thread_in_group;
    const float* lower_high = lower_low + 8 * CHUNK_TC_C_STRIDE;
    const float* inverse_low = inverse_s + (lower_low - lower_s);
    const float* inverse_high = inverse_s + (lower_high - lower_s);
    float* block = inverse_s + CHUNK_TC_SUB * i * CHUNK_TC_C_STRIDE + CHUNK_TC_SUB * j;
    // C element e of n-tile n sits at block[accumulator_at + 8 n + c_offset(e)].
    const int accumulator_at = group_lane * CHUNK_TC_C_STRIDE + 2 * thread_in_group;

    float sum[2][4] = {};
    for (int k = j; k < i; ++k) {
        float a_low[4];
        float a_high[4];
        load4_pair_tf32(a_low, a_high, lower_low + CHUNK_TC_SUB * k, lower_high + CHUNK_TC_SUB * k);
        const float* inverse_kj = inverse_s + (CHUNK_TC_SUB * k + 4 * thread_in_group) * CHUNK_TC_C_STRIDE +
                                  CHUNK_TC_SUB * j + group_lane;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            float b[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                b[e] = round_tf32(inverse_kj[e * CHUNK_TC_C_STRIDE + 8 * n]);
            }
            mma_k_block<2>(sum[n], a_low, a_high, b);
        }
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            block[accumulator_at + (e >> 1) * 8 * CHUNK_TC_C_STRIDE + 8 * n + (e & 1)] = sum[n][e];
        }
    }
    __syncwarp();
    float x[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            x[n][e] = round_tf32(block[(4 * thread_in_group + e) * CHUNK_TC_C_STRIDE + 8 * n + group_lane]);
        }
    }
    // Every lane holds its X fragment before block (i, j) is overwritten with T_ij.
    __syncwarp();
    float a_low[4];
    float a_high[4];
    load4_pair_tf32(a_low, a_high, inverse_low + CHUNK_TC_SUB * i, inverse_high + CHUNK_TC_SUB * i);
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        float product[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_k_block<2>(product, a_low, a_high, x[n]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            block[accumulator_at + (e >> 1) * 8 * CHUNK_TC_C_STRIDE + 8 * n + (e & 1)] = -product[e];
        }
    }
}

// Eight q values of chunk row t (channels column .. column + 7), zero for a padding row (never read).
__device__ __forceinline__ void load_query_row8(float out[8], const float* __restrict__ query, int first, int t,
                                                int valid, size_t row_stride, size_t column)
{
    if (t < valid) {
        load8(out, query + static_cast<size_t>(first + t) * row_stride + column);
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            out[e] = 0.0f;
        }
    }
}

// e^x for a decay factor the prepare rounds to TF32 (10 mantissa bits) after one product: the hardware's
// ex2 of x log2(e), in fewer instructions than the accurate expf. Its error, a few FP32 ulps and about
// 3e-6 relative at the largest decays the prepare forms (e^75), stays far under TF32's half ulp (4.9e-4).
__device__ __forceinline__ float exp_tf32_factor(float x)
{
    return __expf(x);
}

// Transposing passes over a [C][D_STRIDE] tile, conflict free (docs/kernels.md). PASSES: a warp's steps.
#define CHUNK_TC_TRANSPOSE_STEPS ((CHUNK_TC / 16) * (KDA_HEAD_DIM / 8))
#define CHUNK_TC_TRANSPOSE_PASSES (CHUNK_TC_TRANSPOSE_STEPS / CHUNK_TC_PREPARE_WARPS)

// Row t and first channel d of this lane's 4 channels in step `step` of a transposing pass.
__device__ __forceinline__ void transpose_slot(int step, int lane, int& t, int& d)
{
    t = (step & 3) * 16 + (lane & 15);
    d = (step >> 2) * 8 + (lane >> 4) * 4;
}

// The widest decay across a diagonal block that the reference-row products take: that of a bound of -5.
#define CHUNK_TC_DIAGONAL_RANGE (-CHUNK_TC_MIN_LOWER_BOUND * (CHUNK_TC_SUB - 1))

// Whether diagonal block i is within CHUNK_TC_DIAGONAL_RANGE in every channel (warp-uniform; NaN: no).
__device__ __forceinline__ bool diagonal_in_range(const float* cumgate_s, int i, int lane)
{
    float first_row[4];
    float last_row[4];
    load4(first_row, cumgate_s + CHUNK_TC_SUB * i * CHUNK_TC_D_STRIDE + 4 * lane);
    load4(last_row, cumgate_s + (CHUNK_TC_SUB * i + CHUNK_TC_SUB - 1) * CHUNK_TC_D_STRIDE + 4 * lane);
    bool in_range = true;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        in_range = in_range && first_row[e] - last_row[e] <= CHUNK_TC_DIAGONAL_RANGE;
    }
    return __all_sync(KDA_FULL_WARP_MASK, in_range);
}

// Pairs s <= t of one 16 x 16 diagonal block.
#define CHUNK_TC_SUB_PAIRS (CHUNK_TC_SUB * (CHUNK_TC_SUB + 1) / 2)

// The diagonal blocks i with exact[i] set, of A and B, as exact FP32 sums by every thread (docs/kernels.md).
__device__ __forceinline__ void diagonal_blocks_exact(const float* key_s, const float* cumgate_s, const float* beta_s,
                                                      float* lower_s, f16_t* attn_block, const float* query,
                                                      int first, int valid, size_t row_stride, size_t head_offset,
                                                      float scale, const int* exact, int thread)
{
    for (int task = thread; task < CHUNK_TC_SUBS * CHUNK_TC_SUB_PAIRS; task += CHUNK_TC_PREPARE_THREADS) {
        const int i = task / CHUNK_TC_SUB_PAIRS;
        if (!exact[i]) {
            continue;
        }
        const int pair = task - i * CHUNK_TC_SUB_PAIRS;
        int row = 0;
        while ((row + 1) * (row + 2) / 2 <= pair) {
            ++row;
        }
        const int t = CHUNK_TC_SUB * i + row;
        const int s = CHUNK_TC_SUB * i + pair - row * (row + 1) / 2;
        const float* key_t = key_s + t * CHUNK_TC_D_STRIDE;
        const float* key_src = key_s + s * CHUNK_TC_D_STRIDE;
        const float* gate_t = cumgate_s + t * CHUNK_TC_D_STRIDE;
        const float* gate_src = cumgate_s + s * CHUNK_TC_D_STRIDE;
        const float* query_t = query + static_cast<size_t>(first + t) * row_stride + head_offset;
        const bool real = t < valid;
        float kk = 0.0f;
        float qk = 0.0f;
#pragma unroll 2
        for (int d = 0; d < KDA_HEAD_DIM; d += 4) {
            float key_row[4];
            float key_source[4];
            float gate_row[4];
            float gate_source[4];
            float query_row[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            load4(key_row, key_t + d);
            load4(key_source, key_src + d);
            load4(gate_row, gate_t + d);
            load4(gate_source, gate_src + d);
            if (real) {
                load4(query_row, query_t + d);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float decayed = key_source[e] * expf(gate_row[e] - gate_source[e]);
                kk = fmaf(key_row[e], decayed, kk);
                qk = fmaf(query_row[e], decayed, qk);
            }
        }
        lower_s[t * CHUNK_TC_C_STRIDE + s] = s < t ? beta_s[t] * kk : 0.0f;
        attn_block[t * CHUNK_TC + s] = f32_to_f16(round_tf32(scale * qk));
    }
    for (int index = thread; index < CHUNK_TC_SUBS * CHUNK_TC_SUB * CHUNK_TC_SUB; index += CHUNK_TC_PREPARE_THREADS) {
        const int base = CHUNK_TC_SUB * (index / (CHUNK_TC_SUB * CHUNK_TC_SUB));
        const int t = base + (index / CHUNK_TC_SUB) % CHUNK_TC_SUB;
        const int s = base + index % CHUNK_TC_SUB;
        if (s > t && exact[base / CHUNK_TC_SUB]) {
            lower_s[t * CHUNK_TC_C_STRIDE + s] = 0.0f;
            attn_block[t * CHUNK_TC + s] = f32_to_f16(0.0f);
        }
    }
}

// The prepare of every entry point. FUSED_GATE false: gate_in [T, H, D] and beta_in [T, H] are inputs.
// FUSED_GATE true: gate_out and beta_out are formed (the bounded law, or UNBOUNDED the softplus law;
// gate.cu's bits) from forget_proj [T, H*D] BF16, dt_bias [H*D], A_log [H] and the BF16 beta logits
// (row stride ld_beta); gate_out may be null (not written).
template <bool FUSED_GATE, bool UNBOUNDED = false>
__device__ __forceinline__ void chunk_tc_prepare(
    const float* __restrict__ query, const float* __restrict__ key, const float* __restrict__ value,
    const float* __restrict__ gate_in, const float* __restrict__ beta_in, float* __restrict__ gate_out,
    float* __restrict__ beta_out, f16_t* __restrict__ q_decay, f16_t* __restrict__ k_tail_t,
    f16_t* __restrict__ w, float* __restrict__ u, f16_t* __restrict__ attn, float* __restrict__ chunk_decay,
    int tokens, int heads, float scale, float lower_bound, const bf16_t* __restrict__ forget_proj,
    const float* __restrict__ dt_bias, const float* __restrict__ a_log, const bf16_t* __restrict__ beta_logits,
    int ld_beta)
{
    // Shared-memory map and phases: docs/kernels.md, 'Tensor-core prepare'.
    extern __shared__ __align__(16) float shared[];
    float* key_s = shared;
    float* cumgate_s = shared + CHUNK_TC_UNIT;
    float* lower_s = shared + 2 * CHUNK_TC_UNIT;
    float* inverse_s = lower_s + CHUNK_TC * CHUNK_TC_C_STRIDE;
    float* beta_s = shared + 3 * CHUNK_TC_UNIT;
    float* value_t_s = key_s;
    float* key_beta_t_s = cumgate_s;
    // UNBOUNDED: which diagonal blocks take the exact sums (set in phase 2).
    __shared__ int exact_s[CHUNK_TC_SUBS];

    const int chunk_index = blockIdx.x;
    const int head = blockIdx.y;
    const int thread = threadIdx.x;
    const int lane = thread & 31;
    const int warp = thread >> 5;
    const int group_lane = lane >> 2;
    const int thread_in_group = lane & 3;
    const int lane_k = 8 * thread_in_group;
    if (blockDim.x != CHUNK_TC_PREPARE_THREADS || tokens < 1 || head >= heads ||
        chunk_index >= (tokens + CHUNK_TC - 1) / CHUNK_TC ||
        !(UNBOUNDED || (lower_bound >= CHUNK_TC_MIN_LOWER_BOUND && lower_bound <= 0.0f))) {
        return;
    }
    // UNBOUNDED: any gate <= 0 (the softplus law); the clamp only caps g at 0.
    const float clamp_bound = UNBOUNDED ? -__uint_as_float(0x7f800000u) : lower_bound;
    const int first = chunk_index * CHUNK_TC;
    // Rows of this chunk that are real tokens; rows valid..C-1 are padding.
    const int valid = min(CHUNK_TC, tokens - first);
    const size_t row_stride = static_cast<size_t>(heads) * KDA_HEAD_DIM;
    const size_t head_offset = static_cast<size_t>(head) * KDA_HEAD_DIM;
    const size_t chunk_head = static_cast<size_t>(chunk_index) * heads + head;

    // 1. k and g (padding rows zero by index, every load before the first store), G, elementwise outputs.
    {
        float4 key_value[CHUNK_TC_TILE_LOADS];
        const int channel = (thread & 31) * 4;
        if (FUSED_GATE) {
            uint2 projected[CHUNK_TC_TILE_LOADS];
#pragma unroll
            for (int l = 0; l < CHUNK_TC_TILE_LOADS; ++l) {
                const int t = (thread + l * CHUNK_TC_PREPARE_THREADS) >> 5;
                key_value[l] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                projected[l] = make_uint2(0u, 0u);
                if (t < valid) {
                    const size_t at = static_cast<size_t>(first + t) * row_stride + head_offset + channel;
                    key_value[l] = *reinterpret_cast<const float4*>(key + at);
                    projected[l] = *reinterpret_cast<const uint2*>(forget_proj + at);
                }
            }
            const float a = expf(a_log[head]);
            float bias[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                bias[e] = dt_bias[head_offset + channel + e];
            }
#pragma unroll
            for (int l = 0; l < CHUNK_TC_TILE_LOADS; ++l) {
                const int t = (thread + l * CHUNK_TC_PREPARE_THREADS) >> 5;
                const unsigned int words[2] = {projected[l].x, projected[l].y};
                float g[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const bf16_t bits = static_cast<bf16_t>(e & 1 ? words[e >> 1] >> 16 : words[e >> 1] & 0xffffu);
                    const float u = bf16_to_f32(bits) + bias[e];
                    g[e] = UNBOUNDED ? softplus_gate(u, a) : kda_forget_gate(u, a, true, lower_bound);
                }
                float4 clamped = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (t < valid) {
                    if (gate_out != nullptr) {  // a stage buffer no later kernel reads: written on request
                        *reinterpret_cast<float4*>(gate_out + static_cast<size_t>(first + t) * row_stride +
                                                   head_offset + channel) = make_float4(g[0], g[1], g[2], g[3]);
                    }
                    clamped = make_float4(clamp_gate(g[0], clamp_bound), clamp_gate(g[1], clamp_bound),
                                          clamp_gate(g[2], clamp_bound), clamp_gate(g[3], clamp_bound));
                }
                *reinterpret_cast<float4*>(cumgate_s + t * CHUNK_TC_D_STRIDE + channel) = clamped;
            }
        } else {
            float4 gate_value[CHUNK_TC_TILE_LOADS];
#pragma unroll
            for (int l = 0; l < CHUNK_TC_TILE_LOADS; ++l) {
                const int t = (thread + l * CHUNK_TC_PREPARE_THREADS) >> 5;
                key_value[l] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                gate_value[l] = key_value[l];
                if (t < valid) {
                    const size_t at = static_cast<size_t>(first + t) * row_stride + head_offset + channel;
                    key_value[l] = *reinterpret_cast<const float4*>(key + at);
                    gate_value[l] = *reinterpret_cast<const float4*>(gate_in + at);
                }
            }
#pragma unroll
            for (int l = 0; l < CHUNK_TC_TILE_LOADS; ++l) {
                const int t = (thread + l * CHUNK_TC_PREPARE_THREADS) >> 5;
                const float4 g = gate_value[l];
                *reinterpret_cast<float4*>(cumgate_s + t * CHUNK_TC_D_STRIDE + channel) =
                    make_float4(clamp_gate(g.x, clamp_bound), clamp_gate(g.y, clamp_bound),
                                clamp_gate(g.z, clamp_bound), clamp_gate(g.w, clamp_bound));
            }
        }
#pragma unroll
        for (int l = 0; l < CHUNK_TC_TILE_LOADS; ++l) {
            const int t = (thread + l * CHUNK_TC_PREPARE_THREADS) >> 5;
            *reinterpret_cast<float4*>(key_s + t * CHUNK_TC_D_STRIDE + channel) = key_value[l];
        }
    }
    if (thread < CHUNK_TC) {
        float beta_t = 0.0f;
        if (thread < valid) {
            const size_t token = static_cast<size_t>(first + thread);
            if (FUSED_GATE) {
                beta_t = sigmoid_f32(bf16_to_f32(beta_logits[token * ld_beta + head]));
                beta_out[token * heads + head] = beta_t;
            } else {
                beta_t = beta_in[token * heads + head];
            }
        }
        beta_s[thread] = beta_t;
    }
    __syncthreads();

    if (thread < KDA_HEAD_DIM) {
        // Channel d: G_t = G_{t-1} + g_t in row order (the padded rows add zero), a batch of rows'
        // loads in flight before its additions.
        float running = 0.0f;
        float* column = cumgate_s + thread;
#pragma unroll
        for (int base = 0; base < CHUNK_TC; base += CHUNK_TC_CUMSUM_BATCH) {
            float g[CHUNK_TC_CUMSUM_BATCH];
#pragma unroll
            for (int r = 0; r < CHUNK_TC_CUMSUM_BATCH; ++r) {
                g[r] = column[(base + r) * CHUNK_TC_D_STRIDE];
            }
#pragma unroll
            for (int r = 0; r < CHUNK_TC_CUMSUM_BATCH; ++r) {
                running += g[r];
                column[(base + r) * CHUNK_TC_D_STRIDE] = running;
            }
        }
        chunk_decay[chunk_head * KDA_HEAD_DIM + thread] = expf(running);
    }
    __syncthreads();

    // q_decay = tf32(scale q exp(G)), row-major like the inputs, all loads of the thread first.
    {
        float4 query_value[CHUNK_TC_TILE_LOADS];
#pragma unroll
        for (int l = 0; l < CHUNK_TC_TILE_LOADS; ++l) {
            const int index = thread + l * CHUNK_TC_PREPARE_THREADS;
            const int t = index >> 5;
            const int d = (index & 31) * 4;
            query_value[l] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (t < valid) {
                query_value[l] = *reinterpret_cast<const float4*>(
                    query + static_cast<size_t>(first + t) * row_stride + head_offset + d);
            }
        }
#pragma unroll
        for (int l = 0; l < CHUNK_TC_TILE_LOADS; ++l) {
            const int index = thread + l * CHUNK_TC_PREPARE_THREADS;
            const int t = index >> 5;
            const int d = (index & 31) * 4;
            const float4 cumgate = *reinterpret_cast<const float4*>(cumgate_s + t * CHUNK_TC_D_STRIDE + d);
            float4 out;
            out.x = round_tf32(scale * query_value[l].x * exp_tf32_factor(cumgate.x));
            out.y = round_tf32(scale * query_value[l].y * exp_tf32_factor(cumgate.y));
            out.z = round_tf32(scale * query_value[l].z * exp_tf32_factor(cumgate.z));
            out.w = round_tf32(scale * query_value[l].w * exp_tf32_factor(cumgate.w));
            const size_t at = static_cast<size_t>(first + t) * row_stride + head_offset + d;
            uint2 packed;
            packed.x = pack_f16x2(out.x, out.y);
            packed.y = pack_f16x2(out.z, out.w);
            *reinterpret_cast<uint2*>(q_decay + at) = packed;
        }
    }
    // k_tail_t[chunk][head][d][s] = tf32(k_s exp(G_{C-1} - G_s)), transposed: the scan's A operand.
    {
        f16_t* tail_block = k_tail_t + chunk_head * KDA_HEAD_DIM * CHUNK_TC;
        const float* cumgate_last = cumgate_s + (CHUNK_TC - 1) * CHUNK_TC_D_STRIDE;
        for (int step = warp; step < CHUNK_TC_TRANSPOSE_STEPS; step += CHUNK_TC_PREPARE_WARPS) {
            int t, d;
            transpose_slot(step, lane, t, d);
            float key_value[4];
            float cumgate[4];
            float last[4];
            load4(key_value, key_s + t * CHUNK_TC_D_STRIDE + d);
            load4(cumgate, cumgate_s + t * CHUNK_TC_D_STRIDE + d);
            load4(last, cumgate_last + d);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                tail_block[(d + e) * CHUNK_TC + t] =
                    f32_to_f16(round_tf32(key_value[e] * exp_tf32_factor(last[e] - cumgate[e])));
            }
        }
    }
    // B above the diagonal blocks is zero: the scan reads whole 32-column halves of a row.
    f16_t* attn_block = attn + chunk_head * CHUNK_TC * CHUNK_TC;
    for (int index = thread; index < CHUNK_TC * CHUNK_TC / 4; index += CHUNK_TC_PREPARE_THREADS) {
        const int t = index >> 4;
        const int s = (index & 15) * 4;
        if (s >= (t / CHUNK_TC_SUB + 1) * CHUNK_TC_SUB) {
            *reinterpret_cast<uint2*>(attn_block + t * CHUNK_TC + s) = make_uint2(0u, 0u);
        }
    }

    // 2. Blocks (i, j), j <= i, of A and B, through the reference row r = 16 i (docs/maths.md, chunked form).
    for (int pair = warp; pair < CHUNK_TC_SUBS * (CHUNK_TC_SUBS + 1) / 2; pair += CHUNK_TC_PREPARE_WARPS) {
        const int i = (pair >= 1) + (pair >= 3) + (pair >= 6);
        const int j = pair - i * (i + 1) / 2;
        if (UNBOUNDED && i == j) {
            // Beyond the bounded range: the exact sums after the loop (warp-uniform).
            const bool exact = !diagonal_in_range(cumgate_s, i, lane);
            if (lane == 0) {
                exact_s[i] = exact;
            }
            if (exact) {
                continue;
            }
        }
        const int reference = CHUNK_TC_SUB * i;
        const int row_low = CHUNK_TC_SUB * i + group_lane;
        const int row_high = row_low + 8;
        float acc_kk[2][4] = {};
        float acc_qk[2][4] = {};
#pragma unroll 1
        for (int kb = 0; kb < KDA_HEAD_DIM / 32; ++kb) {
            const int d = 32 * kb + lane_k;
            float reference_gate[8];
            load8(reference_gate, cumgate_s + reference * CHUNK_TC_D_STRIDE + d);
            float key_low[8];
            float key_high[8];
            float query_low[8];
            float query_high[8];
            {
                float cumgate[8];
                load8(cumgate, cumgate_s + row_low * CHUNK_TC_D_STRIDE + d);
                load8(key_low, key_s + row_low * CHUNK_TC_D_STRIDE + d);
                load_query_row8(query_low, query, first, row_low, valid, row_stride, head_offset + d);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const float factor = exp_tf32_factor(cumgate[e] - reference_gate[e]);
                    key_low[e] = round_tf32(key_low[e] * factor);
                    query_low[e] = round_tf32(query_low[e] * factor);
                }
                load8(cumgate, cumgate_s + row_high * CHUNK_TC_D_STRIDE + d);
                load8(key_high, key_s + row_high * CHUNK_TC_D_STRIDE + d);
                load_query_row8(query_high, query, first, row_high, valid, row_stride, head_offset + d);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const float factor = exp_tf32_factor(cumgate[e] - reference_gate[e]);
                    key_high[e] = round_tf32(key_high[e] * factor);
                    query_high[e] = round_tf32(query_high[e] * factor);
                }
            }
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                const int source = CHUNK_TC_SUB * j + 8 * n + group_lane;
                float key_source[8];
                float cumgate[8];
                load8(key_source, key_s + source * CHUNK_TC_D_STRIDE + d);
                load8(cumgate, cumgate_s + source * CHUNK_TC_D_STRIDE + d);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    key_source[e] = round_tf32(key_source[e] * exp_tf32_factor(reference_gate[e] - cumgate[e]));
                }
                mma_k_block<4>(acc_kk[n], key_low, key_high, key_source);
                mma_k_block<4>(acc_qk[n], query_low, query_high, key_source);
            }
        }
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = row_low + 8 * (e >> 1);
                const int s = CHUNK_TC_SUB * j + 8 * n + 2 * thread_in_group + (e & 1);
                // A is strictly lower triangular, B keeps its diagonal.
                lower_s[t * CHUNK_TC_C_STRIDE + s] = s < t ? beta_s[t] * acc_kk[n][e] : 0.0f;
                attn_block[t * CHUNK_TC + s] = f32_to_f16(s <= t ? round_tf32(scale * acc_qk[n][e]) : 0.0f);
            }
        }
    }
    __syncthreads();
    if (UNBOUNDED && (exact_s[0] | exact_s[1] | exact_s[2] | exact_s[3])) {  // block-uniform
        diagonal_blocks_exact(key_s, cumgate_s, beta_s, lower_s, attn_block, query, first, valid,
                              row_stride, head_offset, scale, exact_s, thread);
        __syncthreads();
    }

    // v rows for value_t_s (phase 3), loaded now so that the diagonal inverse blocks hide their latency.
    float value_rows[CHUNK_TC_TRANSPOSE_PASSES][4];
#pragma unroll
    for (int pass = 0; pass < CHUNK_TC_TRANSPOSE_PASSES; ++pass) {
        const int step = warp + pass * CHUNK_TC_PREPARE_WARPS;
        int t, d;
        transpose_slot(step, lane, t, d);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            value_rows[pass][e] = 0.0f;
        }
        if (t < valid) {
            const size_t at = static_cast<size_t>(first + t) * row_stride + head_offset + d;
            const float4 v = *reinterpret_cast<const float4*>(value + at);
            value_rows[pass][0] = v.x;
            value_rows[pass][1] = v.y;
            value_rows[pass][2] = v.z;
            value_rows[pass][3] = v.w;
        }
    }

    // 3. T = (I + L)^-1. Diagonal blocks: FP32 forward substitution, warp i block i, lane c < 16 column c.
    if (warp < CHUNK_TC_SUBS) {
        const int base = CHUNK_TC_SUB * warp;
        const int column = lane & 15;
        float x[CHUNK_TC_SUB];
#pragma unroll
        for (int r = 0; r < CHUNK_TC_SUB; ++r) {
            float sum = 0.0f;
#pragma unroll
            for (int k = 0; k < r; ++k) {
                sum = fmaf(lower_s[(base + r) * CHUNK_TC_C_STRIDE + base + k], x[k], sum);
            }
            x[r] = r < column ? 0.0f : (r == column ? 1.0f : -sum);
        }
        if (lane < CHUNK_TC_SUB) {
#pragma unroll
            for (int r = 0; r < CHUNK_TC_SUB; ++r) {
                inverse_s[(base + r) * CHUNK_TC_C_STRIDE + base + column] = x[r];
            }
        }
    } else {
        // T is zero above the diagonal blocks (phase 4 reads whole 32-column halves).
        for (int index = thread - 32 * CHUNK_TC_SUBS; index < CHUNK_TC * CHUNK_TC / 4;
             index += CHUNK_TC_PREPARE_THREADS - 32 * CHUNK_TC_SUBS) {
            const int t = index >> 4;
            const int s = (index & 15) * 4;
            if (s >= (t / CHUNK_TC_SUB + 1) * CHUNK_TC_SUB) {
                *reinterpret_cast<float4*>(inverse_s + t * CHUNK_TC_C_STRIDE + s) =
                    make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
    }
    // key_beta_t_s = tf32(beta k exp(G))^T over the G tile, held in registers across the barrier.
    {
        float key_beta[CHUNK_TC_TRANSPOSE_PASSES][4];
#pragma unroll
        for (int pass = 0; pass < CHUNK_TC_TRANSPOSE_PASSES; ++pass) {
            const int step = warp + pass * CHUNK_TC_PREPARE_WARPS;
            int t, d;
            transpose_slot(step, lane, t, d);
            float key_value[4];
            float cumgate[4];
            load4(key_value, key_s + t * CHUNK_TC_D_STRIDE + d);
            load4(cumgate, cumgate_s + t * CHUNK_TC_D_STRIDE + d);
            const float beta_t = beta_s[t];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                key_beta[pass][e] = round_tf32(beta_t * key_value[e] * exp_tf32_factor(cumgate[e]));
            }
        }
        __syncthreads();
#pragma unroll
        for (int pass = 0; pass < CHUNK_TC_TRANSPOSE_PASSES; ++pass) {
            const int step = warp + pass * CHUNK_TC_PREPARE_WARPS;
            int t, d;
            transpose_slot(step, lane, t, d);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                key_beta_t_s[(d + e) * CHUNK_TC_C_STRIDE + t] = key_beta[pass][e];
            }
        }
    }
    __syncthreads();

    // Off-diagonal blocks in waves by distance from the diagonal; rolled, to fit the instruction cache.
#pragma unroll 1
    for (int distance = 1; distance < CHUNK_TC_SUBS; ++distance) {
        if (warp < CHUNK_TC_SUBS - distance) {
            inverse_block_below_diagonal(lower_s, inverse_s, warp + distance, warp, lane);
        }
        if (distance == 1) {
            // value_t_s = tf32(beta v)^T over the dead key tile (last read before the barrier).
#pragma unroll
            for (int pass = 0; pass < CHUNK_TC_TRANSPOSE_PASSES; ++pass) {
                const int step = warp + pass * CHUNK_TC_PREPARE_WARPS;
                int t, d;
                transpose_slot(step, lane, t, d);
                const float beta_t = beta_s[t];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    value_t_s[(d + e) * CHUNK_TC_C_STRIDE + t] = round_tf32(beta_t * value_rows[pass][e]);
                }
            }
        }
        __syncthreads();
    }

    // 4. W = T key_beta (warps 0-3) and Uc = T value_beta (warps 4-7); rows < 32 skip the tokens >= 32.
    {
        const bool is_value = warp >= 4;
        const float* operand_t = is_value ? value_t_s : key_beta_t_s;
        const int d_base = 32 * (warp & 3);
        float acc[4][4][4] = {};
#pragma unroll
        for (int kb = 0; kb < CHUNK_TC / 32; ++kb) {
            float b[4][8];
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                load8(b[n], operand_t + (d_base + 8 * n + group_lane) * CHUNK_TC_C_STRIDE + 32 * kb + lane_k);
            }
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                if (kb == 1 && m < 2) {
                    continue;
                }
                float a_low[8];
                float a_high[8];
                load8(a_low, inverse_s + (16 * m + group_lane) * CHUNK_TC_C_STRIDE + 32 * kb + lane_k);
                load8(a_high, inverse_s + (16 * m + group_lane + 8) * CHUNK_TC_C_STRIDE + 32 * kb + lane_k);
                round_tf32_all(a_low);
                round_tf32_all(a_high);
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    mma_k_block<4>(acc[m][n], a_low, a_high, b[n]);
                }
            }
        }
        // W as FP16 (the scan's mma operand), Uc as FP32. Padding rows store zeros by a select.
        const size_t lane_at = static_cast<size_t>(first + group_lane) * row_stride + head_offset + d_base +
                               2 * thread_in_group;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int t = 16 * m + group_lane + 8 * half;
                const size_t row_at = lane_at + static_cast<size_t>(16 * m + 8 * half) * row_stride;
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    const float low = t < valid ? acc[m][n][2 * half] : 0.0f;
                    const float high = t < valid ? acc[m][n][2 * half + 1] : 0.0f;
                    if (is_value) {
                        *reinterpret_cast<float2*>(u + row_at + 8 * n) = make_float2(low, high);
                    } else {
                        *reinterpret_cast<unsigned int*>(w + row_at + 8 * n) =
                            pack_f16x2(round_tf32(low), round_tf32(high));
                    }
                }
            }
        }
    }
}

// The prepare's entry points, one a file. CHUNK_TC_PREPARE_ENTRY reads gate and beta,
// CHUNK_TC_PREPARE_GATE_ENTRY forms and writes them (chunk_tc_prepare's contract); UNBOUNDED: any gate
// <= 0 (the softplus law), lower_bound unread.
#define CHUNK_TC_PREPARE_ENTRY(NAME, UNBOUNDED)                                                        \
    extern "C" __global__ void __launch_bounds__(CHUNK_TC_PREPARE_THREADS, 2)                              \
        NAME(const float* __restrict__ query, const float* __restrict__ key, const float* __restrict__ value, \
             const float* __restrict__ gate, const float* __restrict__ beta, f16_t* __restrict__ q_decay,  \
             f16_t* __restrict__ k_tail_t, f16_t* __restrict__ w, float* __restrict__ u,                  \
             f16_t* __restrict__ attn, float* __restrict__ chunk_decay, int tokens, int heads, float scale, \
             float lower_bound)                                                                           \
    {                                                                                                      \
        chunk_tc_prepare<false, UNBOUNDED>(query, key, value, gate, beta, nullptr, nullptr,  \
                                           q_decay, k_tail_t, w, u, attn, chunk_decay, tokens, heads,     \
                                           scale, lower_bound, nullptr, nullptr, nullptr, nullptr, 0);    \
    }
#define CHUNK_TC_PREPARE_GATE_ENTRY(NAME, UNBOUNDED)                                                       \
    extern "C" __global__ void __launch_bounds__(CHUNK_TC_PREPARE_THREADS, 2)                              \
        NAME(const float* __restrict__ query, const float* __restrict__ key, const float* __restrict__ value, \
             float* __restrict__ gate, float* __restrict__ beta, f16_t* __restrict__ q_decay,              \
             f16_t* __restrict__ k_tail_t, f16_t* __restrict__ w, float* __restrict__ u,                  \
             f16_t* __restrict__ attn, float* __restrict__ chunk_decay, int tokens, int heads, float scale, \
             float lower_bound, const bf16_t* __restrict__ forget_proj, const float* __restrict__ dt_bias, \
             const float* __restrict__ a_log, const bf16_t* __restrict__ beta_logits, int ld_beta)        \
    {                                                                                                      \
        chunk_tc_prepare<true, UNBOUNDED>(query, key, value, nullptr, nullptr, gate, beta, q_decay, k_tail_t, \
                                          w, u, attn, chunk_decay, tokens, heads, scale, lower_bound,      \
                                          forget_proj, dt_bias, a_log, beta_logits, ld_beta);              \
    }
