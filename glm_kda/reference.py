"""The NumPy oracle: the block of docs/maths.md section 3, stage by stage, in float64.

The two precisions ("float64", "bf16") are the exact and BF16-faithful oracles of docs/maths.md section 5.
Each stage function takes NumPy or CuPy arrays (`xp` follows the input), so the oracle can also run on a GPU.

Stage dictionaries use the names of STAGE_ORDER, in pipeline order, with the shapes of docs/maths.md
section 5, "Stages".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import ml_dtypes
import numpy as np

from .config import KdaConfig
from .state import KdaState, array_module, require_one_row

STAGE_ORDER = ("qkv_proj", "down_proj", "forget_proj", "out_gate", "conv_out", "query", "key", "value", "gate",
               "beta", "core", "o_norm_out", "final_out")

PRECISIONS = ("float64", "bf16")


# BF16 rounding --------------------------------------------------------------------------
def round_bf16(x: Any) -> Any:
    """Round float64 values to the nearest BF16 (ties to even), returned as float64.

    Rounds once, through float32 rounded to odd (docs/maths.md section 5, "Rounding to BF16").
    """
    xp = array_module(x)
    x = xp.asarray(x, dtype=xp.float64)
    with np.errstate(over="ignore"):  # beyond the float32 range becomes inf, as in BF16
        f32 = x.astype(xp.float32)
    # Truncate toward zero: step back one ulp where RNE rounded away from zero.
    away = xp.abs(f32.astype(xp.float64)) > xp.abs(x)
    f32 = xp.where(away, xp.nextafter(f32, xp.float32(0)), f32)
    bits = f32.view(xp.uint32)
    inexact = f32.astype(xp.float64) != x
    bits = xp.where(inexact, bits | xp.uint32(1), bits)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) & xp.uint32(0xFFFF0000)
    out = rounded.view(xp.float32).astype(xp.float64)
    # NaN stays NaN; +-inf and values that overflow BF16 come out as +-inf from the bit arithmetic.
    return xp.where(xp.isnan(x), x, out)


# Stages ---------------------------------------------------------------------------------
def linear(x: Any, weight: Any) -> Any:
    """x [T, in] @ weight[out, in]^T -> [T, out], float64."""
    return x @ weight.T


def conv_silu(qkv_proj: Any, conv_state: Any, conv_weight: Any) -> tuple[Any, Any]:
    """Causal depthwise conv over time then SiLU, continuing from `conv_state`.

    qkv_proj [T, C], conv_state [C, K] (last K inputs, oldest first), conv_weight [C, K] (docs/maths.md
    section 3, step 2). Returns (pre-rounding conv output [T, C], new state [C, K] = the last K inputs).
    """
    xp = array_module(qkv_proj)
    tokens = qkv_proj.shape[0]
    kernel = conv_weight.shape[1]
    # Full input sequence: K state slots, then the T new inputs. Slot 0 of the state is never
    # read: output t uses positions t+1 .. t+K of this sequence.
    seq = xp.concatenate([conv_state.T, qkv_proj], axis=0)  # [K + T, C]
    acc = xp.zeros(qkv_proj.shape, dtype=xp.float64)
    for j in range(kernel):
        acc += conv_weight[:, j][None, :] * seq[1 + j : 1 + j + tokens]
    out = acc / (1.0 + xp.exp(-acc))
    new_state = seq[tokens:].T.copy()
    return out, new_state


def l2norm_split(conv_out: Any, heads: int, head_dim: int, l2_eps: float) -> tuple[Any, Any, Any]:
    """Split conv_out [T, 3*qkv] into q, k, v [T, H, D]; q and k L2-normalised per head with
    x / sqrt(sum(x*x) + eps) (eps INSIDE the sqrt), exactly once; v untouched."""
    tokens = conv_out.shape[0]
    q, k, v = (conv_out[:, i * heads * head_dim : (i + 1) * heads * head_dim].reshape(tokens, heads, head_dim) for i in range(3))
    xp = array_module(conv_out)

    def l2(x):
        return x / xp.sqrt((x * x).sum(axis=-1, keepdims=True) + l2_eps)

    return l2(q), l2(k), v.copy()


def forget_gate(forget_proj: Any, dt_bias: Any, a_log: Any, config: KdaConfig) -> Any:
    """Log-decay g [T, H, D] from forget_proj [T, qkv], dt_bias [qkv] (per CHANNEL) and
    A_log [H] (per HEAD), by the config's law (docs/maths.md section 3, step 4)."""
    xp = array_module(forget_proj)
    tokens = forget_proj.shape[0]
    u = (forget_proj + dt_bias[None, :]).reshape(tokens, config.heads, config.head_dim)
    a = xp.exp(a_log)[None, :, None]
    if config.bounded:
        return config.gate_lower_bound / (1.0 + xp.exp(-a * u))
    softplus = xp.where(u > 20.0, u, xp.log1p(xp.exp(xp.minimum(u, 20.0))))
    return -a * softplus


