"""The CUDA subset the kernels use, on the host: enough to compile a kernel file as C++ and run
its grid with one std::thread per CUDA thread, so CPU CI runs the kernel source itself.

  HOST_CUDA_HEADER   types, bit casts, __syncthreads / __syncwarp (std::barrier), warp votes and
                     shuffles (a slot per lane and two warp barriers), static __shared__ arrays
                     (function statics: the blocks run one after the other), alignment-checked
                     vector casts, and shims for the intrinsics with no host twin
  HOST_CUDA_RUNTIME  the globals, run_grid (a grid, block after block, x fastest), run_grid_concurrent
                     (every block at once) and file helpers
  host_kernel_source the kernel file with its PTX-only helpers removed (host_source: any kernel text)
  kernel_declaration an entry point's declaration, taken from its definition
  build_host_binary  compile with g++ / clang++ (C++20 for <barrier>), or skip the test

Host libm's expf and sqrtf are not the device's, so a host run is compared with itself or with
the oracle within a bound, never with a GPU run bit for bit.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from glm_kda.gpu import build as kernels


def bf16_bits(x) -> np.ndarray:
    """BF16 bits (uint16) of x, rounded to nearest even (ml_dtypes)."""
    import ml_dtypes

    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def order_sensitive_inputs(rng, rows: int, n: int, k: int, k_split: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 x [rows, k] and w [n, k] whose fp32 sum over gemm_rows' k_split ranges of 32-k
    blocks depends on the order of its additions (plain random data leaves the last fp32 bits to
    the BF16 rounding of the output, which hides them): even ranges hold huge products, equal and
    of opposite sign in ranges 0 / 2, 4 / 6; odd ranges small ones, so the total keeps the small
    partials' bits only as rounded where they were added."""
    k_range = 32 * -(-(-(-k // 32)) // k_split)
    x = rng.standard_normal((rows, k))
    w = rng.standard_normal((n, k)) * 2.0**-4
    huge_x, huge_w = rng.standard_normal((rows, k_range)), rng.standard_normal((n, k_range)) * 2.0**12
    for start in range(0, k, 2 * k_range):
        if start + k_range <= k:
            x[:, start:start + k_range] = huge_x
            w[:, start:start + k_range] = huge_w if start // (2 * k_range) % 2 == 0 else -huge_w
    return x, w


def bits_to_f64(bits) -> np.ndarray:
    """BF16 bits (uint16) as float64, exactly."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32).astype(np.float64)

HOST_CUDA_HEADER = r"""
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
using std::max;
using std::min;
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline uint2 make_uint2(unsigned int a, unsigned int b) { return {a, b}; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static
// (A GNU attribute: `static alignas(n)` is not C++.)
#define __align__(n) __attribute__((aligned(n)))
extern thread_local dim3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
// The present block's, per thread (run_grid_concurrent runs several blocks at once).
extern thread_local float* emulated_shared;
extern thread_local std::barrier<>* block_barrier;
extern thread_local std::barrier<>** warp_barriers;
extern std::atomic<long> misaligned;
extern thread_local unsigned int (*shuffle_slots)[32];
extern int jitter;
inline void maybe_sleep()
{
    if (!jitter) return;
    thread_local unsigned s = 12345u + 7919u * threadIdx.x;
    s = s * 1103515245u + 12345u;
    if ((s >> 16) % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds((s >> 20) % 50));
}
inline void __syncthreads() { maybe_sleep(); block_barrier->arrive_and_wait(); }
inline void __syncwarp() { maybe_sleep(); warp_barriers[threadIdx.x >> 5]->arrive_and_wait(); }
// Every lane of the warp takes part (the kernels shuffle full warps only).
template <class T> T __shfl_sync(unsigned, T v, int source_lane)
{
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    std::memcpy(&shuffle_slots[warp][lane], &v, 4);
    maybe_sleep();
    warp_barriers[warp]->arrive_and_wait();
    T out;
    std::memcpy(&out, &shuffle_slots[warp][source_lane & 31], 4);
    warp_barriers[warp]->arrive_and_wait();
    return out;
}
template <class T> T __shfl_xor_sync(unsigned mask, T v, int lane_mask)
{
    return __shfl_sync(mask, v, (threadIdx.x & 31) ^ lane_mask);
}
inline int __all_sync(unsigned, int predicate)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    shuffle_slots[warp][lane] = predicate ? 1u : 0u;
    maybe_sleep();
    warp_barriers[warp]->arrive_and_wait();
    int all = 1;
    for (int l = 0; l < 32; ++l) all = all && shuffle_slots[warp][l] != 0u;
    warp_barriers[warp]->arrive_and_wait();
    return all;
}
template <class T, class P> T* checked_cast(P* p)
{
    if (reinterpret_cast<uintptr_t>(p) % alignof(T)) misaligned++;
    return reinterpret_cast<T*>(p);
}
// __fdividef's approximate reciprocal-and-product, as the IEEE quotient (within 2 ulp of it).
inline float __fdividef(float a, float b) { return a / b; }
// The correctly rounded product (the host build does not contract into fma: ISO C++, no -ffast-math).
inline float __fmul_rn(float a, float b) { return a * b; }
// __expf: ex2.approx of x log2(e) (within 2 ulp of the exact exp2 of that FP32 product).
inline float __expf(float x) { return std::exp2(x * 1.44269504f); }
// A warp-collective mma: each lane leaves its fragments in slots[warp][lane], the warp meets, each
// lane forms its 4 outputs (rows g, g + 8; columns 2t, 2t + 1) as acc + the sum over k < K of
// product(the warp's slots, row, column, k) in float64, ascending k, and the warp meets again.
template <int K, class Slot, class Product>
inline void warp_mma(float acc[4], const Slot& mine, Slot (&slots)[32][32], Product product)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    slots[warp][lane] = mine;
    maybe_sleep();
    warp_barriers[warp]->arrive_and_wait();
    const int g = lane >> 2, t = lane & 3;
    float out[4];
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        double sum = acc[e];
        for (int k = 0; k < K; ++k) sum += product(slots[warp], row, col, k);
        out[e] = float(sum);
    }
    warp_barriers[warp]->arrive_and_wait();
    for (int e = 0; e < 4; ++e) acc[e] = out[e];
}
// The programmatic-launch helpers of common/sync.cuh (PTX on sm_90, removed from the host build):
// one kernel at a time here, nothing to overlap.
inline void kda_let_next_kernel_launch() {}
inline void kda_grid_dependency_wait() {}
// Its counters read with acquire and written with release (PTX on the device), and the device
// intrinsics of a wait on them.
inline int load_acquire(const int* counter)
{
    return reinterpret_cast<const std::atomic<int>*>(counter)->load(std::memory_order_acquire);
}
inline void kda_count_release(int* word)
{
    reinterpret_cast<std::atomic<int>*>(word)->fetch_add(1, std::memory_order_release);
}
inline int atomicAdd(int* address, int value) { return reinterpret_cast<std::atomic<int>*>(address)->fetch_add(value); }
inline void __nanosleep(unsigned) { std::this_thread::yield(); }
template <class T> inline T __ldcg(const T* pointer) { return *pointer; }
[[noreturn]] inline void __trap() { std::abort(); }
"""

HOST_CUDA_RUNTIME = r"""
#include <cstdio>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
thread_local float* emulated_shared;
thread_local std::barrier<>* block_barrier;
thread_local std::barrier<>** warp_barriers;
std::atomic<long> misaligned{0};
thread_local unsigned int (*shuffle_slots)[32];
int jitter = 0;

// One block's shared memory (NaN at the start: a read before a write shows), barriers and shuffle slots.
struct BlockContext {
    std::vector<float> shared;
    std::barrier<> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<std::barrier<>*> warp_pointers;
    unsigned int slots[32][32];
    BlockContext(int threads, size_t shared_bytes) : shared(shared_bytes / 4 + 4, std::nanf("")), block(threads)
    {
        for (int w = 0; w < threads / 32; ++w) {
            warps.emplace_back(new std::barrier<>(32));
            warp_pointers.push_back(warps.back().get());
        }
    }
    float* aligned_shared()
    {
        return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(shared.data()) + 15) & ~uintptr_t(15));
    }
};

