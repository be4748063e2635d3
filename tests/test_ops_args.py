"""The launch wrappers' operand checks and stride arithmetic, without a GPU: a stand-in for
cupy.ndarray wraps NumPy arrays (same shape, strides, flags and a data pointer)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from glm_kda.gpu import build, ops
from standins import HostStandIn, aligned, use_stand_ins


@pytest.fixture(autouse=True)
def stand_in(monkeypatch):
    use_stand_ins(monkeypatch)


def test_projection_strides_of_column_slices():
    d, heads = 128, 32
    down = HostStandIn(aligned((16, 2 * d + heads)))   # f_a | g_a | b_proj, one buffer
    w = HostStandIn(aligned((4096, d)))
    out = HostStandIn(aligned((16, 4096)))
    rows, n, k, ldx, ldy = ops.projection_args("gemm_rows_bf16", down[:5, d : 2 * d], w, out[:5], None, 256)
    assert (rows, n, k, ldx, ldy) == (5, 4096, d, 2 * d + heads, 4096)
    wide_out = HostStandIn(aligned((4, 3 * 64)))
    x = HostStandIn(aligned((4, 64)))
    w_small = HostStandIn(aligned((64, 64)))
    assert ops.projection_args("gemm_rows_bf16", x, w_small, wide_out[:, 64:128], None, 16)[4] == 3 * 64


@pytest.mark.parametrize("case,needle", [
    ("rows", "rows must be 1..16"),
    ("k", "multiple of 8"),
    ("stride", "row stride"),
    ("misaligned", "aligned"),
    ("dtype", "BF16"),
])
def test_projection_errors_name_the_operand(case, needle):
    x, w, out = aligned((20, 64)), aligned((32, 64)), aligned((20, 32))
    rows = 4
    if case == "rows":
        rows = 17
    elif case == "k":
        x, w = aligned((20, 60)), aligned((32, 60))
    elif case == "stride":
        x = aligned((20, 68))[:, :64]  # rows 68 elements apart: not whole 16-byte vectors
    elif case == "misaligned":
        x = aligned((20, 72)).reshape(-1)[4 : 4 + 20 * 64].reshape(20, 64)
    elif case == "dtype":
        x = aligned((20, 64), np.float32)
    with pytest.raises((ValueError, TypeError), match=needle):
        ops.projection_args("gemm_rows_pair_bf16", HostStandIn(x), HostStandIn(w), HostStandIn(out), rows, 16)


def test_slot_checks():
    pool = HostStandIn(aligned((8, 96, 4), np.float32))
    from glm_kda.gpu.ops.checks import _slot_rows

    _slot_rows("conv_state", pool, (96, 4), 8, None)
    with pytest.raises(ValueError, match="only 1 state"):
        _slot_rows("conv_state", HostStandIn(aligned((96, 4), np.float32)), (96, 4), 2, None)
    with pytest.raises(ValueError, match="int32"):
        _slot_rows("conv_state", pool, (96, 4), 3, HostStandIn(np.zeros(3, np.int64)))


@pytest.fixture
def launches(monkeypatch):
    """Every build.launch the wrappers make, as (name, grid, block, args), instead of running."""
    made = []
    monkeypatch.setattr(build, "launch", lambda name, grid, block, args, shared_mem=0, **options:
                        made.append((name, tuple(grid), tuple(block), tuple(args))))
    return made


def _f32(*shape):
    return HostStandIn(aligned(shape, np.float32))


def _bf16(*shape):
    return HostStandIn(aligned(shape))


@pytest.mark.parametrize("tokens", [1, 3, 63, 64, 65, 1000], ids=lambda t: f"T{t}")
def test_prefill_conv_grid_is_head_groups_by_token_tiles(launches, tokens):
    heads, dim, kernel = 2, ops.HEAD_DIM, 4
    conv_dim = 3 * heads * dim
    ops.kda_conv_prefill_silu_l2_bf16(_f32(conv_dim, kernel), _bf16(tokens, conv_dim), _bf16(conv_dim, kernel),
                                  _bf16(tokens, conv_dim), _f32(tokens, heads, dim), _f32(tokens, heads, dim),
                                  _f32(tokens, heads, dim), heads, dim, 1e-6, tokens=tokens)
    (name, grid, block, args), = launches
    assert name == "kda_conv_prefill_silu_l2_bf16"
    # One warp per head of q, k or v: 4 heads per block of 128 threads.
    assert grid == (-(-3 * heads // 4), -(-tokens // 64)) and block == (128,)
    assert int(args[-2]) == tokens


def test_prefill_conv_names_a_short_output(launches):
    heads, dim = 2, ops.HEAD_DIM
    conv_dim = 3 * heads * dim
    with pytest.raises(ValueError, match="key"):
        ops.kda_conv_prefill_silu_l2_bf16(_f32(conv_dim, 4), _bf16(10, conv_dim), _bf16(conv_dim, 4), _bf16(10, conv_dim),
                                      _f32(10, heads, dim), _f32(9, heads, dim), _f32(10, heads, dim), heads, dim, 1e-6,
                                      tokens=10)
    assert not launches


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 7, 8, 9, ops.MAX_GRID_Y + 5], ids=lambda t: f"T{t}")
def test_gate_and_norm_walk_token_groups(launches, tokens):
    """grid.y = ceil(T / tokens per block) per slice of at most MAX_GRID_Y tokens; each launch
    is told its slice's token count (the kernels stop there); the norm's grid.x = ceil(H / 4)."""
    heads, dim = 5, ops.HEAD_DIM
    qkv = heads * dim
    ops.kda_gate_beta_f32(_bf16(tokens, qkv), _f32(qkv), _f32(heads), _bf16(tokens, 2 * dim + heads)[:, 2 * dim:],
                      _f32(tokens, heads, dim), _f32(tokens, heads), heads, dim, True, -5.0, tokens=tokens)
    ops.kda_gated_rmsnorm_sigmoid_bf16(_f32(tokens, heads, dim), _bf16(tokens, qkv), _bf16(dim), _bf16(tokens, qkv),
                                   heads, dim, 1e-5, tokens=tokens)
    slices = [min(ops.MAX_GRID_Y, tokens - start) for start in range(0, tokens, ops.MAX_GRID_Y)]
    for kernel, head_blocks, per_block in (("kda_gate_beta_f32", heads, 32), ("kda_gated_rmsnorm_sigmoid_bf16", 2, 4)):
        made = [launch for launch in launches if launch[0] == kernel]
        assert [launch[1] for launch in made] == [(head_blocks, -(-count // per_block)) for count in slices]
        assert [int(launch[3][-1]) for launch in made] == slices


def test_constants_match_the_kernel_sources():
    """Every private constant the wrappers share with a kernel is what the kernel source says."""
    import re

    from glm_kda.gpu.ops import checks, chunk, conv, decode_step, gate, norm

    def define(stem, name):
        match = re.search(rf"#define {name} (\d+)", (build.kernels_dir() / stem).read_text())
        assert match, f"{stem} no longer defines {name}"
        return int(match.group(1))

    def enum(stem, name):
        match = re.search(rf"\b{name} = (\d+)", (build.kernels_dir() / stem).read_text())
        assert match, f"{stem} no longer names {name}"
        return int(match.group(1))

    assert (gate._TOKENS_PER_BLOCK, gate._THREADS) == (define("gate.cu", "GATE_TOKENS_PER_BLOCK"),
                                                       define("gate.cu", "GATE_THREADS"))
    assert (norm._TOKENS_PER_BLOCK, norm._HEADS_PER_BLOCK) == (define("norm.cu", "NORM_TOKENS_PER_BLOCK"),
                                                              define("norm.cu", "NORM_HEADS_PER_BLOCK"))
    assert conv._TILE == define("conv.cu", "CONV_PREFILL_TILE")
    assert checks._CONV_MAX_KERNEL == define("common/conv_window.cuh", "CONV_MAX_KERNEL")
    assert (checks.HEAD_DIM, checks.HEAD_BLOCK) == (define("common/head.cuh", "KDA_HEAD_DIM"),
                                                    define("common/head.cuh", "KDA_HEAD_BLOCK"))
    assert (chunk._CHUNK_MAX, chunk._SCAN_COLUMNS) == (define("chunk/chunk.cu", "CHUNK_MAX"),
                                                       define("chunk/chunk.cu", "SCAN_COLUMNS"))
    assert (gate._GATE_SOFTPLUS, gate._GATE_BOUNDED) == (enum("common/math.cuh", "KDA_GATE_SOFTPLUS"),
                                                         enum("common/math.cuh", "KDA_GATE_BOUNDED"))
    assert (decode_step._DEPENDENTS_AT_START, decode_step._DEPENDENTS_AFTER_INPUTS,
            decode_step._DEPENDENTS_AFTER_STEP) == tuple(enum("decode/decode.cu", name) for name in (
                "KDA_DEPENDENTS_AT_START", "KDA_DEPENDENTS_AFTER_INPUTS", "KDA_DEPENDENTS_AFTER_STEP"))


def test_gate_refuses_another_head_dim(launches):
    with pytest.raises(ValueError, match="head_dim = 64"):
        ops.kda_gate_beta_f32(_bf16(4, 128), _f32(128), _f32(2), _bf16(4, 130)[:, 128:], _f32(4, 2, 64), _f32(4, 2), 2, 64,
                          True, -5.0, tokens=4)
    assert not launches


def _fused_decode_operands(heads: int, rows: int, kernel: int = 4, pool: int | None = None):
    dim = ops.HEAD_DIM
    qkv = heads * dim
    lead = () if pool is None else (pool,)
    return dict(
        conv_state=_f32(*lead, 3 * qkv, kernel), recurrent_state=_f32(*lead, heads, dim, dim),
        qkv_proj=_bf16(rows, 3 * qkv), conv_w=_bf16(3 * qkv, kernel), forget_proj=_bf16(rows, qkv),
        dt_bias=_f32(qkv), a_log=_f32(heads), beta_logits=_bf16(rows, 2 * dim + heads)[:, 2 * dim:],
        out_gate=_bf16(rows, qkv), o_norm_w=_bf16(dim), conv_out=_bf16(rows, 3 * qkv),
        query=_f32(rows, heads, dim), key=_f32(rows, heads, dim), value=_f32(rows, heads, dim),
        gate=_f32(rows, heads, dim), beta=_f32(rows, heads), core=_f32(rows, heads, dim),
        o_norm_out=_bf16(rows, qkv),
    )


_FUSED_SCALARS = dict(bounded=True, lower_bound=-5.0, scale=128**-0.5, l2_eps=1e-6, norm_eps=1e-5)


def _fused_parameters() -> list[str]:
    """The names of kda_decode_fused_bf16's parameters, in order (decode.cu)."""
    import re

    source = (build.kernels_dir() / "decode/decode.cu").read_text()
    signature = re.search(r"kda_decode_fused_bf16\((.*?)\)\s*\{", source, re.S).group(1)
    return [re.findall(r"\w+", parameter)[-1] for parameter in signature.split(",")]


