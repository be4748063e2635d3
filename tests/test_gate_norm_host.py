"""kernels_src/gate.cu and norm.cu over many tokens (the prefill launches: 32 and 4 tokens a
block) on the host (tests/host_cuda.py).

Promises tested, for T not a multiple of the block's tokens: the gate (both laws; dt_bias per
channel, A_log per head) and beta are the float64 oracle's (glm_kda.reference.forget_gate,
sigmoid) within FP32 rounding; the gated norm is the oracle's gated_rmsnorm rounded to BF16
within the stage bound; input rows >= T (poisoned) are never read and output rows >= T never
written; no vector access is misaligned. The beta logits are read through a row stride, as
the layer reads them from down_proj.
"""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

from glm_kda.reference import forget_gate, gated_rmsnorm, rms_ratio, round_bf16, sigmoid
from host_cuda import (HOST_CUDA_HEADER, HOST_CUDA_RUNTIME, bf16_bits, bits_to_f64, build_host_binary,
                       host_kernel_source)

HEADS = 2
DIM = 128
LOWER_BOUND = -5.0
NORM_EPS = 1e-5
POISON_BF16 = 0x7FA5
UNTOUCHED = 12345.0

GATE_NORM_MAIN = r"""
#include "emulation.h"
""" + HOST_CUDA_RUNTIME + r"""
using bf16_t = unsigned short;
extern "C" void kda_gate_beta_f32(const bf16_t*, const float*, const float*, const bf16_t*, int, float*, float*, int, int,
                              int, float, int);
extern "C" void kda_gated_rmsnorm_sigmoid_bf16(const float*, const bf16_t*, const bf16_t*, bf16_t*, int, int, float, int);

int main(int argc, char** argv)
{
    const std::string dir = argv[1];
    const int tokens = std::atoi(argv[2]), rows = std::atoi(argv[3]), heads = std::atoi(argv[4]);
    const int bounded = std::atoi(argv[5]), ld_beta = std::atoi(argv[6]);
    const float lower_bound = std::atof(argv[7]), eps = std::atof(argv[8]);
    const size_t qkv = size_t(heads) * 128;
    const auto forget_proj = load_u16(dir + "/forget_proj", rows * qkv);
    const auto beta_logits = load_u16(dir + "/beta_logits", rows * size_t(ld_beta));
    const auto dt_bias = load(dir + "/dt_bias", qkv);
    const auto a_log = load(dir + "/a_log", heads);
    const auto core = load(dir + "/core", rows * qkv);
    const auto out_gate = load_u16(dir + "/out_gate", rows * qkv);
    const auto norm_w = load_u16(dir + "/norm_w", 128);
    std::vector<float> gate(rows * qkv, 12345.0f), beta(rows * heads, 12345.0f);
    std::vector<bf16_t> o_norm_out(rows * qkv, 0x7FA5);
    run_grid(dim3{unsigned(heads), unsigned((tokens + 31) / 32), 1}, 128, 0, [&] {
        // The logits are columns 2 D .. of each row, as the layer reads them from down_proj.
        kda_gate_beta_f32(forget_proj.data(), dt_bias.data(), a_log.data(), beta_logits.data() + 2 * 128, ld_beta, gate.data(),
                      beta.data(), heads, 128, bounded, lower_bound, tokens);
    });
    run_grid(dim3{unsigned((heads + 3) / 4), unsigned((tokens + 3) / 4), 1}, 128, 0, [&] {
        kda_gated_rmsnorm_sigmoid_bf16(core.data(), out_gate.data(), norm_w.data(), o_norm_out.data(), heads, 128, eps,
                                   tokens);
    });
    save_each(dir + "/", {"gate.out", "beta.out", "o_norm_out.out"}, gate, beta, o_norm_out);
    std::printf("misaligned=%ld\n", misaligned.load());
    return 0;
}
"""


@pytest.fixture(scope="module")
def gate_norm_host(tmp_path_factory):
    files = {"emulation.h": HOST_CUDA_HEADER, "main.cpp": GATE_NORM_MAIN}
    for stem in ("gate", "norm"):
        files[f"{stem}.cpp"] = '#include "emulation.h"\n' + host_kernel_source(stem)
    return build_host_binary(tmp_path_factory.mktemp("gate_norm_host"), "gate_norm_host", files)


