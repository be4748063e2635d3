// The tensor-core chunked prefill's kernels: the prepare (bounded and unbounded gate laws, gate and
// beta read) and the scan across chunks. Launch, shared memory and numerics: chunk_tc.cuh.
#include "chunk/chunk_tc.cuh"

CHUNK_TC_PREPARE_ENTRY(kda_chunk_tc_prepare_f32, false)
CHUNK_TC_PREPARE_ENTRY(kda_chunk_tc_prepare_unbounded_f32, true)

// The scan's W and q_decay tiles of chunk `chunk_index` into shared memory, asynchronously.
__device__ __forceinline__ void copy_chunk_rows_async(f16_t* w_s, f16_t* q_s, const f16_t* w,
                                                      const f16_t* q_decay, int chunk_index,
                                                      size_t row_stride, size_t head_offset)
{
    for (int index = threadIdx.x; index < 2 * CHUNK_TC * KDA_HEAD_DIM / 8; index += CHUNK_TC_SCAN_THREADS) {
        const int matrix = index / (CHUNK_TC * KDA_HEAD_DIM / 8);
        const int rest = index - matrix * (CHUNK_TC * KDA_HEAD_DIM / 8);
        const int t = rest >> 4;
        const int d = (rest & 15) * 8;
        const size_t at = static_cast<size_t>(chunk_index * CHUNK_TC + t) * row_stride + head_offset + d;
        copy_async_16B((matrix == 0 ? w_s : q_s) + t * CHUNK_TC_H_STRIDE + d, (matrix == 0 ? w : q_decay) + at);
    }
    copy_async_commit();
}

// This lane's Uc of chunk `chunk_index`: rows row_low and row_low + 8, 2 columns from `column` + 8 n.
__device__ __forceinline__ void load_chunk_uc(float uc[4][4], const float* u, int chunk_index, int row_low,
                                              size_t row_stride, size_t column)
{
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float2 pair_value = *reinterpret_cast<const float2*>(
                u + static_cast<size_t>(chunk_index * CHUNK_TC + row_low + 8 * half) * row_stride + column + 8 * n);
            uc[n][2 * half] = pair_value.x;
            uc[n][2 * half + 1] = pair_value.y;
        }
    }
}

