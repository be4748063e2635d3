"""KdaStack's one-graph decode on the host: the layers' launches in order with each output copied
into the next layer's input rows, eager on the first call, captured on the second, replayed after
with the input and output copies repointed; the layer-by-layer path with a between callback. The
layers are stand-ins whose one "kernel" adds their position to the rows and counts their state's
updates; CuPy is the stand-in of test_decode_graphs_host.py."""

from __future__ import annotations

import types

import numpy as np
import pytest

from glm_kda.gpu.layer import KdaLayer
from glm_kda.gpu.stack import KdaStack
from glm_kda.state import KdaState
from glm_kda.synthetic import synthetic_config

from standins import aligned
from test_decode_graphs_host import Array, Device, rows_of, use_stand_in_cupy, workspace


class StandInLayer(KdaLayer):
    """A KdaLayer with its device work replaced: final_out = rows + position + 1."""

    def __init__(self, position: int, ws, config):
        self.position, self._workspace, self.config = position, ws, config
        self.layer_idx, self.device_id, self.max_tokens, self._generation = position, 0, 16, 0

    def _rows_in(self, hidden, what, max_rows):
        assert 1 <= hidden.shape[0] <= max_rows
        return hidden, lambda out: out

    def _check_state(self, state, what, name="state"):
        pass

    def _check_finite(self, rows, what, name="hidden", after=""):
        pass

    def _checked_output(self, out, what):
        return out

    def _enter(self):
        return (self._workspace, Device.current(), False, None, None)

    @staticmethod
    def _leave(call):
        pass

    def _graphed(self):
        return True

    def _decode_rows(self, ws, hidden, conv_state, recurrent_state, *, slots=None, sequential=False, snapshots=()):
        rows, add = hidden.shape[0], self.position + 1

        def kernel():
            ws.final_out._array[:rows] = hidden._array + add
            recurrent_state._array += 1

        Device.issue(Device.current().ptr, ["kernel", kernel])

    def decode(self, hidden, state, slots=None, *, check_slots=True):  # the layer-by-layer path, eager
        self._decode_rows(self._workspace, hidden, state.conv, state.recurrent)
        return Array(self._workspace.final_out._array[: hidden.shape[0]].copy())


class Workspace(types.SimpleNamespace):
    """test_decode_graphs_host's stand-in workspace, weakly referable (DecodeGraphs.follow)."""


def _workspace(serial: int) -> Workspace:
    return Workspace(**vars(workspace(serial, 16)))


@pytest.fixture
def stack(monkeypatch):
    use_stand_in_cupy(monkeypatch)
    ws = _workspace(3)
    return KdaStack([StandInLayer(i, ws, synthetic_config("tiny-kimi")) for i in range(3)])


def _states(count: int = 3) -> list[KdaState]:
    return [KdaState(Array(aligned((4, 4), np.float32)), Array(aligned((2, 2), np.float32))) for _ in range(count)]


def test_a_decode_through_the_stack_is_one_graph_after_the_first_call(stack):
    states = _states()
    outs = [stack.decode(rows_of(10 * t, 1), states) for t in range(4)]
    for t, out in enumerate(outs):  # rows + 1 + 2 + 3
        assert np.array_equal(out._array, rows_of(10 * t, 1)._array + 6), f"call {t}: {out._array}"
    assert stack.graphs.captures == 1, "one capture for one key, replays after"
    assert all(int(s.recurrent._array[0, 0]) == 4 for s in states), "each layer's state advanced once a call"
    other = _states()
    stack.decode(rows_of(1, 1), other)
    stack.decode(rows_of(1, 1), other)
    assert stack.graphs.captures == 2, "new states are a new key"


def test_decode_k_and_between_take_their_own_paths(stack):
    states = _states()
    for _ in range(3):
        out = stack.decode_k(rows_of(5, 3), states)
        assert np.array_equal(out._array, rows_of(5, 3)._array + 6)
    assert stack.graphs.captures == 1
    seen = []

    def between(i, out):
        seen.append(i)
        return Array(out._array * 2)

    out = stack.decode(rows_of(2, 1), states, between=between)
    assert seen == [0, 1], "between runs after every layer but the last"
    assert np.array_equal(out._array, ((rows_of(2, 1)._array + 1) * 2 + 2) * 2 + 3)
    assert stack.graphs.captures == 1, "the between path captures nothing"


def test_a_stack_of_layers_with_their_own_workspaces_calls_them_one_by_one(monkeypatch, stack):
    layers = [StandInLayer(i, _workspace(10 + i), stack.config) for i in range(2)]
    separate = KdaStack(layers)
    states = _states(2)
    for call in range(3):  # (the first call of a graphed stack is eager too: the later ones would replay)
        out = separate.decode(rows_of(3, 1), states)
        assert np.array_equal(out._array, rows_of(3, 1)._array + 3), f"call {call}"
    assert separate.graphs.captures == 0, f"{separate.graphs.captures} captures over layers of their own workspaces"


def test_two_rows_for_one_state_each_are_refused_before_any_launch(stack):
    states = _states()
    with pytest.raises(ValueError, match="decode: 2 rows for one state"):
        stack.decode(rows_of(1, 2), states)
    assert all(int(s.recurrent._array[0, 0]) == 0 for s in states) and stack.graphs.captures == 0


def test_a_state_list_that_passed_is_checked_again_only_when_a_buffer_changes(stack, monkeypatch):
    checked = []
    for layer in stack.layers:
        monkeypatch.setattr(layer, "_check_state", lambda state, what, name="state": checked.append(name))
    states = _states()
    for t in range(3):
        stack.decode(rows_of(t, 1), states)
    assert checked == ["states[0]", "states[1]", "states[2]"], f"checks over three calls: {checked}"
    for change, replacement in (("a new buffer", Array(aligned((2, 2), np.float32))),
                                ("a view of it with other strides", Array(states[1].recurrent._array.T)),
                                ("a view of it as another dtype", Array(states[1].recurrent._array.view(np.int32)))):
        checked.clear()
        states[1].recurrent = replacement
        stack.decode(rows_of(5, 1), states)
        assert checked == ["states[0]", "states[1]", "states[2]"], f"{change}: checks {checked}"
    checked.clear()
    stack.decode(rows_of(6, 1), _states())
    assert len(checked) == 3, "a new state list is checked"
