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

from glm_kda.reference import rms_ratio
from host_cuda import HOST_CUDA_HEADER, HOST_CUDA_RUNTIME, bf16_bits, build_host_binary, host_source

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import stream_stack  # noqa: E402

HIDDEN = 64
HEADS = 1
EXTRA_ROWS = 8
LAYERS = 3
SLOTS = 2

# The kernel's PTX-only pieces, defined by SHIMS below.
DEVICE_HELPERS = ("mbarrier_init", "mbarrier_init_fence", "mbarrier_expect_bytes", "mbarrier_arrive",
                  "mbarrier_wait", "bulk_copy_to_shared", "consumers_sync")

SHIMS = r"""
#include <map>
#include <mutex>
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline unsigned char* shared_bytes() { return reinterpret_cast<unsigned char*>(emulated_shared); }
inline unsigned int shared_address(const void* p)
{
    return static_cast<unsigned int>(static_cast<const unsigned char*>(p) - shared_bytes());
}
// An mbarrier: arrivals pending and bytes pending in the present phase, and phases completed.
struct HostBarrier {
    int count = 0, pending = 0;
    long bytes = 0;
    unsigned int phases = 0;
};
std::mutex barrier_lock;
// By the barrier's address in its block's shared memory (blocks may run at once).
std::map<const unsigned char*, HostBarrier> host_barriers;
inline HostBarrier& host_barrier(unsigned int barrier) { return host_barriers.at(shared_bytes() + barrier); }
inline void complete_if_done(HostBarrier& b)
{
    if (b.pending == 0 && b.bytes == 0) {
        b.phases += 1;
        b.pending = b.count;
    }
}
inline void mbarrier_init(unsigned int barrier, unsigned int count)
{
    std::lock_guard<std::mutex> hold(barrier_lock);
    host_barriers[shared_bytes() + barrier] = HostBarrier{int(count), int(count), 0, 0};
}
inline void mbarrier_init_fence() {}
inline void mbarrier_expect_bytes(unsigned int barrier, unsigned int bytes)
{
    std::lock_guard<std::mutex> hold(barrier_lock);
    HostBarrier& b = host_barrier(barrier);
    b.bytes += bytes;
    b.pending -= 1;
    complete_if_done(b);
}
inline void mbarrier_arrive(unsigned int barrier)
{
    std::lock_guard<std::mutex> hold(barrier_lock);
    HostBarrier& b = host_barrier(barrier);
    b.pending -= 1;
    if (b.pending < 0) std::abort();  // more arrivals than the phase takes
    complete_if_done(b);
}
// The phase of parity `parity` has completed once the phases completed differ from it in parity.
inline void mbarrier_wait(unsigned int barrier, unsigned int parity)
{
    for (;;) {
        {
            std::lock_guard<std::mutex> hold(barrier_lock);
            if ((host_barrier(barrier).phases & 1u) != parity) return;
        }
        maybe_sleep();
        std::this_thread::yield();
    }
}
inline void bulk_copy_to_shared(unsigned int destination, const void* source, unsigned int bytes, unsigned int barrier)
{
    if (destination % 16 || reinterpret_cast<uintptr_t>(source) % 16 || bytes % 16) misaligned++;
    std::memcpy(shared_bytes() + destination, source, bytes);
    std::lock_guard<std::mutex> hold(barrier_lock);
    HostBarrier& b = host_barrier(barrier);
    b.bytes -= bytes;
    complete_if_done(b);
}
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
    assert all(error < 1e-6 for error in errors.values()), f"rms ratio against float64 per stage (bound 1e-6): {errors}"
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
    error = rms_ratio(buffers["qkv"][0], exact)
    assert error < 1e-6, f"layer 0's q|k|v over three blocks: rms ratio {error:.2e} against float64 (bound 1e-6)"
