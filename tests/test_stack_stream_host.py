"""The persistent stack kernel (kernels_src/decode/stack_stream.cu) on the host (tests/host_cuda.py), its
blocks all at once as a cooperative launch runs them, against the layers' own kernels run one after the
other on the host: the row projection's one-row entry (gemm_rows.cu) for down_proj, q|k|v, f_b, g_b and
o_proj, and the fused step (decode.cu), layer after layer, the output of one the input of the next.

Promises tested over two tokens and a ring of two slots, for both gate laws: three layers on three blocks
(two of them stepping two heads each), one layer on two (one stepping, a conv of two taps), two layers on
four (three stepping; o_proj's column groups two tiles wide):
  * the same bits: each token's output, every layer's conv and recurrent state after each token, and
    the last layer's stage rows (its projections, conv output, q, k, v, gate, beta, core, o_norm_out);
  * the counters the blocks wait on are zero again after each launch (the second token waits on them);
  * no bulk copy or vector access misaligned.
The host mma sums its products in float64 (tests/test_gemm_rows_host.py): host bits are compared with
host bits, never with a GPU's.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from glm_kda.gpu.ops import stack_stream
from glm_kda.gpu.projection import PackedWeight, pack_weight
from host_cuda import (HOST_CUDA_RUNTIME, MBARRIER_HELPERS, MBARRIER_SHIMS, bf16_bits, build_host_binary,
                       host_kernel_source, kernel_declaration)
from test_gemm_rows_host import DEVICE_HELPERS as GEMM_DEVICE_HELPERS
from test_gemm_rows_host import GEMM_HEADER

HIDDEN = 64
D = 128
TOKENS = 2
SLOTS = 2
STEP_HELPERS = ("prefetch_floats_l2",)
# The last layer's stage rows compared, by element type.
STAGES = {**{name: np.uint16 for name in ("down_proj", "qkv_proj", "forget_proj", "out_gate", "conv_out",
                                          "o_norm_out")},
          **{name: np.float32 for name in ("query", "key", "value", "gate", "beta", "core")}}

# The row projection's host header, its mma slots one set a block (the blocks run at once here).
_SLOTS_DECLARATION = "extern MmaSlot mma_slots[32][32];"
assert _SLOTS_DECLARATION in GEMM_HEADER, "test_gemm_rows_host.GEMM_HEADER changed; update this header"
HEADER = GEMM_HEADER.replace(_SLOTS_DECLARATION, "extern MmaSlot block_mma_slots[8][32][32];\n"
                             "#define mma_slots block_mma_slots[blockIdx.x]") + r"""
inline void prefetch_floats_l2(const float*, int, int) {}
""" + MBARRIER_SHIMS

MAIN = HOST_CUDA_RUNTIME + r"""
MmaSlot block_mma_slots[8][32][32];
// (A macro defines the row projection's entries: declared as tests/test_gemm_rows_host.py declares them.)
extern "C" void kda_gemm_rows_packed_bf16_m1_n1(const bf16_t*, int, const bf16_t*, bf16_t*, int, int, int, int, int);
""" + kernel_declaration("decode/decode", "kda_decode_fused_bf16") + r"""
template <class T> static std::vector<T> load_all(const std::string& path)
{
    std::ifstream file(path, std::ios::binary | std::ios::ate);
    const size_t bytes = file.tellg();
    return load_as<T>(path, bytes / sizeof(T));
}

struct Layer {
    std::vector<bf16_t> weights[5], conv_w, norm_w;
    std::vector<float> dt_bias, a_log, conv_state, state;
};

