"""The driver structure that glm_kda.gpu.graph_copies hands to cuGraphExecMemcpyNodeSetParams.

Offsets and size as cuda.h lays out CUDA_MEMCPY3D on 64-bit Linux (a C program printing
sizeof and offsetof against CUDA 13.0's cuda.h gave these numbers): a field out of place would
repoint the wrong address.
"""

import ctypes

from glm_kda.gpu.graph_copies import Memcpy3D


def test_memcpy3d_matches_the_driver_layout():
    expected = {"srcMemoryType": 32, "srcDevice": 48, "dstMemoryType": 120, "dstDevice": 136, "WidthInBytes": 176}
    got = {name: getattr(Memcpy3D, name).offset for name in expected}
    assert got == expected, f"field offsets {got}, cuda.h has {expected}"
    assert ctypes.sizeof(Memcpy3D) == 200, f"sizeof {ctypes.sizeof(Memcpy3D)}, cuda.h has 200"


def test_a_driver_that_cannot_repoint_copies_is_none(monkeypatch):
    """No libcuda, or one lacking an entry point used here: driver() is None (the copies then run
    beside the graphs), never an exception out of the first decode call."""
    from types import SimpleNamespace

    from glm_kda.gpu import graph_copies

    def cdll(name):
        raise OSError(f"{name}: cannot open shared object file")

    for loader in (cdll, lambda name: SimpleNamespace(cuCtxGetCurrent=SimpleNamespace())):
        monkeypatch.setattr(graph_copies, "_DRIVER", None)
        monkeypatch.setattr(graph_copies.ctypes, "CDLL", loader)
        assert graph_copies.driver() is None
        assert graph_copies.driver() is None, "the answer is kept"
