"""The floor of one kernel that only streams a projection's weight bytes, one JSON line per size.

A kernel that reads every 16-byte word of a buffer once (8 loads in flight per thread, an xor
to keep them) and writes nothing, timed like benchmarks/gemm_rows.py (launches queued behind a
spin kernel, event pairs around each, buffers rotated past three times the L2: lib/launches.py).
It is what a single launch of gemm_rows at that size could reach at best: the start and drain of a
kernel are in it, the mma and the k-split are not. `ratio`: (bytes / median time) over the copy
bandwidth measured in the same run; `roofline_us`: the bytes at that bandwidth.

    PYTHONPATH=. python benchmarks/stream_floor.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.launches import SHAPES, copies_past_l2, time_launches  # noqa: E402
from lib.timing import copy_bandwidth_gbs  # noqa: E402

_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256, 2)
stream_read(const uint4* __restrict__ words, long long count, unsigned int* __restrict__ sink)
{
    unsigned int acc = 0;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < count; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            v[u] = __ldg(words + i + u * stride);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    for (; i < count; i += stride) {
        const uint4 v = __ldg(words + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) {  // practically never: keeps the loads without a store per thread
        sink[blockIdx.x] = acc;
    }
}
"""


def main() -> None:
    import cupy
    import numpy as np

    kernel = cupy.RawKernel(_SOURCE, "stream_read")
    bandwidth = copy_bandwidth_gbs()
    properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    l2_bytes, sm_count = int(properties["l2CacheSize"]), int(properties["multiProcessorCount"])
    sink = cupy.zeros(8 * sm_count, cupy.uint32)
    for geometry, projection, n, k in SHAPES:
        nbytes = 2 * n * k
        if nbytes < 8 << 20:
            continue
        buffers = [cupy.ones(nbytes // 4, cupy.uint32) for _ in range(copies_past_l2(nbytes, l2_bytes))]
        for blocks in (2 * sm_count, 4 * sm_count, 8 * sm_count):

            def launch(index: int, blocks: int = blocks) -> None:
                kernel((blocks,), (256,), (buffers[index], np.int64(nbytes // 16), sink))

            median_us, back_to_back_us = time_launches(launch, len(buffers), 400)
            print(json.dumps({
                "geometry": geometry, "projection": projection, "bytes": nbytes, "blocks": blocks,
                "median_us": round(median_us, 2), "back_to_back_us": round(back_to_back_us, 2),
                "ratio": round(nbytes / (median_us * 1e-6) / 1e9 / bandwidth, 3),
                "roofline_us": round(nbytes / 1e3 / bandwidth, 2),
                "copy_bandwidth_GBs": round(bandwidth, 1),
            }), flush=True)


if __name__ == "__main__":
    from lib.script import script_help
    from lib.script import exit_unless_gpu

    script_help(__doc__)
    exit_unless_gpu("the stream floor benchmark")
    main()
