"""DecodeGraphs' control flow on the host: which call runs eagerly, which captures, what a replay
copies where, the fallbacks of the in-graph copies, host slots through the pinned buffers.

A stand-in for the few CuPy calls DecodeGraphs makes (streams that record what is issued while
they capture, graphs that replay it, memcpyAsync as a host memmove, pinned buffers, events): the
"device" is host memory, so every copy is checked by the bytes it moves.
"""

from __future__ import annotations

import ctypes
import sys
import types
import warnings

import numpy as np
import pytest

from glm_kda.gpu import graph_copies
from glm_kda.gpu.graphs import DecodeGraphs
from glm_kda.gpu.workspace import PinnedUploads

from standins import HostStandIn, aligned

HIDDEN = 8


class Array(HostStandIn):
    """A host stand-in with nbytes; slices stay stand-ins of views (same addresses)."""

    def __init__(self, array: np.ndarray):
        super().__init__(array)
        self.nbytes = array.nbytes

    def __getitem__(self, index):
        return Array(self._array[index])


class Graph:
    """What a capture recorded: ["copy", dst, src, nbytes] (mutable: the stand-in copies
    repoint them) and ["kernel", fn] nodes, replayed in order."""

    def __init__(self):
        self.nodes: list[list] = []
        self.launches = 0

    def launch(self, stream) -> None:
        self.launches += 1
        for node in self.nodes:
            if node[0] == "copy":
                ctypes.memmove(node[1], node[2], node[3])
            else:
                node[1]()


class Stream:
    def __init__(self, non_blocking: bool = False):
        self.ptr = id(self)
        self.graph: Graph | None = None
        Device.streams[self.ptr] = self

    def __enter__(self):
        Device.stack.append(self)
        return self

    def __exit__(self, *exc):
        Device.stack.pop()

    def begin_capture(self) -> None:
        self.graph = Graph()

    def end_capture(self) -> Graph:
        graph, self.graph = self.graph, None
        return graph


class Event:
    def __init__(self, disable_timing: bool = False):
        self.recorded = 0

    def record(self, stream) -> None:
        self.recorded += 1

    def synchronize(self) -> None:
        Device.event_waits += 1


class Pinned(np.ndarray):
    """A pinned host buffer: a buffer with a .ptr."""


class Device:
    """The stand-in's state: streams by address, the current stream, counters."""

    streams: dict[int, Stream] = {}
    stack: list[Stream] = []
    default: Stream | None = None
    event_waits = 0

    @classmethod
    def current(cls) -> Stream:
        return cls.stack[-1] if cls.stack else cls.default

    @classmethod
    def issue(cls, stream_ptr: int, node: list) -> None:
        """Record `node` where its stream captures, else run it now."""
        stream = cls.streams[stream_ptr]
        if stream.graph is not None:
            stream.graph.nodes.append(node)
        elif node[0] == "copy":
            ctypes.memmove(node[1], node[2], node[3])
        else:
            node[1]()


def memcpy_async(dst: int, src: int, nbytes: int, kind: int, stream_ptr: int) -> None:
    Device.issue(stream_ptr, ["copy", dst, src, nbytes])


def alloc_pinned_memory(nbytes: int) -> Pinned:
    buffer = np.zeros(nbytes, np.uint8).view(Pinned)
    buffer.ptr = buffer.ctypes.data
    return buffer


def fake_cupy() -> types.ModuleType:
    module = types.ModuleType("cupy")
    module.empty = lambda shape, dtype: Array(aligned(shape, dtype))
    module.cuda = types.SimpleNamespace(
        get_current_stream=Device.current, Stream=Stream, Event=Event, alloc_pinned_memory=alloc_pinned_memory,
        runtime=types.SimpleNamespace(memcpyAsync=memcpy_async))
    return module


class Copies:
    """Stand-in GraphCopies: repoints the graph's two copy nodes; `accept` False refuses."""

    accept = True

    def __init__(self, input_node: list, output_node: list):
        self.input_node, self.output_node = input_node, output_node

    @classmethod
    def find(cls, graph: Graph, input_dst: int, output_src: int, nbytes: tuple[int, int]):
        inputs = [n for n in graph.nodes if n[0] == "copy" and n[1] == input_dst and n[3] == nbytes[0]]
        outputs = [n for n in graph.nodes if n[0] == "copy" and n[2] == output_src and n[3] == nbytes[1]]
        return cls(inputs[0], outputs[0]) if len(inputs) == 1 and len(outputs) == 1 else None

    def point(self, source, destination) -> bool:
        self.input_node[2] = source.data.ptr
        self.output_node[1] = destination.data.ptr
        return Copies.accept


