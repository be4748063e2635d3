"""The fused decode step's source (kernels_src/decode/decode.cu) on the host (tests/host_cuda.py).

Promises tested, for both gate laws and 1..9 tokens of one sequence from a random state:
  * the step, one launch per token, writes bit for bit what the prefill kernels write for its
    stages (conv.cu over the tokens: conv_out, q, k, v and the conv state; gate.cu: gate and beta;
    norm.cu on the step's core: o_norm_out), and its recurrence is the state column's device
    functions (kda_recurrent_load / _step / _store) launched one token at a time: core and state;
  * the step walking all the tokens in one launch (a verify's rows), counting its blocks' outputs
    out or not, writes the same bits;
  * in a pool, B sequences advancing shuffled slots in one launch write the bits each sequence
    gets alone, the other slots keep theirs, and the L2 requests name the right slot;
  * against the float64 oracle (glm_kda.reference), each fed the kernels' own inputs: the gate
    (forget_gate; dt_bias per channel, A_log per head) and beta within FP32 rounding, the core
    output and state of the recurrence (recurrent_scan) likewise, the gated norm within the
    stage bound after its BF16 rounding.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from types import SimpleNamespace

from glm_kda.gpu.projection import tile_layout
from glm_kda.reference import forget_gate, gated_rmsnorm, recurrent_scan, rms_ratio, round_bf16, sigmoid
from host_cuda import (HOST_CUDA_HEADER, HOST_CUDA_RUNTIME, bf16_bits, bits_to_f64, build_host_binary,
                       host_kernel_source, kernel_declaration)

HEADS = 2
DIM = 128
KERNEL = 4
LOWER_BOUND = -5.0
L2_EPS = 1e-6
NORM_EPS = 1e-5
STEMS = ("conv", "gate", "norm", "decode/decode")
OUTPUTS = ("conv_out", "query", "key", "value", "gate", "beta", "core", "o_norm_out", "conv_state", "state")

# The pool path's fused step asks L2 for the state of the sequence this far ahead.
PREFETCH_AHEAD = 2
DEVICE_HELPERS = {"decode/decode": ("prefetch_floats_l2",)}

# One token of the recurrence of every head, by the step's own device functions (decode_step.cuh),
# appended to the host build of decode.cu: block h, thread d steps value column d of head h.
RECURRENT_STEP = r"""
extern "C" void host_recurrent_step(const float* query, const float* key, const float* value, const float* gate,
                                    const float* beta, float* state, float* core, float scale)
{
    __shared__ __align__(16) float decay_s[KDA_HEAD_DIM];
    __shared__ __align__(16) float key_s[KDA_HEAD_DIM];
    __shared__ __align__(16) float query_s[KDA_HEAD_DIM];
    const size_t head = blockIdx.x, d = threadIdx.x, channel = head * KDA_HEAD_DIM + d;
    decay_s[d] = expf(gate[channel]);
    key_s[d] = key[channel];
    query_s[d] = query[channel] * scale;
    __syncthreads();
    float* column = state + head * KDA_HEAD_DIM * KDA_HEAD_DIM + d;
    float s[KDA_HEAD_DIM];
    kda_recurrent_load(s, column);
    core[channel] = kda_recurrent_step(s, decay_s, key_s, query_s, value[channel], beta[head]);
    kda_recurrent_store(s, column);
}
"""

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
""".replace("PREFETCH_AHEAD", str(PREFETCH_AHEAD))

