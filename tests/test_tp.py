"""Tensor parallelism on the host: the head split is exact, the shard reader reads only its bytes.

The float64 oracle run on each rank's shard, summed over ranks BEFORE any rounding, equals
the full block's float64 output (the split itself is exact, only float64 reassociation is
left); each rank's final state is the head slice of the full run's state. The byte-range
reader equals plan.shard(bind_layer(...)) bit for bit and reads less than the whole layer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import subprocess

import ml_dtypes
import numpy as np
import pytest

from glm_kda import tp
from glm_kda.checkpoint import (
    INDEX_FILE,
    LAYOUT_RELEASE,
    LAYOUT_TRANSFORMERS,
    SINGLE_FILE,
    BoundLayer,
    CheckpointError,
    attention_prefix,
    bind_layer,
    read_safetensors_header,
)
from glm_kda.config import KdaConfig
from glm_kda.device import gpu_status
from glm_kda.reference import KdaOracle, rms_ratio, round_bf16
from glm_kda.state import KdaState
from glm_kda.synthetic import synthetic_config, synthetic_hidden, write_synthetic_checkpoint
from glm_kda.tp import (
    ShardReadStats,
    TensorParallelError,
    TensorParallelPlan,
    bind_layer_shard,
    check_devices,
)
from host_cuda import HOST_CUDA_HEADER, build_host_binary

SEED = 4321
HEADS = 4
EXACT = 1e-12
# The ranks' FP32 o_proj sums added in FP32 and rounded once differ from the single-GPU rounding
# only by FP32 reassociation (docs/design.md, "Tensor parallel"); BF16 partials would add a second
# rounding, about 3e-3, over the GPU test's bound (TP2_BOUND of tests/test_tp_gpu.py).
FP32_PARTIALS_BOUND = 1e-4
TP2_BOUND = 1e-3
GEOMETRIES = ["tiny-glm", "tiny-kimi"]


def four_heads(geometry: str) -> KdaConfig:
    """A tiny geometry with 4 heads, so tp 2 and 4 both split it."""
    return dataclasses.replace(synthetic_config(geometry), heads=HEADS)


def assert_close(actual, expected, bound, what):
    ratio = rms_ratio(actual, expected)
    print(f"{what}: rms-ratio {ratio:.3e}")
    assert ratio <= bound, f"{what}: rms-ratio {ratio:.3e} > bound {bound:.1e}"


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray, what: str):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    differ = int(np.count_nonzero(actual.view(np.uint8) != expected.view(np.uint8)))
    assert differ == 0, f"{what}: {differ} bytes differ"


@pytest.fixture(scope="module", params=GEOMETRIES)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"{request.param}-4heads")
    return write_synthetic_checkpoint(path, four_heads(request.param), seed=SEED)


@pytest.fixture(scope="module")
def full_layer(checkpoint):
    return bind_layer(checkpoint, 0, progress=False)


# The plan ------------------------------------------------------------------------------------
def test_plan_ranges_cover_the_block_once():
    config = four_heads("tiny-glm")
    for tp_size in (1, 2, 4):
        plan = TensorParallelPlan(config, tp_size)
        heads = np.concatenate([np.arange(config.heads)[plan.head_slice(r)] for r in plan.ranks()])
        channels = np.concatenate([np.arange(config.qkv)[plan.channel_slice(r)] for r in plan.ranks()])
        conv = np.concatenate([np.arange(config.conv_dim)[s] for r in plan.ranks() for s in plan.conv_channel_slices(r)])
        assert heads.tolist() == list(range(config.heads))
        assert channels.tolist() == list(range(config.qkv))
        assert sorted(conv.tolist()) == list(range(config.conv_dim))
        for r in plan.ranks():
            rank_config = plan.rank_config(r)
            assert rank_config.heads == config.heads // tp_size
            assert dataclasses.replace(rank_config, heads=config.heads) == config


def test_conv_slice_is_three_ranges():
    """Rank 1 of 2 (qkv = 64): its q, k and v channels, not one contiguous block."""
    plan = TensorParallelPlan(four_heads("tiny-glm"), 2)
    assert plan.conv_channel_slices(1) == (slice(32, 64), slice(96, 128), slice(160, 192))


@pytest.mark.parametrize("tp_size", [2, 4], ids=lambda t: f"tp{t}")
def test_shard_slices(full_layer, tp_size):
    plan = TensorParallelPlan(full_layer.config, tp_size)
    width = plan.channels_per_rank
    for r in plan.ranks():
        shard = plan.shard(full_layer, r)
        ch, hd = plan.channel_slice(r), plan.head_slice(r)
        assert shard.config == plan.rank_config(r)
        np.testing.assert_array_equal(shard.q_proj, full_layer.q_proj[ch])
        np.testing.assert_array_equal(shard.conv_weight[width : 2 * width], full_layer.conv_weight[full_layer.config.qkv + ch.start : full_layer.config.qkv + ch.stop])
        np.testing.assert_array_equal(shard.a_log, full_layer.a_log[hd])
        np.testing.assert_array_equal(shard.dt_bias, full_layer.dt_bias[ch])
        np.testing.assert_array_equal(shard.o_proj, full_layer.o_proj[:, ch])
        for replicated in ("f_a", "g_a", "o_norm"):
            np.testing.assert_array_equal(getattr(shard, replicated), getattr(full_layer, replicated))
        for name, array in shard.arrays().items():
            assert array.flags.c_contiguous, f"rank {r}: {name} is not contiguous"


def test_state_slice_and_gather_round_trip():
    config = four_heads("tiny-kimi")
    state = KdaState.random(config, seed=SEED)
    for tp_size in (1, 2, 4):
        plan = TensorParallelPlan(config, tp_size)
        parts = [plan.state_slice(state, r) for r in plan.ranks()]
        for r, part in enumerate(parts):
            part.check(plan.rank_config(r))
            q, k, v = plan.conv_channel_slices(r)
            np.testing.assert_array_equal(part.conv, np.concatenate([state.conv[q], state.conv[k], state.conv[v]]))
        gathered = plan.gather_states(parts)
        np.testing.assert_array_equal(gathered.conv, state.conv)
        np.testing.assert_array_equal(gathered.recurrent, state.recurrent)


# Errors name the culprit ---------------------------------------------------------------------
def test_tp_size_must_divide_heads():
    with pytest.raises(TensorParallelError, match=r"tp_size=3 does not divide heads=4") as info:
        TensorParallelPlan(four_heads("tiny-glm"), 3)
    assert "[1, 2, 4]" in str(info.value)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(TensorParallelError, match="tp_size must be a positive integer"):
            TensorParallelPlan(four_heads("tiny-glm"), bad)


@pytest.mark.parametrize("rank", [-1, 4])
def test_rank_out_of_range(full_layer, checkpoint, rank):
    plan = TensorParallelPlan(full_layer.config, 4)
    message = rf"rank {rank} is outside \[0, 4\) for tp_size=4"
    for call in (lambda: plan.rank_config(rank), lambda: plan.shard(full_layer, rank),
                 lambda: plan.state_slice(KdaState.zeros(full_layer.config), rank),
                 lambda: bind_layer_shard(checkpoint, 0, 4, rank, progress=False)):
        with pytest.raises(TensorParallelError, match=message):
            call()


def test_bind_layer_shard_tp_size_error(checkpoint):
    with pytest.raises(TensorParallelError, match=r"tp_size=3 does not divide heads=4"):
        bind_layer_shard(checkpoint, 0, 3, 0, progress=False)


def test_shard_rejects_another_config(full_layer):
    plan = TensorParallelPlan(full_layer.config.with_chunk(16), 2)
    with pytest.raises(TensorParallelError, match=r"chunk \(64 vs 16\)"):
        plan.shard(full_layer, 0)


def test_check_devices():
    assert check_devices((0, 1), 2) == [0, 1]
    with pytest.raises(TensorParallelError, match=r"devices \[0, 1\] asks for 2 GPUs .* only 1 CUDA device is visible"):
        check_devices((0, 1), 1)
    with pytest.raises(TensorParallelError, match=r"devices \[1, 3\] .* only 2 CUDA devices are visible"):
        check_devices((1, 3), 2)
    with pytest.raises(TensorParallelError, match="lists a GPU twice"):
        check_devices((0, 0), 2)
    with pytest.raises(TensorParallelError, match="empty"):
        check_devices((), 2)


@pytest.mark.skipif(gpu_status()[0], reason="checks the message given on a machine without a GPU")
def test_block_needs_a_gpu(checkpoint):
    from glm_kda.device import NoGpuError

    with pytest.raises(NoGpuError, match="TensorParallelBlock.from_pretrained needs a CUDA GPU"):
        tp.TensorParallelBlock.from_pretrained(checkpoint, 0, devices=(0, 1))


# The split is exact in float64 -----------------------------------------------------------------
MODES = {
    "token-T33": dict(tokens=33, chunk=None, decode=False),
    "chunked-T37-C16": dict(tokens=37, chunk=16, decode=False),
    "decode-6": dict(tokens=6, chunk=None, decode=True),
}


def run_oracle(layer: BoundLayer, precision: str, hidden: np.ndarray, state: KdaState, mode: dict):
    """(final_out [T, hidden], final state) of one oracle run in `mode`."""
    oracle = KdaOracle(layer, precision)
    if not mode["decode"]:
        stages, state = oracle.prefill(hidden, state, chunk=mode["chunk"])
        return stages["final_out"], state
    rows = []
    for t in range(hidden.shape[0]):
        stages, state = oracle.decode(hidden[t], state)
        rows.append(stages["final_out"])
    return np.concatenate(rows), state


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("tp_size", [2, 4], ids=lambda t: f"tp{t}")
def test_rank_sum_equals_full_block(full_layer, tp_size, mode):
    config = full_layer.config
    plan = TensorParallelPlan(config, tp_size)
    spec = MODES[mode]
    hidden = synthetic_hidden(spec["tokens"], config.hidden, seed=SEED)
    start = KdaState.random(config, seed=SEED).astype(np.float64)
    full_out, full_state = run_oracle(full_layer, "float64", hidden, start, spec)
    total = np.zeros_like(full_out)
    for r in plan.ranks():
        rank_out, rank_state = run_oracle(plan.shard(full_layer, r), "float64", hidden, plan.state_slice(start, r), spec)
        total += rank_out
        expected = plan.state_slice(full_state, r)
        assert_close(rank_state.conv, expected.conv, EXACT, f"{mode} tp{tp_size} rank {r} conv state")
        assert_close(rank_state.recurrent, expected.recurrent, EXACT, f"{mode} tp{tp_size} rank {r} recurrent state")
    assert_close(total, full_out, EXACT, f"{mode} tp{tp_size} sum of rank outputs")


@pytest.mark.parametrize("tp_size", [2, 4], ids=lambda t: f"tp{t}")
def test_fp32_partials_round_once(full_layer, tp_size):
    """What the GPU path does after the heads, simulated in float32 on the BF16 oracle's o_norm_out
    (each rank's o_norm_out is the head slice of the single run's): each rank's o_proj sums its own
    channels in FP32 (KdaLayer.o_proj_sums), the ranks' sums are added in FP32 and rounded once.
    Against one rounding of the single-GPU FP32 sum only the reassociation is left; BF16 partials
    (each rank's output rounded before the sum) would put a second rounding over the GPU test's
    bound, so that bound tells the two apart."""
    config = full_layer.config
    plan = TensorParallelPlan(config, tp_size)
    hidden = synthetic_hidden(64, config.hidden, seed=SEED + 1)
    start = KdaState.random(config, seed=SEED + 1)
    stages, _ = KdaOracle(full_layer, "bf16").prefill(hidden, start)
    exact, _ = KdaOracle(full_layer, "float64").prefill(hidden, start)
    x = np.asarray(stages["o_norm_out"]).astype(np.float32)
    w = np.asarray(full_layer.o_proj).astype(np.float32)
    single = round_bf16((x @ w.T).astype(np.float64))
    assert_close(single, stages["final_out"], FP32_PARTIALS_BOUND, "single FP32 sum vs the BF16 oracle's o_proj")
    summed = np.zeros(single.shape, np.float32)
    double = np.zeros(single.shape, np.float32)
    for r in plan.ranks():
        channels = plan.channel_slice(r)
        partial = x[:, channels] @ w[:, channels].T
        summed = (summed + partial).astype(np.float32)
        double = (double + round_bf16(partial.astype(np.float64)).astype(np.float32)).astype(np.float32)
    parallel = round_bf16(summed.astype(np.float64))
    assert_close(parallel, single, FP32_PARTIALS_BOUND, f"tp{tp_size} FP32 partials vs single")
    double_ratio = rms_ratio(round_bf16(double.astype(np.float64)), single)
    assert double_ratio > TP2_BOUND, f"tp{tp_size}: BF16 partials only {double_ratio:.3e} from single"
    single_error, parallel_error = rms_ratio(single, exact["final_out"]), rms_ratio(parallel, exact["final_out"])
    print(f"tp{tp_size}: error vs float64 {parallel_error:.3e}, single {single_error:.3e}, "
          f"BF16 partials {double_ratio:.3e} from single")
    assert parallel_error <= 1.01 * single_error, f"tp{tp_size}: {parallel_error:.3e} against {single_error:.3e}"


# Reading only the rank's bytes ---------------------------------------------------------------
class CountingFile:
    """A binary file that counts the bytes its reads return."""

    def __init__(self, path, log):
        self._handle = open(path, "rb")
        self._log = log

    def read(self, size=-1):
        data = self._handle.read(size)
        self._log["bytes"] += len(data)
        return data

    def readinto(self, buffer):
        count = self._handle.readinto(buffer)
        self._log["bytes"] += count or 0
        return count

    def seek(self, offset, whence=0):
        return self._handle.seek(offset, whence)

    def fileno(self):
        return self._handle.fileno()

    def close(self):
        self._handle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture
def counted_reads(monkeypatch):
    log = {"bytes": 0}
    monkeypatch.setattr(tp, "_open_binary", lambda path: CountingFile(path, log))
    return log


def layer_files(path, layer_idx):
    """{file: header length} of the files holding the layer, and the layer's data bytes."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        weight_map = {name: SINGLE_FILE for name in read_safetensors_header(path / SINGLE_FILE)}
    prefix = attention_prefix(layer_idx)
    files = sorted({file for name, file in weight_map.items() if name.startswith(prefix)})
    layer_bytes, header_bytes = 0, {}
    for file in files:
        with open(path / file, "rb") as handle:
            header_bytes[file] = 8 + int.from_bytes(handle.read(8), "little")
        for name, (dtype, shape) in read_safetensors_header(path / file).items():
            if name.startswith(prefix):
                layer_bytes += math.prod(shape) * (2 if dtype == "BF16" else 4)
    return header_bytes, layer_bytes


@pytest.mark.parametrize("shards", [1, 4], ids=lambda s: f"shards{s}")
@pytest.mark.parametrize("layout", [LAYOUT_RELEASE, LAYOUT_TRANSFORMERS])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_byte_range_reader_equals_shard(tmp_path, counted_reads, geometry, layout, shards):
    path = write_synthetic_checkpoint(tmp_path, four_heads(geometry), layout=layout, shards=shards, seed=SEED)
    layer_idx = 2  # a KDA layer in the third of four shards
    full = bind_layer(path, layer_idx, progress=False)
    header_bytes, layer_bytes = layer_files(path, layer_idx)
    for tp_size in (1, 2, 4):
        plan = TensorParallelPlan(full.config, tp_size)
        for r in plan.ranks():
            expected = plan.shard(full, r)
            counted_reads["bytes"] = 0
            stats = ShardReadStats()
            shard = bind_layer_shard(path, layer_idx, tp_size, r, progress=False, stats=stats)
            tag = f"{geometry} {layout} shards{shards} tp{tp_size} rank {r}"
            assert shard.config == expected.config and shard.layout == expected.layout == layout
            assert shard.layer_idx == layer_idx
            for name, array in expected.arrays().items():
                assert_bits_equal(getattr(shard, name), array, f"{tag}: {name}")
            # Exactly the headers of the files holding the layer, then exactly the rank's rows.
            assert counted_reads["bytes"] == stats.bytes_read, tag
            assert {file for file, _, _ in stats.reads} == set(header_bytes), tag
            row_bytes = sum(a.nbytes for n, a in expected.arrays().items() if n != "o_proj")
            assert stats.bytes_read == sum(header_bytes.values()) + row_bytes, tag
            assert stats.bytes_mapped >= expected.o_proj.nbytes, tag
            if tp_size > 1:
                assert stats.bytes_read - sum(header_bytes.values()) + stats.bytes_mapped < layer_bytes, tag
            print(f"{tag}: read {stats.bytes_read} B (headers {sum(header_bytes.values())}), "
                  f"mapped {stats.bytes_mapped} B, whole layer {layer_bytes} B")


def test_reader_reads_fewer_bytes_than_the_layer(tmp_path, counted_reads):
    """At a width where o_proj rows span several pages, the column copy touches only the
    rank's pages, and the whole read (headers included) is well under the layer."""
    config = KdaConfig(hidden=256, heads=8, head_dim=512, conv_kernel=4, gate_law="bounded",
                       gate_lower_bound=-5.0, rms_norm_eps=1e-5)
    path = write_synthetic_checkpoint(tmp_path, config, num_layers=1, seed=SEED)
    header_bytes, layer_bytes = layer_files(path, 0)
    for tp_size in (2, 4):
        stats = ShardReadStats()
        counted_reads["bytes"] = 0
        shard = bind_layer_shard(path, 0, tp_size, tp_size - 1, progress=False, stats=stats)
        total = counted_reads["bytes"] + stats.bytes_mapped
        print(f"tp{tp_size}: read {counted_reads['bytes']} B + mapped {stats.bytes_mapped} B "
              f"= {total / layer_bytes:.3f} of the layer's {layer_bytes} B")
        assert counted_reads["bytes"] == stats.bytes_read
        assert stats.bytes_mapped <= 2 * shard.o_proj.nbytes + mmap.PAGESIZE * config.hidden
        assert total < layer_bytes * (1.0 / tp_size + 0.1)


def test_reader_errors_match_bind_layer(tmp_path):
    path = write_synthetic_checkpoint(tmp_path, four_heads("tiny-glm"), seed=SEED)
    wrong = dataclasses.replace(synthetic_config(four_heads("tiny-glm")), head_dim=8)
    for layer_idx, config in ((0, wrong), (3, None), (9, None)):
        with pytest.raises(CheckpointError) as expected:
            bind_layer(path, layer_idx, config=config, progress=False)
        with pytest.raises(CheckpointError) as actual:
            bind_layer_shard(path, layer_idx, 2, 1, config=config, progress=False)
        assert str(actual.value) == str(expected.value)


def test_reader_rejects_inconsistent_offsets(tmp_path):
    """A header whose data_offsets do not fit the tensor's shape is named, not misread."""
    path = write_synthetic_checkpoint(tmp_path, four_heads("tiny-glm"), num_layers=1, seed=SEED)
    file = path / SINGLE_FILE
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    name = attention_prefix(0) + "q_proj.weight"
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end - 2]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(text) == length
    file.write_bytes(raw[:8] + text + raw[8 + length :])
    with pytest.raises(CheckpointError, match=r"q_proj.weight' has data_offsets spanning \d+ bytes"):
        bind_layer_shard(path, 0, 2, 0, progress=False)