def _fused_parameter(args, name):
    """The launch argument of the fused step's parameter `name`."""
    names = _fused_parameters()
    assert len(names) == len(args), f"{len(args)} arguments for the {len(names)} parameters {names}"
    return args[names.index(name)]


@pytest.mark.parametrize("rows", [1, 3])
def test_fused_decode_grid_and_arguments_match_the_kernel(launches, rows):
    """grid (heads, rows), one block per head, and as many arguments as the kernel declares."""
    heads = 2
    slots = HostStandIn(np.arange(rows, dtype=np.int32))
    ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows, pool=4), **_FUSED_SCALARS, slots=slots)
    (name, grid, block, args), = launches
    assert name == "kda_decode_fused_bf16" and grid == (heads, rows) and block == (ops.HEAD_DIM,)
    assert len(args) == len(_fused_parameters())
    assert [int(_fused_parameter(args, name)) for name in ("heads", "kernel_size", "tokens")] == [heads, 4, 1]
    assert [int(_fused_parameter(args, name)) for name in ("prefetch_ahead", "dependents_after")] == [0, 0]
    assert [float(_fused_parameter(args, name)) for name in ("gate_law", "lower_bound")] == [1, -5.0]
    assert _fused_parameter(args, "x_tiles") is None and _fused_parameter(args, "outputs_ready") is None
    ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows, pool=4), **{**_FUSED_SCALARS, "bounded": False},
                              slots=slots)
    assert [float(_fused_parameter(launches[-1][3], name)) for name in ("gate_law", "lower_bound")] == [0, 0.0]


