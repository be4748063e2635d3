"""Shared fixtures: real-geometry synthetic checkpoints (written once per session) and a fake hub;
the --portable switch that runs the GPU tests on the path without Hopper-only features."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
from figure_log import FigureLog
from huggingface_hub.errors import EntryNotFoundError

from glm_kda.device import gpu_status
from glm_kda.synthetic import write_synthetic_checkpoint

GPU_PRESENT = gpu_status()[0]


def pytest_addoption(parser):
    parser.addoption("--portable", action="store_true",
                     help="run every test with KdaOptions(hopper=False) as the default and kernel launches made "
                          "without Hopper-only features: the path sm_80 and sm_120 / sm_121 take")
    parser.addoption("--gemm-without-cublas", action="store_true",
                     help="run the prefill's wide projections on a plain tiled kernel of the test suite's instead "
                          "of cuBLAS (for compute-sanitizer's racecheck, which stops with an internal error at "
                          "the first cuBLAS kernel when it instruments ours alone)")
    parser.addoption("--zeroed-cublas-workspace", action="store_true",
                     help="give cuBLAS a workspace filled with zeros (for compute-sanitizer's initcheck, which "
                          "otherwise reports cuBLAS's own split-K reduce reading workspace bytes nothing wrote)")
    parser.addoption("--hang-seconds", type=float, default=120.0,
                     help="how long a test waits for its threads before it calls their work hung (raise it under "
                          "compute-sanitizer, which slows our kernels about a hundredfold)")


@pytest.fixture
def hang_seconds(request) -> float:
    """--hang-seconds: how long a test's threads may take before the test reports a hang."""
    return request.config.getoption("--hang-seconds")


@pytest.fixture(autouse=True, scope="session")
def zeroed_cublas_workspace(request):
    """Under --zeroed-cublas-workspace: CuPy's cuBLAS handle of device 0 works in a zero-filled
    buffer (a memset, so initcheck counts every byte as written) instead of the uninitialised one
    cuBLAS allocates itself. Changes no result of ours: only where cuBLAS keeps its partial sums."""
    if not request.config.getoption("--zeroed-cublas-workspace"):
        yield None
        return
    import ctypes

    import cupy
    from cuda.pathfinder import load_nvidia_dynamic_lib

    size = 64 << 20
    workspace = cupy.zeros(size, cupy.uint8)
    cupy.cuda.Device().synchronize()
    library = ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)  # the copy CuPy loaded
    status = library.cublasSetWorkspace_v2(ctypes.c_void_p(cupy.cuda.device.get_cublas_handle()),
                                           ctypes.c_void_p(workspace.data.ptr), ctypes.c_size_t(size))
    assert status == 0, f"cublasSetWorkspace_v2 returned status {status}"
    yield workspace


@pytest.fixture(autouse=True, scope="session")
def gemm_without_cublas(request):
    """Under --gemm-without-cublas: glm_kda.gpu.ops.gemm_bf16_cublas (the prefill's projections of
    more than 16 rows) runs tests/tiled_gemm.py's kernel instead, on the same shapes and row strides.
    Its sums reassociate as cuBLAS's do (another order, FP32), so the tests' bounds hold; a test of
    cuBLAS's own bits would not."""
    if not request.config.getoption("--gemm-without-cublas"):
        yield None
        return
    from tiled_gemm import tiled_gemm_bf16

    from glm_kda.gpu import ops

    patch = pytest.MonkeyPatch()
    patch.setattr(ops, "gemm_bf16_cublas", tiled_gemm_bf16)
    yield tiled_gemm_bf16
    patch.undo()


