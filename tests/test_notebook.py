"""The notebooks run top to bottom (on the NumPy path where there is no GPU), their imports resolve,
and they are committed with their plots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parent.parent / "notebooks"
# notebook -> (words its printed output must hold, plots its committed outputs must show)
NOTEBOOKS = {"explore_stages.ipynb": (("final_out", "conv_out"), 3),
             "decode_loop.ipynb": (("ms a token", "ours against float64"), 1)}


def test_every_notebook_is_listed():
    assert sorted(p.name for p in FOLDER.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_the_notebook_runs(monkeypatch, name):
    nbformat = pytest.importorskip("nbformat", reason="nbformat comes with the test extra")
    nbclient = pytest.importorskip("nbclient", reason="nbclient comes with the test extra")
    monkeypatch.setenv("GLM_KDA_NOTEBOOK_GEOMETRY", "tiny-kimi")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # The kernel is a new process: let it import this checkout even when it is not installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FOLDER.parent), os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(FOLDER / name, as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(FOLDER)}}).execute()
    printed = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", []))
    assert all(words in printed for words in NOTEBOOKS[name][0]), printed[-2000:]


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_every_import_in_the_notebook_resolves(name):
    """The GPU branch does not run without a GPU: its imports are checked here instead."""
    import importlib
    import json
    import re

    cells = json.loads((FOLDER / name).read_text())["cells"]
    source = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
    found = re.findall(r"^\s*from (glm_kda[\w.]*) import ([\w, ]+)$", source, flags=re.M)
    assert found, "the notebook imports nothing from glm_kda"
    for module, names in found:
        imported = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(imported, name), f"notebook: from {module} import {name}: no such name"


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_the_committed_notebook_shows_its_plots(name):
    """The notebook is committed with the outputs of a CPU run: its plots are there to read."""
    import json

    cells = json.loads((FOLDER / name).read_text())["cells"]
    images = sum("image/png" in output.get("data", {}) for cell in cells if cell["cell_type"] == "code"
                 for output in cell.get("outputs", []))
    assert images >= NOTEBOOKS[name][1], f"{name}: {images} plots in the committed outputs"


def test_the_notebooks_extra_installs_what_the_notebooks_import():
    """Every third-party module a notebook imports comes with the package or its notebooks extra."""
    import json
    import re
    import sys

    tomllib = pytest.importorskip("tomllib", reason="tomllib comes with Python 3.11")
    project = tomllib.loads((FOLDER.parent / "pyproject.toml").read_text())["project"]
    names = project["dependencies"] + project["optional-dependencies"]["notebooks"]
    installed = {re.split(r"[<>=!~ \[]", name)[0].lower().replace("-", "_") for name in names}
    distribution = {"cupy": "cupy_cuda12x"}  # module -> distribution, where they differ
    for name in NOTEBOOKS:
        cells = json.loads((FOLDER / name).read_text())["cells"]
        source = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
        modules = set(re.findall(r"^\s*(?:import|from) (\w+)", source, flags=re.M))
        third_party = {m for m in modules if m not in sys.stdlib_module_names and m != "glm_kda"}
        missing = sorted(m for m in third_party if distribution.get(m, m).lower() not in installed)
        assert not missing, f"{name} imports {missing}, which neither the package nor its notebooks extra installs"
