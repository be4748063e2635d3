"""How fast an SM takes data in: alone, beside every other SM, by the bulk copy engine, by
multicast over a cluster of two, and by plain loads. One JSON line per case.

The decode projections at 17..64 rows (kernels_src/gemm_rows_bulk.cu) stream about 37 GB/s into
each SM whatever the DRAM load, and every block reads all of x besides its weight. Whether that
rate is the SM's own limit or one that the SMs share (L2, the crossbar) decides what can help:
only a limit the SMs share is relieved by multicast (L2 serves a chunk once for both blocks of a
cluster), and only a limit of each SM by spreading a sweep over more SMs. Each case gives the
bytes every block received over the kernel's time (CUDA events, median of 9 launches after 2),
per SM and summed; `source` "l2" reads an 8 MB region every block shares (L2 hits after the first
pass), "dram" a region of its own per block (or per cluster). Mode "issuers" (first for each block
count; alone with --issuers-only) streams a block's bytes from several threads at once, each with a
ring of its own, or from one thread in chunks of other sizes. sm_90 only.

    PYTHONPATH=. python benchmarks/sm_intake.py [--blocks 2 8 32 66 96 132] [--issuers-only]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import cupy
import numpy as np

from glm_kda import kernels
from glm_kda.device import exit_unless_gpu
from glm_kda.selftest import copy_bandwidth_gbs, median_ms

HERE = Path(__file__).resolve().parent
CHUNK = 16 << 10
L2_REGION = 8 << 20


ENTRY_POINTS = ("intake_bulk", "intake_multicast", "intake_loads", "intake_issuers")


def compile_kernels() -> kernels.CompiledFile:
    """sm_intake.cu compiled for sm_90a by NVRTC (no GPU needed), wgmma.cuh inlined from kernels_src."""
    with tempfile.TemporaryDirectory() as folder:
        _stage(folder)
        return kernels.compile_file("sm_intake", "sm_90a", folder)


def _stage(folder: str) -> None:
    shutil.copy(HERE / "sm_intake.cu", folder)
    shutil.copy(HERE.parent / "kernels_src" / "wgmma.cuh", folder)


def _module() -> cupy.RawModule:
    with tempfile.TemporaryDirectory() as folder:
        _stage(folder)
        return cupy.RawModule(path=str(kernels._cached_cubin("sm_intake", "sm_90a", folder)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 8, 32, 66, 96, 132])
    parser.add_argument("--mb-per-block", type=float, default=4.0)
    parser.add_argument("--issuers-only", action="store_true",
                        help="only the cases of several issuing threads a block and of other chunk sizes")
    args = parser.parse_args()
    exit_unless_gpu("the SM intake benchmark")
    properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    sm_count = int(properties["multiProcessorCount"])
    module = _module()
    bulk, multicast, loads, issuers_kernel = (module.get_function(n) for n in ENTRY_POINTS)
    per_block = int(args.mb_per_block * (1 << 20)) // CHUNK * CHUNK
    chunks = per_block // CHUNK
    dram_bytes = per_block * 2 * sm_count
    buffer = cupy.zeros(dram_bytes // 4, cupy.uint32)
    sink = cupy.zeros(4 * sm_count, cupy.uint32)
    print(json.dumps({"copy_bandwidth_GBs": round(copy_bandwidth_gbs(), 1), "sm_count": sm_count,
                      "bytes_per_block": per_block}), flush=True)

    def report(mode, source, blocks, per_sm_blocks, stages, ms, **extra):
        received = per_block * blocks
        sms = blocks // per_sm_blocks
        print(json.dumps({"mode": mode, "source": source, "blocks": blocks, "sms": sms, "stages": stages, **extra,
                          "us": round(ms * 1e3, 1), "per_sm_GBs": round(received / sms / ms / 1e6, 1),
                          "total_GBs": round(received / ms / 1e6, 1),
                          "l2_served_GBs": round(received / (2 if mode == "multicast" else 1) / ms / 1e6, 1)}),
              flush=True)

    for source in ("l2", "dram"):
        region = L2_REGION if source == "l2" else dram_bytes
        offset = 64 << 10 if source == "l2" else per_block
        for blocks in args.blocks:
            # Several issuing threads in one block (one a warp, or neighbouring lanes), and one issuer
            # with other chunk sizes, 64 KB of ring an issuer (48 KB for 4 issuers).
            for count, lane_step, chunk in ((1, 32, 4 << 10), (1, 32, 32 << 10), (1, 32, 64 << 10), (2, 32, CHUNK),
                                            (4, 32, CHUNK), (2, 1, CHUNK), (4, 1, CHUNK), (3, 1, CHUNK)):
                stages = 3 if count == 4 else max(2, (64 << 10) // chunk)
                shared = count * stages * (chunk + 8)
                issuers_kernel.max_dynamic_shared_size_bytes = shared
                launch = lambda: issuers_kernel((blocks,), (256,), (
                    buffer, np.uint64(region), np.uint64(offset), np.int32(per_block // chunk), np.int32(chunk),
                    np.int32(stages), np.int32(count), np.int32(lane_step)), shared_mem=shared)
                report("issuers", source, blocks, 1, stages, median_ms(launch, 9, 2), issuers=count,
                       lanes_apart=lane_step, chunk_kb=chunk >> 10)
            if args.issuers_only:
                continue
            for stages in (4, 8):
                shared = stages * CHUNK + 16 * stages
                bulk.max_dynamic_shared_size_bytes = shared
                launch = lambda: bulk((blocks,), (32,), (buffer, np.uint64(region), np.uint64(offset), np.int32(chunks),
                                                          np.int32(CHUNK), np.int32(stages)), shared_mem=shared)
                report("bulk", source, blocks, 1, stages, median_ms(launch, 9, 2))
            # Two blocks an SM, each with a ring of 4 slots (shared memory for two, not three).
            stages = 4
            shared = max(stages * CHUNK + 16 * stages, 80 << 10)
            bulk.max_dynamic_shared_size_bytes = shared
            launch = lambda: bulk((2 * blocks,), (32,), (buffer, np.uint64(region), np.uint64(offset),
                                                          np.int32(chunks), np.int32(CHUNK), np.int32(stages)),
                                  shared_mem=shared)
            report("bulk_2_per_sm", source, 2 * blocks, 2, stages, median_ms(launch, 9, 2))
            if blocks % 2 == 0:
                stages = 8
                shared = max(stages * CHUNK + 32 * stages, 120 << 10)
                multicast.max_dynamic_shared_size_bytes = shared
                launch = lambda: multicast((blocks,), (32,), (buffer, np.uint64(region), np.uint64(offset),
                                                               np.int32(chunks), np.int32(CHUNK), np.int32(stages)),
                                           shared_mem=shared)
                report("multicast", source, blocks, 1, stages, median_ms(launch, 9, 2))
            # Plain loads, one block an SM (shared memory keeps a second one off).
            shared = 120 << 10
            loads.max_dynamic_shared_size_bytes = shared
            launch = lambda: loads((blocks,), (256,), (buffer, np.uint64(region // 16), np.uint64(offset // 16),
                                                        np.int64(per_block // 16), sink), shared_mem=shared)
            report("loads", source, blocks, 1, 0, median_ms(launch, 9, 2))


if __name__ == "__main__":
    main()
