"""The tensor-core chunked prefill (glm_kda.gpu.ops.chunk_tc, kernels_src/chunk/chunk_tc.cu) against its contract.

Promises, one test each:
  * the float64 model of the blocked algorithm is the chunked delta rule: with its rounding
    emulation off it equals reference.chunk_scan (float64) to 1e-12;
  * with the kernels' TF32 operand rounding emulated it stays within TC_BOUND of the float64
    oracle, for T = 1 .. 300 from zero and random carried states, the bounded law at -5, a
    strongly-decaying law (g near -5 on every token) and g = -5 exactly;
  * a poisoned pad (NaN, 1e30, inf) changes no bit of outputs, scratch or state;
  * lower_bound None (the unbounded prepare, for gates without a bound such as the softplus
    law): the model is the chunked delta rule without rounding and within TC_BOUND with it, for
    gates far below -5; the bounded prepare (gates clamped to -5) is not;
  * round_tf32 rounds like cvt.rna.tf32.f32 and passes inf / NaN;
  * support and refusals: bounded law with -5 <= lower_bound <= 0 and chunk 64 only; the
    wrappers refuse any other bound before a launch; launch geometry and shared memory;
  * the kernel SOURCE, compiled for the host with one thread per CUDA thread (barriers as
    std::barrier, mma.sync from the PTX fragment layout, cp.async as a copy), equals the
    model stage by stage and keeps the pad out: index arithmetic, fragment layouts, shared
    memory reuse and padding checked without a GPU (skipped without a C++20 compiler),
    and the fused-gate prepare's gate, beta and results against the plain prepare's, and the
    unbounded prepare against its model on softplus-law gates;
  * on a GPU: the kernels against the FP32 kernel path and the float64 oracle at GLM (64
    heads) and Kimi (32 heads) geometry for T in {1, 17, 64, 65, 1000, 4096}, each kernel
    against the model fed its own inputs, poisoned pad bits, carried state, determinism,
    and the prepare's fused gate and beta bit-equal to the gate kernel's.

Tolerance, why TC_BOUND = 1.5e-3: TF32 keeps 10 mantissa bits, so a rounded operand carries
a relative error of at most u = 2^-11 = 4.9e-4 (rms about u / sqrt(3)); each output is a
short chain of such products (W = T K, U = Uc - W S, o = Q S + B U), measured at 3e-4 ..
7e-4 on random, correlated-key, strong- and weak-decay inputs up to T = 16384, flat in T.
1.5e-3 (about 3 u) leaves twice the worst measured case; the emulation-off bound of 1e-12
shows the rounding points are the only departure from the exact algorithm.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import chunk_tc_model
import kernel_report
from glm_kda.gpu.ops import chunk_tc
from glm_kda.gpu import build as kernels
from glm_kda.gpu import ops
from glm_kda import chunk_model
from glm_kda.chunk_model import (
    PREPARE_SMEM_BYTES,
    SCAN_SMEM_BYTES,
    chunk_count,
    chunk_tc_supported,
    prepare_lower_bound,
    SCRATCH_KINDS,
    new_scratch,
    scratch_shapes,
)
from chunk_tc_model import model_chunk_tc, model_chunk_tc_prepare, model_chunk_tc_scan, round_tf32
from glm_kda.device import gpu_status
from glm_kda.reference import chunk_scan, rms_ratio
from glm_kda.synthetic import synthetic_config
from host_cuda import (HOST_CUDA_HEADER, HOST_CUDA_RUNTIME, bf16_bits, build_host_binary,
                       host_kernel_source)
from standins import HostStandIn, aligned, use_stand_ins

GPU_OK, GPU_WHY = gpu_status()
needs_gpu = pytest.mark.skipif(not GPU_OK, reason=f"no CUDA GPU: {GPU_WHY}")

SEED = 4321
LOWER_BOUND = -5.0
TC_BOUND = 1.5e-3
EXACT_BOUND = 1e-12
# A kernel against the model fed its own inputs: FP32 arithmetic and the rare TF32 rounding
# flips it causes (1e-6 .. 2e-5 measured on the host emulation).
FED_BOUND = 1e-4
MODEL_TOKENS = [1, 15, 16, 17, 63, 64, 65, 300]
MODEL_HEADS = 4
GPU_TOKENS = [1, 17, 64, 65, 1000, 4096]
GEOMETRY_HEADS = {"glm": 64, "kimi": 32}
POISONS = {"nan": float("nan"), "1e30": 1e30, "inf": float("inf")}
SCRATCH = ("q_decay", "k_tail", "w", "u", "attn", "chunk_decay")


def assert_close(actual, expected, bound, what):
    ratio = rms_ratio(actual, expected)
    print(f"{what}: rms-ratio {ratio:.3e}")
    assert ratio <= bound, f"{what}: rms-ratio {ratio:.3e} > bound {bound:.1e}"


def bits(x):
    x = x.get() if hasattr(x, "get") else np.asarray(x)
    x = np.ascontiguousarray(x)
    return x.view({8: np.uint64, 4: np.uint32, 2: np.uint16}[x.dtype.itemsize])


def assert_bits_equal(a, b, what):
    differ = int(np.count_nonzero(bits(a) != bits(b)))
    assert differ == 0, f"{what}: {differ} elements differ in their bits"


def make_inputs(tokens, heads, law="bounded", state="random", seed=SEED, xp=np, dtype=np.float64):
    """query, key (unit rows), value, gate, beta, recurrent state. Laws: "bounded" (the GLM
    law with lower bound -5 on random pre-activations), "strong" (g in [-5, -4.85] on every
    token: the strongest decay the bound allows), "at_bound" (g = -5 exactly), "softplus" (the
    Kimi law -exp(A_log) softplus(u), no lower bound: A_log per head in [-0.5, 2], so gates
    reach -40 and below)."""
    rng = np.random.default_rng(seed) if xp is np else xp.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32 if xp is not np else np.float64)

    def unit(x):
        return x / xp.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    query = unit(normal(tokens, heads, 128))
    key = unit(normal(tokens, heads, 128))
    value = normal(tokens, heads, 128)
    if law == "bounded":
        gate = LOWER_BOUND / (1.0 + xp.exp(-(2.0 * normal(tokens, heads, 128) - 3.0)))
    elif law == "strong":
        gate = LOWER_BOUND * (0.97 + 0.03 * rng.random((tokens, heads, 128)))
    elif law == "at_bound":
        gate = xp.full((tokens, heads, 128), LOWER_BOUND)
    elif law == "softplus":
        a = xp.exp(-0.5 + 2.5 * rng.random((1, heads, 1)))
        u = 2.0 * normal(tokens, heads, 128)
        gate = -a * xp.where(u > 20.0, u, xp.log1p(xp.exp(xp.minimum(u, 20.0))))
    else:
        raise ValueError(law)
    beta = 1.0 / (1.0 + xp.exp(-normal(tokens, heads)))
    recurrent = 0.1 * normal(heads, 128, 128) if state == "random" else xp.zeros((heads, 128, 128))
    # The values the kernels see are FP32; the models and the oracle get the same values.
    return tuple(xp.asarray(x, dtype=np.float32).astype(dtype) for x in (query, key, value, gate, beta, recurrent))


# --------------------------------------------------------------------------------------
# The float64 model (no GPU)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["zero", "random"])
@pytest.mark.parametrize("law", ["bounded", "strong"])
@pytest.mark.parametrize("tokens", MODEL_TOKENS, ids=lambda t: f"T{t}")
def test_model_without_rounding_is_the_chunked_delta_rule(tokens, law, state):
    q, k, v, g, b, s0 = make_inputs(tokens, MODEL_HEADS, law, state)
    core, final = model_chunk_tc(q, k, v, g, b, s0, LOWER_BOUND, emulate_rounding=False)
    ref_core, ref_state = chunk_scan(q, k, v, g, b, s0, chunk=64)
    assert_close(core, ref_core, EXACT_BOUND, f"T{tokens}-{law}-{state} core")
    assert_close(final, ref_state, EXACT_BOUND, f"T{tokens}-{law}-{state} state")


@pytest.mark.parametrize("state", ["zero", "random"])
@pytest.mark.parametrize("law", ["bounded", "strong"])
@pytest.mark.parametrize("tokens", MODEL_TOKENS, ids=lambda t: f"T{t}")
def test_model_with_tf32_rounding_within_bound(tokens, law, state):
    q, k, v, g, b, s0 = make_inputs(tokens, MODEL_HEADS, law, state)
    core, final = model_chunk_tc(q, k, v, g, b, s0, LOWER_BOUND)
    ref_core, ref_state = chunk_scan(q, k, v, g, b, s0, chunk=64)
    assert_close(core, ref_core, TC_BOUND, f"T{tokens}-{law}-{state} core")
    assert_close(final, ref_state, TC_BOUND, f"T{tokens}-{law}-{state} state")


@pytest.mark.parametrize("law", ["softplus", "strong"])
@pytest.mark.parametrize("tokens", MODEL_TOKENS, ids=lambda t: f"T{t}")
def test_unbounded_model_is_the_chunked_delta_rule_and_within_bound(tokens, law):
    # lower_bound None (the unbounded prepare: diagonal blocks as exact sums): without rounding
    # the chunked delta rule, with the kernels' rounding within TC_BOUND, every scratch value
    # finite, for gates far below -5.
    q, k, v, g, b, s0 = make_inputs(tokens, MODEL_HEADS, law, "random")
    if law == "softplus":
        assert float(g.min()) < 2 * LOWER_BOUND, "the softplus inputs must leave the bounded law's range"
    ref_core, ref_state = chunk_scan(q, k, v, g, b, s0, chunk=64)
    core, final = model_chunk_tc(q, k, v, g, b, s0, None, emulate_rounding=False)
    assert_close(core, ref_core, EXACT_BOUND, f"T{tokens}-{law} unbounded core, no rounding")
    assert_close(final, ref_state, EXACT_BOUND, f"T{tokens}-{law} unbounded state, no rounding")
    scratch = model_chunk_tc_prepare(q, k, v, g, b, None)
    for name, value in scratch.items():
        assert np.isfinite(value.astype(np.float32)).all(), f"{name} leaves the FP32 range"
    core, final = model_chunk_tc_scan(scratch, s0, tokens)
    assert_close(core, ref_core, TC_BOUND, f"T{tokens}-{law} unbounded core")
    assert_close(final, ref_state, TC_BOUND, f"T{tokens}-{law} unbounded state")


def test_the_bounded_prepare_cannot_serve_the_softplus_law():
    # Why the unbounded prepare exists: the bounded one clamps the softplus law's gates to -5
    # (its reference-row products would overflow otherwise), which changes the result beyond
    # the contract; the unbounded one keeps it.
    q, k, v, g, b, s0 = make_inputs(65, 2, "softplus", "random")
    ref_core, _ = chunk_scan(q, k, v, g, b, s0, chunk=64)
    with np.errstate(over="ignore", invalid="ignore"):
        clamped = rms_ratio(model_chunk_tc(q, k, v, g, b, s0, LOWER_BOUND)[0], ref_core)
    unbounded = rms_ratio(model_chunk_tc(q, k, v, g, b, s0, None)[0], ref_core)
    assert clamped > TC_BOUND >= unbounded, f"core rms-ratio: clamped to -5 {clamped:.2e}, unbounded {unbounded:.2e}"


@pytest.mark.parametrize("tokens", [16, 65, 300], ids=lambda t: f"T{t}")
def test_model_at_the_bound_stays_finite(tokens):
    # g = -5 on every token: the widest exponent range the argument allows (exp(75) on the
    # diagonal blocks, exp(-320) at the chunk end); every scratch value must stay finite.
    q, k, v, g, b, s0 = make_inputs(tokens, MODEL_HEADS, "at_bound")
    scratch = model_chunk_tc_prepare(q, k, v, g, b, LOWER_BOUND)
    for name, value in scratch.items():
        assert np.isfinite(value.astype(np.float32)).all(), f"{name} leaves the FP32 range"
    core, final = model_chunk_tc_scan(scratch, s0, tokens)
    ref_core, ref_state = chunk_scan(q, k, v, g, b, s0, chunk=64)
    assert_close(core, ref_core, TC_BOUND, f"T{tokens}-at_bound core")
    assert_close(final, ref_state, TC_BOUND, f"T{tokens}-at_bound state")


@pytest.mark.parametrize("poison", list(POISONS), ids=list(POISONS))
@pytest.mark.parametrize("tokens", [1, 17, 63, 65, 300], ids=lambda t: f"T{t}")
def test_model_poisoned_pad_changes_no_bit(tokens, poison):
    q, k, v, g, b, s0 = make_inputs(tokens, 2)
    clean_scratch = model_chunk_tc_prepare(q, k, v, g, b, LOWER_BOUND)
    dirty_scratch = model_chunk_tc_prepare(q, k, v, g, b, LOWER_BOUND, pad_value=POISONS[poison])
    for name in SCRATCH:
        assert_bits_equal(dirty_scratch[name], clean_scratch[name], f"{name} with pad {poison}")
    clean = model_chunk_tc(q, k, v, g, b, s0, LOWER_BOUND)
    dirty = model_chunk_tc(q, k, v, g, b, s0, LOWER_BOUND, pad_value=POISONS[poison])
    assert_bits_equal(dirty[0], clean[0], f"core with pad {poison}")
    assert_bits_equal(dirty[1], clean[1], f"state with pad {poison}")


def test_round_tf32_is_nearest_ties_away():
    one = 1.0
    cases = {
        one + 2.0**-11: one + 2.0**-10,  # a tie rounds away from zero
        -(one + 2.0**-11): -(one + 2.0**-10),
        one + 2.0**-12: one,
        one + 3 * 2.0**-12: one + 2.0**-10,
        0.0: 0.0,
        float("inf"): float("inf"),
        -float("inf"): -float("inf"),
    }
    for value, expected in cases.items():
        assert round_tf32(np.array([value]))[0] == expected, value
    x = np.random.default_rng(SEED).standard_normal(10000) * 1e3
    rounded = round_tf32(x)
    assert not np.any(rounded.astype(np.float32).view(np.uint32) & 0x1FFF), "low 13 bits must be zero"
    assert np.max(np.abs(rounded - x.astype(np.float32)) / np.abs(x)) <= 2.0**-11 * (1 + 1e-6)
    with np.errstate(invalid="ignore"):
        nan = np.array([0x7FFFFFFF, 0x7F800001, 0xFFC00000], np.uint32).view(np.float32).astype(np.float64)
        assert np.isnan(round_tf32(nan)).all(), "a NaN must stay a NaN"


# --------------------------------------------------------------------------------------
# Support, refusals and launch geometry (no GPU: stand-ins for the device arrays)
# --------------------------------------------------------------------------------------


def test_support_is_chunk_64_and_the_prepare_follows_the_gate_law():
    import dataclasses

    glm, kimi = synthetic_config("glm"), synthetic_config("kimi")
    ok, reason = chunk_tc_supported(glm)
    assert ok and "bounded law" in reason, reason
    assert prepare_lower_bound(glm) == glm.gate_lower_bound == -5.0
    ok, reason = chunk_tc_supported(kimi)
    assert ok and "softplus" in reason and "unbounded" in reason, reason
    assert prepare_lower_bound(kimi) is None
    below = dataclasses.replace(glm, gate_lower_bound=-6.0)
    ok, reason = chunk_tc_supported(below)
    assert ok and "gate_lower_bound=-6.0" in reason and "unbounded" in reason, reason
    assert prepare_lower_bound(below) is None, "a bound below -5 is outside the bounded prepare's range"
    assert prepare_lower_bound(dataclasses.replace(glm, gate_lower_bound=-2.5)) == -2.5
    ok, reason = chunk_tc_supported(glm.with_chunk(32))
    assert not ok and "chunk=32" in reason
    ok, reason = chunk_tc_supported(kimi.with_chunk(16))
    assert not ok and "chunk=16" in reason


def _aligned_f32(shape):
    return HostStandIn(aligned(shape, np.float32))


@pytest.fixture
def launches(monkeypatch):
    """Stand-ins instead of cupy arrays, and the launches recorded instead of run."""
    use_stand_ins(monkeypatch)
    recorded = []
    monkeypatch.setattr(chunk_tc, "_launch", lambda name, grid, block, args, shared_mem: recorded.append(
        (name, grid, block, shared_mem)))
    return recorded


def _call_arguments(tokens, heads):
    inputs = [_aligned_f32((tokens, heads, 128)) for _ in range(4)]
    beta = _aligned_f32((tokens, heads))
    state = _aligned_f32((heads, 128, 128))
    core = _aligned_f32((tokens, heads, 128))
    dtypes = {"f16": np.float16, "f32": np.float32}
    scratch = [HostStandIn(aligned(shape, dtypes[SCRATCH_KINDS[name]]))
               for name, shape in scratch_shapes(tokens, heads).items()]
    return inputs, beta, state, core, scratch


@pytest.mark.parametrize("bound", [-6.0, -5.0001, 0.5, float("nan"), float("-inf"), "x"], ids=str)
def test_wrapper_refuses_other_bounds_before_any_launch(launches, bound):
    inputs, beta, state, core, scratch = _call_arguments(65, 2)
    with pytest.raises(ValueError, match="lower_bound"):
        chunk_tc.chunk_prefill_tc(*inputs, beta, state, core, 65, bound, *scratch)
    assert launches == []


@pytest.mark.parametrize("tokens,heads", [(1, 64), (65, 32), (4096, 1)], ids=lambda v: str(v))
def test_launch_geometry_and_shared_memory(launches, tokens, heads):
    inputs, beta, state, core, scratch = _call_arguments(tokens, heads)
    chunk_tc.chunk_prefill_tc(*inputs, beta, state, core, tokens, LOWER_BOUND, *scratch)
    nchunks = chunk_count(tokens)
    assert launches == [
        ("kda_chunk_tc_prepare_f32", (nchunks, heads), (256,), PREPARE_SMEM_BYTES),
        ("kda_chunk_tc_scan_f32", (heads, 4), (128,), SCAN_SMEM_BYTES),
    ]
    # sm_90 / sm_100: 227 KB per block, 228 KB per SM with 1 KB reserved per block. Both
    # kernels must fit twice (the scan: GLM's 256 blocks in one wave on 132 SMs; the prepare:
    # one block's loads overlap the other's products).
    assert PREPARE_SMEM_BYTES == 104704 and 2 * (PREPARE_SMEM_BYTES + 1024) <= 228 * 1024
    assert SCAN_SMEM_BYTES == 66560 and 2 * (SCAN_SMEM_BYTES + 1024) <= 228 * 1024
    source = (kernels.kernels_dir() / "chunk/chunk_tc.cuh").read_text()
    assert "104,704 B" in source and "66,560 B" in source, "chunk_tc.cuh states the shared memory"


def test_unbounded_launches_its_prepare_and_its_fused_gate_form(launches):
    inputs, beta, state, core, scratch = _call_arguments(65, 2)
    chunk_tc.chunk_prefill_tc(*inputs, beta, state, core, 65, None, *scratch)
    assert launches == [
        ("kda_chunk_tc_prepare_unbounded_f32", (2, 2), (256,), PREPARE_SMEM_BYTES),
        ("kda_chunk_tc_scan_f32", (2, 4), (128,), SCAN_SMEM_BYTES),
    ]
    launches.clear()
    source = chunk_tc.GateSource(HostStandIn(aligned((65, 256), np.uint16)), _aligned_f32((256,)), _aligned_f32((2,)),
                                 HostStandIn(aligned((65, 2), np.uint16)))
    chunk_tc.chunk_prefill_tc(*inputs, beta, state, core, 65, None, *scratch, gate_source=source)
    assert [launch[0] for launch in launches] == ["kda_chunk_tc_prepare_unbounded_gate_f32", "kda_chunk_tc_scan_f32"]


def test_wrapper_names_a_bad_scratch_buffer(launches):
    inputs, beta, state, core, scratch = _call_arguments(65, 2)
    scratch[4] = HostStandIn(aligned((1, 2, 64, 64), np.float16))  # attn for one chunk, two are needed
    with pytest.raises(ValueError, match="attn"):
        chunk_tc.chunk_prefill_tc(*inputs, beta, state, core, 65, LOWER_BOUND, *scratch)
    scratch[4] = _aligned_f32((2, 2, 64, 64))  # the FP32 path's attn: the tensor-core path stores FP16
    with pytest.raises(TypeError, match="attn: expected float16"):
        chunk_tc.chunk_prefill_tc(*inputs, beta, state, core, 65, LOWER_BOUND, *scratch)
    assert launches == []


def test_wrapper_names_a_bad_gate_source(launches):
    inputs, beta, state, core, scratch = _call_arguments(65, 2)
    good = dict(forget_proj=HostStandIn(aligned((65, 256), np.uint16)), dt_bias=_aligned_f32((256,)),
                a_log=_aligned_f32((2,)), beta_logits=HostStandIn(aligned((65, 2), np.uint16)))
    for name, bad in (("forget_proj", _aligned_f32((65, 256))), ("dt_bias", _aligned_f32((2,))),
                      ("a_log", _aligned_f32((256,))), ("beta_logits", HostStandIn(aligned((64, 2), np.uint16)))):
        source = chunk_tc.GateSource(**{**good, name: bad})
        with pytest.raises((TypeError, ValueError), match=name):
            chunk_tc.chunk_prefill_tc(*inputs, beta, state, core, 65, LOWER_BOUND, *scratch, gate_source=source)
    assert launches == []
    chunk_tc.chunk_prefill_tc(*inputs, beta, state, core, 65, LOWER_BOUND, *scratch,
                              gate_source=chunk_tc.GateSource(**good))
    assert [launch[0] for launch in launches] == ["kda_chunk_tc_prepare_gate_f32", "kda_chunk_tc_scan_f32"]


def test_no_spills_on_sm_90():
    os.environ.setdefault("CUDA_CACHE_DISABLE", "1")
    resources = {}
    stems = [stem for stem in kernels.ENTRY_POINTS if stem.startswith("chunk/chunk_tc")]
    assert stems, "no tensor-core chunk file among the entry points"
    for stem in stems:
        resources.update(kernel_report.parse_ptxas_log(kernel_report.compile_file(stem, "sm_90").log))
    for name in (name for stem in stems for name in kernels.ENTRY_POINTS[stem]):
        r = resources[name]
        print(f"{name}: {r}")
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack_frame"] == 0, f"{name} spills: {r}"
        # Two 128-thread scan blocks per SM need <= 255 registers (65536 / 256).
        assert 0 < r["registers"] <= 255


# --------------------------------------------------------------------------------------
# The kernel source on the host
# --------------------------------------------------------------------------------------

# chunk_tc.cu's own device helpers on the host, after the common CUDA subset (host_cuda.py):
# mma.m16n8k8 TF32 as a warp collective built from the PTX fragment layout (A (g + 8 (r % 2),
# t + 4 (r / 2)), B (k t + 4 r, n g), C (g + 8 (r / 2), 2 t + r % 2), lane = 4 g + t), cp.async
# as a plain copy, the FP16 conversions through _Float16. Counts mma operands that are not TF32
# values (and, through checked_cast, vector accesses that are not aligned).
EMULATION_HEADER = HOST_CUDA_HEADER + r"""
extern std::atomic<long> not_tf32, mma_count;
struct WarpSlot { float a[4], b[2]; };
extern WarpSlot warp_slots[32][32];
inline void mma_tf32_m16n8k8(float acc[4], float a0, float a1, float a2, float a3, float b0, float b1)
{
    for (float x : {a0, a1, a2, a3, b0, b1}) if (__float_as_uint(x) & 0x1fffu) not_tf32++;
    warp_mma<8>(acc, WarpSlot{{a0, a1, a2, a3}, {b0, b1}}, warp_slots, [](const WarpSlot* slot, int row, int col, int k) {
        return double(slot[4 * (row % 8) + k % 4].a[row / 8 + 2 * (k / 4)]) * double(slot[4 * col + k % 4].b[k / 4]);
    });
    if ((threadIdx.x & 31) == 0) mma_count++;
}
inline void copy_async_16B(void* destination, const void* source) { std::memcpy(destination, source, 16); }
// cvt.rn.f16.f32 / cvt.f32.f16 through the compiler's IEEE half type (nearest even).
inline unsigned short f32_to_f16(float x)
{
    const _Float16 h = static_cast<_Float16>(x);
    unsigned short bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}
