"""The driver structure that glm_kda.graph_copies hands to cuGraphExecMemcpyNodeSetParams.

Offsets and size as cuda.h lays out CUDA_MEMCPY3D on 64-bit Linux (a C program printing
sizeof and offsetof against CUDA 13.0's cuda.h gave these numbers): a field out of place would
repoint the wrong address.
"""

import ctypes

from glm_kda.graph_copies import Memcpy3D


def test_memcpy3d_matches_the_driver_layout():
    expected = {"srcMemoryType": 32, "srcDevice": 48, "dstMemoryType": 120, "dstDevice": 136, "WidthInBytes": 176}
    got = {name: getattr(Memcpy3D, name).offset for name in expected}
    assert got == expected, f"field offsets {got}, cuda.h has {expected}"
    assert ctypes.sizeof(Memcpy3D) == 200, f"sizeof {ctypes.sizeof(Memcpy3D)}, cuda.h has 200"
