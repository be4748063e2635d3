"""The driver structures that glm_kda.graph_copies hands to cuGraphExecMemcpyNodeSetParams and
cuGraphExecKernelNodeSetParams, and its answers where the driver lacks an entry point.

Offsets and sizes as cuda.h lays out CUDA_MEMCPY3D and CUDA_KERNEL_NODE_PARAMS_v2 on 64-bit Linux
(a C program printing sizeof and offsetof against CUDA 13.0's cuda.h gave these numbers): a field
out of place would repoint the wrong address.
"""

import ctypes

from glm_kda.graph_copies import KernelNodeParams, Memcpy3D


def test_memcpy3d_matches_the_driver_layout():
    expected = {"srcMemoryType": 32, "srcDevice": 48, "dstMemoryType": 120, "dstDevice": 136, "WidthInBytes": 176}
    got = {name: getattr(Memcpy3D, name).offset for name in expected}
    assert got == expected, f"field offsets {got}, cuda.h has {expected}"
    assert ctypes.sizeof(Memcpy3D) == 200, f"sizeof {ctypes.sizeof(Memcpy3D)}, cuda.h has 200"


def test_a_driver_that_cannot_repoint_copies_is_none(monkeypatch):
    """No libcuda, or one lacking an entry point used here: driver() is None (the copies then run
    beside the graphs), never an exception out of the first decode call."""
    from types import SimpleNamespace

    from glm_kda import graph_copies

    def cdll(name):
        raise OSError(f"{name}: cannot open shared object file")

    for loader in (cdll, lambda name: SimpleNamespace(cuCtxGetCurrent=SimpleNamespace())):
        monkeypatch.setattr(graph_copies, "_DRIVER", None)
        monkeypatch.setattr(graph_copies.ctypes, "CDLL", loader)
        assert graph_copies.driver() is None
        assert graph_copies.driver() is None, "the answer is kept"


def test_kernel_node_params_match_the_driver_layout():
    expected = {"func": 0, "gridDimX": 8, "sharedMemBytes": 32, "kernelParams": 40, "extra": 48, "kern": 56,
                "ctx": 64}
    got = {name: getattr(KernelNodeParams, name).offset for name in expected}
    assert got == expected, f"field offsets {got}, cuda.h has {expected}"
    assert ctypes.sizeof(KernelNodeParams) == 72, f"sizeof {ctypes.sizeof(KernelNodeParams)}, cuda.h has 72"


def test_kernel_entries_take_the_v2_forms_then_the_plain_ones_else_none(monkeypatch):
    """cuGraphKernelNodeGetParams_v2 / cuGraphExecKernelNodeSetParams_v2 where the driver has both,
    else the names without _v2, else None (the copies then stay memcpy nodes)."""
    from types import SimpleNamespace

    from glm_kda import graph_copies

    def entry():
        return SimpleNamespace(argtypes=None, restype=None)

    both = {"cuGraphKernelNodeGetParams_v2": entry(), "cuGraphExecKernelNodeSetParams_v2": entry(),
            "cuGraphKernelNodeGetParams": entry(), "cuGraphExecKernelNodeSetParams": entry()}
    plain = {name: value for name, value in both.items() if not name.endswith("_v2")}
    half = {"cuGraphKernelNodeGetParams_v2": entry(), "cuGraphExecKernelNodeSetParams": entry()}
    for names, expected in ((both, "_v2"), (plain, ""), (half, None), ({}, None)):
        monkeypatch.setattr(graph_copies, "_KERNEL_ENTRIES", None)
        monkeypatch.setattr(graph_copies, "driver", lambda names=names: SimpleNamespace(**names))
        got = graph_copies.kernel_entries()
        if expected is None:
            assert got is None, f"{sorted(names)}: {got}"
        else:
            assert got == (names["cuGraphKernelNodeGetParams" + expected],
                           names["cuGraphExecKernelNodeSetParams" + expected]), sorted(names)
            assert got[0].restype is ctypes.c_int and got[0].argtypes[1]._type_ is KernelNodeParams
    monkeypatch.setattr(graph_copies, "_KERNEL_ENTRIES", None)
    monkeypatch.setattr(graph_copies, "driver", lambda: None)
    assert graph_copies.kernel_entries() is None, "no driver, no kernel entries"


def test_kernel_copies_point_their_own_argument_values():
    """KernelCopies keeps each node's fixed address (the input's dst, the output's src) and size,
    and point() changes the other address in the parameters it hands the driver."""
    from types import SimpleNamespace

    from glm_kda.graph_copies import KernelCopies

    def node_params(src, dst, size):
        values = (ctypes.c_uint64(src), ctypes.c_uint64(dst), ctypes.c_int64(size))
        array = (ctypes.c_void_p * 3)(*(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values))
        params = KernelNodeParams(func=1234, gridDimX=1, blockDimX=256)
        params.kernelParams = ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p))
        return params, (values, array)

    calls = []

    def put(graph_exec, node, params):
        p = params.contents
        read = [ctypes.cast(p.kernelParams[i], ctypes.POINTER(kind)).contents.value
                for i, kind in enumerate((ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64))]
        calls.append((node, read, p.func, p.blockDimX))
        return 0

    (input_params, keep_in), (output_params, keep_out) = node_params(11, 0x1000, 64), node_params(0x2000, 22, 128)
    copies = KernelCopies(put, 99, "in", "out", input_params, output_params, (64, 128))
    array = lambda ptr: SimpleNamespace(data=SimpleNamespace(ptr=ptr))
    assert copies.point(array(0x5000), array(0x6000))
    assert calls == [("in", [0x5000, 0x1000, 64], 1234, 256), ("out", [0x2000, 0x6000, 128], 1234, 256)], calls
