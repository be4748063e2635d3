"""Same-run comparison with flash-linear-attention (PyPI `flash-linear-attention`, package `fla`).

fla is never a dependency of glm_kda (nor is this module part of it: it lives in benchmarks/lib/,
imported by benchmarks/fla_compare.py, decode.py and prefill.py): fla is imported inside the functions that need it, and
`fla_available()` says why a comparison cannot run. Written against fla 0.6.0 (the KDA ops
exist since 0.4.0, the bounded gate `lower_bound` / `safe_gate` since 0.4.2; 0.6.0's layer keeps
its recurrent state V-first). fla 0.6.0 needs torch >= 2.7, triton >= 3.3, einops and
transformers >= 5.6.2, < 6 (its layer package imports transformers).

What is compared: fla's `KimiDeltaAttention` layer built with our geometry and OUR weights
(`build_fla_layer`), timed for one-token decode through its cache (captured in a CUDA graph and
eager) and for prefill, and `chunk_kda` alone on random inputs of the same shapes.

Parameter map (KimiDeltaAttention.named_parameters() <- BoundLayer, docs/maths.md section 2):

    q_proj.weight, k_proj.weight, v_proj.weight  [qkv, hidden]  <- q_proj, k_proj, v_proj
    q_conv1d.weight, k_conv1d.weight, v_conv1d.weight [qkv, 1, K] <- conv_weight thirds q|k|v
    f_proj.0.weight [D, hidden] <- f_a          f_proj.1.weight [qkv, D] <- f_b
    b_proj.weight   [H, hidden] <- b_proj       A_log [H] <- a_log        dt_bias [qkv] <- dt_bias
    g_proj.0.weight [D, hidden] <- g_a          g_proj.1.weight [qkv, D] <- g_b
    g_proj.1.bias   [qkv]       <- zeros: fla's output-gate up projection has a bias, ours none
    o_norm.weight   [D]         <- o_norm       o_proj.weight [hidden, qkv] <- o_proj

BF16 everywhere except A_log and dt_bias, which stay FP32 as in the checkpoint (fla creates
them FP32 and its kernels read them as FP32).

Known differences between fla's layer and docs/maths.md section 3 (check_fla_agrees measures them):

- Gate law: with `lower_bound` set, fla's gate is lower_bound * sigmoid(exp(A_log) * (u + dt_bias)),
  our bounded law; without it, -exp(A_log) * softplus(u + dt_bias), our softplus law.
  `safe_gate=True` only selects fla's faster chunk path for bounded gates and needs
  -5 <= lower_bound < 0; outside that range the law is the same and the chunk path the general one.
- Gated norm: fla's layer asks FusedRMSNormGated for activation="sigmoid", the same gate as ours
  (that class's own default is swish).
- Extra BF16 roundings: fla rounds the delta-rule output to BF16 before the gated norm, and its
  chunk path (T > 64, or any T with autograd on) rounds the L2-normalised q and k to BF16; the
  BF16-faithful oracle keeps both in FP32.
- Mode: without autograd, T <= 64 runs fla's token-by-token fused_recurrent kernel, longer T its
  chunk kernel (C = 64).
- Conv state: three BF16 tensors [B, qkv, K] (q, k, v), the last K conv inputs oldest first, slot 0
  never read; ours is one FP32 [3*qkv, K], the same slots: concat(q, k, v) == ours.
- Recurrent state: FP32 [B, H, D_v, D_k] (V-first) in the layer's cache; ours [H, D_k, D_v].
- Decode in a CUDA graph: fla's layer returns a NEW recurrent state each step and stores it in its
  cache, so a captured step reads the state it was captured with and writes a graph-owned buffer:
  the bytes moved are a real step's, the state just does not advance across replays (the conv
  states are updated in place and do advance).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np

from glm_kda.config import KdaConfig

from .timing import MIN_TIMED_CALLS, decode_bytes, median_ms, replay_ms, roofline, timed_calls, torch_events

FLA_DISTRIBUTION = "flash-linear-attention"
FLA_TESTED_VERSION = "0.6.0"
_MIN_VERSION = (0, 6, 0)

# fla's chunk_kda accepts safe_gate=True only for a lower bound in [-5, 0).
FLA_SAFE_GATE_RANGE = (-5.0, 0.0)

DECODE_BATCHES = (1, 4, 16, 64, 256)
PREFILL_TOKENS = (1024, 4096, 16384, 65536)
# The prefill length whose layer call is also broken down by kernel (bench_prefill's block_kernels too).
KERNEL_BREAKDOWN_TOKENS = 16384


# The parameter map ----------------------------------------------------------------------------
@dataclass(frozen=True)
class FlaParameter:
    """One parameter KimiDeltaAttention declares, and where its values come from.

    name: as in `named_parameters()`. field: the BoundLayer array it is copied from ("" for a
    zero tensor: the checkpoint has no such tensor). third: for the conv taps, which third of
    conv_weight (0 q, 1 k, 2 v). shape: the declared shape in config terms (hidden, qkv, H, D,
    K, 1), comma-separated.
    """

    name: str
    field: str
    shape: str
    third: int | None = None


FLA_PARAMETERS: tuple[FlaParameter, ...] = (
    FlaParameter("q_proj.weight", "q_proj", "qkv,hidden"),
    FlaParameter("k_proj.weight", "k_proj", "qkv,hidden"),
    FlaParameter("v_proj.weight", "v_proj", "qkv,hidden"),
    FlaParameter("q_conv1d.weight", "conv_weight", "qkv,1,K", third=0),
    FlaParameter("k_conv1d.weight", "conv_weight", "qkv,1,K", third=1),
    FlaParameter("v_conv1d.weight", "conv_weight", "qkv,1,K", third=2),
    FlaParameter("f_proj.0.weight", "f_a", "D,hidden"),
    FlaParameter("f_proj.1.weight", "f_b", "qkv,D"),
    FlaParameter("b_proj.weight", "b_proj", "H,hidden"),
    # A_log is per HEAD, dt_bias per CHANNEL (docs/maths.md section 6): fla's shapes say the same.
    FlaParameter("A_log", "a_log", "H"),
    FlaParameter("dt_bias", "dt_bias", "qkv"),
    FlaParameter("g_proj.0.weight", "g_a", "D,hidden"),
    FlaParameter("g_proj.1.weight", "g_b", "qkv,D"),
    FlaParameter("g_proj.1.bias", "", "qkv"),
    FlaParameter("o_norm.weight", "o_norm", "D"),
    FlaParameter("o_proj.weight", "o_proj", "hidden,qkv"),
)


class FlaMappingError(ValueError):
    """Our weights and fla's declared parameters do not line up one to one."""


