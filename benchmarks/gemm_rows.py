"""gemm_rows_bf16 timings on a GPU, one JSON line per (shape, rows).

Roofline: up to 64 rows the kernel must read the weight once, so its floor is
(bytes of w) / (device-to-device copy bandwidth, read + write bytes over the time of
a 1 GiB cupy copy, measured in the same run). Each line carries

    median_us           median of >= 200 launches, one CUDA event pair around each
    back_to_back_us     mean of as many launches timed as back-to-back batches
    weight_bytes        bytes of w (rows > 64 read it ceil(rows / 64) times)
    ratio               (weight_bytes / median_us) / copy bandwidth
    ratio_back_to_back  the same with back_to_back_us (no event pair between launches)

Both times queue their launches behind a spin kernel, so the host's launch overhead
(larger than the small cases) is not in them; what remains per launch is the GPU's
own start and drain of a kernel, a few microseconds that dominate the small shapes.

Launches rotate over enough copies of the weight (at least 4) that together they
exceed three times the L2 cache, so every launch reads its weight from memory; the
line says how many copies and whether a single copy alone would fit in L2.
Every row count runs with the weight row-major and in gemm_rows' packed layout
(`layout`), and the two outputs must agree bit for bit; the gemm_rows_bf16 lines are the mma.sync
(or warpgroup-MMA) sweeps, never the bulk-copy one (--bulk times that). For comparison ops.gemv_bf16 (the
CUDA-core GEMV of up to 16 rows) is timed at rows 1 and 16 of every shape.

    PYTHONPATH=. python benchmarks/gemm_rows.py [--launches 200] [--sweep] [--against DIR ...]
        [--rows R ...] [--layout both|row_major|packed] [--no-gemv] [--serial auto|both] [--wgmma auto|both]
        [--bulk WG ...]

--sweep adds one line per tiles_per_warp (1, 2, 4) and grid (one block per column group, or
only as many blocks as are resident at once) at rows 1, 4, 16 and 64: the choice launch_plan
makes automatically, measured against the others.

--bulk WG ... (sm_90) also times 17..256 rows of the packed weight on the bulk-copy sweep
(gemm_rows_bulk: the x tiling and the sweep, two launches, three where it splits by k range) with
each of those warpgroups per block, whole (0: the warpgroups and the split bulk_plan chooses), bits
compared like every other line.

--against DIR (repeatable) also times every gemm_rows line with the kernels compiled from the sources in DIR
(another version of kernels_src/, say the previous commit's: `git archive HEAD~1 kernels_src | tar
-x -C /tmp/previous`), right after the package's own in the same process (`sources` names which),
and requires the two to agree bit for bit.
"""

from __future__ import annotations

import argparse
import json
import math

import cupy
import numpy as np

from glm_kda.gpu import build as kernels
from glm_kda.gpu import ops
from glm_kda.gpu.projection import (GEMM_ROWS_BLOCKS_PER_SM, bulk_available, bulk_partial_size, bulk_plan, gemm_rows_bf16,
                               gemm_rows_bulk,
                               launch_plan, pack_weight, wgmma_available, weight_bytes, x_tiles_size)
from glm_kda.device import exit_unless_gpu
from glm_kda.selftest import copy_bandwidth_gbs

# (geometry, projection, n, k)
SHAPES = [
    ("glm", "qkv_proj", 24576, 4096),
    ("glm", "down_proj", 320, 4096),
    ("glm", "f_b/g_b", 8192, 128),
    ("glm", "o_proj", 4096, 8192),
    ("kimi", "qkv_proj", 12288, 2304),
    ("kimi", "down_proj", 288, 2304),
    ("kimi", "f_b/g_b", 4096, 128),
    ("kimi", "o_proj", 2304, 4096),
]
ROWS = (1, 4, 16, 64, 256)
GEMV_ROWS = (1, 16)
WARMUP = 20


def _random_bf16_bits(shape, scale: float = 1.0):
    """BF16 bits of scaled normals, made on the device (truncated, which is fine for timing)."""
    values = cupy.random.standard_normal(shape, dtype=cupy.float32) * scale
    return (values.view(cupy.uint32) >> 16).astype(cupy.uint16)


# Keeps the GPU busy while the host queues a batch, so that the events time the
# kernels and not the host's launch overhead (which is larger than the small cases).
_SPIN = cupy.RawKernel(
    r"""extern "C" __global__ void spin(long long cycles)
    {
        const long long start = clock64();
        while (clock64() - start < cycles) {
        }
    }""",
    "spin",
)
SPIN_SECONDS = 0.03
BATCH = 100


def _spin() -> None:
    rate_khz = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["clockRate"]
    _SPIN((1,), (1,), (np.int64(rate_khz * 1e3 * SPIN_SECONDS),))


