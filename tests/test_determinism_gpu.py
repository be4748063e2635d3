"""Determinism across processes: two fresh processes running the same calls on the same
checkpoint give the same bits (outputs and states). Within one process the GPU tests already
compare paths bit for bit; this catches what differs between processes (uninitialised memory,
launch plans that depend on timing, atomics whose order varies)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glm_kda.device import gpu_status

GPU_OK, GPU_WHY = gpu_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=f"no CUDA GPU: {GPU_WHY}")]

# Prefill (tensor-core and FP32 chunk kernels), one-row decode, a verify walk and a pool decode;
# prints a SHA-256 of every output's and state's bytes as one JSON object.
_RUN = """
import hashlib, json, sys
import numpy as np
from glm_kda import KdaLayer, KdaOptions, StatePool
from glm_kda.synthetic import synthetic_hidden

path, hopper = sys.argv[1], sys.argv[2] == "1"
digests = {}
def record(name, array):
    host = array.get() if hasattr(array, "get") else array
    digests[name] = hashlib.sha256(np.ascontiguousarray(host).tobytes()).hexdigest()
for impl in ("tensor", "fp32"):
    layer = KdaLayer.from_pretrained(path, 0, max_tokens=1024, options=KdaOptions(chunk_impl=impl, hopper=hopper),
                                     progress=False)
    hidden = synthetic_hidden(1000 + 24, layer.config.hidden, seed=5)
    state = layer.new_state()
    record(f"{impl}/prefill", layer.prefill(hidden[:1000], state))
    for t in range(8):
        record(f"{impl}/decode{t}", layer.decode(hidden[1000 + t], state))
    record(f"{impl}/verify", layer.decode_k(hidden[1008:1012], state))
    record(f"{impl}/conv", state.conv)
    record(f"{impl}/recurrent", state.recurrent)
    pool = StatePool(layer.config, 8)
    record(f"{impl}/pool_out", layer.decode(hidden[1012:1020], pool, list(range(7, -1, -1))))
    record(f"{impl}/pool", pool.recurrent)
print(json.dumps(digests))
"""


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_two_processes_give_the_same_bits(real_checkpoint, portable_path, geometry):
    path = real_checkpoint(geometry)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")]))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _RUN, str(path), "0" if portable_path else "1"],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    differ = sorted(name for name in runs[0] if runs[0][name] != runs[1][name])
    assert runs[0].keys() == runs[1].keys() and not differ, f"{geometry}: bits differ between processes in {differ}"
