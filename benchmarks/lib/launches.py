"""Timing single kernel launches with the host's launch overhead kept out (benchmarks/gemm_rows.py,
benchmarks/stream_floor.py), the decode-side projection shapes they time, and random BF16 inputs
(benchmarks/kernel_versions.py, benchmarks/projections.py)."""

from __future__ import annotations

import numpy as np

# (geometry, projection, n, k): the decode-side projections of GLM-5.3-Flash and Kimi-Linear.
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
WARMUP = 20
SPIN_SECONDS = 0.03
BATCH = 100

_SPIN_SOURCE = r"""extern "C" __global__ void spin(long long cycles)
{
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}"""
_spin_kernel = None


def random_bf16(rng, shape, scale: float = 1.0):
    """Normal samples of a CuPy generator times `scale`, rounded to BF16 on the GPU as the projections
    round (glm_kda.gpu.arrays.bf16_dtype)."""
    import cupy

    from glm_kda.gpu.arrays import bf16_dtype
    from glm_kda.gpu.ops import round_to_bf16

    out = cupy.empty(shape, bf16_dtype())
    round_to_bf16(rng.standard_normal(shape, dtype=cupy.float32) * scale, out)
    return out


def spin() -> None:
    """Keep the GPU busy for SPIN_SECONDS while the host queues a batch, so that the events time
    the kernels and not the host's launch overhead (which is larger than the small cases)."""
    import cupy

    global _spin_kernel
    if _spin_kernel is None:
        _spin_kernel = cupy.RawKernel(_SPIN_SOURCE, "spin")
    rate_khz = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["clockRate"]
    _spin_kernel((1,), (1,), (np.int64(rate_khz * 1e3 * SPIN_SECONDS),))


def time_launches(launch, count: int, launches: int) -> tuple[float, float]:
    """(median µs of single launches, mean µs of back-to-back launches); launch(i) runs copy i % count.

    Launches go in batches of BATCH behind a spin kernel: the queue is full when the GPU
    reaches them, so an event pair measures the kernel alone.
    """
    import cupy

    for index in range(WARMUP):
        launch(index % count)
    single: list[float] = []
    streams: list[float] = []
    done = 0
    while done < launches:
        spin()
        events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(BATCH)]
        for offset, (start, end) in enumerate(events):
            start.record()
            launch((done + offset) % count)
            end.record()
        events[-1][1].synchronize()
        single += [cupy.cuda.get_elapsed_time(start, end) * 1e3 for start, end in events]

        spin()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for offset in range(BATCH):
            launch((done + offset) % count)
        end.record()
        end.synchronize()
        streams.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / BATCH)
        done += BATCH
    return float(np.median(single)), float(np.mean(streams))


def copies_past_l2(nbytes: int, l2_bytes: int) -> int:
    """How many copies of an nbytes buffer launches rotate over so that together they exceed three
    times the L2 (at least 4): every launch then reads its buffer from memory."""
    return max(4, -(-3 * l2_bytes // nbytes))
