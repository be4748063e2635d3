"""Decode-side timings: batched decode (B sequences), speculative verify (K rows), graph vs eager.

One JSON line per case. Each carries the device-to-device copy bandwidth measured in the same
run and the roofline ratio: the fewest bytes the call must move (every weight once; each
sequence's conv and recurrent state read and written once) over the copy bandwidth, divided by
the measured median time. Times are CUDA-event medians over >= 200 calls after warm-up,
measured on the stream, so Python time inside a call counts when the GPU waits for it.

    glm-kda bench decode [--geometry glm kimi] [--repeats 200]
    PYTHONPATH=. python benchmarks/decode.py (the same)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from .selftest import copy_bandwidth_gbs, median_ms, state_bytes, weight_bytes


def bench_geometry(geometry: str, directory: Path, bandwidth: float, repeats: int) -> list[dict]:
    import cupy

    from .layer import KdaLayer, to_device_bf16
    from .state import StatePool
    from .synthetic import synthetic_hidden, write_synthetic_checkpoint

    path = write_synthetic_checkpoint(directory / geometry, geometry, num_layers=1)
    layer = KdaLayer.from_pretrained(path, 0, max_tokens=256, progress=False)
    cfg = layer.config
    hidden = to_device_bf16(synthetic_hidden(256, cfg.hidden, seed=3))
    pool = StatePool(cfg, 256)
    rows = []

    def record(case: dict, ms: float, nbytes: int) -> None:
        case.update(geometry=geometry, median_us=1e3 * ms, bytes=nbytes, copy_bandwidth_GBs=bandwidth,
                    roofline_ratio=nbytes / 1e9 / bandwidth / (ms / 1e3))
        rows.append(case)
        print(json.dumps(case), flush=True)

    for graph in (True, False):
        layer.use_graphs = graph
        for batch in (1, 4, 16, 64, 256):
            slots = cupy.arange(batch, dtype=cupy.int32)
            ms = median_ms(lambda: layer.decode(hidden[:batch], pool, slots), repeats=repeats, warmup=10)
            record({"case": "decode", "B": batch, "graph": graph}, ms, weight_bytes(cfg) + batch * state_bytes(cfg))
        state = layer.new_state()
        for k in (2, 4, 8, 16):
            ms = median_ms(lambda: layer.decode_k(hidden[:k], state), repeats=repeats, warmup=10)
            record({"case": "verify", "K": k, "graph": graph}, ms, weight_bytes(cfg) + state_bytes(cfg))
    layer.use_graphs = True
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", nargs="+", default=["glm", "kimi"], choices=["glm", "kimi"])
    parser.add_argument("--repeats", type=int, default=200)


def run(args: argparse.Namespace) -> int:
    from .device import require_gpu

    require_gpu("the decode benchmark")
    import cupy

    bandwidth = copy_bandwidth_gbs()
    try:
        import fla  # noqa: F401  (only to say whether the comparison could run)

        print(json.dumps({"note": "flash-linear-attention is importable; its comparison is not wired in yet"}))
    except ImportError:
        print(json.dumps({"note": "flash-linear-attention not importable here: no comparison rows"}))
    with tempfile.TemporaryDirectory() as tmp:
        for geometry in args.geometry:
            bench_geometry(geometry, Path(tmp), bandwidth, args.repeats)
            cupy.get_default_memory_pool().free_all_blocks()
    return 0