def use_stand_in_cupy(monkeypatch) -> None:
    """CuPy, the graph copies' driver and their node search replaced by the stand-ins; a fresh
    stand-in device with its default stream."""
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.setattr(graph_copies, "driver", lambda: object())
    monkeypatch.setattr(graph_copies.GraphCopies, "find", Copies.find)
    monkeypatch.setattr(Copies, "accept", True)
    Device.streams.clear()
    Device.stack.clear()
    Device.default = Stream()
    Device.event_waits = 0


@pytest.fixture
def graphs(monkeypatch):
    """A DecodeGraphs over a stand-in workspace of 16 rows, CuPy replaced by the stand-in."""
    use_stand_in_cupy(monkeypatch)
    graphs = DecodeGraphs()
    graphs.workspace = workspace(7, 16)  # (the tests' own: which workspace the next call uses)
    graphs.graphed = True
    return graphs


def workspace(serial: int, rows: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(serial=serial, graph_hidden=Array(aligned((rows, HIDDEN))),
                                 graph_slots=Array(aligned((rows,), np.int32)),
                                 final_out=Array(aligned((rows, HIDDEN))), uploads=None)


class Body:
    """A decode body: final_out's rows = the rows it is given + 1 (one "kernel", issued on the
    current stream), and the slots it saw at each run."""

    def __init__(self, graphs: DecodeGraphs):
        self.graphs = graphs
        self.calls = 0
        self.slots_seen: list = []

    def __call__(self, hidden, slots) -> None:
        self.calls += 1
        ws, rows = self.graphs.workspace, hidden.shape[0]

        def kernel():
            ws.final_out._array[:rows] = hidden._array + 1
            self.slots_seen.append(None if slots is None else slots._array.copy())

        Device.issue(Device.current().ptr, ["kernel", kernel])


def rows_of(seed: int, rows: int) -> Array:
    return Array(aligned((rows, HIDDEN)) + np.uint16(seed))


def call(graphs: DecodeGraphs, body: Body, hidden: Array, slots=None, key=("k",)):
    ws = graphs.workspace
    out = graphs.run(key + (hidden.shape[0], ws.serial), ws, hidden, slots, body, graphs.graphed)
    assert np.array_equal(out._array, hidden._array + 1), "the call's output is not its own rows' result"
    return out


@pytest.mark.parametrize("in_graph", [True, False])
def test_first_call_eager_second_captures_then_replays(graphs, in_graph):
    graphs.copies_in_graph = in_graph
    body = Body(graphs)
    hidden = [rows_of(i, 2) for i in range(6)]
    outs = [call(graphs, body, h) for h in hidden]
    assert graphs.captures == 1 and body.calls == 2, (graphs.captures, body.calls)
    (entry,) = graphs.graphs.values()
    assert (entry.copies is not None) == in_graph
    assert entry.graph.launches == 5, "the capturing call and the four after it replay"
    assert len({o.data.ptr for o in outs}) == 6, "each call returns an array of its own"
    copy_nodes = [n for n in entry.graph.nodes if n[0] == "copy"]
    assert len(copy_nodes) == (2 if in_graph else 0)
    if in_graph:
        assert entry.copies.input_node[2] == hidden[-1].data.ptr, "the graph reads the last call's rows"
        assert entry.copies.output_node[1] == outs[-1].data.ptr, "the graph writes the last call's output"


def test_copies_not_found_capture_again_without_them(graphs, monkeypatch):
    monkeypatch.setattr(graph_copies.GraphCopies, "find", lambda *args: None)
    body = Body(graphs)
    for i in range(4):
        call(graphs, body, rows_of(10 + i, 3))
    (entry,) = graphs.graphs.values()
    assert entry.copies is None and not graphs.copies_in_graph
    assert graphs.captures == 1, "the capture with copies that were not found is not counted"
    assert not [n for n in entry.graph.nodes if n[0] == "copy"], "the kept graph still holds copy nodes"


def test_refused_repointing_warns_and_continues_with_copies_beside(graphs, monkeypatch):
    body = Body(graphs)
    call(graphs, body, rows_of(20, 1))
    call(graphs, body, rows_of(21, 1))
    monkeypatch.setattr(Copies, "accept", False)
    with pytest.warns(RuntimeWarning, match="could not be repointed"):
        call(graphs, body, rows_of(22, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            call(graphs, body, rows_of(23 + i, 1))
    (entry,) = graphs.graphs.values()
    assert entry.copies is None and not graphs.copies_in_graph


def test_eager_calls_read_the_callers_rows(graphs):
    graphs.graphed = False
    body = Body(graphs)
    for i in range(3):
        call(graphs, body, rows_of(30 + i, 4))
    assert body.calls == 3 and graphs.captures == 0 and not graphs.graphs


@pytest.mark.parametrize("enabled", [True, False])
def test_host_slots_reach_the_body_through_pinned_buffers_used_in_turn(graphs, enabled):
    graphs.graphed = enabled
    body = Body(graphs)
    orders = [np.array([(3 * i + j) % 16 for j in range(4)], np.int32) for i in range(9)]
    for i, order in enumerate(orders):
        call(graphs, body, rows_of(40 + i, 4), slots=order)
    assert len(body.slots_seen) == len(orders)
    for i, (seen, order) in enumerate(zip(body.slots_seen, orders)):
        assert np.array_equal(seen, order), f"call {i}: the body saw slots {seen}, the caller gave {order}"
    buffers = len(graphs.workspace.uploads.buffers)
    assert Device.event_waits == len(orders) - buffers, "each reuse of a pinned buffer waits for its last copy"


def test_pinned_uploads_refuse_more_than_a_buffer(graphs):
    uploads = PinnedUploads(16)
    with pytest.raises(ValueError, match="over the 16"):
        uploads.upload(0, np.zeros(5, np.int32), Device.default)


def test_oldest_graph_dropped_past_capacity(graphs):
    graphs.capacity = 2
    body = Body(graphs)
    for rows in (1, 2, 3):
        for seed in range(2):
            call(graphs, body, rows_of(50 + seed, rows))
    assert [key[1] for key in graphs.graphs] == [2, 3], list(graphs.graphs)


def test_each_workspace_has_its_own_io_and_pinned_buffers(graphs):
    """Calls on another workspace (another stream's) slice its own buffers, upload their slots
    through its own pinned buffers and capture graphs of their own."""
    body = Body(graphs)
    first_ws = graphs.workspace
    call(graphs, body, rows_of(60, 2), slots=np.array([1, 2], np.int32))
    call(graphs, body, rows_of(61, 2), slots=np.array([3, 4], np.int32))
    graphs.workspace = workspace(8, 32)
    call(graphs, body, rows_of(62, 2), slots=np.array([5, 6], np.int32))
    call(graphs, body, rows_of(63, 2), slots=np.array([7, 8], np.int32))
    assert graphs.io(graphs.workspace, 2).hidden_ptr != graphs.io(first_ws, 2).hidden_ptr
    assert graphs.workspace.uploads is not first_ws.uploads and graphs.workspace.uploads.nbytes == 128
    assert graphs.captures == 2 and len(graphs.graphs) == 2
    assert np.array_equal(body.slots_seen[-1], [7, 8])


@pytest.mark.parametrize("enabled", [True, False])
def test_device_slots_reach_the_body(graphs, enabled):
    """Device slots: copied into the graph's slot buffer for a graphed call (the caller's array may be
    gone or changed by the next replay), handed to the body as they are for an eager one."""
    graphs.graphed = enabled
    body = Body(graphs)
    orders = [Array(aligned((3,), np.int32) + np.int32(i)) for i in range(5)]
    for i, order in enumerate(orders):
        call(graphs, body, rows_of(70 + i, 3), slots=order)
    for i, (seen, order) in enumerate(zip(body.slots_seen, orders)):
        assert np.array_equal(seen, order._array), f"call {i}: the body saw slots {seen}, the caller gave {order._array}"