@pytest.mark.parametrize("core_scale", [1.0, 3e-3], ids=["core", "small_core"])
@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "softplus"])
@pytest.mark.parametrize("tokens", [1, 31, 70], ids=lambda t: f"T{t}")
def test_gate_and_norm_kernels_on_host(gate_norm_host, tokens, bounded, core_scale):
    """core_scale 3e-3: the core's mean square about the norm's eps, so that where the eps sits
    (or whether it is there) moves o_norm_out by far more than its bound."""
    rng = np.random.default_rng(tokens + int(bounded))
    qkv, rows, ld_beta = HEADS * DIM, tokens + 5, 2 * DIM + HEADS
    real = np.arange(rows) < tokens

    def poisoned_bf16(values):
        return np.where(real.reshape((rows,) + (1,) * (values.ndim - 1)), bf16_bits(values), np.uint16(POISON_BF16))

    forget_proj = poisoned_bf16(3.0 * rng.standard_normal((rows, qkv)))
    beta_logits = poisoned_bf16(2.0 * rng.standard_normal((rows, ld_beta)))
    out_gate = poisoned_bf16(rng.standard_normal((rows, qkv)))
    core = np.where(real[:, None], core_scale * rng.standard_normal((rows, qkv)), np.nan).astype(np.float32)
    dt_bias = rng.standard_normal(qkv).astype(np.float32)
    a_log = rng.uniform(-1.0, 1.0, HEADS).astype(np.float32)
    norm_w = bf16_bits(1.0 + 0.1 * rng.standard_normal(DIM))
    folder = gate_norm_host.parent / f"T{tokens}-b{int(bounded)}-s{core_scale:g}"
    folder.mkdir(exist_ok=True)
    for name, array in (("forget_proj", forget_proj), ("beta_logits", beta_logits), ("dt_bias", dt_bias), ("a_log", a_log),
                        ("core", core), ("out_gate", out_gate), ("norm_w", norm_w)):
        np.ascontiguousarray(array).tofile(folder / name)
    result = subprocess.run([str(gate_norm_host), str(folder), str(tokens), str(rows), str(HEADS), str(int(bounded)),
                             str(ld_beta), repr(LOWER_BOUND), repr(NORM_EPS)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["misaligned=0"], f"host run: {result.stdout.strip()}"
    gate = np.fromfile(folder / "gate.out", np.float32).reshape(rows, HEADS, DIM)
    beta = np.fromfile(folder / "beta.out", np.float32).reshape(rows, HEADS)
    o_norm_out = np.fromfile(folder / "o_norm_out.out", np.uint16).reshape(rows, qkv)
    tag = f"T={tokens} {'bounded' if bounded else 'softplus'} core x{core_scale:g}"
    assert (gate[tokens:] == UNTOUCHED).all() and (beta[tokens:] == UNTOUCHED).all(), f"{tag}: gate rows >= T written"
    assert (o_norm_out[tokens:] == POISON_BF16).all(), f"{tag}: norm rows >= T written"

    config = SimpleNamespace(heads=HEADS, head_dim=DIM, bounded=bounded, gate_lower_bound=LOWER_BOUND)
    expected = forget_gate(bits_to_f64(forget_proj[:tokens]), dt_bias.astype(np.float64), a_log.astype(np.float64), config)
    ratio = rms_ratio(gate[:tokens].astype(np.float64), expected)
    assert ratio <= 1e-5, f"{tag}: gate rms-ratio {ratio:.3e} against the float64 forget gate (bound 1e-5)"
    ratio = rms_ratio(beta[:tokens].astype(np.float64), sigmoid(bits_to_f64(beta_logits[:tokens, 2 * DIM :])))
    assert ratio <= 1e-6, f"{tag}: beta rms-ratio {ratio:.3e} against sigmoid of the logits (bound 1e-6)"
    expected = round_bf16(gated_rmsnorm(core[:tokens].astype(np.float64).reshape(tokens, HEADS, DIM),
                                        bits_to_f64(out_gate[:tokens]), bits_to_f64(norm_w), NORM_EPS))
    ratio = rms_ratio(bits_to_f64(o_norm_out[:tokens]), expected)
    assert ratio <= 1e-3, f"{tag}: o_norm_out rms-ratio {ratio:.3e} against the float64 gated norm (bound 1e-3)"
