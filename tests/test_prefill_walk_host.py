"""How a prefill walks its rows, on the host (the stages replaced by recorders): segments of the
workspace's rows, each through the projections once, its middle in windows of the workspace's
middle_rows (each run's rows in the window, then the window's norm) and o_proj once. The GPU tests
(tests/test_gpu.py::test_prefill_in_segments_gives_the_bits_of_one_pass, the packed prefill tests)
measure the bits; this checks the bookkeeping for any shape: every row of every run reaches the
middle exactly once, in order, within the middle's buffers, split only where a window or segment
ends, which are whole chunks from the call's first row.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

from glm_kda.gpu import pipeline
from glm_kda.gpu.layer import KdaLayer
from glm_kda.options import KdaOptions

HIDDEN = 4


def walk(monkeypatch, total, runs, max_tokens, middle_rows, chunk=64, options=KdaOptions()):
    """The recorded calls of _prefill_rows over `total` rows and `runs` [(first, tokens)]:
    ("front", start, rows), ("core", run index, tokens, row, middle_first), ("norm", rows, row),
    ("back", rows, start), rows absolute."""
    calls, segment = [], [0]
    cupy = types.ModuleType("cupy")
    cupy.empty = np.empty
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(pipeline, "copy_into", lambda out, src: calls.append(("copy", out.shape[0])))
    layer = object.__new__(KdaLayer)
    layer.config = SimpleNamespace(chunk=chunk, hidden=HIDDEN)
    layer._options, layer._chunk_impl = options, "tensor"
    ws = SimpleNamespace(max_tokens=max_tokens, middle_rows=middle_rows, unrecorded="stale",
                         final_out=np.zeros((max_tokens, HIDDEN), np.uint16))

    def front_end(ws, hidden, wide):
        start = sum(call[2] for call in calls if call[0] == "front")
        segment[0] = start
        calls.append(("front", start, hidden.shape[0]))

    def core(ws, tokens, conv_state, recurrent_state, pad_value, first, middle_first):
        calls.append(("core", conv_state, tokens, segment[0] + first, middle_first))

    layer._front_end = front_end
    layer._prefill_core = core
    layer._norm = lambda ws, rows, first: calls.append(("norm", rows, segment[0] + first))
    layer._back_end = lambda ws, rows, wide, first=0, out=None: calls.append(
        ("back", rows, first, "final_out" if out is None else out.shape[0]))
    layer._prefill_rows(ws, np.zeros((total, HIDDEN), np.uint16),
                        [(first, tokens, index, index) for index, (first, tokens) in enumerate(runs)], None)
    return calls, ws


def check_walk(calls, runs, total, middle_rows, chunk=64):
    fronts = [call for call in calls if call[0] == "front"]
    assert [start for _, start, _ in fronts] == list(np.cumsum([0] + [rows for _, _, rows in fronts])[:-1])
    assert sum(rows for _, _, rows in fronts) == total, "the projections ran over every row once"
    assert [(rows, start) for _, rows, start, _ in (c for c in calls if c[0] == "back")] == \
        [(rows, start) for _, start, rows in fronts], "o_proj once a segment, over its rows"
    segment_starts = [start for _, start, _ in fronts]
    for start in segment_starts:
        assert start % chunk == 0, f"a segment starts at row {start}, inside a chunk"
    # Windows: the norms tile every segment, each from a whole number of middle_rows after its segment's start.
    norms = [(row, rows) for _, rows, row in (c for c in calls if c[0] == "norm")]
    assert sorted(norms) == norms and sum(rows for _, rows in norms) == total, norms
    for row, rows in norms:
        start = max(s for s in segment_starts if s <= row)
        assert (row - start) % middle_rows == 0 and 0 < rows <= middle_rows, (row, rows, start)
    # Every run's rows reach the middle once, in order, within the window's buffers.
    for index, (first, tokens) in enumerate(runs):
        pieces = [(row, n, middle_first) for _, run, n, row, middle_first in (c for c in calls if c[0] == "core")
                  if run == index]
        assert pieces and pieces[0][0] == first and sum(n for _, n, _ in pieces) == tokens, (index, pieces)
        for (row, n, middle_first), (next_row, _, _) in zip(pieces, pieces[1:]):
            assert row + n == next_row, f"run {index}: rows {row + n}..{next_row} skipped or repeated"
        for row, n, middle_first in pieces:
            window = max(w for w, _ in norms if w <= row)
            assert middle_first == row - window and middle_first + n <= middle_rows, (index, row, n, middle_first)
            assert row + n <= window + dict(norms)[window], f"run {index}: a piece crosses its window's end"


@pytest.mark.parametrize("total,max_tokens,middle_rows", [(10000, 10000, 4096), (10000, 3000, 1024), (700, 700, 704),
                                                          (4096, 4096, 4096), (100, 300, 128)],
                         ids=["windows", "segments_and_windows", "one_window", "exactly_one", "short"])
def test_a_sequence_alone_is_cut_only_at_whole_chunks(monkeypatch, total, max_tokens, middle_rows):
    """One sequence: every piece of its middle but the last is whole chunks, so it is chunked as in
    one pass; the unrecorded reason names the windows or the segments where the stages are lost."""
    calls, ws = walk(monkeypatch, total, [(0, total)], max_tokens, middle_rows)
    check_walk(calls, [(0, total)], total, middle_rows)
    pieces = [(row, n) for _, _, n, row, _ in (c for c in calls if c[0] == "core")]
    assert all(row % 64 == 0 for row, _ in pieces), pieces
    expected = -(-total // min(middle_rows, max_tokens // 64 * 64 if total > max_tokens else total))
    assert len(pieces) >= expected, pieces


def test_packed_runs_through_windows_and_segments(monkeypatch):
    """The packed lengths of the GPU tests, through windows of 1024 rows of one segment, and through
    segments of 2048 rows with windows of 512: each run's rows once, split where windows end."""
    lengths = [1, 17, 64, 100, 1000, 3, 4096, 250]
    bounds = np.cumsum([0] + lengths)
    runs = [(int(first), int(n)) for first, n in zip(bounds[:-1], lengths)]
    total = int(bounds[-1])
    for max_tokens, middle_rows in ((total, 1024), (2048, 512), (total, 8192)):
        calls, _ = walk(monkeypatch, total, runs, max_tokens, middle_rows)
        check_walk(calls, runs, total, middle_rows)


