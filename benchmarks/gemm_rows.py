"""gemm_rows_bf16 (the decode-side projection) timed alone on a GPU, one JSON line per case.

Roofline: up to 64 rows the kernel must read the weight once, so its floor is (bytes of w) /
(device-to-device copy bandwidth, read + write bytes over the time of a 1 GiB cupy copy, measured
in the same run). Each line carries

    median_us           median of >= 200 launches, one CUDA event pair around each
    back_to_back_us     mean of as many launches timed as back-to-back batches
    weight_bytes        bytes of w (rows > 64 read it ceil(rows / 64) times: weight_reads)
    roofline_us         weight_bytes at the copy bandwidth
    ratio               roofline_us / median_us
    ratio_back_to_back  the same with back_to_back_us (no event pair between launches)

Both times queue their launches behind a spin kernel (lib/launches.py), so the host's launch
overhead (larger than the small cases) is not in them; what remains per launch is the GPU's own
start and drain of a kernel, a few microseconds that dominate the small shapes. Launches rotate
over enough copies of the weight (at least 4) that together they exceed three times the L2, so
every launch reads its weight from memory.

Every row count runs with the weight row-major and in the packed layout (pack_weight; `layout`),
on the sweep the projection picks (bulk=False), and all the outputs of one shape and row count must
agree bit for bit. --sweep adds tiles_per_warp 1, 2, 4 with the grid the projection picks and with
at most two blocks per SM (`blocks`; a combination the projection refuses is left out). --bulk
(sm_90) adds 17..256 rows of a packed weight with the tile layout on the bulk-copy sweep
(bulk=True), bits compared too. --against DIR (repeatable) also times every line with the kernels
compiled from the sources in DIR (another version of kernels_src/ with the same entry points, say
`git archive HEAD~1 kernels_src | tar -x -C /tmp/previous`), in the same process, bits compared.

    PYTHONPATH=. python benchmarks/gemm_rows.py [--launches 200] [--rows R ...] [--layout both|row_major|packed]
        [--sweep] [--bulk] [--against DIR ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.launches import SHAPES, copies_past_l2, time_launches  # noqa: E402
from lib.timing import MIN_TIMED_CALLS, copy_bandwidth_gbs, timed_calls  # noqa: E402

ROWS = (1, 4, 16, 64, 256)
SWEEP_ROWS = (1, 4, 16, 64)
TILES_PER_WARP = (1, 2, 4)
# --sweep's second grid: at most this many blocks per SM.
GRID_BLOCKS_PER_SM = 2


def _random_bf16_bits(shape, scale: float = 1.0):
    """BF16 bits of scaled normals, made on the device (truncated, which is fine for timing)."""
    import cupy

    values = cupy.random.standard_normal(shape, dtype=cupy.float32) * scale
    return (values.view(cupy.uint32) >> 16).astype(cupy.uint16)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=timed_calls(), default=MIN_TIMED_CALLS,
                        help="timed launches per line (>= 200)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help=f"row counts (default {ROWS})")
    parser.add_argument("--layout", choices=("both", "row_major", "packed"), default="both",
                        help="weight layouts to time")
    parser.add_argument("--sweep", action="store_true", help="also every tiles_per_warp, two grids, at rows "
                        f"{SWEEP_ROWS}")
    parser.add_argument("--bulk", action="store_true", help="17..256 rows: also the bulk-copy sweep (sm_90)")
    parser.add_argument("--against", metavar="DIR", action="append", default=[],
                        help="also time the kernels compiled from the sources in DIR, bits compared (repeatable)")
    args = parser.parse_args(argv)
    if any(not 1 <= rows <= 256 for rows in args.rows):
        parser.error(f"--rows must lie in 1..256, got {args.rows}")
    return args


def bench_shape(args: argparse.Namespace, geometry: str, projection: str, n: int, k: int, kernel_sets: dict,
                common: dict) -> None:
    """Every line of one projection shape (its weight copies freed on return)."""
    import cupy

    from glm_kda.gpu import build as kernels
    from glm_kda.gpu.projection import gemm_rows_bf16, pack_weight

    nbytes, bandwidth = 2 * n * k, common["copy_bandwidth_GBs"]
    weights = [_random_bf16_bits((n, k), k**-0.5) for _ in range(copies_past_l2(nbytes, common["l2_bytes"]))]
    layouts = {}
    if args.layout in ("both", "row_major"):
        layouts["row_major"] = weights
    if args.layout in ("both", "packed"):
        layouts["packed"] = [pack_weight(w, tiles=args.bulk) for w in weights]
    x = _random_bf16_bits((max(ROWS), k))
    out = cupy.empty((max(ROWS), n), cupy.uint16)

    def record(rows: int, median_us: float, back_to_back_us: float, **extra) -> None:
        print(json.dumps({
            "geometry": geometry, "projection": projection, "n": n, "k": k, "rows": rows, **extra,
            "median_us": round(median_us, 2), "back_to_back_us": round(back_to_back_us, 2),
            "weight_bytes": nbytes, "weight_reads": -(-rows // 64), "roofline_us": round(nbytes / 1e3 / bandwidth, 2),
            "weight_GBs": round(nbytes / 1e3 / median_us, 1), "ratio": round(nbytes / 1e3 / bandwidth / median_us, 3),
            "ratio_back_to_back": round(nbytes / 1e3 / bandwidth / back_to_back_us, 3),
            "weight_copies": len(weights), "one_copy_fits_l2": nbytes <= common["l2_bytes"], **common,
        }), flush=True)

    def measure(rows: int, copies, results: dict, label: tuple, **options) -> None:
        """Time gemm_rows_bf16 over `copies` with `options` under every kernel set, keeping each
        output under label + (sources,); a combination the projection refuses is left out."""
        try:
            gemm_rows_bf16(x[:rows], copies[0], out[:rows], rows=rows, **options)
        except (ValueError, RuntimeError) as refused:
            print(json.dumps({"geometry": geometry, "projection": projection, "rows": rows, **options,
                              "layout": label[0], "skipped": str(refused)[:200]}), flush=True)
            return
        for sources, kernel_set in kernel_sets.items():
            kernels.KernelSet.install(kernel_set)

            def launch(index: int) -> None:
                gemm_rows_bf16(x[:rows], copies[index], out[:rows], rows=rows, **options)

            timed = time_launches(launch, len(copies), args.launches)
            record(rows, *timed, layout=label[0], **options, **({"sources": sources} if args.against else {}))
            results[label + (sources,)] = out[:rows].copy()
        kernels.KernelSet.install(kernel_sets["package"])

    for rows in args.rows:
        results: dict = {}
        for layout, copies in layouts.items():
            measure(rows, copies, results, (layout, "auto"), bulk=False)
        if args.sweep and rows in SWEEP_ROWS:
            for layout, copies in layouts.items():
                for tiles in TILES_PER_WARP:
                    for blocks in (None, GRID_BLOCKS_PER_SM * common["sm_count"]):
                        measure(rows, copies, results, (layout, f"tiles{tiles}/{blocks}"), bulk=False,
                                tiles_per_warp=tiles, blocks=blocks)
        if args.bulk and rows > 16 and "packed" in layouts:
            measure(rows, layouts["packed"], results, ("tiles", "bulk"), bulk=True)
        if not results:
            continue
        first, reference = next(iter(results.items()))
        for label, result in results.items():
            if not bool((result == reference).all()):
                raise SystemExit(f"{geometry} {projection} rows {rows}: {label} changed bits against {first}")


def main(args: argparse.Namespace) -> None:
    import cupy

    from glm_kda.gpu import build as kernels

    properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    kernel_sets = {"package": kernels.KernelSet.get()}
    for folder in args.against:
        kernel_sets[folder] = kernels.KernelSet(folder)
    name = properties["name"]
    common = {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "copy_bandwidth_GBs": round(copy_bandwidth_gbs(), 1), "l2_bytes": int(properties["l2CacheSize"]),
        "sm_count": int(properties["multiProcessorCount"]),
    }
    for geometry, projection, n, k in SHAPES:
        bench_shape(args, geometry, projection, n, k, kernel_sets, common)
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    from lib.script import exit_unless_gpu

    arguments = parse_arguments()
    exit_unless_gpu("the projection benchmark")
    main(arguments)
