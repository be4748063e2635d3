"""CUDA graphs of the decode-side calls: eager first call, capture on the second, replay after
(docs/design.md, "CUDA graphs").
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, NamedTuple

import numpy as np

from . import graph_copies
from .arrays import copy_into
from .workspace import KdaWorkspace, PinnedUploads

# cudaMemcpyKind of a device-to-device copy.
_DEVICE_TO_DEVICE = 3


class GraphIO:
    """The workspace's fixed buffers that a graphed call of `rows` rows reads and writes, sliced
    once: its input rows (graph_hidden), slots (graph_slots) and output rows (final_out), with
    their device pointers and sizes."""

    __slots__ = ("hidden", "slots", "out", "hidden_ptr", "slots_ptr", "out_ptr", "hidden_bytes", "slots_bytes",
                 "out_bytes")

    def __init__(self, ws: KdaWorkspace, rows: int):
        self.hidden, self.slots, self.out = ws.graph_hidden[:rows], ws.graph_slots[:rows], ws.final_out[:rows]
        self.hidden_ptr, self.slots_ptr, self.out_ptr = (a.data.ptr for a in (self.hidden, self.slots, self.out))
        self.hidden_bytes, self.slots_bytes, self.out_bytes = (a.nbytes for a in (self.hidden, self.slots, self.out))


class CapturedGraph(NamedTuple):
    """One captured decode call: its CUDA graph and, where the call's copies are nodes of it,
    their GraphCopies. launch() replays it with the addresses its last call set: what the
    benchmarks time alone."""

    graph: Any
    copies: graph_copies.GraphCopies | None
    serial: int  # of the workspace whose buffers it reads and writes

    def launch(self, stream: Any) -> None:
        self.graph.launch(stream)


class DecodeGraphs:
    """The captured decode graphs of one layer (docs/design.md, "CUDA graphs")."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self.graphs: dict[tuple, CapturedGraph] = {}
        self.seen: set[tuple] = set()
        self.captures = 0
        self.last_graph: CapturedGraph | None = None  # the latest replayed call's (benchmarks time it alone)
        self._io: dict[tuple[int, int], GraphIO] = {}
        # Where the driver cannot repoint a graph's copy nodes, the copies run beside the graphs.
        self.copies_in_graph = True
        self._followed: set[int] = set()

    def follow(self, ws: KdaWorkspace) -> None:
        """Forget ws's buffers and graphs once ws itself is gone (its stream was let go)."""
        if ws.serial not in self._followed:
            self._followed.add(ws.serial)
            weakref.finalize(ws, self._forget_workspace, weakref.ref(self), ws.serial)

    @staticmethod
    def _forget_workspace(graphs_ref: Any, serial: int) -> None:
        graphs = graphs_ref()
        if graphs is None:
            return
        graphs._followed.discard(serial)
        for key in [key for key in graphs._io if key[0] == serial]:
            del graphs._io[key]
        for key in [key for key, entry in graphs.graphs.items() if entry.serial == serial]:
            del graphs.graphs[key]

    def io(self, ws: KdaWorkspace, rows: int) -> GraphIO:
        """The GraphIO of `rows` rows of workspace `ws`."""
        io = self._io.get((ws.serial, rows))
        if io is None:
            io = self._io[(ws.serial, rows)] = GraphIO(ws, rows)
        return io

    @staticmethod
    def _slots_in(ws: KdaWorkspace, io: GraphIO, slots: Any, stream: Any) -> None:
        """slots (device int32 [rows], or checked host int32 [rows]) into io.slots."""
        import cupy

        if isinstance(slots, np.ndarray):
            if ws.uploads is None:
                ws.uploads = PinnedUploads(ws.graph_slots.nbytes)
            ws.uploads.upload(io.slots_ptr, slots, stream)
        elif slots.flags.c_contiguous:
            cupy.cuda.runtime.memcpyAsync(io.slots_ptr, slots.data.ptr, io.slots_bytes, _DEVICE_TO_DEVICE, stream.ptr)
        else:
            copy_into(io.slots, slots)

    def run(self, key: tuple, ws: KdaWorkspace, hidden: Any, slots: Any, body: Callable[[Any, Any], None],
            graphed: bool) -> Any:
        """Run body(hidden_rows, device_slots) for the C-contiguous BF16 rows `hidden` [rows, hidden]
        and slots (None; device int32 [rows]; or host int32 [rows], already checked), replaying its
        graph where `graphed` and there is one. Returns a new CuPy array [rows, hidden] holding
        final_out's rows."""
        import cupy

        rows = hidden.shape[0]
        io = self.io(ws, rows)
        stream = cupy.cuda.get_current_stream()
        if slots is not None and (graphed or isinstance(slots, np.ndarray)):
            self._slots_in(ws, io, slots, stream)
            slots = io.slots
        if not graphed:
            body(hidden, slots)
            return self._copy_out(io, stream)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen:
                self.seen.add(key)
                self._copy_in(io, hidden, stream)
                body(io.hidden, slots)
                return self._copy_out(io, stream)
            entry = self._capture(key, ws, io, hidden, slots, body)
        self.last_graph = entry
        if entry.copies is not None:
            out = cupy.empty(io.out.shape, io.out.dtype)
            if entry.copies.point(hidden, out):
                entry.launch(stream)
                return out
            warnings.warn("decode graphs: their copy nodes could not be repointed; the input and output "
                          "copies run as separate operations from now on", RuntimeWarning, stacklevel=3)
            self.copies_in_graph = False
            self.graphs.clear()
            entry = self.last_graph = self._capture(key, ws, io, hidden, slots, body)
        self._copy_in(io, hidden, stream)
        entry.launch(stream)
        return self._copy_out(io, stream)

    @staticmethod
    def _copy_in(io: GraphIO, hidden: Any, stream: Any) -> None:
        import cupy

        cupy.cuda.runtime.memcpyAsync(io.hidden_ptr, hidden.data.ptr, io.hidden_bytes, _DEVICE_TO_DEVICE, stream.ptr)

    @staticmethod
    def _copy_out(io: GraphIO, stream: Any, out: Any = None) -> Any:
        """final_out's rows into `out` (None: a new array), issued on `stream`; returns it."""
        import cupy

        if out is None:
            out = cupy.empty(io.out.shape, io.out.dtype)
        cupy.cuda.runtime.memcpyAsync(out.data.ptr, io.out_ptr, io.out_bytes, _DEVICE_TO_DEVICE, stream.ptr)
        return out

    def _capture(self, key: tuple, ws: KdaWorkspace, io: GraphIO, hidden: Any, slots: Any, body) -> CapturedGraph:
        """Capture body on a side stream and keep it under `key`, with the input and output copies
        as its first and last nodes where the driver can repoint them."""
        import cupy

        copies_in_graph = self.copies_in_graph and graph_copies.driver() is not None
        scratch = cupy.empty(io.out.shape, io.out.dtype) if copies_in_graph else None
        side = cupy.cuda.Stream(non_blocking=True)
        with side:
            side.begin_capture()
            try:
                if copies_in_graph:
                    self._copy_in(io, hidden, side)
                body(io.hidden, slots)
                if copies_in_graph:
                    self._copy_out(io, side, scratch)
            finally:
                graph = side.end_capture()
        copies = None
        if copies_in_graph:
            copies = graph_copies.GraphCopies.find(graph, io.hidden_ptr, io.out_ptr, (io.hidden_bytes, io.out_bytes))
            if copies is None:
                # Not found or not reachable: capture again without them, and do so from now on.
                self.copies_in_graph = False
                return self._capture(key, ws, io, hidden, slots, body)
        self.captures += 1
        if len(self.graphs) >= self.capacity:
            self.graphs.pop(next(iter(self.graphs)))
        entry = self.graphs[key] = CapturedGraph(graph, copies, ws.serial)
        return entry

    def clear(self) -> None:
        """Forget every captured graph."""
        self.graphs.clear()
        self.seen.clear()
        self.last_graph = None