@pytest.mark.parametrize("operand,shape,needle", [
    ("out_gate", (3, 200), "out_gate"),
    ("a_log", (5,), "a_log"),
    ("gate", (3, 2, 64), "gate"),
    ("recurrent_state", (3, 128, 128), "state"),
])
def test_fused_decode_names_the_bad_operand_before_any_launch(launches, operand, shape, needle):
    operands = _fused_decode_operands(2, 3, pool=4)
    slots = HostStandIn(np.arange(3, dtype=np.int32))
    operands[operand] = (_bf16 if operands[operand].dtype == np.uint16 else _f32)(*shape)
    with pytest.raises(ValueError, match=needle):
        ops.kda_decode_fused_bf16(**operands, **_FUSED_SCALARS, slots=slots)
    assert not launches


def test_programmatic_launch_marshals_the_launch_config_and_arguments():
    """cuLaunchKernelEx gets the grid, block, stream, one programmatic-serialization attribute
    and a pointer per argument (device arrays as their data pointers), laid out as cuda.h."""
    import ctypes
    from types import SimpleNamespace

    from glm_kda.gpu import build as kernels

    assert ctypes.sizeof(kernels._LaunchAttribute) == 72 and ctypes.sizeof(kernels._LaunchConfig) == 56
    seen = {}

    def fake_launch_ex(config_ref, handle, params, extra):
        config = ctypes.cast(config_ref, ctypes.POINTER(kernels._LaunchConfig)).contents
        seen["grid"] = (config.grid_x, config.grid_y, config.grid_z)
        seen["block"] = (config.block_x, config.block_y, config.block_z)
        seen["stream"], seen["shared"] = config.stream, config.shared_mem
        seen["attribute"] = (config.num_attrs, config.attrs[0].id, config.attrs[0].value[0])
        seen["handle"] = handle
        seen["pointer"] = ctypes.cast(params[0], ctypes.POINTER(ctypes.c_void_p)).contents.value
        seen["null"] = ctypes.cast(params[1], ctypes.POINTER(ctypes.c_void_p)).contents.value
        seen["int"] = ctypes.cast(params[2], ctypes.POINTER(ctypes.c_int32)).contents.value
        seen["float"] = ctypes.cast(params[3], ctypes.POINTER(ctypes.c_float)).contents.value
        return 0

    launcher = kernels._ProgrammaticLauncher(launch_ex=fake_launch_ex)
    array = HostStandIn(aligned((4,), np.float32))
    function = SimpleNamespace(kernel=SimpleNamespace(ptr=0xF00D))
    result = launcher.launch(function, (7, 2), (256,), (array, None, np.int32(-3), np.float32(0.5)), 0, 0xABC)
    assert result == 0
    assert seen["grid"] == (7, 2, 1) and seen["block"] == (256, 1, 1) and seen["shared"] == 0
    assert seen["stream"] == 0xABC and seen["handle"] == 0xF00D
    assert seen["attribute"] == (1, kernels._PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    assert seen["pointer"] == array.data.ptr and seen["null"] is None
    assert seen["int"] == -3 and seen["float"] == 0.5
    with pytest.raises(TypeError, match="argument 1"):
        kernels.kernel_parameters((array, 3.0))



def test_fused_decode_walks_whole_sequences_of_tokens(launches):
    """tokens > 1: grid (heads, rows / tokens), the sequences checked against the states."""
    heads = 2
    ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, 6), **_FUSED_SCALARS, tokens=6)
    (name, grid, block, args), = launches
    assert grid == (heads, 1) and int(_fused_parameter(args, "tokens")) == 6
    with pytest.raises(ValueError, match="whole sequences"):
        ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, 6), **_FUSED_SCALARS, tokens=4)
    with pytest.raises(ValueError, match="only 1 state"):
        ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, 6), **_FUSED_SCALARS, tokens=3)