# The BF16 conversions of the all-reduce ------------------------------------------------------
_ROUND_HOST_MAIN = r"""
#include <cstdio>
#include <vector>
int main(int argc, char** argv) {
    std::FILE* in = std::fopen(argv[1], "rb");
    std::vector<float> values(std::atoi(argv[3]));
    if (std::fread(values.data(), 4, values.size(), in) != values.size()) return 1;
    std::vector<unsigned short> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i) bits[i] = kda_float_to_bf16_bits(values[i]);
    std::FILE* out = std::fopen(argv[2], "wb");
    return std::fwrite(bits.data(), 2, bits.size(), out) == bits.size() ? 0 : 1;
}
"""


def test_round_to_nearest_even_formula(tmp_path):
    """ops.BF16_ROUND_SOURCE's kda_float_to_bf16_bits, compiled for the host, equals ml_dtypes' FP32 -> BF16
    rounding (nearest even; a NaN stays a NaN)."""
    from glm_kda.gpu.ops.cublas import BF16_ROUND_SOURCE

    rng = np.random.default_rng(SEED)
    values = np.concatenate([
        rng.standard_normal(20000).astype(np.float32) * np.float32(10.0) ** rng.integers(-40, 38, 20000).astype(np.float32),
        np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 3.3895314e38, np.finfo(np.float32).max,
                  1e-45, -1e-40, 1.00390625, 1.01171875], dtype=np.float32),
    ]).astype(np.float32)
    # Exact ties: the low 16 bits 0x8000, odd and even upper halves.
    ties = (rng.integers(0, 2**15, 2000, dtype=np.uint32) << 17 | 0x8000).astype(np.uint32)
    ties = np.concatenate([ties, ties | np.uint32(0x10000)]).view(np.float32)
    values = np.concatenate([values, ties[np.isfinite(ties)]])
    binary = build_host_binary(tmp_path, "round", {"round.cpp": HOST_CUDA_HEADER.replace("#pragma once", "")
                                                   + BF16_ROUND_SOURCE + _ROUND_HOST_MAIN})
    values.tofile(tmp_path / "values.bin")
    subprocess.run([str(binary), str(tmp_path / "values.bin"), str(tmp_path / "bits.bin"), str(values.size)], check=True)
    ours = np.fromfile(tmp_path / "bits.bin", np.uint16)
    assert ours.size == values.size
    nan = np.isnan(values)
    reference = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    wrong = np.flatnonzero(ours[~nan] != reference[~nan])
    assert wrong.size == 0, (f"{wrong.size} finite values round differently, first "
                             f"{values[~nan][wrong[0]]!r}: {ours[~nan][wrong[0]]:#06x} against {reference[~nan][wrong[0]]:#06x}")
    assert np.isnan(ours[nan].view(ml_dtypes.bfloat16).astype(np.float32)).all(), "a NaN did not stay a NaN"


