"""Same-run comparison with flash-linear-attention: see glm_kda/bench_fla.py.

One JSON line per case (fla's layer: decode graph/eager, prefill, chunk_kda alone; and ours in
the same process), glm and kimi geometry on synthetic checkpoints, with the device-to-device
copy bandwidth measured in the same run. Without fla (or torch, or a GPU) it prints one note
saying why and exits 0.

    PYTHONPATH=. python benchmarks/fla_compare.py [--geometry glm kimi] [--repeats 200] [--no-ours]
"""

import argparse
import sys

from glm_kda import bench_fla

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=bench_fla.__doc__.splitlines()[0])
    bench_fla.add_arguments(parser)
    sys.exit(bench_fla.run(parser.parse_args()))
