"""The float64 oracle keeps the promises of docs/maths.md section 5 that need no GPU."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from glm_kda import reference
from glm_kda.checkpoint import bind_layer
from glm_kda.reference import STAGE_ORDER, KdaOracle, compare_stages, rms_ratio, round_bf16
from glm_kda.state import KdaState
from glm_kda.synthetic import synthetic_hidden, write_synthetic_checkpoint

SEED = 1234


def assert_close(actual, expected, bound, what):
    ratio = rms_ratio(actual, expected)
    assert ratio <= bound, f"{what}: rms-ratio {ratio:.3e} > bound {bound:.1e}"


def assert_bits_equal(actual, expected, what):
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} vs {e.shape}"
    differ = int(np.count_nonzero(a.view(np.uint64) != e.view(np.uint64))) if a.dtype == np.float64 else int(np.count_nonzero(a != e))
    assert differ == 0, f"{what}: {differ} of {a.size} elements differ in their bits"


@pytest.fixture(scope="module", params=["tiny-glm", "tiny-kimi"])
def tiny_layer(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_synthetic_checkpoint(path, request.param, seed=SEED)
    return bind_layer(path, 0, progress=False)


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-glm-only")
    write_synthetic_checkpoint(path, "tiny-glm", seed=SEED)
    return path


def start_state(layer, kind):
    return None if kind == "zero" else KdaState.random(layer.config, seed=SEED)


@pytest.mark.parametrize("start", ["zero", "carried"])
@pytest.mark.parametrize("tokens", [1, 2, 63, 64, 65, 1000], ids=lambda t: f"T{t}")
def test_chunked_prefill_equals_token_by_token(tiny_layer, tokens, start):
    """float64: the chunked (WY) recurrence equals the token-by-token one to 1e-12 at every
    chunk size, on outputs and on the final state."""
    oracle = KdaOracle(tiny_layer, "float64")
    hidden = synthetic_hidden(tokens, tiny_layer.config.hidden, seed=tokens)
    state = start_state(tiny_layer, start)
    walked, walked_state = oracle.prefill(hidden, state)
    for chunk in (16, 32, 64):
        chunked, chunked_state = oracle.prefill(hidden, state, chunk=chunk)
        tag = f"T{tokens}-C{chunk}-{start}"
        for stage in ("core", "final_out"):
            assert_close(chunked[stage], walked[stage], 1e-12, f"{tag} {stage}")
        assert_close(chunked_state.recurrent, walked_state.recurrent, 1e-12, f"{tag} recurrent state")
        assert_bits_equal(chunked_state.conv, walked_state.conv, f"{tag} conv state")


@pytest.mark.parametrize("poison", [np.nan, 1e30], ids=["nan", "1e30"])
@pytest.mark.parametrize("tokens,chunk", [(1, 16), (17, 16), (63, 64), (65, 32), (100, 64)], ids=lambda v: str(v))
def test_poisoned_pad_changes_no_bit(tiny_layer, tokens, chunk, poison):
    oracle = KdaOracle(tiny_layer, "float64")
    hidden = synthetic_hidden(tokens, tiny_layer.config.hidden, seed=7)
    state = KdaState.random(tiny_layer.config, seed=3)
    clean, clean_state = oracle.prefill(hidden, state, chunk=chunk, pad_value=0.0)
    dirty, dirty_state = oracle.prefill(hidden, state, chunk=chunk, pad_value=poison)
    for stage in STAGE_ORDER:
        assert_bits_equal(dirty[stage], clean[stage], f"T{tokens}-C{chunk} {stage}")
    assert_bits_equal(dirty_state.recurrent, clean_state.recurrent, "carried recurrent state")
    assert_bits_equal(dirty_state.conv, clean_state.conv, "carried conv state")


def test_decode_and_verify_walk_the_same_states(tiny_layer):
    oracle = KdaOracle(tiny_layer, "bf16")
    hidden = synthetic_hidden(6, tiny_layer.config.hidden, seed=11)
    state = KdaState.random(tiny_layer.config, seed=5)
    verified, states = oracle.verify(hidden, state)
    current = state
    for row in range(hidden.shape[0]):
        stages, current = oracle.decode(hidden[row], current)
        for name in STAGE_ORDER:
            assert_bits_equal(verified[name][row : row + 1], stages[name], f"row {row} {name}")
        assert_bits_equal(states[row].recurrent, current.recurrent, f"state after row {row}")
        assert_bits_equal(states[row].conv, current.conv, f"conv state after row {row}")
    walked, walked_state = oracle.prefill(hidden, state)
    assert_bits_equal(walked["final_out"], verified["final_out"], "prefill token by token vs verify")


def test_stage_names_and_shapes(tiny_layer):
    cfg = tiny_layer.config
    stages, state = KdaOracle(tiny_layer).prefill(synthetic_hidden(5, cfg.hidden), None, chunk=4)
    assert set(stages) == set(STAGE_ORDER)
    t, h, d = 5, cfg.heads, cfg.head_dim
    expected = {"qkv_proj": (t, 3 * h * d), "down_proj": (t, 2 * d + h), "forget_proj": (t, h * d), "out_gate": (t, h * d),
                "conv_out": (t, 3 * h * d), "query": (t, h, d), "key": (t, h, d), "value": (t, h, d), "gate": (t, h, d),
                "beta": (t, h), "core": (t, h, d), "o_norm_out": (t, h * d), "final_out": (t, cfg.hidden)}
    assert {k: v.shape for k, v in stages.items()} == expected
    assert state.conv.shape == cfg.conv_state_shape and state.recurrent.shape == cfg.recurrent_state_shape


def test_bf16_oracle_rounds_where_the_block_rounds(tiny_layer):
    cfg = tiny_layer.config
    hidden = synthetic_hidden(40, cfg.hidden, seed=2)
    faithful, _ = KdaOracle(tiny_layer, "bf16").prefill(hidden, None)
    exact, _ = KdaOracle(tiny_layer, "float64").prefill(hidden, None)
    rounded = ("qkv_proj", "down_proj", "forget_proj", "out_gate", "conv_out", "o_norm_out", "final_out")
    for name in rounded:
        values = faithful[name]
        assert np.array_equal(values, values.astype(ml_dtypes.bfloat16).astype(np.float64)), f"{name} is not BF16-rounded"
    for name in ("gate", "beta", "core", "query"):
        assert not np.array_equal(faithful[name], round_bf16(faithful[name])), f"{name} must stay unrounded (FP32 in the block)"
    table = compare_stages(faithful, exact)
    # BF16 rounding (8 significant bits) costs between 1e-4 and 3e-2 at every stage.
    for row in table.rows:
        assert 1e-5 < row.rms_ratio < 3e-2, f"BF16-faithful vs float64 at {row.stage}: {row.rms_ratio:.3e}\n{table}"


def test_round_bf16_is_correctly_rounded():
    rng = np.random.default_rng(0)
    as_f32 = (rng.standard_normal(200_000) * np.exp(rng.uniform(-30, 30, 200_000))).astype(np.float32).astype(np.float64)
    assert np.array_equal(round_bf16(as_f32), as_f32.astype(ml_dtypes.bfloat16).astype(np.float64))
    # Exact ties go to even; a hair above a tie goes up (where a float32 step would double-round).
    one_ulp = 2.0**-7
    tie_even, tie_odd = 1.0 + one_ulp / 2, 1.0 + 1.5 * one_ulp
    assert round_bf16(np.array([tie_even, tie_odd])).tolist() == [1.0, 1.0 + 2 * one_ulp]
    above_tie = 1.0 + one_ulp / 2 + 2.0**-40
    assert round_bf16(np.array([above_tie]))[0] == 1.0 + one_ulp
    special = round_bf16(np.array([np.inf, -np.inf, 1e39, -1e39, 0.0]))
    assert special.tolist() == [np.inf, -np.inf, np.inf, -np.inf, 0.0]
    assert np.isnan(round_bf16(np.array([np.nan])))[0]


def test_softplus_law_is_linear_above_20(tiny_layer):
    import dataclasses

    cfg = dataclasses.replace(tiny_layer.config, gate_law="softplus", gate_lower_bound=None)
    forget = np.array([[25.0, 19.0] + [0.0] * (cfg.qkv - 2)])
    gate = reference.forget_gate(forget, np.zeros(cfg.qkv), np.zeros(cfg.heads), cfg)
    assert gate[0, 0, 0] == -25.0
    assert gate[0, 0, 1] == pytest.approx(-np.log1p(np.exp(19.0)), rel=1e-15)


def test_state_layouts_round_trip(tiny_layer):
    cfg = tiny_layer.config
    oracle = KdaOracle(tiny_layer, "bf16")
    _, state = oracle.prefill(synthetic_hidden(9, cfg.hidden, seed=4), None)
    ours = state.astype(np.float32)
    conv_t, rec_t = ours.to_transformers()
    assert conv_t.dtype == ml_dtypes.bfloat16 and conv_t.shape == (cfg.conv_dim, cfg.conv_kernel)
    back = KdaState.from_transformers(conv_t, rec_t)
    assert_bits_equal(back.conv, ours.conv, "transformers conv round trip (BF16 conv inputs are exact)")
    assert_bits_equal(back.recurrent, ours.recurrent, "transformers recurrent round trip")
    conv_v, rec_v = ours.to_vllm()
    assert conv_v.shape == (cfg.conv_dim, cfg.conv_kernel - 1)
    assert_bits_equal(conv_v, ours.conv[:, 1:], "ours[1:K] == vllm[0:K-1]")
    back = KdaState.from_vllm(conv_v, rec_v)
    assert_bits_equal(back.conv[:, 1:], ours.conv[:, 1:], "vLLM round trip, every slot it keeps")
    assert_bits_equal(back.recurrent, ours.recurrent, "vLLM recurrent round trip")
    # Slot 0 is never read: continuing from the vLLM import gives the same bits.
    more = synthetic_hidden(3, cfg.hidden, seed=8)
    a, _ = oracle.prefill(more, ours)
    b, _ = oracle.prefill(more, back)
    assert_bits_equal(b["final_out"], a["final_out"], "continuing from a vLLM-imported state")


def test_short_sequence_leaves_zeros_in_older_conv_slots(tiny_layer):
    cfg = tiny_layer.config
    _, state = KdaOracle(tiny_layer).prefill(synthetic_hidden(2, cfg.hidden), None)
    assert np.all(state.conv[:, : cfg.conv_kernel - 2] == 0)
    assert np.all(state.conv[:, cfg.conv_kernel - 2 :] != 0)


# Tests with teeth: known faults must show, at the stage where they sit -----------------
def test_conv_taps_in_kqv_order_fail_at_the_conv_stage(tiny_glm, tmp_path):
    faulty_path = tmp_path / "kqv"
    write_synthetic_checkpoint(faulty_path, "tiny-glm", seed=SEED, conv_order=("k", "q", "v"))
    good, bad = bind_layer(tiny_glm, 0, progress=False), bind_layer(faulty_path, 0, progress=False)
    hidden = synthetic_hidden(32, good.config.hidden, seed=9)
    truth, _ = KdaOracle(good, "bf16").prefill(hidden, None)
    faulty, _ = KdaOracle(bad, "bf16").prefill(hidden, None)
    table = compare_stages(faulty, truth)
    assert table.first_above(0.0) == "conv_out", f"the fault must first show at conv_out:\n{table}"
    assert table["conv_out"].rms_ratio > 0.1, f"conv_out moved only {table['conv_out'].rms_ratio:.3e}:\n{table}"


class ALogByChannelOracle(KdaOracle):
    """A deliberately wrong oracle: A_log tiled over channels (channel c takes A_log[c % H])
    instead of repeated per head (channel c takes A_log[c // D])."""

    def front_end(self, x, out, src):
        super().front_end(x, out, src)
        cfg, w = self.config, self.weights
        tokens = src["forget_proj"].shape[0]
        u = (src["forget_proj"] + w["dt_bias"][None, :]).reshape(tokens, cfg.heads, cfg.head_dim)
        a = np.exp(np.tile(w["a_log"], cfg.head_dim)).reshape(cfg.heads, cfg.head_dim)[None]
        if cfg.bounded:
            out["gate"] = cfg.gate_lower_bound / (1.0 + np.exp(-a * u))
        else:
            out["gate"] = -a * np.where(u > 20, u, np.log1p(np.exp(np.minimum(u, 20))))


def test_a_log_indexed_by_channel_fails_at_the_gate_stage(tiny_layer):
    hidden = synthetic_hidden(32, tiny_layer.config.hidden, seed=10)
    truth, _ = KdaOracle(tiny_layer, "bf16").prefill(hidden, None)
    faulty, _ = ALogByChannelOracle(tiny_layer, "bf16").prefill(hidden, None)
    table = compare_stages(faulty, truth)
    assert table.first_above(0.0) == "gate", f"the fault must first show at the gate:\n{table}"
    assert table["gate"].rms_ratio > 0.1, f"gate moved only {table['gate'].rms_ratio:.3e}:\n{table}"


def test_compare_stages_reports_nan_and_shapes():
    table = compare_stages({"core": np.array([1.0, np.nan])}, {"core": np.array([1.0, 2.0])})
    assert np.isnan(table["core"].rms_ratio) and table.first_above(1.0) == "core"
    with pytest.raises(ValueError, match="core"):
        compare_stages({"core": np.zeros(3)}, {"core": np.zeros(4)})


def test_fed_stages_of_an_oracle_run_reproduce_it(tiny_layer):
    """Fed its own stages, the oracle reproduces each of them: the per-stage judge is exact."""
    oracle = KdaOracle(tiny_layer, "bf16")
    hidden = synthetic_hidden(20, tiny_layer.config.hidden, seed=12)
    state = KdaState.random(tiny_layer.config, seed=6)
    stages, after = oracle.prefill(hidden, state)
    fed, fed_after = oracle.fed_stages(hidden, stages, state)
    for name in STAGE_ORDER:
        assert_bits_equal(fed[name], stages[name], f"fed {name}")
    assert_bits_equal(fed_after.recurrent, after.recurrent, "fed recurrent state")


def test_oracle_decode_takes_one_token():
    """KdaOracle.decode of several rows is refused, naming the walk that takes them (verify)."""
    oracle = object.__new__(KdaOracle)  # (refused before any weight is read)
    with pytest.raises(ValueError, match="decode: 3 rows for one state.*verify"):
        oracle.decode(np.zeros((3, 64), np.float32))
