"""Read one KDA layer's weights from a safetensors checkpoint (local directory or hub repo).

Only the requested layer's tensors are read, and for a hub repo only the shards holding them are downloaded.
Every name, shape and dtype is checked against the KdaConfig before any data is read. The "release" and
"transformers" layouts bind to the same arrays (docs/maths.md, section 2).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, NamedTuple

import ml_dtypes
import numpy as np
from huggingface_hub import get_safetensors_metadata, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
from safetensors import safe_open
from tqdm.auto import tqdm

from .config import KdaConfig
from .files import CheckpointError, _local_dir, resolve_file  # noqa: F401 (re-exported)

LAYOUT_RELEASE = "release"
LAYOUT_TRANSFORMERS = "transformers"

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

BF16 = "BF16"
F32 = "F32"

# A safetensors header is JSON; anything larger than this is a corrupt length prefix.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def layer_prefix(layer_idx: int) -> str:
    """Every tensor of layer i starts with this (attention, MLP and norms alike)."""
    return f"model.layers.{layer_idx}."


def attention_prefix(layer_idx: int) -> str:
    """The KDA block's tensors of layer i start with this."""
    return f"model.layers.{layer_idx}.self_attn."


# Where files come from ------------------------------------------------------------------
class TensorEntry(NamedTuple):
    """One tensor of a safetensors header: dtype, shape and its bytes [begin, end) in the file
    (None for a header fetched from the hub without the file)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int | None = None
    end: int | None = None


def _read_at(handle: BinaryIO, offset: int, length: int) -> bytes:
    handle.seek(offset)
    return handle.read(length)


def read_safetensors_entries(path: str | Path, read: Callable[[int, int], Any] | None = None) -> dict[str, TensorEntry]:
    """{tensor name: TensorEntry} from a safetensors file's header; no tensor data is read.

    The file is an 8-byte little-endian header length, the header JSON, then the data; each
    tensor's `data_offsets` count from the start of the data. read(offset, length) returns the
    file's bytes there (default: a plain read of the file).
    """
    path = Path(path)
    if read is None:
        with open(path, "rb") as handle:
            return read_safetensors_entries(path, functools.partial(_read_at, handle))
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    length = int.from_bytes(bytes(read(0, 8)), "little")
    if length > _MAX_HEADER_BYTES or 8 + length > size:
        raise CheckpointError(f"{path}: not a safetensors file (header length {length})")
    try:
        header = json.loads(bytes(read(8, length)))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: unreadable safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    entries = {}
    for name, info in header.items():
        try:
            begin, end = (8 + length + int(n) for n in info["data_offsets"])
            entries[name] = TensorEntry(str(info["dtype"]), tuple(int(n) for n in info["shape"]), begin, end)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: header entry of '{name}' lacks dtype, shape or data_offsets ({exc})") from None
        # A shard cut short (an interrupted download) is named here, before any data is read.
        if end > size:
            raise CheckpointError(f"{path}: truncated: tensor '{name}' ends at byte {end}, the file at {size}")
    return entries


def read_safetensors_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header; no tensor data is read."""
    return {name: (entry.dtype, entry.shape) for name, entry in read_safetensors_entries(path).items()}


