"""Geometry and numeric settings of one KDA block, read from a checkpoint's config.json.

Every value that changes the numbers is READ from the checkpoint; a missing key is an error naming the key
and the file (docs/maths.md, sections 1 and 6).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

# The L2 normalisation of q and k is x / sqrt(sum(x*x) + L2_EPS). A convention shared by
# every reference implementation, not a config key.
L2_EPS = 1e-6

GATE_BOUNDED = "bounded"
GATE_SOFTPLUS = "softplus"

# Limits the CUDA kernels impose, each with the reason it exists (see validate()).
KERNEL_HEAD_DIM = 128
MAX_CONV_KERNEL = 4
MAX_CHUNK = 64


class ConfigError(ValueError):
    """A config.json that does not describe a KDA block we can run. field: the KdaConfig field a
    value check refused (None for other errors), so that a reader can name its key in the file."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class KdaConfig:
    """One KDA block's geometry and numerics.

    Attributes:
        hidden: model width; the block maps [T, hidden] -> [T, hidden].
        heads: H, number of KDA heads.
        head_dim: D, per-head width of q, k and v.
        conv_kernel: K, taps of the causal depthwise conv.
        gate_law: "bounded" (g = lower_bound * sigmoid(exp(A_log) * u)) or
            "softplus" (g = -exp(A_log) * softplus(u)).
        gate_lower_bound: the bound of the bounded law; None for softplus.
        rms_norm_eps: eps of the gated RMSNorm, from the config.
        l2_eps: eps inside the sqrt of the q/k L2 norm (convention, 1e-6).
        chunk: chunk length of the chunked prefill (a tiling choice, not model data).
        num_layers: layers in the text stack, when the config says (else None).
        kda_layers: 0-based indices of the KDA layers in the stack (empty when unknown).
        model_type: the config's model_type, for messages.
    """

    hidden: int
    heads: int
    head_dim: int
    conv_kernel: int
    gate_law: str
    gate_lower_bound: float | None
    rms_norm_eps: float
    l2_eps: float = L2_EPS
    chunk: int = 64
    num_layers: int | None = None
    kda_layers: tuple[int, ...] = ()
    model_type: str = ""

    def __post_init__(self) -> None:
        if self.gate_law not in (GATE_BOUNDED, GATE_SOFTPLUS):
            raise ConfigError(f"gate_law must be {GATE_BOUNDED!r} or {GATE_SOFTPLUS!r}, got {self.gate_law!r}")
        if (self.gate_law == GATE_BOUNDED) != (self.gate_lower_bound is not None):
            raise ConfigError(
                f"gate_lower_bound is required for the bounded law and meaningless for softplus "
                f"(gate_law={self.gate_law!r}, gate_lower_bound={self.gate_lower_bound!r})"
            )
        for name in ("hidden", "heads", "head_dim", "conv_kernel", "chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}", name)
        for name in ("rms_norm_eps", "l2_eps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}", name)
        bound = self.gate_lower_bound
        if bound is not None and not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound <= 0):
            # g = bound * sigmoid(...) is a log-decay: a positive bound would grow the state every token.
            raise ConfigError(f"gate_lower_bound must be a finite number <= 0 (a log-decay), got {bound!r}",
                              "gate_lower_bound")
        if self.num_layers is not None and (not isinstance(self.num_layers, int) or self.num_layers < 1):
            raise ConfigError(f"num_layers (num_hidden_layers) must be a positive integer, got {self.num_layers!r}")
        outside = [i for i in self.kda_layers if not 0 <= i < (self.num_layers or i + 1)]
        if outside:
            raise ConfigError(f"kda_layers {outside} lie outside the stack of {self.num_layers} layers")

    # Derived sizes -------------------------------------------------------------------
    @property
    def qkv(self) -> int:
        """H * D: the width of each of q, k, v."""
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """3 * H * D: q|k|v as the fused depthwise conv sees them."""
        return 3 * self.qkv

    @property
    def down_dim(self) -> int:
        """Width of the fused down projection f_a | g_a | b_proj: 2*D + H."""
        return 2 * self.head_dim + self.heads

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """FP32 [H, D_k, D_v], K-major."""
        return (self.heads, self.head_dim, self.head_dim)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """FP32 [conv_dim, K]: the last K conv inputs per channel, oldest first."""
        return (self.conv_dim, self.conv_kernel)

    @property
    def bounded(self) -> bool:
        return self.gate_law == GATE_BOUNDED

    def with_chunk(self, chunk: int) -> "KdaConfig":
        """The same block with another prefill chunk length."""
        return dataclasses.replace(self, chunk=chunk)

    def validate(self) -> "KdaConfig":
        """Check the limits the CUDA kernels impose; each error names the limit's reason.

        The NumPy oracle runs any geometry; only the GPU path calls this.
        """
        if self.head_dim != KERNEL_HEAD_DIM:
            raise ConfigError(
                f"head_dim={self.head_dim}: the recurrent and chunk kernels keep a state column of "
                f"exactly {KERNEL_HEAD_DIM} floats in registers (compile-time size)"
            )
        if self.conv_kernel > MAX_CONV_KERNEL:
            raise ConfigError(
                f"conv_kernel={self.conv_kernel}: the conv kernels keep the sliding window in "
                f"{MAX_CONV_KERNEL} registers"
            )
        if not 1 <= self.chunk <= MAX_CHUNK:
            raise ConfigError(
                f"chunk={self.chunk}: the chunk kernels hold a [chunk, chunk] attention tile and "
                f"[chunk, {self.head_dim}] tiles in shared memory; 1 <= chunk <= {MAX_CHUNK}"
            )
        if self.hidden % 8 or self.down_dim % 8:
            raise ConfigError(
                f"hidden={self.hidden}, 2*head_dim+heads={self.down_dim}: the GEMV kernels read "
                "rows in 16-byte vectors of 8 BF16, so both must be multiples of 8"
            )
        return self

    def describe(self) -> str:
        law = (
            f"bounded (lower bound {self.gate_lower_bound:g})" if self.bounded else "softplus (no bound)"
        )
        return (
            f"hidden {self.hidden}, heads {self.heads}, head_dim {self.head_dim}, qkv {self.qkv}, "
            f"conv kernel {self.conv_kernel}, gate {law}, rms_norm_eps {self.rms_norm_eps:g}"
        )

    # Reading config.json ---------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json", chunk: int = 64) -> "KdaConfig":
        """Build from a parsed config.json in any of the GLM-5.3-Flash or Kimi-Linear forms of
        docs/maths.md section 1 (flat GLM keys or `linear_attn_config`, either under `text_config`)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: expected a JSON object, got a {type(raw).__name__}")
        cfg = raw.get("text_config", raw)
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{source}: 'text_config' must be an object")
        model_type = str(cfg.get("model_type", raw.get("model_type", "")))

        def need(mapping: Mapping[str, Any], key: str, where: str, kind: type | None = None) -> Any:
            if key not in mapping:
                raise ConfigError(f"{source}: missing key '{where}{key}' (no default is assumed)")
            return mapping[key] if kind is None else _typed(mapping[key], kind, f"{where}{key}", source)

        hidden = need(cfg, "hidden_size", "", int)
        rms_norm_eps = need(cfg, "rms_norm_eps", "", float)
        num_layers = cfg.get("num_hidden_layers")
        if num_layers is not None:
            num_layers = _typed(num_layers, int, "num_hidden_layers", source)
            if num_layers < 1:
                raise ConfigError(f"{source}: key 'num_hidden_layers' = {num_layers} is not a positive layer count")
            if num_layers > _MAX_LAYERS:
                raise ConfigError(f"{source}: key 'num_hidden_layers' = {num_layers} is not a plausible layer count "
                                  f"(more than {_MAX_LAYERS})")

        lac = cfg.get("linear_attn_config")
        if isinstance(lac, Mapping):
            where = "linear_attn_config."
            names = ("num_heads", "head_dim", "short_conv_kernel_size")
            bound_key = "lower_bound" if "lower_bound" in lac and "gate_lower_bound" not in lac else "gate_lower_bound"
            heads, head_dim, conv_kernel = (need(lac, name, where, int) for name in names)
            if bound_key in lac:
                law, bound = GATE_BOUNDED, need(lac, bound_key, where, float)
            elif "kda_layers" in lac:
                # Kimi-Linear: the gate is -exp(A_log) * softplus(u), and the config has no bound.
                law, bound = GATE_SOFTPLUS, None
            else:
                raise ConfigError(
                    f"{source}: missing key '{where}gate_lower_bound' (or legacy '{where}lower_bound'); "
                    f"a config without a bound must list '{where}kda_layers' (Kimi-Linear softplus law)"
                )
            kda_layers = (_kda_layers_kimi(lac["kda_layers"], num_layers, source) if "kda_layers" in lac
                          else _kda_layers_glm(cfg, num_layers, source))
        elif "linear_num_heads" in cfg:
            where = ""
            names = ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")
            bound_key = "linear_lower_bound"
            heads, head_dim, conv_kernel = (need(cfg, name, where, int) for name in names)
            law, bound = GATE_BOUNDED, need(cfg, bound_key, "", float)
            kda_layers = _kda_layers_glm(cfg, num_layers, source)
        else:
            raise ConfigError(
                f"{source}: no KDA geometry: expected 'linear_attn_config' or 'linear_num_heads' "
                f"(model_type={model_type!r})"
            )
        # The config.json key each checked field came from, to name it when its value is refused.
        keys = {"hidden": "hidden_size", "rms_norm_eps": "rms_norm_eps", "gate_lower_bound": where + bound_key,
                **{name: where + key for name, key in zip(("heads", "head_dim", "conv_kernel"), names)}}
        # The conv's activation: read, not assumed (a loader that hard-codes SiLU is right only by accident).
        act = need(cfg, "hidden_act", "")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act={act!r}; the KDA conv activation is SiLU only")
        try:
            return cls(hidden=hidden, heads=heads, head_dim=head_dim, conv_kernel=conv_kernel, gate_law=law,
                       gate_lower_bound=bound, rms_norm_eps=rms_norm_eps, chunk=chunk, num_layers=num_layers,
                       kda_layers=kda_layers, model_type=model_type)
        except ConfigError as exc:  # a field's check: name the key of the file it came from
            named = f"key '{keys[exc.field]}': " if exc.field in keys else ""
            raise ConfigError(f"{source}: {named}{exc}") from None

    @classmethod
    def from_file(cls, path: str | Path, chunk: int = 64) -> "KdaConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(raw, source=str(path), chunk=chunk)

    @classmethod
    def from_pretrained(cls, dir_or_repo_id: str | Path, chunk: int = 64, **hub_kwargs: Any) -> "KdaConfig":
        """Read config.json from a checkpoint directory or a hub repo id (downloads only config.json)."""
        from .files import resolve_file

        return cls.from_file(resolve_file(dir_or_repo_id, "config.json", **hub_kwargs), chunk=chunk)


def _typed(value: Any, kind: type, key: str, source: str) -> Any:
    """value as an int (an integral JSON number) or a float (any finite JSON number), else a
    ConfigError naming the key and the file: null, a string, a bool or 127.9 for a count are
    refused, not converted."""
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{source}: key '{key}' = {value!r} is not a whole number")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise ConfigError(f"{source}: key '{key}' = {value!r} is not a finite number")


def _kda_layers_kimi(listed: Any, num_layers: int | None, source: str) -> tuple[int, ...]:
    """Kimi lists `linear_attn_config.kda_layers` 1-indexed; we speak 0-based layer indices everywhere."""
    if not isinstance(listed, (list, tuple)):
        raise ConfigError(f"{source}: linear_attn_config.kda_layers must be a list of layer numbers, got {listed!r}")
    one_based = [_typed(i, int, "linear_attn_config.kda_layers[]", source) for i in listed]
    if any(i < 1 for i in one_based):
        raise ConfigError(f"{source}: linear_attn_config.kda_layers is 1-indexed, found {min(one_based)}")
    if num_layers is not None and max(one_based, default=0) > num_layers:
        raise ConfigError(
            f"{source}: linear_attn_config.kda_layers lists layer {max(one_based)} (1-indexed) "
            f"but num_hidden_layers is {num_layers}"
        )
    return tuple(i - 1 for i in one_based)


# More layers than any model has: a larger count is a corrupt file (and would build lists that large).
_MAX_LAYERS = 100_000

# The `layer_types` entries that name a KDA layer; every other entry is another kind of layer.
_KDA_LAYER_TYPES = ("linear_attention", "kda")


def _kda_layers_glm(cfg: Mapping[str, Any], num_layers: int | None, source: str) -> tuple[int, ...]:
    """GLM-5.3-Flash: an explicit `layer_types` list when present, else every layer whose
    index % 4 != 3 (the fourth of each group is an MLA/DSA attention layer)."""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, (list, tuple)) or not all(isinstance(kind, str) for kind in types):
            raise ConfigError(f"{source}: key 'layer_types' must be a list of layer type names, got {types!r}")
        if num_layers is not None and len(types) != num_layers:
            raise ConfigError(f"{source}: key 'layer_types' lists {len(types)} layers, num_hidden_layers is {num_layers}")
        return tuple(i for i, kind in enumerate(types) if kind in _KDA_LAYER_TYPES)
    if num_layers is None:
        return ()
    return tuple(i for i in range(num_layers) if i % 4 != 3)


GLM_5_3_FLASH = dict(hidden=4096, heads=64, head_dim=128, conv_kernel=4, gate_law=GATE_BOUNDED,
                     gate_lower_bound=-5.0, rms_norm_eps=1e-5)
KIMI_LINEAR_48B = dict(hidden=2304, heads=32, head_dim=128, conv_kernel=4, gate_law=GATE_SOFTPLUS,
                       gate_lower_bound=None, rms_norm_eps=1e-5)
