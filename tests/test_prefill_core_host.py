"""Which q, k and v the prefill's stateful middle hands its kernels, on the host: the launches
KdaLayer._prefill_core issues are recorded (the conv pass and the chunk kernels replaced by
recorders), so CPU CI checks the routing that tests/test_gpu.py::
test_prefill_without_stage_buffers_gives_the_same_bits measures. With options.stage_buffers off and
the tensor-core kernels, the conv pass gets no FP32 split and the chunk prepare reads the conv
output (ConvRows); otherwise both take the FP32 q, k and v buffers.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from glm_kda.gpu import ops
from glm_kda.gpu.layer import KdaLayer
from glm_kda.gpu.ops import chunk_tc
from glm_kda.options import KdaOptions

TOKENS, ROWS, HEADS, D = 70, 128, 2, 128


@pytest.fixture
def recorded(monkeypatch):
    """(a KdaLayer without a device, the list of kernel calls its prefill middle makes)."""
    calls: list[tuple] = []
    monkeypatch.setattr(ops, "kda_conv_prefill_silu_l2_bf16",
                        lambda *args, **kw: calls.append(("conv", args, kw)))
    monkeypatch.setattr(chunk_tc, "chunk_prefill_tc", lambda *args, **kw: calls.append(("tensor", args, kw)))
    monkeypatch.setattr(ops, "kda_gate_beta_f32", lambda *args, **kw: calls.append(("gate", args, kw)))
    monkeypatch.setattr(ops, "kda_chunk_prepare_f32", lambda *args, **kw: calls.append(("prepare_f32", args, kw)))
    monkeypatch.setattr(ops, "kda_chunk_scan_f32", lambda *args, **kw: calls.append(("scan_f32", args, kw)))
    layer = object.__new__(KdaLayer)
    layer.config = SimpleNamespace(heads=HEADS, head_dim=D, l2_eps=1e-6, chunk=64, bounded=False,
                                   gate_lower_bound=None)
    layer.conv_weight, layer.dt_bias, layer.a_log, layer.scale = "conv taps", "dt_bias", "a_log", 0.088
    qkv = HEADS * D
    f32 = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    ws = SimpleNamespace(qkv_proj=np.zeros((ROWS, 3 * qkv), np.uint16), conv_out=np.zeros((ROWS, 3 * qkv), np.uint16),
                         query=f32(ROWS, HEADS, D), key=f32(ROWS, HEADS, D), value=f32(ROWS, HEADS, D),
                         gate=f32(ROWS, HEADS, D), beta=f32(ROWS, HEADS), core=f32(ROWS, HEADS, D),
                         forget_proj=np.zeros((ROWS, qkv), np.uint16), down_proj=np.zeros((ROWS, 2 * D + 32), np.uint16),
                         **{name: name for name in ("q_decay_f16", "k_tail_f16", "chunk_w_f16", "chunk_u", "attn_f16",
                                                    "chunk_decay", "q_decay", "k_tail", "chunk_w", "attn")})
    return layer, ws, calls


@pytest.mark.parametrize("impl,stage_buffers", [("tensor", False), ("tensor", True), ("fp32", False)])
def test_prefill_core_routes_q_k_v(recorded, impl, stage_buffers):
    layer, ws, calls = recorded
    layer._options = dataclasses.replace(KdaOptions(), stage_buffers=stage_buffers)
    layer._chunk_impl = impl
    layer._prefill_core(ws, TOKENS, "conv state", "recurrent state", pad_value=0.0, first=3)
    conv_args = calls[0][1]
    assert calls[0][0] == "conv" and conv_args[3].base is ws.conv_out and conv_args[3].shape[0] == ROWS - 3
    fast = impl == "tensor" and not stage_buffers
    if fast:
        assert conv_args[4:7] == (None, None, None), "no FP32 split without the stage buffers"
        kind, args, kw = calls[-1]
        assert kind == "tensor" and args[:3] == (None, None, None)
        assert isinstance(kw["conv"], chunk_tc.ConvRows) and kw["conv"].l2_eps == 1e-6
        assert kw["conv"].conv_out.base is ws.conv_out and kw["conv"].conv_out.shape[0] == ROWS - 3
    else:
        assert all(a.base is b for a, b in zip(conv_args[4:7], (ws.query, ws.key, ws.value))), "the FP32 split"
        kind, args, kw = calls[-1]
        if impl == "tensor":
            assert kind == "tensor" and kw["conv"] is None and args[0].base is ws.query
        else:
            assert kind == "scan_f32" and [c[0] for c in calls] == ["conv", "gate", "prepare_f32", "scan_f32"]
