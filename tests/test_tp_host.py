"""The tensor-parallel driver's host logic (glm_kda.tp: TpRankLayer, the rank group), on stand-ins.

CuPy, NCCL and each rank's KdaLayer are replaced by host stand-ins: arrays are NumPy arrays tagged
with their device, every copy or "kernel" is queued on its stream (or recorded into the graph the
stream captures), and the queues run at a synchronisation, rank by rank up to each all-reduce,
which sums the ranks' buffers in place as NCCL does. A rank's stand-in layer writes its FP32
partial output (a function of the input rows and the rank) into whatever its o_proj_sums names,
and garbage into its BF16 final_out. So these tests check what two GPUs would: every rank's
partial goes from its o_proj sums into the all-reduce, nothing reads final_out, the sum is rounded
once to BF16, the all-reduces of one call form one NCCL group, and eager, captured and replayed
calls agree.
"""

from __future__ import annotations

import contextlib

import ctypes
import sys
import types
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from glm_kda import device as device_module, tp
from glm_kda.gpu import arrays as arrays_module
from glm_kda.gpu import layer as layer_module
from glm_kda.gpu import workspace as workspace_module
from glm_kda.gpu import ops
from glm_kda.config import KdaConfig
from glm_kda.state import KdaState
from glm_kda.synthetic import synthetic_config

HIDDEN_ROWS = 16


class Array:
    """A NumPy array standing in for a cupy.ndarray on device `device_id` (not an np.ndarray, as
    the driver tells host from device rows by that)."""

    def __init__(self, array: np.ndarray, device_id: int | None = None):
        self._a = array
        self.device_id = Gpu.current if device_id is None else device_id
        self.shape, self.ndim, self.dtype, self.nbytes = array.shape, array.ndim, array.dtype, array.nbytes
        self.flags = array.flags

    @property
    def data(self):
        return SimpleNamespace(ptr=self._a.ctypes.data)

    @property
    def device(self):
        return SimpleNamespace(id=self.device_id)

    def __array__(self, dtype=None, copy=None):
        return self._a

    def __getitem__(self, index):
        return Array(self._a[index], self.device_id)

    def reshape(self, *shape):
        return Array(self._a.reshape(*shape), self.device_id)

    def view(self, dtype):
        return Array(self._a.view(dtype), self.device_id)

    def copy(self):
        out = Array(np.empty_like(self._a), self.device_id)
        Gpu.issue(["copy", out.data.ptr, self.data.ptr, self.nbytes])
        return out

    def get(self) -> np.ndarray:
        Gpu.run_queues()
        return self._a.copy()

    def set(self, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host).copy()
        Gpu.issue(["copy", self.data.ptr, host.ctypes.data, host.nbytes, host])


def on_device(array: np.ndarray) -> Array:
    return Array(np.ascontiguousarray(array).copy())


class Graph:
    def __init__(self):
        self.nodes: list[list] = []

    def launch(self, stream) -> None:
        Gpu.queues.setdefault(stream.device_id, []).extend(self.nodes)
        Gpu.run_queues(finish=False)


class Stream:
    def __init__(self, non_blocking: bool = False):
        self.ptr = id(self)
        self.device_id = Gpu.current
        self.graph: Graph | None = None
        Gpu.streams[self.ptr] = self

    def __enter__(self):
        Gpu.stream_stack.setdefault(Gpu.current, []).append(self)
        return self

    def __exit__(self, *exc):
        Gpu.stream_stack[Gpu.current].pop()

    def begin_capture(self) -> None:
        self.graph = Graph()

    def end_capture(self) -> Graph:
        graph, self.graph = self.graph, None
        return graph

    def is_capturing(self) -> bool:
        return self.graph is not None

    def wait_event(self, event) -> None:
        pass  # the queues run in issue order per device, and all-reduces join them


class Event:
    def __init__(self, disable_timing: bool = False):
        pass

    def record(self, stream=None) -> None:
        pass


class DeviceContext:
    def __init__(self, device_id: int | None = None):
        self.id = Gpu.current if device_id is None else device_id

    def __enter__(self):
        self.previous, Gpu.current = Gpu.current, self.id
        return self

    def __exit__(self, *exc):
        Gpu.current = self.previous


