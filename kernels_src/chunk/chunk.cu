// Chunked (WY) prefill of the KDA delta rule in FP32, any chunk of 1..64 tokens: the reference path.
// kda_chunk_prepare_f32 forms each chunk's A, B, W, Uc and decays, kda_chunk_scan_f32 walks the chunks
// (docs/maths.md, the chunked form). Only G_t - G_s with s <= t is exponentiated, so nothing overflows.
// Padded rows of the last chunk are zero by index before any read.
// Launch, shared-memory map and the scan's equations: docs/kernels.md, 'FP32 chunk kernels'.
#include "common/head.cuh"

#define CHUNK_MAX 64
#define SCAN_COLUMNS 32
// Row stride of the [C][D] shared tiles, padded so that one channel of different rows hits different banks.
#define CHUNK_TILE_STRIDE (KDA_HEAD_DIM + 1)

extern "C" __global__ void __launch_bounds__(KDA_HEAD_BLOCK)
kda_chunk_prepare_f32(const float* __restrict__ query, const float* __restrict__ key,
                      const float* __restrict__ value, const float* __restrict__ gate,
                      const float* __restrict__ beta, float* __restrict__ q_decay,
                      float* __restrict__ k_tail, float* __restrict__ w, float* __restrict__ u,
                      float* __restrict__ attn, float* __restrict__ chunk_decay, int tokens,
                      int heads, int chunk, float scale)
{
    // key_s (k, then Uc), query_s (q, then W), cumgate_s (G), pair_s (A), beta_s: docs/kernels.md.
    extern __shared__ float shared[];

    const int chunk_index = blockIdx.x;
    const int head = blockIdx.y;
    const int d = threadIdx.x;
    if (blockDim.x != KDA_HEAD_BLOCK || chunk < 1 || chunk > CHUNK_MAX || tokens < 1 ||
        head >= heads || chunk_index >= (tokens + chunk - 1) / chunk) {
        return;
    }

    float* key_s = shared;
    float* query_s = key_s + chunk * CHUNK_TILE_STRIDE;
    float* cumgate_s = query_s + chunk * CHUNK_TILE_STRIDE;
    float* pair_s = cumgate_s + chunk * CHUNK_TILE_STRIDE;
    float* beta_s = pair_s + chunk * chunk;

    const int first = chunk_index * chunk;
    // Rows of this chunk that are real tokens; rows valid..chunk-1 are padding.
    const int valid = min(chunk, tokens - first);
    const size_t row_stride = static_cast<size_t>(heads) * KDA_HEAD_DIM;
    const size_t head_offset = static_cast<size_t>(head) * KDA_HEAD_DIM;

    // Channel d: load the chunk, cumulative gate, q_decay.
    float cumgate = 0.0f;
    for (int t = 0; t < chunk; ++t) {
        const size_t index = static_cast<size_t>(first + t) * row_stride + head_offset + d;
        float key_value = 0.0f;
        float query_value = 0.0f;
        if (t < valid) {
            key_value = key[index];
            query_value = query[index];
            cumgate += gate[index];
        }
        key_s[t * CHUNK_TILE_STRIDE + d] = key_value;
        query_s[t * CHUNK_TILE_STRIDE + d] = query_value;
        cumgate_s[t * CHUNK_TILE_STRIDE + d] = cumgate;
        q_decay[index] = (t < valid) ? scale * query_value * expf(cumgate) : 0.0f;
    }
    // cumgate is now G_{C-1}[d]; the padded rows added nothing.
    const float cumgate_last = cumgate;
    chunk_decay[(static_cast<size_t>(chunk_index) * heads + head) * KDA_HEAD_DIM + d] =
        expf(cumgate_last);
    for (int t = d; t < chunk; t += blockDim.x) {
        beta_s[t] = (t < valid) ? beta[static_cast<size_t>(first + t) * heads + head] : 0.0f;
    }
    __syncthreads();

    // Pair sums A[t][s] and B[t][s], one (t, s) pair per thread at a time, d ascending.
    float* attn_block = attn + (static_cast<size_t>(chunk_index) * heads + head) * chunk * chunk;
    for (int pair = d; pair < chunk * chunk; pair += blockDim.x) {
        const int t = pair / chunk;
        const int s = pair - t * chunk;
        float a_sum = 0.0f;
        float b_sum = 0.0f;
        if (s <= t && t < valid) {
            const float* key_t = key_s + t * CHUNK_TILE_STRIDE;
            const float* key_src = key_s + s * CHUNK_TILE_STRIDE;
            const float* query_t = query_s + t * CHUNK_TILE_STRIDE;
            const float* cumgate_t = cumgate_s + t * CHUNK_TILE_STRIDE;
            const float* cumgate_src = cumgate_s + s * CHUNK_TILE_STRIDE;
            for (int i = 0; i < KDA_HEAD_DIM; ++i) {
                const float key_decayed = key_src[i] * expf(cumgate_t[i] - cumgate_src[i]);
                a_sum = fmaf(key_t[i], key_decayed, a_sum);
                b_sum = fmaf(query_t[i], key_decayed, b_sum);
            }
            b_sum *= scale;
            if (s == t) {
                // A is strictly lower triangular; only B keeps its diagonal.
                a_sum = 0.0f;
            }
        }
        pair_s[pair] = a_sum;
        attn_block[pair] = b_sum;
    }
    __syncthreads();

    // Forward substitution, independent per channel: thread d reads only column d of W / Uc, which it
    // wrote itself. Row t of query_s / key_s is overwritten by W_t / Uc_t once q_t / k_t is read.
    for (int t = 0; t < chunk; ++t) {
        const size_t index = static_cast<size_t>(first + t) * row_stride + head_offset + d;
        if (t >= valid) {
            k_tail[index] = 0.0f;
            w[index] = 0.0f;
            u[index] = 0.0f;
            continue;
        }
        const float key_value = key_s[t * CHUNK_TILE_STRIDE + d];
        const float cumgate_t = cumgate_s[t * CHUNK_TILE_STRIDE + d];
        const float beta_t = beta_s[t];
        k_tail[index] = key_value * expf(cumgate_last - cumgate_t);

        const float* pair_row = pair_s + t * chunk;
        float w_sum = 0.0f;
        float u_sum = 0.0f;
        for (int s = 0; s < t; ++s) {
            const float a = pair_row[s];
            w_sum = fmaf(a, query_s[s * CHUNK_TILE_STRIDE + d], w_sum);
            u_sum = fmaf(a, key_s[s * CHUNK_TILE_STRIDE + d], u_sum);
        }
        const float w_t = beta_t * (key_value * expf(cumgate_t) - w_sum);
        const float u_t = beta_t * (value[index] - u_sum);
        query_s[t * CHUNK_TILE_STRIDE + d] = w_t;
        key_s[t * CHUNK_TILE_STRIDE + d] = u_t;
        w[index] = w_t;
        u[index] = u_t;
    }
}