def test_a_refused_programmatic_launch_falls_back_to_plain_launches(monkeypatch):
    """cuLaunchKernelEx refusing (an older driver, say) turns that launch and every later one
    into a plain launch of the same kernel with the same arguments."""
    from types import SimpleNamespace

    from glm_kda.gpu import build as kernels

    plain = []
    function = lambda grid, block, args, shared_mem=0: plain.append((grid, block, args))  # noqa: E731
    fake_set = SimpleNamespace(device_id=0, function=lambda name: function, ensure_dynamic_shared=lambda *a: None,
                               prefer_shared_carveout=lambda *a: None)
    monkeypatch.setattr(kernels.KernelSet, "get", classmethod(lambda cls: fake_set))
    tried = []
    launcher = kernels._ProgrammaticLauncher(launch_ex=object(), devices={0: True})
    launcher.launch = lambda *args: tried.append(args) or 801  # CUDA_ERROR_NOT_SUPPORTED
    monkeypatch.setattr(kernels, "_PROGRAMMATIC", launcher)
    monkeypatch.setitem(__import__("sys").modules, "cupy", SimpleNamespace(
        cuda=SimpleNamespace(get_current_stream=lambda: SimpleNamespace(ptr=0))))
    args = (np.int32(1),)
    kernels.launch("k", (2,), (32,), args, programmatic=True)
    kernels.launch("k", (2,), (32,), args, programmatic=True)
    assert len(tried) == 1 and "801" in launcher.unavailable
    assert plain == [((2,), (32,), args), ((2,), (32,), args)]


