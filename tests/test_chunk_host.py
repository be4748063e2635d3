"""kernels_src/chunk.cu (the FP32 chunk kernels: the reference path, and the prefill of the
softplus law) on the host (tests/host_cuda.py), so CPU CI runs their source.

Promises tested: prepare + scan over T tokens in chunks of C, from a random state, give the
float64 chunked delta rule (glm_kda.reference.chunk_scan) and the token-by-token recurrence
(recurrent_scan) within FP32 rounding, for C in 16, 64 and T not a multiple of C; input rows
>= T (NaN here) are never read; no vector access is misaligned.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from glm_kda.gpu.ops import chunk_count, chunk_prepare_smem_bytes
from glm_kda.reference import chunk_scan, recurrent_scan, rms_ratio
from host_cuda import HOST_CUDA_HEADER, HOST_CUDA_RUNTIME, build_host_binary, host_kernel_source

HEADS = 2
DIM = 128
# FP32 against float64 over at most a few hundred tokens: measured 4e-8 .. 3.6e-7 on the host.
FP32_BOUND = 2e-6

CHUNK_MAIN = r"""
#include "emulation.h"
""" + HOST_CUDA_RUNTIME + r"""
extern "C" void kda_chunk_prepare_f32(const float*, const float*, const float*, const float*, const float*, float*,
                                      float*, float*, float*, float*, float*, int, int, int, float);
extern "C" void kda_chunk_scan_f32(const float*, const float*, const float*, const float*, const float*, const float*,
                                   float*, float*, int, int, int, int);

int main(int argc, char** argv)
{
    const std::string dir = argv[1];
    const int tokens = std::atoi(argv[2]), rows = std::atoi(argv[3]), heads = std::atoi(argv[4]);
    const int chunk = std::atoi(argv[5]), shared_bytes = std::atoi(argv[6]);
    const size_t D = 128, nchunks = (tokens + chunk - 1) / chunk, padded = nchunks * chunk;
    auto in = [&](const char* name, size_t per_row) { return load(dir + "/" + name, rows * heads * per_row); };
    const auto query = in("query", D), key = in("key", D), value = in("value", D), gate = in("gate", D);
    const auto beta = in("beta", 1);
    auto state = load(dir + "/state", heads * D * D);
    auto scratch = [](size_t count) { return std::vector<float>(count, std::nanf("")); };
    auto q_decay = scratch(padded * heads * D), k_tail = scratch(padded * heads * D), w = scratch(padded * heads * D);
    auto u = scratch(padded * heads * D), attn = scratch(nchunks * heads * chunk * chunk);
    auto chunk_decay = scratch(nchunks * heads * D);
    std::vector<float> core(rows * heads * D, 12345.0f);
    run_grid(dim3{unsigned(nchunks), unsigned(heads), 1}, 128, shared_bytes, [&] {
        kda_chunk_prepare_f32(query.data(), key.data(), value.data(), gate.data(), beta.data(), q_decay.data(),
                              k_tail.data(), w.data(), u.data(), attn.data(), chunk_decay.data(), tokens, heads, chunk,
                              1.0f / std::sqrt(128.0f));
    });
    run_grid(dim3{unsigned(heads), 4, 1}, 32, 0, [&] {
        kda_chunk_scan_f32(q_decay.data(), k_tail.data(), w.data(), u.data(), attn.data(), chunk_decay.data(),
                           state.data(), core.data(), tokens, heads, chunk, int(nchunks));
    });
    save_each(dir + "/", {"core.out", "state.out"}, core, state);
    std::printf("misaligned=%ld\n", misaligned.load());
    return 0;
}
"""


def host_source() -> str:
    source = host_kernel_source("chunk/chunk")
    declaration = "extern __shared__ float shared[];"
    assert source.count(declaration) == 1, "the host emulation expects one dynamic shared array"
    return '#include "emulation.h"\n' + source.replace(declaration, "float* shared = emulated_shared;")


@pytest.fixture(scope="module")
def chunk_host(tmp_path_factory):
    return build_host_binary(tmp_path_factory.mktemp("chunk_host"), "chunk_host",
                             {"emulation.h": HOST_CUDA_HEADER, "main.cpp": CHUNK_MAIN, "kernel.cpp": host_source()})


def _inputs(tokens, seed):
    """q, k L2-normalised, v, a softplus-law gate (-exp(a) softplus(u)), beta in (0, 1), and a
    random state; float32."""
    rng = np.random.default_rng(seed)
    shape = (tokens, HEADS, DIM)
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (rng.standard_normal(shape) for _ in range(2)))
    v = rng.standard_normal(shape)
    u = rng.standard_normal(shape)
    gate = -np.exp(rng.uniform(-1.0, 0.5, (1, HEADS, 1))) * np.log1p(np.exp(u - 2.0))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((tokens, HEADS))))
    state = 0.1 * rng.standard_normal((HEADS, DIM, DIM))
    return tuple(np.asarray(x, np.float32) for x in (q, k, v, gate, beta, state))


def run_chunk(binary, inputs, tokens, chunk):
    query, key, value, gate, beta, state = inputs
    rows = chunk_count(tokens, chunk) * chunk + 3
    folder = binary.parent / f"T{tokens}-C{chunk}"
    folder.mkdir(exist_ok=True)
    for name, x in (("query", query), ("key", key), ("value", value), ("gate", gate), ("beta", beta)):
        full = np.full((rows,) + x.shape[1:], np.nan, np.float32)  # rows >= T must never be read
        full[:tokens] = x
        full.tofile(folder / name)
    state.tofile(folder / "state")
    result = subprocess.run([str(binary), str(folder), str(tokens), str(rows), str(HEADS), str(chunk),
                             str(chunk_prepare_smem_bytes(chunk))], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["misaligned=0"], f"host run: {result.stdout.strip()}"
    core = np.fromfile(folder / "core.out", np.float32).reshape(rows, HEADS, DIM)
    assert (core[tokens:] == 12345.0).all(), "core rows >= T were written"
    return core[:tokens], np.fromfile(folder / "state.out", np.float32).reshape(HEADS, DIM, DIM)


@pytest.mark.parametrize("tokens,chunk", [(1, 16), (17, 16), (70, 64), (150, 64)], ids=lambda v: str(v))
def test_fp32_chunk_kernels_on_host(chunk_host, tokens, chunk):
    inputs = _inputs(tokens, seed=tokens + chunk)
    core, state = run_chunk(chunk_host, inputs, tokens, chunk)
    as64 = [x.astype(np.float64) for x in inputs]
    for name, (ref_core, ref_state) in (("chunk_scan", chunk_scan(*as64, chunk)), ("recurrent_scan", recurrent_scan(*as64))):
        for what, actual, expected in (("core", core, ref_core), ("state", state, ref_state)):
            ratio = rms_ratio(actual.astype(np.float64), expected)
            assert ratio <= FP32_BOUND, (f"T={tokens} C={chunk}: {what} rms-ratio {ratio:.3e} against the float64 "
                                         f"{name} (bound {FP32_BOUND:g})")