def sigmoid(x: Any) -> Any:
    xp = array_module(x)
    return 1.0 / (1.0 + xp.exp(-x))


def recurrent_scan(query: Any, key: Any, value: Any, gate: Any, beta: Any, recurrent: Any) -> tuple[Any, Any]:
    """The delta rule token by token (docs/maths.md section 3, step 6), the decode form.

    query/key/value/gate [T, H, D], beta [T, H], recurrent [H, D_k, D_v]. Returns (core [T, H, D], new state).
    """
    xp = array_module(query)
    scale = 1.0 / math.sqrt(query.shape[-1])
    state = recurrent.astype(xp.float64, copy=True)
    core = xp.empty(value.shape, dtype=xp.float64)
    for t in range(query.shape[0]):
        state *= xp.exp(gate[t])[:, :, None]
        pred = xp.einsum("hkv,hk->hv", state, key[t])
        delta = beta[t][:, None] * (value[t] - pred)
        state += key[t][:, :, None] * delta[:, None, :]
        core[t] = xp.einsum("hkv,hk->hv", state, query[t] * scale)
    return core, state


def chunk_scan(query: Any, key: Any, value: Any, gate: Any, beta: Any, recurrent: Any, chunk: int,
               pad_value: float = 0.0) -> tuple[Any, Any]:
    """The same recurrence chunk-wise (docs/maths.md, "The chunked (WY) form"), with a padded last chunk.

    The inputs are padded to a multiple of `chunk` with `pad_value` and the padding is masked BY INDEX
    before any arithmetic, as the kernels do: a padded row leaves outputs and state untouched.
    Returns (core [T, H, D], new state).
    """
    xp = array_module(query)
    tokens, heads, head_dim = query.shape
    scale = 1.0 / math.sqrt(head_dim)
    nchunks = -(-tokens // chunk)
    padded = nchunks * chunk
    valid = xp.arange(padded) < tokens

    def pad(x):
        out = xp.full((padded,) + x.shape[1:], pad_value, dtype=xp.float64)
        out[:tokens] = x
        mask = valid.reshape((padded,) + (1,) * (x.ndim - 1))
        return xp.where(mask, out, 0.0)

    q, k, v, g, b = (pad(x) for x in (query, key, value, gate, beta))
    state = recurrent.astype(xp.float64, copy=True)
    core = xp.empty((padded, heads, head_dim), dtype=xp.float64)
    rows = xp.arange(chunk)
    inclusive = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    eye = xp.eye(chunk)
    for n in range(nchunks):
        sl = slice(n * chunk, (n + 1) * chunk)
        # [H, C, D] per head.
        qc, kc, vc, gc = (x[sl].transpose(1, 0, 2) for x in (q, k, v, g))
        bc = b[sl].T  # [H, C]
        cum = xp.cumsum(gc, axis=1)
        diff = cum[:, :, None, :] - cum[:, None, :, :]  # [H, t, s, D]
        decay = xp.exp(xp.where(inclusive[None, :, :, None], diff, -xp.inf))
        attn_kk = xp.einsum("htd,hsd,htsd->hts", kc, kc, decay) * strict
        attn_qk = xp.einsum("htd,hsd,htsd->hts", qc, kc, decay) * scale
        system = eye[None] + bc[:, :, None] * attn_kk
        w = xp.linalg.solve(system, bc[:, :, None] * (kc * xp.exp(cum)))
        u_c = xp.linalg.solve(system, bc[:, :, None] * vc)
        u = u_c - w @ state
        out = (qc * scale * xp.exp(cum)) @ state + attn_qk @ u
        tail = kc * xp.exp(cum[:, -1:, :] - cum)
        state = xp.exp(cum[:, -1, :])[:, :, None] * state + xp.einsum("hsk,hsv->hkv", tail, u)
        core[sl] = out.transpose(1, 0, 2)
    return core[:tokens], state


def gated_rmsnorm(core: Any, out_gate: Any, norm_weight: Any, eps: float) -> Any:
    """Per head: y = o / sqrt(mean(o*o) + eps) * w * sigmoid(z). core [T, H, D], out_gate [T, qkv].

    The gate is a SIGMOID, not the common SiLU (docs/maths.md section 6)."""
    xp = array_module(core)
    tokens, heads, head_dim = core.shape
    z = out_gate.reshape(tokens, heads, head_dim)
    normed = core / xp.sqrt((core * core).mean(axis=-1, keepdims=True) + eps)
    return (normed * norm_weight[None, None, :] * sigmoid(z)).reshape(tokens, heads * head_dim)


# The block ------------------------------------------------------------------------------
# What the oracle takes as hidden rows.
_ROW_DTYPES = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))
WEIGHT_FIELDS = ("qkv_weight", "down_weight", "f_b", "g_b", "conv_weight", "dt_bias", "a_log", "o_norm", "o_proj")


