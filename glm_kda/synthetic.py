"""Synthetic checkpoints with the real tensor names, shapes, dtypes and realistic scales.

They stand in for GLM-5.3-Flash and Kimi-Linear wherever the real weights are not at hand. Each tensor
is drawn from its own generator keyed by (seed, layer, release tensor name), so the same seed gives the
same arrays whatever the other layers, the layout or the sharding.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path
from typing import Sequence

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from .checkpoint import INDEX_FILE, LAYOUT_RELEASE, LAYOUT_TRANSFORMERS, SINGLE_FILE, attention_prefix, layer_prefix
from .config import GLM_5_3_FLASH, KIMI_LINEAR_48B, KdaConfig

BFLOAT16 = ml_dtypes.bfloat16

GLM_FORMS = ("flat", "linear_attn_config", "legacy", "text_config")
KIMI_FORMS = ("kimi",)

GLM_MODEL_TYPE = "glm5_next"
KIMI_MODEL_TYPE = "kimi_linear"
# The file that marks a directory as this writer's: it rewrites such a directory, and no other.
SYNTHETIC_MARKER = ".glm_kda_synthetic"

_TINY = dict(hidden=64, heads=2, head_dim=16, conv_kernel=4)
# Each named geometry: its KdaConfig fields and model_type.
_NAMED = {
    "glm": (GLM_5_3_FLASH, GLM_MODEL_TYPE),
    "kimi": (KIMI_LINEAR_48B, KIMI_MODEL_TYPE),
    "tiny-glm": ({**GLM_5_3_FLASH, **_TINY}, GLM_MODEL_TYPE),
    "tiny-kimi": ({**KIMI_LINEAR_48B, **_TINY}, KIMI_MODEL_TYPE),
}
GEOMETRIES = tuple(_NAMED)

# Small stand-ins so a synthetic stack has non-KDA tensors where a real one does:
# MLA/DSA attention in every fourth layer, an MLP in every layer.
_ATTENTION_STAND_INS = ("q_a_proj.weight", "kv_a_proj_with_mqa.weight")
_STAND_IN_ROWS = 8


# Kimi-Linear-48B-A3B's 27-layer stack as published: full attention at layers 4, 8, ..., 24 and 27
# (1-indexed), the last layer too.
KIMI_LINEAR_FULL_ATTENTION = (4, 8, 12, 16, 20, 24, 27)


def default_kda_layers(num_layers: int, kimi: bool = False) -> tuple[int, ...]:
    """0-based KDA layers of a synthetic stack: a full-attention layer fourth in each group of four
    (i % 4 == 3); a Kimi stack of the published 27 layers also ends on one (20 KDA layers)."""
    if kimi and num_layers == 27:
        return tuple(i for i in range(num_layers) if i + 1 not in KIMI_LINEAR_FULL_ATTENTION)
    return tuple(i for i in range(num_layers) if i % 4 != 3)


def synthetic_config(geometry: str | KdaConfig, num_layers: int | None = None) -> KdaConfig:
    """The KdaConfig of a named synthetic geometry (see GEOMETRIES), or `geometry` itself
    completed with a layer count (default 4) and KDA layer list (default_kda_layers) where it has none."""
    if isinstance(geometry, KdaConfig):
        layers = num_layers if num_layers is not None else geometry.num_layers or 4
        kda_layers = geometry.kda_layers if geometry.kda_layers and geometry.num_layers == layers else (
            default_kda_layers(layers, kimi=not geometry.bounded)
        )
        model_type = geometry.model_type or (GLM_MODEL_TYPE if geometry.bounded else KIMI_MODEL_TYPE)
        return dataclasses.replace(geometry, num_layers=layers, kda_layers=kda_layers, model_type=model_type)
    if not isinstance(geometry, str) or geometry not in _NAMED:
        raise ValueError(f"geometry must be a KdaConfig or one of {', '.join(GEOMETRIES)}; got {geometry!r}")
    layers = 4 if num_layers is None else num_layers
    base, model_type = _NAMED[geometry]
    kda_layers = default_kda_layers(layers, kimi=model_type == KIMI_MODEL_TYPE)
    return KdaConfig(**base, num_layers=layers, kda_layers=kda_layers, model_type=model_type)


def config_json(config: KdaConfig, form: str | None = None) -> dict:
    """config.json content for `config` in one of the forms real checkpoints use.

    Bounded law (GLM): "flat", "linear_attn_config", "legacy" (bound under `lower_bound`),
    "text_config" (linear_attn_config nested under text_config). Softplus law (Kimi):
    "kimi" (linear_attn_config with 1-indexed kda_layers and full_attn_layers, no bound).
    """
    if config.num_layers is None:
        raise ValueError("config.json needs num_layers")
    form = form or ("flat" if config.bounded else "kimi")
    allowed = GLM_FORMS if config.bounded else KIMI_FORMS
    if form not in allowed:
        raise ValueError(f"config form {form!r} does not fit the {config.gate_law} gate law; use one of {allowed}")
    common = {
        "model_type": config.model_type or (GLM_MODEL_TYPE if config.bounded else KIMI_MODEL_TYPE),
        "hidden_size": config.hidden,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": "silu",
        "num_hidden_layers": config.num_layers,
    }
    geometry = {
        "num_heads": config.heads,
        "head_dim": config.head_dim,
        "short_conv_kernel_size": config.conv_kernel,
    }
    if form == "kimi":
        kda = set(config.kda_layers)
        return {**common, "linear_attn_config": {
            **geometry,
            "kda_layers": [i + 1 for i in range(config.num_layers) if i in kda],
            "full_attn_layers": [i + 1 for i in range(config.num_layers) if i not in kda],
        }}
    text = dict(common)
    if config.kda_layers != default_kda_layers(config.num_layers):
        # GLM states a non-default stack with an explicit per-layer list.
        text["layer_types"] = [
            "linear_attention" if i in config.kda_layers else "full_attention" for i in range(config.num_layers)
        ]
    if form == "flat":
        text.update(
            linear_num_heads=config.heads,
            linear_head_dim=config.head_dim,
            linear_conv_kernel_dim=config.conv_kernel,
            linear_lower_bound=config.gate_lower_bound,
        )
        return text
    bound_key = "lower_bound" if form == "legacy" else "gate_lower_bound"
    text["linear_attn_config"] = {**geometry, bound_key: config.gate_lower_bound}
    if form == "text_config":
        return {"model_type": text["model_type"], "text_config": text}
    return text


# Tensor values -----------------------------------------------------------------------------
def _rng(seed: int, layer_idx: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, layer_idx, zlib.crc32(name.encode())])


def _linear(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """N(0, 1/fan_in) like a trained Linear; float32 draws, then one cast to BF16 (fast)."""
    weight = rng.standard_normal((rows, cols), dtype=np.float32)
    weight *= np.float32(1.0 / np.sqrt(cols))
    return weight.astype(BFLOAT16)


def _conv_taps(rng: np.random.Generator, channels: int, kernel: int) -> np.ndarray:
    """[channels, 1, K] BF16, U(-1/sqrt(K), 1/sqrt(K)) like torch's Conv1d init."""
    bound = 1.0 / np.sqrt(kernel)
    return rng.uniform(-bound, bound, size=(channels, 1, kernel)).astype(np.float32).astype(BFLOAT16)