inline float f16_to_f32(unsigned short bits)
{
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return static_cast<float>(h);
}
inline void copy_async_commit() {}
inline void copy_async_wait_all() {}
"""

EMULATION_MAIN = r"""
#include "emulation.h"
""" + HOST_CUDA_RUNTIME + r"""
std::atomic<long> not_tf32{0}, mma_count{0};
WarpSlot warp_slots[32][32];
using f16_t = unsigned short;
extern "C" void kda_chunk_tc_prepare_f32(const float*, const float*, const float*, const float*, const float*,
    f16_t*, f16_t*, f16_t*, float*, f16_t*, float*, int, int, float, float);
using bf16_t = unsigned short;
extern "C" void kda_chunk_tc_prepare_gate_f32(const float*, const float*, const float*, float*, float*,
    f16_t*, f16_t*, f16_t*, float*, f16_t*, float*, int, int, float, float, const bf16_t*, const float*,
    const float*, const bf16_t*, int);
extern "C" void kda_chunk_tc_prepare_unbounded_gate_f32(const float*, const float*, const float*, float*, float*,
    f16_t*, f16_t*, f16_t*, float*, f16_t*, float*, int, int, float, float, const bf16_t*, const float*,
    const float*, const bf16_t*, int);
extern "C" void kda_chunk_tc_prepare_unbounded_f32(const float*, const float*, const float*, const float*,
    const float*, f16_t*, f16_t*, f16_t*, float*, f16_t*, float*, int, int, float, float);
