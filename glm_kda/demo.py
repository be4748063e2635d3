"""The demo: a synthetic checkpoint, a prefill, a decode loop, a stage agreement table.

On a machine with a CUDA GPU the block runs in the CUDA kernels and is compared with the
float64 oracle; without one, the BF16-faithful NumPy oracle stands in for the kernels, and the
demo says so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .checkpoint import bind_layer
from .config import ConfigError
from .device import gpu_status
from .reference import KdaOracle, compare_stages, rms_ratio
from .synthetic import synthetic_hidden, write_synthetic_checkpoint


def demo_checkpoint(geometry: str, seed: int = 0) -> Path:
    """Write (once) and return a synthetic checkpoint directory for `geometry`, in $GLM_KDA_CACHE
    (default: the temporary directory's glm_kda_demo). It is written into a scratch directory
    beside it and renamed into place once complete, so an interrupted write is never taken for a
    checkpoint by the next run."""
    root = Path(os.environ.get("GLM_KDA_CACHE", Path(tempfile.gettempdir()) / "glm_kda_demo"))
    path = root / f"{geometry}-seed{seed}"
    if (path / "config.json").exists():
        print(f"using the synthetic {geometry} checkpoint cached at {path} (GLM_KDA_CACHE moves it)")
    else:
        print(f"writing a synthetic {geometry} checkpoint to {path} ...", flush=True)
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=root))
        try:
            write_synthetic_checkpoint(scratch, geometry, seed=seed, num_layers=4, progress=True)
            if not (path / "config.json").exists():  # (else another run has just put its copy there)
                if path.exists():
                    shutil.rmtree(path)  # an incomplete directory (no config.json): not a checkpoint
                os.replace(scratch, path)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return path


def run_demo(geometry: str = "kimi", prompt: int = 64, steps: int = 32, seed: int = 0, force_cpu: bool = False) -> dict:
    """Prefill `prompt` synthetic hidden rows, decode `steps` more, compare with the oracle.

    Returns a dict with the path taken ("cuda" or "numpy"), timings and the stage table.
    prompt and steps must be >= 1 (ValueError otherwise, before any file is written).
    """
    if prompt < 1 or steps < 1:
        raise ValueError(f"run_demo: prompt and steps must be >= 1, got prompt={prompt}, steps={steps}")
    path = demo_checkpoint(geometry, seed)
    layer = bind_layer(path, 0, progress=False)
    cfg = layer.config
    print(f"layer 0 of {path.name}: {cfg.describe()}")
    hidden = synthetic_hidden(prompt + steps, cfg.hidden, seed=seed + 1)
    ok, why = gpu_status()
    try:
        cfg.validate()  # the kernels' limits (head_dim 128, ...): the tiny geometries are the oracle's only
        runs_on_kernels = True
    except ConfigError as exc:
        runs_on_kernels, unfit = False, str(exc)
    use_gpu = ok and not force_cpu and runs_on_kernels
    exact = KdaOracle(layer, "float64")
    if use_gpu:
        print(f"GPU: {why}: running the CUDA kernels")
        result = _run_gpu(path, hidden, prompt, steps)
    else:
        reason = ("--cpu given" if force_cpu else f"no GPU found ({why})" if not ok
                  else f"the CUDA kernels do not run this geometry ({unfit})")
        print(f"{reason}: running the NumPy reference path (BF16-faithful oracle in place of the kernels)")
        faithful = KdaOracle(layer, "bf16")
        stages, prefill_s, decode_s = _oracle_run(faithful, hidden, prompt, chunk=cfg.chunk, progress=True)
        result = {"path": "numpy", "stages": stages, "prefill_ms": 1e3 * prefill_s,
                  "decode_ms_per_token": 1e3 * decode_s / steps}
    ref_stages, prefill_s, decode_s = _oracle_run(exact, hidden, prompt)
    table = compare_stages(result["stages"], ref_stages)
    print(f"\nagreement with the float64 oracle over {prompt} prefill + {steps} decode tokens "
          f"(oracle took {prefill_s + decode_s:.1f} s):")
    print(table)
    print("  rms-ratio: rms(ours - float64) / rms(float64) over every element of the stage; max-abs: the largest\n"
          "  |ours - float64|. BF16 rounding alone puts a rounded stage near 2^-9 = 2e-3.")
    result["verdict"] = _verdict(table, layer, hidden, prompt, ref_stages["final_out"], use_gpu)
    print(result["verdict"])
    if not geometry.startswith("tiny"):
        print("(--geometry tiny-kimi or tiny-glm: the same on a tiny layer, in about a second on a CPU)")
    print(f"\nprefill {prompt} tokens: {result['prefill_ms']:.2f} ms; decode: {result['decode_ms_per_token']:.3f} ms/token "
          f"({result['path']} path)")
    result["table"] = table
    return result


# The contract (docs/maths.md, section 5): the kernels' end-to-end error is at most this many times
# the error the BF16-faithful oracle itself has against the float64 oracle.
_E2E_FACTOR = 1.5


def _verdict(table, layer, hidden: np.ndarray, prompt: int, exact_out: np.ndarray, on_gpu: bool) -> str:
    """One line judging the run against the numerics contract (exact_out: the float64 final_out)."""
    ours = table["final_out"].rms_ratio
    if not on_gpu:
        return (f"verdict: final_out {ours:.2e} from float64: the BF16-faithful oracle's own error, the floor the "
                f"CUDA kernels are held to (at most {_E2E_FACTOR}x of it)")
    stages, _, _ = _oracle_run(KdaOracle(layer, "bf16"), hidden, prompt)
    floor = rms_ratio(stages["final_out"], exact_out)
    bound = _E2E_FACTOR * floor
    return (f"verdict: {'PASS' if ours <= bound else 'FAIL'}: final_out {ours:.2e} from float64, bound "
            f"{bound:.2e} ({_E2E_FACTOR}x the BF16-faithful oracle's {floor:.2e})")


def _oracle_run(oracle: KdaOracle, hidden: np.ndarray, prompt: int, chunk: int | None = None,
                progress: bool = False) -> tuple[dict, float, float]:
    """(stages, prefill seconds, decode seconds) of a prefill of hidden[:prompt], then a decode of
    every following row."""
    t0 = time.perf_counter()
    stages, state = oracle.prefill(hidden[:prompt], None, chunk=chunk)
    t1 = time.perf_counter()
    decoded = []
    for row in tqdm(hidden[prompt:], desc="decode", disable=not progress, leave=False):
        step, state = oracle.decode(row, state)
        decoded.append(step)
    merged = {k: np.concatenate([stages[k]] + [d[k] for d in decoded]) for k in stages}
    return merged, t1 - t0, time.perf_counter() - t1


def _run_gpu(path: Path, hidden: np.ndarray, prompt: int, steps: int) -> dict:
    """The demo's GPU half: prefill, then a decode loop; stage buffers gathered per call."""
    import cupy

    from .gpu.arrays import to_device_bf16
    from .gpu.layer import KdaLayer
    from .options import KdaOptions

    print("loading the layer and its kernels (the first run on a machine compiles them with NVRTC, a few "
          "seconds; later runs read them from the cache) ...", flush=True)
    start_time = time.perf_counter()
    layer = KdaLayer.from_pretrained(path, 0, max_tokens=max(prompt, 16), options=KdaOptions(stage_buffers=True))
    print(f"ready in {time.perf_counter() - start_time:.1f} s")
    state = layer.new_state()
    device_hidden = to_device_bf16(hidden)
    # Warm-up on a scratch state so compile and cuBLAS set-up stay out of the timings.
    scratch = layer.new_state()
    layer.prefill(device_hidden[:prompt], scratch)
    layer.decode(device_hidden[prompt : prompt + 1], scratch)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    layer.prefill(device_hidden[:prompt], state)
    end.record()
    end.synchronize()
    prefill_ms = cupy.cuda.get_elapsed_time(start, end)
    stages = layer.workspace.stages(prompt)
    decoded, total_ms = [], 0.0
    for i in tqdm(range(steps), desc="decode", leave=False):
        start.record()
        layer.decode(device_hidden[prompt + i : prompt + i + 1], state)
        end.record()
        end.synchronize()
        total_ms += cupy.cuda.get_elapsed_time(start, end)
        decoded.append(layer.workspace.stages(1))
    merged = {k: np.concatenate([stages[k]] + [d[k] for d in decoded]) for k in stages}
    return {"path": "cuda", "stages": merged, "prefill_ms": prefill_ms, "decode_ms_per_token": total_ms / steps}
