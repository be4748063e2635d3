"""Tensor parallelism for one KDA block: H heads split over tp_size GPUs, one all-reduce.

TensorParallelPlan splits weights and states on the host; bind_layer_shard reads only a rank's byte ranges of a
safetensors checkpoint; TpRankLayer is one rank on its GPU (one process per GPU, NCCL communicator given);
TensorParallelBlock drives every rank from one process (notebooks). Why the ranks add FP32 sums and round once,
and when decode_k stays bit-identical to K decodes: docs/design.md, "Tensor parallel".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import mmap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from .checkpoint import (
    BF16,
    F32,
    BoundLayer,
    CheckpointError,
    TensorEntry,
    _Checkpoint,
    _check_layer_index,
    _join_rows,
    _plan_layer,
    all_finite,
    attention_prefix,
    expected_tensors,
    read_safetensors_entries,
)
from .config import KdaConfig
from .state import KdaState, array_module, require_one_row, require_state


class TensorParallelError(ValueError):
    """A tensor-parallel split that cannot be made: tp_size, rank, devices or shapes."""


# The plan ---------------------------------------------------------------------------------
class TensorParallelPlan:
    """Which part of one KDA block rank r of `tp_size` owns (docs/design.md, "Tensor parallel"), as
    slices over the full block's axes: head_slice(r) of the heads [H]; channel_slice(r) of the
    channels [qkv] of q, k or v, f_b, g_b, dt_bias and o_proj's input; conv_channel_slices(r), its
    q, k and v rows of the fused conv and conv state [3*qkv]; rows(name, r), of any BoundLayer array.
    """

    def __init__(self, config: KdaConfig, tp_size: int):
        if isinstance(tp_size, bool) or not isinstance(tp_size, (int, np.integer)) or tp_size < 1:
            raise TensorParallelError(f"tp_size must be a positive integer, got {tp_size!r}")
        tp_size = int(tp_size)
        if config.heads % tp_size:
            raise TensorParallelError(
                f"tp_size={tp_size} does not divide heads={config.heads}: every rank takes whole "
                f"heads, so tp_size must be one of {[d for d in range(1, config.heads + 1) if config.heads % d == 0]}"
            )
        self.config = config
        self.tp_size = tp_size
        self.heads_per_rank = config.heads // tp_size
        self.channels_per_rank = self.heads_per_rank * config.head_dim

    def __repr__(self) -> str:
        return (f"TensorParallelPlan(tp_size={self.tp_size}, {self.heads_per_rank} of {self.config.heads} "
                f"heads per rank; {self.config.describe()})")

    def check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.tp_size:
            raise TensorParallelError(
                f"rank {rank!r} is outside [0, {self.tp_size}) for tp_size={self.tp_size}"
            )
        return int(rank)

    def ranks(self) -> range:
        return range(self.tp_size)

    def head_slice(self, rank: int) -> slice:
        rank = self.check_rank(rank)
        return slice(rank * self.heads_per_rank, (rank + 1) * self.heads_per_rank)

    def channel_slice(self, rank: int) -> slice:
        rank = self.check_rank(rank)
        return slice(rank * self.channels_per_rank, (rank + 1) * self.channels_per_rank)

    def conv_channel_slices(self, rank: int) -> tuple[slice, slice, slice]:
        """The rank's rows of the fused conv [3*qkv, K] and of the conv state: its q, k and v
        channels, three ranges qkv apart (q|k|v follow each other in the fused layout)."""
        channels = self.channel_slice(rank)
        qkv = self.config.qkv
        return tuple(slice(part * qkv + channels.start, part * qkv + channels.stop) for part in range(3))

    def rank_config(self, rank: int) -> KdaConfig:
        """The KdaConfig rank r's KdaLayer is built from: H/tp heads, everything else equal."""
        self.check_rank(rank)
        return dataclasses.replace(self.config, heads=self.heads_per_rank)

    def rows(self, name: str, rank: int) -> tuple[slice, ...]:
        """Rank r's rows of BoundLayer array `name`: its channels, heads, q/k/v conv rows, or
        every row of a replicated one (f_a, g_a, o_norm); for o_proj, its columns."""
        if name == "conv_weight":
            return self.conv_channel_slices(rank)
        if name in ("a_log", "b_proj"):
            return (self.head_slice(rank),)
        if name in ("f_a", "g_a", "o_norm"):
            self.check_rank(rank)
            return (slice(0, self.config.head_dim),)
        return (self.channel_slice(rank),)

    # Weights ------------------------------------------------------------------------------
    def shard(self, bound: BoundLayer, rank: int) -> BoundLayer:
        """Rank r's weights cut from an already bound full layer (host copies, contiguous, so the
        shard does not keep the full layer alive)."""
        rank = self.check_rank(rank)
        if bound.config != self.config:
            raise TensorParallelError(
                f"layer {bound.layer_idx} was bound with a config that differs from the plan's in "
                f"{_config_differences(bound.config, self.config)}"
            )
        arrays = {name: np.concatenate([array[rows] for rows in self.rows(name, rank)])
                  for name, array in bound.arrays().items() if name != "o_proj"}
        # o_proj [hidden, qkv] is split by its INPUT columns; the ranks' outputs are summed.
        arrays["o_proj"] = np.ascontiguousarray(bound.o_proj[:, self.channel_slice(rank)])
        return BoundLayer(layer_idx=bound.layer_idx, config=self.rank_config(rank), layout=bound.layout, **arrays)

    # State --------------------------------------------------------------------------------
    def state_slice(self, state: KdaState, rank: int) -> KdaState:
        """Rank r's part of a full state (NumPy or CuPy, copies): conv rows of its q, k and v
        channels [3*qkv/tp, K], recurrent state of its heads [H/tp, D, D]."""
        rank = self.check_rank(rank)
        state.check(self.config, "state")
        xp = array_module(state.conv)
        # CuPy launches on the current device: make it the state's.
        with contextlib.nullcontext() if xp is np else state.conv.device:
            conv = xp.concatenate([state.conv[part] for part in self.conv_channel_slices(rank)], axis=0)
            return KdaState(xp.ascontiguousarray(conv), state.recurrent[self.head_slice(rank)].copy())

    def gather_states(self, states: Sequence[KdaState]) -> KdaState:
        """The full state from the ranks' states, in rank order. NumPy states give NumPy;
        device states (each on its rank's GPU) come back to the host."""
        if len(states) != self.tp_size:
            raise TensorParallelError(f"gather_states: got {len(states)} states for tp_size={self.tp_size}")
        host = not all(isinstance(s.conv, np.ndarray) and isinstance(s.recurrent, np.ndarray) for s in states)
        parts = [s.to_numpy() if host else s for s in states]
        for rank, part in enumerate(parts):
            part.check(self.rank_config(rank), f"states[{rank}]")
        width = self.channels_per_rank
        # Each rank's conv rows are its q | k | v channels; the full conv is all q, then all k, then all v.
        conv = np.concatenate(
            [part.conv[i * width : (i + 1) * width] for i in range(3) for part in parts], axis=0
        )
        recurrent = np.concatenate([part.recurrent for part in parts], axis=0)
        return KdaState(conv, recurrent)