class KdaOracle:
    """The block (docs/maths.md section 3) for one bound layer, in float64 or BF16-faithful precision.

    `layer` is a BoundLayer (glm_kda.checkpoint) or any object with the attributes of
    WEIGHT_FIELDS and `config`. Calls never mutate the state they are given: they return
    (stages, new_state), where stages maps STAGE_ORDER names to float64 arrays.
    """

    def __init__(self, layer: Any, precision: str = "float64", xp: Any = np, config: KdaConfig | None = None):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        missing = [name for name in WEIGHT_FIELDS + (() if config is not None else ("config",)) if not hasattr(layer, name)]
        if missing:
            raise TypeError(f"KdaOracle: layer must be a BoundLayer (or hold its fields); "
                            f"{type(layer).__name__} lacks {', '.join(missing)}")
        self.config = config if config is not None else layer.config
        self.precision = precision
        self.xp = xp
        self.round = round_bf16 if precision == "bf16" else (lambda x: x)
        self.weights = {name: xp.asarray(np.asarray(getattr(layer, name), dtype=np.float64)) for name in WEIGHT_FIELDS}

    # Stage groups, mirroring the GPU front end, stateful part and back end. Each writes its
    # stages into `out` and reads its inputs from `src`: the same dict for an ordinary run,
    # given upstream values (a kernel's workspace) for fed_stages --------------------------
    def front_end(self, x: Any, out: dict[str, Any], src: Mapping[str, Any]) -> None:
        """Everything driven by the raw hidden rows x: projections, gate, beta, output gate."""
        cfg, w, rnd = self.config, self.weights, self.round
        d = cfg.head_dim
        out["qkv_proj"] = rnd(linear(x, w["qkv_weight"]))
        out["down_proj"] = rnd(linear(x, w["down_weight"]))
        down = src["down_proj"]
        out["forget_proj"] = rnd(linear(down[:, :d], w["f_b"]))
        out["out_gate"] = rnd(linear(down[:, d : 2 * d], w["g_b"]))
        out["gate"] = forget_gate(src["forget_proj"], w["dt_bias"], w["a_log"], cfg)
        out["beta"] = sigmoid(down[:, 2 * d :])

    def conv_stage(self, out: dict[str, Any], src: Mapping[str, Any], conv_state: Any) -> Any:
        """Conv + SiLU, then the q/k L2 and split; returns the new conv state."""
        cfg = self.config
        conv_out, new_conv = conv_silu(src["qkv_proj"], conv_state, self.weights["conv_weight"])
        out["conv_out"] = self.round(conv_out)
        out["query"], out["key"], out["value"] = l2norm_split(src["conv_out"], cfg.heads, cfg.head_dim, cfg.l2_eps)
        return new_conv

    def scan_stage(self, out: dict[str, Any], src: Mapping[str, Any], recurrent: Any, chunk: int | None,
                   pad_value: float) -> Any:
        """The delta rule, token by token (chunk None) or chunk-wise; returns the new state."""
        args = (src["query"], src["key"], src["value"], src["gate"], src["beta"], recurrent)
        if chunk is None:
            out["core"], recurrent = recurrent_scan(*args)
        else:
            out["core"], recurrent = chunk_scan(*args, chunk=chunk, pad_value=pad_value)
        return recurrent

    def back_end(self, out: dict[str, Any], src: Mapping[str, Any]) -> None:
        w = self.weights
        out["o_norm_out"] = self.round(gated_rmsnorm(src["core"], src["out_gate"], w["o_norm"], self.config.rms_norm_eps))
        out["final_out"] = self.round(linear(src["o_norm_out"], w["o_proj"]))

    def _rows(self, hidden: Any, what: str) -> Any:
        """hidden [T, hidden] (BF16, FP32 or FP64 rows, T >= 1) as float64 of module xp, rounded
        to BF16 by the BF16-faithful oracle (the block's input is BF16); else an error naming it."""
        dtype = getattr(hidden, "dtype", None)
        if dtype is None or np.dtype(dtype) not in _ROW_DTYPES:
            raise TypeError(f"{what}: hidden must be an array of BF16, float32 or float64 rows, got "
                            f"{type(hidden).__name__} of dtype {dtype}")
        if hidden.ndim != 2 or hidden.shape[1] != self.config.hidden or hidden.shape[0] < 1:
            raise ValueError(f"{what}: hidden must be [T >= 1, {self.config.hidden}], got {list(hidden.shape)}")
        return self.round(_to_float64(hidden, self.xp))

    def _run(self, hidden: Any, state: KdaState | None, chunk: int | None, pad_value: float,
             upstream: Mapping[str, Any] | None, what: str = "prefill") -> tuple[dict[str, Any], KdaState]:
        xp = self.xp
        hidden = self._rows(hidden, what)
        if chunk is not None and (not isinstance(chunk, (int, np.integer)) or isinstance(chunk, bool) or chunk < 1):
            raise ValueError(f"{what}: chunk must be None (token by token) or an int >= 1, got {chunk!r}")
        start = self._state(state)
        out: dict[str, Any] = {}
        src = out if upstream is None else {name: _to_float64(value, xp) for name, value in upstream.items()}
        self.front_end(hidden, out, src)
        conv = self.conv_stage(out, src, start.conv)
        recurrent = self.scan_stage(out, src, start.recurrent, chunk, pad_value)
        self.back_end(out, src)
        return out, KdaState(conv, recurrent)

    def fed_stages(self, hidden: Any, upstream: Mapping[str, Any], state: KdaState | None = None,
                   chunk: int | None = None) -> tuple[dict[str, Any], KdaState]:
        """Every stage recomputed from the UPSTREAM stage values given (typically a kernel's
        workspace), so each stage can be judged on its own, free of upstream rounding flips.

        upstream holds every stage but final_out (as a GPU workspace does); `state`: the starting state;
        chunk as in prefill. Returns (stages, state after the run from upstream inputs).
        """
        return self._run(hidden, state, chunk, 0.0, upstream, "fed_stages")

    def _state(self, state: KdaState | None) -> KdaState:
        xp = self.xp
        if state is None:
            return KdaState.zeros(self.config, xp, xp.float64)
        if not isinstance(state, KdaState):
            raise TypeError(f"state must be a KdaState (or None for a new sequence), got {type(state).__name__}")
        state.check(self.config)
        return KdaState(_to_float64(state.conv, xp), _to_float64(state.recurrent, xp))

    # Operations ----------------------------------------------------------------------------
    def prefill(self, hidden: Any, state: KdaState | None = None, chunk: int | None = None, pad_value: float = 0.0) -> tuple[dict[str, Any], KdaState]:
        """hidden [T, hidden] from `state` (None: a new sequence). chunk=None walks token by
        token; an int evaluates the recurrence chunk-wise with a padded tail of `pad_value`."""
        return self._run(hidden, state, chunk, pad_value, None)

    def decode(self, hidden_row: Any, state: KdaState | None = None) -> tuple[dict[str, Any], KdaState]:
        """One token, hidden_row [1, hidden] or [hidden] (K tokens of one sequence: verify)."""
        require_one_row("decode", hidden_row)
        return self._run(hidden_row.reshape(1, -1), state, None, 0.0, None, "decode")

    def verify(self, hidden_rows: Any, state: KdaState | None = None) -> tuple[dict[str, Any], list[KdaState]]:
        """K rows of one sequence walked token by token; returns the state after every row."""
        if getattr(hidden_rows, "ndim", 0) != 2 or hidden_rows.shape[0] < 1:
            raise ValueError(f"verify: hidden_rows must be [K >= 1, {self.config.hidden}], got "
                             f"{list(getattr(hidden_rows, 'shape', []))}")
        stages_rows, states = [], []
        for row in range(hidden_rows.shape[0]):
            stages, state = self.decode(hidden_rows[row : row + 1], state)
            stages_rows.append(stages)
            states.append(state)
        merged = {name: self.xp.concatenate([s[name] for s in stages_rows], axis=0) for name in stages_rows[0]}
        return merged, states