extern "C" void kda_chunk_tc_scan_f32(const f16_t*, const f16_t*, const f16_t*, const float*, const f16_t*,
    const float*, float*, float*, int, int);

static void save(const std::string& path, const std::vector<f16_t>& v)
{
    std::vector<float> widened(v.size());
    for (size_t i = 0; i < v.size(); ++i) widened[i] = f16_to_f32(v[i]);
    save(path, widened);
}

int main(int argc, char** argv)
{
    const std::string dir = argv[1];
    const int tokens = std::atoi(argv[2]), rows = std::atoi(argv[3]), heads = std::atoi(argv[4]);
    const float lower_bound = std::atof(argv[5]);
    jitter = std::atoi(argv[6]);
    const size_t D = 128, C = 64, nchunks = (tokens + C - 1) / C, padded = nchunks * C;
    auto in = [&](const char* name, size_t per_row) { return load(dir + "/" + name, rows * heads * per_row); };
    auto query = in("query", D), key = in("key", D), value = in("value", D), gate = in("gate", D), beta = in("beta", 1);
    auto state = load(dir + "/state", heads * D * D);
    // Scratch starts as NaN: an element the prepare does not write shows.
    auto poisoned = [](size_t count) { return std::vector<float>(count, std::nanf("")); };
    auto poisoned_f16 = [](size_t count) { return std::vector<f16_t>(count, f16_t(0x7e00)); };
    auto q_decay = poisoned_f16(padded * heads * D), k_tail = poisoned_f16(padded * heads * D);
    auto w = poisoned_f16(padded * heads * D), attn = poisoned_f16(nchunks * heads * C * C);
    auto u = poisoned(padded * heads * D), chunk_decay = poisoned(nchunks * heads * D);
    auto core = std::vector<float>(rows * heads * D, 12345.0f);
    // "fused": the prepare forms gate and beta from forget_proj, dt_bias, a_log and the beta
    // logits (row stride heads + 3) and writes them over buffers of 7.0 ("fused_unbounded": by the
    // softplus law). "unbounded": the prepare for gates without a lower bound.
    const std::string mode = argc > 9 ? argv[9] : "plain";
    const bool fused = mode == "fused" || mode == "fused_unbounded";
    const bool unbounded = mode == "unbounded" || mode == "fused_unbounded";
    const int ld_beta = heads + 3;
    std::vector<unsigned short> forget_proj, beta_logits;
    std::vector<float> dt_bias, a_log;
    if (fused) {
        forget_proj = load_u16(dir + "/forget_proj", rows * heads * D);
        beta_logits = load_u16(dir + "/beta_logits", rows * ld_beta);
        dt_bias = load(dir + "/dt_bias", heads * D);
        a_log = load(dir + "/a_log", heads);
        std::fill(gate.begin(), gate.end(), 7.0f);
        std::fill(beta.begin(), beta.end(), 7.0f);
    }
    run_grid(dim3{unsigned(nchunks), unsigned(heads), 1}, 256, std::atoi(argv[7]), [&] {
        if (fused) {
            (unbounded ? kda_chunk_tc_prepare_unbounded_gate_f32 : kda_chunk_tc_prepare_gate_f32)(
                query.data(), key.data(), value.data(), gate.data(), beta.data(), q_decay.data(), k_tail.data(),
                w.data(), u.data(), attn.data(), chunk_decay.data(), tokens, heads, 1.0f / std::sqrt(128.0f),
                lower_bound, forget_proj.data(), dt_bias.data(), a_log.data(), beta_logits.data(), ld_beta);
        } else {
            (unbounded ? kda_chunk_tc_prepare_unbounded_f32 : kda_chunk_tc_prepare_f32)(
                query.data(), key.data(), value.data(), gate.data(), beta.data(), q_decay.data(), k_tail.data(),
                w.data(), u.data(), attn.data(), chunk_decay.data(), tokens, heads, 1.0f / std::sqrt(128.0f),
                lower_bound);
        }
    });
    run_grid(dim3{unsigned(heads), 4, 1}, 128, std::atoi(argv[8]), [&] {
        kda_chunk_tc_scan_f32(q_decay.data(), k_tail.data(), w.data(), u.data(), attn.data(), chunk_decay.data(),
                              state.data(), core.data(), tokens, heads);
    });
    for (auto [name, data] : {std::pair{"q_decay", &q_decay}, {"k_tail", &k_tail}, {"w", &w}, {"attn", &attn}}) {
        save(dir + "/" + name + ".out", *data);
    }
    for (auto [name, data] : {std::pair{"u", &u}, {"chunk_decay", &chunk_decay}, {"core", &core}, {"state", &state},
                              {"gate", &gate}, {"beta", &beta}}) {
        save(dir + "/" + name + ".out", *data);
    }
    std::printf("not_tf32=%ld misaligned=%ld mma=%ld\n", not_tf32.load(), misaligned.load(), mma_count.load());
    return 0;
}
"""

# The device-only helpers the emulation header replaces (their bodies are inline PTX).
DEVICE_HELPERS = ("mma_tf32_m16n8k8", "copy_async_16B", "copy_async_commit", "copy_async_wait_all", "f32_to_f16",
                  "f16_to_f32")


def host_source() -> str:
    """chunk_tc.cu (header inlined) and the entries of chunk_tc_gate*.cu rewritten for the host: the
    PTX helpers removed, dynamic shared memory from the emulator, every vector cast alignment-checked."""
    source = host_kernel_source("chunk/chunk_tc", DEVICE_HELPERS)
    for stem in ("chunk_tc_gate", "chunk_tc_gate_unbounded"):
        source += (kernels.kernels_dir() / f"chunk/{stem}.cu").read_text().replace('#include "chunk/chunk_tc.cuh"', "")
    declaration = "extern __shared__ __align__(16) float shared[];"
    assert source.count(declaration) == 2, "the host emulation expects one dynamic shared array per kernel"
    source = source.replace(declaration, "float* shared = emulated_shared;")
    return '#include "emulation.h"\n' + source


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_host_binary(tmp_path_factory.mktemp("chunk_tc_host"), "chunk_tc_host",
                             {"emulation.h": EMULATION_HEADER, "main.cpp": EMULATION_MAIN, "kernel.cpp": host_source()})


def host_rows(tokens):
    """Rows of the emulator's input buffers: the padded chunks and 3 more."""
    return chunk_count(tokens) * 64 + 3


