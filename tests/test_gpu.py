"""The CUDA block against the oracle: the numerics contract (docs/maths.md, section 5) on a GPU.

Two levels:
  * each stage against the BF16-faithful oracle fed the SAME upstream stage values (the GPU's
    own workspace): rms-ratio <= 1e-3, FP32 reassociation and rare BF16 rounding flips only;
  * end to end against the float64 oracle: no more than 1.5x the error of the BF16-faithful
    oracle's own end-to-end run.
The float64 oracle runs on the GPU through CuPy (same code as the NumPy oracle), which keeps
real-geometry cases fast.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from glm_kda.device import gpu_status
from glm_kda.reference import KdaOracle, compare_stages, rms_ratio
from glm_kda.options import KdaOptions
from glm_kda.state import KdaState
from glm_kda.synthetic import synthetic_hidden, write_synthetic_checkpoint

GPU_OK, GPU_WHY = gpu_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=f"no CUDA GPU: {GPU_WHY}")]

STAGE_BOUND = 1e-3
E2E_FACTOR = 1.5
SEED = 99
TOKENS = [1, 2, 15, 16, 17, 63, 64, 65, 1000, 4096]


def _cp():
    import cupy

    return cupy


@pytest.fixture(scope="module")
def layers(real_checkpoint):
    """(bound, KdaLayer) per geometry and chunk, built once, recording every stage buffer."""
    from glm_kda.checkpoint import bind_layer
    from glm_kda.gpu.layer import KdaLayer

    built = {}

    def get(geometry: str, chunk: int = 64):
        if (geometry, chunk) not in built:
            bound = bind_layer(real_checkpoint(geometry), 0, progress=False)
            bound = dataclasses.replace(bound, config=bound.config.with_chunk(chunk))
            built[geometry, chunk] = (bound, KdaLayer(bound, max_tokens=4096, options=KdaOptions(stage_buffers=True)))
        return built[geometry, chunk]

    return get


@contextlib.contextmanager
def _options(layer, **changes):
    """The layer under its options with `changes`, then back as it was."""
    previous = layer.options
    layer.options = dataclasses.replace(previous, **changes)
    try:
        yield layer
    finally:
        layer.options = previous


def _option_switch(layer, field: str):
    """switch(state) for _decode_paths: options.<field> True, False, or as it was (None)."""
    previous = layer.options

    def switch(state):
        layer.options = previous if state is None else dataclasses.replace(previous, **{field: state})

    return switch


def device_state(layer, host_state: KdaState | None) -> KdaState:
    cp = _cp()
    if host_state is None:
        return layer.new_state()
    return KdaState(cp.asarray(host_state.conv), cp.asarray(host_state.recurrent))


def check_stages(bound, hidden, gpu_stages, start, chunk, tag, figures):
    """Level 1: each GPU stage against the BF16 oracle fed the GPU's own upstream stages."""
    oracle = KdaOracle(bound, "bf16", xp=_cp())
    fed, fed_state = oracle.fed_stages(hidden, gpu_stages, start, chunk=chunk)
    table = compare_stages(gpu_stages, fed)
    figures.append({"test": tag, "level": "stage", **table.ratios()})
    bad = [row for row in table.rows if not row.rms_ratio <= STAGE_BOUND]
    assert not bad, f"{tag}: stages above {STAGE_BOUND:g} against the fed BF16 oracle:\n{table}"
    return fed_state


def check_end_to_end(bound, hidden, gpu_out, gpu_state, start, tag, figures, oracle_chunk=None):
    """Level 2: final output and state against float64, within 1.5x the BF16 oracle's own error.
    The oracles walk token by token, or chunk-wise with `oracle_chunk` (equal to 1e-15, and
    far faster at long T)."""
    cp = _cp()
    exact, exact_state = KdaOracle(bound, "float64", xp=cp).prefill(hidden, start, chunk=oracle_chunk)
    faithful, faithful_state = KdaOracle(bound, "bf16", xp=cp).prefill(hidden, start, chunk=oracle_chunk)
    for what, ours, ref, floor in (
        ("final_out", gpu_out, exact["final_out"], faithful["final_out"]),
        ("recurrent state", gpu_state.recurrent, exact_state.recurrent, faithful_state.recurrent),
        ("conv state", gpu_state.conv, exact_state.conv, faithful_state.conv),
    ):
        ours_err, floor_err = rms_ratio(ours, ref), rms_ratio(floor, ref)
        bound_err = E2E_FACTOR * floor_err
        figures.append({"test": tag, "level": "end_to_end", "what": what, "ours": ours_err, "bf16_oracle": floor_err})
        assert ours_err <= bound_err, (f"{tag} {what}: rms-ratio {ours_err:.3e} vs float64; the BF16 oracle's own "
                                       f"is {floor_err:.3e}, bound {bound_err:.3e} (ratio {ours_err / max(floor_err, 1e-300):.2f}x)")


def as_float(x):
    """A host BF16 output as float32."""
    return np.asarray(x, dtype=np.float32)


# Every chunk length over every token count, but the longest input only at the default chunk: its
# float64 oracle is most of the suite's time, and chunks 16 and 32 meet many chunks at T=1000 already.
PREFILL_CASES = [(t, c) for t in TOKENS for c in (16, 32, 64) if t < 4096 or c == 64]


