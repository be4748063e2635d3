"""Where a decode step spends its time, one JSON line per geometry.

  * per-kernel GPU time of an eager step (CUDA events around every launch, 20 steps averaged);
  * the captured graph replayed back to back with no Python in between: the GPU time of one
    step (median of 5 interleaved rounds of 200 replays), its roofline ratio against the copy
    bandwidth measured in the same run, the replays of verify K=4 and K=16 (decode_k) over it,
    and steps of 64 and 256 sequences of a pool (shuffled slots) with their own roofline ratios;
  * the public call (input copy, replay, output copy) issued back to back, 200 calls between
    two events: what a decode loop that does not synchronise every token pays per call.
Each geometry runs the VARIANTS below in the same process: the separate launches (the fused
decode step with the projections after a kernel launched as its programmatic dependents,
asking L2 for the first 16 or 0 blocks of 32 k of each weight row, gemm_rows.PREFETCH_K_BLOCKS,
for weights up to 32 MB (the default) or any, gemm_rows.PREFETCH_MAX_WEIGHT_BYTES), with the
weights in gemm_rows' packed layout (layer.packed_decode, the default) or row-major, and the
batched step as blocks walking the sequences (layer.walk_batched_step). A variant
with the one persistent launch (layer.persistent_decode; a lags pair in place of None) times
B=1 and verify only: it takes one sequence's rows, the batches are the separate launches'.
With --against DIR the default configuration also runs the kernels compiled from the sources in
DIR (another version of kernels_src/, say the previous commit's), in the same process.

    PYTHONPATH=. python benchmarks/decode_breakdown.py [--against DIR] [glm kimi]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def back_to_back_us(fn, calls: int = 200) -> float:
    from glm_kda.selftest import back_to_back_ms

    return 1e3 * back_to_back_ms(fn, calls)


# (fused_decode, programmatic launches, L2 prefetch k blocks, step prefetch waves, persistent
# decode lags (step, out) in pairs of heads or None for the separate launches, largest weight
# that a programmatic launch asks L2 for (None: any), packed decode weights, the batched step as
# blocks walking the sequences (layer.walk_batched_step), the folder of the kernel sources (None:
# the package's own))
MB = 1 << 20
VARIANTS = (
    (True, True, 16, 0.25, None, 32 * MB, True, False, None), (True, True, 16, 0.25, None, 32 * MB, False, False, None),
    (True, True, 16, 0.25, None, 32 * MB, True, True, None),
)
ROUNDS = 5
VERIFY_K = (4, 16)
BATCHES = (64, 256)


_KERNEL_SETS: dict = {}


def apply(variant, layer_object) -> None:
    from glm_kda import gemm_rows, kernels, layer, persistent

    (fused, kernels.PROGRAMMATIC_LAUNCH, gemm_rows.PREFETCH_K_BLOCKS, layer.STEP_PREFETCH_WAVES, lags,
     gemm_rows.PREFETCH_MAX_WEIGHT_BYTES, packed, walk, sources) = variant
    if sources not in _KERNEL_SETS:
        _KERNEL_SETS[sources] = kernels.KernelSet.get() if sources is None else kernels.KernelSet(sources)
    kernels.KernelSet.install(_KERNEL_SETS[sources])
    layer_object.fused_decode = fused
    layer_object.packed_decode = packed
    layer_object.walk_batched_step = walk
    layer_object.persistent_decode = lags is not None
    if lags is not None:
        persistent.STEP_LAG_PAIRS, persistent.OUT_LAG_PAIRS = lags


def main(geometries: list[str], against: str | None = None) -> None:
    import cupy
    import numpy as np

    from glm_kda import gemm_rows, kernels, layer as layer_module
    from glm_kda.selftest import state_bytes, weight_bytes
    from glm_kda.layer import KdaLayer, to_device_bf16
    from glm_kda.state import StatePool
    from glm_kda.selftest import copy_bandwidth_gbs
    from glm_kda.synthetic import synthetic_hidden, write_synthetic_checkpoint

    bandwidth = copy_bandwidth_gbs()
    from glm_kda import persistent

    defaults = (True, kernels.PROGRAMMATIC_LAUNCH, gemm_rows.PREFETCH_K_BLOCKS, layer_module.STEP_PREFETCH_WAVES,
                (persistent.STEP_LAG_PAIRS, persistent.OUT_LAG_PAIRS) if layer_module.PERSISTENT_DECODE else None,
                gemm_rows.PREFETCH_MAX_WEIGHT_BYTES, True, layer_module.STEP_WALK, None)
    variants = VARIANTS + ((defaults[:-1] + (against,),) if against is not None else ())
    stream = cupy.cuda.get_current_stream()
    with tempfile.TemporaryDirectory() as tmp:
        for geometry in geometries:
            path = write_synthetic_checkpoint(Path(tmp) / geometry, geometry, num_layers=1)
            layer = KdaLayer.from_pretrained(path, 0, max_tokens=max(BATCHES), progress=False)
            cfg = layer.config
            hidden = to_device_bf16(synthetic_hidden(max(BATCHES), cfg.hidden))
            state = layer.new_state()
            pool = StatePool(cfg, 2 * max(BATCHES))
            order = np.random.default_rng(0).permutation(2 * max(BATCHES)).astype(np.int32)
            slots = {batch: cupy.asarray(order[:batch]) for batch in BATCHES}
            nbytes = weight_bytes(cfg) + state_bytes(cfg)
            captured = {}
            # The first variant twice, the first capture thrown away: in one run the graphs captured
            # first replayed 4 us slower than the same kernels captured later.
            for variant in (variants[0],) + variants:
                apply(variant, layer)
                layer._graphs.clear()
                graphs = {}
                for rows in (1,) + VERIFY_K:
                    for _ in range(3):
                        layer.decode_k(hidden[:rows], state)  # eager, capture, replay
                    graphs[rows] = layer._graphs.last_graph
                for batch in BATCHES if variant[4] is None else ():
                    # (A persistent variant's batches are the separate launches: not timed again.)
                    for _ in range(3):
                        layer.decode(hidden[:batch], pool, slots[batch])
                    graphs[f"B{batch}"] = layer._graphs.last_graph
                with kernels.timing() as timer:
                    for _ in range(20):
                        layer.decode(hidden[:1], state)
                per_kernel = {name: 1e3 * ms / 20 for name, ms in timer.summary().items()}
                call_us = back_to_back_us(lambda: layer.decode(hidden[:1], state))
                captured[variant] = (graphs, per_kernel, call_us)
            # The graphs keep what they were captured with: replay them in interleaved rounds,
            # so that drift over the run hits every variant alike.
            replays = {(variant, rows): [] for variant in variants for rows in captured[variant][0]}
            for _ in range(ROUNDS):
                for variant in variants:
                    for rows, graph in captured[variant][0].items():
                        replays[variant, rows].append(back_to_back_us(lambda: graph.launch(stream)))
            for variant in variants:
                fused, programmatic, prefetch, step_prefetch, lags, prefetch_limit, packed, walk, sources = variant
                replay_us = float(np.median(replays[variant, 1]))
                verify = {f"K{rows}": round(float(np.median(replays[variant, rows])) / replay_us, 3) for rows in VERIFY_K}
                batched = {}
                for batch in BATCHES if lags is None else ():
                    batch_us = float(np.median(replays[variant, f"B{batch}"]))
                    batched[f"B{batch}_graph_replay_us"] = batch_us
                    batched[f"B{batch}_roofline_ratio"] = (
                        (weight_bytes(cfg) + batch * state_bytes(cfg)) / 1e3 / bandwidth / batch_us)
                print(json.dumps({
                    "geometry": geometry, "fused_decode": fused, "programmatic_launch": programmatic,
                    "l2_prefetch_k_blocks": prefetch, "step_prefetch_waves": step_prefetch,
                    "persistent_lags": lags, "l2_prefetch_max_weight_bytes": prefetch_limit, "packed_decode": packed,
                    "walk_batched_step": walk, "kernel_sources": sources or "package",
                    "default": variant == defaults, "copy_bandwidth_GBs": bandwidth,
                    "bytes": nbytes, "graph_replay_us": replay_us,
                    "graph_replay_rounds_us": [round(x, 2) for x in replays[variant, 1]],
                    "graph_replay_roofline_ratio": nbytes / 1e3 / bandwidth / replay_us,
                    "verify_replay_over_decode": verify,
                    **batched,
                    "public_call_back_to_back_us": captured[variant][2], "eager_per_kernel_us": captured[variant][1],
                }), flush=True)
            apply(defaults, layer)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    against = None
    if "--against" in arguments:
        at = arguments.index("--against")
        against = arguments[at + 1]
        del arguments[at : at + 2]
    main(arguments or ["glm", "kimi"], against)