def run_on_host(binary, inputs, tokens, pad, jitter=False, gate_source=None, unbounded=False):
    """The two kernels on the host emulator; input rows T.. are filled with `pad`. With
    gate_source (forget_proj [rows, H*D] and beta_logits [rows, H + 3] as BF16 bits, dt_bias,
    a_log), the fused-gate prepare runs and "gate" / "beta" are its outputs; unbounded: the
    prepare for gates without a lower bound (with gate_source: forming the softplus law's)."""
    query, key, value, gate, beta, recurrent = inputs
    heads = query.shape[1]
    nchunks = chunk_count(tokens)
    rows = host_rows(tokens)
    folder = Path(binary).parent / f"T{tokens}-H{heads}-{pad}-{int(jitter)}-{int(gate_source is not None)}-{int(unbounded)}"
    folder.mkdir(exist_ok=True)
    for name, x in (("query", query), ("key", key), ("value", value), ("gate", gate), ("beta", beta)):
        full = np.full((rows,) + x.shape[1:], pad, np.float32)
        full[:tokens] = x
        full.tofile(folder / name)
    recurrent.astype(np.float32).tofile(folder / "state")
    if gate_source is not None:
        forget_proj, beta_logits, dt_bias, a_log = gate_source
        np.ascontiguousarray(forget_proj, np.uint16).tofile(folder / "forget_proj")
        np.ascontiguousarray(beta_logits, np.uint16).tofile(folder / "beta_logits")
        np.asarray(dt_bias, np.float32).tofile(folder / "dt_bias")
        np.asarray(a_log, np.float32).tofile(folder / "a_log")
    mode = "_".join(part for part, on in (("fused", gate_source is not None), ("unbounded", unbounded)) if on)
    result = subprocess.run(
        [str(binary), str(folder), str(tokens), str(rows), str(heads), str(LOWER_BOUND), str(int(jitter)),
         str(PREPARE_SMEM_BYTES), str(SCAN_SMEM_BYTES), mode or "plain"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    counters = dict(item.split("=") for item in result.stdout.split())
    shapes = {**scratch_shapes(tokens, heads), "k_tail": (nchunks, heads, 128, 64),
              "core": (rows, heads, 128), "state": (heads, 128, 128), "gate": (rows, heads, 128), "beta": (rows, heads)}
    out = {name: np.fromfile(folder / f"{name}.out", np.float32).reshape(shape) for name, shape in shapes.items()}
    return out, {name: int(value) for name, value in counters.items()}


@pytest.mark.parametrize("law", ["bounded", "softplus"])
def test_kernel_source_on_host_fused_gate(emulator, law):
    # The fused-gate entry points (the bounded prepare's, the unbounded prepare's by the softplus
    # law): gate and beta from the projections for the real rows only (the pad rows of the sources
    # are NaN and must not leak), and, fed those gate and beta, the same prepare reading them gives
    # the same scratch, core and state bits.
    import ml_dtypes

    tokens, heads = 70, 2
    rows = host_rows(tokens)
    inputs = make_inputs(tokens, heads, seed=SEED + 11)
    rng = np.random.default_rng(SEED + 11)

    forget_proj = np.full((rows, heads * 128), 0x7FC0, np.uint16)  # BF16 NaN in the pad rows
    forget_proj[:tokens] = bf16_bits(2.0 * rng.standard_normal((tokens, heads * 128)))
    beta_logits = np.full((rows, heads + 3), 0x7FC0, np.uint16)
    beta_logits[:tokens] = bf16_bits(rng.standard_normal((tokens, heads + 3)))
    dt_bias = rng.standard_normal(heads * 128).astype(np.float32)
    a_log = (0.5 * rng.standard_normal(heads)).astype(np.float32)
    unbounded = law == "softplus"
    fused, counters = run_on_host(emulator, inputs, tokens, pad=float("nan"),
                                  gate_source=(forget_proj, beta_logits, dt_bias, a_log), unbounded=unbounded)
    assert counters["misaligned"] == 0, f"fused host run: {counters['misaligned']} misaligned vector accesses"
    # The law in float32 (the host's expf may differ from NumPy's by an ulp).
    projected = forget_proj[:tokens].view(ml_dtypes.bfloat16).astype(np.float32).reshape(tokens, heads, 128)
    u = projected + dt_bias.reshape(heads, 128)
    a = np.exp(a_log).astype(np.float32)[None, :, None]
    if unbounded:
        expected_gate = -a * np.where(u > np.float32(20.0), u, np.log1p(np.exp(u)))
    else:
        expected_gate = np.float32(LOWER_BOUND) / (np.float32(1.0) + np.exp(-(a * u)))
    logits = beta_logits[:tokens, :heads].view(ml_dtypes.bfloat16).astype(np.float32)
    expected_beta = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))
    assert_close(fused["gate"][:tokens], expected_gate, 1e-6, "host fused gate vs the law")
    assert_close(fused["beta"][:tokens], expected_beta, 1e-6, "host fused beta vs sigmoid")
    assert (fused["gate"][tokens:] == 7.0).all() and (fused["beta"][tokens:] == 7.0).all(), \
        "the fused prepare wrote gate or beta rows >= T"
    fed = (*inputs[:3], fused["gate"][:tokens], fused["beta"][:tokens], inputs[5])
    plain, _ = run_on_host(emulator, fed, tokens, pad=float("nan"), unbounded=unbounded)
    for name in (*SCRATCH, "state"):
        assert_bits_equal(fused[name], plain[name], f"host {name}, fused vs plain prepare")
    assert_bits_equal(fused["core"][:tokens], plain["core"][:tokens], "host core, fused vs plain prepare")


