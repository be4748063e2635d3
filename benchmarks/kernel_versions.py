"""The prefill's kernels of two kernel folders side by side: bits and times, one JSON line each.

    PYTHONPATH=. python benchmarks/kernel_versions.py --old DIR [--new DIR] [--geometry glm kimi]
        [--tokens 4096 16384] [--repeats 30]

DIR is a `kernels_src` folder of another version (say `git archive <rev> kernels_src | tar -x -C
/tmp/old`, then --old /tmp/old/kernels_src); --new defaults to this checkout's. Each version's
conv pass (`kda_conv_prefill_silu_l2_bf16`), gated RMSNorm (`kda_gated_rmsnorm_sigmoid_bf16`), tensor-core
chunk prepare forming the gate (the model's gate law) and chunk scan is built by NVRTC from its own
folder and run on the same random inputs at the model's geometry (`synthetic_config`: heads, conv
kernel size, gate law, the two eps), with the grid and shared memory its folder's source names (the
tokens a block, the bytes, from its `#define`s). A line gives each version's median milliseconds over
--repeats launches (CUDA events, after warm-up), `ratio` new / old (below 1: the new one is faster),
each one's share of the copy bandwidth measured in the same run for the bytes the kernel must move
(lib/bench_prefill.kernel_bytes), and `same_bits`: whether every output byte (and the conv state)
agrees.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.bench_prefill import kernel_bytes  # noqa: E402
from lib.launches import random_bf16  # noqa: E402
from lib.timing import copy_bandwidth_gbs, median_ms  # noqa: E402

# The models whose geometry (glm_kda.synthetic.synthetic_config) the kernels run at.
_GEOMETRIES = ("glm", "kimi")


def _define(source: str, name: str) -> int:
    """The integer value of macro `name` of `source`: a literal, or arithmetic on other macros (expanded)."""
    defines = dict(re.findall(r"^#define (\w+) ((?:.*\\\n)*.*)$", source, flags=re.MULTILINE))

    def value(macro: str) -> int:
        text = defines[macro].replace("\\\n", " ")
        return int(eval(re.sub(r"[A-Za-z_]\w*", lambda m: str(value(m.group(0))), text), {"__builtins__": {}}))

    if name not in defines:
        raise SystemExit(f"the kernel source no longer defines {name}")
    return value(name)


def _opt_in(function, shared: int) -> None:
    """`shared` bytes of dynamic shared memory and the largest carveout, as the package launches its chunk
    kernels."""
    function.max_dynamic_shared_size_bytes = shared
    function.preferred_shared_memory_carveout = 100


def _function(folder: str, stem: str, entry: str):
    """(the entry point of <folder>/<stem>.cu built by NVRTC, that file's inlined source)."""
    import cupy

    from glm_kda.gpu.build import COMPILE_OPTIONS, kernel_source

    source = kernel_source(stem, folder)
    module = cupy.RawModule(code=source, options=COMPILE_OPTIONS)
    return module.get_function(entry), source


def _conv_case(folder: str, config, tokens: int, inputs: dict):
    """(launch(), outputs()) of one folder's conv pass on `inputs`."""
    import cupy

    function, source = _function(folder, "conv", "kda_conv_prefill_silu_l2_bf16")
    heads, dim, qkv = config.heads, config.head_dim, config.qkv
    state = inputs["state"].copy()
    q, k, v = (cupy.empty((tokens, qkv), cupy.float32) for _ in range(3))
    grid = (-(-3 * heads // 4), -(-tokens // _define(source, "CONV_PREFILL_TILE")))

    def launch():
        function(grid, (128,), (state, inputs["qkv"], inputs["conv_w"], np.uint64(0), q, k, v, np.int32(heads),
                                np.int32(dim), np.int32(config.conv_kernel), np.int32(tokens), np.float32(config.l2_eps)))

    def outputs():
        state[...] = inputs["state"]
        launch()
        return [array.copy() for array in (state, q, k, v)]

    return launch, outputs


def _norm_case(folder: str, config, tokens: int, inputs: dict):
    """(launch(), outputs()) of one folder's gated norm on `inputs`."""
    import cupy

    function, source = _function(folder, "norm", "kda_gated_rmsnorm_sigmoid_bf16")
    heads, dim = config.heads, config.head_dim
    out = cupy.empty((tokens, config.qkv), cupy.uint16)
    # Older folders launch a block per head (no NORM_HEADS_PER_BLOCK).
    heads_per_block = _define(source, "NORM_HEADS_PER_BLOCK") if "NORM_HEADS_PER_BLOCK" in source else 1
    grid = (-(-heads // heads_per_block), -(-tokens // _define(source, "NORM_TOKENS_PER_BLOCK")))

    def launch():
        function(grid, (128,), (inputs["core"], inputs["gate"], inputs["norm_w"], out, np.int32(heads), np.int32(dim),
                                np.float32(config.rms_norm_eps), np.int32(tokens)))

    def outputs():
        launch()
        return [out.copy()]

    return launch, outputs


def _chunk_inputs(rng, config, tokens: int) -> dict:
    """Random inputs of the chunk kernels: unit-norm q and k per head, the gate's projections, a state."""
    import cupy

    heads, dim = config.heads, config.head_dim

    def unit(x):
        return x / cupy.sqrt((x * x).sum(axis=-1, keepdims=True))

    return {"q": unit(rng.standard_normal((tokens, heads, dim), dtype=cupy.float32)),
            "k": unit(rng.standard_normal((tokens, heads, dim), dtype=cupy.float32)),
            "v": rng.standard_normal((tokens, heads, dim), dtype=cupy.float32),
            "forget_proj": random_bf16(rng, (tokens, heads * dim)),
            "dt_bias": rng.standard_normal(heads * dim, dtype=cupy.float32) * 0.5,
            "a_log": rng.standard_normal(heads, dtype=cupy.float32) * 0.5,
            "beta_logits": random_bf16(rng, (tokens, heads)),
            "state": rng.standard_normal((heads, dim, dim), dtype=cupy.float32) * 0.1}


def _prepare_entry(config) -> str:
    """The gate-forming prepare of the model's gate law (a bounded law outside the bounded prepare's
    range does not form its gate: not one of the geometries here)."""
    from glm_kda.chunk_model import prepare_lower_bound

    if prepare_lower_bound(config) is not None:
        return "kda_chunk_tc_prepare_gate_f32"
    if config.bounded:
        raise SystemExit("a bounded gate law below the bounded prepare's range has no gate-forming prepare")
    return "kda_chunk_tc_prepare_unbounded_gate_f32"


def _prepare_case(folder: str, config, tokens: int, inputs: dict):
    """(launch(), outputs()) of one folder's tensor-core prepare that forms the gate, on `inputs`; its
    outputs stay in inputs["scratch"] for the scan."""
    import cupy

    from glm_kda.chunk_model import chunk_count, new_scratch, prepare_lower_bound
    from glm_kda.gpu.build import ENTRY_POINTS

    lower_bound = prepare_lower_bound(config)
    entry = _prepare_entry(config)
    stem = next(stem for stem, entries in ENTRY_POINTS.items() if entry in entries)
    function, source = _function(folder, stem, entry)
    shared = _define(source, "CHUNK_TC_PREPARE_SMEM_BYTES")
    _opt_in(function, shared)
    heads = config.heads
    scratch = new_scratch(cupy, tokens, heads, float("nan"))
    beta = cupy.empty((tokens, heads), cupy.float32)
    inputs["scratch"] = scratch
    grid, block = (chunk_count(tokens), heads), (_define(source, "CHUNK_TC_PREPARE_THREADS"),)

    def launch():
        function(grid, block,
                 (inputs["q"], inputs["k"], inputs["v"], np.uint64(0), beta, scratch["q_decay"], scratch["k_tail"],
                  scratch["w"], scratch["u"], scratch["attn"], scratch["chunk_decay"], np.int32(tokens),
                  np.int32(heads), np.float32(config.head_dim ** -0.5), np.float32(lower_bound or 0.0),
                  inputs["forget_proj"], inputs["dt_bias"], inputs["a_log"], inputs["beta_logits"], np.int32(heads)),
                 shared_mem=shared)

    def outputs():
        launch()
        return [beta.copy(), *(array.copy() for array in scratch.values())]

    return launch, outputs


def _scan_case(folder: str, config, tokens: int, inputs: dict):
    """(launch(), outputs()) of one folder's tensor-core scan on the prepare's outputs in inputs["scratch"]
    (the last prepare run's, the new version's: both versions' scans read the same scratch)."""
    import cupy

    function, source = _function(folder, "chunk/chunk_tc", "kda_chunk_tc_scan_f32")
    shared = _define(source, "CHUNK_TC_SCAN_SMEM_BYTES")
    _opt_in(function, shared)
    heads, dim = config.heads, config.head_dim
    scratch, state = inputs["scratch"], inputs["state"].copy()
    core = cupy.empty((tokens, heads, dim), cupy.float32)
    grid, block = (heads, dim // _define(source, "CHUNK_TC_SCAN_COLUMNS")), (_define(source, "CHUNK_TC_SCAN_THREADS"),)

    def launch():
        function(grid, block,
                 (scratch["q_decay"], scratch["k_tail"], scratch["w"], scratch["u"], scratch["attn"],
                  scratch["chunk_decay"], state, core, np.int32(tokens), np.int32(heads)), shared_mem=shared)

    def outputs():
        state[...] = inputs["state"]
        launch()
        return [core.copy(), state.copy()]

    return launch, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the other version's kernels_src folder")
    parser.add_argument("--new", default=None, help="this version's kernels_src folder (default: this checkout's)")
    parser.add_argument("--geometry", nargs="+", default=list(_GEOMETRIES), choices=_GEOMETRIES)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    from lib.script import exit_unless_gpu

    exit_unless_gpu("the kernel versions benchmark")
    import cupy

    from glm_kda.gpu.build import kernels_dir
    from glm_kda.synthetic import synthetic_config

    new = args.new or str(kernels_dir())
    bandwidth = copy_bandwidth_gbs()
    print(json.dumps({"copy_bandwidth_GBs": bandwidth, "old": args.old, "new": new}), flush=True)
    rng = cupy.random.default_rng(0)
    for geometry in args.geometry:
        config = synthetic_config(geometry, 1)
        qkv, kernel_size = config.qkv, config.conv_kernel
        for tokens in args.tokens:
            conv_inputs = {"qkv": random_bf16(rng, (tokens, 3 * qkv)),
                           "conv_w": random_bf16(rng, (3 * qkv, kernel_size), 0.5),
                           "state": rng.standard_normal((3 * qkv, kernel_size), dtype=cupy.float32)}
            norm_inputs = {"core": rng.standard_normal((tokens, config.heads, config.head_dim), dtype=cupy.float32),
                           "gate": random_bf16(rng, (tokens, qkv)), "norm_w": random_bf16(rng, (config.head_dim,), 0.3)}
            chunk_inputs = _chunk_inputs(rng, config, tokens)
            cases = (("kda_conv_prefill_silu_l2_bf16", _conv_case, conv_inputs),
                     ("kda_gated_rmsnorm_sigmoid_bf16", _norm_case, norm_inputs),
                     (_prepare_entry(config), _prepare_case, chunk_inputs),
                     ("kda_chunk_tc_scan_f32", _scan_case, chunk_inputs))
            for kernel, case, inputs in cases:
                moved = kernel_bytes(config, tokens)[kernel]
                row = {"kernel": kernel, "geometry": geometry, "T": tokens, "bytes": moved}
                results = {}
                for name, folder in (("old", args.old), ("new", new)):
                    launch, outputs = case(folder, config, tokens, inputs)
                    results[name] = outputs()
                    ms = median_ms(launch, args.repeats)
                    row[f"{name}_ms"] = ms
                    row[f"{name}_copy_fraction"] = moved / (ms * 1e-3) / 1e9 / bandwidth
                row["ratio"] = row["new_ms"] / row["old_ms"]
                row["same_bits"] = all(bool(cupy.array_equal(a.view(cupy.uint8), b.view(cupy.uint8)))
                                       for a, b in zip(results["old"], results["new"]))
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
