"""kernels_src/conv.cu on the host (tests/host_cuda.py: a std::thread per CUDA thread, real warp
shuffles), so CPU CI runs the conv kernel's own source.

Promises tested:
  * the prefill kernel over T tokens (tiles of 64 run in parallel, each rebuilding its windows from
    the inputs before it) writes, bit for bit, what T one-token launches carrying the state write:
    conv output, q, k, v and the carried conv state, from a random carried state, across token
    tiles of 64, for kernel sizes 1..4, with scheduling jitter (tests/test_decode_host.py checks
    that the fused decode step's conv stage writes these bits too);
  * the conv output is the float64 oracle's (glm_kda.reference.conv_silu) rounded to BF16
    within the stage bound, q and k are the oracle's L2 norm of that output, v is it, and the
    new state is the last K inputs exactly;
  * no vector access is misaligned.
Host libm's expf is not the device's, so these bits are compared among host runs only.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from glm_kda.reference import conv_silu, l2norm_split, rms_ratio, round_bf16
from host_cuda import (HOST_CUDA_HEADER, HOST_CUDA_RUNTIME, bf16_bits, bits_to_f64, build_host_binary,
                       host_kernel_source)

HEADS = 2  # 6 heads of q, k or v: the prefill's second block has two warps past the last head
DIM = 128
L2_EPS = 1e-6
STAGE_BOUND = 1e-3

CONV_MAIN = r"""
#include "emulation.h"
""" + HOST_CUDA_RUNTIME + r"""
using bf16_t = unsigned short;
extern "C" void kda_conv_prefill_silu_l2_bf16(float*, const bf16_t*, const bf16_t*, bf16_t*, float*, float*, float*, int,
                                          int, int, int, float);

