"""One decode step (eager, B=1) or one prefill, bracketed by cudaProfilerStart/Stop, for
Nsight Compute: every kernel of the step and nothing of the set-up.

    ncu --clock-control none --profile-from-start off --csv \\
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size \\
        python benchmarks/profile_kernels.py decode glm
    python benchmarks/profile_kernels.py prefill glm 16384
    python benchmarks/profile_kernels.py decode glm 64     # 64 sequences of a StatePool
    python benchmarks/profile_kernels.py decode glm --variant hopper=False   # KdaOptions fields

Geometries as in benchmarks/lib/bench_prefill.py (glm, kimi, kimi-bounded). Before the profiled
range it prints one JSON line: the case, its fewest bytes and the copy bandwidth measured in the
same run, so the profiler's kernel times can be read against `roofline_us`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.bench_prefill import PREFILL_GEOMETRIES, geometry_config  # noqa: E402
from lib.layers import parse_options  # noqa: E402
from lib.timing import count_at_least  # noqa: E402


def main(kind: str, geometry: str, tokens: int, options: dict) -> None:
    import cupy
    import numpy as np

    from glm_kda.gpu.arrays import to_device_bf16
    from glm_kda.state import StatePool
    from glm_kda.synthetic import synthetic_hidden

    from lib.layers import make_layer, with_options
    from lib.timing import copy_bandwidth_gbs, decode_bytes, prefill_bytes

    bandwidth = copy_bandwidth_gbs()
    with tempfile.TemporaryDirectory() as tmp:
        layer = make_layer(Path(tmp), geometry_config(geometry), max(tokens, 16), name=geometry, own_workspace=True)
    with_options(layer, **{**options, "graphs": False})
    hidden = to_device_bf16(synthetic_hidden(max(tokens, 1), layer.config.hidden, seed=3))
    state = layer.new_state()
    if kind == "prefill":
        step = lambda: layer.prefill(hidden[:tokens], state)  # noqa: E731
        nbytes = prefill_bytes(layer.config, tokens)
    elif tokens == 1:
        step = lambda: layer.decode(hidden[:1], state)  # noqa: E731
        nbytes = decode_bytes(layer.config)
    else:
        # Batched decode: `tokens` sequences of a pool, one token each, slots shuffled.
        pool = StatePool(layer.config, tokens)
        slots = cupy.asarray(np.random.default_rng(0).permutation(tokens).astype(np.int32))
        step = lambda: layer.decode(hidden[:tokens], pool, slots, check_slots=False)  # noqa: E731
        nbytes = decode_bytes(layer.config, tokens)
    print(json.dumps({"case": kind, "geometry": geometry, "rows": tokens, "options": options, "bytes": nbytes,
                      "copy_bandwidth_GBs": bandwidth, "roofline_us": nbytes / 1e3 / bandwidth}), flush=True)
    for _ in range(3):
        step()
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    step()
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.stop()


if __name__ == "__main__":
    from lib.script import exit_unless_gpu

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["decode", "prefill"])
    parser.add_argument("geometry", choices=list(PREFILL_GEOMETRIES))
    parser.add_argument("tokens", type=count_at_least(1), nargs="?", default=1,
                        help="decode: sequences (1: one state); prefill: tokens")
    parser.add_argument("--variant", type=parse_options, action="append", default=[], metavar="NAME=VALUE[,...]",
                        help="KdaOptions fields of the layer")
    args = parser.parse_args()
    exit_unless_gpu("the kernel profile")
    main(args.kind, args.geometry, args.tokens, {k: v for fields in args.variant for k, v in fields.items()})
