"""Timing helpers and the byte counts the roofline ratios are taken against.

Every timing is a CUDA-event figure after warm-up, quoted beside the device-to-device copy
bandwidth measured in the same process (bytes read + bytes written per second): a line's
``roofline_ratio`` is (fewest bytes the work must move / that bandwidth) over its measured time.

Nothing here imports glm_kda: benchmarks/compare_versions.py runs these helpers against other
versions of the package too. CuPy is imported inside the functions that need it.
"""

from __future__ import annotations


import numpy as np

from glm_kda.selftest import count_at_least  # noqa: F401 (the scripts' argparse type, one definition)

# The fewest calls after warm-up a decode timing's median is taken over.
MIN_TIMED_CALLS = 200


def timed_calls() -> "callable":
    """The argparse type of a --repeats that feeds a decode median (at least MIN_TIMED_CALLS)."""
    return count_at_least(MIN_TIMED_CALLS, " (a median over at least that many calls)")


def _events(event, elapsed):
    """event() and elapsed(start, end), CuPy's Event and get_elapsed_time where either is None."""
    if event is None or elapsed is None:
        import cupy

        event, elapsed = event or cupy.cuda.Event, elapsed or cupy.cuda.get_elapsed_time
    return event, elapsed


def torch_events() -> dict:
    """The event and elapsed arguments of median_ms and replay_ms for torch's CUDA events (work on
    torch's stream)."""
    import torch

    return {"event": lambda: torch.cuda.Event(enable_timing=True),
            "elapsed": lambda start, end: start.elapsed_time(end)}


def copy_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy: (read + write) bytes / median time, GB/s."""
    import cupy

    src = cupy.empty(nbytes // 4, cupy.float32)
    src.fill(1.0)
    dst = cupy.empty_like(src)
    return 2 * nbytes / 1e9 / (median_ms(lambda: cupy.copyto(dst, src), repeats) / 1e3)


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


def replay_ms(fn, calls: int = MIN_TIMED_CALLS, warmup: int = 10, between=None, event=None,
              elapsed=None) -> list[float]:
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


def replay_median_us(fn, calls: int = MIN_TIMED_CALLS, warmup: int = 10, between=None) -> float:
    """The median of replay_ms, in microseconds."""
    return 1e3 * float(np.median(replay_ms(fn, calls, warmup, between)))


def back_to_back_ms(fn, calls: int = MIN_TIMED_CALLS, warmup: int = 10) -> float:
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


def host_us(fn, calls: int = MIN_TIMED_CALLS, warmup: int = 10) -> float:
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


def l2_scrub():
    """A call that reads a buffer of four times the device's L2 size (a reduction on the current
    stream), so that nothing a timed call left in L2 is there for the next one."""
    import cupy

    size = 4 * int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"])
    buffer = cupy.ones(size // 4, cupy.float32)
    return lambda: buffer.sum()


# Byte counts -------------------------------------------------------------------------------------
def weight_bytes(config) -> int:
    """Bytes of every weight of the block (BF16, and the FP32 dt_bias and A_log)."""
    c = config
    return (2 * (c.conv_dim * c.hidden + c.down_dim * c.hidden + 2 * c.qkv * c.head_dim + c.conv_dim * c.conv_kernel
                 + c.head_dim + c.hidden * c.qkv) + 4 * (c.qkv + c.heads))


def state_bytes(config) -> int:
    """One sequence's conv and recurrent state (FP32), read once and written once."""
    c = config
    return 2 * 4 * (c.heads * c.head_dim * c.head_dim + c.conv_dim * c.conv_kernel)


def decode_bytes(config, sequences: int = 1) -> int:
    """Fewest bytes a decode-side call moves: every weight once, each sequence's state read and
    written once (a verify of K rows of one sequence: the same as one row)."""
    return weight_bytes(config) + sequences * state_bytes(config)


def prefill_bytes(config, tokens: int) -> int:
    """Fewest bytes a prefill of `tokens` moves: every weight once, the state read and written, the
    BF16 input read and the BF16 output written."""
    return weight_bytes(config) + state_bytes(config) + 2 * 2 * tokens * config.hidden


def roofline(nbytes: int, bandwidth_gbs: float, us: float) -> float:
    """(nbytes at the copy bandwidth) over the measured time: 1.0 is the copy's own rate."""
    return nbytes / 1e3 / bandwidth_gbs / us


def roofline_fields(nbytes: int, bandwidth_gbs: float, **times_us: float) -> dict:
    """bytes, copy_bandwidth_GBs, roofline_us and, per named time `x_us`, `x_roofline_ratio`."""
    out = {"bytes": nbytes, "copy_bandwidth_GBs": bandwidth_gbs, "roofline_us": nbytes / 1e3 / bandwidth_gbs}
    for name, us in times_us.items():
        out[f"{name.removesuffix('_us')}_roofline_ratio"] = roofline(nbytes, bandwidth_gbs, us) if us else None
    return out
