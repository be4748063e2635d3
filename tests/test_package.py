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