class _Checkpoint:
    """The safetensors files of a local directory or a hub repo, opened on demand: weight_map(),
    header(file), path(file) (a download for a hub repo; header() reads remotely with headers_only)."""

    def __init__(self, location: str | Path, hub_kwargs: dict[str, Any], *, headers_only: bool = False):
        self.location = location
        self.local = _local_dir(location)
        self.hub_kwargs = hub_kwargs
        self.headers_only = headers_only
        self.index_name: str | None = None
        self._weight_map: dict[str, str] | None = None
        self._headers: dict[str, dict[str, TensorEntry]] = {}
        self._downloaded: dict[str, Path] = {}
        if self.local is not None and not self.local.is_dir():
            raise CheckpointError(f"{self.local}: no such checkpoint directory")

    def __str__(self) -> str:
        return str(self.local) if self.local is not None else f"hub repo '{self.location}'"

    def weight_map(self) -> dict[str, str]:
        if self._weight_map is None:
            self._weight_map = self._find_weight_map()
        return self._weight_map

    def _find_weight_map(self) -> dict[str, str]:
        if self.local is None and self.headers_only:
            return self._remote_metadata()
        index = self._optional_file(INDEX_FILE)
        if index is not None:
            self.index_name = INDEX_FILE
            try:
                raw = json.loads(index.read_text())
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{self} {INDEX_FILE}: not valid JSON ({exc})") from None
            weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{self} {INDEX_FILE}: no 'weight_map' object")
            return {str(name): str(file) for name, file in weight_map.items()}
        if self._optional_file(SINGLE_FILE) is not None:
            files = [SINGLE_FILE]
        elif self.local is not None:
            # No index: any set of *.safetensors; their headers say who holds what.
            files = sorted(p.name for p in self.local.glob("*.safetensors"))
        else:
            raise CheckpointError(
                f"{self}: has neither {INDEX_FILE} nor {SINGLE_FILE} (or they are not in the local cache while offline)"
            )
        if not files:
            raise CheckpointError(
                f"{self}: no safetensors files ({INDEX_FILE}, {SINGLE_FILE} or any *.safetensors)"
            )
        weight_map: dict[str, str] = {}
        for file in files:
            for name in self.header(file):
                if name in weight_map:
                    raise CheckpointError(f"{self}: tensor '{name}' is in both {weight_map[name]} and {file}")
                weight_map[name] = file
        return weight_map

    def _optional_file(self, filename: str) -> Path | None:
        if self.local is not None:
            path = self.local / filename
            return path if path.is_file() else None
        try:
            path = Path(hf_hub_download(repo_id=str(self.location), filename=filename, **self.hub_kwargs))
        except EntryNotFoundError:
            return None
        self._downloaded[filename] = path
        return path

    def _remote_metadata(self) -> dict[str, str]:
        keys = ("repo_type", "revision", "token")
        metadata = get_safetensors_metadata(
            str(self.location), **{k: v for k, v in self.hub_kwargs.items() if k in keys}
        )
        for file, file_metadata in metadata.files_metadata.items():
            self._headers[file] = {
                name: TensorEntry(info.dtype, tuple(info.shape)) for name, info in file_metadata.tensors.items()
            }
        self.index_name = INDEX_FILE if metadata.sharded else None
        return dict(metadata.weight_map)

    def path(self, filename: str) -> Path:
        if self.local is not None:
            path = self.local / filename
            if not path.is_file():
                if self.index_name is not None:
                    raise CheckpointError(f"{self.index_name} names shard '{filename}', which is not in {self.local}")
                raise CheckpointError(f"{self.local}: no file '{filename}'")
            return path
        if filename not in self._downloaded:
            self._downloaded[filename] = resolve_file(self.location, filename, **self.hub_kwargs)
        return self._downloaded[filename]

    def header(self, filename: str) -> dict[str, TensorEntry]:
        if filename not in self._headers:
            if self.local is None and self.headers_only:
                self.weight_map()
                if filename not in self._headers:
                    raise CheckpointError(f"{self}: no header for shard '{filename}'")
            else:
                self._headers[filename] = self.read_entries(self.path(filename))
        return self._headers[filename]

    def read_entries(self, path: Path) -> dict[str, TensorEntry]:
        return read_safetensors_entries(path)


# What one layer must hold -----------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """One tensor a KDA layer must hold: name under `model.layers.{i}.self_attn.`, accepted
    shapes (the first is the canonical one), dtype, and the BoundLayer field it goes into."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    field: str


