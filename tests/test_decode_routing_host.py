"""How a decode-side call hands the low-rank chain to the fused step, on the host: the launches
_decode_rows issues are recorded (the projections and the step replaced by recorders, the
workspace's streams by a log), so CPU CI checks the routing that the GPU tests measure (the bits of
tests/test_gpu.py and tests/test_stack_gpu.py, the same with or without the count):
  * one sequence: the pair launch counts its blocks in chain_ready, the step awaits that count and
    lets o_proj launch once its inputs are formed, and the side stream is joined after o_proj, not
    before the step (with join=False, not at all: the caller joins);
  * more step blocks than SMs, or a timed call: the streams join before the step, and nothing counts;
  * a step refused after the chain counted: the streams are joined and the count is set back to zero.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import cupy
import numpy as np
import pytest

from glm_kda.gpu import build, ops
from glm_kda.gpu import pipeline
from glm_kda.gpu import projection
from glm_kda.gpu.layer import KdaLayer

HEADS, DIM, HIDDEN, SMS = 4, 8, 12, 132


class Words:
    """chain_ready / outputs_ready: fill() noted in the log."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def fill(self, value):
        self.log.append(("fill", self.name, value))


class Workspace(SimpleNamespace):
    """The buffers _decode_rows slices, and beside / join_open noting forks and joins in `log`."""

    def __init__(self, log, rows=16):
        def bf16(*shape):
            return np.zeros(shape, np.uint16)

        super().__init__(
            log=log, device_id=0, qkv_proj=bf16(rows, 3 * HEADS * DIM), down_proj=bf16(rows, 2 * DIM + HEADS),
            forget_proj=bf16(rows, HEADS * DIM), out_gate=bf16(rows, HEADS * DIM), o_norm_out=bf16(rows, HEADS * DIM),
            final_out=bf16(rows, HIDDEN), conv_out=bf16(rows, 3 * HEADS * DIM), query=None, key=None, value=None,
            gate=None, beta=None, core=None, x_tiles="x_tiles", x_tiles_side="x_tiles_side",
            x_tiles_gate="x_tiles_gate", bulk_partial="bulk_partial", outputs_ready=Words("outputs_ready", log),
            chain_ready=Words("chain_ready", log))
        for name in ("query", "key", "value", "gate", "core"):
            setattr(self, name, np.zeros((rows, HEADS, DIM), np.float32))
        self.beta = np.zeros((rows, HEADS), np.float32)

    @contextlib.contextmanager
    def beside(self, concurrent, branch=0, join=True):
        self.log.append(("fork", branch) if concurrent else ("serial",))
        yield contextlib.nullcontext()
        if concurrent and join:
            self.log.append(("join", branch))
        elif concurrent:
            self.log.append(("open", branch))

    def join_open(self):
        self.log.append(("join_open",))


@pytest.fixture
def recorded(monkeypatch):
    """(a KdaLayer without a device, its workspace, the log of launches, forks and joins)."""
    log: list[tuple] = []
    monkeypatch.setattr(projection, "sm_count", lambda device_id: SMS)
    monkeypatch.setattr(projection, "bulk_applies", lambda w, rows, bulk=None: False)
    packed = {name: object.__new__(projection.PackedWeight) for name in ("qkv_weight", "down_weight", "f_b", "g_b",
                                                                          "o_proj")}
    names = {id(weight): name for name, weight in packed.items()}
    monkeypatch.setattr(projection, "gemm_rows_bf16", lambda x, w, out, rows=None, **kw: log.append(
        ("gemm_rows", names[id(w)], kw.get("ready_target", 0))) or 0)
    # (the refused call's clean-up asks whether the stream is capturing)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: SimpleNamespace(is_capturing=lambda: False))

    def pair(x, w, out, x2, w2, out2, rows=None, *, done=None, **kw):
        log.append(("pair", done.name if done is not None else None))
        return 9

    monkeypatch.setattr(projection, "gemm_rows_pair_bf16", pair)

    def step(*args, chain_ready=None, chain_target=0, dependents_after=0, outputs_ready=None, **kw):
        log.append(("step", chain_ready.name if chain_ready is not None else None, chain_target, dependents_after))
        return HEADS

    monkeypatch.setattr(ops, "kda_decode_fused_bf16", step)
    layer = object.__new__(KdaLayer)
    layer.config = SimpleNamespace(heads=HEADS, head_dim=DIM, bounded=True, gate_lower_bound=-5.0, l2_eps=1e-6,
                                   rms_norm_eps=1e-6)
    layer._packed = packed
    for name in ("conv_weight", "dt_bias", "a_log", "o_norm"):
        setattr(layer, name, name)
    layer.scale, layer._o_proj_sums = DIM**-0.5, None
    return layer, Workspace(log), log


