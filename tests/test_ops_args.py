"""The launch wrappers' operand checks and stride arithmetic, without a GPU: a stand-in for
cupy.ndarray wraps NumPy arrays (same shape, strides, flags and a data pointer)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from glm_kda import ops
from standins import HostStandIn, aligned


@pytest.fixture(autouse=True)
def stand_in(monkeypatch):
    monkeypatch.setattr(ops, "cupy", SimpleNamespace(ndarray=HostStandIn))


def test_projection_strides_of_column_slices():
    d, heads = 128, 32
    down = HostStandIn(aligned((16, 2 * d + heads)))   # f_a | g_a | b_proj, one buffer
    w = HostStandIn(aligned((4096, d)))
    out = HostStandIn(aligned((16, 4096)))
    rows, n, k, ldx, ldy = ops.projection_args("gemm_rows_bf16", down[:5, d : 2 * d], w, out[:5], None, 256)
    assert (rows, n, k, ldx, ldy) == (5, 4096, d, 2 * d + heads, 4096)
    wide_out = HostStandIn(aligned((4, 3 * 64)))
    x = HostStandIn(aligned((4, 64)))
    w_small = HostStandIn(aligned((64, 64)))
    assert ops.projection_args("gemv_bf16", x, w_small, wide_out[:, 64:128], None, 16)[4] == 3 * 64


@pytest.mark.parametrize("case,needle", [
    ("rows", "rows must be 1..16"),
    ("k", "multiple of 8"),
    ("stride", "row stride"),
    ("misaligned", "aligned"),
    ("dtype", "BF16"),
])
def test_projection_errors_name_the_operand(case, needle):
    x, w, out = aligned((20, 64)), aligned((32, 64)), aligned((20, 32))
    rows = 4
    if case == "rows":
        rows = 17
    elif case == "k":
        x, w = aligned((20, 60)), aligned((32, 60))
    elif case == "stride":
        x = aligned((20, 68))[:, :64]  # rows 68 elements apart: not whole 16-byte vectors
    elif case == "misaligned":
        x = aligned((20, 72)).reshape(-1)[4 : 4 + 20 * 64].reshape(20, 64)
    elif case == "dtype":
        x = aligned((20, 64), np.float32)
    with pytest.raises((ValueError, TypeError), match=needle):
        ops.projection_args("gemv_bf16", HostStandIn(x), HostStandIn(w), HostStandIn(out), rows, 16)


def test_slot_checks():
    pool = HostStandIn(aligned((8, 96, 4), np.float32))
    ops._slot_rows("conv_state", pool, (96, 4), 8, None)
    with pytest.raises(ValueError, match="only 1 state"):
        ops._slot_rows("conv_state", HostStandIn(aligned((96, 4), np.float32)), (96, 4), 2, None)
    with pytest.raises(ValueError, match="int32"):
        ops._slot_rows("conv_state", pool, (96, 4), 3, HostStandIn(np.zeros(3, np.int64)))