extern "C" __global__ void __launch_bounds__(CHUNK_TC_SCAN_THREADS, 2)
kda_chunk_tc_scan_f32(const f16_t* __restrict__ q_decay, const f16_t* __restrict__ k_tail_t,
                      const f16_t* __restrict__ w, const float* __restrict__ u,
                      const f16_t* __restrict__ attn, const float* __restrict__ chunk_decay,
                      float* __restrict__ state, float* __restrict__ core, int tokens, int heads)
{
    // w_s, q_s: the chunk's W, q_decay; state_t_s: tf32(S0)^T; u_t_s: tf32(U)^T (docs/kernels.md).
    extern __shared__ __align__(16) float shared[];
    f16_t* w_s = reinterpret_cast<f16_t*>(shared);
    f16_t* q_s = w_s + CHUNK_TC * CHUNK_TC_H_STRIDE;
    float* state_t_s = shared + CHUNK_TC * CHUNK_TC_H_STRIDE;
    float* u_t_s = state_t_s + CHUNK_TC_SCAN_COLUMNS * CHUNK_TC_D_STRIDE;

    const int head = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int group_lane = lane >> 2;
    const int thread_in_group = lane & 3;
    const int lane_k = 8 * thread_in_group;
    if (blockDim.x != CHUNK_TC_SCAN_THREADS || blockIdx.y >= KDA_HEAD_DIM / CHUNK_TC_SCAN_COLUMNS ||
        head >= heads || tokens < 1) {
        return;
    }
    const int nchunks = (tokens + CHUNK_TC - 1) / CHUNK_TC;
    const int column_base = blockIdx.y * CHUNK_TC_SCAN_COLUMNS;
    const size_t row_stride = static_cast<size_t>(heads) * KDA_HEAD_DIM;
    const size_t head_offset = static_cast<size_t>(head) * KDA_HEAD_DIM;
    // Phase A rows of this warp (chunk rows) and state rows it owns (key channels).
    const int row_low = 16 * warp + group_lane;
    const int state_row = 32 * warp + group_lane;

    // The block's state columns, FP32, in the accumulator layout of k_tail^T U.
    float* state_head = state + head_offset * KDA_HEAD_DIM;
    float state_acc[2][4][4];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = state_row + 16 * m + 8 * half;
                const int column = 8 * n + 2 * thread_in_group;
                const float2 pair_value = *reinterpret_cast<const float2*>(
                    state_head + static_cast<size_t>(row) * KDA_HEAD_DIM + column_base + column);
                state_acc[m][n][2 * half] = pair_value.x;
                state_acc[m][n][2 * half + 1] = pair_value.y;
                state_t_s[column * CHUNK_TC_D_STRIDE + row] = round_tf32(pair_value.x);
                state_t_s[(column + 1) * CHUNK_TC_D_STRIDE + row] = round_tf32(pair_value.y);
            }
        }
    }
    copy_chunk_rows_async(w_s, q_s, w, q_decay, 0, row_stride, head_offset);
    const size_t uc_column = head_offset + column_base + 2 * thread_in_group;
    float u_ahead[4][4];
    load_chunk_uc(u_ahead, u, 0, row_low, row_stride, uc_column);

    for (int chunk_index = 0; chunk_index < nchunks; ++chunk_index) {
        const int first = chunk_index * CHUNK_TC;
        const int valid = min(CHUNK_TC, tokens - first);
        const size_t chunk_head = static_cast<size_t>(chunk_index) * heads + head;

        // U = Uc - W S0 accumulates onto Uc (mma with -W; TF32 negation is exact); the next chunk's Uc is
        // loaded now, a chunk before phase A starts from it.
        float u_acc[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                u_acc[n][e] = u_ahead[n][e];
            }
        }
        if (chunk_index + 1 < nchunks) {
            load_chunk_uc(u_ahead, u, chunk_index + 1, row_low, row_stride, uc_column);
        }

        // Phase B's operands (B, k_tail^T and the rows' decay), loaded now so that phase A hides their latency.
        float attn_low[2][8];
        float attn_high[2][8];
        const f16_t* attn_block = attn + chunk_head * CHUNK_TC * CHUNK_TC;
#pragma unroll
        for (int kb = 0; kb < 2; ++kb) {
            load8_f16(attn_low[kb], attn_block + row_low * CHUNK_TC + 32 * kb + lane_k);
            load8_f16(attn_high[kb], attn_block + (row_low + 8) * CHUNK_TC + 32 * kb + lane_k);
        }
        float tail_low[2][2][8];
        float tail_high[2][2][8];
        const f16_t* tail_block = k_tail_t + chunk_head * KDA_HEAD_DIM * CHUNK_TC;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
#pragma unroll
            for (int kb = 0; kb < 2; ++kb) {
                load8_f16(tail_low[m][kb], tail_block + (state_row + 16 * m) * CHUNK_TC + 32 * kb + lane_k);
                load8_f16(tail_high[m][kb], tail_block + (state_row + 16 * m + 8) * CHUNK_TC + 32 * kb + lane_k);
            }
        }
        float decay[2][2];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            decay[m][0] = chunk_decay[chunk_head * KDA_HEAD_DIM + state_row + 16 * m];
            decay[m][1] = chunk_decay[chunk_head * KDA_HEAD_DIM + state_row + 16 * m + 8];
        }

        copy_async_wait_all();
        __syncthreads();

        // Phase A: U = Uc - W S0, o = q_decay S0 (rows row_low, row_low + 8).
        float out_acc[4][4] = {};
