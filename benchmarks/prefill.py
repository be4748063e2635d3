"""Prefill timings (whole block and KDA core, tensor-core and FP32 chunk kernels, and
flash-linear-attention in the same run when importable): see benchmarks/lib/bench_prefill.py.

One JSON line per case; the block lines carry their roofline (bytes moved / copy bandwidth
measured in the same run) beside Mtok/s and TFLOP/s.

    PYTHONPATH=. python benchmarks/prefill.py [--geometry glm kimi-bounded] [--tokens 1024 4096 16384 65536]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib import bench_prefill  # noqa: E402

if __name__ == "__main__":
    from lib.script import bench_main

    bench_main(bench_prefill, __doc__, "the prefill benchmark")
