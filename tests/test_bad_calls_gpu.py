"""Bad arguments to the GPU layer's calls: each is refused before the first launch with the
named exception and a message naming the argument, its shape, dtype or value; the state, the
snapshots and the pool are byte-identical afterwards. (Host-side bad inputs: test_bad_inputs.py.)"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from glm_kda.device import gpu_status
from glm_kda.options import KdaOptions
from glm_kda.state import KdaState, StatePool
from glm_kda.synthetic import synthetic_hidden

GPU_OK, GPU_WHY = gpu_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=f"no CUDA GPU: {GPU_WHY}")]

POOL = 4


@pytest.fixture(scope="module")
def kit(real_checkpoint):
    """A Kimi-geometry layer, a state, a snapshot and a pool holding random values, and rows."""
    import cupy as cp

    from glm_kda.checkpoint import bind_layer
    from glm_kda.gpu.layer import KdaLayer

    bound = bind_layer(real_checkpoint("kimi"), 0, progress=False)
    layer = KdaLayer(bound, max_tokens=256)
    cfg = layer.config

    def device(host: KdaState) -> KdaState:
        return KdaState(cp.asarray(host.conv), cp.asarray(host.recurrent))

    pool = StatePool(cfg, POOL)
    for slot in range(POOL):
        start = KdaState.random(cfg, seed=40 + slot)
        pool.conv[slot], pool.recurrent[slot] = cp.asarray(start.conv), cp.asarray(start.recurrent)
    host_rows = synthetic_hidden(8, cfg.hidden, seed=6)
    bf16 = layer.workspace.final_out.dtype
    return types.SimpleNamespace(
        cp=cp, bound=bound, layer=layer, cfg=cfg, pool=pool, host_rows=host_rows,
        rows=cp.asarray(host_rows.view(np.uint16)).view(bf16),
        state=device(KdaState.random(cfg, seed=3)), snapshot=device(KdaState.random(cfg, seed=4)))


def _bits(kit) -> list:
    buffers = (kit.state.conv, kit.state.recurrent, kit.snapshot.conv, kit.snapshot.recurrent, kit.pool.conv,
               kit.pool.recurrent)
    return [b.get().tobytes() for b in buffers]


def _with_nan(k, row: int, rows: int = 4):
    bad = k.host_rows[:rows].copy()
    bad[row, 7] = np.nan
    return bad


def _other_geometry_state(k) -> KdaState:
    return KdaState.zeros(dataclasses.replace(k.cfg, heads=k.cfg.heads // 2), k.cp)


def _torch_rows(k, dtype_name: str, cuda: bool = True):
    torch = pytest.importorskip("torch")
    if cuda and not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    tensor = torch.zeros((2, k.cfg.hidden), dtype=getattr(torch, dtype_name))
    return tensor.cuda() if cuda else tensor


def _uint16_rows(k):
    from glm_kda.gpu.arrays import bf16_dtype

    if bf16_dtype() == np.dtype(np.uint16):
        pytest.skip("this CuPy has no BF16 dtype: uint16 is how it holds BF16")
    return k.rows.view(k.cp.uint16)


def _nan_checked(k, call):
    k.layer.options = dataclasses.replace(k.layer.options, check_finite=True)
    try:
        call()
    finally:
        k.layer.options = dataclasses.replace(k.layer.options, check_finite=False)


# name: (call(kit), exception, words its message must hold)
CASES = {
    # the rows
    "numpy float32 rows": (lambda k: k.layer.prefill(k.host_rows.astype(np.float32), k.state), TypeError, "float32"),
    "numpy float16 rows": (lambda k: k.layer.decode(k.host_rows[:1].astype(np.float16), k.state), TypeError, "float16"),
    "numpy uint16 rows": (lambda k: k.layer.decode(k.host_rows[:1].view(np.uint16), k.state), TypeError, "uint16"),
    "cupy float32 rows": (lambda k: k.layer.prefill(k.cp.zeros((4, k.cfg.hidden), k.cp.float32), k.state), TypeError, "float32"),
    "cupy int16 rows": (lambda k: k.layer.decode(k.rows[:1].view(k.cp.int16), k.state), TypeError, "int16"),
    "cupy uint16 rows": (lambda k: k.layer.decode(_uint16_rows(k)[:1], k.state), TypeError, "view(ml_dtypes.bfloat16)"),
    "a list of rows": (lambda k: k.layer.prefill(k.host_rows.tolist(), k.state), TypeError, "got list"),
    "torch float16": (lambda k: k.layer.prefill(_torch_rows(k, "float16"), k.state), TypeError, "torch.bfloat16"),
    "torch on the CPU": (lambda k: k.layer.prefill(_torch_rows(k, "bfloat16", cuda=False), k.state), TypeError, "CUDA device"),
    "rows too wide": (lambda k: k.layer.prefill(synthetic_hidden(4, k.cfg.hidden + 8), k.state), ValueError, "[rows, 2304]"),
    "rows too narrow": (lambda k: k.layer.decode(k.rows[:1, :-2], k.state), ValueError, "[rows, 2304], got [1, 2302]"),
    "rows of 3 dimensions": (lambda k: k.layer.prefill(k.rows[:4].reshape(2, 2, -1), k.state), ValueError, "[2, 2, 2304]"),
    "no rows": (lambda k: k.layer.prefill(k.rows[:0], k.state), ValueError, "0 rows"),
    "more rows than max_tokens": (lambda k: k.layer.prefill(synthetic_hidden(257, k.cfg.hidden), k.state), ValueError, "max_tokens=256"),
    "decode of 2 rows on one state": (lambda k: k.layer.decode(k.rows[:2], k.state), ValueError, "2 rows for one state"),
    "decode_k of 17 rows": (lambda k: k.layer.decode_k(synthetic_hidden(17, k.cfg.hidden), k.state), ValueError, "1..16"),
    "rows not contiguous": (lambda k: k.layer.prefill(k.rows[::2], k.state), ValueError, "C-contiguous"),
    # the state
    "a state of another geometry": (lambda k: k.layer.decode(k.rows[:1], _other_geometry_state(k)), ValueError, "state.conv"),
    "a float64 state": (lambda k: k.layer.decode(k.rows[:1], KdaState.zeros(k.cfg, k.cp, np.float64)), TypeError, "state.conv must be a contiguous CuPy float32"),
    "a host state": (lambda k: k.layer.prefill(k.rows[:4], KdaState.zeros(k.cfg)), TypeError, "CuPy float32"),
    "a state that is not a KdaState": (lambda k: k.layer.decode(k.rows[:1], (k.state.conv, k.state.recurrent)), TypeError, "state must be a KdaState"),
    "no state": (lambda k: k.layer.prefill(k.rows[:4], None), TypeError, "got NoneType"),
    "a state not contiguous": (lambda k: k.layer.decode(k.rows[:1], KdaState(k.cp.zeros(k.cfg.conv_state_shape[::-1], k.cp.float32).T, k.state.recurrent)), TypeError, "state.conv"),
    "more snapshots than rows": (lambda k: k.layer.decode_k(k.rows[:1], k.state, [k.snapshot, k.snapshot]), ValueError, "2 snapshots for 1 rows"),
    "a snapshot of another geometry": (lambda k: k.layer.decode_k(k.rows[:2], k.state, [k.snapshot, _other_geometry_state(k)]), ValueError, "snapshots[1]"),
    "slots with one state (prefill)": (lambda k: k.layer.prefill(k.rows[:4], k.state, slots=[0]), TypeError, "slots and cu_seqlens only apply to a StatePool"),
    "slots with one state (decode)": (lambda k: k.layer.decode(k.rows[:1], k.state, [0]), TypeError, "slots only apply to a StatePool"),
    # the pool and its slots
    "pool decode without slots": (lambda k: k.layer.decode(k.rows[:2], k.pool), ValueError, "needs slots"),
    "a host slot past the pool": (lambda k: k.layer.decode(k.rows[:2], k.pool, [0, POOL]), ValueError, "[0, 4] outside this pool of 4"),
    "a negative host slot": (lambda k: k.layer.decode(k.rows[:2], k.pool, [-1, 0]), ValueError, "outside this pool"),
    "a host slot twice": (lambda k: k.layer.decode(k.rows[:2], k.pool, [1, 1]), ValueError, "repeats a slot"),
    "fewer slots than rows": (lambda k: k.layer.decode(k.rows[:3], k.pool, [0, 1]), ValueError, "expected 3 integer slots"),
    "float slots": (lambda k: k.layer.decode(k.rows[:2], k.pool, [0.0, 1.0]), ValueError, "integer slots, got float64"),
    "more rows than the pool": (lambda k: k.layer.decode(k.rows[:5], k.pool, list(range(5))), ValueError, "1..4"),
    "device int64 slots": (lambda k: k.layer.decode(k.rows[:2], k.pool, k.cp.arange(2)), ValueError, "device int32"),
    "device slots of another length": (lambda k: k.layer.decode(k.rows[:2], k.pool, k.cp.arange(3, dtype=k.cp.int32)), ValueError, "of 2 entries"),
    "a device slot past the pool": (lambda k: k.layer.decode(k.rows[:2], k.pool, k.cp.asarray([0, 9], k.cp.int32)), ValueError, "[0, 9] outside this pool"),
    "a device slot twice": (lambda k: k.layer.decode(k.rows[:2], k.pool, k.cp.asarray([2, 2], k.cp.int32)), ValueError, "repeats a slot"),
    "device slots not contiguous": (lambda k: k.layer.decode(k.rows[:2], k.pool, k.cp.arange(4, dtype=k.cp.int32)[::2]), ValueError, "C-contiguous"),
    "a pool of another geometry": (lambda k: k.layer.decode(k.rows[:1], StatePool(dataclasses.replace(k.cfg, heads=k.cfg.heads // 2), 2), [0]), ValueError, "do not fit"),
    # packed prefill: everything is checked before the first sequence runs
    "packed without cu_seqlens": (lambda k: k.layer.prefill(k.rows, k.pool, slots=[0, 1]), ValueError, "needs cu_seqlens"),
    "packed lengths short of the rows": (lambda k: k.layer.prefill(k.rows, k.pool, slots=[0, 1], cu_seqlens=[0, 3, 7]), ValueError, "end at the 8 rows"),
    "packed empty sequence": (lambda k: k.layer.prefill(k.rows, k.pool, slots=[0, 1], cu_seqlens=[0, 0, 8]), ValueError, "strictly increase"),
    "packed not from 0": (lambda k: k.layer.prefill(k.rows, k.pool, slots=[0, 1], cu_seqlens=[1, 4, 8]), ValueError, "must start at 0"),
    "packed float bounds": (lambda k: k.layer.prefill(k.rows, k.pool, slots=[0, 1], cu_seqlens=[0.0, 4.0, 8.0]), ValueError, "cu_seqlens: expected [N+1] integers"),
    "packed slot twice": (lambda k: k.layer.prefill(k.rows, k.pool, slots=[3, 3], cu_seqlens=[0, 4, 8]), ValueError, "repeats a slot"),
    "packed slot past the pool": (lambda k: k.layer.prefill(k.rows, k.pool, slots=[0, 7], cu_seqlens=[0, 4, 8]), ValueError, "outside this pool"),
    "packed slots fewer than sequences": (lambda k: k.layer.prefill(k.rows, k.pool, slots=[0], cu_seqlens=[0, 4, 8]), ValueError, "expected 2 integer slots"),
    # non-finite rows, when asked to check
    "a NaN row to prefill": (lambda k: _nan_checked(k, lambda: k.layer.prefill(_with_nan(k, 2), k.state)), FloatingPointError, "hidden rows [2]"),
    "a NaN row to decode": (lambda k: _nan_checked(k, lambda: k.layer.decode(_with_nan(k, 0, 1), k.state)), FloatingPointError, "hidden rows [0]"),
    "a NaN row to decode_k": (lambda k: _nan_checked(k, lambda: k.layer.decode_k(_with_nan(k, 3), k.state)), FloatingPointError, "hidden rows [3]"),
    "a NaN row to a pool decode": (lambda k: _nan_checked(k, lambda: k.layer.decode(_with_nan(k, 1, 2), k.pool, [0, 1])), FloatingPointError, "hidden rows [1]"),
    # the layer and its options
    "max_tokens of 0": (lambda k: type(k.layer)(k.bound, max_tokens=0), ValueError, "max_tokens must be an int >= 1, got 0"),
    "options of the wrong type": (lambda k: setattr(k.layer, "options", {"graphs": False}), TypeError, "KdaOptions"),
    "an unknown chunk_impl": (lambda k: KdaOptions(chunk_impl="fast"), ValueError, "'fast'"),
    "an int for a flag": (lambda k: KdaOptions(hopper=1), TypeError, "KdaOptions.hopper must be a bool, got int 1"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_call_is_refused_and_changes_nothing(kit, name):
    call, error, needle = CASES[name]
    before = _bits(kit)
    options = kit.layer.options
    with pytest.raises(error) as info:
        call(kit)
    assert needle in str(info.value), f"{name}: message {str(info.value)!r} does not name {needle!r}"
    assert kit.layer.options == options, f"{name}: the layer's options changed"
    after = _bits(kit)
    names = ("state.conv", "state.recurrent", "snapshot.conv", "snapshot.recurrent", "pool.conv", "pool.recurrent")
    changed = [n for n, a, b in zip(names, before, after) if a != b]
    assert not changed, f"{name}: a refused call changed {changed}"


def test_unchecked_device_slots_take_the_fast_path_with_the_checked_bits(kit):
    """check_slots=False skips the read-back; for good slots the bits are the checked call's."""
    cp = kit.cp
    slots = cp.asarray([3, 1], cp.int32)
    outs = []
    for check in (True, False):
        pool = StatePool(kit.cfg, POOL)
        pool.conv[...], pool.recurrent[...] = kit.pool.conv, kit.pool.recurrent
        outs.append((kit.layer.decode(kit.rows[:2], pool, slots, check_slots=check).get().tobytes(),
                     pool.recurrent.get().tobytes()))
    assert outs[0] == outs[1], "check_slots=False changed the bits"


