"""`glm-kda selftest`: on a GPU machine, run the GPU tests and a few timings; write a JSON report.

Timings are CUDA-event medians after warm-up, quoted beside the device-to-device copy
bandwidth measured in the same process (bytes read + bytes written per second), so the
numbers carry their own roofline.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np

from .device import gpu_status


def copy_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy: (read + write) bytes / median time, GB/s."""
    import cupy

    src = cupy.empty(nbytes // 4, cupy.float32)
    src.fill(1.0)
    dst = cupy.empty_like(src)
    return 2 * nbytes / 1e9 / (median_ms(lambda: cupy.copyto(dst, src), repeats) / 1e3)


# The fewest calls after warm-up a decode timing's median is taken over.
MIN_TIMED_CALLS = 200


def count_at_least(minimum: int, why: str = ""):
    """An argparse type: an integer >= minimum; `why`, the reason, is said in a refusal."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}{why}, got {value}")
        return value

    return parse


def _events(event, elapsed):
    """event() and elapsed(start, end), CuPy's Event and get_elapsed_time where either is None."""
    if event is None or elapsed is None:
        import cupy

        event, elapsed = event or cupy.cuda.Event, elapsed or cupy.cuda.get_elapsed_time
    return event, elapsed


def median_ms(fn, repeats: int = 50, warmup: int = 5, event=None, elapsed=None) -> float:
    """Median milliseconds of `repeats` calls of fn(), each between a pair of events and synchronised,
    after `warmup` calls. event() and elapsed(start, end) as in replay_ms."""
    event, elapsed = _events(event, elapsed)
    for _ in range(warmup):
        fn()
    times = []
    start, end = event(), event()
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(elapsed(start, end))
    return float(np.median(times))


def back_to_back_ms(fn, calls: int = 200, warmup: int = 10) -> float:
    """Mean milliseconds per call of `calls` calls issued back to back between two events
    (no synchronisation in between: host work overlaps the GPU's)."""
    import cupy

    for _ in range(warmup):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / calls


def replay_ms(fn, calls: int = 200, warmup: int = 10, between=None, event=None, elapsed=None) -> list[float]:
    """Milliseconds of each of `calls` calls issued back to back, each between its own pair of
    events, with one synchronisation after the last: while the host stays ahead of the GPU each pair
    times its call's GPU work as the queue runs it, so their median is a per-call figure without the
    gaps a synchronisation per call would add. between (None: nothing): issued before each timed
    call, outside its events (l2_scrub, say). event() and elapsed(start, end) (None: CuPy's Event
    and get_elapsed_time) make and read the events: another library's, for work on its stream."""
    event, elapsed = _events(event, elapsed)
    for _ in range(warmup):
        fn()
    events = [(event(), event()) for _ in range(calls)]
    for start, end in events:
        if between is not None:
            between()
        start.record()
        fn()
        end.record()
    events[-1][1].synchronize()
    return [elapsed(start, end) for start, end in events]


def l2_scrub():
    """A call that reads a buffer of four times the device's L2 size (a reduction on the current
    stream), so that nothing a timed call left in L2 is there for the next one."""
    import cupy

    size = 4 * int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"])
    buffer = cupy.ones(size // 4, cupy.float32)
    return lambda: buffer.sum()


def host_us(fn, calls: int = 200, warmup: int = 10) -> float:
    """Host microseconds per call of `calls` calls issued without synchronising (perf_counter, taken
    before the final synchronisation): the Python and driver work of a call, whatever the GPU does."""
    import time

    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    cupy.cuda.get_current_stream().synchronize()
    return 1e6 * seconds / calls


def weight_bytes(config) -> int:
    """Bytes of every weight of the block (BF16, and the FP32 dt_bias and A_log)."""
    c = config
    return (2 * (c.conv_dim * c.hidden + c.down_dim * c.hidden + 2 * c.qkv * c.head_dim + c.conv_dim * c.conv_kernel
                 + c.head_dim + c.hidden * c.qkv) + 4 * (c.qkv + c.heads))


def state_bytes(config) -> int:
    """One sequence's conv and recurrent state, read once and written once."""
    c = config
    return 2 * 4 * (c.heads * c.head_dim * c.head_dim + c.conv_dim * c.conv_kernel)


def decode_bytes(config) -> int:
    """Fewest bytes one decode token moves: every weight once, the state read and written."""
    return weight_bytes(config) + state_bytes(config)


def block_timings(geometry: str, directory: Path, bandwidth: float) -> dict:
    from .layer import KdaLayer, to_device_bf16
    from .synthetic import synthetic_hidden, write_synthetic_checkpoint

    path = write_synthetic_checkpoint(directory / geometry, geometry, num_layers=1)
    layer = KdaLayer.from_pretrained(path, 0, max_tokens=16384, progress=False)
    cfg = layer.config
    hidden = to_device_bf16(synthetic_hidden(16384, cfg.hidden))
    state = layer.new_state()
    result = {"geometry": geometry}
    nbytes = decode_bytes(cfg)
    result["decode_bytes"] = nbytes
    for mode, graphs in (("graph", True), ("eager", False)):
        layer.use_graphs = graphs
        decode_ms = median_ms(lambda: layer.decode(hidden[:1], state), repeats=200, warmup=20)
        result[f"decode_{mode}_us"] = 1e3 * decode_ms
        result[f"decode_{mode}_roofline_ratio"] = nbytes / 1e9 / bandwidth / (decode_ms / 1e3)
        for k in (4, 16):
            result[f"decode_k{k}_{mode}_us"] = 1e3 * median_ms(lambda: layer.decode_k(hidden[:k], state), repeats=200,
                                                               warmup=20)
    layer.use_graphs = True
    for tokens in (1024, 4096, 16384):
        ms = median_ms(lambda: layer.prefill(hidden[:tokens], state), repeats=5, warmup=2)
        result[f"prefill_T{tokens}_ms"] = ms
        result[f"prefill_T{tokens}_Mtok_s"] = tokens / ms / 1e3
    return result


def import_times() -> dict:
    """Seconds to import and build every kernel in a fresh process: first (cache may be cold)
    and second (warm CuPy kernel cache)."""
    code = "import time; t=time.perf_counter(); import glm_kda.kernels as k; k.KernelSet.get(); print(time.perf_counter()-t)"
    env = dict(os.environ)
    out = {}
    for name in ("first", "second"):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        out[f"{name}_import_and_build_s"] = float(done.stdout.strip().splitlines()[-1])
    return out


def _refused(report: dict, output: str, message: str, error: str) -> int:
    """Say why the self-test cannot run, record it in the report at `output`, and return 2."""
    print(message)
    report["error"] = error
    Path(output).write_text(json.dumps(report, indent=2))
    return 2


def run_selftest(output: str, quick: bool = False) -> int:
    ok, why = gpu_status()
    report: dict = {"gpu": why, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not ok:
        return _refused(report, output, f"selftest needs a CUDA GPU: {why}", why)
    import cupy

    repo_tests = Path(__file__).resolve().parent.parent / "tests"
    if not (repo_tests / "test_gpu.py").exists():
        return _refused(report, output, f"selftest runs the test suite of a checkout; {repo_tests} has none (an "
                        "installed wheel ships no tests)", "no tests/ beside the package")
    if importlib.util.find_spec("pytest") is None:
        return _refused(report, output, "selftest runs the GPU tests with pytest, which is not installed: "
                        "pip install -e '.[test]'", "pytest not installed")
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
        bandwidth = copy_bandwidth_gbs()
        report["copy_bandwidth_GBs"] = bandwidth
        report["timings"] = []
        for geometry in ("kimi",) if quick else ("glm", "kimi"):
            report["timings"].append(block_timings(geometry, Path(tmp), bandwidth))
            cupy.get_default_memory_pool().free_all_blocks()  # the next geometry starts with the memory free
    report["import"] = import_times()
    Path(output).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if rc == 0 else 1
