"""kernels_src/decode_persistent.cu on the host (tests/host_cuda.py): the one-launch decode of one
sequence, its task table from glm_kda.persistent, against the separate launches it replaces
(gemm_rows.cu for f_a|g_a|b, q|k|v, f_b, g_b and o_proj, decode.cu for the fused step) compiled
into the same host binary, so CPU CI runs the kernel's ticket loop, waits, o_proj k-range
partials and their ordered sum, the two heads per step task and the counter reset.

The host runs the blocks of a grid one after the other: the first block takes every ticket (each
wait is then met by its own earlier tasks, which the table guarantees), the others find the
tickets gone and leave, and the last one out resets the counters. Host bits are compared with host
bits (the mma is emulated in float64): every stage buffer, the output and both states must be
equal, and the counters zero after the launch. Dropping o_proj's last k range or sharing one head's
shared memory between the two heads of a step task fails it; the ORDER in which the k-range
partials are added shows only where it moves a BF16 output across a rounding boundary, which these
sizes do not reach (a reversed order passed), so that order rests on the kernel's comment and the
GPU bit test.
"""

from __future__ import annotations

import signal
import subprocess

import numpy as np
import pytest

from glm_kda import persistent
from host_cuda import (COMMON_DEVICE_HELPERS, HOST_CUDA_RUNTIME, STAGED_STATE_HELPERS, bf16_bits, build_host_binary,
                       host_decode_source, host_kernel_source, kernel_macro)
from test_gemm_rows_host import DEVICE_HELPERS as GEMM_DEVICE_HELPERS
from test_gemm_rows_host import GEMM_HEADER, host_gemm_rows_source

DIM, KERNEL = 128, 4
HELPERS = (*GEMM_DEVICE_HELPERS, "prefetch_floats_l2", "global_timer_ns", *STAGED_STATE_HELPERS)

PERSISTENT_HEADER = GEMM_HEADER + r"""
inline void prefetch_floats_l2(const float*, int, int) {}
inline unsigned long long global_timer_ns() { return 0; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
"""

