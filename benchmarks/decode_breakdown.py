"""Where a decode step spends its time, one JSON line per geometry and variant.

  * per-kernel GPU time of an eager step (CUDA events around every launch, 20 steps averaged);
  * the captured graph replayed back to back with no Python in between, in 5 interleaved rounds of
    200 replays, each replay between its own pair of events: the GPU time of one step (the median
    over the 1000 replays, `graph_replay_us`), its roofline ratio against the copy bandwidth
    measured in the same run, the replays of verify K=4 and K=16 (decode_k) over it, and steps of
    64 and 256 sequences of a pool (shuffled slots) with their own roofline ratios; beside them,
    as `*_back_to_back_us`, the median over the rounds of the mean replay of 200 launched between
    two events alone (the figure of the rounds before per-replay events), and, as
    `graph_replay_cold_l2_us`, the one-row step with L2 scrubbed before each replay (a Kimi-Linear
    step moves 84 MB, within a small factor of the H200's L2: what one replay leaves there must not
    count for the next);
  * the public call (input copy, replay, output copy) issued back to back, 200 calls between
    two events: what a decode loop that does not synchronise every token pays per call.
Each geometry runs the VARIANTS below in the same process, each the package's defaults with the
settings it names changed (see `variant`): the defaults, and the decode weights row-major instead
of gemm_rows' packed layout (layer.packed_decode).
A variant with the one persistent launch (persistent_lags) times B=1 and verify only: it takes
one sequence's rows, the batches are the separate launches'. With --against DIR the defaults
also run with the kernels compiled from the sources in DIR (another version of kernels_src/ with
the same entry points and parameters), in the same process; each --variant adds a variant of
the settings it names (name=value[,name=value...], see `defaults`).

    PYTHONPATH=. python benchmarks/decode_breakdown.py [--against DIR] [--variant SETTINGS ...] [glm kimi]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from glm_kda.cli import script_help
from glm_kda.device import exit_unless_gpu


def back_to_back_us(fn, calls: int = 200) -> float:
    from glm_kda.selftest import back_to_back_ms

    return 1e3 * back_to_back_ms(fn, calls)


def replay_us(fn, calls: int = 200, between=None) -> list[float]:
    from glm_kda.selftest import replay_ms

    return [1e3 * ms for ms in replay_ms(fn, calls, between=between)]


def variant(**settings) -> tuple:
    """The settings that differ from the package's defaults (see `defaults`), as sorted (name,
    value) pairs."""
    return tuple(sorted(settings.items()))


VARIANTS = (variant(), variant(packed_decode=False))
ROUNDS = 5
VERIFY_K = (4, 16)
BATCHES = (64, 256)


def defaults() -> dict:
    """Every setting a variant may change, as the package has it: fused_decode,
    programmatic_launch, l2_prefetch_k_blocks (blocks of 32 k a programmatic projection asks L2
    for), step_prefetch_waves, persistent_lags (the one persistent launch with these (step, out)
    lags in pairs of heads; None: the separate launches), l2_prefetch_max_weight_bytes (None: any
    weight), packed_decode, step_dependents_after (layer.STEP_DEPENDENTS_AFTER), serial_min_groups_per_sm
    (gemm_rows.SERIAL_MIN_GROUPS_PER_SM; None: never the serial sweep), wgmma_min_groups_per_sm
    (gemm_rows.WGMMA_MIN_GROUPS_PER_SM; None: never the warpgroup-MMA sweep), bulk_min_groups_per_sm
    (gemm_rows.BULK_MIN_GROUPS_PER_SM; None: never the bulk-copy sweep), bulk_row_group_waves
    (gemm_rows.BULK_ROW_GROUP_WAVES), wgmma_ring
    (gemm_rows.WGMMA_RING, that sweep's weight ring; 0: registers), step_staged_state and
    step_staged_carveout (layer.STEP_STAGED_STATE, layer.STEP_STAGED_CARVEOUT), step_split_waves
    (layer.STEP_SPLIT_WAVES; None: never a split head), side_chain_first, side_chain_programmatic
    and side_stream_priority (layer.SIDE_CHAIN_FIRST, layer.SIDE_CHAIN_PROGRAMMATIC,
    layer.SIDE_STREAM_PRIORITY: how the low-rank chain runs beside q|k|v), qkv_reserved_slots
    (layer.QKV_RESERVED_SLOTS), out_proj_staged (layer.OUT_PROJ_STAGED), step_writes_x_tiles
    (layer.STEP_WRITES_X_TILES), side_chain_bulk (layer.SIDE_CHAIN_BULK), gate_branch_min_rows
    (layer.GATE_BRANCH_MIN_ROWS; None: g_b after f_b on one stream), bulk_stages_by_chunks
    (gemm_rows.BULK_STAGES_BY_CHUNKS), bulk_split_warpgroups (gemm_rows.BULK_SPLIT_WARPGROUPS),
    step_awaits_projection (layer.STEP_AWAITS_PROJECTION), qkv_counts_inputs (layer.QKV_COUNTS_INPUTS),
    gate_up_pair (layer.GATE_UP_PAIR),
    out_proj_awaits_step (layer.OUT_PROJ_AWAITS_STEP), out_proj_staged_awaiting
    (layer.OUT_PROJ_STAGED_AWAITING), awaiting_step_dependents_after and
    awaiting_unstaged_dependents_after (layer.AWAITING_STEP_DEPENDENTS_AFTER,
    layer.AWAITING_UNSTAGED_DEPENDENTS_AFTER), tail_staged_awaiting and tail_blocks (gemm_rows.TAIL_STAGED_AWAITING,
    gemm_rows.TAIL_BLOCKS), graph_copies (layer.GRAPH_COPIES_IN_GRAPH: the replayed graphs then hold
    the public call's input and output copies), counting_ahead (gemm_rows.COUNTING_AHEAD), kernel_sources (a folder of kernel sources; None:
    the package's own)."""
    from glm_kda.gpu import projection as gemm_rows
    from glm_kda.gpu import build as kernels
    from glm_kda.gpu import layer

    return {
        "fused_decode": True, "programmatic_launch": kernels.PROGRAMMATIC_LAUNCH,
        "l2_prefetch_k_blocks": gemm_rows.PREFETCH_K_BLOCKS, "step_prefetch_waves": layer.STEP_PREFETCH_WAVES,
        "persistent_lags": (persistent.STEP_LAG_PAIRS, persistent.OUT_LAG_PAIRS) if layer.PERSISTENT_DECODE else None,
        "l2_prefetch_max_weight_bytes": gemm_rows.PREFETCH_MAX_WEIGHT_BYTES, "packed_decode": True,
        "step_dependents_after": layer.STEP_DEPENDENTS_AFTER,
        "serial_min_groups_per_sm": gemm_rows.SERIAL_MIN_GROUPS_PER_SM,
        "wgmma_min_groups_per_sm": gemm_rows.WGMMA_MIN_GROUPS_PER_SM, "wgmma_ring": gemm_rows.WGMMA_RING,
        "bulk_min_groups_per_sm": gemm_rows.BULK_MIN_GROUPS_PER_SM,
        "bulk_row_group_waves": gemm_rows.BULK_ROW_GROUP_WAVES,
        "step_staged_state": layer.STEP_STAGED_STATE,
        "step_staged_carveout": layer.STEP_STAGED_CARVEOUT, "step_split_waves": layer.STEP_SPLIT_WAVES,
        "side_chain_first": layer.SIDE_CHAIN_FIRST, "side_chain_programmatic": layer.SIDE_CHAIN_PROGRAMMATIC,
        "side_stream_priority": layer.SIDE_STREAM_PRIORITY, "qkv_reserved_slots": layer.QKV_RESERVED_SLOTS,
        "out_proj_staged": layer.OUT_PROJ_STAGED, "step_writes_x_tiles": layer.STEP_WRITES_X_TILES,
        "side_chain_bulk": layer.SIDE_CHAIN_BULK, "gate_branch_min_rows": layer.GATE_BRANCH_MIN_ROWS,
        "bulk_stages_by_chunks": gemm_rows.BULK_STAGES_BY_CHUNKS, "bulk_split_warpgroups": gemm_rows.BULK_SPLIT_WARPGROUPS,
        "step_awaits_projection": layer.STEP_AWAITS_PROJECTION, "qkv_counts_inputs": layer.QKV_COUNTS_INPUTS,
        "gate_up_pair": layer.GATE_UP_PAIR,
        "out_proj_awaits_step": layer.OUT_PROJ_AWAITS_STEP, "out_proj_staged_awaiting": layer.OUT_PROJ_STAGED_AWAITING,
        "awaiting_step_dependents_after": layer.AWAITING_STEP_DEPENDENTS_AFTER,
        "awaiting_unstaged_dependents_after": layer.AWAITING_UNSTAGED_DEPENDENTS_AFTER,
        "tail_staged_awaiting": gemm_rows.TAIL_STAGED_AWAITING, "tail_blocks": gemm_rows.TAIL_BLOCKS,
        "graph_copies": layer.GRAPH_COPIES_IN_GRAPH, "counting_ahead": gemm_rows.COUNTING_AHEAD,
        "kernel_sources": None,
    }


def settings_of(chosen: tuple, base: dict) -> dict:
    """The full settings of a variant over `base`; an unknown name is an error."""
    unknown = set(dict(chosen)) - set(base)
    if unknown:
        raise ValueError(f"unknown variant settings {sorted(unknown)}; known: {sorted(base)}")
    return {**base, **dict(chosen)}


_KERNEL_SETS: dict = {}


def apply(settings: dict, layer_object) -> None:
    from glm_kda.gpu import projection as gemm_rows
    from glm_kda.gpu import build as kernels
    from glm_kda.gpu import layer

    kernels.PROGRAMMATIC_LAUNCH = settings["programmatic_launch"]
    gemm_rows.PREFETCH_K_BLOCKS = settings["l2_prefetch_k_blocks"]
    layer.STEP_PREFETCH_WAVES = settings["step_prefetch_waves"]
    gemm_rows.PREFETCH_MAX_WEIGHT_BYTES = settings["l2_prefetch_max_weight_bytes"]
    layer.STEP_DEPENDENTS_AFTER = settings["step_dependents_after"]
    gemm_rows.SERIAL_MIN_GROUPS_PER_SM = settings["serial_min_groups_per_sm"]
    gemm_rows.WGMMA_MIN_GROUPS_PER_SM = settings["wgmma_min_groups_per_sm"]
    gemm_rows.WGMMA_RING = settings["wgmma_ring"]
    gemm_rows.BULK_MIN_GROUPS_PER_SM = settings["bulk_min_groups_per_sm"]
    gemm_rows.BULK_ROW_GROUP_WAVES = settings["bulk_row_group_waves"]
    layer.STEP_STAGED_STATE = settings["step_staged_state"]
    layer.STEP_STAGED_CARVEOUT = settings["step_staged_carveout"]
    layer.STEP_SPLIT_WAVES = settings["step_split_waves"]
    layer.SIDE_CHAIN_FIRST = settings["side_chain_first"]
    layer.SIDE_CHAIN_PROGRAMMATIC = settings["side_chain_programmatic"]
    layer.SIDE_STREAM_PRIORITY = settings["side_stream_priority"]
    layer.QKV_RESERVED_SLOTS = settings["qkv_reserved_slots"]
    layer.OUT_PROJ_STAGED = settings["out_proj_staged"]
    layer.STEP_WRITES_X_TILES = settings["step_writes_x_tiles"]
    layer.SIDE_CHAIN_BULK = settings["side_chain_bulk"]
    layer.GATE_BRANCH_MIN_ROWS = settings["gate_branch_min_rows"]
    gemm_rows.BULK_STAGES_BY_CHUNKS = settings["bulk_stages_by_chunks"]
    gemm_rows.BULK_SPLIT_WARPGROUPS = settings["bulk_split_warpgroups"]
    layer.STEP_AWAITS_PROJECTION = settings["step_awaits_projection"]
    layer.QKV_COUNTS_INPUTS = settings["qkv_counts_inputs"]
    layer.GATE_UP_PAIR = settings["gate_up_pair"]
    layer.OUT_PROJ_AWAITS_STEP = settings["out_proj_awaits_step"]
    layer.OUT_PROJ_STAGED_AWAITING = settings["out_proj_staged_awaiting"]
    layer.AWAITING_STEP_DEPENDENTS_AFTER = settings["awaiting_step_dependents_after"]
    layer.AWAITING_UNSTAGED_DEPENDENTS_AFTER = settings["awaiting_unstaged_dependents_after"]
    gemm_rows.TAIL_STAGED_AWAITING = settings["tail_staged_awaiting"]
    gemm_rows.TAIL_BLOCKS = settings["tail_blocks"]
    layer.GRAPH_COPIES_IN_GRAPH = settings["graph_copies"]
    gemm_rows.COUNTING_AHEAD = settings["counting_ahead"]
    sources = settings["kernel_sources"]
    if sources not in _KERNEL_SETS:
        _KERNEL_SETS[sources] = kernels.KernelSet.get() if sources is None else kernels.KernelSet(sources)
    kernels.KernelSet.install(_KERNEL_SETS[sources])
    layer_object.fused_decode = settings["fused_decode"]
    layer_object.packed_decode = settings["packed_decode"]
    lags = settings["persistent_lags"]
    layer_object.persistent_decode = lags is not None
    if lags is not None:
        persistent.STEP_LAG_PAIRS, persistent.OUT_LAG_PAIRS = lags


def parse_variant(text: str) -> tuple:
    """A variant from the command line: name=value[,name=value...], each value a Python literal
    (packed_decode=False,step_dependents_after=1)."""
    import ast

    settings = {}
    for item in text.split(","):
        name, equals, value = item.partition("=")
        if not equals:
            raise SystemExit(f"--variant {text!r}: expected name=value[,name=value...]")
        settings[name.strip()] = ast.literal_eval(value.strip())
    return variant(**settings)


def main(geometries: list[str], against: str | None = None, extra: tuple = ()) -> None:
    import cupy
    import numpy as np

    from glm_kda.gpu import build as kernels
    from glm_kda.gpu.layer import KdaLayer, to_device_bf16
    from glm_kda.selftest import copy_bandwidth_gbs, l2_scrub, state_bytes, weight_bytes
    from glm_kda.state import StatePool
    from glm_kda.synthetic import synthetic_hidden, write_synthetic_checkpoint

    base = defaults()
    variants = VARIANTS + tuple(extra) + ((variant(kernel_sources=against),) if against is not None else ())
    chosen = {v: settings_of(v, base) for v in variants}  # an unknown name fails before any GPU work
    bandwidth = copy_bandwidth_gbs()
    stream = cupy.cuda.get_current_stream()
    scrub = l2_scrub()
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
            for one in (variants[0],) + variants:
                settings = chosen[one]
                apply(settings, layer)
                layer._graphs.clear()
                graphs = {}
                for rows in (1,) + VERIFY_K:
                    for _ in range(3):
                        layer.decode_k(hidden[:rows], state)  # eager, capture, replay
                    graphs[rows] = layer._graphs.last_graph
                for batch in BATCHES if settings["persistent_lags"] is None else ():
                    # (A persistent variant's batches are the separate launches: not timed again.)
                    for _ in range(3):
                        layer.decode(hidden[:batch], pool, slots[batch])
                    graphs[f"B{batch}"] = layer._graphs.last_graph
                with kernels.timing() as timer:
                    for _ in range(20):
                        layer.decode(hidden[:1], state)
                per_kernel = {name: 1e3 * ms / 20 for name, ms in timer.summary().items()}
                call_us = back_to_back_us(lambda: layer.decode(hidden[:1], state))
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
                        rounds[one, rows].append(back_to_back_us(lambda: graph.launch(stream)))
                        if rows == 1:
                            cold[one] += replay_us(lambda: graph.launch(stream), between=scrub)
            for one in variants:
                settings = chosen[one]
                step_us = float(np.median(replays[one, 1]))
                verify = {f"K{rows}": round(float(np.median(replays[one, rows])) / step_us, 3) for rows in VERIFY_K}
                batched = {}
                for batch in BATCHES if settings["persistent_lags"] is None else ():
                    batch_bytes = weight_bytes(cfg) + batch * state_bytes(cfg)
                    batch_us = float(np.median(replays[one, f"B{batch}"]))
                    chained_us = float(np.median(rounds[one, f"B{batch}"]))
                    batched[f"B{batch}_graph_replay_us"] = batch_us
                    batched[f"B{batch}_roofline_ratio"] = batch_bytes / 1e3 / bandwidth / batch_us
                    batched[f"B{batch}_back_to_back_us"] = chained_us
                    batched[f"B{batch}_back_to_back_roofline_ratio"] = batch_bytes / 1e3 / bandwidth / chained_us
                chained_us, cold_us = float(np.median(rounds[one, 1])), float(np.median(cold[one]))
                print(json.dumps({
                    "geometry": geometry, **settings, "kernel_sources": settings["kernel_sources"] or "package",
                    "changed": dict(one), "default": settings == base, "copy_bandwidth_GBs": bandwidth,
                    "bytes": nbytes, "graph_replays": len(replays[one, 1]), "graph_replay_us": step_us,
                    "graph_replay_roofline_ratio": nbytes / 1e3 / bandwidth / step_us,
                    "graph_replay_back_to_back_us": chained_us,
                    "graph_replay_back_to_back_roofline_ratio": nbytes / 1e3 / bandwidth / chained_us,
                    "graph_replay_rounds_us": [round(x, 2) for x in rounds[one, 1]],
                    "graph_replay_cold_l2_us": cold_us,
                    "graph_replay_cold_l2_roofline_ratio": nbytes / 1e3 / bandwidth / cold_us,
                    "verify_replay_over_decode": verify,
                    **batched,
                    "public_call_back_to_back_us": captured[one][2], "eager_per_kernel_us": captured[one][1],
                    "programmatic_unavailable": kernels._PROGRAMMATIC.unavailable,
                }), flush=True)
            apply(base, layer)


def take_option(arguments: list[str], flag: str, needs: str) -> str | None:
    """The value after the first `flag` in arguments, both removed (None without the flag)."""
    if flag not in arguments:
        return None
    at = arguments.index(flag)
    if at + 1 >= len(arguments):
        raise SystemExit(f"{flag} needs {needs}")
    value = arguments[at + 1]
    del arguments[at : at + 2]
    return value


if __name__ == "__main__":
    script_help(__doc__)
    arguments = sys.argv[1:]
    against = take_option(arguments, "--against", "a folder of kernel sources")
    extra = []
    while (text := take_option(arguments, "--variant", "name=value[,name=value...]")) is not None:
        extra.append(parse_variant(text))
    exit_unless_gpu("the decode breakdown")
    main(arguments or ["glm", "kimi"], against, tuple(extra))
