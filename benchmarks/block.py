"""Whole-block timings on a GPU, one JSON line per geometry.

Each line carries the device-to-device copy bandwidth measured in the same run and the decode
roofline ratio: (fewest bytes a decode token must move: weights once, state read + written)
/ copy bandwidth, over the measured median time. Eager launches, CUDA-event medians after
warm-up.

    PYTHONPATH=. python benchmarks/block.py [glm kimi]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from glm_kda.cli import script_help
from glm_kda.device import exit_unless_gpu
from glm_kda.selftest import block_timings, copy_bandwidth_gbs


def main(geometries: list[str]) -> None:
    bandwidth = copy_bandwidth_gbs()
    with tempfile.TemporaryDirectory() as tmp:
        for geometry in geometries:
            row = block_timings(geometry, Path(tmp), bandwidth)
            row["copy_bandwidth_GBs"] = bandwidth
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    script_help(__doc__)
    exit_unless_gpu("the whole-block benchmark")
    main(sys.argv[1:] or ["glm", "kimi"])