class Gpu:
    """The stand-in devices: the current device, streams, per-device queues of issued work."""

    current = 0
    streams: dict[int, Stream] = {}
    stream_stack: dict[int, list[Stream]] = {}
    default: dict[int, Stream] = {}
    queues: dict[int, list[list]] = {}
    groups: list[list] = []  # the all-reduces of each NCCL group, as issued
    open_group: list | None = None

    @classmethod
    def reset(cls, devices) -> None:
        cls.current = 0
        cls.streams, cls.stream_stack, cls.queues, cls.groups, cls.open_group = {}, {}, {}, [], None
        cls.default = {}
        for d in devices:
            with DeviceContext(d):
                cls.default[d] = Stream()

    @classmethod
    def stream(cls) -> Stream:
        stack = cls.stream_stack.get(cls.current)
        return stack[-1] if stack else cls.default[cls.current]

    @classmethod
    def issue(cls, node: list, stream: Stream | None = None) -> None:
        """Record `node` where its stream captures; else queue it on its device and run what can run
        (issue order per device; a copy's source is read when it runs, as on a GPU)."""
        stream = stream or cls.stream()
        if stream.graph is not None:
            stream.graph.nodes.append(node)
        else:
            cls.queues.setdefault(stream.device_id, []).append(node)
            cls.run_queues(finish=False)

    @classmethod
    def run_queues(cls, finish: bool = True) -> None:
        """Run each device's queue in order. An all-reduce node waits until every device with queued
        work has one at its head, then sums their buffers into each (FP32, in device order) and all
        go on. finish: everything must have run (a synchronisation)."""
        while True:
            for queue in cls.queues.values():
                while queue and queue[0][0] != "allreduce":
                    node = queue.pop(0)
                    if node[0] == "copy":
                        ctypes.memmove(node[1], node[2], node[3])
                    else:
                        node[1]()
            waiting = [queue for queue in cls.queues.values() if queue]
            if not waiting or len(waiting) < len(cls.default):
                break
            buffers = [queue[0][1] for _, queue in sorted(cls.queues.items()) if queue]
            total = np.zeros_like(buffers[0])
            for buffer in buffers:
                total = (total + buffer).astype(np.float32)
            for buffer in buffers:
                buffer[...] = total
            for queue in waiting:
                queue.pop(0)
        assert not finish or not any(cls.queues.values()), "an all-reduce without its peers at a synchronisation"


def memcpy_async(dst: int, src: int, nbytes: int, kind: int, stream_ptr: int) -> None:
    Gpu.issue(["copy", dst, src, nbytes], Gpu.streams[stream_ptr])


def fake_cupy() -> types.ModuleType:
    module = types.ModuleType("cupy")
    module.ndarray = Array

    module.zeros = lambda shape, dtype=np.float32: on_device(np.zeros(shape, dtype))
    module.asarray = lambda array: on_device(np.asarray(array))
    module.cuda = SimpleNamespace(
        Device=DeviceContext, Stream=Stream, Event=Event, get_current_stream=Gpu.stream,
        runtime=SimpleNamespace(memcpyAsync=memcpy_async, memcpyDefault=4))
    return module


class FakeNccl:
    NCCL_FLOAT32, NCCL_SUM = 7, 0

    @staticmethod
    def groupStart() -> None:
        Gpu.open_group = []

    @staticmethod
    def groupEnd() -> None:
        Gpu.groups.append(Gpu.open_group)
        Gpu.open_group = None


class Comm:
    def __init__(self, rank: int, size: int, device_id: int):
        self._rank, self._size, self._device = rank, size, device_id

    def size(self):
        return self._size

    def rank_id(self):
        return self._rank

    def device_id(self):
        return self._device

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream_ptr: int) -> None:
        assert send == recv and dtype == FakeNccl.NCCL_FLOAT32 and op == FakeNccl.NCCL_SUM
        assert Gpu.open_group is not None, "an all-reduce outside an NCCL group"
        buffer = np.ctypeslib.as_array(ctypes.cast(send, ctypes.POINTER(ctypes.c_float)), shape=(count,))
        Gpu.open_group.append(self._rank)
        Gpu.issue(["allreduce", buffer], Gpu.streams[stream_ptr])


def partial_of(hidden: np.ndarray, rank: int) -> np.ndarray:
    """The stand-in rank's FP32 partial output for BF16 rows `hidden` (values that need more than
    BF16's precision, so a rounding before the sum would show)."""
    x = hidden.view(ml_dtypes.bfloat16).astype(np.float32)
    return (x * np.float32(1.0 + 1e-3 * (rank + 1)) + np.float32(rank + 1) / np.float32(3.0)).astype(np.float32)


