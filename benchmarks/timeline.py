"""Where a decode step's time goes on the GPU: the block timeline of its captured graph.

The kernels are built a second time with KDA_TRACE defined (kernels_src/common/trace.cuh): thread 0
of every block of the projections (gemm_rows, and the bulk-copy sweep's three kernels) and of the
fused step then records its SM and the GPU's global timer at the block's start, after its wait on
the previous kernel (programmatic launches; for the bulk-copy sweep, its copy warp's wait, past
which x's tiles are copied; for the fused step: once its outputs are written, before it stores its
states) and at its end. The package's own kernels carry none of this. The decode graph of each
geometry and row count is captured with the traced kernels and replayed; per launch (named by the
buffer it writes) the line gives, in microseconds from the graph's first block start and as the
median over the replays: the first block start, the last wait end, the first and last block end,
and the blocks. `step_us` is the last block end of the graph. The global timer ticks coarsely on
some GPUs: `timer_tick_ns` is the smallest nonzero step seen between two records of a replay.

    PYTHONPATH=. python benchmarks/timeline.py [glm kimi] [--replays 200] [--rows 1 64]
        [--variant NAME=VALUE[,...]] [--blocks DIR]

--blocks writes, per geometry and row count, DIR/<geometry>_rows<rows>.json: every block of the last
replay as [launch, SM, start, wait end (null: none), end], in microseconds from the graph's first
block start.

--variant sets KdaOptions fields of the layer for the run (say hopper=False; each value a Python
literal); the line names them ("options"). Each line also carries the copy bandwidth measured in the
same run and the step's roofline (its fewest bytes at that bandwidth, `roofline_us`, and
`roofline_ratio`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.layers import parse_options  # noqa: E402

# Launches by the workspace buffer they write (the tag of their records).
LAUNCH_NAMES = (("down_proj", "f_a|g_a|b"), ("forget_proj", "f_b"), ("out_gate", "g_b"), ("qkv_proj", "q|k|v"),
                ("o_norm_out", "fused step"), ("final_out", "o_proj"), ("bulk_partial", "split sums"))
# The bulk-copy sweep's x-tiling launches (gemm_rows_tile_x_bf16), named by their input's address one
# byte on: (workspace buffer, its column where the input starts in units of head_dim, name).
TILE_X_NAMES = (("graph_hidden", 0, "x tiles: hidden"), ("o_norm_out", 0, "x tiles: o_proj"),
                ("down_proj", 0, "x tiles: f_b"), ("down_proj", 1, "x tiles: g_b"))
# Modules whose kernels record blocks (gemm_rows_bulk only where the device runs it).
TRACED_STEMS = ("projection/gemm_rows", "decode/decode", "projection/gemm_rows_bulk")
# The header that defines the records (under KDA_TRACE) and their count.
TRACE_HEADER = "common/trace.cuh"


def launch_names(workspace, head_dim: int) -> dict[int, str]:
    """Record tag -> launch name for a workspace (LAUNCH_NAMES and TILE_X_NAMES; a buffer the
    workspace does not have names nothing: its launches keep their tags in hex)."""
    names = {}
    for buffer, name in LAUNCH_NAMES:
        array = getattr(workspace, buffer, None)
        if array is not None:
            names[array.data.ptr] = name
    for buffer, column, name in TILE_X_NAMES:
        array = getattr(workspace, buffer, None)
        if array is not None:
            names[array.data.ptr + column * head_dim * array.itemsize + 1] = name
    return names


def write_traced_sources(folder: Path) -> Path:
    """The package's kernel sources copied into `folder` with KDA_TRACE defined; returns folder."""
    from glm_kda.gpu import build as kernels

    shutil.copytree(kernels.kernels_dir(), folder, dirs_exist_ok=True)
    header = folder / TRACE_HEADER
    header.write_text("#define KDA_TRACE 1\n" + header.read_text())
    return folder


def trace_capacity() -> int:
    """Records the traced kernels' buffer holds (KDA_TRACE_RECORDS of TRACE_HEADER)."""
    from glm_kda.gpu import build as kernels

    text = (kernels.kernels_dir() / TRACE_HEADER).read_text()
    return int(re.search(r"#define KDA_TRACE_RECORDS (\d+)", text).group(1))