def _config_differences(actual: KdaConfig, expected: KdaConfig) -> str:
    fields = [f.name for f in dataclasses.fields(KdaConfig)]
    differ = [f"{name} ({getattr(actual, name)!r} vs {getattr(expected, name)!r})"
              for name in fields if getattr(actual, name) != getattr(expected, name)]
    return ", ".join(differ) or "nothing"


# Reading only one rank's bytes ------------------------------------------------------------
_NUMPY_DTYPES = {BF16: np.dtype(ml_dtypes.bfloat16), F32: np.dtype("<f4")}


def _open_binary(path: Path) -> BinaryIO:
    """Every file read of bind_layer_shard goes through here (tests count the bytes)."""
    return open(path, "rb")


@dataclass
class ShardReadStats:
    """What one bind_layer_shard call read.

    bytes_read: bytes returned by file reads (safetensors headers and the row ranges).
    bytes_mapped: bytes of the pages the o_proj column copy touched through the memory map
        (whole pages: what the OS reads at most, before read-ahead).
    reads: (file, offset, length) of every file read, in order.
    """

    bytes_read: int = 0
    bytes_mapped: int = 0
    reads: list[tuple[str, int, int]] = field(default_factory=list)


def _read_exactly(handle: BinaryIO, path: Path, offset: int, length: int, stats: ShardReadStats) -> np.ndarray:
    """`length` bytes at `offset`, as a uint8 array."""
    buffer = np.empty(length, np.uint8)
    handle.seek(offset)
    view = memoryview(buffer).cast("B")
    got = 0
    while got < length:
        count = handle.readinto(view[got:])
        if not count:
            break
        got += count
    stats.bytes_read += got
    stats.reads.append((path.name, offset, got))
    if got != length:
        raise CheckpointError(f"{path}: truncated: wanted bytes [{offset}, {offset + length}), the file ends at {offset + got}")
    return buffer