#pragma unroll
        for (int kb = 0; kb < KDA_HEAD_DIM / 32; ++kb) {
            float w_low[8];
            float w_high[8];
            float q_low[8];
            float q_high[8];
            load8_f16(w_low, w_s + row_low * CHUNK_TC_H_STRIDE + 32 * kb + lane_k);
            load8_f16(w_high, w_s + (row_low + 8) * CHUNK_TC_H_STRIDE + 32 * kb + lane_k);
            load8_f16(q_low, q_s + row_low * CHUNK_TC_H_STRIDE + 32 * kb + lane_k);
            load8_f16(q_high, q_s + (row_low + 8) * CHUNK_TC_H_STRIDE + 32 * kb + lane_k);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                w_low[e] = -w_low[e];
                w_high[e] = -w_high[e];
            }
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                float b[8];
                load8(b, state_t_s + (8 * n + group_lane) * CHUNK_TC_D_STRIDE + 32 * kb + lane_k);
                mma_k_block<4>(u_acc[n], w_low, w_high, b);
                mma_k_block<4>(out_acc[n], q_low, q_high, b);
            }
        }
        // Padded rows: U = 0 by index (0 - 0 already; so it does not depend on the scratch contents).
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = row_low + 8 * (e >> 1);
                const int column = 8 * n + 2 * thread_in_group + (e & 1);
                u_t_s[column * CHUNK_TC_C_STRIDE + t] = t < valid ? round_tf32(u_acc[n][e]) : 0.0f;
            }
        }
        // U complete; every warp is done with w_s / q_s / state_t_s of this chunk.
        __syncthreads();
        if (chunk_index + 1 < nchunks) {
            copy_chunk_rows_async(w_s, q_s, w, q_decay, chunk_index + 1, row_stride, head_offset);
        }

        // Phase B: o += B U, then the state update.
#pragma unroll
        for (int kb = 0; kb < 2; ++kb) {
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                float b[8];
                load8(b, u_t_s + (8 * n + group_lane) * CHUNK_TC_C_STRIDE + 32 * kb + lane_k);
                mma_k_block<4>(out_acc[n], attn_low[kb], attn_high[kb], b);
            }
        }
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int t = row_low + 8 * half;
                if (t < valid) {
                    *reinterpret_cast<float2*>(core + static_cast<size_t>(first + t) * row_stride +
                                               head_offset + column_base + 8 * n + 2 * thread_in_group) =
                        make_float2(out_acc[n][2 * half], out_acc[n][2 * half + 1]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < 2; ++m) {
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                state_acc[m][n][0] *= decay[m][0];
                state_acc[m][n][1] *= decay[m][0];
                state_acc[m][n][2] *= decay[m][1];
                state_acc[m][n][3] *= decay[m][1];
            }
        }
#pragma unroll
        for (int kb = 0; kb < 2; ++kb) {
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                float b[8];
                load8(b, u_t_s + (8 * n + group_lane) * CHUNK_TC_C_STRIDE + 32 * kb + lane_k);
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    mma_k_block<4>(state_acc[m][n], tail_low[m][kb], tail_high[m][kb], b);
                }
            }
        }
        // The next chunk's S0 operand (nobody reads state_t_s until the next barrier).
#pragma unroll
        for (int m = 0; m < 2; ++m) {
#pragma unroll
            for (int n = 0; n < 4; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = state_row + 16 * m + 8 * (e >> 1);
                    const int column = 8 * n + 2 * thread_in_group + (e & 1);
                    state_t_s[column * CHUNK_TC_D_STRIDE + row] = round_tf32(state_acc[m][n][e]);
                }
            }
        }
    }

#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = state_row + 16 * m + 8 * half;
                *reinterpret_cast<float2*>(state_head + static_cast<size_t>(row) * KDA_HEAD_DIM +
                                           column_base + 8 * n + 2 * thread_in_group) =
                    make_float2(state_acc[m][n][2 * half], state_acc[m][n][2 * half + 1]);
            }
        }
    }
}
