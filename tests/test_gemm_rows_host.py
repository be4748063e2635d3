"""kernels_src/projection/gemm_rows.cu on the host (tests/host_cuda.py), launched as
glm_kda.gpu.projection plans it, so CPU CI runs the projection kernel's own indexing, predication,
k tails and split-k order.

The BF16 mma.m16n8k16 is emulated as a warp collective from the PTX fragment layout (A: row g
for registers 0 and 2, g + 8 for 1 and 3, k 2t + 8 (r / 2) + e; B: k 2t + 8 r + e, column g;
C: row g + 8 (e / 2), column 2t + e % 2; lane = 4g + t), the products summed in float64: the
hardware's rounding inside an mma is not modelled, so host bits are compared with host bits.

Promises tested: row r of an R-row launch equals a one-row launch on x[r] alone, bit for bit,
for R from 1 to 65 and every entry point the plan picks; tiles per warp and the grid change no
bit; strided x and a column slice of out write only columns < n of rows < R; every row is the
float64 oracle rounded to BF16 within the bound of tests/test_gemm_rows.py.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from glm_kda.gpu.projection import _staged_plan, _tail_staged_plan, launch_plan, pack_weight
from glm_kda.reference import rms_ratio, round_bf16
from host_cuda import (HOST_CUDA_HEADER, HOST_CUDA_RUNTIME, bf16_bits, bits_to_f64, build_host_binary,
                       host_kernel_source, order_sensitive_inputs)

RMS_BOUND = 1e-3
POISON = 0x7FA5
DEVICE_HELPERS = ("load_weight_16B", "load_weight_16B_in_order", "prefetch_l2", "load_activation_16B",
                  "load_produced_16B", "mma_bf16_m16n8k16", "gemm_rows_stage_weights", "gemm_rows_wait_weights")

GEMM_HEADER = HOST_CUDA_HEADER + r"""
using bf16_t = unsigned short;
struct MmaSlot { unsigned int a[4], b[2]; };
extern MmaSlot mma_slots[32][32];
// Predicated 16-byte loads: zeros when not valid (the source is then not read).
inline uint4 load_weight_16B(const bf16_t* pointer, bool valid)
{
    uint4 v{0, 0, 0, 0};
    if (valid) std::memcpy(&v, checked_cast<const uint4>(pointer), 16);
    return v;
}
inline uint4 load_weight_16B_in_order(const bf16_t* pointer, bool valid) { return load_weight_16B(pointer, valid); }
inline uint4 load_activation_16B(const bf16_t* pointer, bool valid) { return load_weight_16B(pointer, valid); }
inline uint4 load_produced_16B(const bf16_t* pointer, bool valid) { return load_weight_16B(pointer, valid); }
inline void prefetch_l2(const void*) {}
// The staged entries' asynchronous copies (PTX on sm_80 and later): the first of the copying threads
// copies at once (thread 0 of a block's copy, lane 0 of a warp's own), and the barrier that follows
// the wait in the kernel (the block's or the warp's) publishes the copy.
inline void gemm_rows_stage_weights(void* stage, const bf16_t* source, unsigned int bytes, unsigned int thread,
                                    unsigned int)
{
    if (thread == 0) std::memcpy(stage, source, bytes);
}
inline void gemm_rows_wait_weights() {}
inline double bf16_word(unsigned int word, int half)
{
    return double(__uint_as_float(half ? (word & 0xFFFF0000u) : (word << 16)));
}
inline void mma_bf16_m16n8k16(float acc[4], unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                              unsigned int b0, unsigned int b1)
{
    // k = 2 t' + 8 half + h: register (row / 8) + 2 half of lane 4 (row % 8) + t' for A, register
    // half of lane 4 col + t' for B, element h of the register.
    warp_mma<16>(acc, MmaSlot{{a0, a1, a2, a3}, {b0, b1}}, mma_slots, [](const MmaSlot* slot, int row, int col, int k) {
        const int tk = (k % 8) / 2, half = k / 8, h = k % 2;
        return bf16_word(slot[4 * (row % 8) + tk].a[row / 8 + 2 * half], h) * bf16_word(slot[4 * col + tk].b[half], h);
    });
}
"""

GEMM_MAIN = r"""
#include "emulation.h"
""" + HOST_CUDA_RUNTIME + r"""
MmaSlot mma_slots[32][32];
#define DECLARE(M, N) extern "C" void kda_gemm_rows_bf16_m##M##_n##N(const bf16_t*, int, const bf16_t*, bf16_t*, int, int, \
                                                                int, int, int);
#define DECLARE_PACKED(M, N) extern "C" void kda_gemm_rows_packed_bf16_m##M##_n##N(const bf16_t*, int, const bf16_t*, \
                                                                              bf16_t*, int, int, int, int, int);
#define DECLARE_BOTH(M, N) DECLARE(M, N) DECLARE_PACKED(M, N)
#define DECLARE_SUMS(M, N)                                                                                        \
    extern "C" void kda_gemm_rows_sums_bf16_m##M##_n##N(const bf16_t*, int, const bf16_t*, bf16_t*, int, int, int, int, \
                                                     int, float*, int);                                            \
    extern "C" void kda_gemm_rows_packed_sums_bf16_m##M##_n##N(const bf16_t*, int, const bf16_t*, bf16_t*, int, int,   \
                                                            int, int, int, float*, int);
#define DECLARE_BOTH(M, N) DECLARE(M, N) DECLARE_PACKED(M, N) DECLARE_SUMS(M, N)
DECLARE_BOTH(1, 1) DECLARE_BOTH(1, 2) DECLARE_BOTH(1, 4) DECLARE_BOTH(2, 1) DECLARE_BOTH(2, 2) DECLARE_BOTH(2, 4)
DECLARE_BOTH(4, 1) DECLARE_BOTH(4, 2)
using SumsEntry = void (*)(const bf16_t*, int, const bf16_t*, bf16_t*, int, int, int, int, int, float*, int);
#define SUMS_ENTRY(M, N) {{M, N}, {kda_gemm_rows_sums_bf16_m##M##_n##N, kda_gemm_rows_packed_sums_bf16_m##M##_n##N}}
// Form 7: the entries writing the FP32 sums too, into a [y_rows, argv[20]] float buffer of NaN (sums.out).
int sums_form(const std::string& dir, int ld_sums, int m_tiles, int n_tiles, dim3 grid, unsigned threads, int rows,
              int n, int k, int ldx, int ldy, int x_rows, int y_rows, long w_elements)
{
    const std::pair<std::pair<int, int>, std::pair<SumsEntry, SumsEntry>> entries[] = {
        SUMS_ENTRY(1, 1), SUMS_ENTRY(1, 2), SUMS_ENTRY(1, 4), SUMS_ENTRY(2, 1), SUMS_ENTRY(2, 2), SUMS_ENTRY(2, 4),
        SUMS_ENTRY(4, 1), SUMS_ENTRY(4, 2)};
    SumsEntry entry = nullptr;
    for (const auto& [name, pair] : entries) {
        if (name == std::pair<int, int>{m_tiles, n_tiles}) entry = w_elements > 0 ? pair.second : pair.first;
    }
    if (!entry) { std::fprintf(stderr, "no sums entry m%d_n%d\n", m_tiles, n_tiles); return 2; }
    const auto x = load_u16(dir + "/x", size_t(x_rows) * ldx);
    const auto w = load_u16(dir + "/w", w_elements > 0 ? size_t(w_elements) : size_t(n) * k);
    auto y = load_u16(dir + "/y", size_t(y_rows) * ldy);
    std::vector<float> sums(size_t(y_rows) * ld_sums, std::nanf(""));
    run_grid(grid, threads, 0, [&] {
        entry(x.data(), ldx, w.data(), y.data(), ldy, rows, n, k, 0, sums.data(), ld_sums);
    });
    save_each(dir + "/", {"y.out", "sums.out"}, y, sums);
    std::printf("misaligned=%ld\n", misaligned.load());
    return 0;
}
#define DECLARE_STAGED(N) extern "C" void kda_gemm_rows_staged_awaiting_bf16_m1_n##N(const bf16_t*, int, const bf16_t*, \
                                                                                bf16_t*, int, int, int, int, int, int*, int);
