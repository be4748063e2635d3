"""What a public decode call costs the host, against what its graph costs the GPU.

For each geometry and call form (`decode(row, state)`, `decode(rows, pool, slots)` with device
or host slots, `decode_k(rows, state)`), one JSON line:
  * host_us: wall-clock time per call of 200 calls issued without synchronising, taken on the
    host (perf_counter) before the final synchronisation: the Python and driver work of a call;
  * graph_us: the call's captured graph replayed back to back between two CUDA events: the GPU
    time of the same work (with copies_in_graph, the call's two copies included);
  * back_to_back_us: the public call itself between two events, 200 calls: the larger of the two
    above, roughly, for a decode loop that does not synchronise every token.
Each case runs with the copies as graph nodes (layer.GRAPH_COPIES_IN_GRAPH) and beside the graph.
A call whose host_us is over its graph_us leaves the GPU idle between steps. With --profile, the
functions that take the host's time in `decode(row, state)` (cProfile, 2000 calls, by own time)
and the cost of CuPy primitives a call uses, each timed alone.

    PYTHONPATH=. python benchmarks/host_cost.py [--profile] [glm kimi]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from glm_kda.device import exit_unless_gpu
from glm_kda.selftest import host_us

CALLS = 200


def primitive_costs(layer, hidden) -> dict:
    """Microseconds per call of the CuPy operations a public call is made of, each alone."""
    import cupy
    import numpy as np

    ws = layer.workspace
    stream = cupy.cuda.get_current_stream()
    dst = ws.graph_hidden[:1]
    graph = layer._graphs.last_graph
    ops = {
        "slice [:1]": lambda: ws.final_out[:1],
        "view uint16": lambda: hidden.view(np.uint16),
        "flags.c_contiguous": lambda: hidden.flags.c_contiguous,
        "device.id": lambda: hidden.device.id,
        "data.ptr": lambda: hidden.data.ptr,
        "get_current_stream": cupy.cuda.get_current_stream,
        "cupy.empty": lambda: cupy.empty((1, layer.config.hidden), hidden.dtype),
        "memcpy (MemoryPointer)": lambda: dst.data.copy_from_device_async(hidden.data, hidden.nbytes, stream),
        "memcpy (runtime)": lambda: cupy.cuda.runtime.memcpyAsync(dst.data.ptr, hidden.data.ptr, hidden.nbytes, 3,
                                                                  stream.ptr),
        "graph.launch": lambda: graph.launch(stream),
    }
    out = {}
    for name, op in ops.items():
        out[name] = host_us(op, 2000)
    return out


def profile_lines(fn, calls: int = 2000, top: int = 25) -> list[str]:
    import cProfile
    import io
    import pstats

    for _ in range(10):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue().splitlines()


def bench(geometry: str, directory: Path, profile: bool) -> None:
    import cupy

    from glm_kda.gpu import layer as layer_module
    from glm_kda.gpu.layer import KdaLayer, to_device_bf16
    from glm_kda.selftest import back_to_back_ms
    from glm_kda.state import StatePool
    from glm_kda.synthetic import synthetic_hidden, write_synthetic_checkpoint

    path = write_synthetic_checkpoint(directory / geometry, geometry, num_layers=1)
    layer = KdaLayer.from_pretrained(path, 0, max_tokens=64, progress=False)
    hidden = to_device_bf16(synthetic_hidden(16, layer.config.hidden, seed=3))
    state = layer.new_state()
    pool = StatePool(layer.config, 8)
    device_slots = cupy.arange(4, dtype=cupy.int32)
    cases = {
        "decode(row, state)": lambda: layer.decode(hidden[:1], state),
        "decode(1 row, pool, device slots)": lambda: layer.decode(hidden[:1], pool, device_slots[:1]),
        "decode(4 rows, pool, device slots)": lambda: layer.decode(hidden[:4], pool, device_slots),
        "decode(4 rows, pool, host slots)": lambda: layer.decode(hidden[:4], pool, [0, 1, 2, 3]),
        "decode_k(4 rows, state)": lambda: layer.decode_k(hidden[:4], state),
    }
    found = layer_module.GRAPH_COPIES_IN_GRAPH
    for copies_in_graph in (True, False):
        layer_module.GRAPH_COPIES_IN_GRAPH = copies_in_graph
        layer._graphs.clear()
        for name, call in cases.items():
            for _ in range(3):
                call()
            graph = layer._graphs.last_graph
            stream = cupy.cuda.get_current_stream()
            graph_us = 1e3 * back_to_back_ms(lambda: graph.launch(stream), CALLS)
            row = {"geometry": geometry, "call": name, "copies_in_graph": copies_in_graph, "host_us": host_us(call),
                   "graph_us": graph_us, "back_to_back_us": 1e3 * back_to_back_ms(call, CALLS)}
            print(json.dumps(row), flush=True)
    layer_module.GRAPH_COPIES_IN_GRAPH = found
    layer._graphs.clear()
    if profile:
        layer.decode(hidden[:1], state)
        print(json.dumps({"geometry": geometry, "primitives_us": primitive_costs(layer, hidden[:1])}), flush=True)
        for line in profile_lines(lambda: layer.decode(hidden[:1], state)):
            print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # No `choices` here: argparse checks a positional's whole default list (or []) against them.
    parser.add_argument("geometry", nargs="*", help="glm and / or kimi (default: kimi glm)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    unknown = sorted(set(args.geometry) - {"glm", "kimi"})
    if unknown:
        parser.error(f"unknown geometry {', '.join(map(repr, unknown))} (choose from 'glm', 'kimi')")
    exit_unless_gpu("the host-cost benchmark")
    with tempfile.TemporaryDirectory() as tmp:
        for geometry in args.geometry or ["kimi", "glm"]:
            bench(geometry, Path(tmp), args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