def test_fused_decode_passes_the_prefetch_distance_and_refuses_a_negative_one(launches):
    heads = 2
    slots = HostStandIn(np.arange(3, dtype=np.int32))
    ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, 3, pool=4), **_FUSED_SCALARS, slots=slots,
                              prefetch_ahead=2)
    (_, _, _, args), = launches
    assert int(_fused_parameter(args, "prefetch_ahead")) == 2
    with pytest.raises(ValueError, match="prefetch_ahead"):
        ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, 3, pool=4), **_FUSED_SCALARS, slots=slots,
                                  prefetch_ahead=-1)
    assert len(launches) == 1
    # States that do not start on 16 bytes get no L2 request (it takes aligned ranges).
    operands = _fused_decode_operands(heads, 3, pool=4)
    shifted = aligned((4 * heads * 128 * 128 + 1,), np.float32)[1:].reshape(4, heads, 128, 128)
    operands["recurrent_state"] = HostStandIn(shifted)
    ops.kda_decode_fused_bf16(**operands, **_FUSED_SCALARS, slots=slots, prefetch_ahead=2)
    assert int(_fused_parameter(launches[-1][3], "prefetch_ahead")) == 0


def test_fused_decode_passes_its_x_tiles_and_refuses_a_short_array(launches):
    """x_tiles (o_norm_out again in the bulk sweep's tile layout) reaches the kernel; an array smaller
    than gemm_rows.x_tiles_size(rows, H*D) is refused, naming what it must be, before any launch."""
    from glm_kda.gpu import projection as gemm_rows

    heads, rows = 2, 3
    size = gemm_rows.x_tiles_size(rows, heads * ops.HEAD_DIM)
    tiles = _bf16(size)
    ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows), **_FUSED_SCALARS, tokens=rows, x_tiles=tiles)
    assert _fused_parameter(launches[-1][3], "x_tiles") is tiles
    with pytest.raises(ValueError, match=f"x_tiles must be a contiguous BF16 array of at least {size} elements"):
        ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows), **_FUSED_SCALARS, tokens=rows,
                                  x_tiles=_bf16(size - 1))
    assert len(launches) == 1


def test_fused_decode_counts_outputs_into_its_words_and_returns_its_blocks(launches):
    """outputs_ready (the words an output projection awaiting the step's outputs polls) reaches the
    kernel; the call returns the blocks launched (the count the words reach); a short array is
    refused before any launch."""
    heads, rows = 2, 3
    counts = HostStandIn(np.zeros(2, np.int32))
    blocks = ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows), **_FUSED_SCALARS, tokens=rows,
                                       outputs_ready=counts)
    assert blocks == heads and launches[-1][1] == (heads, 1)
    assert _fused_parameter(launches[-1][3], "outputs_ready") is counts
    with pytest.raises(ValueError, match="outputs_ready must be a contiguous int32 array of at least 2"):
        ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows), **_FUSED_SCALARS, tokens=rows,
                                  outputs_ready=HostStandIn(np.zeros(1, np.int32)))
    assert len(launches) == 1