DECLARE_STAGED(1) DECLARE_STAGED(2)
#define DECLARE_TAIL(N) extern "C" void kda_gemm_rows_tail_staged_awaiting_bf16_m1_n##N(const bf16_t*, int, const bf16_t*, \
                                                                           bf16_t*, int, int, int, int, int, int*, int);
DECLARE_TAIL(1) DECLARE_TAIL(2) DECLARE_TAIL(4)
using AwaitingSumsEntry = void (*)(const bf16_t*, int, const bf16_t*, bf16_t*, int, int, int, int, int, int*, int,
                                   float*, int);
#define DECLARE_AWAITING_SUMS(NAME) extern "C" void NAME(const bf16_t*, int, const bf16_t*, bf16_t*, int, int, int, \
                                                         int, int, int*, int, float*, int);
DECLARE_AWAITING_SUMS(kda_gemm_rows_packed_awaiting_sums_bf16_m1_n1) DECLARE_AWAITING_SUMS(kda_gemm_rows_packed_awaiting_sums_bf16_m1_n2)
DECLARE_AWAITING_SUMS(kda_gemm_rows_packed_awaiting_sums_bf16_m1_n4) DECLARE_AWAITING_SUMS(kda_gemm_rows_staged_awaiting_sums_bf16_m1_n1)
DECLARE_AWAITING_SUMS(kda_gemm_rows_staged_awaiting_sums_bf16_m1_n2)
DECLARE_AWAITING_SUMS(kda_gemm_rows_tail_staged_awaiting_sums_bf16_m1_n1)
DECLARE_AWAITING_SUMS(kda_gemm_rows_tail_staged_awaiting_sums_bf16_m1_n2)
DECLARE_AWAITING_SUMS(kda_gemm_rows_tail_staged_awaiting_sums_bf16_m1_n4)
using Entry = void (*)(const bf16_t*, int, const bf16_t*, bf16_t*, int, int, int, int, int);
#define DECLARE_DECODE(N)                                                                                         \
    extern "C" void kda_gemm_rows_packed_pair_bf16_m1_n##N(const bf16_t*, int, const bf16_t*, bf16_t*, int, int, int, \
                                                       int, int, const bf16_t*, const bf16_t*, bf16_t*);          \
    extern "C" void kda_gemm_rows_packed_awaiting_bf16_m1_n##N(const bf16_t*, int, const bf16_t*, bf16_t*, int, int,  \
                                                           int, int, int, int*, int);
DECLARE_DECODE(1) DECLARE_DECODE(2) DECLARE_DECODE(4)
using PairEntry = void (*)(const bf16_t*, int, const bf16_t*, bf16_t*, int, int, int, int, int, const bf16_t*,
                           const bf16_t*, bf16_t*);
using AwaitingEntry = void (*)(const bf16_t*, int, const bf16_t*, bf16_t*, int, int, int, int, int, int*, int);

// The one-sequence decode forms of the packed m1 entries (argv[17]): 1 the pair (x2 = x + argv[18]
// columns, w2 and y2 from their files), 2 awaiting words set to {argv[18], 0} (the count its target),
// 3 the staged awaiting entry so (with shared_bytes of dynamic shared memory), 5 the tail-staged
// awaiting entry as 3, its tail argv[19] k blocks, 8 form 2 with x written late. ld_sums > 0 (forms
// 2, 3 and 5): the form's entry writing the FP32 sums too, into a [y_rows, ld_sums] float buffer of
// NaN (sums.out).
int decode_form(const std::string& dir, int form, int form_arg, int n_tiles, unsigned grid_x, unsigned threads,
                int rows, int n, int k, int ldx, int ldy, int x_rows, int y_rows, long w_elements,
                size_t shared_bytes, int tail_blocks, int ld_sums)
{
    const int index = n_tiles == 1 ? 0 : n_tiles == 2 ? 1 : n_tiles == 4 ? 2 : -1;
    const PairEntry pairs[] = {kda_gemm_rows_packed_pair_bf16_m1_n1, kda_gemm_rows_packed_pair_bf16_m1_n2,
                               kda_gemm_rows_packed_pair_bf16_m1_n4};
    const AwaitingEntry awaiting[] = {kda_gemm_rows_packed_awaiting_bf16_m1_n1, kda_gemm_rows_packed_awaiting_bf16_m1_n2,
                                      kda_gemm_rows_packed_awaiting_bf16_m1_n4};
    const AwaitingEntry staged_awaiting[] = {kda_gemm_rows_staged_awaiting_bf16_m1_n1,
                                             kda_gemm_rows_staged_awaiting_bf16_m1_n2, nullptr};
    const AwaitingEntry tail_staged[] = {kda_gemm_rows_tail_staged_awaiting_bf16_m1_n1,
                                         kda_gemm_rows_tail_staged_awaiting_bf16_m1_n2,
                                         kda_gemm_rows_tail_staged_awaiting_bf16_m1_n4};
    const AwaitingSumsEntry awaiting_sums[] = {kda_gemm_rows_packed_awaiting_sums_bf16_m1_n1,
                                               kda_gemm_rows_packed_awaiting_sums_bf16_m1_n2,
                                               kda_gemm_rows_packed_awaiting_sums_bf16_m1_n4};
    const AwaitingSumsEntry staged_awaiting_sums[] = {kda_gemm_rows_staged_awaiting_sums_bf16_m1_n1,
                                                      kda_gemm_rows_staged_awaiting_sums_bf16_m1_n2, nullptr};
    const AwaitingSumsEntry tail_staged_sums[] = {kda_gemm_rows_tail_staged_awaiting_sums_bf16_m1_n1,
                                                  kda_gemm_rows_tail_staged_awaiting_sums_bf16_m1_n2,
                                                  kda_gemm_rows_tail_staged_awaiting_sums_bf16_m1_n4};
    if (index < 0 || (form == 3 && !staged_awaiting[index])) {
        std::fprintf(stderr, "no decode entry m1_n%d\n", n_tiles);
        return 2;
    }
    const auto x = load_u16(dir + "/x", size_t(x_rows) * ldx);
    const auto w = load_u16(dir + "/w", size_t(w_elements));
    auto y = load_u16(dir + "/y", size_t(y_rows) * ldy);
    if (form == 1) {
        const auto w2 = load_u16(dir + "/w2", size_t(w_elements));
        auto y2 = load_u16(dir + "/y2", size_t(y_rows) * ldy);
        run_grid(dim3{grid_x, 1, 1}, threads, 0, [&] {
            pairs[index](x.data(), ldx, w.data(), y.data(), ldy, rows, n, k, 0, x.data() + form_arg, w2.data(),
                         y2.data());
        });
        save(dir + "/y2.out", y2);
    } else if (form == 8) {
        // Form 2 with x written late: the words one short of their target, x poison until another
        // thread writes it and counts the last producer in.
        std::vector<int> words = {form_arg - 1, 0};
        std::vector<bf16_t> late(x.size(), 0x7FA5);
        std::thread producer([&] {
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            std::copy(x.begin(), x.end(), late.begin());
            kda_count_release(words.data());
        });
        run_grid(dim3{grid_x, 1, 1}, threads, 0, [&] {
            awaiting[index](late.data(), ldx, w.data(), y.data(), ldy, rows, n, k, 0, words.data(), form_arg);
        });
        producer.join();
        save(dir + "/words.out", words);
    } else if (ld_sums > 0) {
        std::vector<int> words = {form_arg, 0};
        std::vector<float> sums(size_t(y_rows) * ld_sums, std::nanf(""));
        const AwaitingSumsEntry entry =
            form == 3 ? staged_awaiting_sums[index] : form == 5 ? tail_staged_sums[index] : awaiting_sums[index];
        run_grid(dim3{grid_x, 1, 1}, threads, form == 3 || form == 5 ? shared_bytes : 0, [&] {
            entry(x.data(), ldx, w.data(), y.data(), ldy, rows, n, k, form == 5 ? tail_blocks : 0, words.data(),
                  form_arg, sums.data(), ld_sums);
        });
        save_each(dir + "/", {"words.out", "sums.out"}, words, sums);
    } else {
        std::vector<int> words = {form_arg, 0};
        const AwaitingEntry entry = form == 3 ? staged_awaiting[index] : form == 5 ? tail_staged[index] : awaiting[index];
        run_grid(dim3{grid_x, 1, 1}, threads, form == 3 || form == 5 ? shared_bytes : 0, [&] {
            entry(x.data(), ldx, w.data(), y.data(), ldy, rows, n, k, form == 5 ? tail_blocks : 0, words.data(),
                  form_arg);
        });
        save(dir + "/words.out", words);
    }
    save(dir + "/y.out", y);
    std::printf("misaligned=%ld\n", misaligned.load());
    return 0;
}