def expected_tensors(config: KdaConfig, layout: str) -> tuple[TensorSpec, ...]:
    """The tensors of one KDA layer in `layout`, in the order of docs/maths.md section 2 (and of
    BoundLayer's fields)."""
    hidden, heads, head_dim, qkv, kernel = (
        config.hidden, config.heads, config.head_dim, config.qkv, config.conv_kernel
    )
    if layout == LAYOUT_RELEASE:
        conv = tuple(TensorSpec(f"{part}_conv1d.weight", ((qkv, 1, kernel),), BF16, "conv_weight") for part in "qkv")
        gate = ""
    elif layout == LAYOUT_TRANSFORMERS:
        conv = (TensorSpec("conv1d.weight", ((3 * qkv, 1, kernel),), BF16, "conv_weight"),)
        gate = "forget_gate."
    else:
        raise ValueError(f"layout must be {LAYOUT_RELEASE!r} or {LAYOUT_TRANSFORMERS!r}, got {layout!r}")
    return (
        TensorSpec("q_proj.weight", ((qkv, hidden),), BF16, "q_proj"),
        TensorSpec("k_proj.weight", ((qkv, hidden),), BF16, "k_proj"),
        TensorSpec("v_proj.weight", ((qkv, hidden),), BF16, "v_proj"),
        *conv,
        TensorSpec(f"{gate}f_a_proj.weight", ((head_dim, hidden),), BF16, "f_a"),
        TensorSpec(f"{gate}f_b_proj.weight", ((qkv, head_dim),), BF16, "f_b"),
        # dt_bias is per CHANNEL (H*D), A_log per HEAD: mixing them up is the classic bug.
        TensorSpec(f"{gate}dt_bias", ((qkv,),), F32, "dt_bias"),
        # A_log: [H] on GLM, [1, 1, H, 1] on Kimi (broadcast over [B, T, H, D]).
        TensorSpec(f"{gate}A_log", ((heads,), (1, 1, heads, 1)), F32, "a_log"),
        TensorSpec("b_proj.weight", ((heads, hidden),), BF16, "b_proj"),
        TensorSpec("g_a_proj.weight", ((head_dim, hidden),), BF16, "g_a"),
        TensorSpec("g_b_proj.weight", ((qkv, head_dim),), BF16, "g_b"),
        TensorSpec("o_norm.weight", ((head_dim,),), BF16, "o_norm"),
        TensorSpec("o_proj.weight", ((hidden, qkv),), BF16, "o_proj"),
    )


_RELEASE_MARKERS = frozenset(
    ["q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"]
)


def _detect_layout(relative_names: Iterable[str]) -> tuple[str, bool]:
    """(layout, mixed): transformers when the fused conv or forget_gate names are present."""
    names = set(relative_names)
    transformers = "conv1d.weight" in names or any(n.startswith("forget_gate.") for n in names)
    release = bool(names & _RELEASE_MARKERS)
    return (LAYOUT_TRANSFORMERS if transformers else LAYOUT_RELEASE), (transformers and release)


def _fmt_shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(n)) for n in shape) + "]"


def _fmt_shapes(shapes: Iterable[Iterable[int]]) -> str:
    return " or ".join(_fmt_shape(s) for s in shapes)


def _near_names(name: str, candidates: list[str], expected: set[str], layer_idx: int) -> list[str]:
    """Up to 4 existing names of the layer like `name`: unexpected ones first (a renamed
    tensor), then expected siblings. Names are compared without the shared prefix and the
    `.weight` suffix; one that ends with the other's name (moved under a sub-module) or
    starts with it (shortened) counts as near."""

    def key(full: str) -> str:
        short = full[len(layer_prefix(layer_idx)):]
        short = short[len("self_attn."):] if short.startswith("self_attn.") else short
        return short[: -len(".weight")] if short.endswith(".weight") else short

    target = key(name)

    def score(candidate: str) -> float:
        other = key(candidate)
        if other.endswith("." + target) or target.endswith("." + other):
            return 1.0
        if min(len(target), len(other)) >= 3 and (target.startswith(other) or other.startswith(target)):
            return 0.9
        return difflib.SequenceMatcher(None, target, other).ratio()

    def best(pool: list[str], count: int) -> list[str]:
        scored = sorted(((score(c), c) for c in pool), key=lambda sc: -sc[0])
        return [c for s, c in scored if s >= 0.6][:count]

    near = best([c for c in candidates if c not in expected], 4)
    return near + best([c for c in candidates if c in expected], 4 - len(near))