# (tokens, heads, law, state, unbounded): the last three run the prepare for gates without a
# lower bound (lower_bound None), two of them on the softplus law's gates.
HOST_CASES = [(1, 1, "bounded", "random", False), (17, 2, "strong", "random", False),
              (65, 1, "bounded", "zero", False), (130, 1, "at_bound", "random", False),
              (17, 2, "softplus", "random", True), (65, 1, "softplus", "zero", True),
              (130, 1, "strong", "random", True), (65, 1, "at_bound", "random", True)]


def _diagonal_forms(tokens, heads, law, state, seed):
    """[nchunks][4][H] of diagonal_in_range for make_inputs' gate, cumulated in FP32 per chunk
    with the padding zero, as the unbounded prepare sees it."""
    gate = np.minimum(make_inputs(tokens, heads, law, state, seed=seed)[3], 0.0)
    nchunks = chunk_count(tokens)
    padded = np.zeros((nchunks * 64, heads, 128), np.float32)
    padded[:tokens] = gate
    cumgate = np.cumsum(padded.reshape(nchunks, 64, heads, 128), axis=1, dtype=np.float32).transpose(0, 2, 1, 3)
    return np.stack([chunk_tc_model.diagonal_in_range(cumgate, i) for i in range(4)], axis=1)


def test_unbounded_host_cases_reach_both_diagonal_forms():
    """The unbounded prepare's host cases cover the exact sums and the products for diagonal
    blocks, and both in one chunk: softplus T17 H2 (head 0's first block exact, the rest
    products), softplus T65 (chunk 0 exact throughout), strong (decays of 73 - 75, just
    within the range, products throughout)."""
    forms = {(t, h, law): _diagonal_forms(t, h, law, state, SEED + t + 31)
             for t, h, law, state, unbounded in HOST_CASES if unbounded}
    mixed = forms[17, 2, "softplus"]
    assert not mixed[0, 0, 0] and mixed[0, 0, 1] and mixed[0, 1:].all(), mixed
    assert not forms[65, 1, "softplus"][0].any() and forms[65, 1, "softplus"][1].all()
    assert forms[130, 1, "strong"].all()