int main(int argc, char** argv)
{
    const std::string dir = argv[1];
    const int m_tiles = std::atoi(argv[2]), n_tiles = std::atoi(argv[3]);
    const unsigned grid_x = std::atoi(argv[4]), grid_y = std::atoi(argv[5]);
    const int rows = std::atoi(argv[6]), n = std::atoi(argv[7]), k = std::atoi(argv[8]);
    const int ldx = std::atoi(argv[9]), ldy = std::atoi(argv[10]), x_rows = std::atoi(argv[11]);
    const int y_rows = std::atoi(argv[12]);
    // launches > 1: that many one-row launches (the plan is a one-row plan), on rows 0, 1, ...
    const int launches = std::atoi(argv[13]);
    // w_elements > 0: w is in the packed layout (that many elements) and the packed entry runs.
    const long w_elements = std::atol(argv[14]);
    const unsigned threads = std::atoi(argv[15]);
    const size_t shared_bytes = std::atol(argv[16]);
    const int form = std::atoi(argv[17]);
    if (form == 7) {
        return sums_form(dir, std::atoi(argv[18]), m_tiles, n_tiles, dim3{grid_x, grid_y, 1}, threads, rows, n, k, ldx,
                         ldy, x_rows, y_rows, w_elements);
    }
    if (form != 0) {
        return decode_form(dir, form, std::atoi(argv[18]), n_tiles, grid_x, threads, rows, n, k, ldx, ldy, x_rows,
                           y_rows, w_elements, shared_bytes, std::atoi(argv[19]), std::atoi(argv[20]));
    }
    const std::pair<int, int> key{m_tiles, n_tiles};
    const std::pair<std::pair<int, int>, Entry> entries[] = {
        {{1, 1}, kda_gemm_rows_bf16_m1_n1}, {{1, 2}, kda_gemm_rows_bf16_m1_n2}, {{1, 4}, kda_gemm_rows_bf16_m1_n4},
        {{2, 1}, kda_gemm_rows_bf16_m2_n1}, {{2, 2}, kda_gemm_rows_bf16_m2_n2}, {{2, 4}, kda_gemm_rows_bf16_m2_n4},
        {{4, 1}, kda_gemm_rows_bf16_m4_n1}, {{4, 2}, kda_gemm_rows_bf16_m4_n2}};
    const std::pair<std::pair<int, int>, Entry> packed_entries[] = {
        {{1, 1}, kda_gemm_rows_packed_bf16_m1_n1}, {{1, 2}, kda_gemm_rows_packed_bf16_m1_n2},
        {{1, 4}, kda_gemm_rows_packed_bf16_m1_n4}, {{2, 1}, kda_gemm_rows_packed_bf16_m2_n1},
        {{2, 2}, kda_gemm_rows_packed_bf16_m2_n2}, {{2, 4}, kda_gemm_rows_packed_bf16_m2_n4},
        {{4, 1}, kda_gemm_rows_packed_bf16_m4_n1}, {{4, 2}, kda_gemm_rows_packed_bf16_m4_n2}};
    Entry entry = nullptr;
    for (const auto& [name, function] : w_elements > 0 ? packed_entries : entries) {
        if (name == key) entry = function;
    }
    if (!entry) { std::fprintf(stderr, "no entry m%d_n%d\n", m_tiles, n_tiles); return 2; }
    const auto x = load_u16(dir + "/x", size_t(x_rows) * ldx);
    const auto w = load_u16(dir + "/w", w_elements > 0 ? size_t(w_elements) : size_t(n) * k);
    auto y = load_u16(dir + "/y", size_t(y_rows) * ldy);
    for (int launch = 0; launch < launches; ++launch) {
        run_grid(dim3{grid_x, grid_y, 1}, threads, shared_bytes, [&] {
            entry(x.data() + size_t(launch) * ldx, ldx, w.data(), y.data() + size_t(launch) * ldy, ldy, rows, n, k, 0);
        });
    }
    save(dir + "/y.out", y);
    std::printf("misaligned=%ld\n", misaligned.load());
    return 0;
}
"""


def host_gemm_rows_sources() -> dict[str, str]:
    """The row projection's files (gemm_rows.cu, its sums, decode and staged forms) for the host, one
    translation unit each as NVRTC compiles them (host_kernel_source with DEVICE_HELPERS removed), the
    staged entries' dynamic shared array taken from the emulated block's."""
    stems = ("gemm_rows", "gemm_rows_sums", "gemm_rows_decode", "gemm_rows_staged")
    units = {f"{stem}.cpp": '#include "emulation.h"\n' + host_kernel_source(f"projection/{stem}", DEVICE_HELPERS)
             for stem in stems}
    declaration = "extern __shared__ __align__(128) unsigned char gemm_rows_stage[];"
    assert [name for name, unit in units.items() if declaration in unit] == ["gemm_rows_staged.cpp"], \
        "gemm_rows_staged.cu no longer declares gemm_rows_stage alone; update the host emulation"
    units["gemm_rows_staged.cpp"] = units["gemm_rows_staged.cpp"].replace(
        declaration, "unsigned char* gemm_rows_stage = reinterpret_cast<unsigned char*>(emulated_shared);")
    return units


def _gemm_host_files() -> dict[str, str]:
    return {"emulation.h": GEMM_HEADER, "main.cpp": GEMM_MAIN, **host_gemm_rows_sources()}


@pytest.fixture(scope="module")
def gemm_host(tmp_path_factory):
    return build_host_binary(tmp_path_factory.mktemp("gemm_rows_host"), "gemm_rows_host", _gemm_host_files())


@pytest.fixture(scope="module")
def gemm_host_checked(tmp_path_factory):
    """The same binary built with AddressSanitizer."""
    return build_host_binary(tmp_path_factory.mktemp("gemm_rows_host_asan"), "gemm_rows_host", _gemm_host_files(),
                             address_sanitizer=True)




_calls = iter(range(10**9))


def run_host(binary, x_buffer, w, rows, y_buffer, one_row_launches=False, packed=False, form=0, form_arg=0, w2=None,
             sums_ld=0, **plan_args):
    """One launch as gemm_rows_bf16 plans it (132 SMs), on x_buffer[:, :k] (row stride of the
    buffer) into y_buffer[:, :n], or with one_row_launches a one-row launch per row; returns the
    new y_buffer. packed: the packed entry point on pack_weight(w). form 1: gemm_rows_pair_bf16's
    launch with w2, x2 = x_buffer from column form_arg and y2 a copy of y_buffer; returns (y, y2).
    form 2: the awaiting entry with its words set to {form_arg, 0} and form_arg its target; returns
    (y, words after). form 3: the same with the staged awaiting entry as _staged_plan plans it.
    form 5: the tail-staged awaiting entry as _tail_staged_plan plans it (plan_args its tail_blocks),
    words as form 2. form 7: the entry writing the FP32 sums too (packed or not), into [y_buffer rows,
    form_arg] floats of NaN; returns (y, sums). form 8: form 2 with x written late. sums_ld > 0 with
    form 2, 3 or 5: that form's entry writing the sums too, into [y_buffer rows, sums_ld] floats of
    NaN; returns (y, words, sums)."""
    n, k = w.shape
    packed = packed or form not in (0, 7)
    w_file = pack_weight(w.view(np.uint16)).data if packed else w
    if form == 3:
        plan = _staged_plan(n, k, rows, **plan_args)
        assert plan is not None, f"N{n}-K{k} R{rows}: no staged plan"
    elif form == 5:
        plan = _tail_staged_plan(n, k, rows, **plan_args)
        assert plan is not None, f"N{n}-K{k} R{rows}: no tail-staged plan"
    else:
        plan = launch_plan(2 * n if form == 1 else n, k, 1 if one_row_launches else rows, **plan_args)
    m_tiles, n_tiles = (int(part[1:]) for part in plan.kernel.split("_")[-2:])
    folder = binary.parent / f"call{next(_calls)}"
    folder.mkdir()
    x_buffer.tofile(folder / "x")
    w_file.tofile(folder / "w")
    y_buffer.tofile(folder / "y")
    if form == 1:
        pack_weight(w2.view(np.uint16)).data.tofile(folder / "w2")
        y_buffer.tofile(folder / "y2")
    result = subprocess.run(
        [str(binary), str(folder), str(m_tiles), str(n_tiles), str(plan.grid[0]), str(plan.grid[1]),
         str(1 if one_row_launches else rows), str(n),
         str(k), str(x_buffer.shape[1]), str(y_buffer.shape[1]), str(x_buffer.shape[0]), str(y_buffer.shape[0]),
         str(rows if one_row_launches else 1), str(w_file.size if packed else 0), str(plan.block[0]),
         str(plan.shared_mem), str(form), str(form_arg), str(plan.tail_blocks), str(sums_ld)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["misaligned=0"], f"host run: {result.stdout.strip()}"
    y = np.fromfile(folder / "y.out", np.uint16).reshape(y_buffer.shape)
    if form == 1:
        return y, np.fromfile(folder / "y2.out", np.uint16).reshape(y_buffer.shape)
    if form == 7:
        return y, np.fromfile(folder / "sums.out", np.float32).reshape(y_buffer.shape[0], form_arg)
    if form == 0:
        return y
    words = np.fromfile(folder / "words.out", np.int32)
    if sums_ld:
        return y, words, np.fromfile(folder / "sums.out", np.float32).reshape(y_buffer.shape[0], sums_ld)
    return y, words


def _inputs(n, k, rows, seed):
    rng = np.random.default_rng(seed)
    return bf16_bits(rng.standard_normal((rows, k))), bf16_bits(rng.standard_normal((n, k)) * k**-0.5)


def _assert_bits_equal(actual, expected, tag):
    differ = int(np.count_nonzero(actual != expected))
    assert differ == 0, f"{tag}: {differ} elements differ in bits"


@pytest.mark.parametrize("shape", [(40, 128), (100, 136), (72, 2056)], ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_rows_equal_one_row_launches_on_host(gemm_host, shape):
    n, k = shape
    x, w = _inputs(n, k, 65, seed=n + k)
    one_row = run_host(gemm_host, x, w, 65, np.full((65, n), POISON, np.uint16), one_row_launches=True)
    ratio = rms_ratio(bits_to_f64(one_row), round_bf16(bits_to_f64(x) @ bits_to_f64(w).T))
    assert ratio <= RMS_BOUND, f"N{n}-K{k}: rms-ratio {ratio:.3e} against the float64 oracle (bound {RMS_BOUND:g})"
    for rows in (2, 3, 16, 17, 33, 64, 65):
        out = run_host(gemm_host, x[:rows], w, rows, np.full((rows, n), POISON, np.uint16))
        _assert_bits_equal(out, one_row[:rows], f"N{n}-K{k} R{rows} vs one-row launches")


@pytest.mark.parametrize("rows", [1, 16, 40], ids=lambda r: f"R{r}")
def test_tiles_and_grid_change_no_bit_on_host(gemm_host, rows):
    n, k = 200, 520
    x, w = _inputs(n, k, rows, seed=rows)
    default = run_host(gemm_host, x, w, rows, np.full((rows, n), POISON, np.uint16))
    for tiles in (1, 2, 4):
        for blocks in (None, 1, 3):
            out = run_host(gemm_host, x, w, rows, np.full((rows, n), POISON, np.uint16), tiles_per_warp=tiles,
                           blocks=blocks)
            _assert_bits_equal(out, default, f"R{rows} tiles_per_warp={tiles} blocks={blocks}")


@pytest.mark.parametrize("rows", [1, 5, 33], ids=lambda r: f"R{r}")
def test_strided_x_and_column_slice_out_on_host(gemm_host, rows):
    n, k = 136, 264
    rng = np.random.default_rng(rows)
    x_buffer = bf16_bits(rng.standard_normal((rows + 3, k + 40)))
    w = bf16_bits(rng.standard_normal((n, k)) * k**-0.5)
    # x: columns 0 .. k of a buffer with row stride k + 40; out: columns 0 .. n of a wider buffer.
    contiguous = run_host(gemm_host, np.ascontiguousarray(x_buffer[:rows, :k]), w, rows,
                          np.full((rows, n), POISON, np.uint16))
    wide = run_host(gemm_host, x_buffer, w, rows, np.full((rows + 2, n + 40), POISON, np.uint16))
    _assert_bits_equal(wide[:rows, :n], contiguous, f"R{rows} strided x / sliced out vs contiguous")
    untouched = np.ones(wide.shape, dtype=bool)
    untouched[:rows, :n] = False
    assert (wide[untouched] == POISON).all(), f"R{rows}: wrote outside columns < {n} / rows < {rows}"


@pytest.mark.parametrize("rows,form", [(1, "packed"), (5, "row-major"), (5, "packed"), (17, "packed"),
                                       (33, "row-major")], ids=lambda v: str(v))
def test_no_access_outside_the_operands_on_host(gemm_host_checked, rows, form):
    """x, w and out exactly as large as the launch's rows, n and k (no slack a stray access could
    land in), under AddressSanitizer: a row past `rows` read or written, or a k or n tail read
    past the end, ends the run naming the access (the bits are the other tests' business)."""
    n, k = 100, 136
    x, w = _inputs(n, k, rows, seed=rows)
    run_host(gemm_host_checked, x, w, rows, np.full((rows, n), POISON, np.uint16), packed=form == "packed")


@pytest.mark.parametrize("shape", [(40, 128), (100, 136), (72, 2056), (13, 40)], ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_packed_weight_gives_the_row_major_bits_on_host(gemm_host, shape):
    """The packed layout (n and k padded by zeros) loads the values the row-major launch loads:
    the same bits for every entry point the plans pick, every tile width and a small grid."""
    n, k = shape
    x, w = _inputs(n, k, 40, seed=5 * n + k)
    for rows in (1, 16, 40):
        for tiles, blocks in ((None, None), (1, 3), (4, 1), (2, 3)):
            args = dict(tiles_per_warp=tiles, blocks=blocks)
            row_major = run_host(gemm_host, x[:rows], w, rows, np.full((rows, n), POISON, np.uint16), **args)
            packed = run_host(gemm_host, x[:rows], w, rows, np.full((rows, n), POISON, np.uint16), packed=True,
                              **args)
            _assert_bits_equal(packed, row_major, f"N{n}-K{k} R{rows} tiles={tiles} blocks={blocks} packed")
            assert (packed != POISON).all(), f"N{n}-K{k} R{rows}: the packed launch left outputs unwritten"


@pytest.mark.parametrize("shape", [(40, 128), (100, 136), (13, 40)], ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_pair_launch_gives_each_projection_its_own_bits_on_host(gemm_host, shape):
    """gemm_rows_pair_bf16's entry: y = x @ w.T and y2 = x2 @ w2.T in one launch (x2 a column range of
    the same buffer, as down_proj's forget and gate ranges are), each bit-equal to its own packed
    launch, for every tile width and a small grid."""
    n, k = shape
    rng = np.random.default_rng(n + 7 * k)
    x = bf16_bits(rng.standard_normal((16, 2 * k)))
    w, w2 = (bf16_bits(rng.standard_normal((n, k)) * k**-0.5) for _ in range(2))
    for rows in (1, 5, 16):
        for tiles, blocks in ((None, None), (1, 3), (4, 1), (2, 2)):
            args = dict(tiles_per_warp=tiles, blocks=blocks)
            tag = f"N{n}-K{k} R{rows} tiles={tiles} blocks={blocks}"
            fresh = np.full((rows, n), POISON, np.uint16)
            y, y2 = run_host(gemm_host, x[:rows], w, rows, fresh, form=1, form_arg=k, w2=w2, **args)
            _assert_bits_equal(y, run_host(gemm_host, x[:rows, :k], w, rows, fresh, packed=True, **args),
                               f"{tag}: the first projection of the pair")
            _assert_bits_equal(y2, run_host(gemm_host, np.ascontiguousarray(x[:rows, k:]), w2, rows, fresh,
                                            packed=True, **args), f"{tag}: the second projection of the pair")
            assert (y != POISON).all() and (y2 != POISON).all(), f"{tag}: the pair left outputs unwritten"


@pytest.mark.parametrize("late", [False, True], ids=["counted", "late"])
@pytest.mark.parametrize("rows", [1, 9], ids=lambda r: f"R{r}")
def test_awaiting_launch_gives_the_packed_bits_and_clears_its_words_on_host(gemm_host, rows, late):
    """The awaiting entry: the packed entry's bits, and its words back at zero once every block has
    passed the wait. counted: the fused step's count already at its target; late: the words one
    short of it and x not yet written at the launch, a producer thread writing x 50 ms later and
    then counting in (so a wait one short, or none, reads poison)."""
    n, k = 100, 136
    x, w = _inputs(n, k, rows, seed=rows + (40 if late else 0))
    for tiles, blocks in ((None, None), (1, 3)):
        tag = f"R{rows} tiles={tiles} blocks={blocks}" + (" awaiting a late x" if late else " awaiting")
        fresh = np.full((rows, n), POISON, np.uint16)
        y, words = run_host(gemm_host, x, w, rows, fresh, form=8 if late else 2, form_arg=3, tiles_per_warp=tiles,
                            blocks=blocks)
        _assert_bits_equal(y, run_host(gemm_host, x, w, rows, fresh, packed=True, tiles_per_warp=tiles,
                                       blocks=blocks), tag)
        assert words.tolist() == [0, 0], f"{tag}: words after {words.tolist()}"


@pytest.mark.parametrize("packed", [False, True], ids=["rowmajor", "packed"])
@pytest.mark.parametrize("rows", [1, 9, 40], ids=lambda r: f"R{r}")
def test_sums_entries_write_what_out_rounds_on_host(gemm_host, rows, packed):
    """The entries writing each output's FP32 sum too (a tensor-parallel rank's partial output): out
    holds the plain entry's bits, the sums round to them (nearest even), they are the float64 dot
    products within FP32 accumulation, and nothing lands outside rows < R and columns < n of the
    sums. Every m-tile count (1, 9, 40 rows), tiles and grids, k tails and split-k ranges."""
    import ml_dtypes

    for n, k in ((100, 136), (72, 1032)):
        x, w = _inputs(n, k, rows, seed=rows + 31)
        exact = bits_to_f64(x) @ bits_to_f64(w).T
        for tiles, blocks in ((None, None), (1, 3), (2, 1)):
            tag = f"N{n}-K{k} R{rows} tiles={tiles} blocks={blocks}"
            fresh = np.full((rows + 2, n), POISON, np.uint16)
            plain = run_host(gemm_host, x, w, rows, fresh, packed=packed, tiles_per_warp=tiles, blocks=blocks)
            y, sums = run_host(gemm_host, x, w, rows, fresh, packed=packed, form=7, form_arg=n + 3,
                               tiles_per_warp=tiles, blocks=blocks)
            _assert_bits_equal(y, plain, f"{tag}: out of the sums entry")
            rounded = sums[:rows, :n].astype(ml_dtypes.bfloat16).view(np.uint16)
            _assert_bits_equal(rounded, y[:rows, :n], f"{tag}: sums rounded to BF16")
            assert np.isnan(sums[rows:]).all() and np.isnan(sums[:, n:]).all(), f"{tag}: sums outside rows x n"
            error = np.abs(sums[:rows, :n] - exact).max() / np.abs(exact).max()
            assert error < 1e-5, f"{tag}: FP32 sums {error:.2e} (relative to the largest) from the float64 dot products"


@pytest.mark.parametrize("shape", [(40, 128), (72, 1032)], ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_awaiting_forms_write_their_sums_on_host(gemm_host, shape):
    """The awaiting entries writing the FP32 sums too (a tensor-parallel rank's one-row o_proj): the
    packed awaiting (form 2), staged awaiting (3) and tail-staged awaiting (5) entries each give the
    bits of their plain form, clear their words, and write sums that round to those bits, nothing
    outside rows < R and columns < n."""
    import ml_dtypes

    n, k = shape
    x, w = _inputs(n, k, 16, seed=13 * n + k)
    for rows, tiles in ((1, None), (5, 4), (16, None)):
        plans = {2: launch_plan(n, k, rows, tiles), 3: _staged_plan(n, k, rows),
                 5: _tail_staged_plan(n, k, rows, tiles_per_warp=tiles)}
        for form, plan in plans.items():
            if plan is None:
                continue
            tag = f"N{n}-K{k} R{rows} form {form} {plan.kernel}"
            extra = {"form": form, "form_arg": plan.grid[0] if form != 2 else 3}
            if form != 3:
                extra["tiles_per_warp"] = tiles
            plain, _ = run_host(gemm_host, x, w, rows, np.full((rows, n), POISON, np.uint16), **extra)
            y, words, sums = run_host(gemm_host, x, w, rows, np.full((rows, n), POISON, np.uint16), sums_ld=n + 3,
                                      **extra)
            _assert_bits_equal(y, plain, f"{tag}: out")
            assert words.tolist() == [0, 0], f"{tag}: words after {words.tolist()}"
            _assert_bits_equal(sums[:rows, :n].astype(ml_dtypes.bfloat16).view(np.uint16), y, f"{tag}: rounded sums")
            assert np.isnan(sums[rows:]).all() and np.isnan(sums[:, n:]).all(), f"{tag}: sums outside rows x n"


def test_pack_weight_layout():
    """pack_weight's layout element by element: data[tile, kb, 8 lane + e] = w[8 tile + lane // 4,
    32 kb + 8 (lane % 4) + e], zeros past n and k."""
    n, k = 11, 48
    w = (np.arange(n * k, dtype=np.uint16) + 1).reshape(n, k)
    data = pack_weight(w).data
    assert data.shape == (2, 2, 256), data.shape
    for tile, kb, lane, e in np.ndindex(*data.shape[:2], 32, 8):
        row, col = 8 * tile + lane // 4, 32 * kb + 8 * (lane % 4) + e
        expected = w[row, col] if row < n and col < k else 0
        assert data[tile, kb, 8 * lane + e] == expected, (tile, kb, lane, e)


def test_tile_layout():
    """tile_layout element by element (zeros past m and k, m and k not multiples of the group or the
    block), and slot by slot against the A fragment the mma.sync sweeps form from two loads of
    pack_weight's layout (gemm_rows.cuh's mma_bf16_step): logical slot 8 h + 2 t + e of k16 step s
    holds the value that fragment holds there, for every column."""
    from glm_kda.gpu.projection import tile_layout

    n, k = 70, 72
    w = (np.arange(n * k, dtype=np.uint16) + 1).reshape(n, k)
    tiles = tile_layout(w, "test")
    assert tiles.shape == (2, 3, 2048), tiles.shape
    for group, kb, s, h, c, t, e in np.ndindex(2, 3, 2, 2, 64, 4, 2):
        row, col = 64 * group + c, 32 * kb + 8 * t + 4 * s + 2 * h + e
        expected = w[row, col] if row < n and col < k else 0
        assert tiles[group, kb, 1024 * s + 512 * h + 8 * c + 2 * t + e] == expected, (group, kb, s, h, c, t, e)
    packed = pack_weight(w, tiles=True)
    assert np.array_equal(packed.tiles, tiles) and pack_weight(w).tiles is None
    # mma_bf16_step's A fragment (low, high, s) of tiles 2 p, 2 p + 1: words 2 s, 2 s + 1 of each load, low's rows
    # g (words 0, 2 of the fragment) and high's g + 8 (words 1, 3); fragment words 0, 1 are slots
    # 2 t, 2 t + 1 and words 2, 3 slots 8 + 2 t, 9 + 2 t.
    words = packed.data.view(np.uint32).reshape(packed.data.shape[0], 3, 32, 4)  # [tile, kb, lane, word]
    for tile, kb, s, g, t, word, e in np.ndindex(words.shape[0], 3, 2, 8, 4, 4, 2):
        if (word % 2) != tile % 2:
            continue
        row = 8 * tile + g
        value = int(words[tile, kb, 4 * g + t, 2 * s + word // 2]) >> (16 * e) & 0xFFFF  # element e of the word
        slot = 8 * (word // 2) + 2 * t + e
        h, tt, ee = slot // 8, (slot % 8) // 2, slot % 2
        assert tiles[row // 64, kb, 1024 * s + 512 * h + 8 * (row % 64) + 2 * tt + ee] == value, (tile, kb, s, g, t, word, e)


def test_bulk_plan_fits_and_chooses():
    """_bulk_plan: the ring and its barriers fit a block's shared memory (two blocks an SM with one
    warpgroup), a grid of at most the super-groups in one wave of resident blocks, the warpgroups that
    load the busiest SM least, and the kernel source's chunk and tile sizes."""
    from glm_kda.gpu import projection as gemm_rows
    from glm_kda.gpu.build import kernel_source
    from glm_kda.gpu.projection import _bulk_fill_tiles as bulk_fill_tiles
    from glm_kda.gpu.projection import _bulk_plan as bulk_plan
    from glm_kda.gpu.projection import _bulk_warpgroups as bulk_warpgroups
    from glm_kda.gpu.projection import x_tiles_size

    for n, k in ((24576, 4096), (12288, 2304), (4096, 8192), (2304, 4096), (13, 40)):
        for rows in (17, 64, 65, 256):
            for warpgroups in (None, 1, 2, 3):
                plan = bulk_plan(n, k, rows, 132, warpgroups)
                wg = plan.warpgroups
                assert plan.kernel == f"kda_gemm_rows_bulk_g{wg}" and plan.block == (128 * wg + 32,)
                row_groups = -(-rows // 64)
                cap = 132 * (2 if wg == 1 else 1) // row_groups
                assert plan.grid == (min(cap, -(-(-(-n // 64)) // wg)), row_groups)
                slot = (1 + wg) * gemm_rows._BULK_CHUNK * gemm_rows._BULK_TILE_BYTES
                assert plan.shared_mem == plan.stages * (slot + 16) <= gemm_rows._SHARED_PER_BLOCK
                assert 1 <= plan.stages <= gemm_rows._BULK_MAX_STAGES
                if wg == 1:
                    assert 2 * (plan.shared_mem + 1024) <= gemm_rows._SHARED_PER_SM
    # The warpgroups whose busiest SM copies the fewest 4 KB tiles (x's and the weight's). GLM's q|k|v
    # (384 groups, 128 blocks of 32 k): 128 blocks of 3, 4 x 128 tiles, against 2 tasks of 3 x 128 at 2
    # warpgroups; Kimi's (192 groups, 72 blocks): 96 blocks of 2 at 64 rows, 3 warpgroups at 256 rows
    # (2 tasks of 4 x 72 tiles, against 3 of 3 x 72).
    assert bulk_fill_tiles(384, 4096, 64, 3, False, 132) == 4 * 128
    assert bulk_fill_tiles(384, 4096, 64, 2, False, 132) == 2 * 3 * 128
    assert bulk_warpgroups(384, 4096, 64, False, 132) == 3 and bulk_warpgroups(192, 2304, 64, False, 132) == 2
    assert bulk_warpgroups(192, 2304, 256, False, 132) == 3 and bulk_warpgroups(5, 4096, 64, False, 132) == 1
    # Split o_proj at 64 rows, 8 ranges: Kimi's 36 groups of 16-block ranges take 3 warpgroups (96
    # tasks, one an SM: 4 x 16 tiles, against 2 tasks of 3 x 16 at 2), GLM's 64 groups of 32-block
    # ranges 2 (256 tasks: 2 of 3 x 32, against 2 of 4 x 32 at 3 and 4 of 2 x 32 at 1).
    assert bulk_plan(2304, 4096, 64, 132, split=None) == bulk_plan(2304, 4096, 64, 132, 3, split=True)
    assert bulk_plan(2304, 4096, 64, 132, split=None).grid == (96, 1)
    # GLM's q|k|v: 4 row groups (256 rows) in one wave of 132 blocks, 33 a row group; 3 (129 - 192
    # rows) 44 a row group; o_proj's 32 super-groups of 2 warpgroups fit as they are.
    assert bulk_plan(24576, 4096, 256, 132).grid == (33, 4) and bulk_plan(24576, 4096, 129, 132).grid == (44, 3)
    assert bulk_plan(4096, 8192, 256, 132).grid == (32, 4)
    assert bulk_plan(4096, 8192, 64, 132, split=None).warpgroups == 2
    assert x_tiles_size(65, 40) == 2 * 2 * 2048
    # Split by k range where the whole sweep would keep fewer than half the SMs busy: o_proj at up to
    # 64 rows (GLM 64 groups, Kimi 36, one warpgroup a block whole), never q|k|v, never a k of one range.
    assert bulk_plan(4096, 8192, 64, 132, split=None).split and bulk_plan(2304, 4096, 40, 132, split=None).split
    assert bulk_plan(4096, 8192, 64, 132, split=None).grid == (132, 1)  # 256 tasks of 2 warpgroups
    assert not bulk_plan(4096, 8192, 256, 132, split=None).split
    assert not bulk_plan(24576, 4096, 64, 132, split=None).split and not bulk_plan(12288, 2304, 64, 132, split=None).split
    assert not bulk_plan(4096, 128, 64, 132, split=None).split
    assert [gemm_rows._k_ranges(k) for k in (128, 1056, 2304, 4096, 8192)] == [1, 7, 8, 8, 8]
    assert gemm_rows.bulk_partial_size(4096, 8192, 64) == 8 * 64 * 4096
    # No more ring slots than the chunks a block walks: the gate up-projections (k = 128, one chunk
    # a task, one task a block at 64 rows) ask for one slot, 32 KB, which fits beside a ring of
    # 192 KB; Kimi's split o_proj walks 4 chunks a block (3 slots fit), its q|k|v 8 ranges of 3 (4 fit).
    chunks = gemm_rows._bulk_block_chunks
    assert chunks(128, 64, 64, False) == 1 and chunks(4096, 96, 96, True) == 4
    assert chunks(2304, 96, 96, False) == 8 * 3 and chunks(1056, 3, 2, False) == 2 * (6 * 2 + 1)
    assert bulk_plan(4096, 128, 64, 132).stages == 1 and bulk_plan(4096, 128, 64, 132).shared_mem == 32 * 1024 + 16
    assert 228 * 1024 - (bulk_plan(12288, 2304, 64, 132).shared_mem + 1024) >= bulk_plan(4096, 128, 64, 132).shared_mem + 1024
    assert bulk_plan(2304, 4096, 64, 132, split=None).stages == 3 and bulk_plan(12288, 2304, 64, 132).stages == 4
    assert bulk_plan(4096, 128, 64, 132, stages=2).stages == 2
    with pytest.raises(ValueError, match="warpgroups must be 1, 2 or 3"):
        bulk_plan(64, 64, 64, 132, 4)
    with pytest.raises(ValueError, match="stages must be"):
        bulk_plan(64, 64, 64, 132, 3, stages=9)
    source = kernel_source("projection/gemm_rows_bulk")
    assert f"#define GEMM_BULK_CHUNK {gemm_rows._BULK_CHUNK}" in source
    assert "#define GEMM_BULK_TILE_ELEMENTS (GEMM_BULK_COLUMNS * GEMM_ROWS_K_BLOCK)" in source
    assert gemm_rows._BULK_TILE_BYTES == 64 * 32 * 2


@pytest.mark.parametrize("k", [520, 2056], ids=lambda k: f"K{k}")
def test_split_k_order_is_kept_on_host(gemm_host, k):
    """k ranges whose partial sums make the fp32 total depend on the order it is taken in
    (host_cuda.order_sensitive_inputs): a launch of 17..64 rows equals the one-row launches."""
    from glm_kda.gpu.projection import _k_split

    n, rows = 48, 40
    x, w = (bf16_bits(v) for v in order_sensitive_inputs(np.random.default_rng(k), rows, n, k, _k_split(k)))
    one_row = run_host(gemm_host, x, w, rows, np.full((rows, n), POISON, np.uint16), one_row_launches=True)
    out = run_host(gemm_host, x, w, rows, np.full((rows, n), POISON, np.uint16))
    _assert_bits_equal(out, one_row, f"K{k} R{rows} vs one-row launches")


@pytest.mark.parametrize("shape,max_bytes", [((40, 128), None), ((100, 136), 24576), ((72, 2056), None)],
                         ids=lambda v: f"N{v[0]}-K{v[1]}" if isinstance(v, tuple) else f"stage{v}")
def test_staged_awaiting_launch_gives_the_packed_bits_on_host(gemm_host, shape, max_bytes, monkeypatch):
    """The staged entry's awaiting form (its words already at their target; x's rows copied into shared
    memory past the wait, the partial sums written over them): the packed launch's bits for 1 .. 16
    rows and both tile widths (where x's rows fit beside the stage: K2056 to 5 rows), nothing written
    outside the outputs, the words back at zero."""
    from glm_kda.gpu import projection as gemm_rows

    n, k = shape
    if max_bytes is not None:
        monkeypatch.setattr(gemm_rows, "_STAGED_MAX_BYTES", max_bytes)
    x, w = _inputs(n, k, 16, seed=5 * n + k)
    for rows in (1, 5, 16):
        plan = _staged_plan(n, k, rows)
        if plan is None:
            assert rows * k * 2 > 48 << 10, f"N{n}-K{k} R{rows}: no awaiting staged plan"
            continue
        tag = f"N{n}-K{k} R{rows} {plan.kernel} grid {plan.grid}"
        packed = run_host(gemm_host, x[:rows], w, rows, np.full((rows, n), POISON, np.uint16), packed=True)
        staged, words = run_host(gemm_host, x, w, rows, np.full((rows + 2, n + 8), POISON, np.uint16), form=3,
                                 form_arg=plan.grid[0])
        _assert_bits_equal(staged[:rows, :n], packed, f"{tag} staged awaiting")
        untouched = np.ones(staged.shape, dtype=bool)
        untouched[:rows, :n] = False
        assert (staged[untouched] == POISON).all(), f"{tag}: the launch wrote outside its outputs"
        assert words.tolist() == [0, 0], f"{tag}: words after {words.tolist()}"


@pytest.mark.parametrize("shape", [(100, 136), (40, 1056), (72, 2056), (136, 4104)], ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_tail_staged_launch_gives_the_packed_bits_on_host(gemm_host, shape):
    """The tail-staged awaiting entry (its words already at their target): each warp's last k blocks
    from its copies in the block's stage, the rest of its range from memory, x's rows from shared
    memory. The packed launch's bits for 1 .. 16 rows, 1 .. 4 tiles a warp and tails of one k block, a
    few, and the whole range (warps side by side at K136, a last warp with no k blocks at K1056 (33
    blocks in ranges of 5), a short last range at K2056 and K4104, whose 8-column tile is too wide for
    the staged entry); nothing written outside the outputs; the words back at zero. The emulated shared
    memory starts as NaNs, so a k block read from the stage that was not copied there changes bits."""
    n, k = shape
    x, w = _inputs(n, k, 16, seed=11 * n + k)
    for rows in (1, 5, 16):
        packed = run_host(gemm_host, x[:rows], w, rows, np.full((rows, n), POISON, np.uint16), packed=True)
        for tail, tiles in ((1, None), (4, 2), (None, None), (None, 4)):
            plan = _tail_staged_plan(n, k, rows, tail_blocks=tail, tiles_per_warp=tiles)
            if plan is None:
                assert rows * k * 2 > 96 << 10, f"N{n}-K{k} R{rows}: no tail-staged plan"
                continue
            tag = f"N{n}-K{k} R{rows} {plan.kernel} grid {plan.grid} tail {plan.tail_blocks}"
            staged, words = run_host(gemm_host, x, w, rows, np.full((rows + 2, n + 8), POISON, np.uint16), form=5,
                                     form_arg=plan.grid[0], tail_blocks=tail, tiles_per_warp=tiles)
            _assert_bits_equal(staged[:rows, :n], packed, f"{tag}: tail-staged awaiting")
            untouched = np.ones(staged.shape, dtype=bool)
            untouched[:rows, :n] = False
            assert (staged[untouched] == POISON).all(), f"{tag}: the launch wrote outside its outputs"
            assert words.tolist() == [0, 0], f"{tag}: words after {words.tolist()}"


def test_tail_staged_plan_fills_two_blocks_an_sm():
    """_tail_staged_plan: the one-row sweep's tiles and groups, one group a block, the longest tail
    that leaves _TAIL_BLOCKS_PER_SM blocks (tail, x's rows or the partial sums, the driver's KB) in an
    SM's shared memory, never past a warp's k range. GLM-5.3-Flash's o_proj [4096, 8192]: 2 tiles a
    warp, 256 blocks, 12 of each warp's 32 k blocks (96 KB) beside x's row (16 KB)."""
    from glm_kda.gpu import projection as gemm_rows

    plan = _tail_staged_plan(4096, 8192, 1)
    assert (plan.kernel, plan.grid, plan.tail_blocks) == ("kda_gemm_rows_tail_staged_awaiting_bf16_m1_n2", (256, 1),
                                                          12), plan
    assert plan.shared_mem == 8 * 2 * 12 * 512 + 16 + 8192 * 2, plan
    for rows in (1, 4, 16):
        plan = _tail_staged_plan(4096, 8192, rows)
        if plan is not None:
            assert gemm_rows._TAIL_BLOCKS_PER_SM * (plan.shared_mem + 1024) <= gemm_rows._SHARED_PER_SM, plan
    assert _tail_staged_plan(4096, 8192, 16) is None  # 16 rows of x (256 KB) leave no room for a tail
    assert _tail_staged_plan(4096, 8192, 1, tail_blocks=3).tail_blocks == 3
    assert _tail_staged_plan(40, 128, 1).tail_blocks == 4  # k_split 1: the whole 4-block range
    assert _tail_staged_plan(4096, 8192, 17) is None
    # A part with about 100 KB of shared memory an SM (sm_120): a third of the tail.
    small = _tail_staged_plan(4096, 8192, 1, shared_per_sm=100 << 10, shared_per_block=99 << 10)
    assert small.tail_blocks == 4 and 2 * (small.shared_mem + 1024) <= 100 << 10, small
    with pytest.raises(ValueError, match="tail_blocks must be >= 1"):
        _tail_staged_plan(4096, 8192, 1, tail_blocks=0)


def test_staged_plan_fits_its_stage():
    """_staged_plan: the widest tiles whose group fits _STAGED_MAX_BYTES, one group a block, none
    above 16 rows, a zero chunk and x's rows padded to whole k blocks (or the partial sums, if more)
    beside the stage, 3 blocks an SM. A [2304, 4096] weight (the Kimi-Linear output projection)
    takes one tile a warp."""
    from glm_kda.gpu import projection as gemm_rows

    plan = _staged_plan(2304, 4096, 1)
    assert (plan.kernel, plan.grid, plan.shared_mem) == ("kda_gemm_rows_staged_awaiting_bf16_m1_n1", (288, 1),
                                                         65536 + 16 + 8192), plan
    plan = _staged_plan(2304, 2048, 2)
    assert (plan.kernel, plan.grid) == ("kda_gemm_rows_staged_awaiting_bf16_m1_n2", (144, 1)), plan
    assert plan.shared_mem - 16 - 2 * 2048 * 2 <= gemm_rows._STAGED_MAX_BYTES
    assert _staged_plan(2304, 4096, 17) is None
    assert _staged_plan(4096, 8192, 1) is None  # a 128 KB tile
    assert _staged_plan(2304, 4096, 2) is None  # 3 x (64 + 16 + 1) KB > 228 KB
    small = _staged_plan(13, 40, 3)  # k_split 1: 8 warps side by side, one partial tile
    assert small.grid == (1, 1) and small.shared_mem == 2 * 2 * 32 * 8 * 2 + 8 * 2 * 4 * 32 * 4, small
    wide = _staged_plan(40, 2056, 5)  # k 2056: rows padded to 2080
    assert wide.shared_mem == 65 * 32 * 8 * 2 + 16 + 5 * 2080 * 2, wide  # one tile of 65 k blocks a block