def test_check_finite_refuses_a_non_finite_output_after_the_call(kit):
    """A finite input whose output overflows BF16 is reported after the call (the state advanced)."""
    cp = kit.cp
    state = KdaState(kit.state.conv.copy(), kit.state.recurrent.copy())
    state.recurrent[...] = 3e38  # the read-out of this state overflows
    with pytest.raises(FloatingPointError, match="output rows .* hold NaN or Inf .* the state has advanced"):
        _nan_checked(kit, lambda: kit.layer.decode(kit.rows[:1], state))
    assert not cp.array_equal(state.conv, kit.state.conv), "the call ran: the conv window moved"


def test_workspace_bytes_count_each_buffer_once(kit):
    """KdaWorkspace.nbytes: every buffer once (the FP16 views of four FP32 buffers not again),
    from the shapes the workspace documents."""
    from glm_kda.gpu.workspace import KdaWorkspace

    cfg = kit.cfg
    ws = KdaWorkspace(cfg, 128)
    rows, heads, dim = 128, cfg.heads, cfg.head_dim
    vectors = 9 * rows * heads * dim * 4 + rows * heads * 4  # q, k, v, gate, core, q_decay, k_tail, W, U; beta
    rows_bf16 = rows * (2 * cfg.conv_dim + cfg.down_dim + 3 * cfg.qkv + 2 * cfg.hidden) * 2
    chunks = (rows // cfg.chunk) * heads * (cfg.chunk * cfg.chunk + dim) * 4  # attn, chunk_decay
    small = sum(a.nbytes for a in (ws.x_tiles, ws.x_tiles_side, ws.x_tiles_gate, ws.bulk_partial, ws.outputs_ready,
                                   ws.graph_slots))
    assert ws.nbytes == vectors + rows_bf16 + chunks + small, (ws.nbytes, vectors + rows_bf16 + chunks + small)