@pytest.fixture(autouse=True)
def portable_path(request, monkeypatch):
    """Under --portable: KdaOptions() defaults to hopper=False and launches made outside a layer
    call (the kernel-level tests) run under a LaunchContext with hopper=False. Tests that set
    hopper themselves keep their setting."""
    if not request.config.getoption("--portable"):
        yield False
        return
    from glm_kda.options import KdaOptions

    names = [f.name for f in dataclasses.fields(KdaOptions)]
    defaults = list(KdaOptions.__init__.__defaults__)
    defaults[names.index("hopper")] = False
    monkeypatch.setattr(KdaOptions.__init__, "__defaults__", tuple(defaults))
    assert KdaOptions().hopper is False
    try:
        from glm_kda.gpu import build
    except ImportError:  # no CuPy: nothing launches
        yield True
        return
    with build.launching(build.LaunchContext(hopper=False)):
        yield True


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """After each test, CuPy's pool hands its unused blocks back to the driver: a test's
    buffers (a long prefill's workspace, the float64 oracle's stages) do not stay held for the
    rest of the run, so that several test processes (the sanitizers side by side) fit one GPU."""
    yield
    cupy = sys.modules.get("cupy")
    # (A host test's stand-in CuPy, still in place here, has no pools.)
    if GPU_PRESENT and hasattr(cupy, "get_default_memory_pool"):
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


def pytest_report_header(config):
    return "launch path: portable (hopper=False)" if config.getoption("--portable") else None


@pytest.fixture(scope="session")
def real_checkpoint(tmp_path_factory):
    """real_checkpoint(geometry, layout) -> directory of a one-layer checkpoint at the real
    GLM-5.3-Flash or Kimi-Linear geometry (seed 0), written on first use."""
    written: dict[tuple[str, str], Path] = {}

    def get(geometry: str, layout: str = "release") -> Path:
        if (geometry, layout) not in written:
            directory = tmp_path_factory.mktemp(f"{geometry}-{layout}")
            written[geometry, layout] = write_synthetic_checkpoint(directory, geometry, layout=layout, num_layers=1)
        return written[geometry, layout]

    return get


@pytest.fixture
def fake_hub(monkeypatch):
    """fake_hub(directory) serves `directory` as a hub repo through a stand-in for
    glm_kda's hf_hub_download; returns the list of (repo_id, filename, kwargs) requested."""

    def serve(directory: Path) -> list[tuple[str, str, dict]]:
        requests: list[tuple[str, str, dict]] = []

        def download(*, repo_id: str, filename: str, **kwargs) -> str:
            requests.append((repo_id, filename, kwargs))
            path = Path(directory) / filename
            if not path.is_file():
                raise EntryNotFoundError(f"{repo_id}: {filename} not found")
            return str(path)

        monkeypatch.setattr("glm_kda.checkpoint.hf_hub_download", download)
        monkeypatch.setattr("glm_kda.files.hf_hub_download", download)
        return requests

    return serve


@pytest.fixture(scope="session")
def figures():
    """A list the GPU tests append their measured ratios to; written as JSON to the path in
    $GLM_KDA_FIGURES at the end of the session (for reports; each row also goes to
    $GLM_KDA_FIGURES.partial as it is recorded, see FigureLog), otherwise discarded."""
    rows = FigureLog(os.environ.get("GLM_KDA_FIGURES"))
    yield rows
    rows.close()


def pytest_runtest_logreport(report):
    """With $GLM_KDA_DURATIONS set, each test phase's seconds appended to that file as it ends
    (`<seconds> <phase> <outcome> <test id>`), and under a failed phase a line `  why: <message>`, so that a
    run stopped by a time limit still says where its time went and why a test failed (pytest's --durations
    and -rfE print only at the end)."""
    target = os.environ.get("GLM_KDA_DURATIONS")
    if target:
        with open(target, "a") as log:
            log.write(f"{report.duration:.3f} {report.when} {report.outcome} {report.nodeid}\n")
            if report.failed:
                crash = getattr(report.longrepr, "reprcrash", None)
                why = crash.message if crash is not None else str(report.longrepr)
                log.write(f"  why: {' | '.join(why.splitlines())[:2000]}\n")