def _dims(config: KdaConfig) -> dict[str, int]:
    return {"hidden": config.hidden, "qkv": config.qkv, "H": config.heads, "D": config.head_dim,
            "K": config.conv_kernel, "1": 1}


def fla_parameter_shapes(config: KdaConfig) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every parameter KimiDeltaAttention declares for `config`'s geometry."""
    dims = _dims(config)
    return {p.name: tuple(dims[axis] for axis in p.shape.split(",")) for p in FLA_PARAMETERS}


def fla_parameter_arrays(bound: Any) -> dict[str, np.ndarray]:
    """{fla parameter name: host array} from a BoundLayer: BF16, except A_log and dt_bias (FP32)."""
    config: KdaConfig = bound.config
    shapes = fla_parameter_shapes(config)
    qkv = config.qkv
    arrays: dict[str, np.ndarray] = {}
    for p in FLA_PARAMETERS:
        if not p.field:
            arrays[p.name] = np.zeros(shapes[p.name], dtype=ml_dtypes.bfloat16)
            continue
        source = np.asarray(getattr(bound, p.field))
        if p.third is not None:
            # conv_weight [3*qkv, K] holds q|k|v taps in that order; torch's depthwise Conv1d
            # wants the size-1 middle axis back.
            source = source[p.third * qkv : (p.third + 1) * qkv]
        arrays[p.name] = np.ascontiguousarray(source.reshape(shapes[p.name]))
    return arrays