MAIN = r"""
#include "emulation.h"
""" + HOST_CUDA_RUNTIME + r"""
MmaSlot mma_slots[32][32];
using bf16_t = unsigned short;
extern "C" void gemm_rows_bf16_m1_n4(const bf16_t*, int, const bf16_t*, bf16_t*, int, int, int, int, int);
""" + kernel_macro("decode", "KDA_DECODE_FUSED_PARAMETERS") + r"""
extern "C" void kda_decode_fused_bf16(KDA_DECODE_FUSED_PARAMETERS);
extern "C" void kda_decode_persistent_bf16(
    int*, int, const int*, int, int, const bf16_t*, int, const bf16_t*, bf16_t*, int, const bf16_t*, bf16_t*,
    const bf16_t*, bf16_t*, const bf16_t*, bf16_t*, const bf16_t*, float*, bf16_t*, float*, float*, const int*,
    const bf16_t*, const float*, const float*, const bf16_t*, bf16_t*, float*, float*, float*, float*, float*, float*,
    bf16_t*, int, int, int, float, float, float, float, unsigned long long*);

struct Buffers {
    std::vector<bf16_t> down_proj, qkv_proj, forget_proj, out_gate, conv_out, o_norm_out, final_out;
    std::vector<float> query, key, value, gate, beta, core, conv_state, state;
};

// argv: dir, rows, hidden, heads, bounded, lower bound, grid, tasks, counters, out range k
int main(int argc, char** argv)
{
    const std::string dir = argv[1];
    const int rows = std::atoi(argv[2]), hidden = std::atoi(argv[3]), heads = std::atoi(argv[4]);
    const int bounded = std::atoi(argv[5]);
    const float lower_bound = std::atof(argv[6]);
    const int grid = std::atoi(argv[7]), task_count = std::atoi(argv[8]), counter_count = std::atoi(argv[9]);
    const int out_range_k = std::atoi(argv[10]);
    const int D = 128, K = 4, qkv = heads * D, conv_dim = 3 * qkv, down_dim = 2 * D + heads;
    const float scale = 1.0f / std::sqrt(float(D)), l2_eps = 1e-6f, norm_eps = 1e-5f;
    const auto hidden_rows = load_u16(dir + "/hidden", size_t(rows) * hidden);
    const auto down_w = load_u16(dir + "/down_w", size_t(down_dim) * hidden);
    const auto qkv_w = load_u16(dir + "/qkv_w", size_t(conv_dim) * hidden);
    const auto f_b = load_u16(dir + "/f_b", size_t(qkv) * D);
    const auto g_b = load_u16(dir + "/g_b", size_t(qkv) * D);
    const auto o_w = load_u16(dir + "/o_w", size_t(hidden) * qkv);
    const auto conv_w = load_u16(dir + "/conv_w", size_t(conv_dim) * K);
    const auto norm_w = load_u16(dir + "/norm_w", D);
    const auto dt_bias = load(dir + "/dt_bias", qkv);
    const auto a_log = load(dir + "/a_log", heads);
    const auto conv_start = load(dir + "/conv_state", size_t(conv_dim) * K);
    const auto state_start = load(dir + "/state", size_t(heads) * D * D);
    const auto tasks = load_as<int>(dir + "/tasks", size_t(task_count) * 8);

    auto fresh = [&] {
        Buffers b;
        b.down_proj.assign(size_t(rows) * down_dim, 0);
        b.qkv_proj.assign(size_t(rows) * conv_dim, 0);
        b.forget_proj.assign(size_t(rows) * qkv, 0);
        b.out_gate.assign(size_t(rows) * qkv, 0);
        b.conv_out.assign(size_t(rows) * conv_dim, 0);
        b.o_norm_out.assign(size_t(rows) * qkv, 0);
        b.final_out.assign(size_t(rows) * hidden, 0);
        for (auto* v : {&b.query, &b.key, &b.value, &b.gate, &b.core}) v->assign(size_t(rows) * qkv, 0.0f);
        b.beta.assign(size_t(rows) * heads, 0.0f);
        b.conv_state = conv_start;
        b.state = state_start;
        return b;
    };
    auto gemm = [&](const bf16_t* x, int ldx, const std::vector<bf16_t>& w, bf16_t* y, int ldy, int n, int k) {
        run_grid(dim3{1, 1, 1}, 256, 0, [&] { gemm_rows_bf16_m1_n4(x, ldx, w.data(), y, ldy, rows, n, k, 0); });
    };

    // The separate launches.
    Buffers s = fresh();
    gemm(hidden_rows.data(), hidden, down_w, s.down_proj.data(), down_dim, down_dim, hidden);
    gemm(hidden_rows.data(), hidden, qkv_w, s.qkv_proj.data(), conv_dim, conv_dim, hidden);
    gemm(s.down_proj.data(), down_dim, f_b, s.forget_proj.data(), qkv, qkv, D);
    gemm(s.down_proj.data() + D, down_dim, g_b, s.out_gate.data(), qkv, qkv, D);
    run_grid(dim3{unsigned(heads), 1, 1}, 128, 0, [&] {
        kda_decode_fused_bf16(s.conv_state.data(), s.state.data(), nullptr, s.qkv_proj.data(), conv_w.data(),
                              s.forget_proj.data(), dt_bias.data(), a_log.data(), s.down_proj.data() + 2 * D, down_dim,
                              s.out_gate.data(), norm_w.data(), s.conv_out.data(), s.query.data(), s.key.data(),
                              s.value.data(), s.gate.data(), s.beta.data(), s.core.data(), s.o_norm_out.data(), heads,
                              K, rows, bounded, lower_bound, scale, l2_eps, norm_eps, 0, 0, nullptr, nullptr,
                              1, nullptr);
    });
    gemm(s.o_norm_out.data(), qkv, o_w, s.final_out.data(), hidden, hidden, qkv);

    // The persistent launch.
    Buffers p = fresh();
    std::vector<int> counters(counter_count, 0);
    std::vector<float> out_partial(size_t(8) * rows * hidden, std::nanf(""));
    run_grid(dim3{unsigned(grid), 1, 1}, 256, size_t(2) * rows * out_range_k, [&] {
        kda_decode_persistent_bf16(
            counters.data(), counter_count, tasks.data(), task_count, rows, hidden_rows.data(), hidden, down_w.data(),
            p.down_proj.data(), down_dim, qkv_w.data(), p.qkv_proj.data(), f_b.data(), p.forget_proj.data(),
            g_b.data(), p.out_gate.data(), o_w.data(), out_partial.data(), p.final_out.data(), p.conv_state.data(),
            p.state.data(), nullptr, conv_w.data(), dt_bias.data(), a_log.data(), norm_w.data(), p.conv_out.data(),
            p.query.data(), p.key.data(), p.value.data(), p.gate.data(), p.beta.data(), p.core.data(),
            p.o_norm_out.data(), heads, K, bounded, lower_bound, scale, l2_eps, norm_eps, nullptr);
    });
    for (const auto* b : {&s, &p}) {
        const std::string prefix = dir + (b == &s ? "/separate_" : "/persistent_");
        save_each(prefix, {"down_proj", "qkv_proj", "forget_proj", "out_gate", "conv_out", "o_norm_out", "final_out"},
                  b->down_proj, b->qkv_proj, b->forget_proj, b->out_gate, b->conv_out, b->o_norm_out, b->final_out);
        save_each(prefix, {"query", "key", "value", "gate", "beta", "core", "conv_state", "state"}, b->query, b->key,
                  b->value, b->gate, b->beta, b->core, b->conv_state, b->state);
    }
    save(dir + "/counters", counters);
    std::printf("misaligned=%ld\n", misaligned.load());
    return 0;
}
"""

