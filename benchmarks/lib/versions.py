"""The measuring side of benchmarks/compare_versions.py: one version of glm_kda (whichever is first
on sys.path), one geometry, the cases of CASES; timings and the bits of outputs and final states.

It works with both layer APIs there have been:

    new  glm_kda.gpu.layer.KdaLayer, glm_kda.gpu.arrays.to_device_bf16, layer.graphs.last_graph
    old  glm_kda.layer.KdaLayer and to_device_bf16 (3d65311 and before), layer._graphs.last_graph

both with ``KdaLayer.from_pretrained(path, idx, max_tokens=..., chunk=...)`` and graphed decode-side
calls by default. Nothing here imports glm_kda at module level.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .timing import copy_bandwidth_gbs, decode_bytes, median_ms, prefill_bytes, replay_ms, roofline

# (case, rows per call, sequences per call): decode of one sequence and of 64 (a StatePool, shuffled
# slots), a verify walk of 4 and of 16 rows of one sequence, and one prefill.
CASES = (("decode", 1, 1), ("decode", 64, 64), ("verify", 4, 1), ("verify", 16, 1), ("prefill", 16384, 1))
# Calls of a decode-side case whose outputs and final state are compared: the first runs eagerly,
# the second captures its graph, the rest replay it.
BIT_CALLS = 4
PREFILL_REPEATS = 20
POOL_SLOTS = 128


def case_key(case: str, rows: int) -> str:
    """decode_B1, decode_B64, verify_K4, verify_K16, prefill_T16384."""
    return f"{case}_{ {'decode': 'B', 'verify': 'K', 'prefill': 'T'}[case]}{rows}"


def input_rows() -> int:
    """Rows of the input every case slices from: the prefill's, and the decode-side cases' BIT_CALLS."""
    return max(max(rows * (1 if case == "prefill" else BIT_CALLS) for case, rows, _ in CASES), 1)


@dataclass
class Api:
    """The parts of a glm_kda version's layer API the measurement uses."""

    name: str
    KdaLayer: Any
    to_device_bf16: Callable[[np.ndarray], Any]
    package: str

    @staticmethod
    def load() -> "Api":
        import glm_kda

        package = Path(glm_kda.__file__).resolve().parent
        # Which layout the package on sys.path has, by its files (not by what imports: an editable
        # install of another version may answer for a subpackage this one lacks, and an import
        # error of a new version is its own).
        if not (package / "gpu" / "__init__.py").is_file():
            from glm_kda.layer import KdaLayer, to_device_bf16

            return Api("old", KdaLayer, to_device_bf16, str(package))
        from glm_kda.gpu.layer import KdaLayer
        try:
            from glm_kda.gpu.arrays import to_device_bf16
        except ImportError:  # (a version between the two)
            from glm_kda.gpu.layer import to_device_bf16
        return Api("new", KdaLayer, to_device_bf16, str(package))

    @staticmethod
    def graphs(layer: Any) -> Any:
        """The layer's decode graphs (their last_graph replays the last decode-side call alone)."""
        graphs = getattr(layer, "graphs", None)
        if graphs is None or not hasattr(graphs, "last_graph"):
            graphs = layer._graphs
        return graphs


