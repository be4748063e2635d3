"""One decode step (eager, B=1) or one prefill, bracketed by cudaProfilerStart/Stop, for
Nsight Compute: every kernel of the step and nothing of the set-up.

    ncu --clock-control none --profile-from-start off --csv \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size \
        python benchmarks/profile_kernels.py decode glm
    python benchmarks/profile_kernels.py prefill glm 16384
    python benchmarks/profile_kernels.py decode glm 64     # 64 sequences of a StatePool

Geometries as in glm_kda.bench_prefill (glm, kimi, kimi-bounded).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from glm_kda.cli import script_help
from glm_kda.device import exit_unless_gpu


def main(kind: str, geometry: str, tokens: int) -> None:
    import cupy
    import numpy as np

    from glm_kda.bench_prefill import geometry_config
    from glm_kda.checkpoint import bind_layer
    from glm_kda.gpu.layer import KdaLayer, KdaWorkspace, to_device_bf16
    from glm_kda.state import StatePool
    from glm_kda.synthetic import synthetic_hidden, write_synthetic_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = write_synthetic_checkpoint(Path(tmp) / geometry, geometry_config(geometry), num_layers=1)
        bound = bind_layer(path, 0, progress=False)
    layer = KdaLayer(bound, workspace=KdaWorkspace(bound.config, max(tokens, 16)))
    layer.use_graphs = False
    hidden = to_device_bf16(synthetic_hidden(max(tokens, 1), bound.config.hidden, seed=3))
    state = layer.new_state()
    if kind == "prefill":
        step = lambda: layer.prefill(hidden[:tokens], state)  # noqa: E731
    elif tokens == 1:
        step = lambda: layer.decode(hidden[:1], state)  # noqa: E731
    else:
        # Batched decode: `tokens` sequences of a pool, one token each, slots shuffled.
        pool = StatePool(bound.config, tokens)
        slots = cupy.asarray(np.random.default_rng(0).permutation(tokens).astype(np.int32))
        step = lambda: layer.decode(hidden[:tokens], pool, slots)  # noqa: E731
    for _ in range(3):
        step()
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    step()
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.stop()


if __name__ == "__main__":
    script_help(__doc__)
    if len(sys.argv) < 3 or sys.argv[1] not in ("decode", "prefill"):
        sys.exit(__doc__)
    exit_unless_gpu("the kernel profile")
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