// argv: dir, layers, tokens, hidden, heads, K, blocks, slots, slot bytes, shared bytes, bounded, lower bound, jitter
int main(int argc, char** argv)
{
    const std::string dir = argv[1];
    const int layers = std::atoi(argv[2]), tokens = std::atoi(argv[3]), hidden = std::atoi(argv[4]);
    const int heads = std::atoi(argv[5]), kernel = std::atoi(argv[6]), blocks = std::atoi(argv[7]);
    const int slots = std::atoi(argv[8]), slot_bytes = std::atoi(argv[9]);
    const size_t shared = std::strtoull(argv[10], nullptr, 10);
    const int bounded = std::atoi(argv[11]);
    const float lower_bound = std::atof(argv[12]);
    jitter = std::atoi(argv[13]);
    const int D = 128, width = heads * D, down_dim = 2 * D + heads;
    const float scale = 1.0f / std::sqrt(float(D)), l2_eps = 1e-6f, norm_eps = 1e-5f;
    const int dims[5][2] = {{down_dim, hidden}, {3 * width, hidden}, {width, D}, {width, D}, {hidden, width}};
    std::vector<Layer> model(layers);
    for (int l = 0; l < layers; ++l) {
        const std::string p = dir + "/layer" + std::to_string(l) + "_";
        for (int w = 0; w < 5; ++w) model[l].weights[w] = load_all<bf16_t>(p + "w" + std::to_string(w));
        model[l].conv_w = load_all<bf16_t>(p + "conv_w");
        model[l].norm_w = load_all<bf16_t>(p + "norm_w");
        model[l].dt_bias = load_all<float>(p + "dt_bias");
        model[l].a_log = load_all<float>(p + "a_log");
        model[l].conv_state = load_all<float>(p + "conv_state");
        model[l].state = load_all<float>(p + "state");
    }
    const auto x = load_all<bf16_t>(dir + "/x");
    for (const std::string path : {"layers", "stream"}) {
        std::vector<Layer> run = model;
        std::vector<bf16_t> down(down_dim, 0x7FA5), qkv(3 * width, 0x7FA5), forget(width, 0x7FA5);
        std::vector<bf16_t> gate_out(width, 0x7FA5);
        std::vector<bf16_t> final_out(hidden, 0x7FA5), conv_out(3 * width, 0x7FA5), o_norm(width, 0x7FA5);
        std::vector<float> query(width, std::nanf("")), key = query, value = query, gate = query, core = query;
        std::vector<float> beta(heads, std::nanf(""));
        std::vector<bf16_t> outputs;
        std::vector<int> counters(layers * 5 + 1, 0);
        bool counters_cleared = true;
        for (int t = 0; t < tokens; ++t) {
            const bf16_t* token = x.data() + size_t(t) * hidden;
            if (path == "layers") {
                auto gemm = [&](const bf16_t* in, int w, bf16_t* out, Layer& layer) {
                    run_grid(dim3{4, 1, 1}, 256, 0, [&] {
                        kda_gemm_rows_packed_bf16_m1_n1(in, dims[w][1], layer.weights[w].data(), out, dims[w][0], 1,
                                                         dims[w][0], dims[w][1], 0);
                    });
                };
                const bf16_t* in = token;
                for (int l = 0; l < layers; ++l) {
                    Layer& layer = run[l];
                    gemm(in, 0, down.data(), layer);
                    gemm(in, 1, qkv.data(), layer);
                    gemm(down.data(), 2, forget.data(), layer);
                    gemm(down.data() + D, 3, gate_out.data(), layer);
                    run_grid(dim3{unsigned(heads), 1, 1}, 128, 0, [&] {
                        kda_decode_fused_bf16(layer.conv_state.data(), layer.state.data(), nullptr, qkv.data(),
                                              layer.conv_w.data(), forget.data(), layer.dt_bias.data(),
                                              layer.a_log.data(), down.data() + 2 * D, down_dim, gate_out.data(),
                                              layer.norm_w.data(), conv_out.data(), query.data(), key.data(),
                                              value.data(), gate.data(), beta.data(), core.data(), o_norm.data(),
                                              heads, kernel, 1, bounded, lower_bound, scale, l2_eps, norm_eps, 0, 0,
                                              nullptr, nullptr);
                    });
                    gemm(o_norm.data(), 4, final_out.data(), layer);
                    in = final_out.data();
                }
            } else {
                std::vector<unsigned long long> table;
                for (void* row : {(void*)down.data(), (void*)qkv.data(), (void*)forget.data(), (void*)gate_out.data(),
                                  (void*)final_out.data(), (void*)conv_out.data(), (void*)query.data(),
                                  (void*)key.data(), (void*)value.data(), (void*)gate.data(), (void*)beta.data(),
                                  (void*)core.data(), (void*)o_norm.data()}) {
                    table.push_back(reinterpret_cast<uintptr_t>(row));
                }
                for (Layer& layer : run) {
                    for (int w = 0; w < 5; ++w) table.push_back(reinterpret_cast<uintptr_t>(layer.weights[w].data()));
                    for (void* p : {(void*)layer.conv_w.data(), (void*)layer.dt_bias.data(), (void*)layer.a_log.data(),
                                    (void*)layer.norm_w.data(), (void*)layer.conv_state.data(),
                                    (void*)layer.state.data()}) {
                        table.push_back(reinterpret_cast<uintptr_t>(p));
                    }
                }
                run_grid_concurrent(dim3{unsigned(blocks), 1, 1}, KDA_STREAM_THREADS, shared, [&] {
                    kda_stack_stream_bf16(token, reinterpret_cast<const KdaStreamRows*>(table.data()), layers, hidden,
                                          heads, down_dim, kernel, bounded, lower_bound, scale, l2_eps, norm_eps,
                                          counters.data(), slots, slot_bytes);
                });
                for (int c : counters) counters_cleared = counters_cleared && c == 0;
            }
            outputs.insert(outputs.end(), final_out.begin(), final_out.end());
        }
        const std::string out = dir + "/" + path + "_";
        save(out + "outputs", outputs);
        for (int l = 0; l < layers; ++l) {
            save(out + "conv_state" + std::to_string(l), run[l].conv_state);
            save(out + "state" + std::to_string(l), run[l].state);
        }
        save_each(out, {"down_proj", "qkv_proj", "forget_proj", "out_gate", "conv_out", "o_norm_out"}, down, qkv,
                  forget, gate_out, conv_out, o_norm);
        save_each(out, {"query", "key", "value", "gate", "beta", "core"}, query, key, value, gate, beta, core);
        if (path == "stream") std::printf("counters_cleared=%d\n", int(counters_cleared));
    }
    std::printf("misaligned=%ld\n", misaligned.load());
    return 0;
}
"""


@pytest.fixture(scope="module")
def stack_host(tmp_path_factory):
    stream = host_kernel_source("decode/stack_stream", GEMM_DEVICE_HELPERS + STEP_HELPERS + MBARRIER_HELPERS)
    declaration = "extern __shared__ __align__(128) unsigned char kda_stream_ring[];"
    assert declaration in stream, "stack_stream.cu no longer declares kda_stream_ring so; update the host emulation"
    stream = stream.replace(declaration, "unsigned char* kda_stream_ring = shared_bytes();")
    files = {
        "emulation.h": HEADER,
        "gemm_rows.cpp": '#include "emulation.h"\n' + host_kernel_source("projection/gemm_rows", GEMM_DEVICE_HELPERS),
        "decode.cpp": '#include "emulation.h"\n' + host_kernel_source("decode/decode", STEP_HELPERS),
        "stack_stream.cpp": '#include "emulation.h"\n' + stream + MAIN,
    }
    return build_host_binary(tmp_path_factory.mktemp("stack_stream_host"), "stack_stream_host", files)


def _bf16(rng, shape, scale):
    return bf16_bits(rng.standard_normal(shape) * scale)


@pytest.mark.parametrize("heads,kernel,layers,blocks,bounded", [
    (4, 4, 3, 3, False), (4, 4, 3, 3, True),  # two blocks stepping two heads each, one without a step
    (2, 2, 1, 2, False),                      # one layer, one block stepping, a conv of two taps
    (6, 3, 2, 4, True),                       # three blocks stepping, o_proj's column groups of two tiles
])
def test_stack_stream_gives_the_layers_bits(stack_host, tmp_path, heads, kernel, layers, blocks, bounded):
    rng = np.random.default_rng(5 + heads + bounded)
    width, down_dim = heads * D, 2 * D + heads
    shapes = stack_stream.projection_shapes(HIDDEN, heads, down_dim)
    for layer in range(layers):
        prefix = tmp_path / f"layer{layer}_"
        for index, (n, k) in enumerate(shapes):
            pack_weight(_bf16(rng, (n, k), k**-0.5)).data.tofile(f"{prefix}w{index}")
        _bf16(rng, (3 * width, kernel), 0.5).tofile(f"{prefix}conv_w")
        _bf16(rng, (D,), 1.0).tofile(f"{prefix}norm_w")
        rng.standard_normal(width).astype(np.float32).tofile(f"{prefix}dt_bias")
        (rng.standard_normal(heads) * 0.5).astype(np.float32).tofile(f"{prefix}a_log")
        rng.standard_normal((3 * width, kernel)).astype(np.float32).tofile(f"{prefix}conv_state")
        (rng.standard_normal((heads, D, D)) * 0.05).astype(np.float32).tofile(f"{prefix}state")
    _bf16(rng, (TOKENS, HIDDEN), 1.0).tofile(tmp_path / "x")
    slot_bytes = -(-max(stack_stream.group_bytes(n, k) for n, k in shapes) // 128) * 128
    shared = stack_stream.shared_bytes(HIDDEN, heads, SLOTS, slot_bytes)
    result = subprocess.run([str(stack_host), str(tmp_path), str(layers), str(TOKENS), str(HIDDEN), str(heads),
                             str(kernel), str(blocks), str(SLOTS), str(slot_bytes), str(shared), str(int(bounded)),
                             "-5.0", "1"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "misaligned=0" in result.stdout and "counters_cleared=1" in result.stdout, result.stdout

    def pair(name, dtype):
        layers, stream = (np.fromfile(tmp_path / f"{path}_{name}", dtype) for path in ("layers", "stream"))
        assert layers.size and layers.size == stream.size, name
        return layers, stream

    names = {"outputs": np.uint16, **STAGES}
    names.update({f"{kind}{layer}": np.float32 for kind in ("conv_state", "state") for layer in range(layers)})
    for name, dtype in names.items():
        layers, stream = pair(name, dtype)
        bits = np.uint16 if dtype == np.uint16 else np.uint32
        differ = np.flatnonzero(layers.view(bits) != stream.view(bits))
        assert differ.size == 0, f"{name}: {differ.size} elements differ from the layers' kernels, first {differ[:5]}"
    assert np.isfinite(np.fromfile(tmp_path / "stream_core", np.float32)).all()


# The launch's plan and table, in Python -----------------------------------------------------------------
def test_the_ring_fits_kimi_linear_and_not_glm():
    """Kimi-Linear's largest column group (o_proj, k = 4096) is 64 KB: three slots fit 227 KB of shared
    memory beside the rest; GLM-5.3-Flash's o_proj groups are 128 KB, one slot: no plan."""
    from glm_kda.synthetic import synthetic_config

    limit = 227 << 10
    kimi = synthetic_config("kimi")
    ring = stack_stream.plan(kimi.hidden, kimi.heads, kimi.down_dim, limit)
    assert ring is not None and (ring.slots, ring.slot_bytes) == (3, 64 << 10), ring
    assert ring.shared_bytes == stack_stream.shared_bytes(kimi.hidden, kimi.heads, 3, 64 << 10) <= limit
    assert stack_stream.shared_bytes(kimi.hidden, kimi.heads, 4, 64 << 10) > limit
    glm = synthetic_config("glm")
    assert stack_stream.group_bytes(glm.hidden, glm.qkv) == 128 << 10
    assert stack_stream.plan(glm.hidden, glm.heads, glm.down_dim, limit) is None