// The threads of block `index` (x fastest) of the grid, started into `pool`, each with the block's context.
template <class F>
void start_block(BlockContext& context, unsigned index, int threads, F kernel, std::vector<std::thread>& pool)
{
    const dim3 grid = gridDim;
    const unsigned x = index % grid.x, y = index / grid.x % grid.y, z = index / (grid.x * grid.y);
    for (int t = 0; t < threads; ++t) {
        pool.emplace_back([=, &context] {
            threadIdx = dim3{unsigned(t), 0, 0};
            blockIdx = dim3{x, y, z};
            emulated_shared = context.aligned_shared();
            block_barrier = &context.block;
            warp_barriers = context.warp_pointers.data();
            shuffle_slots = context.slots;
            kernel();
        });
    }
}

template <class F> void run_grid(dim3 grid, int threads, size_t shared_bytes, F kernel)
{
    gridDim = grid;
    blockDim = dim3{unsigned(threads), 1, 1};
    for (unsigned index = 0; index < grid.x * grid.y * grid.z; ++index) {
        BlockContext context(threads, shared_bytes);
        std::vector<std::thread> pool;
        start_block(context, index, threads, kernel, pool);
        for (auto& thread : pool) thread.join();
    }
}

// Every block at once, as a cooperative launch runs them: for kernels whose blocks wait on each other.
// Their shared memory must be the dynamic one (emulated_shared): a static __shared__ array is one for all.
template <class F> void run_grid_concurrent(dim3 grid, int threads, size_t shared_bytes, F kernel)
{
    gridDim = grid;
    blockDim = dim3{unsigned(threads), 1, 1};
    const unsigned blocks = grid.x * grid.y * grid.z;
    std::vector<std::unique_ptr<BlockContext>> contexts;
    std::vector<std::thread> pool;
    for (unsigned index = 0; index < blocks; ++index) {
        contexts.emplace_back(new BlockContext(threads, shared_bytes));
    }
    for (unsigned index = 0; index < blocks; ++index) {
        start_block(*contexts[index], index, threads, kernel, pool);
    }
    for (auto& thread : pool) thread.join();
}