class _RangeCheckpoint(_Checkpoint):
    """A checkpoint whose headers are read through _open_binary, into `stats`; the layer is
    checked by the same code and with the same messages as bind_layer."""

    def __init__(self, location: str | Path, hub_kwargs: dict[str, Any], stats: ShardReadStats):
        super().__init__(location, hub_kwargs)
        self.stats = stats

    def read_entries(self, path: Path) -> dict[str, TensorEntry]:
        with _open_binary(path) as handle:
            return read_safetensors_entries(path, functools.partial(_read_exactly, handle, path, stats=self.stats))


def _touched_pages(begin: int, row_bytes: int, rows: int, first_byte: int, stop_byte: int) -> int:
    """Pages a copy of bytes [first_byte, stop_byte) of every row touches (rows row_bytes
    apart, from `begin`): the union of each row's page interval."""
    page = mmap.PAGESIZE
    starts = begin + np.arange(rows, dtype=np.int64) * row_bytes + first_byte
    first = starts // page
    last = (starts + (stop_byte - first_byte) - 1) // page
    previous_last = np.concatenate([[-1], np.maximum.accumulate(last)[:-1]])
    return int(np.maximum(0, last - np.maximum(first, previous_last + 1) + 1).sum())


def bind_layer_shard(path_or_repo: str | Path, layer_idx: int, tp_size: int, rank: int, config: KdaConfig | None = None,
                     *, progress: bool = True, stats: ShardReadStats | None = None, **hub_kwargs: Any) -> BoundLayer:
    """Rank `rank` of `tp_size`'s weights of KDA layer `layer_idx`, reading only its bytes.

    Equal, bit for bit, to `TensorParallelPlan(config, tp_size).shard(bind_layer(...), rank)`, with
    bind_layer's checks and messages, made from the headers before any data is read. Row slices are read
    with seek + read, o_proj's columns out of a memory map (only the pages holding them are read). A hub
    repo's shards holding the layer are downloaded whole first. `stats`, if given, receives what was read.
    """
    if config is None:
        config = KdaConfig.from_pretrained(path_or_repo, **hub_kwargs)
    plan = TensorParallelPlan(config, tp_size)
    rank = plan.check_rank(rank)
    _check_layer_index(config, layer_idx)
    stats = stats if stats is not None else ShardReadStats()
    ckpt = _RangeCheckpoint(path_or_repo, hub_kwargs, stats)
    layer_plan = _plan_layer(ckpt, config, layer_idx)
    if layer_plan.problems:
        raise CheckpointError("\n".join(layer_plan.problems))

    prefix = attention_prefix(layer_idx)
    specs = expected_tensors(config, layer_plan.layout)
    full_shapes = BoundLayer.shapes(config)
    parts: dict[str, list[np.ndarray]] = {}
    with tqdm(total=len(specs), desc=f"layer {layer_idx} rank {rank}/{tp_size}", unit="tensor",
              disable=None if progress else True, leave=False) as bar:
        for spec in specs:
            name = prefix + spec.name
            file = layer_plan.files[name]
            path = ckpt.path(file)
            entry = ckpt.header(file)[name]
            dtype = _NUMPY_DTYPES[entry.dtype]
            size = math.prod(entry.shape) * dtype.itemsize
            if entry.end - entry.begin != size:
                raise CheckpointError(f"{file}: tensor '{name}' has data_offsets spanning {entry.end - entry.begin} "
                                      f"bytes, but {entry.dtype} {list(entry.shape)} needs {size}")
            if spec.field == "o_proj":
                parts["o_proj"] = [_read_columns(path, entry, plan.channel_slice(rank), stats)]
            else:
                row_bytes = dtype.itemsize * math.prod(full_shapes[spec.field][1:])
                slices = plan.rows(spec.field, rank)
                if spec.name.endswith("_conv1d.weight"):  # release layout: the taps of q, k or v alone
                    slices = (plan.channel_slice(rank),)
                with _open_binary(path) as handle:
                    for rows in slices:
                        data = _read_exactly(handle, path, entry.begin + rows.start * row_bytes,
                                             (rows.stop - rows.start) * row_bytes, stats)
                        parts.setdefault(spec.field, []).append(data.view(dtype))
            bar.update(1)
    rank_shapes = BoundLayer.shapes(plan.rank_config(rank))
    arrays = {name: _join_rows(pieces).reshape(rank_shapes[name]) for name, pieces in parts.items()}
    for field_name, array in arrays.items():
        if not all_finite(array):
            raise CheckpointError(f"{path_or_repo}: layer {layer_idx} rank {rank}: {field_name} holds NaN or Inf values")
    return BoundLayer(layer_idx=layer_idx, config=plan.rank_config(rank), layout=layer_plan.layout, **arrays)


