"""Where a decode step spends its time, one JSON line per geometry.

  * per-kernel GPU time of an eager step (CUDA events around every launch, 20 steps averaged);
  * the captured graph replayed back to back with no Python in between: the GPU time of one
    step, and its roofline ratio against the copy bandwidth measured in the same run;
  * the public call (input copy, replay, output copy) issued back to back, 200 calls between
    two events: what a decode loop that does not synchronise every token pays per call.
Each geometry runs twice: the fused decode step (the default) and the separate kernels
(layer.fused_decode = False), in the same process.

    PYTHONPATH=. python benchmarks/decode_breakdown.py [glm kimi]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def back_to_back_us(fn, calls: int = 200) -> float:
    from glm_kda.selftest import back_to_back_ms

    return 1e3 * back_to_back_ms(fn, calls)


def main(geometries: list[str]) -> None:
    import cupy

    from glm_kda import kernels
    from glm_kda.selftest import state_bytes, weight_bytes
    from glm_kda.layer import KdaLayer, to_device_bf16
    from glm_kda.selftest import copy_bandwidth_gbs
    from glm_kda.synthetic import synthetic_hidden, write_synthetic_checkpoint

    bandwidth = copy_bandwidth_gbs()
    with tempfile.TemporaryDirectory() as tmp:
        for geometry in geometries:
            path = write_synthetic_checkpoint(Path(tmp) / geometry, geometry, num_layers=1)
            layer = KdaLayer.from_pretrained(path, 0, max_tokens=64, progress=False)
            cfg = layer.config
            hidden = to_device_bf16(synthetic_hidden(1, cfg.hidden))
            state = layer.new_state()
            for fused in (True, False):
                layer.fused_decode = fused
                for _ in range(3):
                    layer.decode(hidden, state)  # eager, capture, replay
                with kernels.timing() as timer:
                    for _ in range(20):
                        layer.decode(hidden, state)
                per_kernel = {name: 1e3 * ms / 20 for name, ms in timer.summary().items()}
                graph = layer._graphs.last_graph
                stream = cupy.cuda.get_current_stream()
                replay_us = back_to_back_us(lambda: graph.launch(stream))
                call_us = back_to_back_us(lambda: layer.decode(hidden, state))
                nbytes = weight_bytes(cfg) + state_bytes(cfg)
                print(json.dumps({
                    "geometry": geometry, "fused_decode": fused, "copy_bandwidth_GBs": bandwidth, "bytes": nbytes,
                    "graph_replay_us": replay_us, "graph_replay_roofline_ratio": nbytes / 1e3 / bandwidth / replay_us,
                    "public_call_back_to_back_us": call_us, "eager_per_kernel_us": per_kernel,
                }), flush=True)
            layer.fused_decode = True


if __name__ == "__main__":
    main(sys.argv[1:] or ["glm", "kimi"])