def _to_float64(x: Any, xp: Any = np) -> Any:
    """Any host (BF16 included) or device array as a float64 array of module xp (default NumPy)."""
    if isinstance(x, np.ndarray):
        return xp.asarray(x.astype(np.float64))
    if xp is np and hasattr(x, "get"):
        x = x.get()
    return xp.asarray(x).astype(xp.float64)


# Comparison -----------------------------------------------------------------------------
def rms_ratio(actual: Any, reference: Any) -> float:
    """rms(actual - reference) / rms(reference); NaN anywhere gives NaN, a zero reference
    gives rms(actual) (0 when both are zero)."""
    a, r = _to_float64(actual), _to_float64(reference)
    if a.size != r.size:
        raise ValueError(f"rms_ratio: {list(a.shape)} against a reference of {list(r.shape)}: not the same elements")
    if a.shape != r.shape:
        a = a.reshape(r.shape)
    err = math.sqrt(float(np.mean((a - r) ** 2))) if a.size else 0.0
    ref = math.sqrt(float(np.mean(r * r))) if r.size else 0.0
    if math.isnan(err) or math.isnan(ref):
        return float("nan")
    return err / ref if ref > 0 else err


@dataclass(frozen=True)
class StageRow:
    stage: str
    rms_ratio: float
    max_abs: float
    shape: tuple[int, ...]