DECODE_MAIN = r"""
#include "emulation.h"
""" + HOST_CUDA_RUNTIME + r"""
const float* prefetch_pool;
const float* prefetch_conv_pool;
const int* prefetch_slots;
int prefetch_heads, prefetch_kernel;
std::atomic<long> prefetches{0}, bad_prefetches{0};
using bf16_t = unsigned short;
""" + "".join(kernel_declaration(stem, name) for stem, name in (
    ("conv", "kda_conv_prefill_silu_l2_bf16"), ("gate", "kda_gate_beta_f32"), ("norm", "kda_gated_rmsnorm_sigmoid_bf16"),
    ("decode/decode", "kda_decode_fused_bf16"))) + r"""
extern "C" void host_recurrent_step(const float*, const float*, const float*, const float*, const float*, float*,
                                    float*, float);

// argv: dir, rows, heads, K, bounded, lower bound, l2 eps, norm eps, jitter, pool size. Pool size 0:
// the rows are consecutive tokens of one sequence (paths stages, fused_rows, fused_walk and
// fused_walk_counted); else sequence s (rows s T .. s T + T - 1, T = argv[11] tokens, 1 by default)
// advances slot slots[s] of a pool of that many (paths pool_fused, counting its outputs out, pool_plain,
// and alone: the step for each sequence by itself).
int main(int argc, char** argv)
{
    const std::string dir = argv[1];
    const int rows = std::atoi(argv[2]), heads = std::atoi(argv[3]), kernel = std::atoi(argv[4]);
    const int bounded = std::atoi(argv[5]);
    const float lower_bound = std::atof(argv[6]), l2_eps = std::atof(argv[7]), norm_eps = std::atof(argv[8]);
    jitter = std::atoi(argv[9]);
    const int pool_size = std::atoi(argv[10]);
    const int tokens = argc > 11 ? std::atoi(argv[11]) : 1, sequences = rows / tokens;
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

    const std::initializer_list<const char*> one_sequence = {"fused_walk", "stages", "fused_rows",
                                                             "fused_walk_counted"};
    const std::initializer_list<const char*> pool = {"pool_fused", "pool_plain", "alone"};
    std::vector<float> walk_core;  // the fused walk's core, which the stages path normalises
    for (const std::string path : pool_size ? pool : one_sequence) {
        auto conv_state = conv_start, state = state_start;
        std::vector<bf16_t> conv_out(rows * conv_dim, 0x7FA5), o_norm_out(rows * qkv, 0x7FA5);
        std::vector<float> query(rows * qkv, std::nanf("")), key = query, value = query, gate = query, core = query;
        std::vector<float> beta(rows * heads, std::nanf(""));
        // o_norm_out in the bulk sweep's tile layout, which the pool path writes too (k = qkv).
        const size_t row_groups = (rows + 63) / 64;
        std::vector<bf16_t> x_tiles(row_groups * qkv * 64, 0x7FA5);
        // counted: the words a walk's blocks count their outputs out in (for an o_proj awaiting them).
        std::vector<int> counted = {0, 0};
        // The fused step over rows first.. : `sequences` sequences (slot_list, or the states given
        // when null) of `tokens` tokens each.
        auto fused = [&](int first, int sequences, int tokens, const int* slot_list, float* conv, float* states,
                         int prefetch_ahead = 0, bf16_t* tiles = nullptr, int* outputs_ready = nullptr) {
            // Where the blocks let the next kernel launch (a no-op here): every choice, in turn.
            const int dependents_after = (first + tokens) % 3;
            prefetch_pool = states;
            prefetch_conv_pool = conv;
            prefetch_slots = slot_list;
            prefetch_heads = heads;
            prefetch_kernel = kernel;
            run_grid(dim3{unsigned(heads), unsigned(sequences), 1}, 128, 0, [&] {
                kda_decode_fused_bf16(conv, states, slot_list, qkv_proj.data() + first * conv_dim, conv_w.data(),
                             forget_proj.data() + first * qkv, dt_bias.data(), a_log.data(),
                             beta_logits + first * ld_beta, int(ld_beta), out_gate.data() + first * qkv,
                             norm_w.data(), conv_out.data() + first * conv_dim, query.data() + first * qkv,
                             key.data() + first * qkv, value.data() + first * qkv, gate.data() + first * qkv,
                             beta.data() + first * heads, core.data() + first * qkv,
                             o_norm_out.data() + first * qkv, heads, kernel, tokens, bounded, lower_bound,
                             scale, l2_eps, norm_eps, prefetch_ahead, dependents_after, tiles, outputs_ready);
            });
        };
        if (path == "fused_walk") {
            fused(0, 1, rows, nullptr, conv_state.data(), state.data());
            walk_core = core;
        } else if (path == "fused_walk_counted") {
            fused(0, 1, rows, nullptr, conv_state.data(), state.data(), 0, nullptr, counted.data());
        } else if (path == "fused_rows") {
            for (int t = 0; t < rows; ++t) fused(t, 1, 1, nullptr, conv_state.data(), state.data());
        } else if (path == "stages") {
            // The prefill kernels over the rows, the recurrence a token at a time, the norm of the walk's core.
            run_grid(dim3{unsigned((3 * heads + 3) / 4), unsigned((rows + 63) / 64), 1}, 128, 0, [&] {
                kda_conv_prefill_silu_l2_bf16(conv_state.data(), qkv_proj.data(), conv_w.data(), conv_out.data(),
                                          query.data(), key.data(), value.data(), heads, 128, kernel, rows, l2_eps);
            });
            run_grid(dim3{unsigned(heads), unsigned((rows + 31) / 32), 1}, 128, 0, [&] {
                kda_gate_beta_f32(forget_proj.data(), dt_bias.data(), a_log.data(), beta_logits, int(ld_beta), gate.data(),
                              beta.data(), heads, 128, bounded, lower_bound, rows);
            });
            for (int t = 0; t < rows; ++t) {
                run_grid(dim3{unsigned(heads), 1, 1}, 128, 0, [&] {
                    host_recurrent_step(query.data() + t * qkv, key.data() + t * qkv, value.data() + t * qkv,
                                        gate.data() + t * qkv, beta.data() + t * heads, state.data(),
                                        core.data() + t * qkv, scale);
                });
            }
            run_grid(dim3{unsigned((heads + 3) / 4), unsigned((rows + 3) / 4), 1}, 128, 0, [&] {
                kda_gated_rmsnorm_sigmoid_bf16(walk_core.data(), out_gate.data(), norm_w.data(), o_norm_out.data(), heads,
                                           128, norm_eps, rows);
            });
        } else if (path == "pool_plain") {
            fused(0, sequences, tokens, slots.data(), conv_state.data(), state.data(), PREFETCH_AHEAD, x_tiles.data());
        } else if (path == "pool_fused") {
            fused(0, sequences, tokens, slots.data(), conv_state.data(), state.data(), PREFETCH_AHEAD, x_tiles.data(),
                  counted.data());
        } else if (path == "alone") {
            for (int sequence = 0; sequence < sequences; ++sequence) {
                fused(sequence * tokens, 1, tokens, nullptr, conv_state.data() + slots[sequence] * conv_slot,
                      state.data() + slots[sequence] * state_slot);
            }
        }
        save_each(dir + "/" + path + ".",
                  {"conv_out", "query", "key", "value", "gate", "beta", "core", "o_norm_out", "conv_state", "state"},
                  conv_out, query, key, value, gate, beta, core, o_norm_out, conv_state, state);
        save_each(dir + "/" + path + ".", {"x_tiles", "counted"}, x_tiles, counted);
    }
    std::printf("misaligned=%ld prefetches=%ld bad_prefetches=%ld\n", misaligned.load(), prefetches.load(),
                bad_prefetches.load());
    return 0;
}
""".replace("PREFETCH_AHEAD", str(PREFETCH_AHEAD))


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
        source = host_kernel_source(stem, DEVICE_HELPERS.get(stem, ()))
        if stem == "decode/decode":
            source += RECURRENT_STEP
        files[f"{stem.split('/')[-1]}.cpp"] = '#include "emulation.h"\n' + source
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
    pool_size, sequences = int(extra[1]), rows // (int(extra[2]) if len(extra) > 2 else 1)
    # The pool paths' blocks of sequences s < rows - PREFETCH_AHEAD each ask L2 for the state and the
    # three conv windows of their head in the slot of sequence s + PREFETCH_AHEAD (the counting launch
    # and the plain one); nothing else does.
    prefetches = 2 * 4 * HEADS * max(sequences - PREFETCH_AHEAD, 0) if pool_size else 0
    assert result.stdout.split() == ["misaligned=0", f"prefetches={prefetches}", "bad_prefetches=0"], \
        f"host run: {result.stdout.strip()}"


