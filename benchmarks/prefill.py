"""Prefill timings (whole block and KDA core, tensor-core and FP32 chunk kernels, and
flash-linear-attention in the same run when importable): see glm_kda/bench_prefill.py.

    PYTHONPATH=. python benchmarks/prefill.py [--geometry glm kimi-bounded] [--tokens 1024 4096 16384 65536]
"""

import sys

from glm_kda import bench_prefill
from glm_kda.cli import bench_script

if __name__ == "__main__":
    sys.exit(bench_script(bench_prefill, "the prefill benchmark"))