@pytest.mark.parametrize("tokens,chunk", PREFILL_CASES, ids=[f"T{t}-C{c}" for t, c in PREFILL_CASES])
@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_prefill_matches_oracle(layers, geometry, tokens, chunk, figures):
    bound, layer = layers(geometry, chunk)
    cfg = bound.config
    start = KdaState.random(cfg, seed=tokens) if tokens in (17, 1000) else None
    hidden = synthetic_hidden(tokens, cfg.hidden, seed=SEED + tokens)
    state = device_state(layer, start)
    out = layer.prefill(hidden, state)
    tag = f"{geometry} T{tokens}-C{chunk}"
    gpu_stages = layer.workspace.stages(tokens)
    fed_state = check_stages(bound, hidden, gpu_stages, start, chunk, tag, figures)
    assert rms_ratio(state.recurrent, fed_state.recurrent) <= STAGE_BOUND, f"{tag}: chunk-scan state vs fed oracle"
    assert np.array_equal(state.conv.get(), np.asarray(fed_state.conv.get(), np.float32)), f"{tag}: conv state"
    check_end_to_end(bound, hidden, out, state, start, tag, figures)


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_decode_512_steps_after_1000_token_prefill(layers, geometry, figures):
    bound, layer = layers(geometry)
    cfg = bound.config
    hidden = synthetic_hidden(1512, cfg.hidden, seed=SEED)
    state = layer.new_state()
    outs = [as_float(layer.prefill(hidden[:1000], state))]
    for t in range(1000, 1512):
        outs.append(as_float(layer.decode(hidden[t], state)))
    cp = _cp()
    exact = KdaOracle(bound, "float64", xp=cp)
    faithful = KdaOracle(bound, "bf16", xp=cp)
    ex_stages, ex_state = exact.prefill(hidden[:1000])
    fa_stages, fa_state = faithful.prefill(hidden[:1000])
    ex_out, fa_out = [ex_stages["final_out"].get()], [fa_stages["final_out"].get()]
    for t in range(1000, 1512):
        s, ex_state = exact.decode(hidden[t], ex_state)
        ex_out.append(s["final_out"].get())
        s, fa_state = faithful.decode(hidden[t], fa_state)
        fa_out.append(s["final_out"].get())
    ours, ref, floor = np.concatenate(outs), np.concatenate(ex_out), np.concatenate(fa_out)
    tail = slice(1000, 1512)
    for what, a, r, f in (("outputs 1000..1511", ours[tail], ref[tail], floor[tail]),
                          ("recurrent state", state.recurrent, ex_state.recurrent, fa_state.recurrent)):
        err, floor_err = rms_ratio(a, r), rms_ratio(f, r)
        figures.append({"test": f"{geometry} decode 512 after 1000", "level": "end_to_end", "what": what,
                        "ours": err, "bf16_oracle": floor_err})
        assert err <= E2E_FACTOR * floor_err, f"{geometry} {what}: {err:.3e} vs BF16 oracle {floor_err:.3e}"


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_decode_stages_match_fed_oracle(layers, geometry, figures):
    bound, layer = layers(geometry)
    cfg = bound.config
    start = KdaState.random(cfg, seed=4)
    state = device_state(layer, start)
    hidden = synthetic_hidden(3, cfg.hidden, seed=5)
    host = start
    for t in range(3):
        layer.decode(hidden[t], state)
        gpu = layer.workspace.stages(1)
        fed_state = check_stages(bound, hidden[t : t + 1], gpu, host, None, f"{geometry} decode row {t}", figures)
        assert rms_ratio(state.recurrent, fed_state.recurrent) <= STAGE_BOUND
        host = KdaState(state.conv.get(), state.recurrent.get())


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_decode_k_is_bit_identical_to_decode(layers, geometry):
    cp = _cp()
    bound, layer = layers(geometry)
    cfg = bound.config
    start = KdaState.random(cfg, seed=8)
    hidden = cp.asarray(synthetic_hidden(16, cfg.hidden, seed=9).view(np.uint16)).view(layer.workspace.final_out.dtype)
    for k in range(1, 17):
        serial = device_state(layer, start)
        serial_outs, serial_states = [], []
        for row in range(k):
            serial_outs.append(layer.decode(hidden[row : row + 1], serial))
            serial_states.append(KdaState(serial.conv.copy(), serial.recurrent.copy()))
        batched = device_state(layer, start)
        snapshots = [layer.new_state() for _ in range(k)]
        out = layer.decode_k(hidden[:k], batched, snapshots=snapshots)
        serial_out = cp.concatenate(serial_outs)
        differ = int(cp.count_nonzero(out.view(cp.uint16) != serial_out.view(cp.uint16)))
        assert differ == 0, f"{geometry} K={k}: {differ} output elements differ"
        # Without snapshots the fused step walks the K rows in one launch.
        walked = device_state(layer, start)
        walked_out = layer.decode_k(hidden[:k], walked)
        differ = int(cp.count_nonzero(walked_out.view(cp.uint16) != serial_out.view(cp.uint16)))
        assert differ == 0, f"{geometry} K={k}, one walk: {differ} output elements differ"
        for name in ("recurrent", "conv"):
            a, b = getattr(walked, name), getattr(serial, name)
            assert int(cp.count_nonzero(a.view(cp.uint32) != b.view(cp.uint32))) == 0, f"K={k} walk final {name} state"
        for name in ("recurrent", "conv"):
            a, b = getattr(batched, name), getattr(serial, name)
            assert int(cp.count_nonzero(a.view(cp.uint32) != b.view(cp.uint32))) == 0, f"K={k} final {name} state"
        for i, (snap, ref) in enumerate(zip(snapshots, serial_states)):
            for name in ("recurrent", "conv"):
                a, b = getattr(snap, name), getattr(ref, name)
                assert int(cp.count_nonzero(a.view(cp.uint32) != b.view(cp.uint32))) == 0, f"K={k} snapshot {i} {name}"


@pytest.mark.parametrize("poison", [float("nan"), 1e30], ids=["nan", "1e30"])
@pytest.mark.parametrize("tokens,chunk", [(1, 16), (17, 16), (65, 64), (1000, 32)], ids=lambda v: str(v))
def test_poisoned_pad_changes_no_bit(layers, tokens, chunk, poison):
    bound, layer = layers("kimi", chunk)
    cfg = bound.config
    start = KdaState.random(cfg, seed=1)
    hidden = synthetic_hidden(tokens, cfg.hidden, seed=2)
    runs = []
    for pad in (0.0, poison):
        state = device_state(layer, start)
        out = layer.prefill(hidden, state, pad_value=pad)
        runs.append((out.view(np.uint16), state.recurrent.get().view(np.uint32), state.conv.get().view(np.uint32),
                     layer.workspace.core[:tokens].get().view(np.uint32)))
    for what, a, b in zip(("output", "recurrent state", "conv state", "core"), runs[0], runs[1]):
        differ = int(np.count_nonzero(np.asarray(a) != np.asarray(b)))
        assert differ == 0, f"T{tokens}-C{chunk} pad={poison}: {differ} bits of the {what} differ"


def test_conv_taps_in_kqv_order_fail_at_the_conv_stage(layers, tmp_path):
    from glm_kda.checkpoint import bind_layer
    from glm_kda.gpu.layer import KdaLayer

    bound, _ = layers("kimi")
    faulty_dir = write_synthetic_checkpoint(tmp_path / "kqv", "kimi", num_layers=1, conv_order=("k", "q", "v"))
    faulty = KdaLayer(bind_layer(faulty_dir, 0, progress=False), options=KdaOptions(stage_buffers=True))
    hidden = synthetic_hidden(40, bound.config.hidden, seed=3)
    faulty.prefill(hidden, faulty.new_state())
    gpu = faulty.workspace.stages(40)
    truth, _ = KdaOracle(bound, "bf16", xp=_cp()).prefill(hidden)
    table = compare_stages(gpu, truth)
    assert table.first_above(0.1) == "conv_out", f"the k,q,v fault must first show at conv_out:\n{table}"