BF16_OUTPUTS = ("down_proj", "qkv_proj", "forget_proj", "out_gate", "conv_out", "o_norm_out", "final_out")
F32_OUTPUTS = ("query", "key", "value", "gate", "beta", "core", "conv_state", "state")


def _build_persistent(folder, max_polls=None):
    """The host binary; max_polls: KDA_MAX_POLLS in every translation unit (a short wait traps soon)."""
    kernel = host_kernel_source("decode_persistent", HELPERS)
    declaration = "extern __shared__ __align__(16) bf16_t out_x_shared[];"
    assert declaration in kernel, "decode_persistent.cu no longer declares out_x_shared; update the host emulation"
    kernel = kernel.replace(declaration, "bf16_t* out_x_shared = reinterpret_cast<bf16_t*>(emulated_shared);")
    files = {
        "emulation.h": PERSISTENT_HEADER,
        "main.cpp": MAIN,
        "persistent.cpp": '#include "emulation.h"\n' + kernel,
        "gemm_rows.cpp": host_gemm_rows_source(),
        "decode.cpp": '#include "emulation.h"\n' + host_decode_source(("prefetch_floats_l2", *COMMON_DEVICE_HELPERS)),
    }
    if max_polls is not None:
        files = {name: text.replace("#define KDA_MAX_POLLS (1 << 26)", f"#define KDA_MAX_POLLS {max_polls}")
                 for name, text in files.items()}
    return build_host_binary(folder, "persistent_host", files)


@pytest.fixture(scope="module")
def persistent_host(tmp_path_factory):
    return _build_persistent(tmp_path_factory.mktemp("persistent_host"))