int main(int argc, char** argv)
{
    const std::string dir = argv[1];
    const int tokens = std::atoi(argv[2]), heads = std::atoi(argv[3]), kernel = std::atoi(argv[4]);
    jitter = std::atoi(argv[5]);
    const float eps = std::atof(argv[6]);
    const size_t qkv = size_t(heads) * 128, conv_dim = 3 * qkv;
    const auto qkv_proj = load_u16(dir + "/qkv_proj", tokens * conv_dim);
    const auto conv_w = load_u16(dir + "/conv_w", conv_dim * kernel);
    const auto start = load(dir + "/state", conv_dim * kernel);
    for (const char* path : {"prefill", "steps"}) {
        auto state = start;
        std::vector<bf16_t> conv_out(tokens * conv_dim, 0x7FA5);
        std::vector<float> query(tokens * qkv, std::nanf("")), key = query, value = query;
        // prefill: one launch of every token; steps: one launch a token.
        const int launches = std::string(path) == "prefill" ? 1 : tokens, count = tokens / launches;
        for (int t = 0; t < tokens; t += count) {
            run_grid(dim3{unsigned((3 * heads + 3) / 4), unsigned((count + 63) / 64), 1}, 128, 0, [&] {
                kda_conv_prefill_silu_l2_bf16(state.data(), qkv_proj.data() + t * conv_dim, conv_w.data(),
                                          conv_out.data() + t * conv_dim, query.data() + t * qkv, key.data() + t * qkv,
                                          value.data() + t * qkv, heads, 128, kernel, count, eps);
            });
        }
        save_each(dir + "/" + std::string(path) + ".", {"conv_out", "query", "key", "value", "state"}, conv_out, query,
                  key, value, state);
    }
    std::printf("misaligned=%ld\n", misaligned.load());
    return 0;
}
"""


def host_source() -> str:
    return '#include "emulation.h"\n' + host_kernel_source("conv", ())


@pytest.fixture(scope="module")
def conv_host(tmp_path_factory):
    return build_host_binary(tmp_path_factory.mktemp("conv_host"), "conv_host",
                             {"emulation.h": HOST_CUDA_HEADER, "main.cpp": CONV_MAIN, "kernel.cpp": host_source()})


def run_conv(binary, qkv_proj_bits, conv_w_bits, state, jitter=False):
    """(prefill outputs, one-token launches' outputs): dicts of conv_out (BF16 bits), query, key, value,
    state."""
    tokens, conv_dim = qkv_proj_bits.shape
    kernel = conv_w_bits.shape[1]
    folder = Path(tempfile.mkdtemp(prefix=f"T{tokens}-K{kernel}-{int(jitter)}-", dir=binary.parent))
    qkv_proj_bits.tofile(folder / "qkv_proj")
    conv_w_bits.tofile(folder / "conv_w")
    state.astype(np.float32).tofile(folder / "state")
    result = subprocess.run([str(binary), str(folder), str(tokens), str(HEADS), str(kernel), str(int(jitter)),
                             repr(L2_EPS)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["misaligned=0"], f"host run: {result.stdout.strip()}"
    out = {}
    for path in ("prefill", "steps"):
        read = lambda name, dtype, shape: np.fromfile(folder / f"{path}.{name}", dtype).reshape(shape)  # noqa: E731
        out[path] = {"conv_out": read("conv_out", np.uint16, (tokens, conv_dim)),
                     **{name: read(name, np.float32, (tokens, HEADS, DIM)) for name in ("query", "key", "value")},
                     "state": read("state", np.float32, (conv_dim, kernel))}
    return out["prefill"], out["steps"]


@pytest.mark.parametrize("tokens,kernel,jitter,scale", [(1, 4, False, 1.0), (5, 4, False, 1.0), (64, 4, False, 1.0),
                                                        (70, 4, True, 1.0), (130, 3, False, 1.0), (70, 1, False, 1.0),
                                                        (9, 2, False, 1.0), (5, 4, False, 1e-4), (70, 4, True, 1e-4)],
                         ids=lambda v: str(v))
def test_conv_kernels_on_host(conv_host, tokens, kernel, jitter, scale):
    """scale 1e-4: the inputs so small that a head's sum of squares of q or k is about the L2 eps,
    so that where the eps sits moves query and key by far more than their bound."""
    rng = np.random.default_rng(1000 * tokens + kernel)
    conv_dim = 3 * HEADS * DIM
    qkv_proj = bf16_bits(rng.standard_normal((tokens, conv_dim)) * 2.0 * scale)
    conv_w = bf16_bits(rng.standard_normal((conv_dim, kernel)) * 0.5)
    start = (scale * rng.standard_normal((conv_dim, kernel))).astype(np.float32)
    prefill, steps = run_conv(conv_host, qkv_proj, conv_w, start, jitter)
    tag = f"T={tokens} K={kernel} x{scale:g}"

    for name in ("conv_out", "query", "key", "value", "state"):
        a, b = prefill[name], steps[name]
        differ = int(np.count_nonzero(a.view(np.uint8) != b.view(np.uint8)))
        assert differ == 0, f"{tag}: {differ} bytes of {name} differ between one launch and one launch a token"

    expected_conv, expected_state = conv_silu(bits_to_f64(qkv_proj), start.astype(np.float64), bits_to_f64(conv_w))
    conv_out = bits_to_f64(prefill["conv_out"])
    ratio = rms_ratio(conv_out, round_bf16(expected_conv))
    assert ratio <= STAGE_BOUND, f"{tag}: conv_out rms-ratio {ratio:.3e} against the float64 oracle (bound {STAGE_BOUND:g})"
    q, k, v = l2norm_split(conv_out, HEADS, DIM, L2_EPS)
    for name, expected in (("query", q), ("key", k)):
        ratio = rms_ratio(prefill[name].astype(np.float64), expected)
        assert ratio <= 1e-6, f"{tag}: {name} rms-ratio {ratio:.3e} against the oracle's L2 norm of the kernel's conv_out"
    assert np.array_equal(prefill["value"].astype(np.float64), v), f"{tag}: value is not the conv output"
    assert np.array_equal(prefill["state"].astype(np.float64), expected_state), f"{tag}: new state is not the last K inputs"
