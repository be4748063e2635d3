"""The launch wrappers' operand checks and stride arithmetic, without a GPU: a stand-in for
cupy.ndarray wraps NumPy arrays (same shape, strides, flags and a data pointer)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from glm_kda.gpu import ops
from standins import HostStandIn, aligned


@pytest.fixture(autouse=True)
def stand_in(monkeypatch):
    monkeypatch.setattr(ops, "cupy", SimpleNamespace(ndarray=HostStandIn))


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
    assert ops.projection_args("gemv_bf16", x, w_small, wide_out[:, 64:128], None, 16)[4] == 3 * 64


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
        ops.projection_args("gemv_bf16", HostStandIn(x), HostStandIn(w), HostStandIn(out), rows, 16)


def test_slot_checks():
    pool = HostStandIn(aligned((8, 96, 4), np.float32))
    ops._slot_rows("conv_state", pool, (96, 4), 8, None)
    with pytest.raises(ValueError, match="only 1 state"):
        ops._slot_rows("conv_state", HostStandIn(aligned((96, 4), np.float32)), (96, 4), 2, None)
    with pytest.raises(ValueError, match="int32"):
        ops._slot_rows("conv_state", pool, (96, 4), 3, HostStandIn(np.zeros(3, np.int64)))


@pytest.fixture
def launches(monkeypatch):
    """Every kernels.launch the wrappers make, as (name, grid, block, args), instead of running."""
    made = []
    monkeypatch.setattr(ops.kernels, "launch", lambda name, grid, block, args, shared_mem=0, **options:
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
    ops.conv_prefill_silu_l2_bf16(_f32(conv_dim, kernel), _bf16(tokens, conv_dim), _bf16(conv_dim, kernel),
                                  _bf16(tokens, conv_dim), _f32(tokens, heads, dim), _f32(tokens, heads, dim),
                                  _f32(tokens, heads, dim), heads, dim, 1e-6, tokens=tokens)
    (name, grid, block, args), = launches
    assert name == "conv_prefill_silu_l2_bf16"
    # One warp per head of q, k or v: 4 heads per block of 128 threads.
    assert grid == (-(-3 * heads // 4), -(-tokens // ops.CONV_PREFILL_TILE)) and block == (ops.HEAD_BLOCK,)
    assert int(args[-2]) == tokens


def test_prefill_conv_names_a_short_output(launches):
    heads, dim = 2, ops.HEAD_DIM
    conv_dim = 3 * heads * dim
    with pytest.raises(ValueError, match="key"):
        ops.conv_prefill_silu_l2_bf16(_f32(conv_dim, 4), _bf16(10, conv_dim), _bf16(conv_dim, 4), _bf16(10, conv_dim),
                                      _f32(10, heads, dim), _f32(9, heads, dim), _f32(10, heads, dim), heads, dim, 1e-6,
                                      tokens=10)
    assert not launches


@pytest.mark.parametrize("tokens", [1, 7, 8, 9, ops.MAX_GRID_Y + 5], ids=lambda t: f"T{t}")
def test_gate_and_norm_walk_token_groups(launches, tokens):
    """grid.y = ceil(T / tokens per block) per slice of at most MAX_GRID_Y tokens; each launch
    is told its slice's token count (the kernels stop there)."""
    heads, dim = 1, ops.HEAD_DIM
    qkv = heads * dim
    ops.gate_beta_f32(_bf16(tokens, qkv), _f32(qkv), _f32(heads), _bf16(tokens, 2 * dim + heads)[:, 2 * dim:],
                      _f32(tokens, heads, dim), _f32(tokens, heads), heads, dim, True, -5.0, tokens=tokens)
    ops.gated_rmsnorm_sigmoid_bf16(_f32(tokens, heads, dim), _bf16(tokens, qkv), _bf16(dim), _bf16(tokens, qkv),
                                   heads, dim, 1e-5, tokens=tokens)
    slices = [min(ops.MAX_GRID_Y, tokens - start) for start in range(0, tokens, ops.MAX_GRID_Y)]
    for kernel, per_block in (("gate_beta_f32", ops.GATE_TOKENS_PER_BLOCK),
                              ("gated_rmsnorm_sigmoid_bf16", ops.TOKENS_PER_BLOCK)):
        made = [launch for launch in launches if launch[0] == kernel]
        assert [launch[1] for launch in made] == [(heads, -(-count // per_block)) for count in slices]
        assert [int(launch[3][-1]) for launch in made] == slices


def test_token_group_constants_match_the_kernel_sources():
    import re

    from glm_kda.gpu import build as kernels

    def define(stem, name):
        match = re.search(rf"#define {name} (\d+)", (kernels.kernels_dir() / stem).read_text())
        assert match, f"{stem} no longer defines {name}"
        return int(match.group(1))

    assert ops.GATE_TOKENS_PER_BLOCK == define("gate.cu", "GATE_TOKENS_PER_BLOCK")
    assert ops.GATE_THREADS == define("gate.cu", "GATE_THREADS")
    assert ops.TOKENS_PER_BLOCK == define("kda_common.cuh", "KDA_TOKENS_PER_BLOCK")


def test_gate_refuses_another_head_dim(launches):
    with pytest.raises(ValueError, match="head_dim = 64"):
        ops.gate_beta_f32(_bf16(4, 128), _f32(128), _f32(2), _bf16(4, 130)[:, 128:], _f32(4, 2, 64), _f32(4, 2), 2, 64,
                          True, -5.0, tokens=4)
    assert not launches


def _fused_decode_operands(heads: int, rows: int, kernel: int = 4, pool: int | None = None):
    dim = ops.HEAD_DIM
    qkv = heads * dim
    lead = () if pool is None else (pool,)
    return dict(
        conv_state=_f32(*lead, 3 * qkv, kernel), state=_f32(*lead, heads, dim, dim),
        qkv_proj=_bf16(rows, 3 * qkv), conv_w=_bf16(3 * qkv, kernel), forget_proj=_bf16(rows, qkv),
        dt_bias=_f32(qkv), a_log=_f32(heads), beta_logits=_bf16(rows, 2 * dim + heads)[:, 2 * dim:],
        out_gate=_bf16(rows, qkv), norm_w=_bf16(dim), conv_out=_bf16(rows, 3 * qkv),
        query=_f32(rows, heads, dim), key=_f32(rows, heads, dim), value=_f32(rows, heads, dim),
        gate=_f32(rows, heads, dim), beta=_f32(rows, heads), core=_f32(rows, heads, dim),
        o_norm_out=_bf16(rows, qkv),
    )


_FUSED_SCALARS = dict(bounded=True, lower_bound=-5.0, scale=128**-0.5, l2_eps=1e-6, norm_eps=1e-5)


def _fused_parameter(args, name):
    """The launch argument of the fused step's parameter `name` (decode.cu's KDA_DECODE_FUSED_PARAMETERS)."""
    import re

    from glm_kda.gpu import build as kernels

    source = (kernels.kernels_dir() / "decode.cu").read_text()
    signature = re.search(r"#define KDA_DECODE_FUSED_PARAMETERS(.*?)\n#define", source, re.S).group(1)
    names = [re.findall(r"\w+", parameter)[-1] for parameter in signature.replace("\\", " ").split(",")]
    assert len(names) == len(args), f"{len(args)} arguments for the {len(names)} parameters {names}"
    return args[names.index(name)]


@pytest.mark.parametrize("rows", [1, 3])
def test_fused_decode_grid_and_arguments_match_the_kernel(launches, rows):
    """grid (heads, rows), one block per head, and as many arguments as the kernel declares."""
    import re

    from glm_kda.gpu import build as kernels

    heads = 2
    slots = HostStandIn(np.arange(rows, dtype=np.int32))
    ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows, pool=4), **_FUSED_SCALARS, slots=slots)
    (name, grid, block, args), = launches
    assert name == "kda_decode_fused_bf16" and grid == (heads, rows) and block == (ops.HEAD_BLOCK,)
    source = (kernels.kernels_dir() / "decode.cu").read_text()
    # The entries share one parameter list, a macro.
    assert re.search(r"kda_decode_fused_bf16\(KDA_DECODE_FUSED_PARAMETERS\)", source)
    signature = re.search(r"#define KDA_DECODE_FUSED_PARAMETERS(.*?)\n#define", source, re.S).group(1)
    assert len(args) == signature.count(",") + 1
    assert [int(_fused_parameter(args, name)) for name in ("heads", "kernel_size", "tokens")] == [heads, 4, 1]
    assert [int(_fused_parameter(args, name)) for name in ("prefetch_ahead", "dependents_after")] == [0, 0]
    assert _fused_parameter(args, "x_tiles") is None


@pytest.mark.parametrize("operand,shape,needle", [
    ("out_gate", (3, 200), "out_gate"),
    ("a_log", (5,), "a_log"),
    ("gate", (3, 2, 64), "gate"),
    ("state", (3, 128, 128), "state"),
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
    operands["state"] = HostStandIn(shifted)
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


def test_fused_decode_awaiting_inputs_launches_programmatic_and_checks_its_words(monkeypatch):
    """inputs_ready (the words a step awaiting another stream's q|k|v polls) reaches the kernel and
    makes the launch programmatic; a short or non-int32 array, or dependents at once, is refused
    before any launch. signal_inputs_ready launches one programmatic block of 32 threads on it."""
    made = []
    monkeypatch.setattr(ops.kernels, "launch", lambda name, grid, block, args, shared_mem=0, **options:
                        made.append((name, tuple(grid), tuple(args), options)))
    heads, rows = 2, 3
    ready = HostStandIn(np.zeros(2, np.int32))
    ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows), **_FUSED_SCALARS, tokens=rows,
                              dependents_after=1, inputs_ready=ready)
    (name, grid, args, options), = made
    assert _fused_parameter(args, "inputs_ready") is ready and options.get("programmatic") is True
    assert int(_fused_parameter(args, "inputs_target")) == 1
    # The target a q|k|v launch counting its own blocks sets; at least 1.
    ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows), **_FUSED_SCALARS, tokens=rows,
                              dependents_after=1, inputs_ready=ready, inputs_target=200)
    assert int(_fused_parameter(made.pop()[2], "inputs_target")) == 200
    with pytest.raises(ValueError, match="inputs_target must be >= 1"):
        ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows), **_FUSED_SCALARS, tokens=rows,
                                  dependents_after=1, inputs_ready=ready, inputs_target=0)
    ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows), **_FUSED_SCALARS, tokens=rows)
    assert _fused_parameter(made[-1][2], "inputs_ready") is None and not made[-1][3].get("programmatic")
    for words, needle in ((HostStandIn(np.zeros(1, np.int32)), "at least 2 elements"),
                          (HostStandIn(np.zeros(2, np.uint32)), "int32")):
        with pytest.raises(ValueError, match=needle):
            ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows), **_FUSED_SCALARS, tokens=rows,
                                      dependents_after=1, inputs_ready=words)
        with pytest.raises(ValueError, match=needle):
            ops.signal_inputs_ready(words)
    with pytest.raises(ValueError, match="dependents_after 1, 2 or 3"):
        ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows), **_FUSED_SCALARS, tokens=rows,
                                  inputs_ready=ready)
    assert len(made) == 2
    # Dependents once past the wait for the inputs: with inputs_ready only.
    ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows), **_FUSED_SCALARS, tokens=rows,
                              dependents_after=3, inputs_ready=ready)
    assert int(_fused_parameter(made[-1][2], "dependents_after")) == 3
    with pytest.raises(ValueError, match="dependents_after 3 .* needs inputs_ready"):
        ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows), **_FUSED_SCALARS, tokens=rows,
                                  dependents_after=3)
    assert len(made) == 3
    ops.signal_inputs_ready(ready)
    assert made[-1] == ("kda_signal_inputs_ready", (1,), (ready,), {"programmatic": True})