def _hidden(rows):
    return np.zeros((rows, HIDDEN), np.uint16)


def test_one_sequence_awaits_the_chain_count_and_joins_after_o_proj(recorded):
    layer, ws, log = recorded
    layer._decode_rows(ws, _hidden(1), "conv", "recurrent", slots="slots")
    kinds = [entry[0] for entry in log]
    assert kinds == ["fork", "gemm_rows", "pair", "gemm_rows", "open", "step", "gemm_rows", "join_open"], log
    assert [log[i][1] for i in (1, 3, 6)] == ["down_weight", "qkv_weight", "o_proj"], log
    assert log[2] == ("pair", "chain_ready")
    assert log[5] == ("step", "chain_ready", 9, pipeline._CHAINED_STEP_DEPENDENTS_AFTER), log[5]
    assert pipeline._CHAINED_STEP_DEPENDENTS_AFTER == 1, "o_proj launches once the step's inputs are formed"
    log.clear()
    layer._decode_rows(ws, _hidden(3), "conv", "recurrent", sequential=True, join=False)
    assert [entry[0] for entry in log][-1] == "gemm_rows", f"join=False leaves the side stream open: {log}"
    assert ("step", "chain_ready", 9, 1) in log, "a walk of one sequence awaits the count too"


@pytest.mark.parametrize("case", ["too_many_blocks", "timed", "snapshots"])
def test_otherwise_the_streams_join_before_the_step(recorded, monkeypatch, case):
    layer, ws, log = recorded
    rows, kwargs = 1, dict(slots="slots")
    if case == "too_many_blocks":
        monkeypatch.setattr(projection, "sm_count", lambda device_id: 2 * HEADS)
        rows = 3  # (<= 16 rows: still one pair launch)
    elif case == "timed":
        context = build.current_context()
        monkeypatch.setattr(build, "current_context", lambda: SimpleNamespace(**{**vars(context), "timer": object()}))
        monkeypatch.setattr(pipeline, "_section", lambda name: contextlib.nullcontext())
    else:
        rows, kwargs = 2, dict(sequential=True, snapshots=[SimpleNamespace(conv=np.zeros(1), recurrent=np.zeros(1))])
    layer._decode_rows(ws, _hidden(rows), np.zeros(1), np.zeros(1), **kwargs)
    steps = [entry for entry in log if entry[0] == "step"]
    assert steps and all(entry[1:3] == (None, 0) for entry in steps), f"{case}: {steps}"
    assert ("pair", None) in log, f"{case}: the pair counts nothing: {log}"
    assert "open" not in [entry[0] for entry in log], f"{case}: no stream left open: {log}"
    kinds = [entry[0] for entry in log]
    assert ("join" in kinds and kinds.index("join") < kinds.index("step")) or kinds[0] == "serial", log


def test_a_refused_step_after_the_count_joins_and_clears_it(recorded, monkeypatch):
    layer, ws, log = recorded

    def refused(*args, **kwargs):
        raise ValueError("refused")

    monkeypatch.setattr(ops, "kda_decode_fused_bf16", refused)
    with pytest.raises(ValueError, match="refused"):
        layer._decode_rows(ws, _hidden(1), "conv", "recurrent", slots="slots")
    kinds = [entry[0] for entry in log]
    assert kinds[-2:] == ["join_open", "fill"] and log[-1] == ("fill", "chain_ready", 0), log