def _dt_bias(rng: np.random.Generator, channels: int) -> np.ndarray:
    """[qkv] F32: softplus^-1(dt) for dt log-uniform in [1e-3, 1e-1] (values about -7 .. -2)."""
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=channels))
    return np.log(np.expm1(dt)).astype(np.float32)


def kda_layer_tensors(config: KdaConfig, layer_idx: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One KDA layer's 15 tensors by release name (relative to `model.layers.{i}.self_attn.`).

    A_log is [H] for the bounded (GLM) law and [1, 1, H, 1] for softplus (Kimi), as released.
    """
    hidden, heads, head_dim, qkv, kernel = (
        config.hidden, config.heads, config.head_dim, config.qkv, config.conv_kernel
    )

    def rng(name: str) -> np.random.Generator:
        return _rng(seed, layer_idx, name)

    a_log = np.log(rng("A_log").uniform(1.0, 16.0, size=heads)).astype(np.float32)
    o_norm = 1.0 + 0.1 * rng("o_norm.weight").standard_normal(head_dim, dtype=np.float32)
    return {
        "q_proj.weight": _linear(rng("q_proj.weight"), qkv, hidden),
        "k_proj.weight": _linear(rng("k_proj.weight"), qkv, hidden),
        "v_proj.weight": _linear(rng("v_proj.weight"), qkv, hidden),
        "q_conv1d.weight": _conv_taps(rng("q_conv1d.weight"), qkv, kernel),
        "k_conv1d.weight": _conv_taps(rng("k_conv1d.weight"), qkv, kernel),
        "v_conv1d.weight": _conv_taps(rng("v_conv1d.weight"), qkv, kernel),
        "f_a_proj.weight": _linear(rng("f_a_proj.weight"), head_dim, hidden),
        "f_b_proj.weight": _linear(rng("f_b_proj.weight"), qkv, head_dim),
        "dt_bias": _dt_bias(rng("dt_bias"), qkv),
        "A_log": a_log if config.bounded else a_log.reshape(1, 1, heads, 1),
        "b_proj.weight": _linear(rng("b_proj.weight"), heads, hidden),
        "g_a_proj.weight": _linear(rng("g_a_proj.weight"), head_dim, hidden),
        "g_b_proj.weight": _linear(rng("g_b_proj.weight"), qkv, head_dim),
        "o_norm.weight": o_norm.astype(BFLOAT16),
        "o_proj.weight": _linear(rng("o_proj.weight"), hidden, qkv),
    }


def _layer_tensors(config: KdaConfig, layer_idx: int, seed: int, layout: str,
                   conv_order: Sequence[str]) -> dict[str, np.ndarray]:
    """Every tensor of layer `layer_idx` by full name, in `layout`."""
    out: dict[str, np.ndarray] = {}
    attn = attention_prefix(layer_idx)
    if layer_idx in config.kda_layers:
        tensors = kda_layer_tensors(config, layer_idx, seed)
        # Written slot q holds the taps of conv_order[0], and so on: ("q", "k", "v") is correct.
        taps = [tensors.pop(f"{part}_conv1d.weight") for part in conv_order]
        if layout == LAYOUT_RELEASE:
            tensors.update({f"{part}_conv1d.weight": tap for part, tap in zip("qkv", taps)})
        else:
            tensors["conv1d.weight"] = np.concatenate(taps, axis=0)
            for name in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
                tensors[f"forget_gate.{name}"] = tensors.pop(name)
        out.update({attn + name: value for name, value in tensors.items()})
    else:
        for name in _ATTENTION_STAND_INS:
            out[attn + name] = _linear(_rng(seed, layer_idx, name), _STAND_IN_ROWS, config.hidden)
    out[layer_prefix(layer_idx) + "mlp.gate_proj.weight"] = _linear(
        _rng(seed, layer_idx, "mlp.gate_proj.weight"), _STAND_IN_ROWS, config.hidden
    )
    return out


def shard_filename(shard: int, shards: int) -> str:
    return f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"


def write_synthetic_checkpoint(path: str | Path, geometry: str | KdaConfig, *, layout: str = LAYOUT_RELEASE,
                               num_layers: int | None = None, seed: int = 0, shards: int = 1,
                               config_form: str | None = None, conv_order: Sequence[str] = ("q", "k", "v"),
                               progress: bool = False) -> Path:
    """Write config.json and the safetensors of a synthetic checkpoint into directory `path`.

    geometry: "glm", "kimi", "tiny-glm", "tiny-kimi" or a KdaConfig (its gate law picks the
    GLM or Kimi form). num_layers defaults to 4, so layer 3 is an attention layer. shards > 1
    writes model-0000i-of-0000N.safetensors (layers assigned contiguously) and
    model.safetensors.index.json. conv_order permutes the q, k, v conv taps as written, to
    make a deliberately wrong checkpoint. Returns `path`.
    """
    if layout not in (LAYOUT_RELEASE, LAYOUT_TRANSFORMERS):
        raise ValueError(f"layout must be {LAYOUT_RELEASE!r} or {LAYOUT_TRANSFORMERS!r}, got {layout!r}")
    if sorted(conv_order) != ["k", "q", "v"]:
        raise ValueError(f"conv_order must be a permutation of ('q', 'k', 'v'), got {conv_order!r}")
    config = synthetic_config(geometry, num_layers)
    assert config.num_layers is not None
    if not 1 <= shards <= config.num_layers:
        raise ValueError(f"shards must be in 1..{config.num_layers} (one layer at least per shard), got {shards}")

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / SYNTHETIC_MARKER).is_file():
        found = sorted(entry.name for entry in path.iterdir())[:5]
        raise ValueError(f"{path}: holds files this writer did not write ({', '.join(found)}, ...); a synthetic "
                         f"checkpoint goes into an empty directory or one it wrote before (marked {SYNTHETIC_MARKER})")
    path.mkdir(parents=True, exist_ok=True)
    (path / SYNTHETIC_MARKER).write_text("written by glm_kda.synthetic.write_synthetic_checkpoint\n")
    # A checkpoint written here before in another sharding would otherwise be what binds: the index
    # is read first. Only the files this writer names go.
    for stale in (path / INDEX_FILE, path / SINGLE_FILE, *path.glob("model-*-of-*.safetensors")):
        stale.unlink(missing_ok=True)
    (path / "config.json").write_text(json.dumps(config_json(config, config_form), indent=2) + "\n")

    weight_map: dict[str, str] = {}
    total_size = 0
    layer_groups = np.array_split(np.arange(config.num_layers), shards)
    bar = tqdm(total=config.num_layers, desc="synthetic layers", unit="layer", disable=not progress)
    for shard, layers in enumerate(layer_groups):
        tensors: dict[str, np.ndarray] = {}
        for layer_idx in layers:
            tensors.update(_layer_tensors(config, int(layer_idx), seed, layout, conv_order))
            bar.update(1)
        if shard == shards - 1:
            tensors["model.norm.weight"] = np.ones(config.hidden, dtype=BFLOAT16)
        filename = SINGLE_FILE if shards == 1 else shard_filename(shard, shards)
        save_file(tensors, str(path / filename), metadata={"format": "pt"})
        weight_map.update({name: filename for name in tensors})
        total_size += sum(int(value.nbytes) for value in tensors.values())
        del tensors
    bar.close()
    if shards > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return path


def synthetic_hidden(tokens: int, hidden: int, seed: int = 0) -> np.ndarray:
    """[T, hidden] BF16 activations with RMS about 1, like the normed input of a block."""
    rng = np.random.default_rng([seed, tokens, hidden])
    return rng.standard_normal((tokens, hidden), dtype=np.float32).astype(BFLOAT16)
