"""Two versions of glm_kda on the same GPU: timings side by side, and whether their bits agree.

    PYTHONPATH=. python benchmarks/compare_versions.py --old DIR [--new DIR] [--geometry glm kimi]
        [--repeats 200] [--rounds 1] [--keep DIR]

DIR is the root of a checkout of another version (glm_kda/ and kernels_src/ in it), say
`git worktree add /tmp/old 3d65311` or `git archive 3d65311 | tar -x -C /tmp/old`; --new defaults to
this checkout. For each geometry (glm: GLM-5.3-Flash, hidden 4096, 64 heads; kimi: Kimi-Linear,
hidden 2304, 32 heads) one synthetic checkpoint and one input are written here, then each version
runs this script's measuring side (lib/versions.py) in a process of its own, PYTHONPATH=its DIR, on
those same weights and inputs: decode of one sequence (B=1) and of 64 (B=64, a StatePool), verify
walks of K=4 and K=16 rows (decode_k), and a prefill of T=16384. Decode-side timings are the median
per-call time of 200 replays of the call's captured graph (layer graphs' last_graph), each between
its own pair of CUDA events, queued back to back after warm-up (`graph_replay_us`), and the same of
the public call (`call_us`); prefill the median of 20 synchronised calls. Each process measures the
device-to-device copy bandwidth too, and every timing carries its roofline ratio (fewest bytes at
that bandwidth over the time).

The bits: the outputs of the first 4 calls of each decode-side case (eager, capture, replays) and
its final state, and the prefill's output and final state, as sha256 (and .npy files in --keep DIR):
`bits_identical` per case, with the count of differing elements and the largest difference where
they differ. Output: one JSON line per (geometry, case): the old and new figures, `ratio` = new / old
per timing (below 1: the new version is faster) and `roofline_ratio` of each. With --rounds N the
versions alternate N times (old, new, new, old, ...) and each timing is the median over the rounds.
Old versions (3d65311: glm_kda.layer, layer._graphs) and new ones (glm_kda.gpu.layer, layer.graphs)
are both understood.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.timing import MIN_TIMED_CALLS, timed_calls  # noqa: E402

HERE = Path(__file__).resolve()
CHECKOUT = HERE.parent.parent
GEOMETRIES = ("glm", "kimi")
TIMINGS = ("graph_replay_us", "call_us", "prefill_us")


def checkout_dir(text: str) -> Path:
    """An argparse type: a folder holding glm_kda/__init__.py (a checkout of some version)."""
    path = Path(text).expanduser().resolve()
    if not (path / "glm_kda" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text}: no glm_kda/__init__.py there (expected the root of a checkout)")
    return path


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=checkout_dir, metavar="DIR", help="root of the older checkout")
    parser.add_argument("--new", type=checkout_dir, metavar="DIR", default=CHECKOUT,
                        help="root of the newer checkout (default: this one)")
    parser.add_argument("--geometry", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    parser.add_argument("--repeats", type=timed_calls(), default=MIN_TIMED_CALLS,
                        help="timed replays per decode-side case (>= 200)")
    parser.add_argument("--rounds", type=int, default=1, help="times each version runs each geometry (>= 1)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep the checkpoints, inputs and bits here")
    parser.add_argument("--timeout", type=int, default=560, help="seconds one measuring process may take")
    # The measuring side (run by this script in a subprocess; PYTHONPATH names the version).
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--bits", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--package", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.measure and args.old is None:
        parser.error("--old DIR is required (the root of the older checkout)")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def write_inputs(directory: Path, geometry: str) -> tuple[Path, Path]:
    """The checkpoint and the input of a geometry, written once (with this process's glm_kda):
    (checkpoint folder, .npy of the input's BF16 bits as uint16)."""
    import numpy as np

    from glm_kda.synthetic import synthetic_config, synthetic_hidden, write_synthetic_checkpoint

    from lib.versions import input_rows

    checkpoint = directory / f"{geometry}-checkpoint"
    if not (checkpoint / "config.json").exists():
        write_synthetic_checkpoint(checkpoint, geometry, num_layers=1, seed=0)
    hidden = directory / f"{geometry}-hidden.npy"
    if not hidden.exists():
        rows = synthetic_hidden(input_rows(), synthetic_config(geometry, 1).hidden, seed=3)
        np.save(hidden, rows.view(np.uint16))
    return checkpoint, hidden


def describe(root: Path) -> dict:
    """The checkout: its folder and, where it is the root of a git work tree, its commit and whether it
    has changes (a folder unpacked inside another checkout, say by git archive, has no commit of its own)."""
    out = {"dir": str(root)}
    try:
        found = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "--short", "HEAD"],
                               capture_output=True, text=True, timeout=20)
        top, _, commit = found.stdout.strip().partition("\n")
        if found.returncode == 0 and Path(top).resolve() == root.resolve():
            out["commit"] = commit
            status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "glm_kda", "kernels_src"],
                                    capture_output=True, text=True, timeout=20)
            out["changed_files"] = len(status.stdout.splitlines())
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def run_version(root: Path, geometry: str, checkpoint: Path, hidden: Path, bits: Path | None, args,
                work: Path) -> list[dict]:
    """This script's measuring side in a subprocess with PYTHONPATH=root; its JSON rows."""
    # (Here, not at the top: the measuring side runs this script under the other version's package.)
    from glm_kda.selftest import json_lines

    command = [sys.executable, str(HERE), "--measure", "--geometry", geometry, "--checkpoint", str(checkpoint),
               "--hidden", str(hidden), "--repeats", str(args.repeats), "--package", str(root)]
    if bits is not None:
        command += ["--bits", str(bits)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("PYTHONSTARTUP", None)
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=work, timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:
        raise SystemExit(f"{root} {geometry}: the measuring process ran past {args.timeout} s; "
                         f"its output: {str(exc.stdout or '')[-2000:]}") from None
    rows = json_lines(done.stdout)
    if done.returncode != 0:
        raise SystemExit(f"{root} {geometry}: the measuring process failed ({done.returncode}):\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    return rows


def differences(old_dir: Path | None, new_dir: Path | None, key: str) -> dict:
    """Where two versions' saved bits of a case differ: count of differing elements and the
    largest absolute difference, per part (out: BF16, conv and recurrent: FP32)."""
    import ml_dtypes
    import numpy as np

    if old_dir is None or new_dir is None:
        return {}
    out = {}
    for part, dtype in (("out", ml_dtypes.bfloat16), ("conv", np.float32), ("recurrent", np.float32)):
        a, b = np.load(old_dir / f"{key}_{part}.npy"), np.load(new_dir / f"{key}_{part}.npy")
        if a.shape != b.shape:
            out[part] = {"shapes": [list(a.shape), list(b.shape)]}
            continue
        differ = a != b
        if differ.any():
            fa, fb = a.view(dtype).astype(np.float64), b.view(dtype).astype(np.float64)
            out[part] = {"differing": int(differ.sum()), "of": int(differ.size),
                         "max_abs_diff": float(np.nanmax(np.abs(fa - fb)))}
    return out


def median(values: list[float]) -> float:
    import statistics

    return float(statistics.median(values))


def combine(geometry: str, key: str, runs: dict[str, list[list[dict]]]) -> dict:
    """The output line of one case from the measuring rows of every round of both versions
    (runs["old"|"new"][round] = that process's rows): each version's timings (medians over the
    rounds) with their roofline ratios against its own copy bandwidth, ratio = new / old per
    timing, and whether the bits agree (those of the first round; `bits_repeatable`: every round
    of each version gave its first round's bits)."""
    per = {name: [next(r for r in rows if r.get("key") == key) for rows in runs[name]] for name in ("old", "new")}
    first = {name: per[name][0] for name in per}
    line = {"geometry": geometry, "case": first["new"]["case"], "key": key, "rows": first["new"]["rows"],
            "sequences": first["new"]["sequences"], "bytes": first["new"]["bytes"]}
    for name in per:
        figures = {"copy_bandwidth_GBs": median([r["copy_bandwidth_GBs"] for r in per[name]])}
        for timing in TIMINGS:
            if timing in first[name]:
                us = figures[timing] = median([r[timing] for r in per[name]])
                figures[f"{timing.removesuffix('_us')}_roofline_ratio"] = (
                    first[name]["bytes"] / 1e3 / figures["copy_bandwidth_GBs"] / us)
        figures["out_sha256"] = first[name]["out_sha256"][:16]
        figures["state_sha256"] = first[name]["state_sha256"][:16]
        line[name] = figures
    line["ratio"] = {timing: line["new"][timing] / line["old"][timing] for timing in TIMINGS
                     if timing in line["old"] and timing in line["new"]}
    line["out_bits_identical"] = first["old"]["out_sha256"] == first["new"]["out_sha256"]
    line["state_bits_identical"] = first["old"]["state_sha256"] == first["new"]["state_sha256"]
    line["bits_identical"] = line["out_bits_identical"] and line["state_bits_identical"]
    line["bits_repeatable"] = all(len({(r["out_sha256"], r["state_sha256"]) for r in per[name]}) == 1 for name in per)
    return line


def compare(args) -> int:
    from lib.script import exit_unless_gpu

    exit_unless_gpu("the version comparison")
    versions = {"old": args.old, "new": args.new}
    print(json.dumps({"note": "compare_versions", **{name: describe(root) for name, root in versions.items()},
                      "repeats": args.repeats, "rounds": args.rounds}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep.resolve() if args.keep is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for geometry in args.geometry:
            checkpoint, hidden = write_inputs(work, geometry)
            runs: dict[str, list[list[dict]]] = {"old": [], "new": []}
            bits: dict[str, Path] = {}
            for round_index in range(args.rounds):
                order = ("old", "new") if round_index % 2 == 0 else ("new", "old")
                for name in order:
                    folder = None
                    if round_index == 0:  # (the bits of the first round are kept; later rounds' sha256 only)
                        folder = bits[name] = work / f"bits-{name}-{geometry}"
                    runs[name].append(run_version(versions[name], geometry, checkpoint, hidden, folder, args, work))
            for name in versions:
                heads = [next(row for row in rows if row["case"] == "device") for rows in runs[name]]
                print(json.dumps({"version": name, "geometry": geometry, "api": heads[0]["api"],
                                  "package": heads[0]["package"], "device": heads[0]["device"],
                                  "copy_bandwidth_GBs": [head["copy_bandwidth_GBs"] for head in heads]}), flush=True)
            for key in [row["key"] for row in runs["old"][0] if row["case"] != "device"]:
                line = combine(geometry, key, runs)
                if not line["bits_identical"]:
                    line["differences"] = differences(bits.get("old"), bits.get("new"), key)
                print(json.dumps(line), flush=True)
    return 0


def measure(args) -> int:
    """The measuring side: glm_kda must come from args.package (PYTHONPATH); one JSON row per case."""
    import glm_kda

    from lib.versions import measure as measure_cases

    found = Path(glm_kda.__file__).resolve().parent.parent
    if args.package is not None and found != args.package.resolve():
        raise SystemExit(f"glm_kda was imported from {found}, not from {args.package} (PYTHONPATH is not first?)")
    measure_cases(args.checkpoint, args.hidden, args.bits, args.repeats, args.geometry[0])
    return 0


if __name__ == "__main__":
    arguments = parse_arguments()
    sys.exit(measure(arguments) if arguments.measure else compare(arguments))
