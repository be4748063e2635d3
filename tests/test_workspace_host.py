"""Which workspace a call gets, on the host: one per stream and geometry, shared by the layers of
that stream, let go with its stream; the decode graphs of a workspace let go with it."""

from __future__ import annotations

import gc
import sys
import types

import numpy as np
import pytest

from glm_kda.gpu import graph_copies
from glm_kda.gpu.graphs import DecodeGraphs
from glm_kda.gpu.workspace import MAX_DECODE_ROWS, KdaWorkspace
from glm_kda.synthetic import synthetic_config

from test_decode_graphs_host import call, fake_cupy, rows_of, workspace as graph_workspace

CONFIG = synthetic_config("tiny-glm")


class Stream:
    """A stand-in CUDA stream: an address, weakly referable like CuPy's."""

    _next = 16

    def __init__(self, ptr: int | None = None):
        self.ptr = ptr if ptr is not None else Stream._next
        Stream._next += 16


@pytest.fixture
def made(monkeypatch):
    """KdaWorkspace without a device: the constructor records the workspaces it makes."""
    made: list[KdaWorkspace] = []

    def light_init(self, config, max_tokens, stage_buffers=False):
        self.config, self.max_tokens, self.stage_buffers = config, max_tokens, stage_buffers
        self.serial = next(KdaWorkspace._serials)
        self._home_stream = None
        made.append(self)

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0), get_current_stream=None)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(KdaWorkspace, "__init__", light_init)
    monkeypatch.setattr(KdaWorkspace, "_by_stream", {})
    return made


def test_one_workspace_per_stream_shared_by_layers_of_a_geometry(made):
    first, second = Stream(), Stream()
    a = KdaWorkspace.for_stream(CONFIG, 64, first)
    assert KdaWorkspace.for_stream(CONFIG, 64, first) is a, "a second layer on the same stream shares it"
    b = KdaWorkspace.for_stream(CONFIG, 64, second)
    assert b is not a and a._home_stream == first.ptr and b._home_stream == second.ptr
    assert KdaWorkspace.for_stream(CONFIG, 32, first) is not a, "another size is another workspace"
    recording = KdaWorkspace.for_stream(CONFIG, 64, first, stage_buffers=True)
    assert recording is not a and recording.stage_buffers and not a.stage_buffers, "another kind is another workspace"
    assert len(made) == 4


