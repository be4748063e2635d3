"""The decode kernels' source on the host (tests/host_cuda.py), so CPU CI checks the promise the
layer's `fused_decode` switch rests on.

Promises tested, for both gate laws and 1..9 tokens of one sequence from a random state:
  * kernels_src/decode.cu, one launch per token, writes bit for bit what the separate kernels
    write one after the other (conv.cu decode, gate.cu, recurrent.cu, norm.cu): every stage
    buffer (conv_out, q, k, v, gate, beta, core, o_norm_out) and both states;
  * decode.cu walking all the tokens in one launch (a verify's rows) writes the same bits;
  * in a pool, B sequences advancing shuffled slots in one launch (fused, and the separate
    kernels with their slots) write the bits each sequence gets alone, and the other slots
    keep theirs;
  * against the float64 oracle (glm_kda.reference), each fed the kernels' own inputs: the gate
    (forget_gate; dt_bias per channel, A_log per head) and beta within FP32 rounding, the core
    output and state of the recurrence (recurrent_scan) likewise, the gated norm within the
    stage bound after its BF16 rounding.
The GPU tests (tests/test_gpu.py) check the same bits on the device.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from types import SimpleNamespace

from glm_kda.gpu.projection import tile_layout
from glm_kda.reference import forget_gate, gated_rmsnorm, recurrent_scan, rms_ratio, round_bf16, sigmoid
from host_cuda import (COMMON_DEVICE_HELPERS, HOST_CUDA_HEADER, HOST_CUDA_RUNTIME, STAGED_STATE_BYTES, bf16_bits,
                       bits_to_f64, build_host_binary, host_decode_source, host_kernel_source, kernel_macro)

HEADS = 2
DIM = 128
KERNEL = 4
LOWER_BOUND = -5.0
L2_EPS = 1e-6
NORM_EPS = 1e-5
STEMS = ("conv", "gate", "recurrent", "norm", "decode")
OUTPUTS = ("conv_out", "query", "key", "value", "gate", "beta", "core", "o_norm_out", "conv_state", "state")

# The pool path's fused step asks L2 for the state of the sequence this far ahead.
PREFETCH_AHEAD = 2
DEVICE_HELPERS = {"decode": ("prefetch_floats_l2", *COMMON_DEVICE_HELPERS)}

# The L2 requests of the fused step: counted, and checked to name exactly the head of the block
# (blockIdx.x) in the slot of the sequence PREFETCH_AHEAD after the block's (blockIdx.y): its
# state, then the conv windows of its q, k and v channels.
DECODE_HEADER = HOST_CUDA_HEADER + r"""
extern const float* prefetch_pool;
extern const float* prefetch_conv_pool;
extern const int* prefetch_slots;
extern int prefetch_heads, prefetch_kernel;
extern std::atomic<long> prefetches, bad_prefetches;
inline void prefetch_floats_l2(const float* first, int count, int d)
{
    if (d != 0) return;
    const long request = prefetches++ % 4;  // a block's four requests come one after the other
    const long slot = prefetch_slots[blockIdx.y + PREFETCH_AHEAD], head = blockIdx.x, D = 128, K = prefetch_kernel;
    const long qkv = prefetch_heads * D;
    const float* expected = request == 0
        ? prefetch_pool + (slot * prefetch_heads + head) * D * D
        : prefetch_conv_pool + ((slot * 3 + request - 1) * qkv + head * D) * K;
    if (first != expected || count != (request == 0 ? D * D : D * K)) bad_prefetches++;
}
""".replace("PREFETCH_AHEAD", str(PREFETCH_AHEAD)).replace("STAGED_STATE_BYTES", str(STAGED_STATE_BYTES))

DECODE_MAIN = r"""
#include "emulation.h"
""" + HOST_CUDA_RUNTIME + r"""
const float* prefetch_pool;
const float* prefetch_conv_pool;
const int* prefetch_slots;
int prefetch_heads, prefetch_kernel;
std::atomic<long> prefetches{0}, bad_prefetches{0};
using bf16_t = unsigned short;
extern "C" void conv_decode_silu_l2_bf16(float*, const int*, const bf16_t*, const bf16_t*, bf16_t*, float*, float*,
                                         float*, int, int, int, float);