def run_decode(binary, tokens, bounded, seed, jitter=False):
    """(outputs of the one-sequence paths by name, the random inputs)."""
    rng = np.random.default_rng(seed)
    inputs = _layer_inputs(rng, tokens)
    inputs["conv_state"] = rng.standard_normal((3 * HEADS * DIM, KERNEL)).astype(np.float32)
    inputs["state"] = (0.1 * rng.standard_normal((HEADS, DIM, DIM))).astype(np.float32)
    folder = binary.parent / f"T{tokens}-b{int(bounded)}-{seed}-{int(jitter)}"
    _run_binary(binary, folder, inputs, tokens, bounded, int(jitter), 0)
    layout = _layout(tokens)
    out = {}
    for path in ("stages", "fused_rows", "fused_walk", "fused_walk_counted"):
        out[path] = {name: np.fromfile(folder / f"{path}.{name}", dtype).reshape(shape)
                     for name, (dtype, shape) in layout.items()}
    counted = np.fromfile(folder / "fused_walk_counted.counted", np.int32)
    assert counted.tolist() == [HEADS, 0], (f"T={tokens}: the walk's count of blocks with their outputs out is "
                                            f"{counted.tolist()}, not [{HEADS}, 0]")
    return out, inputs


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "softplus"])
@pytest.mark.parametrize("tokens,jitter", [(1, False), (3, True), (9, False)], ids=lambda v: str(v))
def test_fused_decode_equals_its_stages_on_host(decode_host, tokens, jitter, bounded):
    """The fused step against the prefill kernels and the recurrence's device functions, bit for
    bit, and those against float64."""
    out, inputs = run_decode(decode_host, tokens, bounded, seed=7 * tokens + int(bounded), jitter=jitter)
    stages = out["stages"]
    for path in ("fused_rows", "fused_walk", "fused_walk_counted"):
        for name in OUTPUTS:
            a, b = out[path][name], stages[name]
            differ = int(np.count_nonzero(a.view(np.uint8) != b.view(np.uint8)))
            assert differ == 0, f"T={tokens} {path}: {differ} bytes of {name} differ from the stages' kernels"
    assert np.isfinite(stages["core"]).all() and np.isfinite(stages["gate"]).all()

    # The recurrence against float64, fed the kernels' own vectors.
    core, state = recurrent_scan(*(stages[name].astype(np.float64) for name in ("query", "key", "value", "gate")),
                                 stages["beta"].astype(np.float64), inputs["state"].astype(np.float64))
    ratio = rms_ratio(stages["core"].astype(np.float64), core)
    assert ratio <= 1e-5, f"T={tokens}: core rms-ratio {ratio:.3e} against the float64 recurrence"
    ratio = rms_ratio(stages["state"].astype(np.float64), state)
    assert ratio <= 1e-5, f"T={tokens}: state rms-ratio {ratio:.3e} against the float64 recurrence"

    # The gate, beta and the gated norm against float64, fed the kernels' inputs.
    config = SimpleNamespace(heads=HEADS, head_dim=DIM, bounded=bounded, gate_lower_bound=LOWER_BOUND)
    gate = forget_gate(bits_to_f64(inputs["forget_proj"]), inputs["dt_bias"].astype(np.float64),
                       inputs["a_log"].astype(np.float64), config)
    ratio = rms_ratio(stages["gate"].astype(np.float64), gate)
    assert ratio <= 1e-5, f"T={tokens}: gate rms-ratio {ratio:.3e} against the float64 forget gate"
    ratio = rms_ratio(stages["beta"].astype(np.float64), sigmoid(bits_to_f64(inputs["down_proj"][:, 2 * DIM :])))
    assert ratio <= 1e-6, f"T={tokens}: beta rms-ratio {ratio:.3e} against sigmoid of the logits"
    norm = gated_rmsnorm(stages["core"].astype(np.float64), bits_to_f64(inputs["out_gate"]),
                         bits_to_f64(inputs["norm_w"]), NORM_EPS)
    ratio = rms_ratio(bits_to_f64(stages["o_norm_out"]).reshape(tokens, -1), round_bf16(norm))
    assert ratio <= 1e-3, f"T={tokens}: o_norm_out rms-ratio {ratio:.3e} against the float64 gated norm (bound 1e-3)"


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "softplus"])
@pytest.mark.parametrize("sequences", [1, 5, 33], ids=lambda v: f"B{v}")
def test_pool_sequences_equal_each_alone_on_host(decode_host, sequences, bounded):
    rng = np.random.default_rng(100 + sequences + int(bounded))
    conv_dim, pool_size = 3 * HEADS * DIM, sequences + 3
    inputs = _layer_inputs(rng, sequences)
    inputs["conv_state"] = rng.standard_normal((pool_size, conv_dim, KERNEL)).astype(np.float32)
    inputs["state"] = (0.1 * rng.standard_normal((pool_size, HEADS, DIM, DIM))).astype(np.float32)
    inputs["slots"] = rng.permutation(pool_size)[:sequences].astype(np.int32)
    folder = decode_host.parent / f"pool-B{sequences}-b{int(bounded)}"
    _run_binary(decode_host, folder, inputs, sequences, bounded, 0, pool_size)
    layout = {**_layout(sequences), "conv_state": (np.float32, (pool_size, conv_dim, KERNEL)),
              "state": (np.float32, (pool_size, HEADS, DIM, DIM))}
    out = {path: {name: np.fromfile(folder / f"{path}.{name}", dtype).reshape(shape) for name, (dtype, shape) in layout.items()}
           for path in ("pool_fused", "pool_plain", "alone")}
    for path in ("pool_fused", "pool_plain"):
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
    x tiles) in one launch, plain and counting its outputs out: every row, state and x tile as each
    sequence's walk alone writes it, one count per block."""
    sequences, tokens = 17, 4
    rows, conv_dim, pool_size = sequences * tokens, 3 * HEADS * DIM, sequences + 3
    rng = np.random.default_rng(300)
    inputs = _layer_inputs(rng, rows)
    inputs["conv_state"] = rng.standard_normal((pool_size, conv_dim, KERNEL)).astype(np.float32)
    inputs["state"] = (0.1 * rng.standard_normal((pool_size, HEADS, DIM, DIM))).astype(np.float32)
    inputs["slots"] = rng.permutation(pool_size)[:sequences].astype(np.int32)
    folder = decode_host.parent / "pool-walk"
    _run_binary(decode_host, folder, inputs, rows, True, 0, pool_size, tokens)
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
    assert np.fromfile(folder / "pool_fused.counted", np.int32).tolist() == [HEADS * sequences, 0]
