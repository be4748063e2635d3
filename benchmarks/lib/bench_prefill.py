"""Prefill timings: the whole block and the KDA core alone, per chunk implementation.

One JSON line per case: geometry, impl ("tensor": the TF32 tensor-core chunk kernels, "fp32":
the FP32 reference kernels), T, median µs over CUDA events after warm-up, Mtok/s and achieved
TFLOP/s (the FLOP count of :func:`block_flops` / :func:`core_flops`). "core" is conv output to
core output: forget gate + beta and the chunked delta rule (what flash-linear-attention's
chunk_kda computes from the same inputs with its in-kernel gate and beta; its in-kernel L2
norm is fused into our conv pass, so our "core" leaves it out). "core_conv" adds the conv
(+ SiLU + L2 + split) pass: projection output to core output.

Geometries: "glm" (hidden 4096, 64 heads, bounded gate -5), "kimi" (hidden 2304, 32 heads,
softplus law: FP32 kernels only) and "kimi-bounded" (Kimi's shapes with the bounded gate -5, the
law flash-linear-attention's safe-gate chunk path is measured with). When
flash-linear-attention is importable, its chunk_kda and KimiDeltaAttention layer run on the
same shapes and weights in the same process (bench_fla.bench_fla_prefill).

    glm-kda bench prefill [--geometry glm kimi-bounded] [--tokens 1024 4096 16384 65536]
    PYTHONPATH=. python benchmarks/prefill.py (the same)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from .config import KdaConfig

PREFILL_GEOMETRIES = ("glm", "kimi", "kimi-bounded")
PREFILL_TOKENS = (1024, 4096, 16384, 65536)
# The FP32 reference kernels run ~0.1 Mtok/s: timing them past this many tokens costs seconds.
FP32_MAX_TOKENS = 4096


def geometry_config(geometry: str) -> KdaConfig:
    """The synthetic KdaConfig of a benchmark geometry (see PREFILL_GEOMETRIES)."""
    from .config import GATE_BOUNDED
    from .synthetic import synthetic_config

    if geometry == "kimi-bounded":
        return dataclasses.replace(synthetic_config("kimi", 1), gate_law=GATE_BOUNDED, gate_lower_bound=-5.0,
                                   model_type="")
    if geometry in ("glm", "kimi"):
        return synthetic_config(geometry, 1)
    raise ValueError(f"geometry must be one of {PREFILL_GEOMETRIES}, got {geometry!r}")


def core_flops(config: KdaConfig, tokens: int) -> int:
    """Matrix-product FLOPs of the chunked delta rule over `tokens` (C = chunk, D = head_dim),
    per token and head: the decay-weighted K K^T and Q K^T (2 * 2CD), W and U (2 * 2CD), the
    unit-triangular inverse (~C^2 / 3 * 2), and the state terms q S, w S, k^T v (3 * 2D^2)."""
    c, d = config.chunk, config.head_dim
    per_token_head = 8 * c * d + (2 * c * c) // 3 + 6 * d * d
    return tokens * config.heads * per_token_head


def block_flops(config: KdaConfig, tokens: int) -> int:
    """core_flops plus the projections: 2 * T * (hidden * (3qkv + 2D + H) + 2 * D * qkv + qkv * hidden)."""
    c = config
    projection = 2 * tokens * (c.hidden * (c.conv_dim + c.down_dim) + 2 * c.head_dim * c.qkv + c.qkv * c.hidden)
    return projection + core_flops(config, tokens)


def bench_geometry(geometry: str, directory: Path, tokens: tuple[int, ...], repeats: int,
                   gate_kernel: bool = False) -> list[dict]:
    import cupy

    from . import chunk_tc, kernels
    from .checkpoint import bind_layer
    from .layer import KdaLayer, KdaWorkspace, to_device_bf16
    from .selftest import median_ms
    from .synthetic import synthetic_hidden, write_synthetic_checkpoint

    config = geometry_config(geometry)
    path = write_synthetic_checkpoint(directory / geometry, config, num_layers=1)
    bound = bind_layer(path, 0, progress=False)
    layer = KdaLayer(bound, workspace=KdaWorkspace(bound.config, max(tokens)))
    hidden = to_device_bf16(synthetic_hidden(max(tokens), config.hidden, seed=3))
    # "tensor": the default, the prepare forming the gate itself (KdaLayer.fused_gate);
    # "tensor-gate-kernel": the gate kernel and the plain prepare, with --gate-kernel.
    # The softplus law's "tensor" is the unbounded prepare fed by the gate kernel.
    fused = chunk_tc.prepare_lower_bound(config) is not None
    impls = ["fp32", "tensor"] + (["tensor-gate-kernel"] if gate_kernel and fused else [])
    rows = []
    for impl in impls:
        layer.chunk_impl = impl.split("-")[0]
        layer.fused_gate = impl != "tensor-gate-kernel"
        for count in tokens:
            if impl == "fp32" and count > FP32_MAX_TOKENS:
                continue
            state = layer.new_state()
            reps = repeats if count <= 16384 else max(2, repeats // 2)
            block_ms = median_ms(lambda: layer.prefill(hidden[:count], state), repeats=reps, warmup=2)

            core_ms = median_ms(lambda: layer.chunk_core(count, state.recurrent), repeats=reps, warmup=2)
            core_conv_ms = median_ms(lambda: layer.prefill_core(count, state.conv, state.recurrent), repeats=reps,
                                     warmup=2)
            if count == 16384:
                with kernels.timing() as timer:
                    layer.prefill(hidden[:count], state)
                breakdown = {"impl": f"glm_kda-{impl}", "case": "block_kernels", "geometry": geometry, "T": count,
                             "total_ms": {name: round(ms, 4) for name, ms in timer.summary().items()}}
                print(json.dumps(breakdown), flush=True)
            for case, ms, flops in (("block", block_ms, block_flops(config, count)),
                                    ("core", core_ms, core_flops(config, count)),
                                    ("core_conv", core_conv_ms, core_flops(config, count))):
                row = {"impl": f"glm_kda-{impl}", "case": case, "geometry": geometry, "T": count,
                       "median_us": 1e3 * ms, "Mtok_s": count / (1e3 * ms), "TFLOP_s": flops / 1e9 / ms}
                rows.append(row)
                print(json.dumps(row), flush=True)
    del layer, hidden
    cupy.get_default_memory_pool().free_all_blocks()
    return rows


def bench_fla(geometry: str, directory: Path, tokens: tuple[int, ...], repeats: int) -> list[dict]:
    """flash-linear-attention's layer and chunk_kda on the same checkpoint (same run)."""
    import torch

    from .bench_fla import bench_fla_prefill
    from .checkpoint import bind_layer

    bound = bind_layer(directory / geometry, 0, progress=False)
    rows = []
    for row in bench_fla_prefill(bound, tokens, repeats=repeats):
        flops = (block_flops if row["case"] == "prefill" else core_flops)(bound.config, row["T"])
        row.update(geometry=geometry, case="block" if row["case"] == "prefill" else "core",
                   fla_case=row["case"], TFLOP_s=flops / 1e6 / row["median_us"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", nargs="+", default=list(PREFILL_GEOMETRIES), choices=list(PREFILL_GEOMETRIES))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(PREFILL_TOKENS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-fla", dest="fla", action="store_false", help="skip the flash-linear-attention rows")
    parser.add_argument("--gate-kernel", action="store_true",
                        help="also time the tensor-core path with the gate kernel and the plain prepare")


def run(args: argparse.Namespace) -> int:
    from .bench_fla import comparison_note
    from .device import require_gpu

    require_gpu("the prefill benchmark")
    tokens = tuple(args.tokens)
    fla_ok, note = comparison_note(args.fla)
    print(json.dumps(note), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for geometry in args.geometry:
            bench_geometry(geometry, Path(tmp), tokens, args.repeats, args.gate_kernel)
            if fla_ok and geometry != "kimi":
                bench_fla(geometry, Path(tmp), tokens, args.repeats)
    return 0