@pytest.mark.parametrize("tokens,heads,law,state,unbounded", HOST_CASES, ids=lambda v: str(v))
def test_kernel_source_on_host_matches_model(emulator, tokens, heads, law, state, unbounded):
    # Each kernel against the model fed its own inputs, the whole path against the float64
    # oracle; the unbounded prepare also bit-equal with a NaN and a zero pad (jittered threads).
    bound = None if unbounded else LOWER_BOUND
    inputs = make_inputs(tokens, heads, law, state, seed=SEED + tokens + (31 if unbounded else 0))
    out, counters = run_on_host(emulator, inputs, tokens, pad=float("nan"), unbounded=unbounded)
    tag = f"host T{tokens}-H{heads}-{law}-{state}" + (" unbounded" if unbounded else "")
    assert counters["not_tf32"] == 0, f"{tag}: {counters['not_tf32']} mma operands not rounded to TF32"
    assert counters["misaligned"] == 0, f"{tag}: {counters['misaligned']} misaligned vector accesses"
    scratch = model_chunk_tc_prepare(*inputs[:5], bound)
    for name in SCRATCH:
        assert np.isfinite(out[name]).all(), f"{tag}: {name} is not finite, or has elements never written"
        if name != "chunk_decay":  # exp(-320) underflows in FP32, not in float64
            assert_close(out[name], scratch[name], FED_BOUND, f"{tag} {name} vs model")
    fed_core, fed_state = model_chunk_tc_scan(out, inputs[5], tokens)
    assert_close(out["core"][:tokens], fed_core, FED_BOUND, f"{tag} scan core vs model fed the same scratch")
    assert_close(out["state"], fed_state, FED_BOUND, f"{tag} scan state vs model fed the same scratch")
    assert (out["core"][tokens:] == 12345.0).all(), f"{tag}: core rows >= T were written"
    ref_core, ref_state = chunk_scan(*inputs, chunk=64)
    assert_close(out["core"][:tokens], ref_core, TC_BOUND, f"{tag} core vs float64 oracle")
    assert_close(out["state"], ref_state, TC_BOUND, f"{tag} state vs float64 oracle")
    if unbounded:
        clean, _ = run_on_host(emulator, inputs, tokens, pad=0.0, jitter=True, unbounded=True)
        for name in (*SCRATCH, "state"):
            assert_bits_equal(out[name], clean[name], f"{tag} {name}, NaN pad vs zero pad (jitter)")
        assert_bits_equal(out["core"][:tokens], clean["core"][:tokens], f"{tag} core, NaN pad vs zero pad")