def _read_columns(path: Path, entry: TensorEntry, columns: slice, stats: ShardReadStats) -> np.ndarray:
    """Columns `columns` of a 2-D tensor, copied out of a read-only memory map of it: the OS
    reads only the pages the strided copy touches."""
    rows, width = entry.shape
    itemsize = _NUMPY_DTYPES[entry.dtype].itemsize
    mapped = np.memmap(path, dtype=np.dtype(f"<u{itemsize}"), mode="r", offset=entry.begin, shape=(rows, width))
    # np.array copies even when the slice is contiguous (tp_size 1), so nothing keeps the map.
    copied = np.array(mapped[:, columns], copy=True, subok=False)
    stats.bytes_mapped += mmap.PAGESIZE * _touched_pages(
        entry.begin, width * itemsize, rows, columns.start * itemsize, columns.stop * itemsize
    )
    return copied.view(_NUMPY_DTYPES[entry.dtype])


# Running it: the FP32 sum of the ranks' FP32 partial outputs --------------------------------
@functools.lru_cache(maxsize=1)
def _nccl() -> Any:
    """cupy.cuda.nccl, or a clear error when CuPy cannot load the NCCL library (an error
    is not cached: installing the library and calling again works)."""
    with warnings.catch_warnings():
        # CuPy warns at import when libnccl is missing; the error below says it better.
        warnings.simplefilter("ignore")
        from cupy.cuda import nccl
    if not getattr(nccl, "available", False):
        raise TensorParallelError(
            "tensor parallelism needs NCCL: CuPy could not load libnccl.so.2 "
            "(install it with `pip install nvidia-nccl-cu12`)"
        )
    return nccl


def check_devices(devices: Sequence[int], visible: int) -> list[int]:
    """The device list, checked against the number of visible CUDA devices."""
    devices = [int(d) for d in devices]
    if not devices:
        raise TensorParallelError("devices is empty: tensor parallelism needs at least one GPU")
    if len(set(devices)) != len(devices):
        raise TensorParallelError(f"devices {devices} lists a GPU twice; every rank needs its own GPU")
    if len(devices) > visible or any(not 0 <= d < visible for d in devices):
        raise TensorParallelError(
            f"devices {devices} asks for {len(devices)} GPUs (ids up to {max(devices)}), but only {visible} "
            f"CUDA device{'s are' if visible != 1 else ' is'} visible (ids 0..{visible - 1})"
        )
    return devices


def _hidden_rows(hidden: Any, width: int, what: str, max_rows: int) -> tuple[Any, bool]:
    """(hidden as [rows, width] BF16, True when it came from the host)."""
    import cupy

    from .gpu.arrays import require_bf16

    if isinstance(hidden, np.ndarray):
        if hidden.dtype != ml_dtypes.bfloat16:
            raise TypeError(f"{what}: expected a BF16 array (ml_dtypes.bfloat16), got dtype {hidden.dtype}")
        on_host = True
    elif isinstance(hidden, cupy.ndarray):
        require_bf16(hidden, what)
        on_host = False
    else:
        raise TypeError(f"{what}: expected a NumPy or CuPy BF16 array, got {type(hidden).__name__}")
    if hidden.ndim == 1:
        hidden = hidden.reshape(1, -1)
    if hidden.ndim != 2 or hidden.shape[1] != width:
        raise ValueError(f"{what}: expected [rows, {width}], got {list(hidden.shape)}")
    if not 1 <= hidden.shape[0] <= max_rows:
        raise ValueError(f"{what}: {hidden.shape[0]} rows; this call takes 1..{max_rows}")
    if not hidden.flags.c_contiguous:
        raise ValueError(f"{what}: hidden must be C-contiguous")
    return hidden, on_host