def test_bad_calls_raise_before_any_launch(layers):
    cp = _cp()
    bound, layer = layers("kimi")
    cfg = bound.config
    state = device_state(layer, KdaState.random(cfg, seed=3))
    before = (state.conv.copy(), state.recurrent.copy())
    good = synthetic_hidden(4, cfg.hidden)
    cases = {
        "dtype float32": (lambda: layer.prefill(good.astype(np.float32), state), "BF16"),
        "wrong width": (lambda: layer.prefill(synthetic_hidden(4, cfg.hidden + 8), state), str(cfg.hidden)),
        "too many rows": (lambda: layer.prefill(synthetic_hidden(layer.max_tokens + 1, cfg.hidden), state), "rows"),
        "decode_k 17 rows": (lambda: layer.decode_k(synthetic_hidden(17, cfg.hidden), state), "1..16"),
        "non-contiguous": (lambda: layer.prefill(cp.asarray(synthetic_hidden(8, cfg.hidden).view(np.uint16))[::2].view(layer.workspace.final_out.dtype), state), "contiguous"),
        "other geometry state": (lambda: layer.decode(good[0], KdaState.zeros(dataclasses.replace(cfg, heads=cfg.heads // 2), cp)), "state.conv"),
    }
    for name, (call, needle) in cases.items():
        with pytest.raises((TypeError, ValueError)) as info:
            call()
        assert needle in str(info.value), f"{name}: message {info.value!r} does not name {needle!r}"
        assert cp.array_equal(state.conv, before[0]) and cp.array_equal(state.recurrent, before[1]), f"{name} mutated the state"


def test_torch_tensors_pass_through_dlpack(layers):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    bound, layer = layers("kimi")
    host = synthetic_hidden(3, bound.config.hidden, seed=4)
    as_torch = torch.from_numpy(host.view(np.int16)).cuda().view(torch.bfloat16)
    a_state, b_state = layer.new_state(), layer.new_state()
    out_torch = layer.prefill(as_torch, a_state)
    out_cupy = layer.prefill(host, b_state)
    assert isinstance(out_torch, torch.Tensor) and out_torch.dtype == torch.bfloat16
    assert np.array_equal(out_torch.view(torch.int16).cpu().numpy(), np.asarray(out_cupy).view(np.int16))


def test_timing_reports_sections_and_kernels(layers):
    from glm_kda.gpu import build as kernels

    _, layer = layers("kimi")
    hidden = synthetic_hidden(64, layer.config.hidden)
    state = layer.new_state()
    with layer.timing() as timer:
        layer.prefill(hidden, state)
        layer.decode(hidden[0], state)
    summary = timer.summary()
    # Kimi's softplus law: the unbounded tensor-core prepare forming the gate itself, then the scan.
    assert "kda_gate_beta_f32" not in summary, f"the gate kernel ran beside the gate-forming prepare: {sorted(summary)}"
    for name in ("[front_end]", "[recurrence]", "[back_end]", "kda_chunk_tc_prepare_unbounded_gate_f32",
                 "kda_chunk_tc_scan_f32", "kda_decode_fused_bf16"):
        assert name in summary and summary[name] > 0, f"{name} missing from timing: {sorted(summary)}"
    # The decode projections: gemm_rows' packed-weight entry points (layer.options.packed_weights, the default).
    prefix = "kda_gemm_rows_packed_bf16_m" if layer.options.packed_weights else "gemm_rows_bf16_m"
    assert any(name.startswith(prefix) and time > 0 for name, time in summary.items()), \
        f"no {prefix}* entry point in timing: {sorted(summary)}"
    assert kernels.current_context().timer is None


def _bits(x):
    cp = _cp()
    x = x if isinstance(x, cp.ndarray) else cp.asarray(np.asarray(x).view(np.uint16) if np.asarray(x).dtype.itemsize == 2 else np.asarray(x))
    return x.view(cp.uint16 if x.dtype.itemsize == 2 else cp.uint32)


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_batched_decode_is_batch_invariant(layers, geometry):
    """Every sequence gets the same output and state bits alone (B=1) as in batches of
    3, 16, 64 and 256 with shuffled slot order, and as through the single-state API."""
    from glm_kda.state import StatePool

    cp = _cp()
    bound, layer = layers(geometry)
    cfg = bound.config
    count = 256
    rng = np.random.default_rng(21)
    bf16 = layer.workspace.final_out.dtype
    hidden = cp.asarray(synthetic_hidden(count, cfg.hidden, seed=22).view(np.uint16))  # raw bits: indexable
    start_conv = cp.asarray(rng.standard_normal((count,) + cfg.conv_state_shape).astype(np.float32))
    start_rec = cp.asarray((0.1 * rng.standard_normal((count,) + cfg.recurrent_state_shape)).astype(np.float32))
    pool = StatePool(cfg, count)

    def run(batch):
        pool.conv[...] = start_conv
        pool.recurrent[...] = start_rec
        order = rng.permutation(count)
        outs = cp.empty((count, cfg.hidden), dtype=cp.uint16)
        for first in range(0, count, batch):
            seqs = order[first : first + batch]
            slots = cp.asarray(seqs.astype(np.int32))
            outs[slots] = layer.decode(hidden[slots].view(bf16), pool, slots).view(cp.uint16)
        return outs, pool.conv.copy(), pool.recurrent.copy()

    alone = run(1)
    for batch in (3, 16, 64, 256):
        together = run(batch)
        for what, a, b in zip(("outputs", "conv states", "recurrent states"), alone, together):
            differ = int(cp.count_nonzero(_bits(a) != _bits(b)))
            assert differ == 0, f"{geometry} B={batch}: {differ} elements of the {what} differ from B=1"
    single = KdaState(start_conv[5].copy(), start_rec[5].copy())
    out = layer.decode(hidden[5:6].view(bf16), single)
    assert int(cp.count_nonzero(_bits(out[0]) != _bits(alone[0][5]))) == 0, "single-state decode differs from the pool"
    assert int(cp.count_nonzero(_bits(single.recurrent) != _bits(alone[2][5]))) == 0


def _decode_paths(layer, count: int, rows: int, walk_rows: int, prefill_rows: int, seed: int, switch) -> dict:
    """Every stage buffer, output and state of a `rows`-sequence pool step (shuffled slots of a
    pool of `count`), a `walk_rows`-row decode_k walk and (prefill_rows > 0) a prefill of that
    many tokens, all from the same random start, once with switch(True) and once with
    switch(False) in effect (switch(None) restores the layer): (results True, results False)."""
    from glm_kda.reference import STAGE_ORDER
    from glm_kda.state import StatePool

    cp = _cp()
    cfg = layer.config
    rng = np.random.default_rng(seed)
    bf16 = layer.workspace.final_out.dtype
    hidden = cp.asarray(synthetic_hidden(rows, cfg.hidden, seed=seed + 1).view(np.uint16)).view(bf16)
    start_conv = cp.asarray(rng.standard_normal((count,) + cfg.conv_state_shape).astype(np.float32))
    start_rec = cp.asarray((0.1 * rng.standard_normal((count,) + cfg.recurrent_state_shape)).astype(np.float32))
    slots = cp.asarray(rng.permutation(count)[:rows].astype(np.int32))
    start = KdaState.random(cfg, seed=seed + 2)

    def run(setting: bool) -> dict:
        switch(setting)
        try:
            pool = StatePool(cfg, count)
            pool.conv[...] = start_conv
            pool.recurrent[...] = start_rec
            results = {"pool output": layer.decode(hidden, pool, slots)}
            results.update({f"pool {name}": getattr(layer.workspace, name)[:rows].copy() for name in STAGE_ORDER})
            results.update({"pool conv state": pool.conv, "pool recurrent state": pool.recurrent})
            state = device_state(layer, start)
            results["decode_k output"] = layer.decode_k(hidden[:walk_rows], state)
            results.update({"decode_k conv state": state.conv, "decode_k recurrent state": state.recurrent})
            if prefill_rows:
                prefilled = device_state(layer, start)
                results["prefill output"] = layer.prefill(hidden[:prefill_rows], prefilled)
                results.update({"prefill conv state": prefilled.conv, "prefill recurrent state": prefilled.recurrent})
            return results
        finally:
            switch(None)

    return run(True), run(False)


def _assert_same_bits(ours: dict, theirs: dict, tag: str, between: str) -> None:
    cp = _cp()
    assert ours.keys() == theirs.keys()
    for what in ours:
        differ = int(cp.count_nonzero(_bits(ours[what]) != _bits(theirs[what])))
        assert differ == 0, f"{tag} {what}: {differ} of {ours[what].size} elements differ between {between}"


def _one_sequence_calls(layer, seed: int, after_call=lambda what: None) -> dict:
    """Every stage buffer, output and state over 6 decode steps of one state, a 5-row decode_k walk
    and one row of a 4-slot pool in a shuffled slot, from random starts (seed); after_call(what) runs
    after each call."""
    from glm_kda.reference import STAGE_ORDER
    from glm_kda.state import StatePool

    cp = _cp()
    cfg = layer.config
    rows, count = 5, 4
    bf16 = layer.workspace.final_out.dtype
    hidden = cp.asarray(synthetic_hidden(6, cfg.hidden, seed=seed).view(np.uint16)).view(bf16)
    start = KdaState.random(cfg, seed=seed + 1)
    rng = np.random.default_rng(seed + 2)
    start_conv = cp.asarray(rng.standard_normal((count,) + cfg.conv_state_shape).astype(np.float32))
    start_rec = cp.asarray((0.1 * rng.standard_normal((count,) + cfg.recurrent_state_shape)).astype(np.float32))
    slot = cp.asarray(np.array([1 + seed % (count - 1)], np.int32))
    results = {}
    state = device_state(layer, start)
    for t in range(6):
        results[f"decode step {t} output"] = layer.decode(hidden[t : t + 1], state)
        after_call(f"decode step {t}")
    results.update({f"decode {name}": getattr(layer.workspace, name)[:1].copy() for name in STAGE_ORDER})
    results.update({"decode conv state": state.conv, "decode recurrent state": state.recurrent})
    walk = device_state(layer, start)
    results["decode_k output"] = layer.decode_k(hidden[:rows], walk)
    after_call("decode_k")
    results.update({f"decode_k {name}": getattr(layer.workspace, name)[:rows].copy() for name in STAGE_ORDER})
    results.update({"decode_k conv state": walk.conv, "decode_k recurrent state": walk.recurrent})
    pool = StatePool(cfg, count)
    pool.conv[...] = start_conv
    pool.recurrent[...] = start_rec
    results["pool output"] = layer.decode(hidden[:1], pool, slot)
    after_call("pool row")
    results.update({"pool conv state": pool.conv, "pool recurrent state": pool.recurrent})
    return results


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_packed_decode_weights_give_the_row_major_bits(layers, geometry):
    """layer.options.packed_weights (the decode projections read gemm_rows' packed copies of the
    weights) writes the bits of the row-major weights: every stage buffer, the output and both
    states of a 64-sequence pool step with shuffled slots, of a 5-row decode_k walk and of a
    10-token prefill (which takes the decode projections)."""
    _, layer = layers(geometry)
    switch = _option_switch(layer, "packed_weights")

    packed, row_major = _decode_paths(layer, count=80, rows=64, walk_rows=5, prefill_rows=10, seed=61, switch=switch)
    _assert_same_bits(packed, row_major, geometry, "the packed and the row-major decode weights")


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_o_proj_sums_keep_the_bits_and_round_to_them(layers, geometry):
    """layer.o_proj_sums (a tensor-parallel rank's FP32 partial output): decode-side calls write the
    bits they write without it (every stage buffer, output and state of a 64-sequence pool step, a
    5-row walk and a 9-token prefill), and in every call the sums round (nearest even) to the output
    it returns: one-row decode (eager, captured, replayed), the walk, the pool step, a 40-token
    prefill (cuBLAS, FP32 result) within the oracle bound of the plain prefill. A bad buffer is
    refused naming what is wrong, and the layer keeps its sums unset."""
    import ml_dtypes

    from glm_kda.state import StatePool

    cp = _cp()
    _, layer = layers(geometry)
    cfg = layer.config
    sums = cp.full((layer.max_tokens, cfg.hidden), cp.nan, cp.float32)

    def switch(on):
        layer.o_proj_sums = sums if on else None

    with_sums, plain = _decode_paths(layer, count=80, rows=64, walk_rows=5, prefill_rows=9, seed=91, switch=switch)
    _assert_same_bits(with_sums, plain, geometry, "o_proj with and without its FP32 sums")

    def rounded(rows):
        return cp.asarray(sums[:rows].get().astype(ml_dtypes.bfloat16).view(np.uint16))

    bf16 = layer.workspace.final_out.dtype
    hidden = cp.asarray(synthetic_hidden(64, cfg.hidden, seed=92).view(np.uint16)).view(bf16)
    state = device_state(layer, KdaState.random(cfg, seed=93))
    switch(True)
    try:
        for t in range(3):  # eager, captured, replayed
            out = layer.decode(hidden[t : t + 1], state)
            differ = int(cp.count_nonzero(_bits(out) != rounded(1)))
            assert differ == 0, f"decode call {t}: {differ} outputs differ from the rounded sums"
        out = layer.decode_k(hidden[:5], state)
        assert int(cp.count_nonzero(_bits(out) != rounded(5))) == 0, "decode_k: outputs differ from the rounded sums"
        pool = StatePool(cfg, 80)
        out = layer.decode(hidden, pool, cp.arange(64, dtype=cp.int32))
        assert int(cp.count_nonzero(_bits(out) != rounded(64))) == 0, "pool step: outputs differ from the rounded sums"
        prompt = cp.asarray(synthetic_hidden(40, cfg.hidden, seed=94).view(np.uint16)).view(bf16)
        out = layer.prefill(prompt, device_state(layer, KdaState.random(cfg, seed=95)))
        assert int(cp.count_nonzero(_bits(out) != rounded(40))) == 0, "prefill: outputs differ from the rounded sums"
    finally:
        switch(False)
    reference = layer.prefill(prompt, device_state(layer, KdaState.random(cfg, seed=95)))
    def widened(x):
        return (_bits(x).astype(cp.uint32) << 16).view(cp.float32).get()

    ratio = rms_ratio(widened(out), widened(reference))
    assert ratio <= 1e-3, f"prefill with FP32 sums {ratio:.3e} from the plain prefill (cuBLAS)"
    for bad, error, match in ((sums.astype(cp.float16), TypeError, "^o_proj_sums: expected a CuPy float32"),
                              (sums[:-1], ValueError, "^o_proj_sums: expected a C-contiguous"),
                              (sums[:, ::2], ValueError, "^o_proj_sums: expected a C-contiguous")):
        with pytest.raises(error, match=match):
            layer.o_proj_sums = bad
        assert layer.o_proj_sums is None


def test_graph_replay_equals_eager_and_recaptures_on_new_pointers(layers):
    cp = _cp()
    bound, layer = layers("kimi")
    cfg = bound.config
    hidden = cp.asarray(synthetic_hidden(6, cfg.hidden, seed=30).view(np.uint16)).view(layer.workspace.final_out.dtype)
    start = KdaState.random(cfg, seed=31)
    graphed, eager = device_state(layer, start), device_state(layer, start)
    # Freed arrays' addresses come back from the pool: a graph captured by an earlier test for the
    # same pointers would be reused (correctly). Start from an empty cache to count captures.
    layer.graphs.clear()
    captures = layer.graphs.captures
    outs_graph, outs_eager = [], []
    for t in range(5):
        outs_graph.append(layer.decode(hidden[t : t + 1], graphed))
    with _options(layer, graphs=False):
        for t in range(5):
            outs_eager.append(layer.decode(hidden[t : t + 1], eager))
            if t == 1:
                eager_after_two = eager.recurrent.copy()
    assert layer.graphs.captures == captures + 1, "one capture for one (kind, rows, state) key"
    for t in range(5):
        assert int(cp.count_nonzero(_bits(outs_graph[t]) != _bits(outs_eager[t]))) == 0, f"step {t} output"
    assert int(cp.count_nonzero(_bits(graphed.recurrent) != _bits(eager.recurrent))) == 0
    other = device_state(layer, start)
    layer.decode(hidden[0:1], other)
    layer.decode(hidden[1:2], other)
    assert layer.graphs.captures == captures + 2, "a new state (new pointers) is captured afresh"
    assert int(cp.count_nonzero(_bits(other.recurrent) != _bits(eager_after_two))) == 0, "recaptured graph state"


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_host_slots_give_the_device_slots_bits_back_to_back(layers, graphs):
    """Pool decode with host slots (uploaded through the pinned buffers used in turn) gives
    every output and state bit of the same calls with device slots, over more back-to-back
    calls (no synchronisation between them) than there are pinned buffers, each call with
    other slots."""
    from glm_kda.gpu.workspace import PinnedUploads
    from glm_kda.state import StatePool

    cp = _cp()
    bound, layer = layers("glm")
    cfg = bound.config
    count, batch, calls = 16, 4, 12
    rng = np.random.default_rng(41)
    bf16 = layer.workspace.final_out.dtype
    hidden = cp.asarray(synthetic_hidden(calls * batch, cfg.hidden, seed=42).view(np.uint16)).view(bf16)
    start_conv = cp.asarray(rng.standard_normal((count,) + cfg.conv_state_shape).astype(np.float32))
    start_rec = cp.asarray((0.1 * rng.standard_normal((count,) + cfg.recurrent_state_shape)).astype(np.float32))
    orders = [rng.permutation(count)[:batch] for _ in range(calls)]
    assert calls > len(PinnedUploads(4).buffers), "the calls must reuse every pinned buffer"

    def run(device: bool):
        pool = StatePool(cfg, count)
        pool.conv[...] = start_conv
        pool.recurrent[...] = start_rec
        cp.cuda.get_current_stream().synchronize()
        outs = []
        for i, order in enumerate(orders):
            slots = cp.asarray(order.astype(np.int32)) if device else [int(s) for s in order]
            outs.append(layer.decode(hidden[i * batch : (i + 1) * batch], pool, slots))
        return cp.stack(outs), pool.conv, pool.recurrent

    with _options(layer, graphs=graphs):
        run(False)  # the first calls of each key run eagerly, the second capture
        from_host, from_device = run(False), run(True)
    for what, a, b in zip(("outputs", "conv states", "recurrent states"), from_host, from_device):
        differ = int(cp.count_nonzero(_bits(a) != _bits(b)))
        assert differ == 0, f"{differ} elements of the {what} differ between host and device slots"


@pytest.mark.parametrize("in_graph", [True, False], ids=["copies_in_graph", "copies_beside"])
def test_graph_copies_follow_each_calls_arrays(layers, in_graph):
    """Graphed decode and decode_k calls issued back to back, each on rows of a new array (new
    addresses) and each returning a new array, give the eager calls' bits; with the copies as
    graph nodes, every graph holds them (the driver repointed them per call) and nothing
    fell back."""
    import warnings

    cp = _cp()
    bound, layer = layers("kimi")
    cfg = bound.config
    bf16 = layer.workspace.final_out.dtype
    rows_of = [1, 1, 4, 1, 4, 4, 1, 1, 4, 1]
    hidden = [cp.asarray(synthetic_hidden(rows, cfg.hidden, seed=50 + i).view(np.uint16)).view(bf16)
              for i, rows in enumerate(rows_of)]
    start = device_state(layer, KdaState.random(cfg, seed=51))
    state = device_state(layer, KdaState.random(cfg, seed=51))  # one state: the graphs' keys stay

    def run():
        state.conv[...] = start.conv
        state.recurrent[...] = start.recurrent
        cp.cuda.get_current_stream().synchronize()
        outs = [layer.decode(h, state) if h.shape[0] == 1 else layer.decode_k(h, state) for h in hidden]
        return outs, KdaState(state.conv.copy(), state.recurrent.copy())

    layer.graphs.clear()
    layer.graphs.copies_in_graph = in_graph  # (False is what a driver that cannot repoint them gets)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback warns: fail on it
            run()  # the first call of each key runs eagerly, the second captures
            graphed, graphed_state = run()
        graphs = list(layer.graphs.graphs.values())
        with _options(layer, graphs=False):
            eager, eager_state = run()
    finally:
        layer.graphs.clear()
        layer.graphs.copies_in_graph = True
    assert graphs, "no graph was captured"
    with_copies = [graph.copies is not None for graph in graphs]
    assert all(with_copies) if in_graph else not any(with_copies), f"copy nodes per graph: {with_copies}"
    for i, (a, b) in enumerate(zip(graphed, eager)):
        assert a.data.ptr not in {o.data.ptr for o in graphed[:i]}, f"call {i} returned an earlier call's array"
        differ = int(cp.count_nonzero(_bits(a) != _bits(b)))
        assert differ == 0, f"call {i} ({rows_of[i]} rows): {differ} output elements differ from eager"
    for what in ("conv", "recurrent"):
        differ = int(cp.count_nonzero(_bits(getattr(graphed_state, what)) != _bits(getattr(eager_state, what))))
        assert differ == 0, f"{differ} elements of the {what} state differ from eager"


def test_copy_into_memcpy_and_strided_fallback():
    """The decode calls' input and output copies: a memcpy for contiguous arrays, the
    element-wise copy for strided ones, the same values; a shape or dtype mismatch is refused
    before anything is written."""
    from glm_kda.gpu.arrays import copy_into, copy_of

    cp = _cp()
    src = cp.arange(48, dtype=cp.int32).reshape(6, 8)
    dst = cp.full((6, 8), -1, cp.int32)
    copy_into(dst, src)
    assert bool((dst == src).all())
    strided = cp.full((6, 16), -1, cp.int32)[:, ::2]
    copy_into(strided, src)
    assert bool((strided == src).all()) and not strided.flags.c_contiguous
    out = copy_of(src[1:4])
    assert out.flags.c_contiguous and out.data.ptr != src.data.ptr and bool((out == src[1:4]).all())
    untouched = cp.full((6, 8), -1, cp.int32)
    for bad in (cp.zeros((6, 7), cp.int32), cp.zeros((6, 8), cp.float32)):
        with pytest.raises(ValueError, match="copy_into"):
            copy_into(untouched, bad)
    assert int((untouched == -1).sum()) == 48, "a refused copy wrote into its destination"


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
@pytest.mark.parametrize("tokens", [65, 1000], ids=lambda t: f"T{t}")
def test_tensor_core_prefill_path_matches_oracle(layers, geometry, tokens, figures):
    """chunk_impl="tensor" (TF32 mma chunk kernels; GLM's bounded law takes the bounded
    prepare, Kimi's softplus law the unbounded one): the same end-to-end bound as the FP32
    path, and its core and state within 1e-3 of the FP32 kernels' on the same inputs."""
    from glm_kda.chunk_model import prepare_lower_bound
    from glm_kda.gpu.layer import KdaLayer

    bound, shared_layer = layers(geometry)
    assert (prepare_lower_bound(bound.config) is None) == (geometry == "kimi")
    layer = KdaLayer(bound, options=KdaOptions(chunk_impl="tensor"))
    reference_layer = KdaLayer(bound, options=KdaOptions(chunk_impl="fp32"))
    start = KdaState.random(bound.config, seed=tokens)
    hidden = synthetic_hidden(tokens, bound.config.hidden, seed=SEED + 7 * tokens)
    fp32_state = device_state(reference_layer, start)
    reference_layer.prefill(hidden, fp32_state)
    fp32_core = reference_layer.workspace.core[:tokens].get()
    state = device_state(layer, start)
    out = layer.prefill(hidden, state)
    tensor_core = layer.workspace.core[:tokens].get()
    ratio = rms_ratio(tensor_core, fp32_core)
    state_ratio = float(rms_ratio(state.recurrent, fp32_state.recurrent))
    figures.append({"test": f"{geometry} tensor-core prefill T{tokens}", "level": "stage", "core_vs_fp32_path": ratio,
                    "recurrent_vs_fp32_path": state_ratio})
    assert ratio <= STAGE_BOUND, f"{geometry} T{tokens}: tensor-core core vs FP32 path rms-ratio {ratio:.3e}"
    assert state_ratio <= STAGE_BOUND, f"{geometry} T{tokens}: tensor-core state vs FP32 path {state_ratio:.3e}"
    check_end_to_end(bound, hidden, out, state, start, f"{geometry} tensor-core T{tokens}", figures)


def test_tensor_core_prefill_path_refuses_another_chunk(layers):
    from glm_kda.gpu.layer import KdaLayer

    bound, reference_layer = layers("kimi", 32)
    assert reference_layer.chunk_impl == "fp32", "chunk 32 has no tensor-core path: auto takes the FP32 kernels"
    with pytest.raises(ValueError, match="chunk_impl='tensor'.*chunk=32"):
        KdaLayer(bound, options=KdaOptions(chunk_impl="tensor"))


PACKED_LENGTHS = [1, 17, 64, 100, 1000, 3, 4096, 250]


@pytest.mark.parametrize("segment", [None, "windows", 1024], ids=["one_pass", "windows", "segments_of_1024"])
@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_packed_prefill_equals_solo_prefills(layers, geometry, segment, figures, monkeypatch):
    """8 sequences of lengths 1..4096 packed in one call: each sequence's output and states
    (in its own, shuffled slot of a larger pool) within the end-to-end oracle bound, and
    within twice that bound of its solo prefill; the slots not named are left untouched. One
    pass: through a workspace holding every row; "windows": through a lean workspace of every row,
    whose middle runs in windows of 4096 rows (at either geometry, so that the sequences cross
    windows); a number: through a workspace of that many rows, the sequences crossing segments."""
    from glm_kda.gpu import workspace as workspaces
    from glm_kda.gpu.layer import KdaLayer
    from glm_kda.gpu.workspace import KdaWorkspace
    from glm_kda.state import StatePool

    cp = _cp()
    bound, _ = layers(geometry)
    cfg = bound.config
    rng = np.random.default_rng(31)
    total = sum(PACKED_LENGTHS)
    rows = segment if isinstance(segment, int) else total
    monkeypatch.setattr(workspaces, "MIDDLE_ELEMENTS", 4096 * cfg.qkv)
    workspace = KdaWorkspace(cfg, rows, stage_buffers=segment is None)
    assert (workspace.middle_rows < total) == (segment is not None)
    layer = KdaLayer(bound, max_tokens=total, workspace=workspace)
    bounds = np.concatenate([[0], np.cumsum(PACKED_LENGTHS)])
    hidden = synthetic_hidden(total, cfg.hidden, seed=SEED + 5)
    pool = StatePool(cfg, 12)
    starts = [KdaState.random(cfg, seed=40 + i) for i in range(len(pool))]
    for slot, start in enumerate(starts):
        pool.conv[slot] = cp.asarray(start.conv)
        pool.recurrent[slot] = cp.asarray(start.recurrent)
    slots = rng.permutation(len(pool))[: len(PACKED_LENGTHS)]
    out = as_float(layer.prefill(hidden, pool, slots=slots, cu_seqlens=bounds))
    cases = len(figures)
    for i, (first, last) in enumerate(zip(bounds[:-1], bounds[1:])):
        slot, tag = int(slots[i]), f"{geometry} packed seq{i} T{last - first} slot{slots[i]}"
        state = pool.state(slot)
        check_end_to_end(bound, hidden[first:last], out[first:last], state, starts[slot], tag, figures)
        floors = {row["what"]: row["bf16_oracle"] for row in figures[cases:] if row["test"] == tag}
        # The solo prefill of a sequence of <= 16 rows takes the decode-side projection kernel,
        # the packed call cuBLAS: two roundings, each within E2E_FACTOR of the BF16 oracle's
        # own error, so at most twice that apart.
        solo_state = device_state(layer, starts[slot])
        solo = as_float(layer.prefill(hidden[first:last], solo_state))
        for what, a, b in (("final_out", out[first:last], solo), ("recurrent state", state.recurrent, solo_state.recurrent),
                           ("conv state", state.conv, solo_state.conv)):
            ratio, limit = rms_ratio(a, b), 2 * E2E_FACTOR * floors[what]
            assert ratio <= limit, (f"{tag}: packed vs solo {what} rms-ratio {ratio:.3e}; bound {limit:.3e} "
                                    f"(twice {E2E_FACTOR}x the BF16 oracle's own {floors[what]:.3e})")
    for slot in sorted(set(range(len(pool))) - set(slots.tolist())):
        assert np.array_equal(pool.conv[slot].get(), starts[slot].conv), f"slot {slot} not named but its conv state changed"
        assert np.array_equal(pool.recurrent[slot].get(), starts[slot].recurrent), f"slot {slot}: recurrent state changed"


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_prefill_in_segments_gives_the_bits_of_one_pass(layers, geometry, monkeypatch):
    """A prefill recording every stage buffer, one that writes only what its kernels read, one longer
    than its workspace (1000 rows through 256: segments of 256, 256, 256 and 232), and one whose
    middle runs in windows of 256 rows of a lean workspace (MIDDLE_ELEMENTS set to 256 rows here;
    recording or not) write the same bits: output, conv and recurrent state, from a random state. So do a
    packed prefill through segments of 256 rows and one through windows of 256 rows (both split the runs at
    the same rows). The projections run on tests/tiled_gemm.py's kernel, whose sums do not depend on
    the row count: cuBLAS may choose another algorithm for 256 rows than for 1000 (it did, at GLM
    geometry on an H100). workspace.stages refuses what the last three leave unrecorded; a workspace
    too small for a pool decode of the layer is refused by name."""
    from tiled_gemm import tiled_gemm_bf16

    from glm_kda.gpu import ops, workspace as workspaces
    from glm_kda.gpu.layer import KdaLayer
    from glm_kda.gpu.workspace import KdaWorkspace
    from glm_kda.state import StatePool

    monkeypatch.setattr(ops, "gemm_bf16_cublas", tiled_gemm_bf16)
    bound, _ = layers(geometry)
    cfg, tokens = bound.config, 1000
    hidden = synthetic_hidden(tokens, cfg.hidden, seed=SEED + 13)
    start = KdaState.random(cfg, seed=17)
    full = KdaWorkspace(cfg, tokens, stage_buffers=True)
    monkeypatch.setattr(workspaces, "MIDDLE_ELEMENTS", 256 * cfg.qkv)
    windowed = KdaWorkspace(cfg, tokens)
    assert windowed.middle_rows == 256 and full.middle_rows == 1024
    cases = {"one pass, recorded": (full, True, None), "one pass": (full, False, "stage_buffers=False"),
             "segments": (KdaWorkspace(cfg, 256, stage_buffers=True), False, "segments of 256 rows"),
             "windows": (windowed, False, "stage_buffers=False"),
             "windows, recording": (windowed, True, "windows of 256 rows")}
    runs = {}
    for case, (workspace, record, refusal) in cases.items():
        layer = KdaLayer(bound, max_tokens=tokens, workspace=workspace, options=KdaOptions(stage_buffers=record))
        state = device_state(layer, start)
        out = layer.prefill(hidden, state)
        runs[case] = {"output": out, "conv state": state.conv, "recurrent state": state.recurrent}
        if refusal is None:
            assert layer.workspace.stages(tokens)["conv_out"].shape == (tokens, cfg.conv_dim)
        else:
            with pytest.raises(ValueError, match=refusal):
                layer.workspace.stages(1)
    for case in list(cases)[1:]:
        _assert_same_bits(runs[case], runs["one pass, recorded"], geometry, f"{case} and one recorded pass")
    bounds, slots = [0, 100, 317, 700, 1000], [2, 0, 3, 1]
    packed = {}
    for case in ("segments", "windows"):
        layer = KdaLayer(bound, max_tokens=tokens, workspace=cases[case][0])
        pool = StatePool(cfg, 4)
        for slot in range(4):
            pool.conv[slot], pool.recurrent[slot] = (_cp().asarray(x) for x in (start.conv, start.recurrent))
        out = layer.prefill(hidden, pool, slots=slots, cu_seqlens=bounds)
        packed[case] = {"output": out, "conv states": pool.conv, "recurrent states": pool.recurrent}
    _assert_same_bits(packed["windows"], packed["segments"], geometry, "packed through windows and through segments")
    with pytest.raises(ValueError, match="workspace: 100 rows, under the 256"):
        KdaLayer(bound, max_tokens=tokens, workspace=KdaWorkspace(cfg, 100))


def test_packed_prefill_refuses_bad_lengths_and_slots_before_any_launch(layers):
    from glm_kda.state import StatePool

    bound, layer = layers("kimi")
    cfg = bound.config
    pool = StatePool(cfg, 4)
    pool.recurrent[...] = 0.5
    hidden = synthetic_hidden(10, cfg.hidden, seed=1)
    bad = [
        (dict(slots=[0, 1], cu_seqlens=[0, 4, 9]), "end at the 10 rows"),
        (dict(slots=[0, 1], cu_seqlens=[0, 0, 10]), "strictly increase"),
        (dict(slots=[0, 0], cu_seqlens=[0, 4, 10]), "repeats a slot"),
        (dict(slots=[0, 4], cu_seqlens=[0, 4, 10]), "outside this pool"),
        (dict(slots=[0], cu_seqlens=[0, 4, 10]), "expected 2 integer slots"),
        (dict(slots=[0, 1]), "needs cu_seqlens"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            layer.prefill(hidden, pool, **kwargs)
    assert float(pool.recurrent.min()) == 0.5 == float(pool.recurrent.max()), "a refused call changed the pool"


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [16384, 65536], ids=lambda t: f"T{t}")
def test_tensor_core_prefill_long_sequences(layers, tokens, figures):
    """The default (tensor-core) path on GLM geometry at long T, from a random state: core and
    both states within the stage bound of the FP32 reference kernels on the same inputs (the
    TF32 error does not grow with T); at T=16384 also output and states within the end-to-end
    bound against the float64 oracle (at 65536 the oracle's float64 stage buffers would not
    fit beside the workspace). The BF16 block output is not compared with the FP32 path's:
    two roundings of o_norm_out apart, they differ by about a BF16 ulp wherever a rounding
    flips (2.3e-3 measured), which the end-to-end check bounds instead. A lean workspace, whose
    middle runs in windows of the lean workspace's middle_rows, gives the output and state bits of the
    one pass through a workspace holding every row (whose core the comparison reads)."""
    from glm_kda.gpu.layer import KdaLayer
    from glm_kda.gpu.workspace import KdaWorkspace

    cp = _cp()
    bound, _ = layers("glm")
    start = KdaState.random(bound.config, seed=tokens)
    hidden = synthetic_hidden(tokens, bound.config.hidden, seed=SEED + 11)
    lean = KdaLayer(bound, workspace=KdaWorkspace(bound.config, tokens))
    assert lean.workspace.middle_rows < tokens
    lean_state = device_state(lean, start)
    lean_run = {"output": lean.prefill(hidden, lean_state), "conv state": lean_state.conv,
                "recurrent state": lean_state.recurrent}
    del lean
    cp.get_default_memory_pool().free_all_blocks()
    workspace = KdaWorkspace(bound.config, tokens, stage_buffers=True)
    layer = KdaLayer(bound, workspace=workspace)
    assert layer.chunk_impl == "tensor"
    state = device_state(layer, start)
    out = layer.prefill(hidden, state)
    _assert_same_bits(lean_run, {"output": out, "conv state": state.conv, "recurrent state": state.recurrent},
                      f"glm T{tokens}", "windows of a lean workspace and one pass")
    del lean_run
    tensor_core = workspace.core[:tokens].copy()
    reference = KdaLayer(bound, workspace=workspace, options=KdaOptions(chunk_impl="fp32"))
    fp32_state = device_state(reference, start)
    reference.prefill(hidden, fp32_state)
    for what, ours, ref in (("core", tensor_core, workspace.core[:tokens]),
                            ("recurrent state", state.recurrent, fp32_state.recurrent),
                            ("conv state", state.conv, fp32_state.conv)):
        ratio = float(rms_ratio(ours, ref))
        figures.append({"test": f"glm tensor-core prefill T{tokens}", "level": "stage", f"{what}_vs_fp32_path": ratio})
        assert ratio <= STAGE_BOUND, f"T{tokens}: tensor-core {what} vs FP32 path rms-ratio {ratio:.3e}"
    del tensor_core, workspace, reference, fp32_state
    cp.get_default_memory_pool().free_all_blocks()
    if tokens <= 16384:
        check_end_to_end(bound, hidden, as_float(out), state, start, f"glm tensor-core T{tokens}", figures,
                         oracle_chunk=64)


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_portable_path_gives_the_hopper_bits(layers, geometry):
    """options.hopper=False (no programmatic launches, no bulk-copy sweep: what sm_80 runs)
    writes the bits of the Hopper path: every stage buffer, the output and both states of a
    64-sequence pool step, a 5-row decode_k walk and a 10-token prefill."""
    _, layer = layers(geometry)
    hopper, portable = _decode_paths(layer, count=80, rows=64, walk_rows=5, prefill_rows=10, seed=71,
                                     switch=_option_switch(layer, "hopper"))
    _assert_same_bits(hopper, portable, geometry, "the Hopper and the portable paths")


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_the_path_without_the_bulk_sweep_gives_the_hopper_bits(layers, geometry, monkeypatch):
    """Programmatic launches and the staged o_proj with the mma.sync sweep at every row count (no
    sm_90a bulk-copy family: what sm_100, sm_120 and sm_121 run) write the bits of the Hopper path,
    as test_portable_path_gives_the_hopper_bits compares them; the Hopper run took the bulk sweep."""
    from glm_kda.gpu import projection

    if not projection.bulk_available():
        pytest.skip("the bulk-copy sweep is not in use here (not an sm_90 device, or --portable)")
    _, layer = layers(geometry)
    available, bulk = projection.bulk_available, projection._gemm_rows_bulk
    launches, marks = [], []

    def counted_bulk(*args, **kwargs):
        launches.append(1)
        return bulk(*args, **kwargs)

    def switch(state):  # True, None, False, None: the bulk launches of each run lie between its marks
        marks.append(len(launches))
        monkeypatch.setattr(projection, "bulk_available", (lambda: False) if state is False else available)

    monkeypatch.setattr(projection, "_gemm_rows_bulk", counted_bulk)
    with _options(layer, graphs=False):  # (a graph captured without the sweep would outlive the test)
        hopper, without = _decode_paths(layer, count=80, rows=64, walk_rows=5, prefill_rows=10, seed=73,
                                        switch=switch)
    assert marks[1] > marks[0] and marks[3] == marks[2], f"bulk launches per run: {marks}"
    _assert_same_bits(hopper, without, geometry, "the Hopper path and the one without the bulk sweep")


def test_every_option_is_part_of_the_graph_key(layers):
    """Changing any KdaOptions field after a capture never replays the old graph: the key
    differs, and (graphs on) the next calls capture afresh, with the bits of eager calls."""
    import dataclasses as dc

    cp = _cp()
    bound, layer = layers("kimi")
    cfg = bound.config
    bf16 = layer.workspace.final_out.dtype
    hidden = cp.asarray(synthetic_hidden(4, cfg.hidden, seed=77).view(np.uint16)).view(bf16)
    start = KdaState.random(cfg, seed=78)
    base = layer.options
    flags = ("packed_weights", "graphs", "hopper", "check_finite", "stage_buffers")
    other_values = {"chunk_impl": "fp32", **{f: not getattr(base, f) for f in flags}}
    assert set(other_values) == {f.name for f in dc.fields(KdaOptions)}, "a new option needs a case here"
    for field, value in other_values.items():
        state = device_state(layer, start)
        layer.graphs.clear()
        for t in range(3):  # eager, capture, replay
            layer.decode(hidden[t : t + 1], state)
        captures = layer.graphs.captures
        key = layer.graph_key(layer.workspace)
        with _options(layer, **{field: value}):
            assert layer.graph_key(layer.workspace) != key, f"options.{field} is not part of the graph key"
            changed = device_state(layer, start)
            outs = [layer.decode(hidden[t : t + 1], changed) for t in range(3)]
            expected = 0 if field == "graphs" and base.graphs else 1
            assert layer.graphs.captures == captures + expected, f"options.{field}: {layer.graphs.captures - captures} captures"
        eager = device_state(layer, start)
        with _options(layer, graphs=False):
            reference = [layer.decode(hidden[t : t + 1], eager) for t in range(3)]
        for t in range(3):
            assert int(cp.count_nonzero(_bits(outs[t]) != _bits(reference[t]))) == 0, f"options.{field} call {t}"
        assert layer.options == base


def _decode_run(layer, hidden, start: KdaState, steps: int):
    """Outputs of `steps` one-row decodes and a 4-row decode_k from `start`, and the final state."""
    cp = _cp()
    state = device_state(layer, start)
    outs = [layer.decode(hidden[t : t + 1], state) for t in range(steps)]
    outs.append(layer.decode_k(hidden[steps : steps + 4], state))
    return cp.concatenate(outs), state


@pytest.mark.parametrize("count", [2, 8])
@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_layers_decoding_at_once_on_their_own_streams(real_checkpoint, geometry, count, hang_seconds):
    """`count` layers built with from_pretrained's defaults, each driven by its own thread on its
    own CUDA stream, all at once: every output and state bit is that of the same calls made one
    layer after the other; no crash, no hang."""
    import threading

    from glm_kda.gpu.layer import KdaLayer

    cp = _cp()
    path = real_checkpoint(geometry)
    layers = [KdaLayer.from_pretrained(path, 0, max_tokens=64, progress=False) for _ in range(count)]
    cfg = layers[0].config
    bf16 = layers[0].workspace.final_out.dtype
    steps = 12
    hidden = [cp.asarray(synthetic_hidden(steps + 4, cfg.hidden, seed=300 + i).view(np.uint16)).view(bf16)
              for i in range(count)]
    starts = [KdaState.random(cfg, seed=400 + i) for i in range(count)]
    alone = []
    for layer, rows, start in zip(layers, hidden, starts):
        out, state = _decode_run(layer, rows, start, steps)
        alone.append((out.copy(), state.conv.copy(), state.recurrent.copy()))
    cp.cuda.Device().synchronize()
    results: list = [None] * count
    errors: list = []
    barrier = threading.Barrier(count)

    def drive(i: int) -> None:
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                barrier.wait()
                for _ in range(2):  # the first round captures, the second replays
                    out, state = _decode_run(layers[i], hidden[i], starts[i], steps)
                stream.synchronize()
            results[i] = (out, state.conv, state.recurrent)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((i, exc))
            barrier.abort()

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=hang_seconds)
    assert not any(thread.is_alive() for thread in threads), f"{geometry}: a layer's decode hung ({hang_seconds} s)"
    assert not errors, f"{geometry}: {errors}"
    for i in range(count):
        for what, a, b in zip(("outputs", "conv state", "recurrent state"), results[i], alone[i]):
            differ = int(cp.count_nonzero(_bits(a) != _bits(b)))
            assert differ == 0, f"{geometry} layer {i} of {count}: {differ} elements of its {what} differ"


_HOLD_EVERY_SM = r"""
extern "C" __global__ void hold_every_sm(long long cycles, int* done) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    if (threadIdx.x == 0) atomicAdd(done, 1);
}
"""


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_decode_beside_a_kernel_holding_every_sm(layers, geometry):
    """A layer decoding (one row, decode_k, graphed and eager) while another stream runs a long
    kernel whose blocks fill every SM: the calls finish with the bits of a quiet GPU."""
    cp = _cp()
    bound, layer = layers(geometry)
    cfg = bound.config
    bf16 = layer.workspace.final_out.dtype
    hidden = cp.asarray(synthetic_hidden(12, cfg.hidden, seed=88).view(np.uint16)).view(bf16)
    start = KdaState.random(cfg, seed=89)
    quiet, quiet_state = _decode_run(layer, hidden, start, 8)
    quiet, quiet_state = _decode_run(layer, hidden, start, 8)  # captured: the next run replays
    hog = cp.RawKernel(_HOLD_EVERY_SM, "hold_every_sm")
    device = cp.cuda.Device()
    sms = device.attributes["MultiProcessorCount"]
    threads_per_sm = device.attributes["MaxThreadsPerMultiProcessor"]
    done = cp.zeros(1, cp.int32)
    other = cp.cuda.Stream(non_blocking=True)
    for graphs in (True, False):
        done.fill(0)
        # `other` does not wait for this stream: were the quiet runs and the zeroing of `done` still queued,
        # the long kernel could take every SM first, count, and then see its count zeroed behind it.
        cp.cuda.get_current_stream().synchronize()
        with _options(layer, graphs=graphs):
            with other:
                # 2 s at ~2 GHz; every thread slot of every SM.
                hog((sms * threads_per_sm // 256,), (256,), (np.int64(4_000_000_000), done))
            busy, busy_state = _decode_run(layer, hidden, start, 8)
            cp.cuda.get_current_stream().synchronize()
        other.synchronize()
        held = int(done.get()[0])
        assert held > 0, f"{geometry} graphs={graphs}: the long kernel's blocks did not count themselves ({held})"
        for what, a, b in (("outputs", busy, quiet), ("recurrent state", busy_state.recurrent, quiet_state.recurrent),
                           ("conv state", busy_state.conv, quiet_state.conv)):
            differ = int(cp.count_nonzero(_bits(a) != _bits(b)))
            assert differ == 0, f"{geometry} graphs={graphs}: {differ} elements of the {what} differ beside the busy GPU"


@pytest.mark.parametrize("tokens,n,k", [(37, 100, 136), (17, 384, 2304)], ids=lambda v: str(v))
def test_the_tiled_gemm_that_stands_in_for_cublas_matches_it(tokens, n, k, request):
    """tests/tiled_gemm.py (what --gemm-without-cublas runs in place of cuBLAS) against
    glm_kda.gpu.ops.cublas.gemm_bf16_cublas on the same strided x: its FP32 outputs agree with
    cuBLAS's within FP32 reassociation (rms ratio <= 1e-5), its BF16 outputs are its FP32 outputs
    rounded to nearest even, bit for bit, and nothing is written outside out's columns."""
    import ml_dtypes

    if request.config.getoption("--gemm-without-cublas"):
        pytest.skip("compares against cuBLAS, which --gemm-without-cublas keeps out of this run")

    cp = _cp()
    from tiled_gemm import tiled_gemm_bf16

    from glm_kda.gpu.ops import cublas

    rng = np.random.default_rng(tokens + n)
    x = cp.asarray(rng.standard_normal((tokens, k + 24)).astype(ml_dtypes.bfloat16).view(np.uint16))[:, 8 : 8 + k]
    w = cp.asarray((rng.standard_normal((n, k)) / np.sqrt(k)).astype(ml_dtypes.bfloat16).view(np.uint16))
    sums = {}
    for name, gemm in (("cublas", cublas.gemm_bf16_cublas), ("tiled", tiled_gemm_bf16)):
        out32 = cp.full((tokens, n), np.nan, cp.float32)
        out16 = cp.full((tokens, n + 8), 0x7FA5, cp.uint16)
        gemm(x, w, out32)
        gemm(x, w, out16[:, :n])
        assert bool((out16[:, n:] == 0x7FA5).all()), f"{name}: wrote outside out's columns"
        sums[name] = (cp.asnumpy(out32), cp.asnumpy(out16[:, :n]))
    ratio = rms_ratio(sums["tiled"][0], sums["cublas"][0])
    assert ratio <= 1e-5, f"FP32 outputs: rms ratio {ratio:.3e} against cuBLAS (bound 1e-5)"
    rounded = sums["tiled"][0].astype(ml_dtypes.bfloat16).view(np.uint16)
    differ = int(np.count_nonzero(sums["tiled"][1] != rounded))
    assert differ == 0, f"BF16 outputs: {differ} of {rounded.size} are not the FP32 outputs rounded"
