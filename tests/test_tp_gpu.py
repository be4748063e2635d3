"""Tensor parallelism on two GPUs: TP=2 against TP=1 (the plain KdaLayer) at GLM geometry.

What TP=2 must keep:
  * outputs: TP=2 within TP2_BOUND (1e-3) of TP=1, and against the float64 oracle at most
    E2E_FACTOR times TP=1's own error. Each rank hands the all-reduce its o_proj's FP32 sums
    (KdaLayer.o_proj_sums), so only FP32 reassociation separates the two; BF16 partials would
    add a second rounding of about 3e-3 (tests/test_tp.py::test_fp32_partials_round_once);
  * states: every head runs the same kernels on the same inputs as in TP=1, so each rank's
    state equals the TP=1 state's head slice to STATE_BOUND;
  * decode_k (K rows) bit-identical to K decode calls, graphs or not;
  * the decode step in at most TIME_RATIO of TP=1's time.
Needs 2 CUDA devices and the NCCL library; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from glm_kda import tp
from glm_kda.device import gpu_status
from glm_kda.reference import KdaOracle, rms_ratio
from glm_kda.state import KdaState
from glm_kda.synthetic import synthetic_hidden

SEED = 77
PREFILL_TOKENS = 4096
DECODE_STEPS = 256
TP2_BOUND = 1e-3
E2E_FACTOR = 2.0
STATE_BOUND = 1e-3
TIME_RATIO = 0.6
DEVICES = (0, 1)


def _two_gpus() -> tuple[bool, str]:
    ok, why = gpu_status()
    if not ok:
        return False, f"no CUDA GPU: {why}"
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - any failure means the devices cannot be used
        return False, f"cannot count CUDA devices ({type(exc).__name__}: {exc})"
    if count < 2:
        return False, f"tensor parallelism needs 2 CUDA devices, {count} visible"
    try:
        tp._nccl()
    except tp.TensorParallelError as exc:
        return False, str(exc)
    return True, ""


TWO_GPUS, TWO_GPUS_WHY = _two_gpus()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not TWO_GPUS, reason=TWO_GPUS_WHY)]


def _cp():
    import cupy

    return cupy


def bits(array) -> np.ndarray:
    """Host copy as raw bits (BF16 as uint16, FP32 as uint32)."""
    host = array.get() if hasattr(array, "get") else np.asarray(array)
    return host.view(np.uint16 if host.dtype.itemsize == 2 else np.uint32)


def assert_bits_equal(actual, expected, what):
    a, e = bits(actual), bits(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} vs {e.shape}"
    differ = int(np.count_nonzero(a != e))
    assert differ == 0, f"{what}: {differ} of {a.size} values differ in their bits"


@pytest.fixture(scope="module")
def blocks(real_checkpoint):
    """(bound full layer, TP=1 KdaLayer on device 0, TP=2 block on devices 0 and 1)."""
    from glm_kda.checkpoint import bind_layer
    from glm_kda.gpu.layer import KdaLayer

    cp = _cp()
    path = real_checkpoint("glm")
    bound = bind_layer(path, 0, progress=False)
    with cp.cuda.Device(DEVICES[0]):
        single = KdaLayer(bound, max_tokens=PREFILL_TOKENS)
    block = tp.TensorParallelBlock.from_pretrained(path, 0, devices=DEVICES, max_tokens=PREFILL_TOKENS)
    return bound, single, block


def device_state(state: KdaState) -> KdaState:
    cp = _cp()
    with cp.cuda.Device(DEVICES[0]):
        return KdaState(cp.asarray(state.conv), cp.asarray(state.recurrent))


@pytest.fixture(scope="module")
def runs(blocks):
    """Prefill of PREFILL_TOKENS from a carried state, then DECODE_STEPS decode calls, on
    TP=1 and TP=2, plus the float64 oracle (on GPU 0) over the same tokens."""
    from glm_kda.gpu.arrays import to_device_bf16, to_host

    cp = _cp()
    bound, single, block = blocks
    config = bound.config
    hidden = synthetic_hidden(PREFILL_TOKENS + DECODE_STEPS, config.hidden, seed=SEED)
    start = KdaState.random(config, seed=SEED)
    with cp.cuda.Device(DEVICES[0]):
        device_hidden = to_device_bf16(hidden)
    single_state, tp_states = device_state(start), block.split_state(start)
    prompt = device_hidden[:PREFILL_TOKENS]
    run = {
        "single_prefill": to_host(single.prefill(prompt, single_state)),
        "tp_prefill": to_host(block.prefill(prompt, tp_states)),
    }
    run["single_prefill_state"] = single_state.to_numpy()
    run["tp_prefill_states"] = [s.to_numpy() for s in tp_states]
    single_rows, tp_rows = [], []
    for t in range(PREFILL_TOKENS, PREFILL_TOKENS + DECODE_STEPS):
        row = device_hidden[t : t + 1]
        single_rows.append(single.decode(row, single_state))
        tp_rows.append(block.decode(row, tp_states))
    run["single_decode"] = to_host(cp.concatenate(single_rows))
    run["tp_decode"] = to_host(cp.concatenate(tp_rows))
    run["single_decode_state"] = single_state.to_numpy()
    run["tp_decode_states"] = [s.to_numpy() for s in tp_states]
    run["rank_outputs"] = [bits(out) for out in block.outputs(1)]
    with cp.cuda.Device(DEVICES[0]):
        oracle = KdaOracle(bound, "float64", xp=cp)
        exact, _ = oracle.prefill(hidden[:PREFILL_TOKENS], start)
        run["exact_prefill"] = exact["final_out"].get()
        exact, _ = oracle.prefill(hidden[PREFILL_TOKENS:], run["single_prefill_state"])
        run["exact_decode"] = exact["final_out"].get()
    return run


def check_outputs(run, phase, figures):
    tp_out, single_out, exact = run[f"tp_{phase}"], run[f"single_{phase}"], run[f"exact_{phase}"]
    versus_single = rms_ratio(tp_out, single_out)
    tp_error, single_error = rms_ratio(tp_out, exact), rms_ratio(single_out, exact)
    print(f"\n{phase}: TP=2 vs TP=1 {versus_single:.3e}; vs float64: TP=2 {tp_error:.3e}, TP=1 {single_error:.3e}")
    figures.append({"test": f"tp2_{phase}", "tp2_vs_tp1": versus_single, "tp2_vs_float64": tp_error,
                    "tp1_vs_float64": single_error})
    assert versus_single <= TP2_BOUND, f"{phase}: TP=2 vs TP=1 rms-ratio {versus_single:.3e}"
    assert tp_error <= E2E_FACTOR * single_error, (
        f"{phase}: TP=2 error {tp_error:.3e} > {E2E_FACTOR} x TP=1 error {single_error:.3e} (float64 oracle)"
    )


def test_prefill_matches_tp1(runs, figures):
    check_outputs(runs, "prefill", figures)


def test_decode_matches_tp1(runs, figures):
    check_outputs(runs, "decode", figures)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_rank_states_are_head_slices_of_tp1(blocks, runs, phase, figures):
    plan = blocks[2].plan
    single = runs[f"single_{phase}_state"]
    for rank, state in enumerate(runs[f"tp_{phase}_states"]):
        expected = plan.state_slice(single, rank)
        for name in ("conv", "recurrent"):
            ratio = rms_ratio(getattr(state, name), getattr(expected, name))
            print(f"{phase} rank {rank} {name} state: rms-ratio {ratio:.3e}")
            figures.append({"test": f"tp2_{phase}_state", "rank": rank, "buffer": name, "rms_ratio": ratio})
            assert ratio <= STATE_BOUND, f"{phase}: rank {rank} {name} state rms-ratio {ratio:.3e}"


def test_every_rank_holds_the_output(runs):
    first, *others = runs["rank_outputs"]
    for rank, output in enumerate(others, start=1):
        assert_bits_equal(output, first, f"rank {rank} output vs rank 0")


def fill(states, source):
    """Copy per-rank states `source` into `states` in place (keeps their device pointers)."""
    for state, values in zip(states, source):
        with state.conv.device:
            state.conv[...] = values.conv
            state.recurrent[...] = values.recurrent


def test_decode_k_bit_identical_to_decodes(blocks, runs):
    """K=4 rows in one call equal 4 decode calls, every output and state bit, on the eager
    first call, the capturing second and the replays after (the states keep their pointers)."""
    from glm_kda.gpu.arrays import to_device_bf16

    cp = _cp()
    block = blocks[2]
    rows = 4
    start = block.split_state(KdaState.random(block.config, seed=SEED + 1))
    together, separate = block.new_state(), block.new_state()
    snapshots = [block.new_state() for _ in range(rows)]
    for round_ in range(4):
        hidden = synthetic_hidden(rows, block.config.hidden, seed=SEED + 10 + round_)
        with cp.cuda.Device(DEVICES[0]):
            device_hidden = to_device_bf16(hidden)
        fill(together, start)
        fill(separate, start)
        out_k = block.decode_k(device_hidden, together, snapshots=snapshots)
        outs = []
        for i in range(rows):
            outs.append(block.decode(device_hidden[i : i + 1], separate))
            for rank in range(len(separate)):
                for name in ("conv", "recurrent"):
                    assert_bits_equal(getattr(snapshots[i][rank], name), getattr(separate[rank], name),
                                      f"round {round_}: snapshot {i} rank {rank} {name}")
        assert_bits_equal(out_k, cp.concatenate(outs), f"round {round_}: decode_k output vs {rows} decodes")
        for rank in range(len(together)):
            for name in ("conv", "recurrent"):
                assert_bits_equal(getattr(together[rank], name), getattr(separate[rank], name),
                                  f"round {round_}: rank {rank} {name} state")
        # Host input gives the same bits as device input.
        fill(separate, start)
        host_out = block.decode_k(hidden, separate)
        assert isinstance(host_out, np.ndarray)
        assert_bits_equal(host_out, out_k, f"round {round_}: host input")
    assert block.use_graphs, "graph capture failed and was switched off (see the warning)"


def test_graphs_equal_eager(blocks):
    """Captured decode steps give the bits of eager ones (same stages, same order)."""
    from glm_kda.gpu.arrays import to_device_bf16

    cp = _cp()
    block = blocks[2]
    start = block.split_state(KdaState.random(block.config, seed=SEED + 2))
    hidden = synthetic_hidden(8, block.config.hidden, seed=SEED + 3)
    with cp.cuda.Device(DEVICES[0]):
        device_hidden = to_device_bf16(hidden)
    results = {}
    for use_graphs in (False, True):
        block.use_graphs = use_graphs
        states = block.new_state()
        fill(states, start)
        outs = [block.decode(device_hidden[t : t + 1], states) for t in range(8)]
        results[use_graphs] = (cp.concatenate(outs), [s.to_numpy() for s in states])
    assert block.use_graphs, "graph capture failed and was switched off: eager was compared with eager"
    block.use_graphs = True
    assert_bits_equal(results[True][0], results[False][0], "outputs, graphs vs eager")
    for rank, (a, b) in enumerate(zip(results[True][1], results[False][1])):
        assert_bits_equal(a.recurrent, b.recurrent, f"rank {rank} recurrent, graphs vs eager")
        assert_bits_equal(a.conv, b.conv, f"rank {rank} conv, graphs vs eager")


def test_errors_name_the_culprit(real_checkpoint):
    import cupy

    path = real_checkpoint("glm")
    count = cupy.cuda.runtime.getDeviceCount()
    with pytest.raises(tp.TensorParallelError, match="CUDA device"):
        tp.TensorParallelBlock.from_pretrained(path, 0, devices=tuple(range(count + 1)))
    # 64 heads: 3 GPUs cannot split them.
    if count >= 3:
        with pytest.raises(tp.TensorParallelError, match="tp_size=3 does not divide heads=64"):
            tp.TensorParallelBlock.from_pretrained(path, 0, devices=(0, 1, 2))


@pytest.mark.slow
def test_decode_step_time(blocks, figures):
    """Median decode step, CUDA events on GPU 0 around each call (the TP=2 step ends with
    the all-reduced output on GPU 0, so its events cover both GPUs' work)."""
    from glm_kda.gpu.arrays import to_device_bf16

    cp = _cp()
    _, single, block = blocks
    steps, warmup = 200, 10
    hidden = synthetic_hidden(steps + warmup, block.config.hidden, seed=SEED + 4)
    with cp.cuda.Device(DEVICES[0]):
        device_hidden = to_device_bf16(hidden)
        single_state = single.new_state()
    tp_states = block.new_state()

    def median_us(call) -> float:
        times = []
        with cp.cuda.Device(DEVICES[0]):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            for t in range(steps + warmup):
                row = device_hidden[t : t + 1]
                start.record()
                call(row)
                end.record()
                end.synchronize()
                if t >= warmup:
                    times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
        return statistics.median(times)

    single_us = median_us(lambda row: single.decode(row, single_state))
    tp_us = median_us(lambda row: block.decode(row, tp_states))
    ratio = tp_us / single_us
    line = {"case": "tp_decode_step", "geometry": "glm", "tp1_us": round(single_us, 2), "tp2_us": round(tp_us, 2),
            "ratio": round(ratio, 3), "graphs": block.use_graphs}
    print("\n" + json.dumps(line))
    figures.append(line)
    assert ratio <= TIME_RATIO, f"TP=2 decode step {tp_us:.1f} us is {ratio:.2f}x TP=1's {single_us:.1f} us"
