"""The package imports anywhere; GPU entry points fail clearly where there is no GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

import glm_kda
from glm_kda.gpu import build as kernels
from glm_kda.device import NoGpuError, gpu_status


def test_import_needs_no_gpu():
    code = "import glm_kda, glm_kda.gpu.layer, glm_kda.gpu.build, glm_kda.tp; print(glm_kda.__version__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == glm_kda.__version__


@pytest.mark.skipif(gpu_status()[0], reason="a GPU is present: the no-GPU error cannot show")
def test_gpu_entry_points_say_why_they_cannot_run(tmp_path):
    with pytest.raises(NoGpuError, match="needs a CUDA GPU"):
        glm_kda.KdaLayer.from_pretrained(tmp_path, 0)


def test_kernel_sources_are_found():
    root = kernels.kernels_dir()
    stems = {path.relative_to(root).with_suffix("").as_posix() for path in root.rglob("*.cu")}
    assert set(kernels.ENTRY_POINTS) <= stems, f"missing .cu files for {set(kernels.ENTRY_POINTS) - stems}"


def test_the_public_names_show_in_dir_and_carry_docstrings():
    """What tab completion offers: every name of __all__, the lazily imported GPU classes included,
    each with a docstring, and every public method of the GPU classes too."""
    names = dir(glm_kda)
    assert set(glm_kda.__all__) <= set(names)
    assert {"KdaLayer", "KdaStack", "KdaWorkspace", "KdaOptions"} <= set(names)
    for name in glm_kda.__all__:
        item = getattr(glm_kda, name)
        if callable(item):
            assert (item.__doc__ or "").strip(), f"glm_kda.{name} has no docstring"
    for cls in (glm_kda.KdaLayer, glm_kda.KdaStack):
        undocumented = [m for m, f in vars(cls).items() if not m.startswith("_") and callable(getattr(f, "__func__", f))
                        and not (getattr(f, "__doc__", None) or "").strip()]
        assert not undocumented, f"{cls.__name__}: public methods without a docstring: {undocumented}"