def test_unbounded_host_diagonal_just_past_the_range_takes_the_exact_sums(emulator):
    """Gates of -5.2 (a decay of 78 across a 16-row diagonal block: past chunk_model.DIAGONAL_RANGE,
    75, and within FP32's range for the products): the kernel must take the exact sums there, as
    the model does, so its range test and the model's agree on either side of the bound."""
    tokens, heads = 17, 1
    query, key, value, gate, beta, recurrent = make_inputs(tokens, heads, "bounded", "random", seed=SEED + 99)
    inputs = (query, key, value, np.full_like(gate, -5.2), beta, recurrent)
    cumulated = np.cumsum(np.minimum(inputs[3], 0).astype(np.float32), axis=0)
    assert chunk_model.DIAGONAL_RANGE < cumulated[0, 0, 0] - cumulated[15, 0, 0] < 80
    out, _ = run_on_host(emulator, inputs, tokens, pad=float("nan"), unbounded=True)
    scratch = model_chunk_tc_prepare(*inputs[:5], None)
    for name in ("attn", "w", "u"):
        assert_close(out[name], scratch[name], FED_BOUND, f"decay 78: {name} vs model")

@pytest.mark.parametrize("tokens", [17, 65], ids=lambda t: f"T{t}")
def test_kernel_source_on_host_poisoned_pad_and_jitter(emulator, tokens):
    # Bit-identical outputs, scratch and state whatever the pad holds, and whatever the
    # interleaving of the threads (random sleeps at every barrier and mma).
    inputs = make_inputs(tokens, 1, seed=SEED + 7)
    clean, _ = run_on_host(emulator, inputs, tokens, pad=0.0)
    for pad, jitter in ((float("nan"), True), (1e30, False), (float("inf"), True)):
        dirty, _ = run_on_host(emulator, inputs, tokens, pad=pad, jitter=jitter)
        for name in (*SCRATCH, "state"):
            assert_bits_equal(dirty[name], clean[name], f"host T{tokens} {name}, pad {pad}, jitter {jitter}")
        assert_bits_equal(dirty["core"][:tokens], clean["core"][:tokens], f"host T{tokens} core, pad {pad}")


# --------------------------------------------------------------------------------------
# On a GPU
# --------------------------------------------------------------------------------------


def _cp():
    import cupy

    return cupy


def _device_inputs(tokens, heads, law="bounded", seed=SEED, pad=0.0):
    """FP32 device inputs in buffers padded to the chunk with `pad` (the workspace layout),
    and float64 copies of the first T rows for the oracle."""
    cp = _cp()
    inputs = make_inputs(tokens, heads, law, "random", seed=seed, xp=cp, dtype=np.float32)
    padded = chunk_count(tokens) * 64
    device = []
    for x in inputs[:5]:
        full = cp.full((padded,) + x.shape[1:], pad, cp.float32)
        full[:tokens] = x
        device.append(full)
    return device, inputs[5].copy(), [x.astype(cp.float64) for x in inputs]


def _scratch(tokens, heads):
    """The tensor-core path's scratch (FP16 operands, FP32 u and chunk_decay), NaN-filled."""
    return new_scratch(_cp(), tokens, heads, fill=float("nan"))


def _scratch_f32(tokens, heads):
    """The FP32 path's scratch, NaN-filled."""
    cp = _cp()
    return {name: cp.full(shape, float("nan"), cp.float32) for name, shape in scratch_shapes(tokens, heads).items()}


def _run_tc(device, state, tokens, lower_bound=LOWER_BOUND):
    cp = _cp()
    scratch = _scratch(tokens, state.shape[0])
    core = cp.full(device[0].shape, 12345.0, cp.float32)
    chunk_tc.chunk_prefill_tc(*device, state, core, tokens, lower_bound, *scratch.values())
    return core, scratch


def _run_fp32(device, state, tokens):
    cp = _cp()
    heads = state.shape[0]
    scratch = _scratch_f32(tokens, heads)
    core = cp.zeros(device[0].shape, cp.float32)
    ops.kda_chunk_prepare_f32(*device, *scratch.values(), tokens, 64, 1.0 / math.sqrt(128))
    ops.kda_chunk_scan_f32(*scratch.values(), state, core, tokens, 64)
    return core


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tokens", GPU_TOKENS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("geometry", list(GEOMETRY_HEADS))
@pytest.mark.parametrize("law", ["bounded", "softplus"])
def test_gpu_kernels_against_fp32_path_and_oracle(law, geometry, tokens, figures):
    # "softplus": gates without a lower bound, through the unbounded prepare (lower_bound None).
    heads = GEOMETRY_HEADS[geometry]
    bound = LOWER_BOUND if law == "bounded" else None
    seed = SEED + tokens if law == "bounded" else SEED + 40 + tokens
    device, start, exact = _device_inputs(tokens, heads, law=law, seed=seed)
    tc_state, fp32_state = start.copy(), start.copy()
    tc_core, scratch = _run_tc(device, tc_state, tokens, lower_bound=bound)
    fp32_core = _run_fp32(device, fp32_state, tokens)
    ref_core, ref_state = chunk_scan(*exact, chunk=64)
    tag = f"{geometry} T{tokens}" + ("" if law == "bounded" else " softplus")
    # Each kernel against the model fed its own inputs: localises a fault to one kernel.
    model_scratch = model_chunk_tc_prepare(*exact[:5], bound)
    for name in SCRATCH:
        if name != "chunk_decay":
            assert_close(scratch[name].reshape(model_scratch[name].shape), model_scratch[name], FED_BOUND,
                         f"{tag} prepare {name} vs model")
    fed_core, fed_state = model_chunk_tc_scan(scratch, exact[5], tokens)
    assert_close(tc_core[:tokens], fed_core, FED_BOUND, f"{tag} scan core vs model fed the kernel's scratch")
    assert_close(tc_state, fed_state, FED_BOUND, f"{tag} scan state vs model fed the kernel's scratch")
    # The contract: within TC_BOUND of the float64 oracle and of the FP32 kernel path.
    ratios = {
        "core_vs_oracle": rms_ratio(tc_core[:tokens], ref_core),
        "state_vs_oracle": rms_ratio(tc_state, ref_state),
        "core_vs_fp32_path": rms_ratio(tc_core[:tokens], fp32_core[:tokens]),
        "state_vs_fp32_path": rms_ratio(tc_state, fp32_state),
        "fp32_path_core_vs_oracle": rms_ratio(fp32_core[:tokens], ref_core),
    }
    figures.append({"test": f"chunk_tc {tag}", **ratios})
    print(tag, ratios)
    bad = {name: ratio for name, ratio in ratios.items() if not ratio <= TC_BOUND}
    assert not bad, f"{tag}: above {TC_BOUND:g}: {bad}"
    assert bool((tc_core[tokens:] == 12345.0).all()), f"{tag}: core rows >= T were written"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("poison", ["nan", "1e30"])