def test_pair_and_awaiting_projections_check_their_operands(monkeypatch):
    """gemm_rows_pair_bf16 takes two PackedWeights of one shape with equal strides, and launches the
    pair entry of the [2n, k] plan with the second projection's pointers last; gemm_rows_bf16's ready
    needs a programmatic launch of <= 16 rows of a PackedWeight and a target of at least 1, and
    launches the awaiting entry with the words and the target last. Every refusal comes before a launch."""
    from glm_kda.gpu import projection as gemm_rows

    made = []
    monkeypatch.setattr(build, "launch", lambda name, grid, block, args, shared_mem=0, **options:
                        made.append((name, tuple(grid), tuple(args))))
    monkeypatch.setattr(gemm_rows, "sm_count", lambda device_id: 132)
    monkeypatch.setattr(gemm_rows.cupy.cuda, "Device", lambda: SimpleNamespace(id=0))
    n, k = 64, 128
    import dataclasses

    packed = gemm_rows.pack_weight(np.zeros((n, k), np.uint16))
    w, w2 = (dataclasses.replace(packed, data=HostStandIn(aligned(packed.data.shape))) for _ in range(2))
    x = _bf16(3, 2 * k)
    out, out2 = _bf16(3, n), _bf16(3, n)
    gemm_rows.gemm_rows_pair_bf16(x[:, :k], w, out, x[:, k:], w2, out2)
    name, grid, args = made[-1]
    plan = gemm_rows.launch_plan(2 * n, k, 3, None, 132)
    assert name == plan.kernel.replace("gemm_rows_", "gemm_rows_packed_pair_") and grid == plan.grid
    assert args[-3] is not None and args[-2] is w2.data and args[-1] is out2
    with pytest.raises(ValueError, match="PackedWeight"):
        gemm_rows.gemm_rows_pair_bf16(x[:, :k], w, out, x[:, k:], _bf16(n, k), out2)
    with pytest.raises(ValueError, match="the first's shapes and strides"):
        gemm_rows.gemm_rows_pair_bf16(x[:, :k], w, out, x[:, k:], w2, _bf16(3, n + 8)[:, :n])
    words = HostStandIn(np.zeros(2, np.int32))
    gemm_rows.gemm_rows_bf16(x[:, :k], w, out, programmatic=True, ready=words, ready_target=5)
    name, grid, args = made[-1]
    assert name.startswith("kda_gemm_rows_packed_awaiting_bf16_m1_") and args[-2] is words and int(args[-1]) == 5
    launched = len(made)
    for options, needle in ((dict(programmatic=False, ready_target=5), "programmatic launch"),
                            (dict(programmatic=True, ready_target=0), "ready_target must be >= 1")):
        with pytest.raises(ValueError, match=needle):
            gemm_rows.gemm_rows_bf16(x[:, :k], w, out, ready=words, **options)
    with pytest.raises(ValueError, match="programmatic launch of <= 16 rows of a PackedWeight"):
        gemm_rows.gemm_rows_bf16(x[:, :k], _bf16(n, k), out, programmatic=True, ready=words, ready_target=5)
    with pytest.raises(ValueError, match="ready must be a contiguous int32 array of at least 2"):
        gemm_rows.gemm_rows_bf16(x[:, :k], w, out, programmatic=True, ready=HostStandIn(np.zeros(1, np.int32)),
                                 ready_target=5)
    assert len(made) == launched
    # Without ready, staged takes the packed sweep; the blocks returned are the grid's.
    blocks = gemm_rows.gemm_rows_bf16(x[:, :k], w, out, staged=True)
    name, grid, args = made[-1]
    plan = gemm_rows.launch_plan(n, k, 3, None, 132)
    assert name == plan.kernel.replace("gemm_rows_", "gemm_rows_packed_") and grid == plan.grid
    assert blocks == grid[0] * grid[1]


