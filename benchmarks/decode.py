"""Decode-side timings (batched decode, verify, graph vs eager): see glm_kda/bench_decode.py.

    PYTHONPATH=. python benchmarks/decode.py [--geometry glm kimi] [--repeats 200]
"""

import sys

from glm_kda import bench_decode
from glm_kda.cli import bench_script

if __name__ == "__main__":
    sys.exit(bench_script(bench_decode, "the decode benchmark"))