class TpRankLayer:
    """Rank `rank` of a tensor-parallel KDA block, on the current CUDA device.

    For launchers that run one process per GPU: build `comm` as
    `cupy.cuda.nccl.NcclCommunicator(tp_size, unique_id, rank)` from one `get_unique_id()` shared by
    all processes, inside `with cupy.cuda.Device(d):`. Every call takes the FULL hidden rows and returns
    the same full [rows, hidden] BF16 output on every rank; all ranks must make the same calls in the
    same order (each call is a collective). Buffers: `partial` FP32 [max_tokens, hidden] (the rank's
    o_proj sums, then the all-reduced sum), `output` BF16 [max_tokens, hidden] (the rounded sum).
    """

    def __init__(self, bound_shard: BoundLayer, plan: TensorParallelPlan, rank: int, comm: Any,
                 max_tokens: int = 4096, workspace: Any = None):
        from .device import require_gpu

        require_gpu("TpRankLayer")
        import cupy

        from .gpu.arrays import bf16_dtype
        from .gpu.layer import KdaLayer
        from .gpu.pipeline import DECODE_MAX_ROWS as GEMV_MAX_ROWS
        from .gpu.workspace import KdaWorkspace

        self.plan = plan
        self.rank = plan.check_rank(rank)
        expected = plan.rank_config(self.rank)
        if bound_shard.config != expected:
            raise TensorParallelError(
                f"rank {self.rank}: the bound weights do not fit the plan, they differ in "
                f"{_config_differences(bound_shard.config, expected)}; pass plan.shard(bound, rank) "
                f"or bind_layer_shard(path, layer_idx, {plan.tp_size}, {self.rank})"
            )
        self.device_id = cupy.cuda.Device().id
        _check_comm(comm, plan, self.rank, self.device_id)
        self.comm = comm
        # A workspace of the rank's own: its graphs are captured on the rank's capture stream.
        if workspace is None:
            workspace = KdaWorkspace(bound_shard.config, max_tokens)
        self.layer = KdaLayer(bound_shard, max_tokens=max_tokens, workspace=workspace)
        self.config = self.layer.config
        self.max_tokens = self.layer.workspace.max_tokens
        self.decode_rows = min(GEMV_MAX_ROWS, self.max_tokens)
        hidden = self.config.hidden
        self.partial = cupy.zeros((self.max_tokens, hidden), np.float32)
        self.layer.o_proj_sums = self.partial
        self.output = cupy.zeros((self.max_tokens, hidden), bf16_dtype())
        # Fixed input rows of the captured decode graphs.
        self.graph_hidden = cupy.zeros((GEMV_MAX_ROWS, hidden), bf16_dtype())
        self.capture_stream = cupy.cuda.Stream(non_blocking=True)
        self._ready_events: dict[int, Any] = {}
        self._group = _RankGroup([self])

    # Single-rank API ----------------------------------------------------------------------
    @property
    def use_graphs(self) -> bool:
        """Decode-side calls replay one CUDA graph per call shape (layer + all-reduce)."""
        return self._group.use_graphs

    @use_graphs.setter
    def use_graphs(self, value: bool) -> None:
        self._group.use_graphs = bool(value)

    def new_state(self) -> KdaState:
        """Zero state of this rank's heads, on its GPU."""
        import cupy

        with cupy.cuda.Device(self.device_id):
            return self.layer.new_state()

    def prefill(self, hidden: Any, state: KdaState, pad_value: float = 0.0) -> Any:
        """Chunked prefill of the full hidden [T, hidden] BF16; returns the full output."""
        return self._group.prefill(hidden, [state], pad_value)

    def decode(self, hidden: Any, state: KdaState) -> Any:
        """One token: hidden [1, hidden] or [hidden]."""
        require_one_row("decode", hidden)
        return self._group.decode_k(hidden, [state], None)

    def decode_k(self, hidden: Any, state: KdaState, snapshots: Sequence[KdaState] | None = None) -> Any:
        """K rows (1..16) of one sequence, bit-identical to K decode calls (for tp_size
        > 2, see docs/design.md). snapshots[i] receives the state after row i."""
        return self._group.decode_k(hidden, [state], None if snapshots is None else [list(snapshots)])

    # Pieces the groups put together -------------------------------------------------------
    def _device_rows(self, hidden: Any, on_host: bool) -> Any:
        """`hidden` on this rank's GPU (the array itself when it is already there)."""
        import cupy

        from .gpu.arrays import to_device_bf16

        with cupy.cuda.Device(self.device_id):
            if on_host:
                return to_device_bf16(hidden)
            if hidden.device.id == self.device_id:
                return hidden
            copy = cupy.empty(hidden.shape, hidden.dtype)
            self._copy_from(copy, hidden)
            return copy

    def _stage_rows(self, hidden: Any, on_host: bool) -> Any:
        """Copy the decode rows into the fixed graph input; returns that view."""
        import cupy

        rows = hidden.shape[0]
        target = self.graph_hidden[:rows]
        with cupy.cuda.Device(self.device_id):
            if on_host:
                target.view(np.uint16).set(np.ascontiguousarray(hidden.view(np.uint16)))
            else:
                self._copy_from(target, hidden)
        return target

    def _copy_from(self, target: Any, source: Any) -> None:
        """target (on this GPU) <- source (any GPU), ordered after the source's pending work."""
        import cupy

        runtime = cupy.cuda.runtime
        stream = cupy.cuda.get_current_stream()
        source_device = source.device.id
        if source_device != self.device_id:
            # Another GPU's stream writes `source`: wait for it before the peer copy.
            with cupy.cuda.Device(source_device):
                if source_device not in self._ready_events:
                    self._ready_events[source_device] = cupy.cuda.Event(disable_timing=True)
                event = self._ready_events[source_device]
                event.record(cupy.cuda.get_current_stream())
            stream.wait_event(event)
        runtime.memcpyAsync(target.data.ptr, source.data.ptr, source.nbytes, runtime.memcpyDefault, stream.ptr)

    def _all_reduce(self, rows: int, stream: Any) -> None:
        nccl = _nccl()
        pointer = self.partial.data.ptr
        self.comm.allReduce(pointer, pointer, rows * self.config.hidden, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)

    def _round(self, rows: int) -> None:
        """output[:rows] = BF16 (nearest even) of the summed FP32 rows."""
        from .gpu.ops import round_to_bf16

        round_to_bf16(self.partial[:rows], self.output[:rows])

    def _decode_body(self, rows: int, state: KdaState, snapshots: Sequence[KdaState]) -> None:
        """decode_k's launches on graph_hidden[:rows], without its fresh output copy: an allocation made
        during capture would be written by every replay after CuPy has reused its memory."""
        layer = self.layer
        with layer._call() as ws:
            layer._decode_rows(ws, self.graph_hidden[:rows], state.conv, state.recurrent, sequential=True,
                               snapshots=snapshots)