def test_fused_decode_counts_outputs_into_its_words_and_returns_its_blocks(launches):
    """outputs_ready (the words an output projection awaiting the step's outputs polls) reaches the
    kernel, with dependents at once even beside inputs_ready; the call returns the blocks launched
    (the count the words reach); a short array is refused before any launch."""
    heads, rows = 2, 3
    counts, ready = HostStandIn(np.zeros(2, np.int32)), HostStandIn(np.zeros(2, np.int32))
    blocks = ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, rows), **_FUSED_SCALARS, tokens=rows,
                                       outputs_ready=counts, inputs_ready=ready)
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
    monkeypatch.setattr(gemm_rows.kernels, "launch", lambda name, grid, block, args, shared_mem=0, **options:
                        made.append((name, tuple(grid), tuple(args))))
    monkeypatch.setattr(gemm_rows, "_sm_count", lambda device_id: 132)
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
    assert name.startswith("gemm_rows_packed_awaiting_bf16_m1_") and args[-2] is words and int(args[-1]) == 5
    launched = len(made)
    for options, needle in ((dict(programmatic=False, ready_target=5), "programmatic launch"),
                            (dict(programmatic=True, ready_target=0), "ready_target must be >= 1")):
        with pytest.raises(ValueError, match=needle):
            gemm_rows.gemm_rows_bf16(x[:, :k], w, out, ready=words, **options)
    with pytest.raises(ValueError, match="programmatic launch of <= 16 rows of a PackedWeight"):
        gemm_rows.gemm_rows_bf16(x[:, :k], _bf16(n, k), out, programmatic=True, ready=words, ready_target=5)
    assert len(made) == launched
    # counted: the counting entry of the packed plan, the words last; the blocks returned are the grid's.
    blocks = gemm_rows.gemm_rows_bf16(x[:, :k], w, out, counted=words, staged=True)
    name, grid, args = made[-1]
    plan = gemm_rows.launch_plan(n, k, 3, None, 132)
    assert name == plan.kernel.replace("gemm_rows_", "gemm_rows_packed_counting_") and grid == plan.grid
    assert args[-1] is words and blocks == grid[0] * grid[1]
    launched = len(made)
    for call, needle in ((lambda: gemm_rows.gemm_rows_bf16(x[:, :k], _bf16(n, k), out, counted=words),
                          "counted needs <= 16 rows of a PackedWeight"),
                         (lambda: gemm_rows.gemm_rows_bf16(x[:, :k], w, out, counted=words, programmatic=True,
                                                           ready=words, ready_target=5), "without ready"),
                         (lambda: gemm_rows.gemm_rows_bf16(_bf16(20, k), w, _bf16(20, n), counted=words),
                          "rows: 20"),
                         (lambda: gemm_rows.gemm_rows_bf16(x[:, :k], w, out,
                                                           counted=HostStandIn(np.zeros(1, np.int32))),
                          "counted must be a contiguous int32 array of at least 2")):
        with pytest.raises(ValueError, match=needle):
            call()
    assert len(made) == launched