def test_conversion_source_compiles():
    """The device function of ops.round_to_bf16 compiles with NVRTC (no GPU needed)."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - any failure means no NVRTC here
        pytest.skip(f"NVRTC is not available ({type(exc).__name__}: {exc})")
    from glm_kda.gpu.ops.cublas import BF16_ROUND_SOURCE

    source = BF16_ROUND_SOURCE + r"""
extern "C" __global__ void round_check(const float* values, unsigned short* rounded, int count) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) {
        rounded[i] = kda_float_to_bf16_bits(values[i] * 1.5f);
    }
}
"""
    program = nvrtc.createProgram(source, "round_check.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, ["--gpu-architecture=compute_90"])
        except nvrtc.NVRTCError as error:
            pytest.fail(f"{error}:\n{nvrtc.getProgramLog(program)}")
        assert "round_check" in nvrtc.getPTX(program).decode(errors="replace")
    finally:
        nvrtc.destroyProgram(program)


def test_reader_rejects_a_truncated_file(tmp_path):
    path = write_synthetic_checkpoint(tmp_path, four_heads("tiny-glm"), num_layers=1, seed=SEED)
    file = path / SINGLE_FILE
    file.write_bytes(file.read_bytes()[:-300])
    with pytest.raises(CheckpointError, match=r"truncated: tensor '.*' ends at byte \d+, the file at \d+"):
        bind_layer_shard(path, 0, 2, 1, progress=False)