@dataclass(frozen=True)
class _LayerPlan:
    """Result of checking one layer against the headers: what to read and from where."""

    layout: str
    files: dict[str, str]  # full tensor name -> file holding it
    problems: tuple[str, ...]


def _plan_layer(ckpt: _Checkpoint, config: KdaConfig, layer_idx: int) -> _LayerPlan:
    """Check every KDA tensor of layer `layer_idx` from the headers only."""
    weight_map = ckpt.weight_map()
    in_layer = sorted(n for n in weight_map if n.startswith(layer_prefix(layer_idx)))
    prefix = attention_prefix(layer_idx)
    relative = [n[len(prefix):] for n in in_layer if n.startswith(prefix)]
    layout, mixed = _detect_layout(relative)
    specs = expected_tensors(config, layout)
    where = f"layer {layer_idx}"

    if not any(prefix + spec.name in weight_map for spec in specs):
        if relative:
            return _LayerPlan(layout, {}, (
                f"{where} is an attention (MLA/DSA) layer, not KDA: it has none of the KDA tensors "
                f"under '{prefix}' (found {', '.join(relative[:6])})",
            ))
        return _LayerPlan(layout, {}, (
            f"{where}: no tensors under '{prefix}' in {ckpt}"
            + (f" (the layer has {', '.join(in_layer[:6])})" if in_layer else ""),
        ))

    problems: list[str] = []
    if mixed:
        problems.append(
            f"{where}: mixes release names (q_conv1d, f_a_proj, ...) and transformers names "
            f"(conv1d, forget_gate.) under '{prefix}'"
        )
    files: dict[str, str] = {}
    for spec in specs:
        name = prefix + spec.name
        expected = f"{_fmt_shapes(spec.shapes)} {spec.dtype}"
        if name not in weight_map:
            near = _near_names(name, in_layer, {prefix + s.name for s in specs}, layer_idx)
            hint = (
                f"near names: {', '.join(near)}" if near
                else f"names under '{layer_prefix(layer_idx)}': {', '.join(in_layer[:8]) or 'none'}"
            )
            problems.append(f"{where}: missing tensor '{name}' (expected {expected}, {layout} layout); {hint}")
            continue
        file = weight_map[name]
        try:
            header = ckpt.header(file)
        except CheckpointError as exc:
            problems.append(f"{where}: tensor '{name}' (expected {expected}): {exc}")
            continue
        if name not in header:
            problems.append(f"{where}: tensor '{name}' is mapped to '{file}', whose header lacks it")
            continue
        dtype, shape = header[name].dtype, header[name].shape
        if shape not in spec.shapes:
            problems.append(
                f"{where}: tensor '{name}' has wrong shape: expected {_fmt_shapes(spec.shapes)}, "
                f"found {_fmt_shape(shape)}"
            )
        if dtype != spec.dtype:
            problems.append(f"{where}: tensor '{name}' has wrong dtype: expected {spec.dtype}, found {dtype}")
        files[name] = file
    return _LayerPlan(layout, files, tuple(problems))


