"""The floor of a stack decode whose weight stream never waits for the data: one token through every
layer of a model's KDA stack as one persistent kernel (benchmarks/stream_stack.cu), one sequence.

Each block (one an SM, a cooperative launch) streams its share of every layer's weights, in the
order they are used, through a ring of shared-memory slots by bulk copies, while its other warps
form each layer's q|k|v, a stand-in step on one block a head (the FP32 state read and written) and
o_proj, each phase waiting on counters the phase before counts up in every block. The weight bytes
per layer are the block's (q|k|v, o_proj and, as extra q|k|v rows, the rest: the low-rank chain,
the conv taps), so `roofline_ratio_per_layer` is comparable with benchmarks/stack.py's, measured
against the copy bandwidth of the same run. `no_waits` runs the same stream with every phase's wait
left out: the stream and the sums alone.

Before timing, one token's outputs are checked against float64 products of the kernel's own inputs
at every layer (q|k|v, the step's core and state, o_proj); the run stops if an error is over 1e-4.
It is a measurement of what a design could reach, not a product kernel: the step has no conv and
no gates, and its sums are not the product's bits. Needs sm_90 or later.

    PYTHONPATH=. python benchmarks/stream_stack.py [--geometry kimi glm] [--layers N] [--repeats 30]
        [--slots S] [--slot-kb 16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from glm_kda.reference import rms_ratio
from glm_kda.state import array_module

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.launches import random_bf16  # noqa: E402
from lib.script import exit_unless_gpu  # noqa: E402
from lib.timing import copy_bandwidth_gbs, decode_bytes, median_ms, weight_bytes  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "stream_stack.cu"
# The product's headers the kernel uses (mbarriers and bulk copies; counters), prepended in this order.
HEADERS = ("common/sync.cuh", "common/mbarrier.cuh")
# The model's KDA layers (glm_kda.synthetic.default_kda_layers of 45 and 27 layers).
MODEL_KDA_LAYERS = {"glm": 34, "kimi": 20}
# Must match stream_stack.cu.
CONSUMER_WARPS = 8
# Bytes of a ring slot unless --slot-kb says otherwise.
SLOT_BYTES = 16384
HEAD_DIM = 128
# Shared memory one block may ask for on sm_90 and later.
SHARED_BYTES = 227 << 10
# The most slots a ring takes: more only hold weights further ahead than any wait lasts.
MAX_SLOTS = 16
# Largest error (rms ratio against float64) a stage of the check may show: FP32 sums of k <= 8192 products.
CHECK_BOUND = 1e-4


def kernel_source() -> str:
    """The kernel's text with the headers it uses in front (NVRTC has no include path)."""
    from glm_kda.gpu.build import kernels_dir

    folder = kernels_dir()
    return "".join((folder / header).read_text() + "\n" for header in HEADERS) + SOURCE.read_text()


