"""The warpgroup-MMA sweep (kernels_src/gemm_rows_wgmma.cu) compiled with other settings of its
switches, against the mma.sync sweep gemm_rows_bf16 picks, at 64 rows of the model's projections:
bits compared with the mma.sync output, time per call (median of the rounds, CUDA events around
back-to-back launches), one JSON line per (shape, variant).

A variant is STEP,CHUNK,STAGES,WARPGROUPS_PER_SM,WARPGROUPS[,RING] (GEMM_WGMMA_STEP, _CHUNK, _STAGES,
_WARPGROUPS_PER_SM, the warpgroups of a block, and the steps of weight a warp keeps in flight
through shared memory, the kernel's ring_depth: 0, the default, loads it into registers). The
cubins may be built beforehand where NVRTC is at hand but no GPU (--build DIR), then timed on the
GPU (--cubins DIR):

    PYTHONPATH=. python benchmarks/wgmma_variants.py --build wgv 2,4,3,4,1 4,4,3,2,1 8,8,3,2,1
    PYTHONPATH=. python benchmarks/wgmma_variants.py --cubins wgv
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

SHAPES = [("glm", "qkv_proj", 24576, 4096), ("kimi", "qkv_proj", 12288, 2304), ("glm", "o_proj", 4096, 8192),
          ("kimi", "o_proj", 2304, 4096)]
ROWS = 64
ROUNDS = 5
CALLS = 20
SWITCHES = ("GEMM_WGMMA_STEP", "GEMM_WGMMA_CHUNK", "GEMM_WGMMA_STAGES", "GEMM_WGMMA_WARPGROUPS_PER_SM")


def parse_variant(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if len(values) not in (5, 6):
        raise SystemExit(f"variant {text!r}: expected STEP,CHUNK,STAGES,WARPGROUPS_PER_SM,WARPGROUPS[,RING]")
    return values if len(values) == 6 else values + (0,)


def label(variant: tuple[int, ...]) -> str:
    return "s{}c{}t{}p{}g{}r{}".format(*variant)


def build(folder: Path, variants: list[tuple[int, ...]]) -> None:
    """One sm_90a cubin per variant (the switches defined ahead of the file) and variants.json."""
    from glm_kda import kernels

    folder.mkdir(parents=True, exist_ok=True)
    for variant in variants:
        with tempfile.TemporaryDirectory() as tmp:
            for path in kernels.kernels_dir().iterdir():
                shutil.copy(path, tmp)
            source = Path(tmp) / "gemm_rows_wgmma.cu"
            defines = "".join(f"#define {name} {value}\n" for name, value in zip(SWITCHES, variant[:4]))
            source.write_text(defines + source.read_text())
            compiled = kernels.compile_file("gemm_rows_wgmma", "sm_90a", tmp)
        (folder / f"{label(variant)}.cubin").write_bytes(compiled.cubin)
        spills = {name: props for name, props in kernels.parse_ptxas_log(compiled.log).items()}
        print(json.dumps({"variant": label(variant), "ptxas": spills}))
    (folder / "variants.json").write_text(json.dumps([list(v) for v in variants]))


def median_ms(launch, calls: int = CALLS, rounds: int = ROUNDS) -> float:
    """Median over `rounds` of the mean time per call of `calls` launches back to back."""
    import numpy as np

    from glm_kda.selftest import back_to_back_ms

    return float(np.median([back_to_back_ms(launch, calls, warmup=3) for _ in range(rounds)]))


def run(folder: Path) -> None:
    import cupy

    from glm_kda.gemm_rows import gemm_rows_bf16, pack_weight
    from glm_kda.ops import _i32
    from glm_kda.selftest import copy_bandwidth_gbs

    variants = [parse_variant(",".join(map(str, v))) for v in json.loads((folder / "variants.json").read_text())]
    sm_count = cupy.cuda.Device().attributes["MultiProcessorCount"]
    bandwidth = copy_bandwidth_gbs()
    for geometry, name, n, k in SHAPES:
        bits = cupy.random.standard_normal((ROWS, k), dtype=cupy.float32).view(cupy.uint32) >> 16
        x = bits.astype(cupy.uint16)
        w = ((cupy.random.standard_normal((n, k), dtype=cupy.float32) * 0.05).view(cupy.uint32) >> 16).astype(cupy.uint16)
        packed = pack_weight(w, pairs=True)
        reference = cupy.zeros((ROWS, n), dtype=cupy.uint16)
        gemm_rows_bf16(x, packed, reference, rows=ROWS, wgmma=False)
        base_ms = median_ms(lambda: gemm_rows_bf16(x, packed, reference, rows=ROWS, wgmma=False))
        print(json.dumps({"shape": f"{geometry} {name}", "n": n, "k": k, "rows": ROWS, "kernel": "mma.sync",
                          "us": round(1e3 * base_ms, 2), "weight_GBs": round(n * k * 2 / base_ms / 1e6, 1),
                          "copy_bandwidth_GBs": round(bandwidth, 1)}))
        for variant in variants:
            step, chunk, stages, per_sm, groups_per_block, ring = variant
            module = cupy.RawModule(path=str(folder / f"{label(variant)}.cubin"))
            function = module.get_function(f"gemm_rows_wgmma_n64_g{groups_per_block}")
            shared = stages * chunk * 64 * 64 + groups_per_block * 4 * ring * (step * 1024 + 8)
            function.max_dynamic_shared_size_bytes = shared
            groups = -(-n // (64 * groups_per_block))
            grid = (min(sm_count * (per_sm // groups_per_block), groups), 1)
            out = cupy.full((ROWS, n), 0x7FC1, dtype=cupy.uint16)
            args = (x, _i32(k), packed.pairs, out, _i32(n), _i32(ROWS), _i32(n), _i32(k), _i32(ring))

            def launch(function=function, grid=grid, args=args, groups_per_block=groups_per_block, shared=shared):
                function(grid, (128 * groups_per_block,), args, shared_mem=shared)

            launch()
            differ = int(cupy.count_nonzero(out != reference))
            ms = median_ms(launch)
            print(json.dumps({"shape": f"{geometry} {name}", "kernel": label(variant), "us": round(1e3 * ms, 2),
                              "weight_GBs": round(n * k * 2 / ms / 1e6, 1), "differing_outputs": differ,
                              "grid": grid[0]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, help="compile the variants' cubins into this folder")
    parser.add_argument("--cubins", type=Path, help="time the variants built into this folder")
    parser.add_argument("variants", nargs="*", type=parse_variant)
    args = parser.parse_args()
    if args.build:
        build(args.build, args.variants)
    if args.cubins:
        run(args.cubins)
    if not args.build and not args.cubins:
        parser.error("give --build DIR (with variants) and / or --cubins DIR")


if __name__ == "__main__":
    main()
