"""Whole-block timings on a GPU, one JSON line per geometry (what `glm-kda selftest` records).

Each line carries the device-to-device copy bandwidth measured in the same run and the decode
roofline ratio: (fewest bytes a decode token must move: weights once, state read + written)
/ copy bandwidth, over the measured median time. Decode and verify (K = 4, 16) through the
public calls, graphed (the default) and eager (KdaOptions.graphs=False), each call synchronised,
CUDA-event medians over 200 calls after warm-up; prefill at T = 1024, 4096, 16384 (median of 5).

    PYTHONPATH=. python benchmarks/block.py [glm kimi]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.timing import copy_bandwidth_gbs, decode_bytes, median_ms, prefill_bytes, roofline  # noqa: E402

GEOMETRIES = ("glm", "kimi")
PREFILL_TOKENS = (1024, 4096, 16384)


def block_timings(geometry: str, directory: Path, bandwidth: float) -> dict:
    from glm_kda.gpu.arrays import to_device_bf16
    from glm_kda.synthetic import synthetic_hidden

    from lib.layers import make_layer, with_options

    layer = make_layer(directory, geometry, max(PREFILL_TOKENS))
    cfg = layer.config
    hidden = to_device_bf16(synthetic_hidden(max(PREFILL_TOKENS), cfg.hidden))
    state = layer.new_state()
    nbytes = decode_bytes(cfg)
    result = {"geometry": geometry, "copy_bandwidth_GBs": bandwidth, "decode_bytes": nbytes,
              "decode_roofline_us": nbytes / 1e3 / bandwidth}
    for mode, graphs in (("graph", True), ("eager", False)):
        with_options(layer, graphs=graphs)
        decode_us = 1e3 * median_ms(lambda: layer.decode(hidden[:1], state), repeats=200, warmup=20)
        result[f"decode_{mode}_us"] = decode_us
        result[f"decode_{mode}_roofline_ratio"] = roofline(nbytes, bandwidth, decode_us)
        for k in (4, 16):
            verify_us = 1e3 * median_ms(lambda: layer.decode_k(hidden[:k], state), repeats=200, warmup=20)
            result[f"decode_k{k}_{mode}_us"] = verify_us
            result[f"decode_k{k}_{mode}_roofline_ratio"] = roofline(nbytes, bandwidth, verify_us)
    with_options(layer, graphs=True)
    for tokens in PREFILL_TOKENS:
        ms = median_ms(lambda: layer.prefill(hidden[:tokens], state), repeats=5, warmup=2)
        result[f"prefill_T{tokens}_ms"] = ms
        result[f"prefill_T{tokens}_Mtok_s"] = tokens / ms / 1e3
        result[f"prefill_T{tokens}_roofline_ratio"] = roofline(prefill_bytes(cfg, tokens), bandwidth, 1e3 * ms)
    return result


def main(geometries: list[str]) -> None:
    import cupy

    bandwidth = copy_bandwidth_gbs()
    with tempfile.TemporaryDirectory() as tmp:
        for geometry in geometries:
            print(json.dumps(block_timings(geometry, Path(tmp), bandwidth)), flush=True)
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    from lib.script import script_help
    from lib.script import exit_unless_gpu

    script_help(__doc__)
    unknown = sorted(set(sys.argv[1:]) - set(GEOMETRIES))
    if unknown:
        sys.exit(f"unknown geometry {', '.join(map(repr, unknown))} (choose from {', '.join(GEOMETRIES)})")
    exit_unless_gpu("the whole-block benchmark")
    main(sys.argv[1:] or list(GEOMETRIES))