class TraceBuffers:
    """The record arrays and counters of the traced modules of a kernel set."""

    def __init__(self, kernel_set) -> None:
        import cupy

        self.capacity = trace_capacity()
        self.counts, self.records = [], []
        for stem in TRACED_STEMS:
            module = kernel_set.modules.get(stem)
            if module is None:
                continue
            self.counts.append(cupy.ndarray((1,), cupy.uint32, memptr=module.get_global("kda_trace_count")))
            self.records.append(cupy.ndarray((self.capacity, 4), cupy.uint64,
                                             memptr=module.get_global("kda_trace_records")))

    def reset(self) -> None:
        for count in self.counts:
            count.fill(0)

    def read(self):
        """Every record written since the last reset: uint64 [n, 4] (tag | sm << 48, start,
        waited, end)."""
        import numpy as np

        parts = []
        for count, records in zip(self.counts, self.records):
            n = int(count.get()[0])
            if n > self.capacity:
                raise RuntimeError(f"{n} trace records, more than the {self.capacity} the buffer holds")
            parts.append(records[:n].get())
        return np.concatenate(parts)


# A record's first word: the launch's tag in the low 48 bits, the block's SM above (common/trace.cuh).
TAG_BITS = 48
TAG_MASK = (1 << TAG_BITS) - 1


def launch_name(names: dict[int, str], tag: int) -> str:
    """The name of the launch a tag (a pointer it writes) stands for, else the tag in hex."""
    return names.get(tag, hex(tag))


def replay_timeline(records, names: dict[int, str]) -> dict:
    """Per launch name: first start, last wait, first and last end (us from the first start), blocks."""
    import numpy as np

    tags = records[:, 0] & np.uint64(TAG_MASK)
    origin = int(records[:, 1].min())
    out = {}
    for tag in np.unique(tags):
        rows = records[tags == tag]
        name = launch_name(names, int(tag))
        waited = rows[:, 2][rows[:, 2] > 0]
        out[name] = {
            "start_us": (int(rows[:, 1].min()) - origin) / 1e3,
            "last_start_us": (int(rows[:, 1].max()) - origin) / 1e3,
            "first_wait_us": (int(waited.min()) - origin) / 1e3 if waited.size else None,
            "last_wait_us": (int(waited.max()) - origin) / 1e3 if waited.size else None,
            "first_end_us": (int(rows[:, 3].min()) - origin) / 1e3,
            "end_us": (int(rows[:, 3].max()) - origin) / 1e3,
            "blocks": int(rows.shape[0]),
        }
    stamps = np.unique(records[:, 1:].ravel())
    stamps = stamps[stamps > 0]
    steps = np.diff(stamps.astype(np.int64))
    out["_step_us"] = (int(records[:, 3].max()) - origin) / 1e3
    out["_tick_ns"] = int(steps[steps > 0].min()) if steps.size and (steps > 0).any() else None
    return out


def replay_blocks(records, names: dict[int, str]) -> list:
    """Every block of one replay: [launch name, SM, start, wait end or None, end] (us from the first
    start), ordered by start."""
    origin = int(records[:, 1].min())
    blocks = []
    for tag_sm, start, waited, end in records.tolist():
        blocks.append([launch_name(names, tag_sm & TAG_MASK), tag_sm >> TAG_BITS, (start - origin) / 1e3,
                       (waited - origin) / 1e3 if waited else None, (end - origin) / 1e3])
    return sorted(blocks, key=lambda block: block[2])


def median_timeline(replays: list[dict]) -> dict:
    import numpy as np

    names = [name for name in replays[0] if not name.startswith("_")]
    summary = {}
    for name in sorted(names, key=lambda n: replays[0][n]["start_us"]):
        summary[name] = {}
        for field in ("start_us", "last_start_us", "first_wait_us", "last_wait_us", "first_end_us", "end_us", "blocks"):
            values = [r[name][field] for r in replays if name in r and r[name][field] is not None]
            summary[name][field] = round(float(np.median(values)), 2) if values else None
    return summary


