"""`glm-kda selftest`: on a GPU machine, run the GPU tests and a few timings; write a JSON report.

It runs from a source checkout: the GPU tests with pytest, the whole-block timings of
``benchmarks/block.py`` (run by path, in a subprocess; its JSON lines carry the copy bandwidth measured
in the same run), then the import and kernel-build time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from .device import gpu_status

CHECKOUT = Path(__file__).resolve().parent.parent


def count_at_least(minimum: int, why: str = ""):
    """An argparse type: an integer >= minimum; `why`, the reason, is said in a refusal."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}{why}, got {value}")
        return value

    return parse


def json_lines(text: str) -> list:
    """The lines of `text` that are JSON values, parsed (a script's one JSON line per case)."""
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def block_timings(geometries: list[str], script: Path | None = None) -> dict:
    """The JSON lines of benchmarks/block.py for `geometries`, run in a subprocess: {"rows": [...]}
    and, where it failed, "returncode" and the tail of its output."""
    script = script or CHECKOUT / "benchmarks" / "block.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script), *geometries], capture_output=True, text=True, env=env)
    out: dict = {"rows": json_lines(done.stdout)}
    if done.returncode != 0:
        out.update(returncode=done.returncode, output_tail=(done.stdout + done.stderr)[-2000:])
    return out


def import_times() -> dict:
    """Seconds to import and build every kernel in a fresh process: first (cache may be cold)
    and second (warm CuPy kernel cache)."""
    code = "import time; t=time.perf_counter(); import glm_kda.gpu.build as k; k.KernelSet.get(); print(time.perf_counter()-t)"
    out = {}
    for name in ("first", "second"):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        out[f"{name}_import_and_build_s"] = float(done.stdout.strip().splitlines()[-1])
    return out


def _refused(message: str) -> int:
    """Say why the self-test cannot run (one `error:` line, no report file) and return 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def run_selftest(output: str, quick: bool = False) -> int:
    ok, why = gpu_status()
    report: dict = {"gpu": why, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not ok:
        return _refused(f"selftest needs a CUDA GPU: {why}")
    repo_tests = CHECKOUT / "tests"
    if not (repo_tests / "test_gpu.py").exists():
        return _refused(f"selftest runs the test suite of a checkout; {repo_tests} has none (an installed wheel "
                        "ships no tests)")
    if importlib.util.find_spec("pytest") is None:
        return _refused("selftest runs the GPU tests with pytest, which is not installed: pip install -e '.[test]'")
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        args = [sys.executable, "-m", "pytest", "-q", str(repo_tests / "test_gpu.py"), f"--junitxml={junit}"]
        if quick:
            args += ["-x", "-k", "kimi and not T4096 and not T1000"]
        print("running", " ".join(args), flush=True)
        rc = subprocess.call(args)
        suite = ElementTree.parse(junit).getroot().find("testsuite") if junit.exists() else None
        if suite is not None:
            report["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        report["tests_returncode"] = rc
    script = CHECKOUT / "benchmarks" / "block.py"
    if script.exists():
        print("running", script, flush=True)
        report["timings"] = block_timings(["kimi"] if quick else ["glm", "kimi"], script)
    else:
        report["timings"] = {"note": f"no timings: {script} is not here (benchmarks need a source checkout)"}
    report["import"] = import_times()
    # Written whole or not at all: a self-test stopped part way leaves no file behind.
    partial = Path(output).with_name(Path(output).name + ".partial")
    partial.write_text(json.dumps(report, indent=2))
    partial.replace(output)
    print(json.dumps(report, indent=2))
    return 0 if rc == 0 else 1