class FakeLayer:
    """A rank's KdaLayer: o_proj's FP32 sums into o_proj_sums (what TpRankLayer must wire to its
    partial), garbage into final_out, the call counted in the state."""

    def __init__(self, bound, max_tokens: int = 64, workspace=None):
        self.config = bound.config
        self.rank = bound.rank
        hidden = self.config.hidden
        self.workspace = SimpleNamespace(max_tokens=max_tokens, final_out=on_device(np.zeros((max_tokens, hidden),
                                                                                         np.uint16)))
        self.o_proj_sums = None
        self.generation = 0
        self.weight = on_device(np.ones(1, np.float32))

    def graph_key(self, ws) -> tuple:
        return (self.generation,)

    @contextlib.contextmanager
    def _call(self):
        yield self.workspace

    def swap_weight(self, scale: float) -> None:
        """New decode weights, as new KdaLayer.options make them: the old array freed (here NaN,
        what a captured launch reading it would show) and the layer's own graphs cleared."""
        self.weight._a[...] = np.nan
        self.weight = on_device(np.full(1, scale, np.float32))
        self.generation += 1

    def new_state(self) -> KdaState:
        c = self.config
        return KdaState(on_device(np.zeros(c.conv_state_shape, np.float32)),
                        on_device(np.zeros(c.recurrent_state_shape, np.float32)))

    def _issue(self, hidden, state) -> None:
        rows, sums, final_out, weight = hidden.shape[0], self.o_proj_sums, self.workspace.final_out, self.weight

        def kernel():  # (the weight's pointer baked in, as a captured launch holds it)
            np.asarray(sums)[:rows] = partial_of(np.asarray(hidden), self.rank) * weight._a[0]
            np.asarray(final_out)[:rows] = 0x7FC1  # NaN bits: a reader of final_out would show it
            np.asarray(state.recurrent).reshape(-1)[0] += rows

        Gpu.issue(["kernel", kernel])

    def _decode_rows(self, ws, hidden, conv, recurrent, sequential=True, snapshots=()):
        self._issue(hidden, KdaState(conv, recurrent))

    def decode_k(self, hidden, state, snapshots=()):
        self._issue(hidden, state)
        return self.workspace.final_out[: hidden.shape[0]].copy()

    def prefill(self, hidden, state, pad_value=0.0):
        self._issue(hidden, state)
        return self.workspace.final_out[: hidden.shape[0]].copy()


def fake_round(values, out) -> None:
    def kernel():
        np.asarray(out).view(np.uint16)[...] = np.asarray(values).astype(ml_dtypes.bfloat16).view(np.uint16)

    Gpu.issue(["kernel", kernel])


@pytest.fixture
def block(monkeypatch):
    """A TensorParallelBlock of two stand-in ranks on devices 0 and 1."""
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.setattr(tp, "_nccl", lambda: FakeNccl)
    monkeypatch.setattr(device_module, "require_gpu", lambda what: None)
    monkeypatch.setattr(layer_module, "KdaLayer", FakeLayer)
    monkeypatch.setattr(arrays_module, "bf16_dtype", lambda: np.dtype(np.uint16))
    monkeypatch.setattr(workspace_module, "KdaWorkspace", lambda config, max_tokens: None)
    monkeypatch.setattr(ops, "round_to_bf16", fake_round)
    Gpu.reset((0, 1))
    config: KdaConfig = synthetic_config("tiny-glm")
    plan = tp.TensorParallelPlan(config, 2)
    ranks = []
    for rank in plan.ranks():
        with DeviceContext(rank):
            bound = SimpleNamespace(config=plan.rank_config(rank), rank=rank)
            ranks.append(tp.TpRankLayer(bound, plan, rank, Comm(rank, 2, rank), max_tokens=64))
    return tp.TensorParallelBlock(plan, ranks)


