"""The input and output copies of a graphed decode call as nodes of its graph, repointed per call
(docs/design.md, "CUDA graphs"). The driver is reached through ctypes (libcuda); anything missing or refused
there makes `GraphCopies.find` return None, and the caller keeps the separate copies.
"""

from __future__ import annotations

import ctypes
from typing import Any

# cuda.h: CUgraphNodeType CU_GRAPH_NODE_TYPE_MEMCPY.
NODE_TYPE_MEMCPY = 1


class Memcpy3D(ctypes.Structure):
    """cuda.h's CUDA_MEMCPY3D (200 bytes on 64-bit Linux; srcDevice at byte 48, dstDevice at 136)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcZ", ctypes.c_size_t),
        ("srcLOD", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p), ("reserved0", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t), ("srcHeight", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstZ", ctypes.c_size_t),
        ("dstLOD", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p), ("reserved1", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t), ("dstHeight", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Depth", ctypes.c_size_t),
    ]


_DRIVER: Any = None


def driver() -> Any:
    """libcuda with the five entry points used here declared, or None where it cannot be loaded or
    lacks one of them."""
    global _DRIVER
    if _DRIVER is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            _DRIVER = False
            return None
        handle, p_handle = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        signatures = {
            "cuCtxGetCurrent": [p_handle],
            "cuGraphGetNodes": [handle, p_handle, ctypes.POINTER(ctypes.c_size_t)],
            "cuGraphNodeGetType": [handle, ctypes.POINTER(ctypes.c_int)],
            "cuGraphMemcpyNodeGetParams": [handle, ctypes.POINTER(Memcpy3D)],
            "cuGraphExecMemcpyNodeSetParams": [handle, handle, ctypes.POINTER(Memcpy3D), handle],
        }
        for name, argtypes in signatures.items():
            function = getattr(lib, name, None)
            if function is None:  # a driver without it: the copies stay beside the graphs
                _DRIVER = False
                return None
            function.argtypes = argtypes
            function.restype = ctypes.c_int
        _DRIVER = lib
    return _DRIVER or None


class GraphCopies:
    """The input and output memcpy nodes of one captured graph, repointed by `point`."""

    def __init__(self, lib: Any, graph_exec: int, context: Any, input_node: Any, output_node: Any,
                 input_params: Memcpy3D, output_params: Memcpy3D):
        self._set = lib.cuGraphExecMemcpyNodeSetParams
        self._exec = ctypes.c_void_p(graph_exec)
        self._context = context
        self._input_node, self._output_node = input_node, output_node
        self._input, self._output = input_params, output_params
        self._input_ref, self._output_ref = ctypes.pointer(input_params), ctypes.pointer(output_params)
        self.held: tuple = ()

    @classmethod
    def find(cls, graph: Any, input_dst: int, output_src: int, nbytes: tuple[int, int]) -> "GraphCopies | None":
        """The memcpy nodes of `graph` (a cupy.cuda.graph.Graph) that copy nbytes[0] bytes into
        input_dst and nbytes[1] bytes out of output_src: exactly one of each, else None."""
        lib = driver()
        if lib is None:
            return None
        count = ctypes.c_size_t(0)
        if lib.cuGraphGetNodes(ctypes.c_void_p(graph.graph), None, ctypes.byref(count)) != 0:
            return None
        nodes = (ctypes.c_void_p * count.value)()
        if lib.cuGraphGetNodes(ctypes.c_void_p(graph.graph), nodes, ctypes.byref(count)) != 0:
            return None
        inputs, outputs = [], []
        for node in nodes:
            kind = ctypes.c_int(-1)
            if lib.cuGraphNodeGetType(node, ctypes.byref(kind)) != 0:
                return None
            if kind.value != NODE_TYPE_MEMCPY:
                continue
            params = Memcpy3D()
            if lib.cuGraphMemcpyNodeGetParams(node, ctypes.byref(params)) != 0:
                return None
            flat = params.Height <= 1 and params.Depth <= 1
            if flat and params.dstDevice == input_dst and params.WidthInBytes == nbytes[0]:
                inputs.append((node, params))
            if flat and params.srcDevice == output_src and params.WidthInBytes == nbytes[1]:
                outputs.append((node, params))
        if len(inputs) != 1 or len(outputs) != 1:
            return None
        context = ctypes.c_void_p()
        if lib.cuCtxGetCurrent(ctypes.byref(context)) != 0 or not context.value:
            return None
        return cls(lib, graph.graphExec, context, inputs[0][0], outputs[0][0], inputs[0][1], outputs[0][1])

    def point(self, source: Any, destination: Any) -> bool:
        """The next launches copy their input from CuPy array `source` and their output into
        `destination` (C-contiguous, of the sizes captured). Both stay referenced until the
        next call, so that a replay of the graph alone (as the benchmarks time it) reads and
        writes live memory. False where the driver refused: the nodes may then point anywhere,
        and the graph must not be launched."""
        self._input.srcDevice = source.data.ptr
        self._output.dstDevice = destination.data.ptr
        self.held = (source, destination)
        return (self._set(self._exec, self._input_node, self._input_ref, self._context) == 0
                and self._set(self._exec, self._output_node, self._output_ref, self._context) == 0)