@pytest.mark.parametrize("hidden,heads,rows,grid,bounded", [
    (256, 8, 1, 1, True), (256, 8, 3, 2, False), (512, 8, 2, 3, True),
], ids=lambda v: str(v))
def test_persistent_launch_equals_the_separate_launches_on_host(persistent_host, tmp_path, hidden, heads, rows, grid,
                                                                bounded):
    result = _run(persistent_host, tmp_path, hidden, heads, rows, grid, bounded)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "misaligned=0" in result.stdout, result.stdout
    for name in BF16_OUTPUTS + F32_OUTPUTS:
        dtype = np.uint16 if name in BF16_OUTPUTS else np.uint32
        separate = np.fromfile(tmp_path / f"separate_{name}", dtype)
        ours = np.fromfile(tmp_path / f"persistent_{name}", dtype)
        assert separate.size == ours.size > 0, name
        differ = int((separate != ours).sum())
        assert differ == 0, f"{name}: {differ} of {ours.size} elements differ between the persistent and separate launches"
    counters = np.fromfile(tmp_path / "counters", np.int32)
    assert not counters.any(), f"counters left after the launch: {counters.tolist()}"


def test_a_task_waits_for_its_whole_target_on_host(tmp_path_factory, tmp_path):
    """A table whose first wait asks one signal more than its counter ever gets: the launch must trap
    (KDA_MAX_POLLS cut to 4096 polls), not run the task once the counter is one short."""
    binary = _build_persistent(tmp_path_factory.mktemp("persistent_host_polls"), max_polls=4096)

    def one_more(tasks):
        first = int(np.flatnonzero(tasks[:, 3] >= 0)[0])
        tasks[first, 4] += 1

    result = _run(binary, tmp_path, 256, 8, 1, 1, True, edit_tasks=one_more)
    assert result.returncode == -signal.SIGABRT, f"rc {result.returncode}: a task ran before its counter was met"


def _run(binary, tmp_path, hidden, heads, rows, grid, bounded, edit_tasks=None):
    rng = np.random.default_rng(hidden + 7 * heads + rows)
    qkv, conv_dim, down_dim = heads * DIM, 3 * heads * DIM, 2 * DIM + heads
    inputs = {
        "hidden": bf16_bits(rng.standard_normal((rows, hidden))),
        "down_w": bf16_bits(rng.standard_normal((down_dim, hidden)) / np.sqrt(hidden)),
        "qkv_w": bf16_bits(rng.standard_normal((conv_dim, hidden)) * 2.0 / np.sqrt(hidden)),
        "f_b": bf16_bits(rng.standard_normal((qkv, DIM)) / np.sqrt(DIM)),
        "g_b": bf16_bits(rng.standard_normal((qkv, DIM)) / np.sqrt(DIM)),
        "o_w": bf16_bits(rng.standard_normal((hidden, qkv)) / np.sqrt(qkv)),
        "conv_w": bf16_bits(rng.standard_normal((conv_dim, KERNEL)) * 0.5),
        "norm_w": bf16_bits(1.0 + 0.1 * rng.standard_normal(DIM)),
        "dt_bias": rng.standard_normal(qkv).astype(np.float32),
        "a_log": rng.uniform(-1.0, 1.0, heads).astype(np.float32),
        "conv_state": rng.standard_normal(conv_dim * KERNEL).astype(np.float32),
        "state": (0.1 * rng.standard_normal(heads * DIM * DIM)).astype(np.float32),
    }
    schedule = persistent.build_schedule(hidden, heads)
    inputs["tasks"] = schedule.tasks.astype(np.int32)
    if edit_tasks is not None:
        edit_tasks(inputs["tasks"])
    for name, array in inputs.items():
        np.ascontiguousarray(array).tofile(tmp_path / name)
    result = subprocess.run(
        [str(binary), str(tmp_path), str(rows), str(hidden), str(heads), str(int(bounded)), "-5.0", str(grid),
         str(len(schedule.tasks)), str(schedule.counter_count), str(schedule.out_range_k)],
        capture_output=True, text=True, timeout=600)
    return result