def test_staged_awaiting_projection_takes_its_entry_where_it_fits(monkeypatch):
    """gemm_rows_bf16(staged=True, ready=...) launches the staged entry's awaiting form with the words
    and the target last and shared memory for the stage and x's rows, where staged_plan(awaiting=True)
    fits on an sm_90 device; before sm_90, or with x's rows too many for 3 blocks an SM, the awaiting
    sweep instead."""
    import dataclasses

    from glm_kda.gpu import projection as gemm_rows

    made = []
    monkeypatch.setattr(gemm_rows.kernels, "launch", lambda name, grid, block, args, shared_mem=0, **options:
                        made.append((name, tuple(grid), tuple(args), shared_mem)))
    monkeypatch.setattr(gemm_rows, "_sm_count", lambda device_id: 132)
    n, k = 2304, 4096  # the Kimi-Linear output projection: one 64 KB tile a block
    packed = gemm_rows.pack_weight(np.zeros((8, 32), np.uint16))
    w = dataclasses.replace(packed, data=HostStandIn(aligned((n // 8, k // 32, 256))), n=n, k=k)
    words = HostStandIn(np.zeros(2, np.int32))
    for capability, rows, expected in (("90", 1, "gemm_rows_staged_awaiting_bf16_m1_n1"),
                                       ("90", 2, "gemm_rows_packed_awaiting_bf16_m1_n2"),
                                       ("80", 1, "gemm_rows_packed_awaiting_bf16_m1_n2")):
        monkeypatch.setattr(gemm_rows.cupy.cuda, "Device",
                            lambda: SimpleNamespace(id=0, compute_capability=capability))
        gemm_rows.gemm_rows_bf16(_bf16(rows, k), w, _bf16(rows, n), programmatic=True, staged=True, ready=words,
                                 ready_target=7)
        name, grid, args, shared_mem = made[-1]
        assert name == expected, f"sm_{capability} R{rows}: {name}"
        assert args[-2] is words and int(args[-1]) == 7, f"sm_{capability} R{rows}: the words and the target last"
        if "staged" in name:
            assert grid == (288, 1) and shared_mem == 65536 + 16 + rows * k * 2, (grid, shared_mem)



def test_sums_launch_their_entries_with_the_sums_last(monkeypatch):
    """gemm_rows_bf16(sums=...) launches the sums twin of the entry it would take without them (the
    split-k sweep, its awaiting form, the staged awaiting entry), every name one the module builds,
    with the sums and their row stride after the words; the serial sweep gives way to the split-k
    sweep, and counted, bulk=True or FP32 sums of the wrong shape are refused before any launch."""
    import dataclasses

    from glm_kda.gpu import projection as gemm_rows
    from glm_kda.gpu import build as kernels

    made = []
    monkeypatch.setattr(gemm_rows.kernels, "launch", lambda name, grid, block, args, shared_mem=0, **options:
                        made.append((name, tuple(grid), tuple(args))))
    monkeypatch.setattr(gemm_rows, "_sm_count", lambda device_id: 132)
    monkeypatch.setattr(gemm_rows.cupy.cuda, "Device", lambda: SimpleNamespace(id=0, compute_capability="90"))
    entries = set(kernels.ENTRY_POINTS["gemm_rows"])
    words = HostStandIn(np.zeros(2, np.int32))
    n, k = 2304, 4096  # the Kimi-Linear output projection
    packed = gemm_rows.pack_weight(np.zeros((8, 32), np.uint16))
    w = dataclasses.replace(packed, data=HostStandIn(aligned((n // 8, k // 32, 256))), n=n, k=k)
    sums = HostStandIn(aligned((40, n + 64), np.float32))
    for rows, options, form in ((3, {}, "gemm_rows_packed_sums_bf16_m1_"),
                                (40, {}, "gemm_rows_packed_sums_bf16_m"),
                                (2, dict(programmatic=True, ready=words, ready_target=7),
                                 "gemm_rows_packed_awaiting_sums_bf16_m1_"),
                                (1, dict(programmatic=True, ready=words, ready_target=7, staged=True),
                                 "gemm_rows_staged_awaiting_sums_bf16_m1_n1")):
        gemm_rows.gemm_rows_bf16(_bf16(rows, k), w, _bf16(rows, n), sums=sums[:rows, :n], **options)
        name, grid, args = made[-1]
        assert name.startswith(form) and name in entries, f"R{rows} {options}: {name}"
        assert args[-2] is not None and args[-2].shape == (rows, n) and int(args[-1]) == n + 64, \
            f"R{rows}: the sums and their row stride last"
        if "ready" in options:
            assert args[-4] is words and int(args[-3]) == 7, f"R{rows}: the words before the sums"
        without = made.pop()
        gemm_rows.gemm_rows_bf16(_bf16(rows, k), w, _bf16(rows, n), **options)
        assert made.pop()[0] == name.replace("sums_", ""), f"R{rows}: the sums twin of the entry it would take"
        assert without[1] == grid
    launched = len(made)
    for options, needle in ((dict(counted=words), "without counted or bulk=True"),
                            (dict(bulk=True), "without counted or bulk=True")):
        with pytest.raises(ValueError, match=needle):
            gemm_rows.gemm_rows_bf16(_bf16(3, k), w, _bf16(3, n), sums=sums[:3, :n], **options)
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
    with pytest.raises(ValueError, match="dependents_after must be 0, 1, 2 or 3, got 4"):
        ops.kda_decode_fused_bf16(**_fused_decode_operands(heads, 3, pool=4), **_FUSED_SCALARS, slots=slots,
                                  dependents_after=4)
    assert len(launches) == 3


@pytest.mark.parametrize("heads,waves,expected", [(64, 0.25, 1), (32, 0.25, 2), (32, 0.125, 1), (64, 0.5, 2),
                                                  (4, 0.25, 16), (64, 0.0, 0)])
def test_batched_step_prefetch_distance(monkeypatch, heads, waves, expected):
    """layer.STEP_PREFETCH_WAVES in sequences: waves x (132 SMs x 2 resident blocks) / heads,
    rounded, at least one sequence unless switched off."""
    from glm_kda.gpu import projection as gemm_rows
    from glm_kda.gpu import layer

    monkeypatch.setattr(gemm_rows, "_sm_count", lambda device_id: 132)
    monkeypatch.setattr(layer, "STEP_PREFETCH_WAVES", waves)
    fake = SimpleNamespace(config=SimpleNamespace(heads=heads), qkv_weight=SimpleNamespace(device=SimpleNamespace(id=0)))
    assert layer.KdaLayer._step_prefetch_ahead(fake) == expected


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


def test_qkv_projection_leaves_slots_to_the_side_chain(monkeypatch):
    """The decode front end passes QKV_RESERVED_SLOTS to the q|k|v projection's launch, and to
    that launch only (a wide prefill's projections run on cuBLAS, which takes no grid)."""
    import contextlib

    from glm_kda.gpu import layer

    monkeypatch.setattr(layer, "QKV_RESERVED_SLOTS", 40)
    monkeypatch.setattr(layer, "GATE_BRANCH_MIN_ROWS", 16)
    calls, forks = [], []
    gate_tiles = object()

    def beside(concurrent, branch=0):
        forks.append((branch, concurrent))
        return contextlib.nullcontext(contextlib.nullcontext())

    fake = SimpleNamespace(
        config=SimpleNamespace(head_dim=4),
        workspace=SimpleNamespace(x_tiles_gate=gate_tiles, **{name: np.zeros((20, 12)) for name in
                                                              ("qkv_proj", "down_proj", "forget_proj", "out_gate")}),
        _beside=beside,
        _project=lambda x, weight, out, wide, after_kernel=False, reserved_slots=0, x_tiles=None: calls.append(
            (weight, reserved_slots, x_tiles is gate_tiles)),
        gate_beta=lambda rows: calls.append(("gate_beta", 0, False)),
        _gate_up_pair=lambda rows, wide, branched: False,
    )
    fake._low_rank_chain = lambda *args: layer.KdaLayer._low_rank_chain(fake, *args)
    layer.KdaLayer.front_end(fake, np.zeros((3, 8)), gate=False)
    assert sorted(calls) == [("down_weight", 0, False), ("f_b", 0, False), ("g_b", 0, False), ("qkv_weight", 40, False)]
    # Above GATE_BRANCH_MIN_ROWS rows g_b forks onto branch 1 with its own tile scratch.
    assert forks == [(0, True), (1, False)]
    calls.clear(), forks.clear()
    layer.KdaLayer.front_end(fake, np.zeros((20, 8)), gate=False)
    assert sorted(calls) == [("down_weight", 0, False), ("f_b", 0, False), ("g_b", 0, True), ("qkv_weight", 40, False)]
    assert forks == [(0, True), (1, True)]
    # f_b and g_b as one launch (layer.GATE_UP_PAIR): down_proj's two column ranges into their outputs.
    calls.clear(), forks.clear()
    pairs = []
    monkeypatch.setattr(layer.gemm_rows, "gemm_rows_pair_bf16", lambda *args, **options: pairs.append(
        (args[0].shape, args[1], args[4], args[3].shape, options)))
    fake._gate_up_pair = lambda rows, wide, branched: True
    fake.decode_weight = lambda name: name
    layer.KdaLayer.front_end(fake, np.zeros((3, 8)), gate=False)
    assert sorted(calls) == [("down_weight", 0, False), ("qkv_weight", 40, False)]
    assert pairs == [((3, 4), "f_b", "g_b", (3, 4), {"programmatic": layer.SIDE_CHAIN_PROGRAMMATIC})]


def test_one_row_awaiting_step_leaves_a_slot_per_head_and_one_more(monkeypatch):
    """A one-row decode with the step awaiting q|k|v (layer.STEP_AWAITS_PROJECTION) projects q|k|v
    on the current stream leaving at least heads + 1 block slots, signals after it, and runs the
    low-rank chain (without the gate launch), the step with the workspace's words and o_proj on the
    side stream; the words go back to zero when a launch fails."""
    import contextlib

    from glm_kda.gpu import layer

    monkeypatch.setattr(layer, "QKV_RESERVED_SLOTS", 40)
    events = []
    side = contextlib.nullcontext()

    @contextlib.contextmanager
    def beside(concurrent, branch=0):
        events.append(("fork", branch, concurrent))
        yield side
        events.append(("join", branch, concurrent))

    words = SimpleNamespace(fill=lambda value: events.append(("words", value)))
    counts = SimpleNamespace(fill=lambda value: events.append(("counts", value)))
    monkeypatch.setattr(layer.gemm_rows, "gemm_rows_pair_bf16", lambda *args, **options: events.append(
        ("pair", args[1], args[4])))
    monkeypatch.setattr(layer.ops, "signal_inputs_ready", lambda ready: events.append(("signal", ready is words)))
    fake = SimpleNamespace(
        config=SimpleNamespace(head_dim=4, heads=64),
        workspace=SimpleNamespace(inputs_ready=words, outputs_ready=counts, **{
            name: np.zeros((20, 12)) for name in ("qkv_proj", "down_proj", "forget_proj", "out_gate")}),
        _beside=beside,
        _project=lambda x, weight, out, wide, after_kernel=False, reserved_slots=0, x_tiles=None, counted=None: (
            events.append(("project", weight, reserved_slots) + ((counted is words,) if counted else ())), 200)[1],
        gate_beta=lambda rows: events.append(("gate_beta",)),
        stateful_rows=lambda first, rows, conv, rec, slots=None, inputs_ready=None, whole=False, inputs_target=1:
        events.append(("step", rows, inputs_ready is words, whole, inputs_target)),
        back_end=lambda rows, norm=True: events.append(("back_end", rows, norm)),
        decode_weight=lambda name: name,
        _gate_up_pair=lambda rows, wide, branched: pair,
    )
    fake._low_rank_chain = lambda *args, **options: layer.KdaLayer._low_rank_chain(fake, *args, **options)
    fake._words_cleared_on_error = lambda *names: layer.KdaLayer._words_cleared_on_error(fake, *names)
    pair = False
    layer.KdaLayer._decode_awaiting_projection(fake, np.zeros((1, 8)), None, None, None)
    assert events == [("fork", 0, True), ("project", "qkv_weight", 65), ("signal", True),
                      ("project", "down_weight", 0), ("fork", 1, False), ("project", "f_b", 0), ("project", "g_b", 0),
                      ("join", 1, False), ("step", 1, True, True, 1), ("back_end", 1, False), ("join", 0, True)]
    events.clear()
    pair = True
    layer.KdaLayer._decode_awaiting_projection(fake, np.zeros((1, 8)), None, None, None)
    assert events == [("fork", 0, True), ("project", "qkv_weight", 65), ("signal", True),
                      ("project", "down_weight", 0), ("pair", "f_b", "g_b"), ("step", 1, True, True, 1),
                      ("back_end", 1, False), ("join", 0, True)]
    events.clear()
    # A packed q|k|v weight counts its blocks' outputs into the words itself (QKV_COUNTS_INPUTS): no
    # signal, and the step awaits the blocks that launch returned.
    monkeypatch.setattr(layer.gemm_rows, "PackedWeight", str)
    layer.KdaLayer._decode_awaiting_projection(fake, np.zeros((1, 8)), None, None, None)
    assert events == [("fork", 0, True), ("project", "qkv_weight", 65, True), ("project", "down_weight", 0),
                      ("pair", "f_b", "g_b"), ("step", 1, True, True, 200), ("back_end", 1, False),
                      ("join", 0, True)]
    events.clear()
    monkeypatch.setattr(layer, "QKV_COUNTS_INPUTS", False)
    layer.KdaLayer._decode_awaiting_projection(fake, np.zeros((1, 8)), None, None, None)
    assert events[1:3] == [("project", "qkv_weight", 65), ("signal", True)] and events[5] == ("step", 1, True, True, 1)
    events.clear()
    fake.stateful_rows = lambda *args, **options: (_ for _ in ()).throw(ValueError("bad state"))
    monkeypatch.setitem(__import__("sys").modules, "cupy", SimpleNamespace(
        cuda=SimpleNamespace(get_current_stream=lambda: SimpleNamespace(is_capturing=lambda: False))))
    with pytest.raises(ValueError, match="bad state"):
        layer.KdaLayer._decode_awaiting_projection(fake, np.zeros((1, 8)), None, None, None)
    assert events[-2:] == [("words", 0), ("counts", 0)]


@pytest.mark.parametrize("n,k,expected", [(4096, 8192, 0), (2304, 4096, 16), (8192, 128, 16), (24576, 4096, 0)],
                         ids=["glm_o_proj", "kimi_o_proj", "glm_f_b", "glm_qkv"])
def test_programmatic_l2_request_only_for_weights_up_to_the_limit(monkeypatch, n, k, expected):
    from glm_kda.gpu import projection as gemm_rows

    assert gemm_rows.prefetch_k_blocks(n, k) == expected
    monkeypatch.setattr(gemm_rows, "PREFETCH_MAX_WEIGHT_BYTES", None)
    assert gemm_rows.prefetch_k_blocks(n, k) == gemm_rows.PREFETCH_K_BLOCKS


def test_persistent_decode_arguments_match_the_kernel(monkeypatch):
    """One launch: one block per SM, 256 threads, o_proj's x over one k range in shared memory,
    as many arguments as the kernel declares, the scalars where the kernel expects them; a bad
    hidden is refused before any launch."""
    import re
    import types

    from glm_kda.gpu import build as kernels
    from glm_kda.config import KdaConfig

    config = KdaConfig(hidden=2304, heads=32, head_dim=128, conv_kernel=4, gate_law="bounded", gate_lower_bound=-5.0,
                       rms_norm_eps=1e-5)
    made = []
    monkeypatch.setattr(persistent, "buffers", lambda ws, schedule: (
        HostStandIn(schedule.tasks), HostStandIn(np.zeros(schedule.counter_count, np.int32)), _f32(8, 16, 2304)))
    monkeypatch.setattr(persistent, "_resident_blocks", lambda: 132)
    monkeypatch.setattr(kernels, "launch", lambda name, grid, block, args, shared_mem=0, **options:
                        made.append((name, grid, block, args, shared_mem)))
    ws = types.SimpleNamespace(config=config, **{name: None for name in (
        "down_proj", "qkv_proj", "forget_proj", "out_gate", "final_out", "conv_out", "query", "key", "value", "gate",
        "beta", "core", "o_norm_out")})
    layer = types.SimpleNamespace(workspace=ws, config=config, scale=128**-0.5, **{name: None for name in (
        "down_weight", "qkv_weight", "f_b", "g_b", "o_proj", "conv_weight", "dt_bias", "a_log", "o_norm")})
    persistent.launch(layer, _bf16(3, 2304), None, None)
    (name, grid, block, args, shared), = made
    schedule = persistent.build_schedule(2304, 32, persistent.STEP_LAG_PAIRS, persistent.OUT_LAG_PAIRS)
    assert name == "kda_decode_persistent_bf16" and grid == (132,) and block == (persistent.THREADS,)
    assert shared == 2 * 3 * schedule.out_range_k
    source = (kernels.kernels_dir() / "decode_persistent.cu").read_text()
    signature = re.search(r"kda_decode_persistent_bf16\(([^)]*)\)", source).group(1)
    assert len(args) == signature.count(",") + 1
    assert (int(args[1]), int(args[3]), int(args[4])) == (schedule.counter_count, len(schedule.tasks), 3)
    assert (int(args[-8]), int(args[-7]), int(args[-6])) == (32, 4, 1)  # heads, kernel_size, bounded
    assert float(args[-5]) == -5.0 and args[-1] is None  # lower_bound, no trace
    with pytest.raises(ValueError, match="hidden"):
        persistent.launch(layer, _bf16(3, 2300), None, None)
    with pytest.raises(ValueError, match="1..16 rows"):
        persistent.launch(layer, _bf16(17, 2304), None, None)
    assert len(made) == 1
