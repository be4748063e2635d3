// One decode step of the KDA delta rule, FP32, per head h (state S [D_k, D_v],
// K-major, D = KDA_HEAD_DIM):
//   S    = S * exp(gate)[:, None]           decay each key row
//   pred = S^T k                            pred[v] = sum_i S[i, v] k[i]
//   S    = S + k (beta * (v - pred))^T
//   core = S^T (q * scale)                  read AFTER the update
//
// Launch: grid (heads, D / 32, rows), block 32; row r advances the state of slot
// slots[r] of a pool of [heads, D, D] states (slot r when slots is null) by one
// token, reading row r of the per-token inputs. Rows never interact, so a
// sequence's bits do not depend on which other sequences share the launch. A thread owns value column v = 32 *
// blockIdx.y + lane and keeps the whole state column S[0..D-1, v] in registers:
// every column is independent, so the state is read once and written once, and
// with v the fast axis each of those D row accesses is a coalesced 128-byte
// line per warp. The per-head vectors (decay, k, q * scale) are staged once in
// shared memory and read as broadcasts.
#include "kda_common.cuh"

#define RECURRENT_COLUMNS 32

extern "C" __global__ void __launch_bounds__(RECURRENT_COLUMNS)
kda_recurrent_step_f32(const float* __restrict__ query, const float* __restrict__ key,
                       const float* __restrict__ value, const float* __restrict__ gate,
                       const float* __restrict__ beta, float* __restrict__ state,
                       const int* __restrict__ slots, float* __restrict__ core, int heads,
                       float scale)
{
    __shared__ float decay_s[KDA_HEAD_DIM];
    __shared__ float key_s[KDA_HEAD_DIM];
    __shared__ float query_s[KDA_HEAD_DIM];

    const int head = blockIdx.x;
    const int lane = threadIdx.x;
    if (head >= heads || blockIdx.y >= KDA_HEAD_DIM / RECURRENT_COLUMNS ||
        blockDim.x != RECURRENT_COLUMNS) {
        return;
    }
    const int column = blockIdx.y * RECURRENT_COLUMNS + lane;
    const size_t row = blockIdx.z;
    const size_t slot = slots != nullptr ? static_cast<size_t>(slots[row]) : row;
    const size_t row_offset = row * heads * KDA_HEAD_DIM;
    query += row_offset;
    key += row_offset;
    value += row_offset;
    gate += row_offset;
    core += row_offset;
    beta += row * heads;
    state += slot * heads * KDA_HEAD_DIM * KDA_HEAD_DIM;
    const size_t head_offset = static_cast<size_t>(head) * KDA_HEAD_DIM;

    for (int i = lane; i < KDA_HEAD_DIM; i += RECURRENT_COLUMNS) {
        decay_s[i] = expf(gate[head_offset + i]);
        key_s[i] = key[head_offset + i];
        query_s[i] = query[head_offset + i] * scale;
    }
    __syncthreads();

    float* state_column = state + head_offset * KDA_HEAD_DIM + column;
    // Decay folded into the load and the update into the store, so no more than
    // the D state values are live at once.
    float s[KDA_HEAD_DIM];
    float pred = 0.0f;
#pragma unroll
    for (int i = 0; i < KDA_HEAD_DIM; ++i) {
        s[i] = state_column[static_cast<size_t>(i) * KDA_HEAD_DIM] * decay_s[i];
        pred = fmaf(s[i], key_s[i], pred);
    }
    const float delta = beta[head] * (value[head_offset + column] - pred);
    // A barrier is a shared-memory fence: it stops the compiler from keeping the
    // D key values of the first pass in registers for the second, which with the
    // D state values would exceed the 255-register budget and spill.
    __syncthreads();

    float out = 0.0f;
#pragma unroll
    for (int i = 0; i < KDA_HEAD_DIM; ++i) {
        s[i] = fmaf(key_s[i], delta, s[i]);
        out = fmaf(s[i], query_s[i], out);
        state_column[static_cast<size_t>(i) * KDA_HEAD_DIM] = s[i];
    }
    core[head_offset + column] = out;
}