def assign_parameters(
    declared: Iterable[tuple[str, Any]],
    arrays: Mapping[str, np.ndarray],
    copy: Callable[[Any, np.ndarray], None],
) -> list[str]:
    """Copy arrays[name] into every declared (name, parameter) pair with copy(parameter, array).

    Everything is checked before the first copy: a declared parameter with no array, an array
    no parameter takes, and a shape that differs are all errors that name the tensor. Returns
    the names set, in declaration order.
    """
    declared = list(declared)
    names = [name for name, _ in declared]
    unmapped = [name for name in names if name not in arrays]
    unused = [name for name in arrays if name not in names]
    wrong = [
        f"{name}: fla declares {tuple(param.shape)}, our map gives {tuple(arrays[name].shape)}"
        for name, param in declared
        if name in arrays and tuple(param.shape) != tuple(arrays[name].shape)
    ]
    problems = []
    if unmapped:
        problems.append(f"fla parameters with no source in our weights: {', '.join(unmapped)}")
    if unused:
        problems.append(f"mapped tensors fla does not declare: {', '.join(unused)}")
    if wrong:
        problems.append("shape mismatch: " + "; ".join(wrong))
    if problems:
        raise FlaMappingError("\n".join(problems))
    for name, param in declared:
        copy(param, arrays[name])
    return names


def fla_layer_kwargs(config: KdaConfig) -> dict[str, Any]:
    """KimiDeltaAttention constructor arguments for `config` (every value read from it)."""
    kwargs: dict[str, Any] = dict(
        hidden_size=config.hidden,
        expand_v=1,
        head_dim=config.head_dim,
        num_heads=config.heads,
        num_v_heads=config.heads,
        mode="chunk",
        use_short_conv=True,
        allow_neg_eigval=False,
        conv_size=config.conv_kernel,
        conv_bias=False,
        layer_idx=0,
        norm_eps=config.rms_norm_eps,
    )
    kwargs.update(_gate_kwargs(config))
    return kwargs


def _gate_kwargs(config: KdaConfig) -> dict[str, Any]:
    """fla's gate arguments: lower_bound selects the bounded law, safe_gate its faster chunk path."""
    if not config.bounded:
        return {"lower_bound": None, "safe_gate": False}
    bound = float(config.gate_lower_bound)
    low, high = FLA_SAFE_GATE_RANGE
    return {"lower_bound": bound, "safe_gate": low <= bound < high}


def fla_gate_description(config: KdaConfig) -> str:
    if not config.bounded:
        return "softplus (no bound)"
    kwargs = _gate_kwargs(config)
    if kwargs["safe_gate"]:
        return f"bounded, lower_bound {kwargs['lower_bound']:g}, safe_gate"
    return (f"bounded, lower_bound {kwargs['lower_bound']:g}, general chunk path (outside fla's "
            f"safe_gate range [{FLA_SAFE_GATE_RANGE[0]:g}, {FLA_SAFE_GATE_RANGE[1]:g}))")