def _check_comm(comm: Any, plan: TensorParallelPlan, rank: int, device_id: int) -> None:
    """The communicator must be rank `rank` of tp_size on this GPU (when it can say)."""
    checks = (("size", plan.tp_size, "ranks"), ("rank_id", rank, "rank"), ("device_id", device_id, "device"))
    for method, expected, what in checks:
        if not hasattr(comm, method):
            continue
        actual = getattr(comm, method)()
        if actual != expected:
            raise TensorParallelError(
                f"rank {rank}: the NCCL communicator's {what} is {actual}, expected {expected} "
                f"(tp_size={plan.tp_size}, current device {device_id})"
            )


class _RankGroup:
    """Ranks whose calls are issued together from one thread, their all-reduces in one NCCL group
    (docs/design.md, "Tensor parallel")."""

    def __init__(self, ranks: Sequence[TpRankLayer], capacity: int = 64):
        self.ranks = list(ranks)
        self.use_graphs = True
        self.capacity = capacity
        self.graphs: dict[tuple, list[Any]] = {}
        self.seen: set[tuple] = set()
        self.captures = 0

    @property
    def config(self) -> KdaConfig:
        return self.ranks[0].config

    def _check_states(self, states: Sequence[KdaState], what: str) -> None:
        if len(states) != len(self.ranks):
            raise ValueError(f"{what}: {len(states)} states for {len(self.ranks)} ranks")
        for rank, state in zip(self.ranks, states):
            require_state(state, rank.config, rank.device_id, f"{what} (rank {rank.rank})")

    def _result(self, rows: int, on_host: bool) -> Any:
        """The first rank's output rows: a new device array, or a host array for host input."""
        import cupy

        from .gpu.arrays import to_host

        first = self.ranks[0]
        with cupy.cuda.Device(first.device_id):
            out = first.output[:rows].copy()
            return to_host(out) if on_host else out

    def _reduce_and_round(self, rows: int, streams: Sequence[Any] | None = None) -> None:
        import cupy

        nccl = _nccl()
        if streams is None:
            streams = []
            for rank in self.ranks:
                with cupy.cuda.Device(rank.device_id):
                    streams.append(cupy.cuda.get_current_stream())
        nccl.groupStart()
        try:
            for rank, stream in zip(self.ranks, streams):
                with cupy.cuda.Device(rank.device_id):
                    rank._all_reduce(rows, stream)
        finally:
            nccl.groupEnd()
        for rank, stream in zip(self.ranks, streams):
            with cupy.cuda.Device(rank.device_id), stream:
                rank._round(rows)

    # Calls --------------------------------------------------------------------------------
    def prefill(self, hidden: Any, states: Sequence[KdaState], pad_value: float) -> Any:
        import cupy

        hidden, on_host = _hidden_rows(hidden, self.config.hidden, "prefill", min(r.max_tokens for r in self.ranks))
        self._check_states(states, "prefill")
        rows = hidden.shape[0]
        for rank, state in zip(self.ranks, states):
            with cupy.cuda.Device(rank.device_id):
                # (o_proj's FP32 sums land in rank.partial; the BF16 copy it returns is not needed.)
                rank.layer.prefill(rank._device_rows(hidden, on_host), state, pad_value)
        self._reduce_and_round(rows)
        return self._result(rows, on_host)

    def decode_k(self, hidden: Any, states: Sequence[KdaState], snapshots: Sequence[Sequence[KdaState]] | None) -> Any:
        """snapshots: None, or per rank the list of states receiving the state after each row."""
        import cupy

        from .gpu import build

        hidden, on_host = _hidden_rows(hidden, self.config.hidden, "decode_k", min(r.decode_rows for r in self.ranks))
        self._check_states(states, "decode_k")
        rows = hidden.shape[0]
        per_rank = [list(s) for s in snapshots] if snapshots is not None else [[] for _ in self.ranks]
        if len(per_rank) != len(self.ranks):
            raise ValueError(f"decode_k: snapshots for {len(per_rank)} ranks, expected {len(self.ranks)}")
        for rank, snaps in zip(self.ranks, per_rank):
            if len(snaps) > rows:
                raise ValueError(f"decode_k: {len(snaps)} snapshots for {rows} rows")
            for i, snap in enumerate(snaps):
                require_state(snap, rank.config, rank.device_id, f"decode_k (rank {rank.rank})", f"snapshots[{i}]")
        for rank in self.ranks:
            rank._stage_rows(hidden, on_host)

        # Each rank's graph holds its layer's launches: a change there (new packed weights, another
        # step form, a new workspace) is a new key.
        key = ("k", rows) + tuple(
            (*rank.layer.graph_key(rank.layer.workspace), state.conv.data.ptr, state.recurrent.data.ptr)
            + tuple((s.conv.data.ptr, s.recurrent.data.ptr) for s in snaps)
            for rank, state, snaps in zip(self.ranks, states, per_rank)
        )
        graphs = None
        if self.use_graphs and build.current_context().timer is None:
            graphs = self.graphs.get(key)
            if graphs is None and key in self.seen:
                graphs = self._capture(key, rows, states, per_rank)
            self.seen.add(key)
        if graphs is None:
            for rank, state, snaps in zip(self.ranks, states, per_rank):
                with cupy.cuda.Device(rank.device_id):
                    rank.layer.decode_k(rank.graph_hidden[:rows], state, snaps)
            self._reduce_and_round(rows)
        else:
            for rank, graph in zip(self.ranks, graphs):
                with cupy.cuda.Device(rank.device_id):
                    graph.launch(cupy.cuda.get_current_stream())
        return self._result(rows, on_host)

    def _capture(self, key: tuple, rows: int, states: Sequence[KdaState],
                 snapshots: Sequence[Sequence[KdaState]]) -> list[Any] | None:
        """Capture one graph per rank, all at once (their all-reduces form one NCCL group).
        On failure, graphs are switched off with a warning and the call runs eagerly:
        capture records launches without running them, so the states are untouched."""
        import cupy

        capturing: list[TpRankLayer] = []
        try:
            for rank, state, snaps in zip(self.ranks, states, snapshots):
                with cupy.cuda.Device(rank.device_id):
                    rank.capture_stream.begin_capture()
                    capturing.append(rank)
                    with rank.capture_stream:
                        rank._decode_body(rows, state, snaps)
            self._reduce_and_round(rows, [rank.capture_stream for rank in self.ranks])
            graphs = []
            while capturing:
                rank = capturing[0]
                with cupy.cuda.Device(rank.device_id):
                    graphs.append(rank.capture_stream.end_capture())
                capturing.pop(0)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager launches
            for rank in capturing:
                # (Any error here is moot: the capture is being abandoned anyway.)
                with cupy.cuda.Device(rank.device_id), contextlib.suppress(Exception):
                    rank.capture_stream.end_capture()
            self.use_graphs = False
            warnings.warn(f"tensor-parallel decode continues without CUDA graphs: capture failed ({exc})",
                          RuntimeWarning, stacklevel=3)
            return None
        self.captures += 1
        if len(self.graphs) >= self.capacity:
            self.graphs.pop(next(iter(self.graphs)))
        self.graphs[key] = graphs
        return graphs


