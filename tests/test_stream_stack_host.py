"""benchmarks/stream_stack.cu, the persistent stack kernel that benchmarks/stream_stack.py times, on
the host (tests/host_cuda.py): its producer lane and consumer warps run as threads of one block, its
mbarriers and bulk copies as host shims (a copy lands at once and completes its bytes).

Promises tested:
  * one block through three layers with every phase's wait, two launches: the ring of two slots
    wraps many times, each phase waits for the counts of the phase before, and the outputs of the
    second launch are within FP32 rounding of float64 products of the kernel's own inputs
    (stream_stack.check_token, the check the benchmark runs on the GPU before it times);
  * the counters end at the launches times each phase's count (a warp's, or a block's for the step);
  * three blocks at once (run_grid_concurrent), two of them stepping a head, waiting on each
    other's counts: the same, with every count from the other blocks;
  * three blocks without waits, one after the other: each block's share of layer 0's q|k|v rows,
    together every row, as float64 gives.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from host_cuda import (HOST_CUDA_HEADER, HOST_CUDA_RUNTIME, MBARRIER_HELPERS, MBARRIER_SHIMS, bf16_bits,
                       build_host_binary, host_source)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import stream_stack  # noqa: E402

HIDDEN = 64
HEADS = 1
EXTRA_ROWS = 8
LAYERS = 3
SLOTS = 2

# The kernel's PTX-only pieces, defined by SHIMS below (the mbarriers' by host_cuda.MBARRIER_SHIMS).
DEVICE_HELPERS = MBARRIER_HELPERS + ("consumers_sync",)

SHIMS = MBARRIER_SHIMS + r"""
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
thread_local std::barrier<>* consumer_barrier;  // the block's
inline void consumers_sync()
{
    maybe_sleep();
    consumer_barrier->arrive_and_wait();
}
"""

MAIN = r"""
int main(int argc, char** argv)
{
    const std::string dir = argv[1];
    const int grid = std::atoi(argv[2]), layers = std::atoi(argv[3]), rows = std::atoi(argv[4]);
    const int hidden = std::atoi(argv[5]), heads = std::atoi(argv[6]), slots = std::atoi(argv[7]);
    const int waits = std::atoi(argv[8]), launches = std::atoi(argv[9]);
    jitter = std::atoi(argv[10]);
    const bool concurrent = std::atoi(argv[12]) != 0;
    const int slot_bytes = std::atoi(argv[13]);
    const size_t shared = std::strtoull(argv[11], nullptr, 10);
    const int width = heads * STREAM_HEAD_DIM;
    auto qkv_w = load_u16(dir + "/qkv_w", size_t(layers) * rows * hidden);
    auto o_w = load_u16(dir + "/o_w", size_t(layers) * hidden * width);
    auto x = load(dir + "/x", size_t(layers + 1) * hidden);
    auto state = load(dir + "/state", size_t(layers) * width * STREAM_HEAD_DIM);
    std::vector<float> qkv(size_t(layers) * rows, std::nanf("")), core(size_t(layers) * width, std::nanf(""));
    std::vector<float> state_before;
    std::vector<int> counters(3 * layers, 0);
    std::vector<std::unique_ptr<std::barrier<>>> consumers;
    for (int block = 0; block < grid; ++block) consumers.emplace_back(new std::barrier<>(32 * STREAM_CONSUMER_WARPS));
    for (int launch = 1; launch <= launches; ++launch) {
        state_before = state;
        auto block = [&] {
            consumer_barrier = consumers[blockIdx.x].get();
            stream_stack(qkv_w.data(), o_w.data(), x.data(), qkv.data(), core.data(), state.data(), counters.data(),
                         layers, rows, hidden, heads, launch, waits, slots, slot_bytes);
        };
        if (concurrent) {
            run_grid_concurrent(dim3{unsigned(grid), 1, 1}, STREAM_THREADS, shared, block);
        } else {
            run_grid(dim3{unsigned(grid), 1, 1}, STREAM_THREADS, shared, block);
        }
    }
    save_each(dir + "/", {"x.out", "qkv.out", "core.out", "state.out", "state_before.out"}, x, qkv, core, state,
              state_before);
    save(dir + "/counters.out", counters);
    std::printf("misaligned=%ld\n", misaligned.load());
    return 0;
}
"""


@pytest.fixture(scope="module")
def stream_host(tmp_path_factory):
    source = host_source(stream_stack.kernel_source(), "stream_stack.cu", DEVICE_HELPERS)
    declaration = "extern __shared__ __align__(128) unsigned char stream_ring[];"
    assert declaration in source, "stream_stack.cu no longer declares stream_ring so; update the host emulation"
    source = source.replace(declaration, "unsigned char* stream_ring = shared_bytes();")
    files = {"emulation.h": HOST_CUDA_HEADER + HOST_CUDA_RUNTIME,
             "main.cpp": '#include "emulation.h"\n' + SHIMS + source + MAIN}
    return build_host_binary(tmp_path_factory.mktemp("stream_stack_host"), "stream_stack_host", files)


def _run(binary, folder: Path, grid: int, waits: bool, launches: int, jitter: int = 0, heads: int = HEADS,
         concurrent: bool = False) -> dict:
    width = heads * stream_stack.HEAD_DIM
    rows = 3 * width + EXTRA_ROWS
    rng = np.random.default_rng(11)
    qkv_w = bf16_bits(rng.standard_normal((LAYERS, rows, HIDDEN)) * HIDDEN**-0.5)
    o_w = bf16_bits(rng.standard_normal((LAYERS, HIDDEN, width)) * width**-0.5)
    x = np.zeros((LAYERS + 1, HIDDEN), np.float32)
    x[0] = rng.standard_normal(HIDDEN)
    d = stream_stack.HEAD_DIM
    state = (rng.standard_normal((LAYERS, heads, d, d)) * 0.1).astype(np.float32)
    for name, array in (("qkv_w", qkv_w), ("o_w", o_w), ("x", x), ("state", state)):
        array.tofile(folder / name)
    result = subprocess.run([str(binary), str(folder), str(grid), str(LAYERS), str(rows), str(HIDDEN), str(heads),
                             str(SLOTS), str(int(waits)), str(launches), str(jitter),
                             str(stream_stack.shared_bytes(HIDDEN, width, SLOTS)), str(int(concurrent)),
                             str(stream_stack.SLOT_BYTES)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "misaligned=0" in result.stdout, result.stdout

    def out(name, shape, dtype=np.float32):
        return np.fromfile(folder / f"{name}.out", dtype).reshape(shape)

    return {"qkv_w": qkv_w, "o_w": o_w, "x": out("x", (LAYERS + 1, HIDDEN)), "qkv": out("qkv", (LAYERS, rows)),
            "core": out("core", (LAYERS, width)), "state": out("state", state.shape),
            "state_before": out("state_before", state.shape), "counters": out("counters", (LAYERS, 3), np.int32)}


def _check_every_phase(buffers: dict, grid: int, heads: int, launches: int) -> None:
    errors = stream_stack.check_token(buffers, buffers["state_before"], LAYERS, heads)
    assert max(errors.values()) < 1e-6, f"rms ratio against float64 per stage (bound 1e-6): {errors}"
    warps = grid * stream_stack.CONSUMER_WARPS
    assert (buffers["counters"] == [launches * warps, launches * heads, launches * warps]).all(), buffers["counters"]


@pytest.mark.parametrize("jitter", [0, 1])
def test_one_block_through_every_phase_matches_float64(stream_host, tmp_path, jitter):
    _check_every_phase(_run(stream_host, tmp_path, grid=1, waits=True, launches=2, jitter=jitter), 1, HEADS, 2)


def test_blocks_at_once_wait_on_each_other(stream_host, tmp_path):
    """Three blocks run at once, as the cooperative launch runs them, two of them stepping a head:
    every phase's wait is on counts from the other blocks."""
    buffers = _run(stream_host, tmp_path, grid=3, waits=True, launches=2, jitter=1, heads=2, concurrent=True)
    _check_every_phase(buffers, 3, 2, 2)


def test_blocks_share_the_rows(stream_host, tmp_path):
    buffers = _run(stream_host, tmp_path, grid=3, waits=False, launches=1)
    exact = stream_stack.bf16_to_f64(buffers["qkv_w"][0]) @ buffers["x"][0].astype(np.float64)
    error = stream_stack.rms_ratio(buffers["qkv"][0], exact)
    assert error < 1e-6, f"layer 0's q|k|v over three blocks: rms ratio {error:.2e} against float64 (bound 1e-6)"