extern "C" void gate_beta_f32(const bf16_t*, const float*, const float*, const bf16_t*, int, float*, float*, int, int,
                              int, float, int);
extern "C" void kda_recurrent_step_f32(const float*, const float*, const float*, const float*, const float*, float*,
                                       const int*, float*, int, float);
extern "C" void gated_rmsnorm_sigmoid_bf16(const float*, const bf16_t*, const bf16_t*, bf16_t*, int, int, float, int);
""" + kernel_macro("decode", "KDA_DECODE_FUSED_PARAMETERS") + r"""
extern "C" void kda_decode_fused_bf16(KDA_DECODE_FUSED_PARAMETERS);
extern "C" void kda_decode_fused_staged_bf16(KDA_DECODE_FUSED_PARAMETERS);

// argv: dir, rows, heads, K, bounded, lower bound, l2 eps, norm eps, jitter, pool size, staged. Pool
// size 0: the rows are consecutive tokens of one sequence (paths separate, fused_rows, fused_walk and
// fused_walk_awaiting, the walk awaiting words already set);
// else sequence s (row s) advances slot slots[s] of a pool of that many (paths pool_fused,
// pool_separate, and alone: the fused step for each sequence by itself). Staged 1: the fused paths
// run kda_decode_fused_staged_bf16 (the state through the block's shared memory).
int main(int argc, char** argv)
{
    const std::string dir = argv[1];
    const int rows = std::atoi(argv[2]), heads = std::atoi(argv[3]), kernel = std::atoi(argv[4]);
    const int bounded = std::atoi(argv[5]);
    const float lower_bound = std::atof(argv[6]), l2_eps = std::atof(argv[7]), norm_eps = std::atof(argv[8]);
    jitter = std::atoi(argv[9]);
    const int pool_size = std::atoi(argv[10]);
    const bool staged = std::atoi(argv[11]) != 0;
    // argv[12] (pool only): tokens per sequence, rows = sequences * tokens (a batched verify's walks).
    const int tokens = argc > 12 ? std::atoi(argv[12]) : 1, sequences = rows / tokens;
    const size_t D = 128, qkv = heads * D, conv_dim = 3 * qkv, ld_beta = 2 * D + heads;
    const size_t conv_slot = conv_dim * kernel, state_slot = heads * D * D, slot_count = std::max(pool_size, 1);
    const float scale = 1.0f / std::sqrt(float(D));
    auto qkv_proj = load_u16(dir + "/qkv_proj", rows * conv_dim);
    const auto conv_w = load_u16(dir + "/conv_w", conv_dim * kernel);
    const auto forget_proj = load_u16(dir + "/forget_proj", rows * qkv);
    const auto down_proj = load_u16(dir + "/down_proj", rows * ld_beta);  // beta logits at column 2 D
    auto out_gate = load_u16(dir + "/out_gate", rows * qkv);
    const auto norm_w = load_u16(dir + "/norm_w", D);
    const auto dt_bias = load(dir + "/dt_bias", qkv);
    const auto a_log = load(dir + "/a_log", heads);
    const auto conv_start = load(dir + "/conv_state", slot_count * conv_slot);
    const auto state_start = load(dir + "/state", slot_count * state_slot);
    const auto slots = pool_size ? load_as<int>(dir + "/slots", sequences) : std::vector<int>();
    const bf16_t* beta_logits = down_proj.data() + 2 * D;

    const std::initializer_list<const char*> one_sequence = {"separate", "fused_rows", "fused_walk",
                                                             "fused_walk_awaiting", "fused_walk_late"};
    const std::initializer_list<const char*> pool = {"pool_fused", "pool_separate", "alone"};
    const std::initializer_list<const char*> pool_walk = {"pool_fused", "pool_plain", "alone"};
    for (const std::string path : pool_size ? (tokens > 1 ? pool_walk : pool) : one_sequence) {
        auto conv_state = conv_start, state = state_start;
        std::vector<bf16_t> conv_out(rows * conv_dim, 0x7FA5), o_norm_out(rows * qkv, 0x7FA5);
        std::vector<float> query(rows * qkv, std::nanf("")), key = query, value = query, gate = query, core = query;
        std::vector<float> beta(rows * heads, std::nanf(""));
        // o_norm_out in the bulk sweep's tile layout, which the pool path writes too (k = qkv).
        const size_t row_groups = (rows + 63) / 64;
        std::vector<bf16_t> x_tiles(row_groups * qkv * 64, 0x7FA5);
        // The fused step over rows first.. : `sequences` sequences (slot_list, or the states given
        // when null) of `tokens` tokens each.
        // ready: the words a step awaiting another stream's q|k|v polls (set here: that stream's
        // READY_TARGET blocks are done).
        constexpr int READY_TARGET = 7;
        std::vector<int> ready = {path == "fused_walk_late" ? READY_TARGET - 1 : READY_TARGET, 0};
        // counted: the words a walk's blocks count their outputs out in (for an o_proj awaiting them).
        std::vector<int> counted = {0, 0};
        auto fused = [&](int first, int sequences, int tokens, const int* slot_list, float* conv, float* states,
                         int prefetch_ahead = 0, bf16_t* tiles = nullptr, int* inputs_ready = nullptr,
                         int* outputs_ready = nullptr) {
            // Where the blocks let the next kernel launch (a no-op here): every choice, in turn (3, past
            // the wait for inputs_ready, with inputs_ready only).
            const int dependents_after = (first + tokens) % (inputs_ready ? 4 : 3);
            prefetch_pool = states;
            prefetch_conv_pool = conv;
            prefetch_slots = slot_list;
            prefetch_heads = heads;
            prefetch_kernel = kernel;
            const auto kernel_entry = staged ? kda_decode_fused_staged_bf16 : kda_decode_fused_bf16;
            run_grid(dim3{unsigned(heads), unsigned(sequences), 1}, 128, staged ? STAGED_STATE_BYTES : 0, [&] {
                kernel_entry(conv, states, slot_list, qkv_proj.data() + first * conv_dim, conv_w.data(),
                             forget_proj.data() + first * qkv, dt_bias.data(), a_log.data(),
                             beta_logits + first * ld_beta, int(ld_beta), out_gate.data() + first * qkv,
                             norm_w.data(), conv_out.data() + first * conv_dim, query.data() + first * qkv,
                             key.data() + first * qkv, value.data() + first * qkv, gate.data() + first * qkv,
                             beta.data() + first * heads, core.data() + first * qkv,
                             o_norm_out.data() + first * qkv, heads, kernel, tokens, bounded, lower_bound,
                             scale, l2_eps, norm_eps, prefetch_ahead, dependents_after, tiles, inputs_ready,
                             READY_TARGET, outputs_ready);
            });
        };
        // The separate kernels over rows first .. first + count - 1, one token of a sequence each.
        auto separate = [&](int first, int count, const int* slot_list, float* conv, float* states) {
            run_grid(dim3{unsigned(3 * heads), unsigned(count), 1}, 128, 0, [&] {
                conv_decode_silu_l2_bf16(conv, slot_list, qkv_proj.data() + first * conv_dim, conv_w.data(),
                                         conv_out.data() + first * conv_dim, query.data() + first * qkv,
                                         key.data() + first * qkv, value.data() + first * qkv, heads, 128, kernel,
                                         l2_eps);
            });
            run_grid(dim3{unsigned(heads), unsigned((count + 31) / 32), 1}, 128, 0, [&] {
                gate_beta_f32(forget_proj.data() + first * qkv, dt_bias.data(), a_log.data(),
                              beta_logits + first * ld_beta, int(ld_beta), gate.data() + first * qkv,
                              beta.data() + first * heads, heads, 128, bounded, lower_bound, count);
            });
            run_grid(dim3{unsigned(heads), 4, unsigned(count)}, 32, 0, [&] {
                kda_recurrent_step_f32(query.data() + first * qkv, key.data() + first * qkv,
                                       value.data() + first * qkv, gate.data() + first * qkv,
                                       beta.data() + first * heads, states, slot_list, core.data() + first * qkv,
                                       heads, scale);
            });
            run_grid(dim3{unsigned(heads), unsigned((count + 7) / 8), 1}, 128, 0, [&] {
                gated_rmsnorm_sigmoid_bf16(core.data() + first * qkv, out_gate.data() + first * qkv, norm_w.data(),
                                           o_norm_out.data() + first * qkv, heads, 128, norm_eps, count);
            });
        };
        if (path == "fused_walk") {
            fused(0, 1, rows, nullptr, conv_state.data(), state.data());
        } else if (path == "fused_walk_awaiting") {
            fused(0, 1, rows, nullptr, conv_state.data(), state.data(), 0, nullptr, ready.data(), counted.data());
        } else if (path == "fused_walk_late") {
            // q|k|v and the output gate land (and the count reaches its target) only well after the launch.
            const auto real_qkv = qkv_proj, real_gate = out_gate;
            std::fill(qkv_proj.begin(), qkv_proj.end(), bf16_t(0x7FA5));
            std::fill(out_gate.begin(), out_gate.end(), bf16_t(0x7FA5));
            std::thread producer([&] {
                std::this_thread::sleep_for(std::chrono::milliseconds(50));
                std::copy(real_qkv.begin(), real_qkv.end(), qkv_proj.begin());
                std::copy(real_gate.begin(), real_gate.end(), out_gate.begin());
                kda_count_release(ready.data());
            });
            fused(0, 1, rows, nullptr, conv_state.data(), state.data(), 0, nullptr, ready.data(), counted.data());
            producer.join();
        } else if (path == "pool_plain") {
            fused(0, sequences, tokens, slots.data(), conv_state.data(), state.data(), PREFETCH_AHEAD, x_tiles.data());
        } else if (path == "pool_fused" && tokens > 1) {
            fused(0, sequences, tokens, slots.data(), conv_state.data(), state.data(), PREFETCH_AHEAD, x_tiles.data(),
                  ready.data(), counted.data());
        } else if (path == "pool_fused") {
            fused(0, rows, 1, slots.data(), conv_state.data(), state.data(), PREFETCH_AHEAD, x_tiles.data());
        } else if (path == "pool_separate") {
            separate(0, rows, slots.data(), conv_state.data(), state.data());
        }
        for (int t = 0; t < rows; ++t) {
            if (path == "fused_rows") {
                fused(t, 1, 1, nullptr, conv_state.data(), state.data());
            } else if (path == "separate") {
                separate(t, 1, nullptr, conv_state.data(), state.data());
            } else if (path == "alone" && t % tokens == 0) {
                fused(t, 1, tokens, nullptr, conv_state.data() + slots[t / tokens] * conv_slot,
                      state.data() + slots[t / tokens] * state_slot);
            }
        }
        save_each(dir + "/" + path + ".",
                  {"conv_out", "query", "key", "value", "gate", "beta", "core", "o_norm_out", "conv_state", "state"},
                  conv_out, query, key, value, gate, beta, core, o_norm_out, conv_state, state);
        save_each(dir + "/" + path + ".", {"x_tiles", "ready", "counted"}, x_tiles, ready, counted);
    }
    std::printf("misaligned=%ld prefetches=%ld bad_prefetches=%ld\n", misaligned.load(), prefetches.load(),
                bad_prefetches.load());
    return 0;
}
""".replace("PREFETCH_AHEAD", str(PREFETCH_AHEAD)).replace("STAGED_STATE_BYTES", str(STAGED_STATE_BYTES))


def _layout(tokens):
    """dtype and shape of every output file, by the OUTPUTS name."""
    conv_dim = 3 * HEADS * DIM
    vector = (np.float32, (tokens, HEADS, DIM))
    layout = {"conv_out": (np.uint16, (tokens, conv_dim)), "query": vector, "key": vector, "value": vector,
              "gate": vector, "beta": (np.float32, (tokens, HEADS)), "core": vector,
              "o_norm_out": (np.uint16, (tokens, HEADS, DIM)), "conv_state": (np.float32, (conv_dim, KERNEL)),
              "state": (np.float32, (HEADS, DIM, DIM))}
    assert tuple(layout) == OUTPUTS
    return layout


@pytest.fixture(scope="module")
def decode_host(tmp_path_factory):
    files = {"emulation.h": DECODE_HEADER, "main.cpp": DECODE_MAIN}
    for stem in STEMS:
        helpers = DEVICE_HELPERS.get(stem, COMMON_DEVICE_HELPERS)
        source = host_decode_source(helpers) if stem == "decode" else host_kernel_source(stem, helpers)
        files[f"{stem}.cpp"] = '#include "emulation.h"\n' + source
    return build_host_binary(tmp_path_factory.mktemp("decode_host"), "decode_host", files)


def _layer_inputs(rng, rows):
    """Random inputs of `rows` token rows and the weights they meet (BF16 bits or FP32)."""
    qkv, conv_dim = HEADS * DIM, 3 * HEADS * DIM
    return {
        "qkv_proj": bf16_bits(rng.standard_normal((rows, conv_dim)) * 2.0),
        "conv_w": bf16_bits(rng.standard_normal((conv_dim, KERNEL)) * 0.5),
        "forget_proj": bf16_bits(rng.standard_normal((rows, qkv))),
        "down_proj": bf16_bits(rng.standard_normal((rows, 2 * DIM + HEADS)) * 2.0),
        "out_gate": bf16_bits(rng.standard_normal((rows, qkv))),
        "norm_w": bf16_bits(1.0 + 0.1 * rng.standard_normal(DIM)),
        "dt_bias": rng.standard_normal(qkv).astype(np.float32),
        "a_log": rng.uniform(-1.0, 1.0, HEADS).astype(np.float32),
    }


def _run_binary(binary, folder, inputs, rows, bounded, *extra):
    """Write the inputs to `folder`, run the host binary on them; the outputs land there."""
    folder.mkdir(exist_ok=True)
    for name, array in inputs.items():
        np.ascontiguousarray(array).tofile(folder / name)
    result = subprocess.run(
        [str(binary), str(folder), str(rows), str(HEADS), str(KERNEL), str(int(bounded)), repr(LOWER_BOUND),
         repr(L2_EPS), repr(NORM_EPS), *map(str, extra)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    pool_size, sequences = int(extra[1]), rows // (int(extra[3]) if len(extra) > 3 else 1)
    # The pool path's blocks of sequences s < rows - PREFETCH_AHEAD each ask L2 for the state and the
    # three conv windows of their head in the slot of sequence s + PREFETCH_AHEAD; nothing else does.
    prefetches = 4 * HEADS * max(sequences - PREFETCH_AHEAD, 0) if pool_size else 0
    prefetches *= 2 if sequences < rows else 1  # a pool of walks: the awaiting launch and the plain one
    assert result.stdout.split() == ["misaligned=0", f"prefetches={prefetches}", "bad_prefetches=0"], \
        f"host run: {result.stdout.strip()}"


def run_decode(binary, tokens, bounded, seed, jitter=False, staged=False):
    """(outputs of the four one-sequence paths by name, the random inputs)."""
    rng = np.random.default_rng(seed)
    inputs = _layer_inputs(rng, tokens)
    inputs["conv_state"] = rng.standard_normal((3 * HEADS * DIM, KERNEL)).astype(np.float32)
    inputs["state"] = (0.1 * rng.standard_normal((HEADS, DIM, DIM))).astype(np.float32)
    folder = binary.parent / f"T{tokens}-b{int(bounded)}-{seed}-{int(jitter)}-{int(staged)}"
    _run_binary(binary, folder, inputs, tokens, bounded, int(jitter), 0, int(staged))
    layout = _layout(tokens)
    out = {}
    for path in ("separate", "fused_rows", "fused_walk", "fused_walk_awaiting", "fused_walk_late"):
        out[path] = {name: np.fromfile(folder / f"{path}.{name}", dtype).reshape(shape)
                     for name, (dtype, shape) in layout.items()}
    # The awaiting walk found its word set and left both words at zero for the next launch.
    late = np.fromfile(folder / "fused_walk_late.ready", np.int32)
    assert late.tolist() == [0, 0], f"T={tokens}: the late walk's words after it are {late.tolist()}, not [0, 0]"
    ready = np.fromfile(folder / "fused_walk_awaiting.ready", np.int32)
    assert ready.tolist() == [0, 0], f"T={tokens}: the awaited words after the walk are {ready.tolist()}, not [0, 0]"
    counted = np.fromfile(folder / "fused_walk_awaiting.counted", np.int32)
    assert counted.tolist() == [HEADS, 0], (f"T={tokens}: the walk's count of blocks with their outputs out is "
                                            f"{counted.tolist()}, not [{HEADS}, 0]")
    return out, inputs


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "softplus"])
@pytest.mark.parametrize("tokens,jitter,staged", [(1, False, False), (3, True, False), (9, False, False),
                                                  (1, False, True), (3, True, True)], ids=lambda v: str(v))
def test_fused_decode_equals_separate_kernels_on_host(decode_host, tokens, jitter, staged, bounded):
    """The fused step (staged: its state through shared memory) against the separate kernels, bit
    for bit, and the separate kernels against float64."""
    out, inputs = run_decode(decode_host, tokens, bounded, seed=7 * tokens + int(bounded), jitter=jitter, staged=staged)
    separate = out["separate"]
    for path in ("fused_rows", "fused_walk", "fused_walk_awaiting", "fused_walk_late"):
        for name in OUTPUTS:
            a, b = out[path][name], separate[name]
            differ = int(np.count_nonzero(a.view(np.uint8) != b.view(np.uint8)))
            assert differ == 0, f"T={tokens} {path}: {differ} bytes of {name} differ from the separate kernels"
    assert np.isfinite(separate["core"]).all() and np.isfinite(separate["gate"]).all()

    # The separate kernels' recurrence against float64, fed their own vectors.
    core, state = recurrent_scan(*(separate[name].astype(np.float64) for name in ("query", "key", "value", "gate")),
                                 separate["beta"].astype(np.float64), inputs["state"].astype(np.float64))
    ratio = rms_ratio(separate["core"].astype(np.float64), core)
    assert ratio <= 1e-5, f"T={tokens}: core rms-ratio {ratio:.3e} against the float64 recurrence"
    ratio = rms_ratio(separate["state"].astype(np.float64), state)
    assert ratio <= 1e-5, f"T={tokens}: state rms-ratio {ratio:.3e} against the float64 recurrence"

    # The gate, beta and the gated norm against float64, fed the kernels' inputs.
    config = SimpleNamespace(heads=HEADS, head_dim=DIM, bounded=bounded, gate_lower_bound=LOWER_BOUND)
    gate = forget_gate(bits_to_f64(inputs["forget_proj"]), inputs["dt_bias"].astype(np.float64),
                       inputs["a_log"].astype(np.float64), config)
    ratio = rms_ratio(separate["gate"].astype(np.float64), gate)
    assert ratio <= 1e-5, f"T={tokens}: gate rms-ratio {ratio:.3e} against the float64 forget gate"
    ratio = rms_ratio(separate["beta"].astype(np.float64), sigmoid(bits_to_f64(inputs["down_proj"][:, 2 * DIM :])))
    assert ratio <= 1e-6, f"T={tokens}: beta rms-ratio {ratio:.3e} against sigmoid of the logits"
    norm = gated_rmsnorm(separate["core"].astype(np.float64), bits_to_f64(inputs["out_gate"]),
                         bits_to_f64(inputs["norm_w"]), NORM_EPS)
    ratio = rms_ratio(bits_to_f64(separate["o_norm_out"]).reshape(tokens, -1), round_bf16(norm))
    assert ratio <= 1e-3, f"T={tokens}: o_norm_out rms-ratio {ratio:.3e} against the float64 gated norm (bound 1e-3)"


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "softplus"])
@pytest.mark.parametrize("sequences,staged", [(1, False), (5, False), (33, False), (5, True)],
                         ids=lambda v: str(v))
def test_pool_sequences_equal_each_alone_on_host(decode_host, sequences, staged, bounded):
    rng = np.random.default_rng(100 + sequences + int(bounded))
    conv_dim, pool_size = 3 * HEADS * DIM, sequences + 3
    inputs = _layer_inputs(rng, sequences)
    inputs["conv_state"] = rng.standard_normal((pool_size, conv_dim, KERNEL)).astype(np.float32)
    inputs["state"] = (0.1 * rng.standard_normal((pool_size, HEADS, DIM, DIM))).astype(np.float32)
    inputs["slots"] = rng.permutation(pool_size)[:sequences].astype(np.int32)
    folder = decode_host.parent / f"pool-B{sequences}-b{int(bounded)}-{int(staged)}"
    _run_binary(decode_host, folder, inputs, sequences, bounded, 0, pool_size, int(staged))
    layout = {**_layout(sequences), "conv_state": (np.float32, (pool_size, conv_dim, KERNEL)),
              "state": (np.float32, (pool_size, HEADS, DIM, DIM))}
    out = {path: {name: np.fromfile(folder / f"{path}.{name}", dtype).reshape(shape) for name, (dtype, shape) in layout.items()}
           for path in ("pool_fused", "pool_separate", "alone")}
    for path in ("pool_fused", "pool_separate"):
        for name in OUTPUTS:
            differ = int(np.count_nonzero(out[path][name].view(np.uint8) != out["alone"][name].view(np.uint8)))
            assert differ == 0, f"B={sequences} {path}: {differ} bytes of {name} differ from each sequence alone"
    # The pool path also wrote o_norm_out in the bulk sweep's tile layout, its rows and nothing else.
    tiles = np.fromfile(folder / "pool_fused.x_tiles", np.uint16).reshape(-(-sequences // 64), -1, 2048)
    expected = tile_layout(out["pool_fused"]["o_norm_out"].reshape(sequences, -1), "o_norm_out")
    mask = tile_layout(np.ones((sequences, HEADS * DIM), np.uint16), "rows") != 0
    assert np.array_equal(tiles[mask], expected[mask]), f"B={sequences}: the x tiles are not o_norm_out's tile layout"
    assert (tiles[~mask] == 0x7FA5).all(), f"B={sequences}: the step wrote x tiles past its rows"
    others = np.setdiff1d(np.arange(pool_size), inputs["slots"])
    assert np.array_equal(out["pool_fused"]["state"][others], inputs["state"][others]), "an unnamed slot changed"
    assert np.array_equal(out["pool_fused"]["conv_state"][others], inputs["conv_state"][others]), "an unnamed slot changed"
    assert not np.array_equal(out["alone"]["state"][inputs["slots"]], inputs["state"][inputs["slots"]])


def test_pool_walks_equal_each_sequence_walking_alone_on_host(decode_host):
    """A batched verify: 17 sequences of 4 tokens (rows s T .. s T + T - 1, 68 rows: two row groups of
    x tiles) in one launch, plain and awaiting with outputs_ready: every row, state and x tile as each
    sequence's walk alone writes it, the awaited words back at zero, one count per block."""
    sequences, tokens = 17, 4
    rows, conv_dim, pool_size = sequences * tokens, 3 * HEADS * DIM, sequences + 3
    rng = np.random.default_rng(300)
    inputs = _layer_inputs(rng, rows)
    inputs["conv_state"] = rng.standard_normal((pool_size, conv_dim, KERNEL)).astype(np.float32)
    inputs["state"] = (0.1 * rng.standard_normal((pool_size, HEADS, DIM, DIM))).astype(np.float32)
    inputs["slots"] = rng.permutation(pool_size)[:sequences].astype(np.int32)
    folder = decode_host.parent / "pool-walk"
    _run_binary(decode_host, folder, inputs, rows, True, 0, pool_size, 0, tokens)
    layout = {**_layout(rows), "conv_state": (np.float32, (pool_size, conv_dim, KERNEL)),
              "state": (np.float32, (pool_size, HEADS, DIM, DIM))}
    out = {path: {name: np.fromfile(folder / f"{path}.{name}", dtype).reshape(shape)
                  for name, (dtype, shape) in layout.items()} for path in ("pool_fused", "pool_plain", "alone")}
    mask = tile_layout(np.ones((rows, HEADS * DIM), np.uint16), "rows") != 0
    for path in ("pool_fused", "pool_plain"):
        for name in OUTPUTS:
            differ = int(np.count_nonzero(out[path][name].view(np.uint8) != out["alone"][name].view(np.uint8)))
            assert differ == 0, f"{path}: {differ} bytes of {name} differ from each sequence walking alone"
        tiles = np.fromfile(folder / f"{path}.x_tiles", np.uint16).reshape(2, -1, 2048)
        expected = tile_layout(out[path]["o_norm_out"].reshape(rows, -1), "o_norm_out")
        assert np.array_equal(tiles[mask], expected[mask]), f"{path}: the x tiles are not o_norm_out's tile layout"
    assert np.fromfile(folder / "pool_fused.ready", np.int32).tolist() == [0, 0], "awaited words not cleared"
    assert np.fromfile(folder / "pool_fused.counted", np.int32).tolist() == [HEADS * sequences, 0]
