"""Decode-side timings (batched decode, verify, graph vs eager): see benchmarks/lib/bench_decode.py.

One JSON line per case, each with its roofline (bytes moved / copy bandwidth measured in the same run).

    PYTHONPATH=. python benchmarks/decode.py [--geometry glm kimi] [--repeats 200] [--variant hopper=False]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib import bench_decode  # noqa: E402

if __name__ == "__main__":
    from lib.script import bench_main

    bench_main(bench_decode, __doc__, "the decode benchmark")