def test_the_stages_are_refused_after_windows_of_a_recording_layer(monkeypatch):
    """A layer recording its stages on a lean workspace: a prefill longer than its middle_rows leaves
    them unrecorded, named by the windows; one within it records them; past the workspace's rows,
    the segments are named."""
    recording = KdaOptions(stage_buffers=True)
    for total, max_tokens, reason in ((5000, 8192, "windows of 4096 rows"), (4000, 8192, None),
                                      (5000, 4096, "segments of 4096 rows")):
        _, ws = walk(monkeypatch, total, [(0, total)], max_tokens, 4096, options=recording)
        assert ws.unrecorded is None if reason is None else reason in ws.unrecorded, (total, ws.unrecorded)
    _, ws = walk(monkeypatch, 4000, [(0, 4000)], 8192, 4096)
    assert "stage_buffers=False" in ws.unrecorded, ws.unrecorded


def test_the_output_goes_through_final_out_only_where_it_is_recorded(monkeypatch):
    """o_proj writes into final_out, then a copy into the returned rows, only where the stage buffers
    record the call; otherwise straight into the returned array's rows of each segment, no copy."""
    recording = KdaOptions(stage_buffers=True)
    calls, ws = walk(monkeypatch, 4000, [(0, 4000)], 8192, 4096, options=recording)
    assert ws.unrecorded is None
    assert [c for c in calls if c[0] in ("back", "copy")] == [("back", 4000, 0, "final_out"), ("copy", 4000)], calls
    for total, max_tokens, options in ((4000, 8192, KdaOptions()), (5000, 8192, recording), (5000, 2048, recording)):
        calls, ws = walk(monkeypatch, total, [(0, total)], max_tokens, 4096, options=options)
        assert ws.unrecorded is not None
        backs = [c for c in calls if c[0] == "back"]
        assert not [c for c in calls if c[0] == "copy"], calls
        assert [out_rows for *_, out_rows in backs] == [rows for _, rows, _, _ in backs], backs
