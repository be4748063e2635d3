"""Where a decode step spends its time, one JSON line per geometry and variant.

  * per-kernel GPU time of an eager step (layer.timing(): CUDA events around every launch, 20
    steps averaged);
  * the captured graph replayed back to back with no Python in between, in 5 interleaved rounds of
    200 replays, each replay between its own pair of events: the GPU time of one step (the median
    over the 1000 replays, `graph_replay_us`), its roofline ratio against the copy bandwidth
    measured in the same run, the replays of verify K=4 and K=16 (decode_k) over it, and steps of
    64 and 256 sequences of a pool (shuffled slots) with their own roofline ratios; beside them,
    as `*_back_to_back_us`, the median over the rounds of the mean replay of 200 launched between
    two events alone, and, as `graph_replay_cold_l2_us`, the one-row step with L2 scrubbed before
    each replay (a Kimi-Linear step moves 84 MB, within a small factor of the H200's L2: what one
    replay leaves there must not count for the next);
  * the public call (input copy, replay, output copy) issued back to back, 200 calls between
    two events: what a decode loop that does not synchronise every token pays per call.
Each geometry runs the variants in the same process, each the package's defaults (KdaOptions())
with the fields it names changed: the defaults, the decode weights row-major instead of the
projection's packed layout (packed_weights=False), and each --variant NAME=VALUE[,...] given
(KdaOptions fields only, say hopper=False). To compare two versions of the package (other kernel
sources, other code) use benchmarks/compare_versions.py, which runs each in a process of its own.

    PYTHONPATH=. python benchmarks/decode_breakdown.py [--variant NAME=VALUE[,...] ...] [glm kimi]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.layers import option_fields, parse_options  # noqa: E402

ROUNDS = 5
VERIFY_K = (4, 16)
BATCHES = (64, 256)
GEOMETRIES = ("glm", "kimi")


def variant(**fields) -> tuple:
    """The KdaOptions fields that differ from the defaults, as sorted (name, value) pairs."""
    return tuple(sorted(fields.items()))


VARIANTS = (variant(), variant(packed_weights=False))


def settings_of(chosen: tuple, base: dict) -> dict:
    """The full KdaOptions fields of a variant over `base`; an unknown name is an error."""
    unknown = set(dict(chosen)) - set(base)
    if unknown:
        raise ValueError(f"unknown variant settings {sorted(unknown)}; known: {sorted(base)}")
    return {**base, **dict(chosen)}


def variants_of(extra: list[dict]) -> tuple:
    """VARIANTS, then the --variant ones, each once."""
    out = list(VARIANTS)
    for fields in extra:
        if variant(**fields) not in out:
            out.append(variant(**fields))
    return tuple(out)


def main(geometries: list[str], extra: list[dict]) -> None:
    import cupy
    import numpy as np

    from glm_kda.gpu.arrays import to_device_bf16
    from glm_kda.options import KdaOptions
    from glm_kda.state import StatePool
    from glm_kda.synthetic import synthetic_hidden

    from lib.layers import last_graph, make_layer
    from lib.timing import back_to_back_ms, copy_bandwidth_gbs, decode_bytes, l2_scrub, replay_ms, roofline

    def replay_us(fn, between=None) -> list[float]:
        return [1e3 * ms for ms in replay_ms(fn, between=between)]

    base = option_fields()
    variants = variants_of(extra)
    chosen = {v: settings_of(v, base) for v in variants}  # an unknown name fails before any GPU work
    bandwidth = copy_bandwidth_gbs()
    stream = cupy.cuda.get_current_stream()
    scrub = l2_scrub()
    with tempfile.TemporaryDirectory() as tmp:
        for geometry in geometries:
            layer = make_layer(Path(tmp), geometry, max(BATCHES))
            cfg = layer.config
            hidden = to_device_bf16(synthetic_hidden(max(BATCHES), cfg.hidden))
            state = layer.new_state()
            pool = StatePool(cfg, 2 * max(BATCHES))
            order = np.random.default_rng(0).permutation(2 * max(BATCHES)).astype(np.int32)
            slots = {batch: cupy.asarray(order[:batch]) for batch in BATCHES}
            nbytes = decode_bytes(cfg)
            captured = {}
            # The first variant twice, the first capture thrown away: in one run the graphs captured
            # first replayed 4 us slower than the same kernels captured later.
            for one in (variants[0],) + variants:
                layer.options = KdaOptions(**chosen[one])
                graphs = {}
                for rows in (1,) + VERIFY_K:
                    for _ in range(3):
                        layer.decode_k(hidden[:rows], state)  # eager, capture, replay
                    graphs[rows] = last_graph(layer)
                for batch in BATCHES:
                    for _ in range(3):
                        layer.decode(hidden[:batch], pool, slots[batch], check_slots=False)
                    graphs[f"B{batch}"] = last_graph(layer)
                with layer.timing() as timer:
                    for _ in range(20):
                        layer.decode(hidden[:1], state)
                per_kernel = {name: 1e3 * ms / 20 for name, ms in timer.summary().items()}
                call_us = 1e3 * back_to_back_ms(lambda: layer.decode(hidden[:1], state))
                captured[one] = (graphs, per_kernel, call_us)
            # The graphs keep what they were captured with: replay them in interleaved rounds,
            # so that drift over the run hits every variant alike.
            replays = {(one, rows): [] for one in variants for rows in captured[one][0]}  # every replay's us
            rounds = {key: [] for key in replays}  # each round's mean replay, launched between two events alone
            cold = {one: [] for one in variants}  # one-row replays with L2 scrubbed before each
            for _ in range(ROUNDS):
                for one in variants:
                    for rows, graph in captured[one][0].items():
                        replays[one, rows] += replay_us(lambda: graph.launch(stream))
                        rounds[one, rows].append(1e3 * back_to_back_ms(lambda: graph.launch(stream)))
                        if rows == 1:
                            cold[one] += replay_us(lambda: graph.launch(stream), between=scrub)
            for one in variants:
                step_us = float(np.median(replays[one, 1]))
                verify = {f"K{rows}": round(float(np.median(replays[one, rows])) / step_us, 3) for rows in VERIFY_K}
                batched = {}
                for batch in BATCHES:
                    batch_bytes = decode_bytes(cfg, batch)
                    batch_us = float(np.median(replays[one, f"B{batch}"]))
                    chained_us = float(np.median(rounds[one, f"B{batch}"]))
                    batched[f"B{batch}_bytes"] = batch_bytes
                    batched[f"B{batch}_graph_replay_us"] = batch_us
                    batched[f"B{batch}_roofline_ratio"] = roofline(batch_bytes, bandwidth, batch_us)
                    batched[f"B{batch}_back_to_back_us"] = chained_us
                    batched[f"B{batch}_back_to_back_roofline_ratio"] = roofline(batch_bytes, bandwidth, chained_us)
                chained_us, cold_us = float(np.median(rounds[one, 1])), float(np.median(cold[one]))
                print(json.dumps({
                    "geometry": geometry, "options": chosen[one], "changed": dict(one),
                    "default": chosen[one] == base, "copy_bandwidth_GBs": bandwidth,
                    "bytes": nbytes, "roofline_us": nbytes / 1e3 / bandwidth,
                    "graph_replays": len(replays[one, 1]), "graph_replay_us": step_us,
                    "graph_replay_roofline_ratio": roofline(nbytes, bandwidth, step_us),
                    "graph_replay_back_to_back_us": chained_us,
                    "graph_replay_back_to_back_roofline_ratio": roofline(nbytes, bandwidth, chained_us),
                    "graph_replay_rounds_us": [round(x, 2) for x in rounds[one, 1]],
                    "graph_replay_cold_l2_us": cold_us,
                    "graph_replay_cold_l2_roofline_ratio": roofline(nbytes, bandwidth, cold_us),
                    "verify_replay_over_decode": verify,
                    **batched,
                    "public_call_back_to_back_us": captured[one][2], "eager_per_kernel_us": captured[one][1],
                }, default=str), flush=True)
            layer.options = KdaOptions()


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # No `choices` here: argparse checks a positional's whole default list (or []) against them.
    parser.add_argument("geometry", nargs="*", help="glm and / or kimi (default: both)")
    parser.add_argument("--variant", type=parse_options, action="append", default=[], metavar="NAME=VALUE[,...]",
                        help="also time the defaults with these KdaOptions fields changed (repeatable)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.geometry) - set(GEOMETRIES))
    if unknown:
        parser.error(f"unknown geometry {', '.join(map(repr, unknown))} (choose from 'glm', 'kimi')")
    args.geometry = args.geometry or list(GEOMETRIES)
    return args


if __name__ == "__main__":
    from lib.script import exit_unless_gpu

    arguments = parse_arguments()
    exit_unless_gpu("the decode breakdown")
    main(arguments.geometry, arguments.variant)