def _time_launches(launch, count: int, launches: int) -> tuple[float, float]:
    """(median µs of single launches, mean µs of back-to-back launches); launch(i) runs copy i % count.

    Launches go in batches of BATCH behind a spin kernel: the queue is full when the GPU
    reaches them, so an event pair measures the kernel alone.
    """
    for index in range(WARMUP):
        launch(index % count)
    single: list[float] = []
    streams: list[float] = []
    done = 0
    while done < launches:
        _spin()
        events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(BATCH)]
        for offset, (start, end) in enumerate(events):
            start.record()
            launch((done + offset) % count)
            end.record()
        events[-1][1].synchronize()
        single += [cupy.cuda.get_elapsed_time(start, end) * 1e3 for start, end in events]

        _spin()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for offset in range(BATCH):
            launch((done + offset) % count)
        end.record()
        end.synchronize()
        streams.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / BATCH)
        done += BATCH
    return float(np.median(single)), float(np.mean(streams))


def _weight_copies(n: int, k: int, l2_bytes: int) -> list:
    count = max(4, math.ceil(3 * l2_bytes / weight_bytes(n, k)))
    return [_random_bf16_bits((n, k), k**-0.5) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=200)
    parser.add_argument("--sweep", action="store_true",
                        help="also time every tiles_per_warp at rows 1, 16, 64")
    parser.add_argument("--against", metavar="DIR", action="append", default=[],
                        help="also time the kernels compiled from the sources in DIR, bits compared (repeatable)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help=f"row counts (default {ROWS})")
    parser.add_argument("--layout", choices=("both", "row_major", "packed"), default="both",
                        help="weight layouts to time (the bits are compared against the first)")
    parser.add_argument("--no-gemv", action="store_true", help="leave out the gemv_bf16 lines")
    parser.add_argument("--serial", choices=("auto", "both"), default="auto",
                        help="17..64 rows: the sweep launch_plan picks, or both the split-k and the serial sweep")
    parser.add_argument("--wgmma", choices=("auto", "both"), default="auto",
                        help="17..256 rows of a packed weight: the sweep launch_plan picks, or both the mma.sync "
                             "and the warpgroup-MMA sweep (sm_90)")
    parser.add_argument("--bulk", type=int, nargs="*", default=[], metavar="WG",
                        help="17..256 rows: also the bulk-copy sweep with these warpgroups per block (0: bulk_plan's "
                             "choice; sm_90)")
    args = parser.parse_args()
    if any(wg not in (0, 1, 2, 3) for wg in args.bulk):
        parser.error(f"--bulk takes warpgroups 0 (automatic), 1, 2 or 3, got {args.bulk}")
    exit_unless_gpu("the projection benchmark")
    if any(not 1 <= rows <= 256 for rows in args.rows):
        parser.error(f"--rows must lie in 1..256, got {args.rows}")
    if args.launches < 200:
        parser.error("--launches must be at least 200 (the median needs them)")

    device = cupy.cuda.Device()
    properties = cupy.cuda.runtime.getDeviceProperties(device.id)
    l2_bytes = int(properties["l2CacheSize"])
    sm_count = int(properties["multiProcessorCount"])
    bandwidth = copy_bandwidth_gbs()
    kernel_sets = {"package": kernels.KernelSet.get()}
    for folder in args.against:
        kernel_sets[folder] = kernels.KernelSet(folder)
    common = {
        "device": properties["name"].decode() if isinstance(properties["name"], bytes) else str(properties["name"]),
        "copy_bandwidth_GBs": round(bandwidth, 1),
        "l2_bytes": l2_bytes,
    }

    for geometry, projection, n, k in SHAPES:
        weights = _weight_copies(n, k, l2_bytes)
        nbytes = weight_bytes(n, k)
        x = _random_bf16_bits((max(ROWS), k))
        out = cupy.empty((max(ROWS), n), cupy.uint16)

        def record(kernel: str, rows: int, median_us: float, back_to_back_us: float, **extra) -> None:
            achieved = nbytes / (median_us * 1e-6) / 1e9
            print(json.dumps({
                "geometry": geometry, "projection": projection, "n": n, "k": k, "rows": rows,
                "kernel": kernel, **extra,
                "median_us": round(median_us, 2), "back_to_back_us": round(back_to_back_us, 2),
                "weight_bytes": nbytes, "weight_reads": -(-rows // 64) if kernel == "gemm_rows_bf16" else 1,
                "weight_GBs": round(achieved, 1), "ratio": round(achieved / bandwidth, 3),
                "ratio_back_to_back": round(nbytes / (back_to_back_us * 1e-6) / 1e9 / bandwidth, 3),
                "weight_copies": len(weights), "one_copy_fits_l2": nbytes <= l2_bytes, **common,
            }), flush=True)

        layouts = {}
        if args.layout in ("both", "row_major"):
            layouts["row_major"] = weights
        if args.layout in ("both", "packed"):
            layouts["packed"] = [pack_weight(w, pairs=args.wgmma == "both", tiles=bool(args.bulk)) for w in weights]
        x_tiles = cupy.empty((x_tiles_size(max(ROWS), k),), cupy.uint16) if args.bulk else None
        partial = cupy.empty((bulk_partial_size(n, k, max(ROWS)),), cupy.float32) if args.bulk else None
        for rows in args.rows:
            results = {}
            forms = [(serial, None) for serial in ((False, True) if args.serial == "both" and 16 < rows <= 64
                                                   else (None,))]
            if args.wgmma == "both" and rows > 16 and wgmma_available():
                forms = [(serial, False) for serial, _ in forms] + [(None, True)]
            for serial, wgmma in forms:
                for layout, copies in layouts.items():
                    use_wgmma = wgmma if layout == "packed" and wgmma_available() else False
                    plan = launch_plan(n, k, rows, sm_count=sm_count, serial=serial, wgmma=use_wgmma)
                    if wgmma and not use_wgmma:
                        continue

                    def launch(index: int, rows: int = rows, copies=copies, serial=serial, wgmma=use_wgmma) -> None:
                        gemm_rows_bf16(x[:rows], copies[index], out[:rows], rows=rows, serial=serial, wgmma=wgmma,
                                       bulk=False)

                    for sources, kernel_set in kernel_sets.items():
                        kernels.KernelSet.install(kernel_set)
                        extra = {"sources": sources} if len(kernel_sets) > 1 else {}
                        record("gemm_rows_bf16", rows, *_time_launches(launch, len(copies), args.launches),
                               grid=list(plan.grid), tiles_per_warp=plan.tiles_per_warp, entry=plan.kernel,
                               layout=layout, **extra)
                        results[layout, sources, plan.kernel] = out[:rows].copy()
                    kernels.KernelSet.install(kernel_sets["package"])
            for warpgroups in args.bulk if rows > 16 and "packed" in layouts and bulk_available() else ():
                copies = layouts["packed"]
                plan = bulk_plan(n, k, rows, sm_count, warpgroups or None, split=None if warpgroups == 0 else False)

                def launch(index: int, rows: int = rows, copies=copies, warpgroups=warpgroups) -> None:
                    gemm_rows_bulk(x[:rows], copies[index], out[:rows], rows=rows, x_tiles=x_tiles,
                                   partial=partial, warpgroups=warpgroups or None,
                                   split=None if warpgroups == 0 else False)

                record("gemm_rows_bulk", rows, *_time_launches(launch, len(copies), args.launches),
                       grid=list(plan.grid), warpgroups=plan.warpgroups, stages=plan.stages, entry=plan.kernel,
                       split=plan.split, layout="tiles", automatic=warpgroups == 0)
                results["tiles", "package", f"{plan.kernel}/{warpgroups}"] = out[:rows].copy()
            first = next(iter(results))
            reference = results[first]
            for (layout, sources, entry), result in results.items():
                if not bool((result == reference).all()):
                    raise SystemExit(f"{geometry} {projection} rows {rows}: {entry} on the {layout} layout with the "
                                     f"kernels of {sources} changed bits against {first[2]} on the {first[0]} layout")

        if args.sweep:
            for rows in (1, 4, 16, 64):
                for tiles in (1, 2, 4):
                    plan = launch_plan(n, k, rows, tiles, sm_count)
                    if plan.tiles_per_warp != tiles:
                        continue
                    # One block per column group, and a grid of exactly the resident blocks
                    # (each loops over the groups) where that is fewer.
                    whole = launch_plan(n, k, rows, tiles, sm_count, blocks=10**9).grid[0]
                    resident = sm_count * GEMM_ROWS_BLOCKS_PER_SM
                    for blocks in (whole, resident) if resident < whole else (whole,):
                        for layout, copies in layouts.items():

                            def launch(index: int, rows: int = rows, tiles: int = tiles, blocks=blocks,
                                       copies=copies) -> None:
                                gemm_rows_bf16(x[:rows], copies[index], out[:rows], rows=rows,
                                               tiles_per_warp=tiles, blocks=blocks, bulk=False)

                            swept = launch_plan(n, k, rows, tiles, sm_count, blocks)
                            record("gemm_rows_bf16", rows, *_time_launches(launch, len(copies), args.launches),
                                   grid=list(swept.grid), tiles_per_warp=tiles, entry=swept.kernel, sweep=True,
                                   layout=layout)
        del layouts

        for rows in () if args.no_gemv else GEMV_ROWS:

            def launch(index: int, rows: int = rows) -> None:
                ops.gemv_bf16(x[:rows], weights[index], out[:rows], rows=rows)

            record("gemv_bf16", rows, *_time_launches(launch, len(weights), args.launches))
        del weights
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
