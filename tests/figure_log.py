"""The measured figures of a GPU test run, kept as they are recorded."""

from __future__ import annotations

import json
from pathlib import Path


class FigureLog(list):
    """A list of figure rows (dicts). With a target path each appended row also goes at once, as one
    JSON line, to `<target>.partial`, so that a run stopped before its end (a time limit) keeps what
    it measured; close() writes the whole list to the target as JSON and removes the partial file."""

    def __init__(self, target: str | Path | None = None):
        super().__init__()
        self.target = Path(target) if target else None
        self.partial = self.target.with_name(self.target.name + ".partial") if self.target else None
        if self.partial is not None:
            self.partial.write_text("")

    def append(self, row: dict) -> None:
        super().append(row)
        if self.partial is not None:
            with self.partial.open("a") as log:
                log.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self.target is not None:
            self.target.write_text(json.dumps(list(self), indent=1))
            self.partial.unlink(missing_ok=True)
