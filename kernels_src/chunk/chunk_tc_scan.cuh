// The scan across chunks, one block's part: shared by the plain scan (chunk_tc.cu) and the scan that applies
// the gated RMSNorm in its epilogue (chunk_tc_scan_norm.cu, sm_90a: a cluster of the head's four blocks).
// Launch, shared memory and numerics: chunk_tc.cuh and docs/kernels.md, 'Tensor-core chunk kernels'.
#pragma once

#include "chunk/chunk_tc.cuh"

// The scan with the norm: a row's partial sums of squares, double-buffered by chunk parity (docs/kernels.md).
#define CHUNK_TC_SCAN_NORM_SMEM_BYTES (CHUNK_TC_SCAN_SMEM_BYTES + 4 * 2 * CHUNK_TC)

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

// The sums of squares of a warp's two output rows (rows g, g + 8 of its accumulator layout, lane 4 g + t)
// over the block's 32 columns, to every lane of the group, in the order block_sum_f32 adds the channels
// of warp blockIdx.y in norm.cu: the lane's column 8 n + 2 t + b, so that xor tree pairs n ^ 2, then
// n ^ 1, then lane ^ 2 and lane ^ 1 (shuffles), then b.
__device__ __forceinline__ void scan_row_sums_of_squares(const float (&out_acc)[4][4], float sums[2])
{
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float pair[2];
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            float squares[4];
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                squares[n] = __fmul_rn(out_acc[n][2 * half + b], out_acc[n][2 * half + b]);
            }
            pair[b] = (squares[0] + squares[2]) + (squares[1] + squares[3]);
            pair[b] += __shfl_xor_sync(KDA_FULL_WARP_MASK, pair[b], 2);
            pair[b] += __shfl_xor_sync(KDA_FULL_WARP_MASK, pair[b], 1);
        }
        sums[half] = pair[0] + pair[1];
    }
}

// Head blockIdx.x, value columns 32 blockIdx.y .. of the scan. NORM: the block is rank blockIdx.y of a
// cluster of the head's four blocks, and writes o_norm_out = the gated RMSNorm (sigmoid gate out_gate,
// weight norm_w, eps norm_eps) of each core row over the head's 128 columns, with the bits of
// kda_gated_rmsnorm_sigmoid_bf16 (norm.cu) on the same core; core is then written only where not null.
template <bool NORM>
__device__ __forceinline__ void chunk_tc_scan_block(const f16_t* __restrict__ q_decay, const f16_t* __restrict__ k_tail_t,
                                                    const f16_t* __restrict__ w, const float* __restrict__ u,
                                                    const f16_t* __restrict__ attn,
                                                    const float* __restrict__ chunk_decay, float* __restrict__ state,
                                                    float* __restrict__ core, int tokens, int heads,
                                                    const bf16_t* __restrict__ out_gate,
                                                    const bf16_t* __restrict__ norm_w, bf16_t* __restrict__ o_norm_out,
                                                    float norm_eps)
{
    // w_s, q_s: the chunk's W, q_decay; state_t_s: tf32(S0)^T; u_t_s: tf32(U)^T (docs/kernels.md).
    extern __shared__ __align__(16) float shared[];
    f16_t* w_s = reinterpret_cast<f16_t*>(shared);
    f16_t* q_s = w_s + CHUNK_TC * CHUNK_TC_H_STRIDE;
    float* state_t_s = shared + CHUNK_TC * CHUNK_TC_H_STRIDE;
    float* u_t_s = state_t_s + CHUNK_TC_SCAN_COLUMNS * CHUNK_TC_D_STRIDE;
    // NORM: row_sums_s[parity][t], this block's sum of squares of chunk row t (its 32 columns).
    float* row_sums_s = u_t_s + CHUNK_TC_SCAN_COLUMNS * CHUNK_TC_C_STRIDE;

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
    // NORM: the norm weights of this thread's columns 8 n + 2 thread_in_group + b of the block.
    float norm_weight[4][2];
    if (NORM) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                norm_weight[n][b] = bf16_to_f32(norm_w[column_base + 8 * n + 2 * thread_in_group + b]);
            }
        }
    }

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

    for (int chunk_index = 0; chunk_index < nchunks; ++chunk_index) {
        const int first = chunk_index * CHUNK_TC;
        const int valid = min(CHUNK_TC, tokens - first);
        const size_t chunk_head = static_cast<size_t>(chunk_index) * heads + head;

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
        // NORM: out_gate of this thread's outputs (rows row_low, row_low + 8), two BF16 a word.
        unsigned int gate_words[4][2] = {};
        if (NORM) {
#pragma unroll
            for (int n = 0; n < 4; ++n) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int t = row_low + 8 * half;
                    if (t < valid) {
                        gate_words[n][half] = *reinterpret_cast<const unsigned int*>(
                            out_gate + static_cast<size_t>(first + t) * row_stride + head_offset + column_base +
                            8 * n + 2 * thread_in_group);
                    }
                }
            }
        }
        // U = Uc - W S0 accumulates onto Uc (mma with -W; TF32 negation is exact).
        float u_acc[4][4];
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float2 pair_value = *reinterpret_cast<const float2*>(
                    u + static_cast<size_t>(first + row_low + 8 * half) * row_stride + head_offset +
                    column_base + 8 * n + 2 * thread_in_group);
                u_acc[n][2 * half] = pair_value.x;
                u_acc[n][2 * half + 1] = pair_value.y;
            }
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
        if (!NORM || core != nullptr) {
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
        }
        float* row_sums = row_sums_s + (chunk_index & 1) * CHUNK_TC;
        if (NORM) {
            float sums[2];
            scan_row_sums_of_squares(out_acc, sums);
            if (thread_in_group == 0) {
                row_sums[row_low] = sums[0];
                row_sums[row_low + 8] = sums[1];
            }
            // The cluster's blocks read these after their wait; the state update runs meanwhile.
            kda_cluster_arrive();
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
        if (NORM) {
            // Every block's row sums of this chunk are written. Rows summed in block order (sum_of_warps),
            // then norm.cu's gated_rmsnorm_sigmoid, the same expression.
            kda_cluster_wait();
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int t = row_low + 8 * half;
                float total = kda_cluster_load(row_sums + t, 0);
                total += kda_cluster_load(row_sums + t, 1);
                total += kda_cluster_load(row_sums + t, 2);
                total += kda_cluster_load(row_sums + t, 3);
                const float mean_square = total / static_cast<float>(KDA_HEAD_DIM);
                const float root = sqrtf(mean_square + norm_eps);
                if (t < valid) {
#pragma unroll
                    for (int n = 0; n < 4; ++n) {
                        float y[2];
#pragma unroll
                        for (int b = 0; b < 2; ++b) {
                            y[b] = out_acc[n][2 * half + b] / root * norm_weight[n][b] *
                                   sigmoid_f32(bf16_half_to_f32(gate_words[n][half], b));
                        }
                        *reinterpret_cast<unsigned int*>(o_norm_out + static_cast<size_t>(first + t) * row_stride +
                                                         head_offset + column_base + 8 * n + 2 * thread_in_group) =
                            static_cast<unsigned int>(f32_to_bf16(y[0])) |
                            (static_cast<unsigned int>(f32_to_bf16(y[1])) << 16);
                    }
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

    if (NORM) {
        // No block leaves while another may still read its row sums.
        kda_cluster_arrive();
        kda_cluster_wait();
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
