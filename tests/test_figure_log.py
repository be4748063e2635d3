"""tests/figure_log.py: the GPU suite's figures on disk as they are recorded."""

from __future__ import annotations

import json

from figure_log import FigureLog


def test_figure_log_keeps_rows_as_they_come(tmp_path):
    """The GPU suite's figures: each row on disk as it is recorded (a run stopped early keeps them),
    the JSON list at the end; without a target nothing is written."""
    target = tmp_path / "figures.json"
    log = FigureLog(str(target))
    log.append({"test": "a", "ratio": 1e-4})
    log.append({"test": "b", "ratio": 2e-4})
    partial = tmp_path / "figures.json.partial"
    assert [json.loads(line) for line in partial.read_text().splitlines()] == list(log)
    assert not target.exists()
    log.close()
    assert json.loads(target.read_text()) == [{"test": "a", "ratio": 1e-4}, {"test": "b", "ratio": 2e-4}]
    assert not partial.exists()
    quiet = FigureLog(None)
    quiet.append({"test": "c"})
    quiet.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.json"]