# The bound layer -------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class BoundLayer:
    """One KDA layer's weights on the host, checked against `config`.

    Shapes (hidden = model width, H heads, D head_dim, qkv = H*D, K conv taps):

        q_proj, k_proj, v_proj  [qkv, hidden]  BF16   torch Linear layout [out, in]
        conv_weight             [3*qkv, K]     BF16   q|k|v depthwise taps, in that order
        f_a                     [D, hidden]    BF16   forget gate, low rank down
        f_b                     [qkv, D]       BF16   forget gate, low rank up
        dt_bias                 [qkv]          F32    per channel
        a_log                   [H]            F32    per head
        b_proj                  [H, hidden]    BF16   beta logits
        g_a                     [D, hidden]    BF16   output gate, low rank down
        g_b                     [qkv, D]       BF16   output gate, low rank up
        o_norm                  [D]            BF16   gated RMSNorm weight
        o_proj                  [hidden, qkv]  BF16   output projection

    BF16 arrays are numpy arrays of dtype ml_dtypes.bfloat16. `layout` records which
    naming the checkpoint used ("release" or "transformers"); the arrays are the same.
    """

    layer_idx: int
    config: KdaConfig
    layout: str
    q_proj: np.ndarray
    k_proj: np.ndarray
    v_proj: np.ndarray
    conv_weight: np.ndarray
    f_a: np.ndarray
    f_b: np.ndarray
    dt_bias: np.ndarray
    a_log: np.ndarray
    b_proj: np.ndarray
    g_a: np.ndarray
    g_b: np.ndarray
    o_norm: np.ndarray
    o_proj: np.ndarray

    ARRAY_FIELDS = (
        "q_proj", "k_proj", "v_proj", "conv_weight", "f_a", "f_b", "dt_bias", "a_log",
        "b_proj", "g_a", "g_b", "o_norm", "o_proj",
    )

    @property
    def qkv_weight(self) -> np.ndarray:
        """[3*qkv, hidden] BF16: q|k|v rows, so one GEMM writes the conv input in q, k, v order."""
        return np.concatenate([self.q_proj, self.k_proj, self.v_proj], axis=0)

    @property
    def down_weight(self) -> np.ndarray:
        """[2*D + H, hidden] BF16: f_a | g_a | b_proj rows, the three GEMMs that read x and are narrow."""
        return np.concatenate([self.f_a, self.g_a, self.b_proj], axis=0)

    def arrays(self) -> dict[str, np.ndarray]:
        """The 13 weight arrays by field name."""
        return {name: getattr(self, name) for name in self.ARRAY_FIELDS}

    @staticmethod
    def shapes(config: KdaConfig) -> dict[str, tuple[int, ...]]:
        """The shape of every array field for `config` (the table above), by field name."""
        c = config
        return {
            "q_proj": (c.qkv, c.hidden), "k_proj": (c.qkv, c.hidden), "v_proj": (c.qkv, c.hidden),
            "conv_weight": (c.conv_dim, c.conv_kernel), "f_a": (c.head_dim, c.hidden), "f_b": (c.qkv, c.head_dim),
            "dt_bias": (c.qkv,), "a_log": (c.heads,), "b_proj": (c.heads, c.hidden), "g_a": (c.head_dim, c.hidden),
            "g_b": (c.qkv, c.head_dim), "o_norm": (c.head_dim,), "o_proj": (c.hidden, c.qkv),
        }


def _check_layer_index(config: KdaConfig, layer_idx: int) -> None:
    if not isinstance(layer_idx, (int, np.integer)) or isinstance(layer_idx, bool):
        raise TypeError(f"layer_idx must be an int (0-based), got {type(layer_idx).__name__} {layer_idx!r}")
    if layer_idx < 0 or (config.num_layers is not None and layer_idx >= config.num_layers):
        stack = f"the stack of {config.num_layers} layers" if config.num_layers is not None else "the stack"
        raise CheckpointError(f"layer {layer_idx} is outside {stack}")
    if config.kda_layers and layer_idx not in config.kda_layers:
        raise CheckpointError(
            f"layer {layer_idx} is an attention (MLA/DSA) layer, not KDA; "
            f"KDA layers: {', '.join(str(i) for i in config.kda_layers)}"
        )


def all_finite(tensor: np.ndarray) -> bool:
    """Whether every value of a weight is finite. A 2-byte float (BF16, F16) is judged on its bits,
    the exponent all ones being Inf or NaN: one integer pass, no FP32 copy of the tensor."""
    if tensor.dtype in (ml_dtypes.bfloat16, np.float16):
        mask = 0x7C00 if tensor.dtype == np.float16 else 0x7F80
        bits = np.ascontiguousarray(tensor).view(np.uint16)
        return bits.size == 0 or int((bits & 0x7FFF).max()) < mask
    return bool(np.isfinite(tensor).all())


