"""What a public decode call costs the host, against what its graph costs the GPU.

For each geometry and call form (`decode(row, state)`, `decode(rows, pool, slots)` with device
or host slots, `decode_k(rows, state)`), one JSON line:
  * host_us: wall-clock time per call of 200 calls issued without synchronising, taken on the
    host (perf_counter) before the final synchronisation: the Python and driver work of a call;
  * graph_us: the call's captured graph (layer.graphs.last_graph) replayed back to back between
    two CUDA events: the GPU time of the same work;
  * back_to_back_us: the public call itself between two events, 200 calls: the larger of the two
    above, roughly, for a decode loop that does not synchronise every token;
  * the call's roofline: its fewest bytes at the copy bandwidth measured in the same run
    (`roofline_us`), and graph_us's and back_to_back_us's ratios to it.
A call whose host_us is over its graph_us leaves the GPU idle between steps. With --profile, the
functions that take the host's time in `decode(row, state)` (cProfile, 2000 calls, by own time)
and the cost of CuPy primitives a call uses, each timed alone.

    PYTHONPATH=. python benchmarks/host_cost.py [--profile] [glm kimi]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.timing import back_to_back_ms, copy_bandwidth_gbs, decode_bytes, host_us, roofline_fields  # noqa: E402

CALLS = 200


def primitive_costs(graph, hidden) -> dict:
    """Microseconds per call of the CuPy operations a public call is made of, each alone."""
    import cupy
    import numpy as np

    stream = cupy.cuda.get_current_stream()
    dst = cupy.empty_like(hidden)
    ops = {
        "slice [:1]": lambda: hidden[:1],
        "view uint16": lambda: hidden.view(np.uint16),
        "flags.c_contiguous": lambda: hidden.flags.c_contiguous,
        "device.id": lambda: hidden.device.id,
        "data.ptr": lambda: hidden.data.ptr,
        "get_current_stream": cupy.cuda.get_current_stream,
        "cupy.empty": lambda: cupy.empty(hidden.shape, hidden.dtype),
        "memcpy (MemoryPointer)": lambda: dst.data.copy_from_device_async(hidden.data, hidden.nbytes, stream),
        "memcpy (runtime)": lambda: cupy.cuda.runtime.memcpyAsync(dst.data.ptr, hidden.data.ptr, hidden.nbytes, 3,
                                                                  stream.ptr),
        "graph.launch": lambda: graph.launch(stream),
    }
    return {name: host_us(op, 2000) for name, op in ops.items()}


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


def bench(geometry: str, directory: Path, bandwidth: float, profile: bool) -> None:
    import cupy

    from glm_kda.gpu.arrays import to_device_bf16
    from glm_kda.state import StatePool
    from glm_kda.synthetic import synthetic_hidden

    from lib.layers import last_graph, make_layer

    layer = make_layer(directory, geometry, 64)
    cfg = layer.config
    hidden = to_device_bf16(synthetic_hidden(16, cfg.hidden, seed=3))
    state = layer.new_state()
    pool = StatePool(cfg, 8)
    device_slots = cupy.arange(4, dtype=cupy.int32)
    cases = {
        "decode(row, state)": (lambda: layer.decode(hidden[:1], state), 1),
        "decode(1 row, pool, device slots)": (lambda: layer.decode(hidden[:1], pool, device_slots[:1], check_slots=False), 1),
        "decode(4 rows, pool, device slots)": (lambda: layer.decode(hidden[:4], pool, device_slots, check_slots=False), 4),
        "decode(4 rows, pool, device slots, checked)": (lambda: layer.decode(hidden[:4], pool, device_slots), 4),
        "decode(4 rows, pool, host slots)": (lambda: layer.decode(hidden[:4], pool, [0, 1, 2, 3]), 4),
        "decode_k(4 rows, state)": (lambda: layer.decode_k(hidden[:4], state), 1),
    }
    stream = cupy.cuda.get_current_stream()
    for name, (call, sequences) in cases.items():
        for _ in range(3):
            call()  # eager, capture, replay
        graph = last_graph(layer)
        graph_us = 1e3 * back_to_back_ms(lambda: graph.launch(stream), CALLS)
        call_us = 1e3 * back_to_back_ms(call, CALLS)
        row = {"geometry": geometry, "call": name, "host_us": host_us(call), "graph_us": graph_us,
               "back_to_back_us": call_us,
               **roofline_fields(decode_bytes(cfg, sequences), bandwidth, graph_us=graph_us,
                                 back_to_back_us=call_us)}
        print(json.dumps(row), flush=True)
    if profile:
        layer.decode(hidden[:1], state)
        print(json.dumps({"geometry": geometry, "primitives_us": primitive_costs(last_graph(layer), hidden[:1])}),
              flush=True)
        for line in profile_lines(lambda: layer.decode(hidden[:1], state)):
            print(line)


def main() -> int:
    from lib.script import exit_unless_gpu

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # No `choices` here: argparse checks a positional's whole default list (or []) against them.
    parser.add_argument("geometry", nargs="*", help="glm and / or kimi (default: kimi glm)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    unknown = sorted(set(args.geometry) - {"glm", "kimi"})
    if unknown:
        parser.error(f"unknown geometry {', '.join(map(repr, unknown))} (choose from 'glm', 'kimi')")
    exit_unless_gpu("the host-cost benchmark")
    bandwidth = copy_bandwidth_gbs()
    with tempfile.TemporaryDirectory() as tmp:
        for geometry in args.geometry or ["kimi", "glm"]:
            bench(geometry, Path(tmp), bandwidth, args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