# Availability -----------------------------------------------------------------------------------
def fla_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version(FLA_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        try:
            import fla

            return getattr(fla, "__version__", None)
        except Exception:
            return None


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


def fla_available() -> tuple[bool, str]:
    """(True, versions) when fla's KDA layer can run here, else (False, why not)."""
    try:
        import torch
    except Exception as exc:
        return False, f"torch not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} sees no CUDA device"
    try:
        import triton
    except Exception as exc:
        return False, f"triton not importable ({type(exc).__name__}: {exc})"
    try:
        import fla.layers.kda
        import fla.models.cache_utils
        import fla.ops.kda

        for module, name in ((fla.layers.kda, "KimiDeltaAttention"), (fla.models.cache_utils, "Cache"),
                             (fla.ops.kda, "chunk_kda")):
            if not hasattr(module, name):
                return False, f"{FLA_DISTRIBUTION}: {module.__name__} has no {name}"
    except Exception as exc:
        return False, f"{FLA_DISTRIBUTION} not importable ({type(exc).__name__}: {exc})"
    version = fla_version() or "unknown"
    if version == "unknown" or _version_tuple(version) < _MIN_VERSION:
        return False, (f"{FLA_DISTRIBUTION} {version}: this comparison is written against "
                       f"{FLA_TESTED_VERSION} (V-first recurrent state in the layer's cache)")
    return True, (f"{FLA_DISTRIBUTION} {version}, torch {torch.__version__}, triton {triton.__version__}, "
                  f"{torch.cuda.get_device_name()}")


def comparison_note(wanted: bool) -> tuple[bool, dict]:
    """(whether fla rows will run, the benchmark's opening JSON note saying so and why);
    wanted False is the benchmarks' --no-fla."""
    ok, why = fla_available() if wanted else (False, "--no-fla")
    return ok, {"note": f"flash-linear-attention: {why}" if ok else f"no flash-linear-attention rows: {why}"}


def require_fla() -> None:
    ok, why = fla_available()
    if not ok:
        raise RuntimeError(f"the flash-linear-attention comparison cannot run: {why}")


# torch <-> host ---------------------------------------------------------------------------------
def to_torch(array: np.ndarray, device: Any = "cuda") -> Any:
    """A host array (BF16 via ml_dtypes, or any NumPy dtype torch knows) as a torch tensor."""
    import torch

    array = np.ascontiguousarray(array)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(array).to(device)


def to_host_f32(tensor: Any) -> np.ndarray:
    return tensor.detach().float().cpu().numpy()


# The layer --------------------------------------------------------------------------------------
def build_fla_layer(bound: Any, device: Any = "cuda") -> Any:
    """fla's KimiDeltaAttention with `bound`'s geometry, gate law and weights, in eval mode.

    Every declared parameter is set from our weights (see the map at the top of this module);
    one without a source, or a source without a parameter, raises FlaMappingError naming it.
    """
    import torch
    from fla.layers.kda import KimiDeltaAttention

    config: KdaConfig = bound.config
    with torch.device(device):
        layer = KimiDeltaAttention(**fla_layer_kwargs(config))
    buffers = [name for name, _ in layer.named_buffers()]
    if buffers:
        raise FlaMappingError(f"fla's layer declares buffers our map does not set: {', '.join(buffers)}")

    def copy(param: Any, array: np.ndarray) -> None:
        param.data = to_torch(array, device)

    assign_parameters(layer.named_parameters(), fla_parameter_arrays(bound), copy)
    layer.requires_grad_(False)
    return layer.eval()


def _device(layer: Any) -> Any:
    return next(layer.parameters()).device


def new_fla_cache() -> Any:
    from fla.models.cache_utils import Cache

    return Cache()


def _fla_state(cache: Any) -> Any:
    """The layer cache's state, in our layout: KdaState(conv FP32 [3*qkv, K], recurrent FP32 [H, D_k, D_v])
    for one sequence (batch row 0)."""
    from glm_kda.state import KdaState

    layer_state = cache[0]
    conv = np.concatenate([to_host_f32(part[0]) for part in layer_state["conv_state"]], axis=0)
    # The layer keeps the state V-first [B, H, D_v, D_k]; ours is K-major [H, D_k, D_v].
    recurrent = to_host_f32(layer_state["recurrent_state"][0].transpose(-1, -2))
    return KdaState(np.ascontiguousarray(conv), np.ascontiguousarray(recurrent))


def check_fla_agrees(bound: Any, hidden: np.ndarray, layer: Any = None) -> tuple[np.ndarray, Any]:
    """fla's layer on one new sequence: hidden [T, hidden] BF16 (host) ->
    (output [T, hidden] float32 (BF16 values), state after the run as a KdaState in our layout).

    The same shapes as KdaOracle(bound, ...).prefill(hidden) returns (stages["final_out"], state),
    so a caller can measure fla against the float64 oracle. See the module docstring for the
    known differences.
    """
    import torch

    if layer is None:
        require_fla()
        layer = build_fla_layer(bound)
    x = to_torch(np.asarray(hidden), _device(layer)).unsqueeze(0)
    cache = new_fla_cache()
    with torch.inference_mode():
        out = layer(x, past_key_values=cache, use_cache=True)[0]
    return to_host_f32(out[0]), _fla_state(cache)


def fla_decode_steps(layer: Any, hidden: np.ndarray, cache: Any = None) -> tuple[np.ndarray, Any, Any]:
    """Walk hidden [T, hidden] BF16 through the layer one token per call with its cache (the
    decode path). Returns (outputs [T, hidden] float32, state as a KdaState, the cache)."""
    import torch

    cache = cache if cache is not None else new_fla_cache()
    rows = to_torch(np.asarray(hidden), _device(layer))
    outs = []
    with torch.inference_mode():
        for t in range(rows.shape[0]):
            outs.append(layer(rows[t : t + 1].unsqueeze(0), past_key_values=cache, use_cache=True)[0][0])
    return to_host_f32(torch.cat(outs, dim=0)), _fla_state(cache), cache


# Timing -----------------------------------------------------------------------------------------
def median_us(fn: Callable[[], Any], repeats: int, warmup: int) -> float:
    """Median of `repeats` CUDA-event timings of fn() on the current stream, each call synchronised,
    after `warmup` calls (timing.median_ms with torch's events)."""
    return 1e3 * median_ms(fn, repeats=repeats, warmup=warmup, **torch_events())


def queued_us(fn: Callable[[], Any], repeats: int, warmup: int) -> float:
    """Median µs of `repeats` calls of fn() queued back to back on the current stream, each between
    its own pair of CUDA events, one synchronisation after the last (timing.replay_ms with torch's
    events): while the host stays ahead of the GPU, a per-call figure without the idle gap that a
    synchronisation per call leaves in front of each."""
    return 1e3 * float(np.median(replay_ms(fn, calls=repeats, warmup=warmup, **torch_events())))


def kernel_ms(fn: Callable[[], Any], warmup: int = 2) -> dict[str, float]:
    """Milliseconds of GPU time of each kernel (and copy) one call of fn() launches, by name, from
    torch.profiler's device activity (after `warmup` calls); names cut to 96 characters, largest
    first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for entry in profiler.key_averages():
        # Self time: a host operator's device time is its kernels', counted once, at the kernels.
        # torch >= 2.4 names it self_device_time_total, self_cuda_time_total before.
        micros = getattr(entry, "self_device_time_total", None)
        micros = getattr(entry, "self_cuda_time_total", 0.0) if micros is None else micros
        if micros > 0:
            name = entry.key[:96]
            totals[name] = totals.get(name, 0.0) + micros / 1e3
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def capture_graph(fn: Callable[[], Any], warmup: int = 3, hold: Callable[[], Any] | None = None) -> tuple[Any, Any]:
    """fn captured in a torch.cuda.CUDAGraph after warm-up calls on a side stream (Triton
    compiles and autotunes there, never inside the capture). Returns (graph, held): `held` is
    what hold() returned just before the capture, for the caller to keep alive as long as the
    graph (tensors the captured work reads but that fn itself may drop)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    held = hold() if hold is not None else None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph, held


def _hidden_rows(config: KdaConfig, rows: int, seed: int = 3) -> Any:
    from glm_kda.synthetic import synthetic_hidden

    return to_torch(synthetic_hidden(rows, config.hidden, seed=seed), "cuda")


def bench_fla_decode(
    bound: Any,
    batches: Iterable[int] = DECODE_BATCHES,
    repeats: int = 200,
    graphs: Iterable[bool] = (True, False),
    layer: Any = None,
) -> Iterator[dict]:
    """One-token decode steps of B sequences through fla's layer and its cache.

    Each case first runs one step from a zero state (so the cache holds conv and recurrent
    states), then times further steps: replays of a captured CUDA graph (graph=True) or eager
    calls. Yields {"impl": "fla", "case": "decode", "B", "graph", "median_us", "queued_median_us"}:
    the median of calls each synchronised, and of calls queued back to back each between its own
    pair of events (queued_us), as bench_decode times ours.
    """
    import torch

    require_fla()
    layer = layer if layer is not None else build_fla_layer(bound)
    batches = tuple(batches)
    hidden = _hidden_rows(bound.config, max(batches))
    for graph in graphs:
        for batch in batches:
            x = hidden[:batch].unsqueeze(1).contiguous()  # [B, 1, hidden]
            us, queued = _time_decode(layer, x, graph, repeats)
            torch.cuda.empty_cache()
            yield {"impl": "fla", "case": "decode", "B": batch, "graph": graph, "median_us": us,
                   "queued_median_us": queued}


def _time_decode(layer: Any, x: Any, graph: bool, repeats: int) -> tuple[float, float]:
    """(median_us, queued_us) of one decode step of x [B, 1, hidden] through a fresh cache; its
    states and graph are released on return."""
    import torch

    cache = new_fla_cache()
    with torch.inference_mode():

        def step() -> Any:
            return layer(x, past_key_values=cache, use_cache=True)[0]

        step()
        if not graph:
            return median_us(step, repeats=repeats, warmup=10), queued_us(step, repeats=repeats, warmup=10)
        # The captured step reads the states the cache holds at capture time and stores new
        # ones in it: hold the old ones as long as the graph.
        captured, _held = capture_graph(step, hold=lambda: dict(cache[0]))
        return (median_us(captured.replay, repeats=repeats, warmup=10),
                queued_us(captured.replay, repeats=repeats, warmup=10))


def bench_fla_prefill(
    bound: Any,
    tokens: Iterable[int] = PREFILL_TOKENS,
    repeats: int = 5,
    layer: Any = None,
    seed: int = 5,
) -> Iterator[dict]:
    """Prefill of one new sequence of T tokens: fla's whole layer (the state written to a fresh
    cache, as a real prefill does), then chunk_kda alone on random q, k, v, raw gate and beta
    logits of the layer's shapes with our A_log and dt_bias and the layer's gate law (fused
    L2 norm, gate and beta sigmoid, final state written). Yields
    {"impl": "fla", "case": "prefill" | "chunk_kda" | "chunk_kda_norm", "T", "median_us", "Mtok_s",
    "gate"}; at T = KERNEL_BREAKDOWN_TOKENS the prefill and chunk_kda_norm rows are each followed by a
    "<case>_kernels" row: that call's GPU milliseconds by kernel ("kernel_ms", torch.profiler) and their
    sum, to tell the layer's chunk_kda from chunk_kda alone.
    """
    import torch
    from fla.ops.kda import chunk_kda

    require_fla()
    config: KdaConfig = bound.config
    layer = layer if layer is not None else build_fla_layer(bound)
    tokens = tuple(tokens)
    gate = fla_gate_description(config)
    hidden = _hidden_rows(config, max(tokens)).unsqueeze(0)
    # Inference mode around each timing only: a generator must not leave it on between rows.
    for count in tokens:
        x = hidden[:, :count]
        with torch.inference_mode():
            def prefill(x=x):
                return layer(x, past_key_values=new_fla_cache(), use_cache=True)

            us = median_us(prefill, repeats, warmup=2)
            kernels = kernel_ms(prefill) if count == KERNEL_BREAKDOWN_TOKENS else None
        torch.cuda.empty_cache()
        yield {"impl": "fla", "case": "prefill", "T": count, "median_us": us, "Mtok_s": count / us, "gate": gate}
        if kernels is not None:
            yield _kernels_row("prefill", count, kernels, gate)

    a_log = to_torch(np.asarray(bound.a_log, np.float32), "cuda")
    dt_bias = to_torch(np.asarray(bound.dt_bias, np.float32), "cuda")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    for case, norm in (("chunk_kda", None), ("chunk_kda_norm", layer.o_norm)):
        for count in tokens:
            with torch.inference_mode():
                run = _chunk_kda_call(chunk_kda, config, count, a_log, dt_bias, generator, norm)
                us = median_us(run, repeats, warmup=2)
                kernels = kernel_ms(run) if count == KERNEL_BREAKDOWN_TOKENS and norm is not None else None
                del run
            torch.cuda.empty_cache()
            yield {"impl": "fla", "case": case, "T": count, "median_us": us, "Mtok_s": count / us, "gate": gate}
            if kernels is not None:
                yield _kernels_row(case, count, kernels, gate)


def _kernels_row(case: str, tokens: int, kernels: dict[str, float], gate: str) -> dict:
    """The "<case>_kernels" row of one call's kernel_ms breakdown, with their sum."""
    return {"impl": "fla", "case": f"{case}_kernels", "T": tokens, "kernel_ms": kernels,
            "kernel_total_ms": sum(kernels.values()), "gate": gate}


def _chunk_kda_call(chunk_kda: Callable, config: KdaConfig, tokens: int, a_log: Any, dt_bias: Any,
                    generator: Any, norm: Callable | None = None) -> Callable[[], Any]:
    """A call of chunk_kda on random q, k, v [1, T, H, D], raw gate [1, T, H, D] and beta logits
    [1, T, H] (BF16), from a zero FP32 state, final state written, the state V-first as fla's layer
    keeps it (state_v_first, the arguments its layer passes); with `norm` (the layer's gated RMSNorm
    module) also that norm of its output and a random output gate [1, T, H, D]."""
    import torch

    heads, dim = config.heads, config.head_dim

    def draw(*shape: int) -> Any:
        return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.bfloat16)

    q, k, v, g = (draw(1, tokens, heads, dim) for _ in range(4))
    beta = draw(1, tokens, heads)
    initial = torch.zeros(1, heads, dim, dim, device="cuda", dtype=torch.float32)
    out_gate = draw(1, tokens, heads, dim) if norm is not None else None

    def run() -> Any:
        out = chunk_kda(q=q, k=k, v=v, g=g, beta=beta, A_log=a_log, dt_bias=dt_bias,
                        initial_state=initial, output_final_state=True, state_v_first=True,
                        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                        use_beta_sigmoid_in_kernel=True, **_gate_kwargs(config))
        return out if norm is None else norm(out[0], out_gate)

    return run


