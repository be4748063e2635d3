"""Same-run comparison with flash-linear-attention: see benchmarks/lib/bench_fla.py.

One JSON line per case (fla's layer: decode graph/eager, prefill, chunk_kda alone; and ours in
the same process), glm and kimi geometry on synthetic checkpoints, with the device-to-device
copy bandwidth measured in the same run and each decode and prefill line's roofline ratio.
Without fla (or torch, or a GPU) it prints one note saying why and exits 0.

    PYTHONPATH=. python benchmarks/fla_compare.py [--geometry glm kimi] [--repeats 200] [--no-ours]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib import bench_fla  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=bench_fla.__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_fla.add_arguments(parser)
    sys.exit(bench_fla.run(parser.parse_args()))
