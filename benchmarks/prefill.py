"""Prefill timings (whole block and KDA core, tensor-core and FP32 chunk kernels, and
flash-linear-attention in the same run when importable): see glm_kda/bench_prefill.py.

    PYTHONPATH=. python benchmarks/prefill.py [--geometry glm kimi-bounded] [--tokens 1024 4096 16384 65536]
"""

import argparse
import sys

from glm_kda import bench_prefill
from glm_kda.device import exit_unless_gpu

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=bench_prefill.__doc__.splitlines()[0])
    bench_prefill.add_arguments(parser)
    arguments = parser.parse_args()
    exit_unless_gpu("the prefill benchmark")
    sys.exit(bench_prefill.run(arguments))