def bind_layer(path_or_repo: str | Path, layer_idx: int, config: KdaConfig | None = None, *, progress: bool = True,
               **hub_kwargs: Any) -> BoundLayer:
    """Read and check KDA layer `layer_idx` of a checkpoint directory or hub repo id.

    The config is read from the checkpoint's config.json unless given. Files: a single
    model.safetensors, a sharded checkpoint with model.safetensors.index.json, or (local
    only) any set of *.safetensors. Only this layer's tensors are read; from a hub repo
    only config.json, the index and the shards holding them are downloaded (hub_kwargs go
    to hf_hub_download). progress: a progress bar over the tensors read.
    """
    if config is None:
        config = KdaConfig.from_pretrained(path_or_repo, **hub_kwargs)
    elif not isinstance(config, KdaConfig):
        raise TypeError(f"bind_layer: config must be a KdaConfig or None (read from config.json), got "
                        f"{type(config).__name__}")
    _check_layer_index(config, layer_idx)
    ckpt = _Checkpoint(path_or_repo, hub_kwargs)
    plan = _plan_layer(ckpt, config, layer_idx)
    if plan.problems:
        raise CheckpointError("\n".join(plan.problems))

    # A field stored as several tensors (release conv taps: q, k, v) is their rows in that order.
    parts: dict[str, list[np.ndarray]] = {}
    handles: dict[Path, Any] = {}  # one open handle per shard, its header parsed once
    with tqdm(total=len(plan.files), desc=f"layer {layer_idx}", unit="tensor",
              disable=None if progress else True, leave=False) as bar, contextlib.ExitStack() as opened:
        for spec in expected_tensors(config, plan.layout):
            name = attention_prefix(layer_idx) + spec.name
            path = ckpt.path(plan.files[name])
            if path not in handles:
                handles[path] = opened.enter_context(safe_open(str(path), framework="numpy"))
            tensor = handles[path].get_tensor(name)
            # Checked once here (a pass over the layer's bytes), so no kernel sees them.
            if not all_finite(tensor):
                bad = int(np.size(tensor) - np.count_nonzero(np.isfinite(tensor.astype(np.float32))))
                raise CheckpointError(f"{path}: tensor '{name}' holds {bad} NaN or Inf values")
            parts.setdefault(spec.field, []).append(tensor)
            bar.update(1)
    shapes = BoundLayer.shapes(config)
    arrays = {field: _join_rows(pieces).reshape(shapes[field]) for field, pieces in parts.items()}
    return BoundLayer(layer_idx=layer_idx, config=config, layout=plan.layout, **arrays)


def _join_rows(pieces: list[np.ndarray]) -> np.ndarray:
    """The pieces' rows one after another (the one piece itself, uncopied)."""
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def check_layers(path_or_repo: str | Path, config: KdaConfig | None = None,
                 **hub_kwargs: Any) -> list[tuple[int, bool, str]]:
    """[(layer_idx, ok, message)] for every KDA layer, from the safetensors headers only.

    No tensor data is read. For a hub repo the headers are fetched remotely (only
    config.json is downloaded). The layers checked are config.kda_layers, or, when the
    config does not say, every layer that holds KDA tensors.
    """
    if config is None:
        config = KdaConfig.from_pretrained(path_or_repo, **hub_kwargs)
    ckpt = _Checkpoint(path_or_repo, hub_kwargs, headers_only=True)
    layers = list(config.kda_layers)
    if not layers:
        # q_conv1d.weight (release) and conv1d.weight (transformers) exist only in KDA layers.
        found = {
            int(name.split(".")[2])
            for name in ckpt.weight_map()
            if name.startswith("model.layers.") and name.endswith("conv1d.weight") and ".self_attn." in name
            and name.split(".")[2].isdigit()
        }
        layers = sorted(found)
    report = []
    for layer_idx in layers:
        plan = _plan_layer(ckpt, config, layer_idx)
        if plan.problems:
            report.append((layer_idx, False, "\n".join(plan.problems)))
        else:
            report.append((layer_idx, True, f"{plan.layout} layout, {len(plan.files)} tensors match"))
    return report