def expected_output(hidden: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """The ranks' FP32 partials summed in FP32 (rank order), rounded once to BF16 (bits)."""
    total = np.zeros(hidden.shape, np.float32)
    for rank in range(2):
        total = (total + partial_of(hidden, rank) * np.float32(scale)).astype(np.float32)
    return total.astype(ml_dtypes.bfloat16).view(np.uint16)


def rows(seed: int, count: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((count, width)).astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def test_ranks_hand_their_o_proj_sums_to_the_all_reduce(block):
    for rank in block.ranks:
        assert rank.layer.o_proj_sums is rank.partial, f"rank {rank.rank}: o_proj_sums is not the rank's partial"
        assert rank.partial.dtype == np.float32 and rank.partial.device_id == rank.device_id


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_decode_output_is_the_rounded_sum_of_the_fp32_partials(block, graphs):
    """Calls 1 (eager), 2 (captured) and 3 - 4 (replayed) of one shape, then other row counts: the
    output is the FP32 sum of the ranks' partials rounded once, whatever final_out holds; every
    call's all-reduces form one NCCL group of both ranks; each rank's state advanced by each row."""
    block.use_graphs = graphs
    width = block.config.hidden
    states = block.new_state()
    advanced = 0
    for call, count in enumerate([1, 1, 1, 1, 3, 3, 3, 16]):
        hidden = rows(call, count, width)
        out = block.decode(on_device(hidden), states) if count == 1 else block.decode_k(on_device(hidden), states)
        got = np.asarray(out.get()).view(np.uint16)
        np.testing.assert_array_equal(got, expected_output(hidden), err_msg=f"call {call} ({count} rows)")
        advanced += count
        for rank, state in enumerate(states):
            assert float(state.recurrent.get().reshape(-1)[0]) == advanced, f"call {call}: rank {rank}'s state"
    assert Gpu.groups and all(sorted(group) == [0, 1] for group in Gpu.groups), Gpu.groups
    assert block._group.captures == (2 if graphs else 0), block._group.captures


def test_a_rank_layer_changed_under_a_captured_graph_is_captured_again(block):
    """The group's graphs hold each rank layer's launches: once a layer's decode weights change (its
    graph_key moves on), the next call must not replay the graph that reads the old ones."""
    states = block.new_state()
    hidden = rows(5, 1, block.config.hidden)
    for _ in range(3):  # eager, captured, replayed
        block.decode(on_device(hidden), states)
    assert block._group.captures == 1
    for rank in block.ranks:
        rank.layer.swap_weight(3.0)
    for call in range(3):
        got = np.asarray(block.decode(on_device(hidden), states).get()).view(np.uint16)
        np.testing.assert_array_equal(got, expected_output(hidden, 3.0),
                                      err_msg=f"call {call} after the swap: the old weights were read")
    assert block._group.captures == 2, block._group.captures

def test_prefill_output_is_the_rounded_sum_and_host_rows_come_back_on_the_host(block):
    width = block.config.hidden
    hidden = rows(9, 40, width)
    out = block.prefill(hidden.view(ml_dtypes.bfloat16), block.new_state())
    assert isinstance(out, np.ndarray) and not isinstance(out, Array), type(out)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), expected_output(hidden))
    assert len(Gpu.groups) == 1 and sorted(Gpu.groups[0]) == [0, 1]


def test_split_state_gives_each_rank_its_slice_and_gather_inverts_it(block):
    """A full host state split over the ranks: each rank's part on its GPU and holding the plan's
    slice for its heads; gathering the parts gives the state back."""
    state = KdaState.random(block.config, seed=11)
    parts = block.split_state(state)
    for rank, part in zip(block.ranks, parts):
        expected = block.plan.state_slice(state, rank.rank)
        assert part.conv.device_id == rank.device_id == part.recurrent.device_id
        np.testing.assert_array_equal(part.conv.get(), expected.conv, err_msg=f"rank {rank.rank} conv")
        np.testing.assert_array_equal(part.recurrent.get(), expected.recurrent, err_msg=f"rank {rank.rank} recurrent")
    gathered = block.gather_state(parts)
    np.testing.assert_array_equal(gathered.conv, state.conv)
    np.testing.assert_array_equal(gathered.recurrent, state.recurrent)


def test_a_rank_state_on_another_gpu_is_refused_naming_the_rank(block):
    """The rank group checks each rank's state and snapshots with the layer's state checks, before
    any launch: the refusal names the call, the rank and the argument."""
    states = block.new_state()
    hidden = on_device(rows(3, 1, block.config.hidden))
    wrong = [states[0], KdaState(states[0].conv, states[1].recurrent)]  # rank 1's conv on device 0
    with pytest.raises(ValueError, match=r"decode_k \(rank 1\): state\.conv is on device 0"):
        block.decode(hidden, wrong)
    snapshot = block.new_state()  # the state after row 0, one per rank: rank 1's given rank 0's
    with pytest.raises(ValueError, match=r"decode_k \(rank 1\): snapshots\[0\]\.conv is on device 0"):
        block.decode_k(hidden, states, [[snapshot[0], snapshot[0]]])
    # (each rank's launch adds its rows to its state's first recurrent word, so a launch that ran shows there)
    counts = [float(np.asarray(state.recurrent).reshape(-1)[0]) for state in states]
    assert counts == [0.0] * len(states), f"a rank's launch ran before the checks refused: row counts {counts}"