def ring_slots(hidden: int, core_width: int, slot_bytes: int = SLOT_BYTES) -> int:
    """Slots of the ring (each with its two mbarriers) that fit beside x's FP32 copy in one block's
    shared memory."""
    return min(MAX_SLOTS, (SHARED_BYTES - shared_bytes(hidden, core_width, 0)) // (slot_bytes + 16))


def qkv_rows(config) -> int:
    """Rows streamed in the q|k|v phase: q|k|v's, then as many as carry the rest of a layer's
    weight bytes besides o_proj (the low-rank chain, conv taps, norm and gate parameters)."""
    rest = weight_bytes(config) - 2 * config.hidden * (config.conv_dim + config.qkv)
    return config.conv_dim + -(-rest // (2 * config.hidden))


def bf16_to_f64(bits):
    """BF16 bits (uint16, NumPy or CuPy) as float64, exactly."""
    xp = array_module(bits)
    return (bits.astype(xp.uint32) << 16).view(xp.float32).astype(xp.float64)


def check_token(buffers: dict, state_before, layers: int, heads: int) -> dict[str, float]:
    """The worst rms ratio per stage over the layers (NaN if any layer's is), of one launch's outputs
    against float64 products of that launch's own inputs (layer L's x, q|k|v and core as the kernel wrote
    them). NumPy or CuPy arrays: buffers as run_geometry's, state_before the state before the launch."""
    xp = array_module(state_before)
    ratios: dict[str, list[float]] = {"qkv": [], "core": [], "state": [], "o_proj": []}
    x, qkv, core, state = buffers["x"], buffers["qkv"], buffers["core"], buffers["state"]
    d, width = HEAD_DIM, heads * HEAD_DIM
    for layer in range(layers):
        w_qkv = bf16_to_f64(buffers["qkv_w"][layer])
        ratios["qkv"].append(rms_ratio(qkv[layer], w_qkv @ x[layer].astype(xp.float64)))
        del w_qkv
        q = qkv[layer, :width].astype(xp.float64).reshape(heads, d) / np.sqrt(d)
        k = qkv[layer, width : 2 * width].astype(xp.float64).reshape(heads, d) / np.sqrt(d)
        v = qkv[layer, 2 * width : 3 * width].astype(xp.float64).reshape(heads, d)
        s = 0.9 * state_before[layer].astype(xp.float64)  # [heads, D_k, D_v]
        delta = 0.5 * (v - xp.einsum("hkv,hk->hv", s, k))
        s = s + k[:, :, None] * delta[:, None, :]
        ratios["state"].append(rms_ratio(state[layer], s))
        ratios["core"].append(rms_ratio(core[layer], xp.einsum("hkv,hk->hv", s, q).reshape(-1)))
        w_o = bf16_to_f64(buffers["o_w"][layer])
        ratios["o_proj"].append(rms_ratio(x[layer + 1], w_o @ core[layer].astype(xp.float64)))
    return {stage: float(np.max(values)) for stage, values in ratios.items()}


def shared_bytes(hidden: int, core_width: int, slots: int, slot_bytes: int = SLOT_BYTES) -> int:
    """Dynamic shared memory of a block: the ring, x's FP32 copy (or the step's q and k), two
    mbarriers a slot."""
    return slots * slot_bytes + 4 * max(hidden, core_width, 2 * HEAD_DIM) + 16 * slots


def run_geometry(geometry: str, layers: int | None, repeats: int, slots: int | None = None,
                 slot_bytes: int = SLOT_BYTES) -> list[dict]:
    import cupy

    from lib.bench_prefill import geometry_config

    config = geometry_config(geometry)
    layers = layers or MODEL_KDA_LAYERS[geometry]
    hidden, heads, width = config.hidden, config.heads, config.qkv
    rows = qkv_rows(config)
    device = cupy.cuda.Device()
    sm_count = device.attributes["MultiProcessorCount"]
    if slot_bytes % 16 or slot_bytes < 2 * max(hidden, width):
        raise SystemExit(f"error: a slot of {slot_bytes} bytes must be a multiple of 16 holding a row of "
                         f"{2 * max(hidden, width)} bytes")
    slots = min(slots or MAX_SLOTS, ring_slots(hidden, width, slot_bytes))
    shared = shared_bytes(hidden, width, slots, slot_bytes)

    rng = cupy.random.default_rng(7)
    buffers = {
        "qkv_w": cupy.stack([random_bf16(rng, (rows, hidden), hidden**-0.5).view(cupy.uint16) for _ in range(layers)]),
        "o_w": cupy.stack([random_bf16(rng, (hidden, width), width**-0.5).view(cupy.uint16) for _ in range(layers)]),
        "x": cupy.zeros((layers + 1, hidden), cupy.float32),
        "qkv": cupy.zeros((layers, rows), cupy.float32),
        "core": cupy.zeros((layers, width), cupy.float32),
        "state": (rng.standard_normal((layers, heads, HEAD_DIM, HEAD_DIM), dtype=cupy.float32) * 0.1),
    }
    buffers["x"][0] = rng.standard_normal(hidden, dtype=cupy.float32)
    counters = cupy.zeros((layers, 3), cupy.int32)
    # (A cooperative launch: every block resident at once, or the launch fails instead of hanging.)
    kernel = cupy.RawModule(code=kernel_source(), options=("-std=c++17",),
                            enable_cooperative_groups=True).get_function("stream_stack")
    kernel.max_dynamic_shared_size_bytes = shared
    launches = iter(range(1, 1 << 30))

    def launch(waits: bool) -> None:
        kernel((sm_count,), (32 * (1 + CONSUMER_WARPS),),
               (buffers["qkv_w"], buffers["o_w"], buffers["x"], buffers["qkv"], buffers["core"], buffers["state"],
                counters, np.int32(layers), np.int32(rows), np.int32(hidden), np.int32(heads),
                np.int32(next(launches)), np.int32(waits), np.int32(slots), np.int32(slot_bytes)),
               shared_mem=shared)

    state_before = buffers["state"].copy()
    launch(True)
    device.synchronize()
    errors = check_token(buffers, state_before, layers, heads)
    if not all(error <= CHECK_BOUND for error in errors.values()):  # (NaN fails too)
        raise SystemExit(f"error: {geometry}: the persistent kernel's outputs differ from float64 by {errors} "
                         f"(rms ratio; bound {CHECK_BOUND})")
    layer_bytes = decode_bytes(config)
    streamed = 2 * hidden * (rows + width) + 2 * 4 * heads * HEAD_DIM * HEAD_DIM
    results = []
    for waits in (True, False):
        bandwidth = copy_bandwidth_gbs()
        token_us = 1e3 * median_ms(lambda: launch(waits), repeats=repeats, warmup=3)
        results.append({
            "case": "stream_stack" if waits else "stream_stack_no_waits", "geometry": geometry, "layers": layers,
            "sms": sm_count, "ring_slots": slots, "slot_bytes": slot_bytes, "us_per_token": token_us,
            "us_per_layer": token_us / layers,
            "layer_bytes": layer_bytes, "streamed_bytes_per_layer": streamed, "copy_bandwidth_GBs": bandwidth,
            "roofline_ratio_per_layer": layer_bytes * layers / 1e3 / bandwidth / token_us,
            "check_rms_ratio": errors,
        })
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", nargs="+", default=["kimi", "glm"], choices=sorted(MODEL_KDA_LAYERS))
    parser.add_argument("--layers", type=int, default=None,
                        help="layers in the stack (default: the model's KDA layers)")
    parser.add_argument("--repeats", type=int, default=30, help="timed tokens per case")
    parser.add_argument("--slots", type=int, default=None, help="ring slots a block (default: as many as fit)")
    parser.add_argument("--slot-kb", type=int, default=SLOT_BYTES >> 10, help="KB of a ring slot (default 16)")
    args = parser.parse_args()
    exit_unless_gpu("the persistent stack stream benchmark")
    for geometry in args.geometry:
        for row in run_geometry(geometry, args.layers, args.repeats, args.slots, args.slot_kb << 10):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
