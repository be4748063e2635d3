"""First use on a fresh machine: KdaLayer.from_pretrained in a new process with empty kernel caches
(cold: every kernel file compiled), then again with the caches it filled (warm), and the import of
glm_kda alone. Each run is its own process; the checkpoint (written first, not timed) is a synthetic
one-layer checkpoint of the geometry. One JSON line per geometry: the medians of --runs runs.

    PYTHONPATH=. python benchmarks/cold_start.py [--geometry glm kimi] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.script import exit_unless_gpu  # noqa: E402

# What one measured process runs: seconds for the import, for from_pretrained (bind, upload, kernels
# compiled or loaded from the caches) and for both, printed as one JSON object.
_CHILD = """
import json, sys, time
start = time.perf_counter()
import cupy
from glm_kda import KdaLayer
imported = time.perf_counter()
layer = KdaLayer.from_pretrained(sys.argv[1], 0, max_tokens=64, progress=False)
cupy.cuda.Device().synchronize()
done = time.perf_counter()
print(json.dumps({"import_s": imported - start, "from_pretrained_s": done - imported, "total_s": done - start}))
"""


def one_run(checkpoint: Path, caches: Path) -> dict:
    env = dict(os.environ, CUPY_CACHE_DIR=str(caches / "cupy"), GLM_KDA_CUBIN_CACHE=str(caches / "cubin"))
    done = subprocess.run([sys.executable, "-c", _CHILD, str(checkpoint)], capture_output=True, text=True, env=env,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the measured process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", nargs="+", default=["glm", "kimi"], choices=["glm", "kimi", "tiny-glm", "tiny-kimi"])
    parser.add_argument("--runs", type=int, default=3, help="cold and warm runs each (>= 1)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    exit_unless_gpu("the cold-start benchmark")
    from glm_kda.synthetic import write_synthetic_checkpoint

    with tempfile.TemporaryDirectory(prefix="glm_kda_cold_") as folder:
        for geometry in args.geometry:
            checkpoint = write_synthetic_checkpoint(Path(folder) / geometry, geometry, num_layers=1)
            cold, warm = [], []
            for run in range(args.runs):
                caches = Path(folder) / f"caches-{geometry}-{run}"
                cold.append(one_run(checkpoint, caches))  # empty caches: every kernel file compiled
                warm.append(one_run(checkpoint, caches))  # the caches the cold run filled
            row = {"case": "from_pretrained", "geometry": geometry, "runs": args.runs, "cpu_count": os.cpu_count()}
            for name, runs in (("cold", cold), ("warm", warm)):
                for key in ("import_s", "from_pretrained_s", "total_s"):
                    row[f"{name}_{key}"] = float(np.median([r[key] for r in runs]))
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