class StageTable:
    """rms-ratio and max-abs per stage, in pipeline order."""

    def __init__(self, rows: Iterable[StageRow]):
        self.rows = list(rows)

    def __getitem__(self, stage: str) -> StageRow:
        for row in self.rows:
            if row.stage == stage:
                return row
        raise KeyError(f"no stage {stage!r} in this table; stages: {[r.stage for r in self.rows]}")

    def ratios(self) -> dict[str, float]:
        return {row.stage: row.rms_ratio for row in self.rows}

    def first_above(self, threshold: float) -> str | None:
        """The earliest stage (pipeline order) whose rms-ratio exceeds threshold (or is NaN)."""
        for row in self.rows:
            if not row.rms_ratio <= threshold:
                return row.stage
        return None

    def __str__(self) -> str:
        lines = [f"{row.stage:<12} {row.rms_ratio:>11.3e} {row.max_abs:>11.3e}  {list(row.shape)}" for row in self.rows]
        return "\n".join([f"{'stage':<12} {'rms-ratio':>11} {'max-abs':>11}  shape", *lines])

    __repr__ = __str__


def compare_stages(actual: Mapping[str, Any], reference: Mapping[str, Any], stages: Iterable[str] | None = None) -> StageTable:
    """Table of rms-ratio and max-abs for every stage present in both dicts (pipeline order)."""
    names = list(stages) if stages is not None else [s for s in STAGE_ORDER if s in actual and s in reference]
    if not names:
        raise ValueError(f"compare_stages: no stage in both: {sorted(actual)} against {sorted(reference)} "
                         f"(stage names: {', '.join(STAGE_ORDER)})")
    rows = []
    for name in names:
        a, r = _to_float64(actual[name]), _to_float64(reference[name])
        a = a.reshape(r.shape) if a.size == r.size else a
        if a.shape != r.shape:
            raise ValueError(f"stage {name!r}: shapes differ, {list(a.shape)} vs reference {list(r.shape)}")
        max_abs = float(np.max(np.abs(a - r))) if a.size else 0.0
        rows.append(StageRow(name, rms_ratio(a, r), max_abs, tuple(r.shape)))
    return StageTable(rows)
