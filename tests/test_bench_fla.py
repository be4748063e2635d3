"""The flash-linear-attention comparison: its parameter map on the CPU, its agreement on a GPU.

CPU tests need neither torch nor fla: the map is checked against a stand-in that declares what
fla 0.6.0's KimiDeltaAttention declares, and against fla's own source (parsed, never imported)
where an installed fla or a downloaded wheel in .whl/ has it. GPU tests need torch, a CUDA
device and fla; otherwise they are skipped with the reason.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from glm_kda.checkpoint import BoundLayer, bind_layer
from glm_kda.config import GLM_5_3_FLASH, KIMI_LINEAR_48B, KdaConfig
from glm_kda.synthetic import synthetic_config, write_synthetic_checkpoint

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from lib import bench_fla  # noqa: E402  (benchmarks/lib: no part of the package)
from lib.bench_fla import (  # noqa: E402
    FLA_PARAMETERS,
    FlaMappingError,
    assign_parameters,
    fla_layer_kwargs,
    fla_parameter_arrays,
    fla_parameter_shapes,
)
F32_PARAMETERS = {"A_log", "dt_bias"}


# A stand-in for fla 0.6.0's KimiDeltaAttention -------------------------------------------------
class StandInParameter:
    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape
        self.data: np.ndarray | None = None


class StandInKda:
    """Declares the parameters fla 0.6.0's KimiDeltaAttention declares, in its order, with the
    shapes its constructor derives from the same arguments."""

    def __init__(self, hidden_size, expand_v, head_dim, num_heads, num_v_heads, use_short_conv, conv_size,
                 conv_bias, **_):
        key_dim = num_heads * head_dim
        head_v_dim = int(head_dim * expand_v)
        value_dim = num_v_heads * head_v_dim
        gate_dim = num_v_heads * head_dim
        declared = [
            ("q_proj.weight", (key_dim, hidden_size)),
            ("k_proj.weight", (key_dim, hidden_size)),
            ("v_proj.weight", (value_dim, hidden_size)),
        ]
        if use_short_conv:
            for part, width in (("q", key_dim), ("k", key_dim), ("v", value_dim)):
                declared.append((f"{part}_conv1d.weight", (width, 1, conv_size)))
                if conv_bias:
                    declared.append((f"{part}_conv1d.bias", (width,)))
        declared += [
            ("f_proj.0.weight", (head_v_dim, hidden_size)),
            ("f_proj.1.weight", (gate_dim, head_v_dim)),
            ("b_proj.weight", (num_v_heads, hidden_size)),
            ("A_log", (num_v_heads,)),
            ("dt_bias", (gate_dim,)),
            ("g_proj.0.weight", (head_v_dim, hidden_size)),
            ("g_proj.1.weight", (value_dim, head_v_dim)),
            ("g_proj.1.bias", (value_dim,)),
            ("o_norm.weight", (head_v_dim,)),
            ("o_proj.weight", (hidden_size, value_dim)),
        ]
        self.parameters = {name: StandInParameter(shape) for name, shape in declared}

    def named_parameters(self):
        return list(self.parameters.items())


def _copy(param: StandInParameter, array: np.ndarray) -> None:
    param.data = array


# fla's own source, parsed ------------------------------------------------------------------------
def fla_layer_source() -> tuple[str, str] | None:
    """(where, text) of fla/layers/kda.py from an installed fla (found, not imported) or a
    flash-linear-attention wheel in .whl/; None when neither is here."""
    spec = importlib.util.find_spec("fla")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            path = Path(root) / "layers" / "kda.py"
            if path.is_file():
                return str(path), path.read_text()
    for wheel in sorted((REPO / ".whl").glob("flash_linear_attention-*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            if "fla/layers/kda.py" in archive.namelist():
                return f"{wheel.name}:fla/layers/kda.py", archive.read("fla/layers/kda.py").decode()
    return None


_MODULE_PARAMETERS = {
    # torch / fla module class -> (its parameters, the keyword that adds a bias and its default)
    "Linear": (("weight",), ("bias", True)),
    "ShortConvolution": (("weight",), ("bias", False)),
    "FusedRMSNormGated": (("weight",), None),
}


def _evaluate(node: ast.AST, arguments: dict) -> object:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in arguments:
        return arguments[node.id]
    raise AssertionError(f"cannot evaluate {ast.unparse(node)} from the constructor arguments")


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _module_parameters(prefix: str, call: ast.Call, arguments: dict) -> list[str]:
    name = _call_name(call)
    if name == "Sequential":
        out = []
        for index, item in enumerate(call.args):
            assert isinstance(item, ast.Call), f"{prefix}: Sequential item {ast.unparse(item)} is not a module call"
            out += _module_parameters(f"{prefix}.{index}", item, arguments)
        return out
    if name == "Parameter":
        return [prefix]
    if name not in _MODULE_PARAMETERS:
        raise AssertionError(f"{prefix} = {ast.unparse(call)}: a module kind this test does not know")
    weights, bias = _MODULE_PARAMETERS[name]
    out = [f"{prefix}.{weight}" for weight in weights]
    if bias is not None:
        keyword, default = bias
        value = next((kw.value for kw in call.keywords if kw.arg == keyword), None)
        if (_evaluate(value, arguments) if value is not None else default):
            out.append(f"{prefix}.bias")
    return out


def declared_in_source(source: str, arguments: dict) -> tuple[list[str], list[str], dict]:
    """(parameter names KimiDeltaAttention.__init__ registers for these constructor arguments,
    its named constructor parameters, {keyword: value} of the gated-norm and kernel calls)."""
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "KimiDeltaAttention")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    forward = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    constructor = [a.arg for a in init.args.args[1:]]
    names: list[str] = []
    for node in ast.walk(init):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        for target in node.targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                kind = _call_name(node.value)
                if kind in _MODULE_PARAMETERS or kind in ("Sequential", "Parameter"):
                    for name in _module_parameters(target.attr, node.value, arguments):
                        if name not in names:
                            names.append(name)
                elif isinstance(node.value.func, ast.Attribute) and getattr(node.value.func.value, "id", "") == "nn":
                    raise AssertionError(f"self.{target.attr} = {ast.unparse(node.value)}: unknown nn module")
    keywords: dict = {}
    for node in ast.walk(cls):
        if isinstance(node, ast.Call) and _call_name(node) in ("FusedRMSNormGated", "chunk_kda", "fused_recurrent_kda"):
            for kw in node.keywords:
                if isinstance(kw.value, ast.Constant):
                    keywords.setdefault(_call_name(node), {})[kw.arg] = kw.value.value
    assert forward is not None
    return names, constructor, keywords


# Fixtures -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_bound(tmp_path_factory):
    built = {}

    def get(geometry: str) -> BoundLayer:
        if geometry not in built:
            path = write_synthetic_checkpoint(tmp_path_factory.mktemp(geometry), geometry, num_layers=1)
            built[geometry] = bind_layer(path, 0, progress=False)
        return built[geometry]

    return get


def _config(**changes) -> KdaConfig:
    return KdaConfig(**{**GLM_5_3_FLASH, **changes})


# CPU: the map ----------------------------------------------------------------------------------------
def test_map_names_are_unique_and_shapes_follow_the_geometry():
    names = [p.name for p in FLA_PARAMETERS]
    assert len(names) == len(set(names)) == 16
    glm = fla_parameter_shapes(KdaConfig(**GLM_5_3_FLASH))
    assert list(glm) == names
    assert glm["q_proj.weight"] == (8192, 4096)
    assert glm["q_conv1d.weight"] == glm["v_conv1d.weight"] == (8192, 1, 4)
    assert glm["f_proj.0.weight"] == glm["g_proj.0.weight"] == (128, 4096)
    assert glm["f_proj.1.weight"] == glm["g_proj.1.weight"] == (8192, 128)
    # A_log per HEAD, dt_bias per CHANNEL.
    assert glm["A_log"] == (64,) and glm["dt_bias"] == (8192,)
    assert glm["b_proj.weight"] == (64, 4096) and glm["o_norm.weight"] == (128,)
    assert glm["o_proj.weight"] == (4096, 8192) and glm["g_proj.1.bias"] == (8192,)
    kimi = fla_parameter_shapes(KdaConfig(**KIMI_LINEAR_48B))
    assert kimi["q_proj.weight"] == (4096, 2304) and kimi["A_log"] == (32,) and kimi["o_proj.weight"] == (2304, 4096)


@pytest.mark.parametrize("geometry", ["tiny-glm", "tiny-kimi"])
def test_map_carries_every_checkpoint_tensor(tiny_bound, geometry):
    bound = tiny_bound(geometry)
    arrays = fla_parameter_arrays(bound)
    shapes = fla_parameter_shapes(bound.config)
    assert {name: a.shape for name, a in arrays.items()} == shapes
    for name, array in arrays.items():
        expected = np.float32 if name in F32_PARAMETERS else ml_dtypes.bfloat16
        assert array.dtype == expected, f"{name}: {array.dtype}, expected {np.dtype(expected)}"
    # Every BoundLayer array reaches fla, the conv taps as three thirds in q, k, v order.
    assert {p.field for p in FLA_PARAMETERS if p.field} == set(BoundLayer.ARRAY_FIELDS)
    qkv = bound.config.qkv
    for third, part in enumerate("qkv"):
        taps = arrays[f"{part}_conv1d.weight"]
        assert np.array_equal(taps[:, 0, :].view(np.uint16), bound.conv_weight[third * qkv:(third + 1) * qkv].view(np.uint16))
    for p in FLA_PARAMETERS:
        if p.field and p.third is None:
            source = np.asarray(getattr(bound, p.field)).reshape(shapes[p.name])
            assert arrays[p.name].tobytes() == source.tobytes(), p.name
    assert not np.any(arrays["g_proj.1.bias"].astype(np.float32))


@pytest.mark.parametrize("geometry", ["tiny-glm", "tiny-kimi", "glm", "kimi"])
def test_stand_in_gets_every_parameter(tiny_bound, geometry):
    config = synthetic_config(geometry, 1)
    stand_in = StandInKda(**fla_layer_kwargs(config))
    if geometry.startswith("tiny"):
        arrays = fla_parameter_arrays(tiny_bound(geometry))
    else:
        # Real geometry without writing 100s of MB: arrays of the map's shapes.
        arrays = {name: np.zeros(shape, np.uint8) for name, shape in fla_parameter_shapes(config).items()}
    names = assign_parameters(stand_in.named_parameters(), arrays, _copy)
    assert names == [name for name, _ in stand_in.named_parameters()]
    assert all(param.data is arrays[name] for name, param in stand_in.parameters.items())


def test_unmapped_parameter_is_named_and_nothing_is_copied(tiny_bound):
    bound = tiny_bound("tiny-glm")
    stand_in = StandInKda(**{**fla_layer_kwargs(bound.config), "conv_bias": True})
    with pytest.raises(FlaMappingError, match=r"no source in our weights: q_conv1d\.bias, k_conv1d\.bias, v_conv1d\.bias"):
        assign_parameters(stand_in.named_parameters(), fla_parameter_arrays(bound), _copy)
    assert all(param.data is None for param in stand_in.parameters.values())


def test_unused_and_misshaped_tensors_are_named(tiny_bound):
    bound = tiny_bound("tiny-glm")
    stand_in = StandInKda(**fla_layer_kwargs(bound.config))
    del stand_in.parameters["g_proj.1.bias"]
    arrays = fla_parameter_arrays(bound)
    arrays["A_log"] = np.zeros(bound.config.qkv, np.float32)  # per channel instead of per head
    with pytest.raises(FlaMappingError) as error:
        assign_parameters(stand_in.named_parameters(), arrays, _copy)
    text = str(error.value)
    assert "mapped tensors fla does not declare: g_proj.1.bias" in text
    assert f"A_log: fla declares ({bound.config.heads},), our map gives ({bound.config.qkv},)" in text


# CPU: constructor arguments and gate law --------------------------------------------------------------
def test_layer_kwargs_read_the_config():
    glm = fla_layer_kwargs(_config(hidden=512, heads=4, rms_norm_eps=3e-6, conv_kernel=3))
    assert glm["hidden_size"] == 512 and glm["num_heads"] == glm["num_v_heads"] == 4
    assert glm["head_dim"] == 128 and glm["conv_size"] == 3 and glm["norm_eps"] == 3e-6
    assert glm["lower_bound"] == -5.0 and glm["safe_gate"] is True
    assert glm["expand_v"] == 1 and glm["conv_bias"] is False and glm["allow_neg_eigval"] is False
    kimi = fla_layer_kwargs(KdaConfig(**KIMI_LINEAR_48B))
    assert kimi["lower_bound"] is None and kimi["safe_gate"] is False


@pytest.mark.parametrize("bound, safe", [(-5.0, True), (-1.5, True), (-7.0, False)], ids=["lb-5", "lb-1.5", "lb-7"])
def test_bounded_law_keeps_its_bound_outside_the_safe_gate_range(bound, safe):
    config = _config(gate_lower_bound=bound)
    kwargs = fla_layer_kwargs(config)
    assert kwargs["lower_bound"] == bound and kwargs["safe_gate"] is safe
    description = bench_fla.fla_gate_description(config)
    assert f"lower_bound {bound:g}" in description
    assert ("safe_gate" in description and "general" not in description) if safe else "general chunk path" in description


def test_gate_description_of_the_softplus_law():
    assert bench_fla.fla_gate_description(KdaConfig(**KIMI_LINEAR_48B)) == "softplus (no bound)"


# CPU: fla's own source -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fla_source():
    found = fla_layer_source()
    if found is None:
        pytest.skip("no fla/layers/kda.py here: neither an installed fla nor a flash-linear-attention wheel in .whl/")
    return found


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_map_covers_what_fla_source_declares(fla_source, geometry):
    where, source = fla_source
    kwargs = fla_layer_kwargs(synthetic_config(geometry, 1))
    declared, constructor, _ = declared_in_source(source, kwargs)
    stand_in = [name for name, _ in StandInKda(**kwargs).named_parameters()]
    assert sorted(declared) == sorted(stand_in), f"{where} declares {declared}"
    assert sorted(declared) == sorted(p.name for p in FLA_PARAMETERS)
    # KimiDeltaAttention takes **kwargs: a misspelt argument would be swallowed, so each one
    # we pass must be a named constructor parameter.
    unknown = [key for key in kwargs if key not in constructor]
    assert not unknown, f"{where}: KimiDeltaAttention has no parameter {unknown}"


def test_fla_source_gates_with_sigmoid_and_keeps_the_state_v_first(fla_source):
    where, source = fla_source
    _, _, keywords = declared_in_source(source, fla_layer_kwargs(KdaConfig(**GLM_5_3_FLASH)))
    assert keywords["FusedRMSNormGated"].get("activation") == "sigmoid", where
    for kernel in ("chunk_kda", "fused_recurrent_kda"):
        # check_fla_agrees transposes the cached state from V-first [D_v, D_k] to ours.
        assert keywords[kernel].get("state_v_first") is True, f"{where}: {kernel} state layout"
        assert keywords[kernel].get("use_qk_l2norm_in_kernel") is True, where


# CPU: availability and the runner --------------------------------------------------------------------
def test_fla_available_says_why(monkeypatch):
    ok, why = bench_fla.fla_available()
    assert isinstance(ok, bool) and why
    monkeypatch.setitem(sys.modules, "torch", None)
    ok, why = bench_fla.fla_available()
    assert not ok and why.startswith("torch not importable")


def test_runner_without_fla_prints_one_note(monkeypatch, capsys):
    monkeypatch.setattr(bench_fla, "fla_available", lambda: (False, "no fla here"))
    parser = argparse.ArgumentParser()
    bench_fla.add_arguments(parser)
    assert bench_fla.run(parser.parse_args([])) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(line) for line in lines] == [{"note": "no flash-linear-attention comparison: no fla here"}]


def test_version_parsing():
    assert bench_fla._version_tuple("0.6.0") == (0, 6, 0)
    assert bench_fla._version_tuple("0.6.1.dev3+g12ab") == (0, 6, 1)
    assert bench_fla._version_tuple("0.5") < (0, 6, 0)


# torch + fla without a GPU: the real class against the stand-in ------------------------------------
def _torch_and_fla() -> tuple[bool, str]:
    try:
        import torch  # noqa: F401
        from fla.layers.kda import KimiDeltaAttention  # noqa: F401
    except Exception as exc:
        return False, f"torch and fla not importable ({type(exc).__name__}: {exc})"
    return True, ""


TORCH_FLA_OK, TORCH_FLA_WHY = _torch_and_fla()


@pytest.mark.skipif(not TORCH_FLA_OK, reason=TORCH_FLA_WHY)
@pytest.mark.parametrize("geometry", ["tiny-glm", "tiny-kimi"])
def test_real_layer_on_cpu_matches_the_stand_in(tiny_bound, geometry):
    import torch

    bound = tiny_bound(geometry)
    layer = bench_fla.build_fla_layer(bound, device="cpu")
    kwargs = fla_layer_kwargs(bound.config)
    declared = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert declared == {name: p.shape for name, p in StandInKda(**kwargs).named_parameters()}
    assert layer.lower_bound == kwargs["lower_bound"] and layer.safe_gate == kwargs["safe_gate"]
    for name, array in fla_parameter_arrays(bound).items():
        param = dict(layer.named_parameters())[name]
        expected = torch.float32 if name in F32_PARAMETERS else torch.bfloat16
        assert param.dtype == expected, name
        assert torch.equal(param.float(), bench_fla.to_torch(array, "cpu").float()), name


# GPU + fla: agreement with the oracle and the benchmark rows ------------------------------------------
FLA_OK, FLA_WHY = bench_fla.fla_available()
needs_fla = pytest.mark.skipif(not FLA_OK, reason=f"no fla comparison: {FLA_WHY}")

# fla rounds the delta-rule output (and, on its chunk path, q, k and the chunk intermediates) to
# BF16, where the BF16-faithful oracle keeps FP32: it may sit above that oracle's own error, by
# a small factor. A wrong map or gate law misses by orders of magnitude.
FLA_FACTOR = 4.0
CONV_STATE_BOUND = 1e-2
SEED = 17


def _oracle_xp():
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception:
        return np


@pytest.fixture(scope="module")
def fla_layers(real_checkpoint):
    built = {}

    def get(geometry: str):
        if geometry not in built:
            bound = bind_layer(real_checkpoint(geometry), 0, progress=False)
            built[geometry] = (bound, bench_fla.build_fla_layer(bound))
        return built[geometry]

    return get


def _against_oracle(bound, hidden, out, state, tag, figures):
    from glm_kda.reference import KdaOracle, rms_ratio

    xp = _oracle_xp()
    exact, exact_state = KdaOracle(bound, "float64", xp=xp).prefill(hidden)
    faithful, faithful_state = KdaOracle(bound, "bf16", xp=xp).prefill(hidden)
    rows = {
        "output": (rms_ratio(out, exact["final_out"]), rms_ratio(faithful["final_out"], exact["final_out"])),
        "recurrent_state": (rms_ratio(state.recurrent, exact_state.recurrent),
                            rms_ratio(faithful_state.recurrent, exact_state.recurrent)),
    }
    conv = rms_ratio(state.conv, faithful_state.conv)
    figures.append({"test": tag, "fla_conv_state": conv, **{f"fla_{k}": v[0] for k, v in rows.items()},
                    **{f"oracle_bf16_{k}": v[1] for k, v in rows.items()}})
    for what, (fla, floor) in rows.items():
        assert fla <= FLA_FACTOR * floor, f"{tag} {what}: fla {fla:.3e} vs BF16 oracle {floor:.3e} (bound {FLA_FACTOR}x)"
    assert conv <= CONV_STATE_BOUND, f"{tag} conv state: {conv:.3e} against the BF16 oracle"


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("tokens", [1, 63, 65, 1000], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_fla_prefill_agrees_with_the_oracle(fla_layers, figures, geometry, tokens):
    from glm_kda.synthetic import synthetic_hidden

    bound, layer = fla_layers(geometry)
    hidden = synthetic_hidden(tokens, bound.config.hidden, seed=SEED)
    out, state = bench_fla.check_fla_agrees(bound, hidden, layer=layer)
    assert out.shape == (tokens, bound.config.hidden)
    _against_oracle(bound, hidden, out, state, f"fla-prefill-{geometry}-T{tokens}", figures)


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_fla_decode_steps_agree_with_the_oracle(fla_layers, figures, geometry):
    from glm_kda.synthetic import synthetic_hidden

    bound, layer = fla_layers(geometry)
    hidden = synthetic_hidden(8, bound.config.hidden, seed=SEED)
    out, state, _ = bench_fla.fla_decode_steps(layer, hidden)
    _against_oracle(bound, hidden, out, state, f"fla-decode-{geometry}-8steps", figures)


@pytest.mark.gpu
@needs_fla
def test_fla_benchmark_rows(fla_layers):
    bound, layer = fla_layers("kimi")
    decode = list(bench_fla.bench_fla_decode(bound, batches=(1, 3), repeats=5, layer=layer))
    assert [(row["B"], row["graph"]) for row in decode] == [(1, True), (3, True), (1, False), (3, False)]
    prefill = list(bench_fla.bench_fla_prefill(bound, tokens=(100,), repeats=2, layer=layer))
    assert [row["case"] for row in prefill] == ["prefill", "chunk_kda", "chunk_kda_norm"]
    for row in decode + prefill:
        assert row["impl"] == "fla" and row["median_us"] > 0, row



def test_decode_rows_carry_both_medians_and_their_ratios(monkeypatch):
    """decorate_row gives a row timed both ways the ratio of each, from the same bytes; queued_us
    times each call between its own events with one synchronisation (a stand-in torch)."""
    import types

    cfg = KdaConfig(**KIMI_LINEAR_48B)
    row = bench_fla.decorate_row({"impl": "fla", "case": "decode", "B": 4, "median_us": 100.0,
                                  "queued_median_us": 50.0}, "kimi", cfg, 4000.0)
    assert row["queued_roofline_ratio"] == pytest.approx(2 * row["roofline_ratio"])
    assert "queued_roofline_ratio" not in bench_fla.decorate_row(
        {"impl": "fla", "case": "decode", "B": 1, "median_us": 10.0}, "kimi", cfg, 4000.0)

    clock = {"now": 0.0, "synchronised": 0}

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.at = clock["now"]

        def synchronize(self):
            clock["synchronised"] += 1

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event)))
    durations = iter(range(1, 1000))

    def call():
        clock["now"] += next(durations)

    # Warm-up calls of 1 and 2 ms, then 3 .. 203 ms: median 103 ms.
    assert bench_fla.queued_us(call, repeats=201, warmup=2) == pytest.approx(103e3)
    assert clock["synchronised"] == 1
    # median_us: the same stand-in, each call synchronised (warm-up 204 and 205 ms, then 206 .. 210).
    assert bench_fla.median_us(call, repeats=5, warmup=2) == pytest.approx(208e3)
    assert clock["synchronised"] == 1 + 5


def test_kernel_ms_counts_each_kernels_self_time_once(monkeypatch):
    """kernel_ms sums the profiler's self device time by name (an operator's device time is its
    kernels', so it must not count twice), in ms, largest first, after the warm-up calls (a stand-in
    torch and profiler; older torch names the field self_cuda_time_total)."""
    import types

    calls = {"n": 0, "synchronised": 0}

    def entry(key, self_micros, old_name=False):
        field = "self_cuda_time_total" if old_name else "self_device_time_total"
        return types.SimpleNamespace(key=key, **{field: self_micros})

    entries = [entry("aten::mm", 0.0), entry("ampere_bf16_gemm", 1500.0), entry("chunk_kda_fwd", 700.0),
               entry("ampere_bf16_gemm", 500.0), entry("Memcpy DtoD", 20.0, old_name=True), entry("x" * 200, 1.0)]

    class Profile:
        def __init__(self, activities):
            assert activities == ["cuda"]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return entries

    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: calls.__setitem__(
        "synchronised", calls["synchronised"] + 1)))
    profiler = types.SimpleNamespace(ProfilerActivity=types.SimpleNamespace(CUDA="cuda"), profile=Profile)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.profiler", profiler)

    def call():
        calls["n"] += 1

    totals = bench_fla.kernel_ms(call, warmup=2)
    assert calls == {"n": 3, "synchronised": 2}
    assert list(totals) == ["ampere_bf16_gemm", "chunk_kda_fwd", "Memcpy DtoD", "x" * 96]
    assert totals["ampere_bf16_gemm"] == pytest.approx(2.0) and totals["Memcpy DtoD"] == pytest.approx(0.02)
