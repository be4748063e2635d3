"""notebooks/explore_stages.ipynb runs top to bottom (on the NumPy path where there is no GPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "explore_stages.ipynb"


def test_explore_stages_notebook_runs(monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="nbformat comes with the test extra")
    nbclient = pytest.importorskip("nbclient", reason="nbclient comes with the test extra")
    monkeypatch.setenv("GLM_KDA_NOTEBOOK_GEOMETRY", "tiny-kimi")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # The kernel is a new process: let it import this checkout even when it is not installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(NOTEBOOK.parent.parent), os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    printed = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", []))
    assert "final_out" in printed and "conv_out" in printed, printed[-2000:]