class TensorParallelBlock:
    """Every rank of a tensor-parallel KDA block driven from one process (notebooks, tests).

    States are per rank: `new_state()` returns a list with one KdaState per rank, each on its
    GPU; `split_state` / `gather_state` convert from / to a full host state. Calls take host
    (NumPy) or device (CuPy, any GPU) BF16 hidden rows and return the output of rank 0
    (host for host input, else a CuPy array on rank 0's GPU); every rank holds the same.
    """

    def __init__(self, plan: TensorParallelPlan, ranks: Sequence[TpRankLayer]):
        ranks = list(ranks)
        if [r.rank for r in ranks] != list(plan.ranks()):
            raise TensorParallelError(f"expected ranks 0..{plan.tp_size - 1} in order, got {[r.rank for r in ranks]}")
        if len({r.device_id for r in ranks}) != len(ranks):
            raise TensorParallelError(f"every rank needs its own GPU, got devices {[r.device_id for r in ranks]}")
        self.plan = plan
        self.ranks = ranks
        self.config = plan.config
        self.devices = [r.device_id for r in ranks]
        self._group = _RankGroup(ranks)

    @classmethod
    def from_pretrained(cls, path_or_repo: str | Path, layer_idx: int, devices: Sequence[int] = (0, 1),
                        max_tokens: int = 4096, chunk: int = 64, progress: bool = False,
                        **hub_kwargs: Any) -> "TensorParallelBlock":
        """Bind layer `layer_idx` split over `devices` (rank r on devices[r]); each rank reads
        only its bytes of the checkpoint."""
        from .device import require_gpu

        require_gpu("TensorParallelBlock.from_pretrained")
        import cupy

        devices = check_devices(devices, cupy.cuda.runtime.getDeviceCount())
        config = KdaConfig.from_pretrained(path_or_repo, chunk=chunk, **hub_kwargs)
        plan = TensorParallelPlan(config, len(devices))
        plan.rank_config(0).validate()  # the kernels' limits, before anything is read or uploaded
        nccl = _nccl()
        shards = [bind_layer_shard(path_or_repo, layer_idx, plan.tp_size, rank, config=config,
                                   progress=progress, **hub_kwargs) for rank in plan.ranks()]
        comms = nccl.NcclCommunicator.initAll(list(devices))
        ranks = []
        for rank, (device, comm, shard) in enumerate(zip(devices, comms, shards)):
            with cupy.cuda.Device(device):
                ranks.append(TpRankLayer(shard, plan, rank, comm, max_tokens=max_tokens))
        return cls(plan, ranks)

    @property
    def use_graphs(self) -> bool:
        return self._group.use_graphs

    @use_graphs.setter
    def use_graphs(self, value: bool) -> None:
        self._group.use_graphs = bool(value)

    def new_state(self) -> list[KdaState]:
        return [rank.new_state() for rank in self.ranks]

    def split_state(self, state: KdaState) -> list[KdaState]:
        """A full state (host or device) as per-rank device states."""
        import cupy

        host = state.to_numpy() if not isinstance(state.conv, np.ndarray) else state
        out = []
        for rank in self.ranks:
            part = self.plan.state_slice(host, rank.rank)
            with cupy.cuda.Device(rank.device_id):
                out.append(KdaState(cupy.asarray(part.conv), cupy.asarray(part.recurrent)))
        return out

    def gather_state(self, states: Sequence[KdaState]) -> KdaState:
        """Per-rank device states as one full host state."""
        return self.plan.gather_states(states)

    def prefill(self, hidden: Any, states: Sequence[KdaState], pad_value: float = 0.0) -> Any:
        """Chunked prefill of hidden [T, hidden] BF16 from the ranks' states (updated in place)."""
        return self._group.prefill(hidden, states, pad_value)

    def decode(self, hidden: Any, states: Sequence[KdaState]) -> Any:
        """One token of one sequence, hidden [1, hidden] or [hidden]."""
        require_one_row("decode", hidden)
        return self._group.decode_k(hidden, states, None)

    def decode_k(self, hidden: Any, states: Sequence[KdaState],
                 snapshots: Sequence[Sequence[KdaState]] | None = None) -> Any:
        """K rows (1..16) of one sequence; snapshots[i] (a new_state() list) receives the
        state after row i."""
        per_rank = None
        if snapshots is not None:
            for i, snap in enumerate(snapshots):
                if len(snap) != len(self.ranks):
                    raise ValueError(f"decode_k: snapshots[{i}] has {len(snap)} rank states, expected {len(self.ranks)}")
            per_rank = [[snap[r] for snap in snapshots] for r in range(len(self.ranks))]
        return self._group.decode_k(hidden, states, per_rank)

    def outputs(self, rows: int) -> list[Any]:
        """Every rank's output rows of the last call (device views): all equal."""
        return [rank.output[:rows] for rank in self.ranks]