@pytest.mark.parametrize("tokens", [1, 17, 65, 1000], ids=lambda t: f"T{t}")
def test_gpu_poisoned_pad_changes_no_bit(tokens, poison):
    runs = []
    for pad in (0.0, POISONS[poison]):
        device, start, _ = _device_inputs(tokens, 32, seed=SEED + 1, pad=pad)
        core, scratch = _run_tc(device, start, tokens)
        runs.append((core[:tokens], start, scratch))
    assert_bits_equal(runs[1][0], runs[0][0], f"T{tokens} core, pad {poison}")
    assert_bits_equal(runs[1][1], runs[0][1], f"T{tokens} carried state, pad {poison}")
    for name in SCRATCH:
        assert_bits_equal(runs[1][2][name], runs[0][2][name], f"T{tokens} {name}, pad {poison}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("geometry", list(GEOMETRY_HEADS))
def test_gpu_carried_state_across_calls(geometry):
    # 1000 tokens as 300 + 700 (a split inside a chunk) from a random state, against one
    # call and against the oracle: the state carries between calls exactly as within one.
    cp = _cp()
    heads = GEOMETRY_HEADS[geometry]
    device, start, exact = _device_inputs(1000, heads, law="strong", seed=SEED + 2)
    whole_state = start.copy()
    whole_core, _ = _run_tc(device, whole_state, 1000)
    split_state = start.copy()
    first = [x[:300].copy() for x in device]
    second = [x[300:].copy() for x in device]
    core_a, _ = _run_tc(first, split_state, 300)
    core_b, _ = _run_tc(second, split_state, 700)
    split_core = cp.concatenate([core_a[:300], core_b[:700]])
    ref_core, ref_state = chunk_scan(*exact, chunk=64)
    assert_close(split_core, ref_core, TC_BOUND, f"{geometry} split core vs oracle")
    assert_close(split_state, ref_state, TC_BOUND, f"{geometry} split state vs oracle")
    assert_close(split_state, whole_state, TC_BOUND, f"{geometry} split state vs one call")
    assert_close(split_core, whole_core[:1000], TC_BOUND, f"{geometry} split core vs one call")


@pytest.mark.gpu
@needs_gpu
def test_gpu_runs_are_bit_identical():
    device, start, _ = _device_inputs(1000, 64, seed=SEED + 3)
    results = []
    for _ in range(2):
        state = start.copy()
        core, _ = _run_tc(device, state, 1000)
        results.append((core, state))
    assert_bits_equal(results[1][0], results[0][0], "core of a repeated run")
    assert_bits_equal(results[1][1], results[0][1], "state of a repeated run")


@pytest.mark.gpu
@needs_gpu
def test_gpu_refusal_leaves_the_state_untouched():
    device, start, _ = _device_inputs(65, 32, seed=SEED + 4)
    state = start.copy()
    scratch = _scratch(65, 32)
    core = _cp().zeros(device[0].shape, np.float32)
    with pytest.raises(ValueError, match="lower_bound"):
        chunk_tc.chunk_prefill_tc(*device, state, core, 65, -6.0, *scratch.values())
    assert_bits_equal(state, start, "state after a refused call")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("geometry", list(GEOMETRY_HEADS))
def test_gpu_throughput_report(geometry, figures):
    # Not a benchmark (benchmarks/ has those): a sanity figure that the tensor-core path is
    # faster than the FP32 path it replaces, recorded with the other figures.
    cp = _cp()
    heads, tokens = GEOMETRY_HEADS[geometry], 4096
    device, start, _ = _device_inputs(tokens, heads, seed=SEED + 5)
    state, core = start.copy(), cp.zeros(device[0].shape, cp.float32)
    scratch, scratch_f32 = _scratch(tokens, heads), _scratch_f32(tokens, heads)

    def tensor_core():
        chunk_tc.chunk_prefill_tc(*device, state, core, tokens, LOWER_BOUND, *scratch.values())

    def fp32():
        ops.kda_chunk_prepare_f32(*device, *scratch_f32.values(), tokens, 64, 1.0 / math.sqrt(128))
        ops.kda_chunk_scan_f32(*scratch_f32.values(), state, core, tokens, 64)

    timings = {}
    for name, run in (("tc", tensor_core), ("fp32", fp32)):
        run()  # compile and warm up
        begin, end = cp.cuda.Event(), cp.cuda.Event()
        begin.record()
        for _ in range(3):
            run()
        end.record()
        end.synchronize()
        timings[name] = cp.cuda.get_elapsed_time(begin, end) / 3 / 1e3
    rates = {f"{name}_mtok_per_s": tokens / seconds / 1e6 for name, seconds in timings.items()}
    figures.append({"test": f"chunk_tc throughput {geometry} T{tokens}", **rates})
    print(geometry, rates)
    assert timings["tc"] < timings["fp32"], f"{geometry}: tensor-core path not faster: {rates}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("law", ["bounded", "softplus"])
@pytest.mark.parametrize("tokens", [1, 65, 1000], ids=lambda t: f"T{t}")
def test_gpu_fused_gate_equals_the_gate_kernel(tokens, law):
    # The prepare forming gate and beta from the projections (the bounded prepare's, the unbounded
    # prepare's by the softplus law) writes the bits kda_gate_beta_f32 writes, only for the T real
    # rows, and the chunk results equal those of the same prepare fed the gate kernel's output.
    import ml_dtypes

    cp = _cp()
    heads, qkv = 32, 32 * 128
    rng = np.random.default_rng(SEED + 9)
    padded = chunk_count(tokens) * 64
    forget_proj = cp.asarray((rng.standard_normal((padded, qkv)) * 2.0).astype(ml_dtypes.bfloat16).view(np.uint16))
    wide = cp.asarray(rng.standard_normal((padded, 2 * 128 + heads)).astype(ml_dtypes.bfloat16).view(np.uint16))
    beta_logits = wide[:, 2 * 128 :]
    dt_bias = cp.asarray(rng.standard_normal(qkv).astype(np.float32))
    a_log = cp.asarray((0.5 * rng.standard_normal(heads)).astype(np.float32))
    device, start, _ = _device_inputs(tokens, heads, seed=SEED + 9)
    gate_ref, beta_ref = cp.full((padded, heads, 128), np.nan, cp.float32), cp.full((padded, heads), np.nan, cp.float32)
    bounded = law == "bounded"
    bound = LOWER_BOUND if bounded else None
    ops.kda_gate_beta_f32(forget_proj, dt_bias, a_log, beta_logits, gate_ref, beta_ref, heads, 128, bounded,
                          LOWER_BOUND if bounded else 0.0, tokens=tokens)
    query, key, value = device[:3]
    gate_out, beta_out = cp.full_like(gate_ref, 7.0), cp.full_like(beta_ref, 7.0)
    fused_state, fused_core, fused_scratch = start.copy(), cp.zeros_like(query), _scratch(tokens, heads)
    chunk_tc.chunk_prefill_tc(query, key, value, gate_out, beta_out, fused_state, fused_core, tokens, bound,
                              *fused_scratch.values(),
                              gate_source=chunk_tc.GateSource(forget_proj, dt_bias, a_log, beta_logits))
    assert_bits_equal(gate_out[:tokens], gate_ref[:tokens], f"T{tokens} {law} fused gate")
    assert_bits_equal(beta_out[:tokens], beta_ref[:tokens], f"T{tokens} fused beta")
    assert bool((gate_out[tokens:] == 7.0).all()) and bool((beta_out[tokens:] == 7.0).all()), \
        f"T{tokens}: the fused prepare wrote gate or beta rows >= T"
    plain_state, plain_core, plain_scratch = start.copy(), cp.zeros_like(query), _scratch(tokens, heads)
    chunk_tc.chunk_prefill_tc(query, key, value, gate_ref, beta_ref, plain_state, plain_core, tokens, bound,
                              *plain_scratch.values())
    assert_bits_equal(fused_core[:tokens], plain_core[:tokens], f"T{tokens} core, fused vs unfused gate")
    assert_bits_equal(fused_state, plain_state, f"T{tokens} state, fused vs unfused gate")
