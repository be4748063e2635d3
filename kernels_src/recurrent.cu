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
// shared memory and read as broadcasts. The column step is kda_recurrent_load, _step
// and _store (kda_common.cuh), shared with the fused decode step.
#include "kda_common.cuh"

#define RECURRENT_COLUMNS 32

extern "C" __global__ void __launch_bounds__(RECURRENT_COLUMNS)
kda_recurrent_step_f32(const float* __restrict__ query, const float* __restrict__ key,
                       const float* __restrict__ value, const float* __restrict__ gate,
                       const float* __restrict__ beta, float* __restrict__ state,
                       const int* __restrict__ slots, float* __restrict__ core, int heads,
                       float scale)
{
    // 16-byte aligned: the step reads them as broadcasts of four floats (see KdaStepShared).
    __shared__ __align__(16) float decay_s[KDA_HEAD_DIM];
    __shared__ __align__(16) float key_s[KDA_HEAD_DIM];
    __shared__ __align__(16) float query_s[KDA_HEAD_DIM];

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
    float s[KDA_HEAD_DIM];
    kda_recurrent_load(s, state_column);
    const float out = kda_recurrent_step(s, decay_s, key_s, query_s, value[head_offset + column], beta[head]);
    kda_recurrent_store(s, state_column);
    core[head_offset + column] = out;
}