class ShapeOnly:
    """A device array that has a shape, a dtype and an address but no memory: the workspace's buffer
    list at the models' sizes, on the host."""

    _next_ptr = 256

    def __init__(self, shape, dtype, base=None):
        self.shape, self.dtype, self.base = tuple(shape), np.dtype(dtype), base
        self.size = int(np.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize
        self.data = types.SimpleNamespace(ptr=ShapeOnly._next_ptr)
        ShapeOnly._next_ptr += 256

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        return ShapeOnly((self.size,) if shape == (-1,) else shape, self.dtype, self.base or self)

    def __getitem__(self, key):
        assert self.shape == (self.size,) and key.start is None and key.step is None, key
        return ShapeOnly((key.stop,), self.dtype, self.base or self)

    def view(self, dtype):
        return ShapeOnly((self.nbytes // np.dtype(dtype).itemsize,), dtype, self.base or self)


def shape_only_workspace(monkeypatch, config, max_tokens, stage_buffers):
    cupy = types.ModuleType("cupy")
    cupy.ndarray, cupy.float16 = ShapeOnly, np.float16
    cupy.zeros = lambda shape, dtype: ShapeOnly(shape if isinstance(shape, tuple) else (shape,), dtype)
    cupy.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr("glm_kda.gpu.workspace.bf16_dtype", lambda: np.dtype(np.uint16))
    return KdaWorkspace(config, max_tokens, stage_buffers)


# KdaWorkspace.nbytes at GLM-5.3-Flash geometry and 16384 rows, read on a GPU before the middle's windows,
# when every buffer held every row (docs/performance.md, "Workspace size").
FULL_GLM_16384_BYTES = 7_822_508_040
# The same of the lean workspace, read on a GPU once final_out held the middle's rows and the decode
# graphs' input rows MAX_DECODE_ROWS.
LEAN_GLM_16384_BYTES = 3_151_037_448


def test_the_lean_workspace_is_under_half_of_one_holding_every_row(monkeypatch):
    """The middle's buffers hold MIDDLE_ELEMENTS / (H * D) rows unless stage_buffers (4096 at GLM-5.3-Flash
    geometry, 8192 at Kimi-Linear's): at GLM-5.3-Flash geometry and 16384 rows, the workspace is under half
    the bytes of one holding every row; Kimi-Linear's middle buffers take the bytes of GLM-5.3-Flash's. The
    recording workspace's bytes are what a GPU measured for the buffer list before the windows."""
    glm, kimi = synthetic_config("glm", 1), synthetic_config("kimi", 1)
    full = shape_only_workspace(monkeypatch, glm, 16384, True)
    lean = shape_only_workspace(monkeypatch, glm, 16384, False)
    # Since then the decode graphs' input rows and slots hold the rows of a decode-side call only.
    graph_rows_dropped = (16384 - MAX_DECODE_ROWS) * (glm.hidden * 2 + 4)
    assert full.nbytes == FULL_GLM_16384_BYTES - graph_rows_dropped, f"recording workspace {full.nbytes:,} bytes"
    assert (full.middle_rows, lean.middle_rows) == (16384, 4096)
    assert full.final_out.shape[0] == 16384 and full.graph_hidden.shape[0] == MAX_DECODE_ROWS
    assert lean.query.shape[0] == lean.core.shape[0] == lean.conv_out.shape[0] == lean.final_out.shape[0] == 4096
    assert lean.qkv_proj.shape[0] == lean.o_norm_out.shape[0] == 16384
    assert lean.nbytes == LEAN_GLM_16384_BYTES, f"lean workspace {lean.nbytes:,} bytes"
    assert lean.nbytes <= FULL_GLM_16384_BYTES / 2, f"lean {lean.nbytes:,} of {FULL_GLM_16384_BYTES:,} bytes"
    kimi_lean = shape_only_workspace(monkeypatch, kimi, 16384, False)
    assert kimi_lean.middle_rows == 8192 and kimi_lean.core.nbytes == lean.core.nbytes
    # A workspace that its middle covers is the same either way; windows are whole chunks.
    small = [shape_only_workspace(monkeypatch, kimi, 1000, flag) for flag in (False, True)]
    assert small[0].nbytes == small[1].nbytes and small[0].middle_rows == 1024
    odd = shape_only_workspace(monkeypatch, glm.with_chunk(48), 16384, False)
    assert odd.middle_rows == 4096 // 48 * 48 and odd.attn.shape[0] == odd.middle_rows // 48


def test_a_stream_per_request_holds_one_workspace_at_a_time(made):
    """A loop that makes a stream per request: each stream's workspace goes with its stream."""
    for _ in range(5):
        stream = Stream()
        KdaWorkspace.for_stream(CONFIG, 64, stream)
        del stream
        gc.collect()
    assert len(made) == 5 and not KdaWorkspace._by_stream, list(KdaWorkspace._by_stream)


def test_the_process_streams_keep_their_workspace(made):
    for ptr in (0, 1, 2):
        stream = Stream(ptr)
        ws = KdaWorkspace.for_stream(CONFIG, 64, stream)
        del stream
        gc.collect()
        assert KdaWorkspace.for_stream(CONFIG, 64, Stream(ptr)) is ws, f"stream {ptr}"


def test_graphs_of_a_workspace_go_with_it(monkeypatch):
    """DecodeGraphs following a workspace: once it is collected, its sliced buffers and its graphs
    are dropped; another workspace's stay."""
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.setattr(graph_copies, "driver", lambda: None)
    from test_decode_graphs_host import Device, Stream as CaptureStream

    Device.streams.clear()
    Device.stack.clear()
    Device.default = CaptureStream()

    class Workspace(types.SimpleNamespace):
        """A weakly referable stand-in workspace."""

    graphs = DecodeGraphs()
    graphs.graphed = True

    def body(hidden, slots) -> None:
        # (A captured CUDA graph holds device addresses, not the workspace object: nor does this.)
        final_out, rows = graphs.workspace.final_out, hidden.shape[0]

        def kernel():
            final_out._array[:rows] = hidden._array + 1

        Device.issue(Device.current().ptr, ["kernel", kernel])
    kept = Workspace(**vars(graph_workspace(1, 8)))
    for serial, ws in ((1, kept), (2, Workspace(**vars(graph_workspace(2, 8))))):
        graphs.follow(ws)
        graphs.workspace = ws
        for seed in range(3):
            call(graphs, body, rows_of(seed, 2))
    assert {entry.serial for entry in graphs.graphs.values()} == {1, 2} and len(graphs._io) == 2
    graphs.workspace = kept
    del ws
    gc.collect()
    assert {entry.serial for entry in graphs.graphs.values()} == {1}, "the collected workspace's graph stayed"
    assert list(graphs._io) == [(1, 2)]
    out = call(graphs, body, rows_of(9, 2))
    assert np.array_equal(out._array, rows_of(9, 2)._array + 1)


def test_a_shared_workspace_orders_calls_of_other_streams(made, monkeypatch):
    """An explicit workspace used from two streams: a call on the other stream waits for the last
    call's event; calls on its home stream, or inside a capture, record nothing."""
    import threading

    events = []

    class Event:
        def __init__(self, disable_timing=False):
            events.append(self)
            self.recorded_on = []

        def record(self, stream):
            self.recorded_on.append(stream.ptr)

    sys.modules["cupy"].cuda.Event = Event

    class CallStream(Stream):
        def __init__(self, capturing=False):
            super().__init__()
            self.capturing, self.waited = capturing, []

        def is_capturing(self):
            return self.capturing

        def wait_event(self, event):
            self.waited.append(event)

    home, first, second, capture = CallStream(), CallStream(), CallStream(), CallStream(capturing=True)
    ws = KdaWorkspace.for_stream(CONFIG, 64, home)
    ws._lock, ws._last_stream, ws._last_event = threading.RLock(), None, None
    for stream in (home, capture):
        ordered = ws.acquire(stream)
        ws.release(stream, ordered)
        assert not ordered and not events
    ordered = ws.acquire(first)
    ws.release(first, ordered)
    assert ordered and not first.waited and events[0].recorded_on == [first.ptr]
    ordered = ws.acquire(second)
    ws.release(second, ordered)
    assert second.waited == [events[0]], "the other stream's call did not wait for the last one"
    assert ws._lock.acquire(blocking=False), "the hold was not released"