// sum_i row[i] * s[i], i ascending. `row` is 16-byte aligned (a [*, D] FP32 row).
__device__ __forceinline__ float dot_row_column(const float* __restrict__ row,
                                                const float s[KDA_HEAD_DIM])
{
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < KDA_HEAD_DIM; i += 4) {
        const float4 r = *reinterpret_cast<const float4*>(row + i);
        acc = fmaf(r.x, s[i], acc);
        acc = fmaf(r.y, s[i + 1], acc);
        acc = fmaf(r.z, s[i + 2], acc);
        acc = fmaf(r.w, s[i + 3], acc);
    }
    return acc;
}

extern "C" __global__ void __launch_bounds__(SCAN_COLUMNS)
kda_chunk_scan_f32(const float* __restrict__ q_decay, const float* __restrict__ k_tail,
                   const float* __restrict__ w, const float* __restrict__ u,
                   const float* __restrict__ attn, const float* __restrict__ chunk_decay,
                   float* __restrict__ state, float* __restrict__ core, int tokens, int heads,
                   int chunk, int nchunks)
{
    // u_tile[t][lane] = U_t[v]: each lane only touches its own column.
    __shared__ float u_tile[CHUNK_MAX][SCAN_COLUMNS];

    const int head = blockIdx.x;
    const int lane = threadIdx.x;
    if (blockDim.x != SCAN_COLUMNS || blockIdx.y >= KDA_HEAD_DIM / SCAN_COLUMNS ||
        head >= heads || chunk < 1 || chunk > CHUNK_MAX || tokens < 1 ||
        nchunks != (tokens + chunk - 1) / chunk) {
        return;
    }
    const int column = blockIdx.y * SCAN_COLUMNS + lane;
    const size_t row_stride = static_cast<size_t>(heads) * KDA_HEAD_DIM;
    const size_t head_offset = static_cast<size_t>(head) * KDA_HEAD_DIM;

    float* state_column = state + head_offset * KDA_HEAD_DIM + column;
    float s[KDA_HEAD_DIM];
#pragma unroll
    for (int i = 0; i < KDA_HEAD_DIM; ++i) {
        s[i] = state_column[static_cast<size_t>(i) * KDA_HEAD_DIM];
    }

    for (int chunk_index = 0; chunk_index < nchunks; ++chunk_index) {
        const int first = chunk_index * chunk;
        // Padded rows valid..chunk-1 are never read: they contribute nothing.
        const int valid = min(chunk, tokens - first);

        // U_t = Uc_t - W_t^T S0.
        for (int t = 0; t < valid; ++t) {
            const size_t row = static_cast<size_t>(first + t) * row_stride + head_offset;
            u_tile[t][lane] = u[row + column] - dot_row_column(w + row, s);
        }

        // o_t = q_decay_t^T S0 + sum_{s<=t} B[t][s] U_s.
        const float* attn_block =
            attn + (static_cast<size_t>(chunk_index) * heads + head) * chunk * chunk;
        for (int t = 0; t < valid; ++t) {
            const size_t row = static_cast<size_t>(first + t) * row_stride + head_offset;
            float out = dot_row_column(q_decay + row, s);
            const float* attn_row = attn_block + t * chunk;
            for (int src = 0; src <= t; ++src) {
                out = fmaf(attn_row[src], u_tile[src][lane], out);
            }
            core[row + column] = out;
        }

        // S_new = diag(chunk_decay) S0 + sum_s k_tail_s U_s^T.
        const float* decay =
            chunk_decay + (static_cast<size_t>(chunk_index) * heads + head) * KDA_HEAD_DIM;
#pragma unroll
        for (int i = 0; i < KDA_HEAD_DIM; i += 4) {
            const float4 factor = *reinterpret_cast<const float4*>(decay + i);
            s[i] *= factor.x;
            s[i + 1] *= factor.y;
            s[i + 2] *= factor.z;
            s[i + 3] *= factor.w;
        }
        for (int src = 0; src < valid; ++src) {
            const float u_value = u_tile[src][lane];
            const float* tail_row =
                k_tail + static_cast<size_t>(first + src) * row_stride + head_offset;
#pragma unroll
            for (int i = 0; i < KDA_HEAD_DIM; i += 4) {
                const float4 tail = *reinterpret_cast<const float4*>(tail_row + i);
                s[i] = fmaf(tail.x, u_value, s[i]);
                s[i + 1] = fmaf(tail.y, u_value, s[i + 1]);
                s[i + 2] = fmaf(tail.z, u_value, s[i + 2]);
                s[i + 3] = fmaf(tail.w, u_value, s[i + 3]);
            }
        }
    }

#pragma unroll
    for (int i = 0; i < KDA_HEAD_DIM; ++i) {
        state_column[static_cast<size_t>(i) * KDA_HEAD_DIM] = s[i];
    }
}