def test_the_table_holds_the_rows_then_each_layers_arrays_in_the_kernels_order():
    from types import SimpleNamespace

    def array(address):
        return SimpleNamespace(data=SimpleNamespace(ptr=address))

    rows = {name: array(100 + i) for i, name in enumerate(stack_stream.ROW_NAMES)}
    names = (*stack_stream.PROJECTIONS, "conv_w", "dt_bias", "a_log", "norm_w", "conv_state", "state")
    layers = [{name: array(1000 * (layer + 1) + i) for i, name in enumerate(names)} for layer in range(2)]
    layers[1]["o_proj"] = PackedWeight(array(5000), 8, 32)
    table = stack_stream.call_table(rows, layers)
    assert table.dtype == np.uint64 and table.size == 13 + 2 * 11
    assert list(table[:13]) == list(range(100, 113))
    assert list(table[13:24]) == list(range(1000, 1011))
    assert table[24 + 4] == 5000  # a PackedWeight: its data's address


def test_the_one_launch_applies_to_hopper_layers_with_packed_weights_and_no_timer():
    from types import SimpleNamespace

    from glm_kda.gpu import build
    from glm_kda.gpu.streamed_decode import StreamedDecode
    from glm_kda.options import KdaOptions
    from glm_kda.synthetic import synthetic_config

    packed = {name: PackedWeight(None, 8, 32) for name in stack_stream.PROJECTIONS}
    layers = [SimpleNamespace(config=synthetic_config("kimi"), device_id=0, _generation=0, options=KdaOptions(),
                              _o_proj_sums=None, _packed=dict(packed)) for _ in range(3)]
    streamed = StreamedDecode(layers)
    if streamed.plan is None:  # (no cooperative launch without a GPU: plan as on an H100)
        c = layers[0].config
        streamed.plan = stack_stream.plan(c.hidden, c.heads, c.down_dim, 227 << 10)
    assert streamed.applies()
    for change, undo in ((lambda l: setattr(l, "options", KdaOptions(hopper=False)),
                          lambda l: setattr(l, "options", KdaOptions())),
                         (lambda l: setattr(l, "_o_proj_sums", object()), lambda l: setattr(l, "_o_proj_sums", None)),
                         (lambda l: l._packed.pop("f_b"), lambda l: l._packed.update(packed))):
        change(layers[1])
        layers[1]._generation += 1
        assert not streamed.applies()
        undo(layers[1])
        layers[1]._generation += 1
        assert streamed.applies()
    with build.timing():
        assert not streamed.applies()
    assert streamed.applies()
