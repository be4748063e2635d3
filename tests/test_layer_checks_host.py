"""KdaLayer's argument checks on host stand-ins for CuPy arrays (tagged with a device): every
refusal comes before a launch and names the call, the argument and the buffer. States and pools
on another GPU, or not on a 16-byte boundary, are refused (the kernels take raw pointers, and the
prefill's conv would have advanced the conv state before a later kernel's own check); a snapshot's
error names the snapshot; several rows for one state are refused by decode (decode_k walks them);
unsigned cu_seqlens that decrease are refused like signed ones."""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from glm_kda.gpu.layer import KdaLayer
from glm_kda.state import KdaState, StatePool, require_device_buffers
from glm_kda.synthetic import synthetic_config
from standins import HostStandIn, aligned

CONFIG = synthetic_config("tiny-glm")


class OnDevice(HostStandIn):
    """A HostStandIn on device `device_id`."""

    def __init__(self, array: np.ndarray, device_id: int = 0):
        super().__init__(array)
        self.device = SimpleNamespace(id=device_id)

    def __getitem__(self, index):
        return OnDevice(self._array[index], self.device.id)


def state_on(device_id: int = 0, offset: int = 0, config=CONFIG) -> KdaState:
    """A stand-in device state; `offset` bytes past a 16-byte boundary."""
    def buffer(shape):
        count = int(np.prod(shape))
        raw = aligned((count + 4,), np.float32).view(np.uint8)
        return OnDevice(raw[offset : offset + 4 * count].view(np.float32).reshape(shape), device_id)
    return KdaState(buffer(config.conv_state_shape), buffer(config.recurrent_state_shape))


@pytest.fixture
def layer(monkeypatch):
    """A KdaLayer without a device: the checks' attributes only; any launch fails the test."""
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(ndarray=OnDevice))
    made = object.__new__(KdaLayer)
    made.config = CONFIG
    made._state_shapes = (CONFIG.conv_state_shape, CONFIG.recurrent_state_shape)
    made.device_id = 0
    made.max_tokens = 64

    def no_launch(*args, **kwargs):
        pytest.fail("a launch before the checks refused the call")
    made._call = made._decode_rows = made._prefill_rows = no_launch
    made._rows_in = lambda hidden, what, max_rows: (hidden, lambda out: out)
    return made


def test_a_good_state_passes(layer):
    layer._check_state(state_on(), "decode_k")
    require_device_buffers("decode", "pool", *(OnDevice(aligned((4, 8), np.float32)) for _ in range(2)), 0)


@pytest.mark.parametrize("case,needle", [
    ("device", "decode_k: state.conv is on device 1, the layer runs on device 0"),
    ("misaligned", "decode_k: state.conv must start on a 16-byte boundary"),
    ("shape", "decode_k: state.conv has shape"),
    ("dtype", "decode_k: state.conv must be a contiguous CuPy float32 array"),
    ("not a state", "decode_k: state must be a KdaState"),
])
def test_a_bad_state_is_named(layer, case, needle):
    state = {"device": lambda: state_on(1), "misaligned": lambda: state_on(offset=4),
             "shape": lambda: state_on(config=dataclasses.replace(CONFIG, heads=1)),
             "dtype": lambda: KdaState(OnDevice(aligned(CONFIG.conv_state_shape, np.float64)),
                                       state_on().recurrent),
             "not a state": lambda: (1, 2)}[case]()
    with pytest.raises((TypeError, ValueError), match=needle):
        layer._check_state(state, "decode_k")


def test_a_bad_snapshot_is_named_as_the_snapshot(layer):
    rows = OnDevice(aligned((2, CONFIG.hidden)))
    with pytest.raises(ValueError, match=r"decode_k: snapshots\[1\]\.recurrent is on device 1"):
        layer.decode_k(rows, state_on(), [state_on(), KdaState(state_on().conv, state_on(1).recurrent)])


def test_a_pool_on_another_device_is_refused(layer):
    pool = StatePool.__new__(StatePool)
    pool.conv = OnDevice(aligned((3, *CONFIG.conv_state_shape), np.float32), 1)
    pool.recurrent = OnDevice(aligned((3, *CONFIG.recurrent_state_shape), np.float32), 1)
    with pytest.raises(ValueError, match="decode: pool.conv is on device 1"):
        layer._check_pool(pool, "decode")


@pytest.mark.parametrize("rows", [2, 16])
def test_decode_of_several_rows_for_one_state_is_refused(layer, rows):
    with pytest.raises(ValueError, match=f"decode: {rows} rows for one state.*decode_k"):
        layer.decode(OnDevice(aligned((rows, CONFIG.hidden))), state_on())


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64, np.int32])
def test_decreasing_cu_seqlens_are_refused_whatever_their_integer_type(layer, monkeypatch, dtype):
    layer._check_pool = lambda pool, what: None
    with pytest.raises(ValueError, match="strictly increase"):
        layer._packed_runs(8, object(), [0, 1], np.array([0, 5, 3, 8], dtype))