# The runner -------------------------------------------------------------------------------------
def _our_rows(geometry: str, directory: Path, bandwidth: float, repeats: int, tokens: tuple[int, ...]) -> list[dict]:
    """Our block in the same process: bench_decode's decode and verify cases, then prefill."""
    import cupy

    from glm_kda.gpu.arrays import to_device_bf16
    from glm_kda.synthetic import synthetic_hidden

    from .bench_decode import bench_geometry
    from .layers import make_layer
    from .timing import prefill_bytes

    with contextlib.redirect_stdout(io.StringIO()):
        rows = bench_geometry(geometry, directory, bandwidth, repeats)
    rows = [{"impl": "glm_kda", **row} for row in rows]
    cupy.get_default_memory_pool().free_all_blocks()
    if tokens:
        # A workspace of its own (not the shared one), so its memory goes with the layer.
        layer = make_layer(directory, geometry, max(tokens), own_workspace=True)
        hidden = to_device_bf16(synthetic_hidden(max(tokens), layer.config.hidden, seed=3))
        state = layer.new_state()
        for count in tokens:
            ms = median_ms(lambda: layer.prefill(hidden[:count], state), repeats=5, warmup=2)
            nbytes = prefill_bytes(layer.config, count)
            rows.append({"impl": "glm_kda", "case": "prefill", "T": count, "median_us": 1e3 * ms,
                         "Mtok_s": count / (1e3 * ms), "geometry": geometry, "copy_bandwidth_GBs": bandwidth,
                         "bytes": nbytes, "roofline_ratio": roofline(nbytes, bandwidth, 1e3 * ms)})
        del layer, hidden, state
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def decorate_row(row: dict, geometry: str, config: KdaConfig, bandwidth: float) -> dict:
    """geometry, copy bandwidth and the roofline: for decode, bench_decode's (weights once, each
    sequence's state read and written once, FP32 state as ours); for prefill, timing.prefill_bytes."""
    from .timing import prefill_bytes

    row.update(geometry=geometry, copy_bandwidth_GBs=bandwidth)
    if row["case"] == "decode":
        nbytes = decode_bytes(config, row["B"])
        row.update(bytes=nbytes, roofline_ratio=roofline(nbytes, bandwidth, row["median_us"]))
        if "queued_median_us" in row:
            row["queued_roofline_ratio"] = roofline(nbytes, bandwidth, row["queued_median_us"])
    elif row["case"] == "prefill":
        nbytes = prefill_bytes(config, row["T"])
        row.update(bytes=nbytes, roofline_ratio=roofline(nbytes, bandwidth, row["median_us"]))
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", nargs="+", default=["glm", "kimi"], choices=["glm", "kimi"])
    parser.add_argument("--repeats", type=timed_calls(), default=MIN_TIMED_CALLS,
                        help="decode timings per case after warm-up (>= 200)")
    parser.add_argument("--batches", type=int, nargs="+", default=list(DECODE_BATCHES))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(PREFILL_TOKENS))
    parser.add_argument("--no-ours", dest="ours", action="store_false",
                        help="time fla only (default: our block too, in the same process)")


