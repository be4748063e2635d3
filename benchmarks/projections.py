"""The prefill's wide projections through the package's cuBLAS call and through torch, one JSON line each.

A prefill of T rows runs five wide projections on cuBLAS (`ops.gemm_bf16_cublas`: BF16 in and out,
FP32 compute): q|k|v and the low-rank chain's down projection from the hidden rows, the forget gate's
and the output gate's up projections from column slices of the down projection's rows, and o_proj.
For each geometry (`synthetic_config`) and T this times each of them as the layer calls it (the same
shapes and row strides) and, where torch is importable, `torch.nn.functional.linear` on contiguous
tensors of the same shapes in the same process: median milliseconds of --repeats calls after warm-up,
each between CUDA events, and TFLOP/s. `ratio` is ours over torch's (above 1: ours is slower). The
projections are over half of GLM-5.3-Flash's long prefill and about 40 % of Kimi-Linear's, so a ratio
above 1 is time the block gives away.

    PYTHONPATH=. python benchmarks/projections.py [--geometry glm kimi] [--tokens 16384] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.launches import random_bf16  # noqa: E402
from lib.timing import median_ms, torch_events  # noqa: E402

_GEOMETRIES = ("glm", "kimi")


def _shapes(config) -> list[tuple[str, int, int, tuple[int, int] | None]]:
    """(name, k, n, the column slice of the down projection's rows it reads or None) of each wide
    projection of a prefill."""
    d, down = config.head_dim, config.down_dim
    return [("qkv", config.hidden, 3 * config.qkv, None), ("down", config.hidden, down, None),
            ("forget_up", d, config.qkv, (0, d)), ("gate_up", d, config.qkv, (d, 2 * d)),
            ("o_proj", config.qkv, config.hidden, None)]


def _torch_ms(tokens: int, k: int, n: int, repeats: int) -> float | None:
    """Median milliseconds of torch.nn.functional.linear on BF16 [T, k] x [n, k], or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return median_ms(lambda: torch.nn.functional.linear(x, w), repeats, **torch_events())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", nargs="+", default=list(_GEOMETRIES), choices=_GEOMETRIES)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from lib.script import exit_unless_gpu

    exit_unless_gpu("the projections benchmark")
    import cupy

    from glm_kda.gpu.arrays import bf16_dtype
    from glm_kda.gpu.ops import gemm_bf16_cublas
    from glm_kda.synthetic import synthetic_config

    rng = cupy.random.default_rng(0)

    for geometry in args.geometry:
        config = synthetic_config(geometry, 1)
        for tokens in args.tokens:
            down_rows = random_bf16(rng, (tokens, config.down_dim))
            for name, k, n, columns in _shapes(config):
                x = random_bf16(rng, (tokens, k)) if columns is None else down_rows[:, columns[0] : columns[1]]
                w, out = random_bf16(rng, (n, k)), cupy.empty((tokens, n), bf16_dtype())
                flop = 2 * tokens * k * n
                ours = median_ms(lambda: gemm_bf16_cublas(x, w, out), args.repeats)
                row = {"geometry": geometry, "T": tokens, "projection": name, "k": k, "n": n,
                       "ours_ms": ours, "ours_TFLOP_s": flop / ours / 1e9}
                theirs = _torch_ms(tokens, k, n, args.repeats)
                if theirs is not None:
                    row.update(torch_ms=theirs, torch_TFLOP_s=flop / theirs / 1e9, ratio=ours / theirs)
                print(json.dumps(row), flush=True)
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
