"""The input and output copies of a graphed decode call as nodes of its graph, repointed per call.

A replayed decode call copies the caller's rows into the workspace's fixed input buffer, launches
the graph, and copies the output rows into a new array. As separate stream operations the two
copies cost the host two memcpy calls and the GPU two launches of their own around the graph.
Captured into the graph instead (a memcpy node first, one last), each call only points the two
nodes at its own arrays (cuGraphExecMemcpyNodeSetParams: it changes the launches that follow, not
those already queued) and launches once.

The copies take one of two forms. KernelCopies: two launches of the kda_graph_copy kernel
(glm_kda.ops.graph_copy), repointed by cuGraphExecKernelNodeSetParams. A kernel node takes part in
programmatic launches where a memcpy node does not: the projection after the input copy launches as
its programmatic dependent (its blocks start while the copy runs), and the output copy as that of
the output projection (its blocks wait on their SMs for its end). GraphCopies: two memcpy nodes,
repointed by cuGraphExecMemcpyNodeSetParams.

The driver API is reached through ctypes (libcuda, which every CUDA process has loaded); anything
missing or refused there makes `find` return None, and the caller takes the other form, or keeps
the separate copies.
"""

from __future__ import annotations

import ctypes
from typing import Any

# cuda.h: CUgraphNodeType CU_GRAPH_NODE_TYPE_KERNEL and CU_GRAPH_NODE_TYPE_MEMCPY.
NODE_TYPE_KERNEL, NODE_TYPE_MEMCPY = 0, 1


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


class KernelNodeParams(ctypes.Structure):
    """cuda.h's CUDA_KERNEL_NODE_PARAMS_v2 (72 bytes on 64-bit Linux; its first 56 bytes are the
    v1 structure, which the entry points without _v2 read and write)."""

    _fields_ = [
        ("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
        ("kernelParams", ctypes.POINTER(ctypes.c_void_p)), ("extra", ctypes.POINTER(ctypes.c_void_p)),
        ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p),
    ]


_DRIVER: Any = None
_KERNEL_ENTRIES: Any = None


def _declare(lib: Any, name: str, argtypes: list) -> Any:
    """lib's entry point `name` with its argument types declared (CUresult back), or None."""
    function = getattr(lib, name, None)
    if function is not None:
        function.argtypes = argtypes
        function.restype = ctypes.c_int
    return function


def driver() -> Any:
    """libcuda with the five entry points of the memcpy form declared, or None where it cannot be
    loaded or lacks one of them."""
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
            if _declare(lib, name, argtypes) is None:  # a driver without it: the copies stay beside the graphs
                _DRIVER = False
                return None
        _DRIVER = lib
    return _DRIVER or None


def kernel_entries() -> Any:
    """(cuGraphKernelNodeGetParams, cuGraphExecKernelNodeSetParams) of the driver, their _v2 forms
    where it has them, or None where it has neither form (or driver() is None)."""
    global _KERNEL_ENTRIES
    if _KERNEL_ENTRIES is None:
        lib = driver()
        _KERNEL_ENTRIES = False
        if lib is not None:
            handle, params = ctypes.c_void_p, ctypes.POINTER(KernelNodeParams)
            for suffix in ("_v2", ""):
                get = _declare(lib, "cuGraphKernelNodeGetParams" + suffix, [handle, params])
                put = _declare(lib, "cuGraphExecKernelNodeSetParams" + suffix, [handle, handle, params])
                if get is not None and put is not None:
                    _KERNEL_ENTRIES = (get, put)
                    break
    return _KERNEL_ENTRIES or None


def _graph_nodes(lib: Any, graph: Any, kind: int) -> list | None:
    """The nodes of `graph` (a cupy.cuda.graph.Graph) of CUgraphNodeType `kind`, or None where the
    driver refused."""
    count = ctypes.c_size_t(0)
    if lib.cuGraphGetNodes(ctypes.c_void_p(graph.graph), None, ctypes.byref(count)) != 0:
        return None
    nodes = (ctypes.c_void_p * count.value)()
    if lib.cuGraphGetNodes(ctypes.c_void_p(graph.graph), nodes, ctypes.byref(count)) != 0:
        return None
    found = []
    for node in nodes:
        node_kind = ctypes.c_int(-1)
        if lib.cuGraphNodeGetType(node, ctypes.byref(node_kind)) != 0:
            return None
        if node_kind.value == kind:
            found.append(node)
    return found


