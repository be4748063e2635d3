"""KdaLayer: one KDA block bound to the GPU, the public surface of the GPU side (README, "API").

The stages themselves are private (glm_kda.gpu.pipeline). docs/design.md explains how decode and prefill are
built; docs/maths.md the numerics they promise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import ml_dtypes
import numpy as np

from ..checkpoint import BoundLayer, bind_layer
from ..chunk_model import PREPARE_SMEM_BYTES, chunk_tc_supported
from ..device import require_gpu
from ..options import KdaOptions
from ..state import KdaState, StatePool, require_device_buffers, require_one_row, require_state
from . import build, projection
from .arrays import bf16_dtype, require_bf16, to_device_bf16, to_device_f32, to_host
from .graphs import DecodeGraphs
from .pipeline import DECODE_MAX_ROWS, Stages
from .workspace import MAX_DECODE_ROWS, KdaWorkspace

_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)
# BF16 bits whose exponent is all ones: Inf or NaN.
_BF16_EXPONENT = 0x7F80


def _dead() -> None:
    """A weak reference whose object is gone."""
    return None


class KdaLayer(Stages):
    """One KDA block bound to the GPU. Calls take and return BF16 [rows, hidden] arrays (CuPy;
    NumPy is uploaded and the result comes back to the host; torch CUDA tensors pass through
    DLPack without copies). States are FP32 and updated in place.

    bound: one layer's tensors (glm_kda.bind_layer). max_tokens: the most rows a call takes
    (default: the rows of `workspace`, else 4096). workspace: None (default) takes the shared
    workspace of the stream each call runs on (one per stream, geometry and
    options.stage_buffers, see glm_kda.gpu.workspace) of max_tokens rows; a workspace given here
    serves every call, ordered one after the other across streams, and holds at least
    min(max_tokens, MAX_DECODE_ROWS) rows: a prefill longer than it runs in segments of its rows,
    the state carried from one to the next (docs/design.md, "Prefill in segments"). options:
    KdaOptions (default KdaOptions()).
    """

    # The weights every decode-side projection reads (attribute names).
    DECODE_WEIGHTS = ("qkv_weight", "down_weight", "f_b", "g_b", "o_proj")

    def __init__(self, bound: BoundLayer, max_tokens: int | None = None, workspace: KdaWorkspace | None = None,
                 options: KdaOptions | None = None):
        require_gpu("KdaLayer")
        import cupy

        self.config = bound.config.validate()
        self.layer_idx = bound.layer_idx
        if max_tokens is None:
            max_tokens = 4096 if workspace is None else workspace.max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if workspace is not None:
            fields = ("hidden", "heads", "head_dim", "conv_kernel", "chunk")
            differ = [f"{f} {getattr(workspace.config, f)} vs {getattr(self.config, f)}" for f in fields
                      if getattr(workspace.config, f) != getattr(self.config, f)]
            if differ:
                raise ValueError(f"workspace: sized for another geometry: {', '.join(differ)} (workspace vs layer)")
            if workspace.max_tokens < min(max_tokens, MAX_DECODE_ROWS):
                raise ValueError(f"workspace: {workspace.max_tokens} rows, under the "
                                 f"{min(max_tokens, MAX_DECODE_ROWS)} a pool decode of this layer may take "
                                 f"(max_tokens={max_tokens})")
        self.max_tokens = max_tokens
        self._workspace = workspace
        self.device_id = cupy.cuda.Device().id
        build.KernelSet.get()  # compile and resolve every entry point now, not mid-call
        self.qkv_weight = to_device_bf16(bound.qkv_weight)
        self.down_weight = to_device_bf16(bound.down_weight)
        self.f_b = to_device_bf16(bound.f_b)
        self.g_b = to_device_bf16(bound.g_b)
        self.conv_weight = to_device_bf16(bound.conv_weight)
        self.dt_bias = to_device_f32(bound.dt_bias)
        self.a_log = to_device_f32(bound.a_log.reshape(-1))
        self.o_norm = to_device_bf16(bound.o_norm)
        self.o_proj = to_device_bf16(bound.o_proj)
        self.scale = 1.0 / math.sqrt(self.config.head_dim)
        self.graphs = DecodeGraphs()
        self._o_proj_sums: Any = None
        self._state_shapes = (tuple(self.config.conv_state_shape), tuple(self.config.recurrent_state_shape))
        self._packed: dict[str, projection.PackedWeight] = {}
        # Advanced whenever the options or o_proj's sums change: part of every graph key.
        self._generation = 0
        # The last stream a call came from and its workspace (the lookup skipped on a hit).
        self._stream_workspace: tuple = (_dead, _dead)
        self._options = KdaOptions()
        self.options = KdaOptions() if options is None else options

    @classmethod
    def from_pretrained(cls, path_or_repo: str | Path, layer_idx: int, max_tokens: int | None = None, chunk: int = 64,
                        workspace: KdaWorkspace | None = None, options: KdaOptions | None = None,
                        **hub_kwargs: Any) -> "KdaLayer":
        """Bind layer `layer_idx` of a checkpoint directory or hub repo and upload it.

        max_tokens, workspace, options: as the constructor; chunk: the chunked prefill's chunk
        length (64 for the tensor-core kernels). hub_kwargs pass to
        glm_kda.bind_layer (progress, revision, cache_dir, ...)."""
        require_gpu("KdaLayer.from_pretrained")
        bound = bind_layer(path_or_repo, layer_idx, **hub_kwargs)
        if chunk != bound.config.chunk:
            bound = dataclasses.replace(bound, config=bound.config.with_chunk(chunk))
        return cls(bound, max_tokens=max_tokens, workspace=workspace, options=options)

    # Options ----------------------------------------------------------------------------------
    @property
    def options(self) -> KdaOptions:
        """The layer's KdaOptions. Setting them makes the packed weight copies they ask for and
        resolves chunk_impl; graphs captured under other options are never replayed (the options
        are part of every graph key)."""
        return self._options

    @options.setter
    def options(self, options: KdaOptions) -> None:
        if not isinstance(options, KdaOptions):
            raise TypeError(f"options: expected a KdaOptions, got {type(options).__name__}")
        chunk_impl = options.chunk_impl
        supported, why = chunk_tc_supported(self.config)
        shared = projection.shared_memory(self.device_id)[1]
        if supported and shared < PREPARE_SMEM_BYTES:
            supported, why = False, (f"this device gives a block {shared} bytes of shared memory, the tensor-core "
                                     f"prepare needs {PREPARE_SMEM_BYTES} (sm_86, sm_89, sm_120 and sm_121 run the "
                                     f"FP32 chunk kernels)")
        if chunk_impl == "tensor" and not supported:
            raise ValueError(f"options.chunk_impl='tensor' cannot run this layer: {why}")
        if chunk_impl == "auto":
            chunk_impl = "tensor" if supported else "fp32"
        packed = {}
        if options.packed_weights:
            import cupy

            with cupy.cuda.Device(self.device_id), build.launching(build.LaunchContext(hopper=options.hopper)):
                for name in self.DECODE_WEIGHTS:
                    weight = getattr(self, name)
                    tiles = options.hopper and projection.bulk_takes(weight.shape[0])
                    known = self._packed.get(name)
                    keep = known is not None and (known.tiles is not None) == tiles
                    packed[name] = known if keep else projection.pack_weight(weight, tiles=tiles)
        self._packed = packed
        self._chunk_impl = chunk_impl
        self._options = options
        # stage_buffers picks the kind of the shared workspaces: look the stream's up again.
        self._stream_workspace = (_dead, _dead)
        self._context = build.LaunchContext(hopper=options.hopper)
        self._generation += 1

    @property
    def chunk_impl(self) -> str:
        """The chunked-prefill kernels that run: "tensor" or "fp32" (options.chunk_impl resolved)."""
        return self._chunk_impl

    @property
    def o_proj_sums(self) -> Any:
        """None (the default), or a CuPy float32 [max_tokens, hidden] C-contiguous array on this
        layer's GPU: every call's o_proj then also writes its FP32 sums there (rows 0..T-1) beside
        final_out's BF16 rounding of them. What a tensor-parallel rank hands the all-reduce, so
        that the ranks' partial outputs are added before the one rounding."""
        return self._o_proj_sums

    @o_proj_sums.setter
    def o_proj_sums(self, sums: Any) -> None:
        import cupy

        if sums is not None:
            shape = (self.max_tokens, self.config.hidden)
            if not isinstance(sums, cupy.ndarray) or sums.dtype != _F32:
                raise TypeError(f"o_proj_sums: expected a CuPy float32 array, got "
                                f"{type(sums).__name__} {getattr(sums, 'dtype', '')}")
            if sums.shape != shape or not sums.flags.c_contiguous:
                raise ValueError(f"o_proj_sums: expected a C-contiguous [{shape[0]}, {shape[1]}] array (max_tokens, "
                                 f"hidden), got {list(sums.shape)}, C-contiguous: {sums.flags.c_contiguous}")
            if sums.device.id != self.device_id:
                raise ValueError(f"o_proj_sums: on device {sums.device.id}, the layer on {self.device_id}")
        self._o_proj_sums = sums
        self._generation += 1

    # Workspaces, states, timing -----------------------------------------------------------------
    @property
    def workspace(self) -> KdaWorkspace:
        """The workspace the next call on the current stream uses: its stage buffers hold the
        last call's stages (every layer of this geometry called on this stream writes them)."""
        if self._workspace is not None:
            return self._workspace
        import cupy

        with cupy.cuda.Device(self.device_id):
            return KdaWorkspace.for_stream(self.config, self.max_tokens, stage_buffers=self._options.stage_buffers)

    def new_state(self) -> KdaState:
        """Zero state of a new sequence on this layer's GPU: conv FP32 [conv_dim, K], recurrent
        FP32 [H, D, D]."""
        import cupy

        with cupy.cuda.Device(self.device_id):
            return KdaState.zeros(self.config, cupy, np.float32)

    @contextlib.contextmanager
    def timing(self) -> Iterator[build.StageTimer]:
        """Time every launch and stage of this layer's calls inside the block (they run eagerly):
        ``with layer.timing() as timer: ...`` then ``timer.summary()`` (ms by kernel name, stages
        in brackets). The totals are complete once the block has exited."""
        with build.timing(hopper=self._options.hopper) as timer:
            yield timer

    def graph_key(self, ws: KdaWorkspace) -> tuple:
        """What a graph of this layer's decode-side calls depends on besides its states: the
        options and o_proj's sums buffer (through the generation both advance when set) and the
        workspace. A driver holding graphs that replay this layer's launches (a tensor-parallel
        group) keys them on it too."""
        return (self._generation, ws.serial)

    @contextlib.contextmanager
    def _call(self) -> Iterator[KdaWorkspace]:
        """The workspace of a call on the current stream, held for the call, with its launches
        made under this layer's options (the decode path inlines the same as _enter / _leave)."""
        call = self._enter()
        try:
            yield call[0]
        finally:
            self._leave(call)

    def _enter(self) -> tuple:
        """Start a call on the current stream: (workspace, stream, whether it is ordered against other
        streams, launch-context token, previous device or None). Kept lean: a one-row decode's host
        time is on its critical path."""
        import cupy

        previous = cupy.cuda.runtime.getDevice()
        if previous != self.device_id:
            cupy.cuda.runtime.setDevice(self.device_id)
        else:
            previous = None
        stream = cupy.cuda.get_current_stream()
        ws = self._workspace
        if ws is None:
            # Weak references: a workspace lives as long as its stream (KdaWorkspace.for_stream).
            cached_stream, cached_ws = self._stream_workspace
            ws = cached_ws() if cached_stream() is stream else None
            if ws is None:
                ws = KdaWorkspace.for_stream(self.config, self.max_tokens, stream, self._options.stage_buffers)
                self._stream_workspace = (weakref.ref(stream), weakref.ref(ws))
        ordered = ws.acquire(stream)
        timer = build.current_context().timer
        context = self._context if timer is None else build.LaunchContext(self._options.hopper, timer)
        return ws, stream, ordered, build.enter_context(context), previous

    @staticmethod
    def _leave(call: tuple) -> None:
        import cupy

        ws, stream, ordered, token, previous = call
        build.exit_context(token)
        ws.release(stream, ordered)
        if previous is not None:
            cupy.cuda.runtime.setDevice(previous)

    # Calls ----------------------------------------------------------------------------------------
    def prefill(self, hidden: Any, state: KdaState | StatePool, pad_value: float = 0.0, *, slots: Any = None,
                cu_seqlens: Sequence[int] | None = None) -> Any:
        """Chunked prefill of hidden [T, hidden] BF16 from the carried `state` (updated in place).
        Returns the block output [T, hidden] BF16 (a new array).

        pad_value fills the padded tail of the last chunk; the chunk kernels never read it.

        Packed sequences: prefill(hidden [sum T_i, hidden], pool, slots=[N], cu_seqlens=[N+1])
        prefills N sequences of a StatePool at once, sequence i being rows cu_seqlens[i]..cu_seqlens[i+1]-1
        (host ints, 0 first, strictly increasing) and advancing slot slots[i] (distinct), everything checked
        before the first launch. Each sequence equals its own prefill within the oracle bounds, not bit for
        bit (docs/design.md, "Prefill").
        """
        hidden, back = self._rows_in(hidden, "prefill", self.max_tokens)
        if isinstance(state, StatePool):
            runs = self._packed_runs(hidden.shape[0], state, slots, cu_seqlens)
            pad: float | None = None
        else:
            if slots is not None or cu_seqlens is not None:
                raise TypeError("prefill: slots and cu_seqlens only apply to a StatePool")
            self._check_state(state, "prefill")
            runs = [(0, hidden.shape[0], state.conv, state.recurrent)]
            pad = float(pad_value)
        self._check_finite(hidden, "prefill")
        with self._call() as ws:
            return back(self._checked_output(self._prefill_rows(ws, hidden, runs, pad), "prefill"))

    def decode(self, hidden: Any, state: KdaState | StatePool, slots: Any = None, *, check_slots: bool = True) -> Any:
        """One token per sequence. Returns [rows, hidden] BF16.

        decode(hidden_row [1, hidden] or [hidden], state): one sequence, state in place.
        decode(hidden [B, hidden], pool, slots): B sequences of a StatePool advance one token
        each, weights read once for all B; slots [B] (host ints, or a device int32 array) names
        each row's slot. A sequence's bits do not depend on B or on the other rows.

        Slots are checked before the first launch: in the pool, none twice. A device array is
        read back for that, which waits for the GPU; check_slots=False skips the read (the
        unchecked fast path: a slot out of range then writes outside the pool).
        """
        if isinstance(state, StatePool):
            return self._decode_pool(hidden, state, slots, check_slots)
        if slots is not None:
            raise TypeError("decode: slots only apply to a StatePool")
        require_one_row("decode", hidden)
        return self.decode_k(hidden, state)

    def decode_k(self, hidden_rows: Any, state: KdaState, snapshots: Sequence[KdaState] | None = None) -> Any:
        """K rows [K, hidden] (1..16) of ONE sequence: the projections in one weight sweep, the
        recurrence walked row by row. Bit-identical to K calls of decode. Returns [K, hidden].

        snapshots, if given, holds up to K states (layer.new_state()); snapshots[i] receives the
        state after row i, what a partial accept rolls back to.
        """
        hidden_rows, back = self._rows_in(hidden_rows, "decode_k", min(DECODE_MAX_ROWS, self.max_tokens))
        self._check_state(state, "decode_k")
        rows = hidden_rows.shape[0]
        snapshots = list(snapshots or [])
        if len(snapshots) > rows:
            raise ValueError(f"decode_k: {len(snapshots)} snapshots for {rows} rows")
        for i, snap in enumerate(snapshots):
            self._check_state(snap, "decode_k", f"snapshots[{i}]")
        self._check_finite(hidden_rows, "decode_k")

        def body(ws: KdaWorkspace, rows_in: Any, _slots: Any) -> None:
            self._decode_rows(ws, rows_in, state.conv, state.recurrent, sequential=True, snapshots=snapshots)

        key = ("k", rows, self._generation, state.conv.data.ptr, state.recurrent.data.ptr,
               tuple((s.conv.data.ptr, s.recurrent.data.ptr) for s in snapshots))
        return back(self._replay(self.graphs, key, hidden_rows, None, "decode_k", body))

    def _decode_pool(self, hidden: Any, pool: StatePool, slots: Any, check_slots: bool) -> Any:
        max_rows = min(MAX_DECODE_ROWS, self.max_tokens, len(pool))
        hidden, back = self._rows_in(hidden, "decode", max_rows)
        rows = hidden.shape[0]
        self._check_pool(pool, "decode")
        slots = self._slots_in(slots, rows, pool, "decode", check_slots)
        self._check_finite(hidden, "decode")

        def body(ws: KdaWorkspace, rows_in: Any, device_slots: Any) -> None:
            self._decode_rows(ws, rows_in, pool.conv, pool.recurrent, slots=device_slots)

        key = ("pool", rows, self._generation, pool.conv.data.ptr, pool.recurrent.data.ptr)
        return back(self._replay(self.graphs, key, hidden, slots, "decode", body))

    def _replay(self, graphs: DecodeGraphs, key: tuple, hidden: Any, slots: Any, what: str,
                body: Callable[[KdaWorkspace, Any, Any], None]) -> Any:
        """body(ws, hidden_rows, device_slots) on the workspace of a call on the current stream, through
        `graphs` (replayed under `key` and the workspace where options.graphs allow); returns a new
        CuPy array of final_out's rows, checked as options.check_finite asks."""
        call = self._enter()
        try:
            ws = call[0]
            graphs.follow(ws)
            out = graphs.run((*key, ws.serial), ws, hidden, slots, functools.partial(body, ws), self._graphed())
            ws.unrecorded = None  # a decode-side call writes every stage buffer of its rows
            return self._checked_output(out, what)
        finally:
            self._leave(call)

    def _check_finite(self, rows: Any, what: str, name: str = "hidden", after: str = "no state changed") -> None:
        """With options.check_finite: FloatingPointError naming the rows [n, hidden] BF16 that hold
        NaN or Inf (reads one count back)."""
        if self._options.check_finite:
            bad = _non_finite_rows(rows)
            if bad:
                raise FloatingPointError(f"{what}: {name} rows {bad} hold NaN or Inf (options.check_finite); {after}")

    def _checked_output(self, out: Any, what: str) -> Any:
        self._check_finite(out, what, "output", "the state has advanced")
        return out

    def _graphed(self) -> bool:
        return self._options.graphs and build.current_context().timer is None

    # Input checks: everything is checked before the first launch, so a call that fails leaves
    # the state untouched ---------------------------------------------------------------------------
    def _rows_in(self, hidden: Any, what: str, max_rows: int) -> tuple[Any, Any]:
        """(CuPy view of hidden [rows, hidden], a function mapping a CuPy output back to the
        caller's kind)."""
        import cupy

        back = lambda out: out  # noqa: E731
        if type(hidden).__module__.startswith("torch"):
            import torch

            if hidden.dtype != torch.bfloat16:
                raise TypeError(f"{what}: torch tensor must be torch.bfloat16, got {hidden.dtype}")
            if not hidden.is_cuda:
                raise TypeError(f"{what}: torch tensor must be on a CUDA device, got {hidden.device}")
            hidden = cupy.from_dlpack(hidden.view(torch.int16)).view(bf16_dtype())
            back = lambda out: torch.from_dlpack(out.view(np.int16)).view(torch.bfloat16)  # noqa: E731
        elif isinstance(hidden, np.ndarray):
            if hidden.dtype != ml_dtypes.bfloat16:
                raise TypeError(f"{what}: expected a BF16 array (ml_dtypes.bfloat16), got dtype {hidden.dtype}")
            with cupy.cuda.Device(self.device_id):
                hidden = to_device_bf16(hidden)
            back = to_host
        elif not isinstance(hidden, cupy.ndarray):
            raise TypeError(f"{what}: expected a CuPy, NumPy or torch BF16 array, got {type(hidden).__name__}")
        require_bf16(hidden, what)
        if hidden.ndim == 1:
            hidden = hidden.reshape(1, -1)
        if hidden.ndim != 2 or hidden.shape[1] != self.config.hidden:
            raise ValueError(f"{what}: expected [rows, {self.config.hidden}], got {list(hidden.shape)}")
        rows = hidden.shape[0]
        if not 1 <= rows <= max_rows:
            raise ValueError(f"{what}: {rows} rows; this call takes 1..{max_rows} (max_tokens={self.max_tokens})")
        if not hidden.flags.c_contiguous:
            raise ValueError(f"{what}: hidden must be C-contiguous")
        if hidden.device.id != self.device_id:
            raise ValueError(f"{what}: hidden is on device {hidden.device.id}, the layer on {self.device_id}")
        return hidden, back

    def _check_state(self, state: KdaState, what: str, name: str = "state") -> None:
        require_state(state, self.config, self.device_id, what, name, self._state_shapes)

    def _check_pool(self, pool: StatePool, what: str) -> None:
        conv, recurrent = pool.conv, pool.recurrent
        if conv.shape[1:] != self._state_shapes[0] or recurrent.shape[1:] != self._state_shapes[1]:
            raise ValueError(f"{what}: the pool's states [{list(conv.shape[1:])}, {list(recurrent.shape[1:])}] "
                             f"do not fit {self.config.describe()}")
        require_device_buffers(what, "pool", conv, recurrent, self.device_id)

    def _packed_runs(self, rows: int, pool: StatePool, slots: Any,
                     cu_seqlens: Sequence[int] | None) -> list[tuple[int, int, Any, Any]]:
        """The checked runs (first row, tokens, conv_state, recurrent_state) of a packed prefill."""
        self._check_pool(pool, "prefill")
        if cu_seqlens is None:
            raise ValueError("prefill with a StatePool needs cu_seqlens ([N+1] cumulative lengths) and slots ([N])")
        bounds = np.asarray(cu_seqlens.get() if hasattr(cu_seqlens, "get") else cu_seqlens)
        if bounds.ndim != 1 or bounds.size < 2 or not np.issubdtype(bounds.dtype, np.integer):
            raise ValueError(f"cu_seqlens: expected [N+1] integers (N >= 1), got {bounds.dtype} {list(bounds.shape)}")
        bounds = bounds.astype(np.int64)  # (the differences of unsigned bounds would wrap, not go negative)
        lengths = np.diff(bounds)
        if bounds[0] != 0 or bounds[-1] != rows or (lengths < 1).any():
            raise ValueError(f"cu_seqlens: must start at 0, end at the {rows} rows of hidden and strictly increase; "
                             f"got {bounds.tolist()}")
        host_slots = self._host_slots(slots, len(lengths), pool, "prefill")
        return [(first, tokens, pool.conv[slot], pool.recurrent[slot])
                for first, tokens, slot in zip(bounds[:-1].tolist(), lengths.tolist(), host_slots.tolist())]

    def _slots_in(self, slots: Any, rows: int, pool: StatePool, what: str, check_slots: bool) -> Any:
        """The slots of a pool call of `rows` rows, checked: a device int32 array (read back and
        checked unless check_slots is False) as it is, host ints as a checked int32 array."""
        import cupy

        if not isinstance(slots, cupy.ndarray):
            return np.ascontiguousarray(self._host_slots(slots, rows, pool, what), np.int32)
        if slots.dtype != _I32 or slots.shape != (rows,) or not slots.flags.c_contiguous:
            raise ValueError(f"slots: expected a C-contiguous device int32 array of {rows} entries, got "
                             f"{slots.dtype} {list(slots.shape)}")
        if slots.device.id != self.device_id:
            raise ValueError(f"slots: on device {slots.device.id}, the layer on {self.device_id}")
        if check_slots:
            self._host_slots(slots, rows, pool, what)
        return slots

    @staticmethod
    def _host_slots(slots: Any, count: int, pool: StatePool, what: str) -> np.ndarray:
        """Host int slots [count], checked: in the pool, no slot twice."""
        if slots is None:
            raise ValueError(f"{what} with a StatePool needs slots (one per sequence)")
        host = np.asarray(slots.get() if hasattr(slots, "get") else slots)
        if host.shape != (count,) or not np.issubdtype(host.dtype, np.integer):
            raise ValueError(f"slots: expected {count} integer slots, got {host.dtype} {list(host.shape)}")
        if host.min() < 0 or host.max() >= len(pool):
            raise ValueError(f"slots: {host.tolist()} outside this pool of {len(pool)} slots")
        if len(set(host.tolist())) != count:
            raise ValueError(f"slots: {host.tolist()} repeats a slot; each sequence must advance its own state")
        return host


@functools.lru_cache(maxsize=None)
def _count_non_finite() -> Any:
    """A CuPy reduction counting the BF16 elements (as uint16 bits) that are NaN or Inf."""
    import cupy

    return cupy.ReductionKernel("uint16 x", "int32 n", f"(x & {_BF16_EXPONENT}) == {_BF16_EXPONENT}", "a + b",
                                "n = a", "0", "glm_kda_count_non_finite_bf16")


def _non_finite_rows(rows: Any) -> list[int]:
    """Indices of the rows of a BF16 CuPy array [rows, n] holding NaN or Inf: one reduction and
    one value read back; the rows are found only when there are any."""
    import cupy

    bits = rows.view(cupy.uint16)
    if int(_count_non_finite()(bits)) == 0:
        return []
    bad = (cupy.bitwise_and(bits, _BF16_EXPONENT) == _BF16_EXPONENT).any(axis=1)
    return cupy.flatnonzero(bad).get().tolist()
