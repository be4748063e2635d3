"""`glm-kda`: inspect a checkpoint, run the demo, self-test and benchmark on a GPU."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .selftest import count_at_least


# `glm-kda bench NAME`: the script of a source checkout it runs (the benchmarks are no part of the
# package: an installed wheel has none).
BENCH_SCRIPTS = {"decode": "decode.py", "prefill": "prefill.py"}


def benchmarks_dir() -> Path:
    """benchmarks/ of the source checkout this package was imported from (it may not exist)."""
    return Path(__file__).resolve().parent.parent / "benchmarks"


def _bench(args: argparse.Namespace) -> int:
    """Run benchmarks/<script> of the checkout in this process, with the arguments after the
    benchmark's name; its exit status (2 where there is no checkout)."""
    import runpy

    script = benchmarks_dir() / BENCH_SCRIPTS[args.bench]
    if not script.is_file():
        print(f"error: glm-kda bench {args.bench} runs {script.parent.name}/{script.name} of a source checkout, and "
              f"there is none beside this package ({script.parent} does not hold it): an installed wheel ships "
              "no benchmarks. Clone the repository and run `python benchmarks/"
              f"{script.name}` there, or `pip install -e .` from it.", file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = [str(script), *args.arguments]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        code = stop.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0


def _inspect(args: argparse.Namespace) -> int:
    """The config and a header check of every KDA layer (a bad path, config or shard: main's error line)."""
    from .checkpoint import check_layers
    from .config import ConfigError, KdaConfig

    config = KdaConfig.from_pretrained(args.path)
    print(f"{args.path}: model_type {config.model_type or '?'}")
    print(f"  geometry: {config.describe()}")
    layers = ", ".join(str(i) for i in config.kda_layers) or "unknown (config lists none)"
    print(f"  KDA layers ({len(config.kda_layers)} of {config.num_layers or '?'}), 0-based: {layers}")
    try:
        config.validate()
        print("  CUDA kernels: geometry supported")
    except ConfigError as exc:
        print(f"  CUDA kernels: NOT supported: {exc}")
    if args.no_tensors:
        return 0
    results = check_layers(args.path, config)
    bad = 0
    for layer_idx, ok, message in results:
        bad += not ok
        print(f"  layer {layer_idx:>3}: {'ok  ' if ok else 'FAIL'} {message}")
    print(f"  {len(results) - bad} of {len(results)} KDA layers bind cleanly")
    return 1 if bad else 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.geometry, prompt=args.prompt, steps=args.steps, seed=args.seed, force_cpu=args.cpu)
    return 0


def _selftest(args: argparse.Namespace) -> int:
    from .selftest import run_selftest

    return run_selftest(args.output, quick=args.quick)


def main(argv: list[str] | None = None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="glm-kda", description=__doc__)
    parser.add_argument("--version", action="version", version=f"glm-kda {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="geometry, gate law, KDA layers and a tensor check of a checkpoint")
    p.add_argument("path", help="checkpoint directory or hub repo id")
    p.add_argument("--no-tensors", action="store_true", help="only read config.json")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("demo", help="prefill + decode on a synthetic checkpoint, with a stage agreement table")
    p.add_argument("--geometry", default="kimi", choices=["glm", "kimi", "tiny-glm", "tiny-kimi"],
                   help="the synthetic layer's geometry: GLM-5.3-Flash's or Kimi-Linear's, or a tiny one of each law "
                   "(a second on a CPU; default kimi)")
    p.add_argument("--prompt", type=count_at_least(1), default=64, help="prefill tokens, >= 1 (default 64)")
    p.add_argument("--steps", type=count_at_least(1), default=32, help="decode steps, >= 1 (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights and rows (default 0)")
    p.add_argument("--cpu", action="store_true", help="run the NumPy path even when a GPU is present")
    p.set_defaults(func=_demo)

    p = sub.add_parser("selftest", help="GPU machines: run the GPU tests and a few timings, write a JSON report")
    p.add_argument("--output", default="glm_kda_selftest.json", help="where the JSON report goes, written once "
                   "complete (default glm_kda_selftest.json)")
    p.add_argument("--quick", action="store_true", help="skip the real-geometry cases")
    p.set_defaults(func=_selftest)

    p = sub.add_parser("bench", help="GPU benchmarks of a source checkout (benchmarks/), one JSON line per case",
                       description="Runs benchmarks/decode.py or benchmarks/prefill.py of the source checkout this "
                       "package comes from, with the arguments that follow (`glm-kda bench decode -h` lists them). "
                       "The benchmarks are no part of the installed package: they need a source checkout.")
    p.add_argument("bench", choices=sorted(BENCH_SCRIPTS),
                   help="decode: batched decode, verify, graph vs eager, against the copy roofline; prefill: whole "
                   "block and KDA core, tensor-core and FP32 chunk kernels, Mtok/s")
    p.add_argument("arguments", nargs=argparse.REMAINDER, help="the benchmark script's own arguments")
    p.set_defaults(func=_bench)

    args = parser.parse_args(argv)
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .device import NoGpuError

    try:
        return args.func(args)
    except (NoGpuError, ConfigError, CheckpointError, OSError) as exc:
        # Bad input (a path, a file, a config) or no GPU: one line, never a traceback.
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
