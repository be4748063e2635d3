"""Decode-side timings: batched decode (B sequences), speculative verify (K rows), graph vs eager.

One JSON line per case. Each carries the device-to-device copy bandwidth measured in the same
run and the roofline ratio: the fewest bytes the call must move (every weight once; each
sequence's conv and recurrent state read and written once) over the copy bandwidth, divided by
the measured median time. Times are CUDA-event medians over >= 200 calls after warm-up,
each call between its own pair of events and synchronised (`median_us`: the GPU idles while
Python issues the call, so all Python time inside a call counts); as `queued_median_us` the
median over as many calls queued back to back, each between its own pair of events and one
synchronisation after the last (the GPU's time per call while the host keeps ahead of it: the
per-call median without the idle gap, with `queued_roofline_ratio`); as `back_to_back_us` the mean
over 200 calls issued without synchronising between two events: what a decode loop that chains
layers pays per call, with `back_to_back_roofline_ratio` from it; and as `host_us` the host's time
per call of such a loop (perf_counter; above the GPU's time, the loop is bound by Python, and the
queued and back-to-back figures are the host's). When flash-linear-attention is importable, its
KimiDeltaAttention layer runs the same decode cases (graphed) on the same weights in the
same process (impl "fla").

Graphed and eager are KdaOptions.graphs True and False; --variant NAME=VALUE[,...] (KdaOptions
fields, repeatable) adds the cases once more with those options (`"options"` in each line names them).

    PYTHONPATH=. python benchmarks/decode.py [--geometry glm kimi] [--repeats 200] [--variant hopper=False]
    glm-kda bench decode ... (the same, from a source checkout)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from .layers import make_layer, parse_options, with_options
from .timing import (MIN_TIMED_CALLS, back_to_back_ms, copy_bandwidth_gbs, decode_bytes, host_us, median_ms,
                     replay_ms, timed_calls)


def bench_geometry(geometry: str, directory: Path, bandwidth: float, repeats: int,
                   variants: tuple[dict, ...] = ({},)) -> list[dict]:
    """The decode cases of one geometry, graphed and eager, for each variant (KdaOptions fields
    over the defaults; {}: the defaults)."""
    import cupy
    import numpy as np

    from glm_kda.gpu.arrays import to_device_bf16
    from glm_kda.state import StatePool
    from glm_kda.synthetic import synthetic_hidden

    layer = make_layer(directory, geometry, 256)
    defaults = layer.options
    cfg = layer.config
    hidden = to_device_bf16(synthetic_hidden(256, cfg.hidden, seed=3))
    pool = StatePool(cfg, 256)
    rows = []

    def record(case: dict, call, nbytes: int) -> None:
        ms = median_ms(call, repeats=repeats, warmup=10)
        queued_ms = float(np.median(replay_ms(call, calls=repeats)))
        chained_ms = back_to_back_ms(call, calls=repeats)
        roofline_ms = nbytes / 1e9 / bandwidth * 1e3  # the call's bytes at the copy bandwidth
        case.update(impl="glm_kda", geometry=geometry, options=changed, median_us=1e3 * ms,
                    queued_median_us=1e3 * queued_ms, back_to_back_us=1e3 * chained_ms, host_us=host_us(call, calls=repeats),
                    bytes=nbytes, copy_bandwidth_GBs=bandwidth, roofline_ratio=roofline_ms / ms,
                    queued_roofline_ratio=roofline_ms / queued_ms, back_to_back_roofline_ratio=roofline_ms / chained_ms)
        rows.append(case)
        print(json.dumps(case), flush=True)

    for changed in variants:
        for graph in (True, False):
            layer.options = defaults
            with_options(layer, **{**changed, "graphs": graph})
            state = layer.new_state()
            record({"case": "decode", "B": 1, "graph": graph, "api": "state"}, lambda: layer.decode(hidden[:1], state),
                   decode_bytes(cfg))
            for batch in (1, 4, 16, 64, 256):
                slots = cupy.arange(batch, dtype=cupy.int32)
                # Device slots on the unchecked path (a decode loop's); "pool, checked" pays the read-back.
                record({"case": "decode", "B": batch, "graph": graph, "api": "pool"},
                       lambda: layer.decode(hidden[:batch], pool, slots, check_slots=False), decode_bytes(cfg, batch))
                if batch in (1, 64):
                    record({"case": "decode", "B": batch, "graph": graph, "api": "pool, checked"},
                           lambda: layer.decode(hidden[:batch], pool, slots), decode_bytes(cfg, batch))
            for k in (2, 4, 8, 16):
                record({"case": "verify", "K": k, "graph": graph}, lambda: layer.decode_k(hidden[:k], state),
                       decode_bytes(cfg))
    layer.options = defaults
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", nargs="+", default=["glm", "kimi"], choices=["glm", "kimi"])
    parser.add_argument("--repeats", type=timed_calls(), default=MIN_TIMED_CALLS,
                        help="timed calls per case after warm-up (>= 200)")
    parser.add_argument("--variant", type=parse_options, action="append", default=[], metavar="NAME=VALUE[,...]",
                        help="also run every case with these KdaOptions fields changed (repeatable)")
    parser.add_argument("--no-fla", dest="fla", action="store_false", help="skip the flash-linear-attention rows")


def run(args: argparse.Namespace) -> int:
    import cupy

    from glm_kda.checkpoint import bind_layer

    from .bench_fla import bench_fla_decode, comparison_note, decorate_row

    bandwidth = copy_bandwidth_gbs()
    fla_ok, note = comparison_note(args.fla)
    print(json.dumps({**note, "copy_bandwidth_GBs": bandwidth}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for geometry in args.geometry:
            bench_geometry(geometry, Path(tmp), bandwidth, args.repeats, ({}, *args.variant))
            cupy.get_default_memory_pool().free_all_blocks()
            if fla_ok:
                import torch

                bound = bind_layer(Path(tmp) / geometry, 0, progress=False)
                for row in bench_fla_decode(bound, repeats=args.repeats, graphs=(True,)):
                    print(json.dumps(decorate_row(row, geometry, bound.config, bandwidth)), flush=True)
                torch.cuda.empty_cache()
    return 0