def table(record: dict) -> str:
    """The launches of one JSON line as text, one line each (the replies' tail)."""
    lines = [f"# {record['geometry']} rows {record['rows']} {record.get('options') or ''}: step {record['step_us']} us, roofline "
             f"{record['roofline_us']} us, timer tick {record['timer_tick_ns']} ns"]
    for name, t in record["launches"].items():
        label = "outputs out" if name == "fused step" else "waits"
        wait = "" if t["last_wait_us"] is None else f", {label} {t['first_wait_us']} .. {t['last_wait_us']}"
        lines.append(f"#   {name:<11} starts {t['start_us']:>7} .. {t['last_start_us']}{wait}, ends {t['first_end_us']}"
                     f" .. {t['end_us']} us ({t['blocks']:.0f} blocks)")
    return "\n".join(lines)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    from lib.timing import MIN_TIMED_CALLS, count_at_least

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("geometries", nargs="*", help="glm and / or kimi (default: both)")
    parser.add_argument("--replays", type=count_at_least(1), default=MIN_TIMED_CALLS)
    parser.add_argument("--rows", type=count_at_least(1), nargs="+", default=[1, 64],
                        help="sequences per step (1: one state)")
    parser.add_argument("--variant", type=parse_options, action="append", default=[], metavar="NAME=VALUE[,...]",
                        help="KdaOptions fields of the layer for the run")
    parser.add_argument("--blocks", type=Path, default=None, metavar="DIR",
                        help="write every block of the last replay to DIR/<geometry>_rows<rows>.json")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.geometries) - {"glm", "kimi"})
    if unknown:
        parser.error(f"unknown geometry {', '.join(map(repr, unknown))} (choose from 'glm', 'kimi')")
    args.geometries = args.geometries or ["glm", "kimi"]
    args.options = {name: value for fields in args.variant for name, value in fields.items()}
    return args


def main(argv: list[str] | None = None) -> None:
    from glm_kda.device import exit_unless_gpu

    args = parse_arguments(argv)
    exit_unless_gpu("the block timeline")
    import cupy
    import numpy as np

    from glm_kda.gpu import build as kernels
    from glm_kda.gpu.arrays import to_device_bf16
    from glm_kda.state import StatePool
    from glm_kda.synthetic import synthetic_hidden

    from lib.layers import last_graph, make_layer, with_options
    from lib.timing import copy_bandwidth_gbs, decode_bytes, roofline

    bandwidth = copy_bandwidth_gbs()
    stream = cupy.cuda.get_current_stream()
    with tempfile.TemporaryDirectory() as tmp:
        traced = kernels.KernelSet(write_traced_sources(Path(tmp) / "kernels"))
        buffers = TraceBuffers(traced)
        previous = kernels.KernelSet.install(traced)
        try:
            for geometry in args.geometries:
                layer = make_layer(Path(tmp), geometry, max(args.rows))
                with_options(layer, **args.options)
                cfg, ws = layer.config, layer.workspace
                names = launch_names(ws, cfg.head_dim)
                hidden = to_device_bf16(synthetic_hidden(max(args.rows), cfg.hidden))
                for rows in args.rows:
                    if rows == 1:
                        state = layer.new_state()
                        call = lambda: layer.decode(hidden[:1], state)  # noqa: E731
                    else:
                        pool = StatePool(cfg, 2 * rows)
                        slots = cupy.asarray(np.random.default_rng(0).permutation(2 * rows)[:rows].astype(np.int32))
                        call = lambda: layer.decode(hidden[:rows], pool, slots)  # noqa: E731
                    for _ in range(3):
                        call()  # eager, capture, replay
                    graph = last_graph(layer)
                    for _ in range(10):
                        graph.launch(stream)
                    replays = []
                    for _ in range(args.replays):
                        buffers.reset()
                        graph.launch(stream)
                        stream.synchronize()
                        records = buffers.read()
                        replays.append(replay_timeline(records, names))
                    if args.blocks is not None:
                        args.blocks.mkdir(parents=True, exist_ok=True)
                        (args.blocks / f"{geometry}_rows{rows}.json").write_text(
                            json.dumps(replay_blocks(records, names)))
                    nbytes = decode_bytes(cfg, rows)
                    step_us = float(np.median([r["_step_us"] for r in replays]))
                    ticks = [r["_tick_ns"] for r in replays if r["_tick_ns"] is not None]
                    record = {
                        "geometry": geometry, "rows": rows, "options": args.options, "replays": args.replays,
                        "copy_bandwidth_GBs": bandwidth,
                        "bytes": nbytes, "step_us": round(step_us, 2),
                        "roofline_us": round(nbytes / 1e3 / bandwidth, 2),
                        "roofline_ratio": round(roofline(nbytes, bandwidth, step_us), 3),
                        "timer_tick_ns": min(ticks) if ticks else None,
                        "launches": median_timeline(replays),
                    }
                    print(json.dumps(record), flush=True)
                    print(table(record), flush=True)
        finally:
            kernels.KernelSet.install(previous)


if __name__ == "__main__":
    main()