def _current_context(lib: Any) -> Any:
    context = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(context)) != 0 or not context.value:
        return None
    return context


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
        nodes = None if lib is None else _graph_nodes(lib, graph, NODE_TYPE_MEMCPY)
        if nodes is None:
            return None
        inputs, outputs = [], []
        for node in nodes:
            params = Memcpy3D()
            if lib.cuGraphMemcpyNodeGetParams(node, ctypes.byref(params)) != 0:
                return None
            flat = params.Height <= 1 and params.Depth <= 1
            if flat and params.dstDevice == input_dst and params.WidthInBytes == nbytes[0]:
                inputs.append((node, params))
            if flat and params.srcDevice == output_src and params.WidthInBytes == nbytes[1]:
                outputs.append((node, params))
        context = _current_context(lib)
        if len(inputs) != 1 or len(outputs) != 1 or context is None:
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


class KernelCopies:
    """The input and output kda_graph_copy nodes of one captured graph, repointed by `point`."""

    def __init__(self, put: Any, graph_exec: int, input_node: Any, output_node: Any,
                 input_params: KernelNodeParams, output_params: KernelNodeParams, sizes: tuple[int, int]):
        self._put = put
        self._exec = ctypes.c_void_p(graph_exec)
        self._input_node, self._output_node = input_node, output_node
        # Each node's arguments (src, dst, bytes) as values of ours, which its parameters point at:
        # the input's dst and the output's src stay the workspace's, the other two change per call.
        self._input_values = (ctypes.c_uint64(0), ctypes.c_uint64(_argument(input_params, 1)), ctypes.c_int64(sizes[0]))
        self._output_values = (ctypes.c_uint64(_argument(output_params, 0)), ctypes.c_uint64(0), ctypes.c_int64(sizes[1]))
        self._input, self._output = input_params, output_params
        self._arrays = []
        for params, values in ((input_params, self._input_values), (output_params, self._output_values)):
            array = (ctypes.c_void_p * 3)(*(ctypes.cast(ctypes.pointer(value), ctypes.c_void_p) for value in values))
            params.kernelParams = ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p))
            params.extra = None
            self._arrays.append(array)
        self._input_ref, self._output_ref = ctypes.pointer(input_params), ctypes.pointer(output_params)
        self.held: tuple = ()

    @classmethod
    def find(cls, graph: Any, input_dst: int, output_src: int, nbytes: tuple[int, int]) -> "KernelCopies | None":
        """The kernel nodes of `graph` (a cupy.cuda.graph.Graph) launching kda_graph_copy (of the
        current KernelSet) that copy nbytes[0] bytes into input_dst and nbytes[1] bytes out of
        output_src: exactly one of each, else None."""
        from glm_kda import kernels

        function = kernels.function_handle("kda_graph_copy")
        lib, entries = driver(), kernel_entries()
        nodes = None if lib is None or entries is None else _graph_nodes(lib, graph, NODE_TYPE_KERNEL)
        if nodes is None:
            return None
        get, put = entries
        inputs, outputs = [], []
        for node in nodes:
            params = KernelNodeParams()
            if get(node, ctypes.byref(params)) != 0:
                return None
            if params.func != function or not params.kernelParams:
                continue
            src, dst, size = _argument(params, 0), _argument(params, 1), _argument(params, 2, ctypes.c_int64)
            if dst == input_dst and size == nbytes[0]:
                inputs.append((node, params))
            if src == output_src and size == nbytes[1]:
                outputs.append((node, params))
        if len(inputs) != 1 or len(outputs) != 1:
            return None
        return cls(put, graph.graphExec, inputs[0][0], outputs[0][0], inputs[0][1], outputs[0][1], nbytes)

    def point(self, source: Any, destination: Any) -> bool:
        """As GraphCopies.point: the next launches copy their input from `source` and their output
        into `destination`; False where the driver refused (the graph must not be launched)."""
        self._input_values[0].value = source.data.ptr
        self._output_values[1].value = destination.data.ptr
        self.held = (source, destination)
        return (self._put(self._exec, self._input_node, self._input_ref) == 0
                and self._put(self._exec, self._output_node, self._output_ref) == 0)


def _argument(params: KernelNodeParams, index: int, kind: Any = ctypes.c_uint64) -> int:
    """Argument `index` of a kernel node's parameters, read as `kind`."""
    return ctypes.cast(params.kernelParams[index], ctypes.POINTER(kind)).contents.value
