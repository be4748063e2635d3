"""Prefill timings: the whole block and the KDA core alone, per chunk implementation.

One JSON line per case: geometry, impl ("tensor": the TF32 tensor-core chunk kernels, "fp32":
the FP32 reference kernels; KdaOptions.chunk_impl), T, median µs over CUDA events after warm-up,
Mtok/s and achieved TFLOP/s (the FLOP count of :func:`block_flops` / :func:`core_flops`). Block
lines also carry the copy bandwidth measured in the same run and their roofline ratio (the fewest
bytes a prefill moves, timing.prefill_bytes, at that bandwidth, over the time: far below 1, the
prefill is bound by its arithmetic). "core" is conv output to core output: forget gate + beta and
the chunked delta rule (what flash-linear-attention's chunk_kda computes from the same inputs with
its in-kernel gate and beta; its in-kernel L2 norm is fused into our conv pass, so our "core"
leaves it out). "core_norm" is conv output to o_proj input, "core" and the gated RMSNorm kernel
(against chunk_kda followed by fla's own gated norm). "core_conv" adds the conv (+ SiLU + L2 +
split) pass to "core": projection output to core output. They come from the layer's own timer
(layer.timing(): a pair of CUDA events around each launch and each stage, the calls eager):
"core_conv" is the "[recurrence]" stage of a prefill, "core" that less its conv kernel,
"core_norm" that plus the norm kernel, each the median over as many timed prefills as the block's.
At T >= 16384 a "block_kernels" line gives every kernel's and stage's milliseconds.

Geometries: "glm" (hidden 4096, 64 heads, bounded gate -5), "kimi" (hidden 2304, 32 heads,
softplus law) and "kimi-bounded" (Kimi's shapes with the bounded gate -5, the law
flash-linear-attention's safe-gate chunk path is measured with). When flash-linear-attention is
importable, its chunk_kda and KimiDeltaAttention layer run on the same shapes and weights in the
same process (bench_fla.bench_fla_prefill); at T = 16384 "prefill_kernels" and "chunk_kda_norm_kernels"
lines give the GPU milliseconds by kernel (torch.profiler) of its layer and of chunk_kda with the norm,
and a "middle_kernels" line sets our middle's kernels (conv pass to gated norm) beside the kernels of
fla's layer that are not cuBLAS's, kernel time against kernel time (:func:`middle_against_fla`).

    PYTHONPATH=. python benchmarks/prefill.py [--geometry glm kimi-bounded] [--tokens 1024 4096 16384 65536]
        [--variant hopper=False]
    glm-kda bench prefill ... (the same, from a source checkout)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tempfile
from pathlib import Path

from glm_kda.config import KdaConfig

from .layers import make_layer, parse_options, with_options
from .timing import copy_bandwidth_gbs, median_ms, prefill_bytes, roofline

PREFILL_GEOMETRIES = ("glm", "kimi", "kimi-bounded")
PREFILL_TOKENS = (1024, 4096, 16384, 65536)
# The FP32 reference kernels run ~0.1 Mtok/s: timing them past this many tokens costs seconds.
FP32_MAX_TOKENS = 4096
# The layer timer's name of a prefill's stateful middle (conv, gate and beta, chunked delta rule),
# and of its conv kernel.
RECURRENCE = "[recurrence]"
CONV_KERNEL = "kda_conv_prefill_silu_l2_bf16"
# The gated RMSNorm kernel of the back end.
NORM_KERNEL = "kda_gated_rmsnorm_sigmoid_bf16"
# cuBLAS's kernels by name (Hopper's nvjet, the older gemm / xmma / cutlass kernels): the projections.
_GEMM_KERNEL = re.compile(r"nvjet|gemm|xmma|cutlass", re.IGNORECASE)


def kernel_bytes(config: KdaConfig, tokens: int, record: bool = False) -> dict[str, int]:
    """The bytes each of our prefill kernels of the tensor-core path must move for `tokens` rows:
    every buffer it reads or writes once, as its arguments say (ops and gpu.pipeline._prefill_core);
    the conv weights and state, dt_bias, A_log and the recurrent state, under 1 % of any, left out.
    record: the stage buffers no kernel reads written too (KdaOptions.stage_buffers). The cuBLAS
    projections are bound by arithmetic, not counted here."""
    from glm_kda.chunk_model import prepare_lower_bound

    t, qkv, heads = tokens, config.qkv, config.heads
    chunks = -(-tokens // 64)
    bf16_rows, f32_rows, f16_rows = 2 * t * qkv, 4 * t * qkv, 2 * t * qkv  # one [T, H*D] buffer of each kind
    beta_f32, beta_logits = 4 * t * heads, 2 * t * heads
    attn_f16, chunk_decay = chunks * heads * 64 * 64 * 2, chunks * qkv * 4
    # q_decay, k_tail, W (FP16), U (FP32), attn (FP16), the chunk decay: the prepare's writes, the scan's reads.
    prepared = 3 * f16_rows + f32_rows + attn_f16 + chunk_decay
    moved = {
        # qkv_proj in; conv_out (BF16, recorded) and q, k, v (FP32) out.
        "kda_conv_prefill_silu_l2_bf16": 3 * bf16_rows + 3 * bf16_rows * record + 3 * f32_rows,
        "kda_chunk_tc_scan_f32": prepared + f32_rows,  # core out
        "kda_gated_rmsnorm_sigmoid_bf16": f32_rows + 2 * bf16_rows,  # core, out_gate in; o_norm_out out
    }
    # The prepare forms the gate and beta from the projections and writes them out (the bounded prepare,
    # or the unbounded one by the softplus law); a bound the bounded prepare does not take: the gate kernel,
    # then the unbounded prepare reading its output.
    forming = 3 * f32_rows + bf16_rows + beta_logits + f32_rows * record + beta_f32 + prepared
    if prepare_lower_bound(config) is not None:
        moved["kda_chunk_tc_prepare_gate_f32"] = forming
    elif not config.bounded:
        moved["kda_chunk_tc_prepare_unbounded_gate_f32"] = forming
    else:
        moved["kda_gate_beta_f32"] = bf16_rows + beta_logits + f32_rows + beta_f32
        moved["kda_chunk_tc_prepare_unbounded_f32"] = 3 * f32_rows + f32_rows + beta_f32 + prepared
    return moved


def geometry_config(geometry: str) -> KdaConfig:
    """The synthetic KdaConfig of a benchmark geometry (see PREFILL_GEOMETRIES)."""
    from glm_kda.config import GATE_BOUNDED
    from glm_kda.synthetic import synthetic_config

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


def bench_geometry(geometry: str, directory: Path, tokens: tuple[int, ...], repeats: int, bandwidth: float,
                   changed: dict | None = None, workspace_rows: int | None = None) -> list[dict]:
    """The prefill cases of one geometry with the KdaOptions fields `changed` over the defaults,
    for each chunk implementation, through a workspace of the longest T's rows or of `workspace_rows`
    (longer prefills in segments)."""
    import numpy as np

    from glm_kda.gpu.arrays import to_device_bf16
    from glm_kda.options import KdaOptions
    from glm_kda.synthetic import synthetic_hidden

    config = geometry_config(geometry)
    layer = make_layer(directory, config, max(tokens), name=geometry, own_workspace=True,
                       workspace_rows=workspace_rows, options=KdaOptions(**(changed or {})))
    print(json.dumps({"case": "workspace", "geometry": geometry, "max_tokens": max(tokens),
                      "rows": layer.workspace.max_tokens, "middle_rows": layer.workspace.middle_rows,
                      "bytes": layer.workspace.nbytes}), flush=True)
    hidden = to_device_bf16(synthetic_hidden(max(tokens), config.hidden, seed=3))
    rows = []
    for impl in ("fp32", "tensor"):
        with_options(layer, chunk_impl=impl)
        for count in tokens:
            if impl == "fp32" and count > FP32_MAX_TOKENS:
                continue
            state = layer.new_state()
            reps = repeats if count <= 16384 else max(2, repeats // 2)
            block_ms = median_ms(lambda: layer.prefill(hidden[:count], state), repeats=reps, warmup=2)
            stages = []
            for _ in range(reps):
                with layer.timing() as timer:
                    layer.prefill(hidden[:count], state)
                stages.append(timer.summary())
            core_conv_ms = float(np.median([timed[RECURRENCE] for timed in stages]))
            cores = [timed[RECURRENCE] - timed.get(CONV_KERNEL, 0.0) for timed in stages]
            core_ms = float(np.median(cores))
            # conv output to o_proj input: core and the gated RMSNorm
            core_norm_ms = float(np.median([core + timed.get(NORM_KERNEL, 0.0) for core, timed in zip(cores, stages)]))
            if count >= 16384:
                breakdown = {"impl": f"glm_kda-{impl}", "case": "block_kernels", "geometry": geometry, "T": count,
                             "options": changed or {},
                             "workspace_rows": layer.workspace.max_tokens,
                             "total_ms": {name: round(ms, 4) for name, ms in stages[-1].items()}}
                if impl == "tensor":  # each kernel's bytes and its share of the copy bandwidth, same run
                    moved = kernel_bytes(config, count, layer.options.stage_buffers)
                    breakdown.update(bytes=moved, copy_bandwidth_GBs=bandwidth,
                                     copy_fraction={name: nbytes / 1e6 / stages[-1][name] / bandwidth
                                                    for name, nbytes in moved.items() if stages[-1].get(name)})
                print(json.dumps(breakdown), flush=True)
                rows.append(breakdown)
            for case, ms, flops in (("block", block_ms, block_flops(config, count)),
                                    ("core", core_ms, core_flops(config, count)),
                                    ("core_norm", core_norm_ms, core_flops(config, count)),
                                    ("core_conv", core_conv_ms, core_flops(config, count))):
                row = {"impl": f"glm_kda-{impl}", "case": case, "geometry": geometry, "T": count,
                       "options": changed or {}, "workspace_rows": layer.workspace.max_tokens,
                       "median_us": 1e3 * ms, "Mtok_s": count / (1e3 * ms),
                       "TFLOP_s": flops / 1e9 / ms, "copy_bandwidth_GBs": bandwidth}
                if case == "block":
                    nbytes = prefill_bytes(config, count)
                    row.update(bytes=nbytes, roofline_us=nbytes / 1e3 / bandwidth,
                               roofline_ratio=roofline(nbytes, bandwidth, 1e3 * ms))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def middle_against_fla(rows: list[dict]) -> dict | None:
    """Our prefill's middle against fla's layer at the T both broke down by kernel, from one run's rows:
    the sum of our kda_ kernels in the tensor-core path's default "block_kernels" line (conv pass,
    prepare, scan, gated norm: everything but the cuBLAS projections) against the sum of the kernels
    of fla's "prefill_kernels" line that are not cuBLAS's (its conv, l2norm, gate, chunk kernels, norm
    and fills); "ratio" is fla's over ours (above 1: ours is faster). "fla_gpu_busy" is fla's kernel sum
    over its median call: well under 1, its calls waited on the host's launches, and a block ratio of
    that run measures the host. None when either breakdown is missing."""
    # The first such pair: the default options through the layer's own workspace (run() times that first).
    pairs = ((ours, fla) for ours in rows
             if ours.get("case") == "block_kernels" and ours.get("impl") == "glm_kda-tensor" and not ours.get("options")
             for fla in rows if fla.get("case") == "prefill_kernels" and fla["T"] == ours["T"])
    ours, fla = next(pairs, (None, None))
    if fla is None:
        return None
    fla_block = next((row for row in rows if row.get("impl") == "fla" and row.get("fla_case") == "prefill"
                      and row["T"] == fla["T"]), None)
    ours_ms = sum(ms for name, ms in ours["total_ms"].items() if name.startswith("kda_"))
    gemm_ms = sum(ms for name, ms in fla["kernel_ms"].items() if _GEMM_KERNEL.search(name))
    fla_ms = fla["kernel_total_ms"] - gemm_ms
    row = {"impl": "comparison", "case": "middle_kernels", "geometry": ours["geometry"], "T": ours["T"],
           "ours_ms": ours_ms, "fla_ms": fla_ms, "ratio": fla_ms / ours_ms, "fla_gemm_ms": gemm_ms}
    if fla_block is not None:
        row["fla_gpu_busy"] = fla["kernel_total_ms"] / (fla_block["median_us"] / 1e3)
    return row


# fla's cases as ours: its layer is the block, chunk_kda the core, chunk_kda and the layer's gated norm core_norm.
_FLA_CASES = {"prefill": "block", "chunk_kda": "core", "chunk_kda_norm": "core_norm"}


def bench_fla(geometry: str, directory: Path, tokens: tuple[int, ...], repeats: int) -> list[dict]:
    """flash-linear-attention's layer and chunk_kda on the same checkpoint (same run)."""
    import torch

    from glm_kda.checkpoint import bind_layer

    from .bench_fla import bench_fla_prefill

    bound = bind_layer(directory / geometry, 0, progress=False)
    rows = []
    for row in bench_fla_prefill(bound, tokens, repeats=repeats):
        if row["case"].endswith("_kernels"):  # a call of fla's by kernel: no case of ours to set it beside
            row.update(geometry=geometry)
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        flops = (block_flops if row["case"] == "prefill" else core_flops)(bound.config, row["T"])
        row.update(geometry=geometry, case=_FLA_CASES[row["case"]],
                   fla_case=row["case"], TFLOP_s=flops / 1e6 / row["median_us"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    torch.cuda.empty_cache()
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", nargs="+", default=list(PREFILL_GEOMETRIES), choices=list(PREFILL_GEOMETRIES))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(PREFILL_TOKENS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variant", type=parse_options, action="append", default=[], metavar="NAME=VALUE[,...]",
                        help="also run every case with these KdaOptions fields changed (repeatable)")
    parser.add_argument("--no-fla", dest="fla", action="store_false", help="skip the flash-linear-attention rows")
    parser.add_argument("--segments", type=int, metavar="ROWS",
                        help="also run every case through a workspace of ROWS rows (longer prefills in segments)")


def run(args: argparse.Namespace) -> int:
    import cupy

    from .bench_fla import comparison_note

    tokens = tuple(args.tokens)
    bandwidth = copy_bandwidth_gbs()
    fla_ok, note = comparison_note(args.fla)
    print(json.dumps({**note, "copy_bandwidth_GBs": bandwidth}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for geometry in args.geometry:
            rows = []
            for changed in ({}, *args.variant):
                for workspace_rows in (None, args.segments) if args.segments else (None,):
                    rows += bench_geometry(geometry, Path(tmp), tokens, args.repeats, bandwidth, changed,
                                           workspace_rows)
                    cupy.get_default_memory_pool().free_all_blocks()  # the layer's own workspace goes
            if fla_ok and geometry != "kimi":
                middle = middle_against_fla(rows + bench_fla(geometry, Path(tmp), tokens, args.repeats))
                if middle is not None:
                    print(json.dumps(middle), flush=True)
    return 0
