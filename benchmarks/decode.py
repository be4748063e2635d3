"""Decode-side timings (batched decode, verify, graph vs eager): see glm_kda/bench_decode.py.

    PYTHONPATH=. python benchmarks/decode.py [--geometry glm kimi] [--repeats 200]
"""

import argparse
import sys

from glm_kda import bench_decode
from glm_kda.device import exit_unless_gpu

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=bench_decode.__doc__.splitlines()[0])
    bench_decode.add_arguments(parser)
    arguments = parser.parse_args()
    exit_unless_gpu("the decode benchmark")
    sys.exit(bench_decode.run(arguments))
