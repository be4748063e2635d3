"""Decode through a whole KDA stack, one sequence, a loop that waits for each token: the time per
token of KdaStack.decode against the sum of the same layers called one by one (each waited for),
with the copy-bandwidth roofline per layer measured in the same run, and how a token's time splits
between the host's part of the call and the token's graph replayed alone. The stack is timed in rounds,
each next to a copy-bandwidth measurement of its own, so that a drift of the GPU's clocks moves both
sides of a round's roofline ratio; the median round is reported with the spread of the rounds.

The stack has as many KDA layers as the model (GLM-5.3-Flash: 34 of 45 layers; Kimi-Linear-48B:
20 of 27; glm_kda.synthetic.default_kda_layers), each its own copy of one synthetic layer's weights,
all sharing one workspace. One JSON line per geometry.

    PYTHONPATH=. python benchmarks/stack.py [--geometry glm kimi] [--layers N] [--tokens 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.script import exit_unless_gpu  # noqa: E402
from lib.timing import copy_bandwidth_gbs, decode_bytes, median_ms  # noqa: E402

# The model's layer count per geometry (KDA layers follow glm_kda.synthetic.default_kda_layers).
MODEL_LAYERS = {"glm": (45, False), "kimi": (27, True)}


def waited_us(call, rows, warmup: int = 8) -> float:
    """Median microseconds of call(row) for each row, each waited for (median_ms: events around it,
    then a synchronisation): what a generation loop that reads each token back sees, host time included."""
    row = iter(rows)
    return 1e3 * median_ms(lambda: call(next(row)), repeats=len(rows) - warmup, warmup=warmup)


def host_us(call, rows, warmup: int = 8) -> float:
    """Median microseconds the host spends in call(row), for each row: the call alone, its GPU work
    waited for after the timed span (a graph replay returns once its launch is queued)."""
    import time

    import cupy

    times = []
    for index, row in enumerate(rows):
        start = time.perf_counter()
        call(row)
        spent = time.perf_counter() - start
        cupy.cuda.get_current_stream().synchronize()
        if index >= warmup:
            times.append(spent)
    return 1e6 * float(np.median(times))


def run_geometry(geometry: str, layers: int | None, tokens: int, rounds: int, folder: Path) -> dict:
    import cupy

    from glm_kda import KdaLayer, KdaStack
    from glm_kda.checkpoint import bind_layer
    from glm_kda.gpu.workspace import KdaWorkspace
    from glm_kda.synthetic import default_kda_layers, synthetic_hidden, write_synthetic_checkpoint

    total, kimi = MODEL_LAYERS[geometry]
    count = layers or len(default_kda_layers(total, kimi=kimi))
    path = write_synthetic_checkpoint(folder / geometry, geometry, num_layers=1)
    bound = bind_layer(path, 0, progress=False)
    workspace = KdaWorkspace(bound.config, 16)
    stack = KdaStack([KdaLayer(bound, workspace=workspace) for _ in range(count)])
    bf16 = workspace.final_out.dtype
    rows = cupy.asarray(synthetic_hidden(tokens, bound.config.hidden, seed=5).view(np.uint16)).view(bf16)
    rows = [rows[t : t + 1] for t in range(tokens)]

    layer_bytes = decode_bytes(bound.config)

    def roofline_us(bandwidth: float) -> float:
        """A layer's bytes at `bandwidth` GB/s, in us."""
        return layer_bytes / 1e3 / bandwidth

    states = stack.new_states()
    per_round = []  # (copy GB/s, stack us per token)
    for _ in range(rounds):
        bandwidth = copy_bandwidth_gbs()
        per_round.append((bandwidth, waited_us(lambda row: stack.decode(row, states), rows)))
    ratios = [roofline_us(bandwidth) * count / stack_us for bandwidth, stack_us in per_round]
    middle = int(np.argsort(ratios)[len(ratios) // 2])
    bandwidth, stack_us = per_round[middle]
    # Where a waited token's time goes: the host's part of a call, and the GPU's (the token's graph
    # replayed alone, back to back, which is what a loop that does not wait would see).
    host_call_us = host_us(lambda row: stack.decode(row, states), rows)
    graph, stream = stack.graphs.last_graph, cupy.cuda.get_current_stream()
    graph_us = 1e3 * median_ms(lambda: graph.launch(stream), repeats=len(rows) - 8, warmup=8)
    single = []
    for layer in stack.layers:
        state = layer.new_state()
        single.append(waited_us(lambda row, layer=layer, state=state: layer.decode(row, state), rows[: tokens // 4]))
    return {"case": "stack_decode", "geometry": geometry, "layers": count, "tokens": tokens,
            "stack_us_per_token": stack_us, "sum_of_single_layer_us": float(np.sum(single)),
            "stack_over_sum": stack_us / float(np.sum(single)),
            "layer_bytes": layer_bytes, "copy_bandwidth_GBs": bandwidth,
            "roofline_ratio_per_layer": ratios[middle],
            "rounds": [{"copy_bandwidth_GBs": b, "stack_us_per_token": t, "roofline_ratio_per_layer": r}
                       for (b, t), r in zip(per_round, ratios)],
            "roofline_ratio_spread": [min(ratios), max(ratios)],
            "host_us_per_call": host_call_us, "graph_us_per_token": graph_us,
            "graph_roofline_ratio_per_layer": roofline_us(bandwidth) * count / graph_us,
            "single_layer_roofline_ratio_median": roofline_us(bandwidth) / float(np.median(single))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", nargs="+", default=["glm", "kimi"], choices=sorted(MODEL_LAYERS))
    parser.add_argument("--layers", type=int, default=None, help="KDA layers in the stack (default: the model's)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens decoded per measurement (>= 40)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of the stack, each with its copy bandwidth")
    args = parser.parse_args()
    if args.tokens < 40:
        parser.error(f"--tokens must be >= 40, got {args.tokens}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    exit_unless_gpu("the stack benchmark")
    with tempfile.TemporaryDirectory(prefix="glm_kda_stack_") as folder:
        for geometry in args.geometry:
            print(json.dumps(run_geometry(geometry, args.layers, args.tokens, args.rounds, Path(folder))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