def device_bits(array: Any) -> np.ndarray:
    """The bits of a device array as unsigned integers of its element size, on the host."""
    import cupy

    unsigned = {2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[array.dtype.itemsize]
    return cupy.ascontiguousarray(array).view(unsigned).get()


def digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for array in arrays:
        h.update(str(array.shape).encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def measure(checkpoint: Path, hidden_file: Path, out_dir: Path | None, repeats: int, geometry: str,
            emit: Callable[[dict], None] = lambda row: print(json.dumps(row), flush=True)) -> list[dict]:
    """Every case of CASES on the layer of `checkpoint`, inputs from `hidden_file` (uint16 bits of
    BF16 [rows, hidden]); one row per case (also passed to emit), the bits of its outputs and final
    state saved to out_dir (None: only their sha256)."""
    import cupy
    import ml_dtypes

    from glm_kda.state import StatePool

    api = Api.load()
    bandwidth = copy_bandwidth_gbs()
    layer = api.KdaLayer.from_pretrained(checkpoint, 0, max_tokens=max(rows for _, rows, _ in CASES), chunk=64,
                                         progress=False)
    cfg = layer.config
    hidden = api.to_device_bf16(np.load(hidden_file).view(ml_dtypes.bfloat16))
    stream = cupy.cuda.get_current_stream()
    common = {"geometry": geometry, "api": api.name, "package": api.package, "copy_bandwidth_GBs": bandwidth}
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    emit({**common, "case": "device", "hidden": cfg.hidden, "heads": cfg.heads,
          "device": name.decode() if isinstance(name, bytes) else str(name)})
    rows_out = []
    for case, rows, sequences in CASES:
        key = case_key(case, rows)
        row = {**common, "case": case, "key": key, "rows": rows, "sequences": sequences}
        # The bits first (every output copied off as it comes: a call may return a view of its
        # workspace), then the timings, which advance the states further.
        if case == "prefill":
            state = layer.new_state()
            out_bits = [device_bits(layer.prefill(hidden[:rows], state))]
            state_bits = [device_bits(state.conv), device_bits(state.recurrent)]
            timed = layer.new_state()
            us = 1e3 * median_ms(lambda: layer.prefill(hidden[:rows], timed), repeats=PREFILL_REPEATS, warmup=2)
            nbytes = prefill_bytes(cfg, rows)
            times = {"prefill_us": us}
            row.update(prefill_us=us, Mtok_s=rows / us)
        else:
            if sequences > 1:
                pool = StatePool(cfg, POOL_SLOTS)
                slots = cupy.asarray(np.random.default_rng(0).permutation(POOL_SLOTS)[:sequences].astype(np.int32))
                # check_slots=False where the layer has it: the device-slot path without the read-back.
                unchecked = {"check_slots": False} if "check_slots" in inspect.signature(layer.decode).parameters else {}
                call = lambda x: layer.decode(x, pool, slots, **unchecked)  # noqa: E731
                finals = lambda: (pool.conv[slots], pool.recurrent[slots])  # noqa: E731
            else:
                state = layer.new_state()
                call = (lambda x: layer.decode(x, state)) if case == "decode" else (lambda x: layer.decode_k(x, state))
                finals = lambda: (state.conv, state.recurrent)  # noqa: E731
            out_bits = [device_bits(call(hidden[i * rows:(i + 1) * rows])) for i in range(BIT_CALLS)]
            state_bits = [device_bits(part) for part in finals()]
            graph = Api.graphs(layer).last_graph
            if graph is None:
                raise RuntimeError(f"{key}: no decode graph was captured (graphs off?)")
            graph_us = 1e3 * float(np.median(replay_ms(lambda: graph.launch(stream), calls=repeats, warmup=10)))
            call_us = 1e3 * float(np.median(replay_ms(lambda: call(hidden[:rows]), calls=repeats, warmup=10)))
            nbytes = decode_bytes(cfg, sequences)
            times = {"graph_replay_us": graph_us, "call_us": call_us}
            row.update(times)
        cupy.cuda.Device().synchronize()
        row.update(bytes=nbytes, roofline_us=nbytes / 1e3 / bandwidth,
                   **{f"{name.removesuffix('_us')}_roofline_ratio": roofline(nbytes, bandwidth, us)
                      for name, us in times.items()},
                   out_sha256=digest(*out_bits), state_sha256=digest(*state_bits))
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            np.save(out_dir / f"{key}_out.npy", np.stack(out_bits))
            for name, bits in zip(("conv", "recurrent"), state_bits):
                np.save(out_dir / f"{key}_{name}.npy", bits)
        rows_out.append(row)
        emit(row)
        del out_bits, state_bits
        cupy.get_default_memory_pool().free_all_blocks()
    return rows_out