def run(args: argparse.Namespace) -> int:
    """One JSON line per case: fla's rows and (unless --no-ours) ours, both geometries."""
    ok, why = fla_available()
    if not ok:
        print(json.dumps({"note": f"no flash-linear-attention comparison: {why}"}), flush=True)
        return 0
    import torch

    from glm_kda.checkpoint import bind_layer
    from glm_kda.synthetic import write_synthetic_checkpoint

    from .timing import copy_bandwidth_gbs

    bandwidth = copy_bandwidth_gbs()
    print(json.dumps({"note": why, "copy_bandwidth_GBs": bandwidth}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for geometry in args.geometry:
            if args.ours:
                for row in _our_rows(geometry, directory, bandwidth, args.repeats, tuple(args.tokens)):
                    print(json.dumps(row), flush=True)
            else:
                write_synthetic_checkpoint(directory / geometry, geometry, num_layers=1)
            bound = bind_layer(directory / geometry, 0, progress=False)
            layer = build_fla_layer(bound)
            for row in bench_fla_decode(bound, args.batches, args.repeats, layer=layer):
                print(json.dumps(decorate_row(row, geometry, bound.config, bandwidth)), flush=True)
            for row in bench_fla_prefill(bound, args.tokens, layer=layer):
                print(json.dumps(decorate_row(row, geometry, bound.config, bandwidth)), flush=True)
            del layer
            torch.cuda.empty_cache()
    return 0
