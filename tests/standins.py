"""Host stand-ins for CuPy arrays, so the launch wrappers' checks run without a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np


class HostStandIn:
    """Just enough of cupy.ndarray for the wrappers' checks (a NumPy array underneath)."""

    def __init__(self, array: np.ndarray):
        self._array = array
        self.dtype, self.shape, self.ndim = array.dtype, array.shape, array.ndim
        self.strides, self.itemsize, self.size, self.flags = array.strides, array.itemsize, array.size, array.flags
        self.data = SimpleNamespace(ptr=array.ctypes.data, device_id=0)

    def __getitem__(self, index):
        return HostStandIn(self._array[index])


def aligned(shape, dtype=np.uint16) -> np.ndarray:
    """A zeroed, 16-byte aligned host array (the wrappers require 16-byte aligned rows)."""
    count = int(np.prod(shape))
    raw = np.zeros(count * np.dtype(dtype).itemsize + 16, np.uint8)
    start = (-raw.ctypes.data) % 16
    return raw[start : start + count * np.dtype(dtype).itemsize].view(dtype).reshape(shape)


def use_stand_ins(monkeypatch) -> None:
    """Make the launch wrappers' checks take HostStandIn for cupy.ndarray (glm_kda.gpu.ops.checks
    tests every operand with isinstance)."""
    from glm_kda.gpu.ops import checks

    monkeypatch.setattr(checks, "cupy", SimpleNamespace(ndarray=HostStandIn))
