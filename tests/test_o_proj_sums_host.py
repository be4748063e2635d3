"""Where KdaLayer.o_proj_sums sends o_proj, on the host: the launches back_end issues are recorded
(gemm_rows_bf16, cuBLAS and the rounding replaced by recorders), so CPU CI checks the routing the
GPU tests (tests/test_gpu.py::test_o_proj_sums_keep_the_bits_and_round_to_them, the tensor-parallel
tests) measure: with sums set, the decode side passes the sums' rows to gemm_rows_bf16 beside the
forms it would take anyway (awaiting the fused step's count, staged); prefill gets cuBLAS's FP32
result, rounded into final_out.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from glm_kda.gpu import projection as gemm_rows
from glm_kda.gpu import ops
from glm_kda.gpu.layer import KdaLayer

ROWS, QKV, HIDDEN = 8, 16, 12


@pytest.fixture
def recorded(monkeypatch):
    """(a KdaLayer without a device, the list of launches its back end issues)."""
    calls: list[tuple] = []
    monkeypatch.setattr(gemm_rows, "gemm_rows_bf16",
                        lambda x, w, out, rows=None, **kw: calls.append(("gemm_rows", x, w, out, rows, kw)) or 7)
    monkeypatch.setattr(ops, "gemm_bf16_cublas", lambda x, w, out: calls.append(("cublas", x, w, out)))
    monkeypatch.setattr(ops, "round_to_bf16", lambda values, out: calls.append(("round", values, out)))
    layer = object.__new__(KdaLayer)
    layer.ws = SimpleNamespace(
        o_norm_out=np.zeros((ROWS, QKV), np.uint16), final_out=np.zeros((ROWS, HIDDEN), np.uint16),
        outputs_ready=np.zeros(2, np.int32), x_tiles=np.zeros(64, np.uint16), bulk_partial=np.zeros(64, np.float32))
    layer.config = SimpleNamespace(heads=2, head_dim=8, rms_norm_eps=1e-6)
    packed = object.__new__(gemm_rows.PackedWeight)
    layer._packed = {"o_proj": packed}
    layer.o_proj = "o_proj row-major"
    layer._o_proj_sums = None
    return layer, calls, packed


@pytest.mark.parametrize("ready_blocks", [0, 5], ids=["after_the_step", "awaiting_the_step"])
def test_decode_side_o_proj_writes_the_sums_rows(recorded, ready_blocks):
    layer, calls, packed = recorded
    sums = np.full((ROWS, HIDDEN), np.nan, np.float32)
    layer._o_proj_sums = sums
    # ready_blocks: the blocks of the step before that count their outputs out
    layer._back_end(layer.ws, 3, wide=False, ready_target=ready_blocks)
    assert len(calls) == 1, calls
    kind, x, w, out, rows, kw = calls[0]
    assert kind == "gemm_rows" and w is packed and rows == 3
    assert out.base is layer.ws.final_out and out.shape == (3, HIDDEN)
    assert kw["sums"].base is sums and kw["sums"].shape == (3, HIDDEN), "the sums' first rows"
    assert kw["ready_target"] == ready_blocks and (kw["ready"] is not None) == bool(ready_blocks), kw
    assert kw["staged"] == bool(ready_blocks), "the awaiting o_proj keeps its staged forms"


def test_without_sums_the_output_projection_is_unchanged(recorded):
    layer, calls, packed = recorded
    layer._back_end(layer.ws, 1, wide=False, ready_target=5)
    kind, _, w, out, rows, kw = calls[0]
    assert kind == "gemm_rows" and kw["sums"] is None and kw["ready_target"] == 5 and kw["ready"] is not None


def test_prefill_o_proj_rounds_cublas_fp32_result_into_final_out(recorded):
    layer, calls, _ = recorded
    sums = np.full((ROWS, HIDDEN), np.nan, np.float32)
    layer._o_proj_sums = sums
    layer._back_end(layer.ws, 6, wide=True)
    assert [call[0] for call in calls] == ["cublas", "round"], calls
    _, x, w, out = calls[0]
    assert w == "o_proj row-major" and out.base is sums and out.shape == (6, HIDDEN)
    _, values, rounded = calls[1]
    assert values.base is sums and values.shape == (6, HIDDEN)
    assert rounded.base is layer.ws.final_out and rounded.shape == (6, HIDDEN)