template <class T> static std::vector<T> load_as(const std::string& path, size_t count)
{
    std::vector<T> v(count);
    std::ifstream file(path, std::ios::binary);
    file.read(reinterpret_cast<char*>(v.data()), count * sizeof(T));
    if (!file) { std::fprintf(stderr, "short read: %s\n", path.c_str()); std::exit(2); }
    return v;
}
static std::vector<float> load(const std::string& path, size_t count) { return load_as<float>(path, count); }
static std::vector<unsigned short> load_u16(const std::string& path, size_t count)
{
    return load_as<unsigned short>(path, count);
}
template <class T> static void save(const std::string& path, const std::vector<T>& v)
{
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}
// save(prefix + names[i], vectors[i]) for each vector, in order.
template <class... Vectors>
static void save_each(const std::string& prefix, std::initializer_list<const char*> names, const Vectors&... vectors)
{
    auto name = names.begin();
    (save(prefix + *name++, vectors), ...);
}
"""


# The device-only helpers of common/sync.cuh (the first two no-ops before sm_90; their bodies are
# inline PTX or device intrinsics), removed wherever it is inlined: HOST_CUDA_HEADER defines them.
SYNC_DEVICE_HELPERS = ("kda_let_next_kernel_launch", "kda_grid_dependency_wait", "shared_address", "load_acquire",
                       "kda_count_release")


def _remove_helper(source: str, name: str) -> str | None:
    """`source` without the definition of device helper `name`, or None where it has none."""
    match = re.search(r"__device__ __forceinline__ (?:\w+ )+" + name + r"\(.*?\n\}\n", source, re.S)
    return None if match is None else source[: match.start()] + source[match.end() :]


def host_kernel_source(stem: str, device_helpers: tuple[str, ...] = ()) -> str:
    """``<stem>.cu`` (headers inlined) for the host: host_source of its text."""
    return host_source(kernels.kernel_source(stem), f"{stem}.cu", device_helpers)


def host_source(source: str, name: str, device_helpers: tuple[str, ...] = ()) -> str:
    """A kernel text (headers inlined; `name` in messages) for the host: the named PTX-only helpers
    and those of common/sync.cuh removed (the emulation header, or the test, defines them), every
    vector cast alignment-checked, no inline PTX left."""
    for helper in device_helpers:
        removed = _remove_helper(source, helper)
        assert removed is not None, f"{name} no longer defines {helper}; update the host emulation"
        source = removed
    for helper in SYNC_DEVICE_HELPERS:
        source = _remove_helper(source, helper) or source
    for vector in ("float4", "float2", "uint4", "uint2", "unsigned int"):
        source = source.replace(f"reinterpret_cast<const {vector}*>(", f"checked_cast<const {vector}>(")
        source = source.replace(f"reinterpret_cast<{vector}*>(", f"checked_cast<{vector}>(")
    assert "asm" not in re.sub(r"//.*", "", source), f"inline PTX left in the host build of {name}"
    return source


def kernel_declaration(stem: str, name: str) -> str:
    """The declaration of entry point `name` of ``<stem>.cu``, its parameters copied from the
    definition, for a host harness to call it with: a declaration written out by hand is not checked
    against the definition across translation units."""
    match = re.search(r'^extern "C" __global__ void(?:\s+__launch_bounds__\([^)]*\))?\s+' + name + r"\((.*?)\)\s*\{",
                      kernels.kernel_source(stem), re.M | re.S)
    assert match, f"{stem}.cu no longer defines {name}; update the host emulation"
    return f'extern "C" void {name}({match.group(1)});\n'


def build_host_binary(folder: Path, name: str, files: dict[str, str], address_sanitizer: bool = False) -> Path:
    """Write `files` into `folder` and compile every .cpp among them into `folder / name`;
    skips the test where no C++20 compiler is at hand. address_sanitizer: built with
    AddressSanitizer, so that a read or write past a buffer the kernel is handed ends the run with
    the access named (skipped where the compiler cannot)."""
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler for the host emulation")
    # GLM_KDA_HOST_ASAN=1 builds every host binary that way (a run of the host suite under it).
    address_sanitizer = address_sanitizer or os.environ.get("GLM_KDA_HOST_ASAN") == "1"
    sanitizer = ["-fsanitize=address", "-fno-omit-frame-pointer"] if address_sanitizer else []
    probe = folder / "probe.cpp"
    probe.write_text("#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n")
    if subprocess.run([compiler, "-std=c++20", "-pthread", *sanitizer, "-o", str(folder / "probe"), str(probe)],
                      capture_output=True).returncode != 0:
        pytest.skip(f"{compiler} lacks C++20 <barrier>" + (" or AddressSanitizer" if sanitizer else ""))
    for file_name, text in files.items():
        (folder / file_name).write_text(text)
    binary = folder / name
    result = subprocess.run(
        [compiler, "-std=c++20", "-O1" if sanitizer else "-O2", "-pthread", "-Wno-unknown-pragmas", *sanitizer,
         "-o", str(binary), *(str(folder / file_name) for file_name in files if file_name.endswith(".cpp"))],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, f"host build of {name} failed:\n{result.stderr[-4000:]}"
    return binary