def test_staged_awaiting_projection_takes_its_entry_where_it_fits(monkeypatch):
    """gemm_rows_bf16(staged=True, ready=...) launches the staged awaiting entry with the words and the
    target last and shared memory for the stage and x's rows, where _staged_plan fits on an sm_90
    device; before sm_90, with x's rows too many for 3 blocks an SM, or on the portable path
    (build.hopper_enabled() False), the awaiting sweep instead."""
    import dataclasses

    from glm_kda.gpu import projection as gemm_rows

    made = []
    monkeypatch.setattr(build, "launch", lambda name, grid, block, args, shared_mem=0, **options:
                        made.append((name, tuple(grid), tuple(args), shared_mem)))
    monkeypatch.setattr(gemm_rows, "sm_count", lambda device_id: 132)
    n, k = 2304, 4096  # the Kimi-Linear output projection: one 64 KB tile a block
    packed = gemm_rows.pack_weight(np.zeros((8, 32), np.uint16))
    w = dataclasses.replace(packed, data=HostStandIn(aligned((n // 8, k // 32, 256))), n=n, k=k)
    words = HostStandIn(np.zeros(2, np.int32))
    for capability, rows, expected in (("90", 1, "kda_gemm_rows_staged_awaiting_bf16_m1_n1"),
                                       ("90", 2, "kda_gemm_rows_packed_awaiting_bf16_m1_n2"),
                                       ("80", 1, "kda_gemm_rows_packed_awaiting_bf16_m1_n2")):
        monkeypatch.setattr(gemm_rows.cupy.cuda, "Device",
                            lambda: SimpleNamespace(id=0, compute_capability=capability))
        gemm_rows.gemm_rows_bf16(_bf16(rows, k), w, _bf16(rows, n), programmatic=True, staged=True, ready=words,
                                 ready_target=7)
        name, grid, args, shared_mem = made[-1]
        assert name == expected, f"sm_{capability} R{rows}: {name}"
        assert args[-2] is words and int(args[-1]) == 7, f"sm_{capability} R{rows}: the words and the target last"
        if "staged" in name:
            assert grid == (288, 1) and shared_mem == 65536 + 16 + rows * k * 2, (grid, shared_mem)
    monkeypatch.setattr(gemm_rows.cupy.cuda, "Device", lambda: SimpleNamespace(id=0, compute_capability="90"))
    with build.launching(build.LaunchContext(hopper=False)):
        assert not gemm_rows.staged_applies(w, 1)
        gemm_rows.gemm_rows_bf16(_bf16(1, k), w, _bf16(1, n), programmatic=True, staged=True, ready=words,
                                 ready_target=7)
    assert made[-1][0] == "kda_gemm_rows_packed_awaiting_bf16_m1_n2" and gemm_rows.staged_applies(w, 1)


def test_the_portable_path_has_no_bulk_sweep(monkeypatch):
    """bulk_available is False where the launches may not use sm_90 features (without building a
    kernel set): more than 16 rows of a tile-layout weight then take the split-k sweep, and bulk=True
    is refused."""
    from glm_kda.gpu import projection as gemm_rows

    monkeypatch.setattr(build.KernelSet, "get", classmethod(lambda cls: pytest.fail("a kernel set was built")))
    w = gemm_rows.pack_weight(np.zeros((64, 32), np.uint16), tiles=True)
    with build.launching(build.LaunchContext(hopper=False)):
        assert not gemm_rows.bulk_available() and not gemm_rows.bulk_takes(64)
        assert not gemm_rows.bulk_applies(w, 40)
        with pytest.raises(ValueError, match="bulk=True needs"):
            gemm_rows.bulk_applies(w, 40, True)



def test_sums_launch_their_entries_with_the_sums_last(monkeypatch):
    """gemm_rows_bf16(sums=...) launches the sums twin of the entry it would take without them (the
    split-k sweep, its awaiting form, the staged awaiting entry), every name one the module builds,
    with the sums and their row stride after the words; bulk=True or FP32 sums of the wrong shape are
    refused before any launch."""
    import dataclasses

    from glm_kda.gpu import projection as gemm_rows

    made = []
    monkeypatch.setattr(build, "launch", lambda name, grid, block, args, shared_mem=0, **options:
                        made.append((name, tuple(grid), tuple(args))))
    monkeypatch.setattr(gemm_rows, "sm_count", lambda device_id: 132)
    monkeypatch.setattr(gemm_rows.cupy.cuda, "Device", lambda: SimpleNamespace(id=0, compute_capability="90"))
    entries = {name for stem, names in build.ENTRY_POINTS.items() if stem.startswith("projection/") for name in names}
    words = HostStandIn(np.zeros(2, np.int32))
    n, k = 2304, 4096  # the Kimi-Linear output projection
    packed = gemm_rows.pack_weight(np.zeros((8, 32), np.uint16))
    w = dataclasses.replace(packed, data=HostStandIn(aligned((n // 8, k // 32, 256))), n=n, k=k)
    sums = HostStandIn(aligned((40, n + 64), np.float32))
    for rows, options, form in ((3, {}, "kda_gemm_rows_packed_sums_bf16_m1_"),
                                (40, {}, "kda_gemm_rows_packed_sums_bf16_m"),
                                (2, dict(programmatic=True, ready=words, ready_target=7),
                                 "kda_gemm_rows_packed_awaiting_sums_bf16_m1_"),
                                (1, dict(programmatic=True, ready=words, ready_target=7, staged=True),
                                 "kda_gemm_rows_staged_awaiting_sums_bf16_m1_n1")):
        gemm_rows.gemm_rows_bf16(_bf16(rows, k), w, _bf16(rows, n), sums=sums[:rows, :n], **options)
        name, grid, args = made[-1]
        assert name.startswith(form) and name in entries, f"R{rows} {options}: {name}"
        assert args[-2] is not None and args[-2].shape == (rows, n) and int(args[-1]) == n + 64, \
            f"R{rows}: the sums and their row stride last"
        if "ready" in options:
            assert args[-4] is words and int(args[-3]) == 7, f"R{rows}: the words before the sums"
        made.pop()
        gemm_rows.gemm_rows_bf16(_bf16(rows, k), w, _bf16(rows, n), **options)
        plain_name, plain_grid, _ = made.pop()
        assert plain_name == name.replace("sums_", ""), f"R{rows}: the sums twin of the entry it would take"
        assert plain_grid == grid, f"R{rows}: the plain launch's grid {plain_grid} against the sums' {grid}"
    launched = len(made)
    with pytest.raises(ValueError, match="not bulk=True"):
        gemm_rows.gemm_rows_bf16(_bf16(3, k), w, _bf16(3, n), sums=sums[:3, :n], bulk=True)
    with pytest.raises((TypeError, ValueError), match="sums"):
        gemm_rows.gemm_rows_bf16(_bf16(3, k), w, _bf16(3, n), sums=_bf16(3, n))
    with pytest.raises((TypeError, ValueError), match="sums"):
        gemm_rows.gemm_rows_bf16(_bf16(3, k), w, _bf16(3, n), sums=sums[:2, :n])
    assert len(made) == launched


def test_fused_decode_passes_where_its_dependents_launch(launches):
    heads = 2
    slots = HostStandIn(np.arange(3, dtype=np.int32))
    for where in (0, 1, 2):
        ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, 3, pool=4), **_FUSED_SCALARS, slots=slots,
                                  dependents_after=where)
        assert int(_fused_parameter(launches[-1][3], "dependents_after")) == where
    for where in (3, -1):
        with pytest.raises(ValueError, match=f"dependents_after must be 0, 1 or 2, got {where}"):
            ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, 3, pool=4), **_FUSED_SCALARS, slots=slots,
                                      dependents_after=where)
    assert len(launches) == 3


@pytest.mark.parametrize("rows,reserved,expected", [(1, 64, 200), (16, 64, 200), (17, 64, 768), (1, 0, 264),
                                                    (1, 300, 1)])
def test_one_m_tile_launch_leaves_reserved_slots(rows, reserved, expected):
    """A launch of one m-tile (<= 16 rows) takes the resident slots less reserved_slots (at least
    one block); wider launches keep their planned grid (GLM's q|k|v: 768 column groups)."""
    from glm_kda.gpu import projection as gemm_rows

    plan = gemm_rows.launch_plan(24576, 4096, rows, sm_count=132, reserved_slots=reserved)
    assert plan.grid[0] == expected
    with pytest.raises(ValueError, match="reserved_slots"):
        gemm_rows.launch_plan(24576, 4096, rows, sm_count=132, reserved_slots=-1)


@pytest.mark.parametrize("n,k,expected", [(4096, 8192, 0), (2304, 4096, 16), (8192, 128, 16), (24576, 4096, 0)],
                         ids=["glm_o_proj", "kimi_o_proj", "glm_f_b", "glm_qkv"])
def test_programmatic_l2_request_only_for_weights_up_to_the_limit(n, k, expected):
    from glm_kda.gpu import projection as gemm_rows

    assert gemm_rows._prefetch_k_blocks(n, k, True) == expected
    assert gemm_rows._prefetch_k_blocks(n, k, False) == 0
