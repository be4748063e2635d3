"""The float64 oracle against the block written out a second way: token by token, head by head,
from the layer's named arrays (q_proj, f_a, b_proj, ... as bound, not the oracle's fused q|k|v
and f_a|g_a|b_proj weights), each line one formula of the specification's section 3.

The kernels are judged against the oracle; the oracle's own formulas are judged here, stage by
stage, so that a formula wrong in the oracle cannot pass as the reference (the gate laws, which
slice of the down projection feeds beta, the sigmoid of the output gate, the norm's weight and
eps, the L2 eps inside the sqrt). The inputs run at two scales: ordinary rows, and rows a
thousand times smaller, where the sums of squares of the L2 and of the gated norm are of the
order of their eps, so that a misplaced or missing eps moves the result.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest

from glm_kda.checkpoint import bind_layer
from glm_kda.reference import STAGE_ORDER, KdaOracle, rms_ratio
from glm_kda.state import KdaState
from glm_kda.synthetic import synthetic_hidden, write_synthetic_checkpoint

TOKENS = 5


def as_f64(array) -> np.ndarray:
    return np.asarray(array, dtype=np.float64)


def silu(x):
    return x / (1.0 + math.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def block_by_the_formulas(layer, hidden: np.ndarray, state: KdaState) -> tuple[dict[str, np.ndarray], KdaState]:
    """Section 3 of the specification, one token at a time, in float64 (no BF16 rounding)."""
    c = layer.config
    heads, d = c.heads, c.head_dim
    w = {name: as_f64(array) for name, array in layer.arrays().items()}
    a_log = w["a_log"].reshape(heads)
    conv = as_f64(state.conv).copy()  # [3*qkv, K], oldest input first
    recurrent = as_f64(state.recurrent).copy()  # [H, D_k, D_v]
    rows = {name: [] for name in STAGE_ORDER}
    for x in as_f64(hidden):
        m = np.concatenate([w["q_proj"] @ x, w["k_proj"] @ x, w["v_proj"] @ x])
        f_low, g_low, b_logits = w["f_a"] @ x, w["g_a"] @ x, w["b_proj"] @ x
        u = w["f_b"] @ f_low + w["dt_bias"]
        z = w["g_b"] @ g_low
        # The conv: history shifted left, the new input in the last slot, all K slots convolved.
        conv = np.concatenate([conv[:, 1:], m[:, None]], axis=1)
        conv_out = np.array([silu(float(np.dot(w["conv_weight"][ch], conv[ch]))) for ch in range(m.size)])
        q, k, v = (conv_out[i * heads * d : (i + 1) * heads * d].reshape(heads, d) for i in range(3))
        gate = np.empty((heads, d))
        beta = np.empty(heads)
        core = np.empty((heads, d))
        query, key = np.empty((heads, d)), np.empty((heads, d))
        normed = np.empty((heads, d))
        for h in range(heads):
            query[h] = q[h] / math.sqrt(float(np.dot(q[h], q[h])) + c.l2_eps)
            key[h] = k[h] / math.sqrt(float(np.dot(k[h], k[h])) + c.l2_eps)
            u_h = u[h * d : (h + 1) * d]
            if c.bounded:
                gate[h] = c.gate_lower_bound * sigmoid(math.exp(a_log[h]) * u_h)
            else:
                softplus = np.where(u_h > 20.0, u_h, np.log1p(np.exp(np.minimum(u_h, 20.0))))
                gate[h] = -math.exp(a_log[h]) * softplus
            beta[h] = sigmoid(b_logits[h])
            state_h = recurrent[h] * np.exp(gate[h])[:, None]
            predicted = state_h.T @ key[h]
            state_h = state_h + np.outer(key[h], beta[h] * (v[h] - predicted))
            recurrent[h] = state_h
            core[h] = state_h.T @ (query[h] / math.sqrt(d))
            o = core[h]
            normed[h] = o / math.sqrt(float(np.mean(o * o)) + c.rms_norm_eps) * w["o_norm"] * sigmoid(z[h * d : (h + 1) * d])
        y = normed.reshape(-1)
        stage = {"qkv_proj": m, "down_proj": np.concatenate([f_low, g_low, b_logits]), "forget_proj": w["f_b"] @ f_low,
                 "out_gate": z, "gate": gate, "beta": beta, "conv_out": conv_out, "query": query, "key": key,
                 "value": v, "core": core, "o_norm_out": y, "final_out": w["o_proj"] @ y}
        for name in STAGE_ORDER:
            rows[name].append(stage[name])
    return {name: np.stack(values) for name, values in rows.items()}, KdaState(conv, recurrent)


@pytest.fixture(scope="module")
def layers(tmp_path_factory):
    made = {}

    def layer(geometry: str):
        if geometry not in made:
            path = write_synthetic_checkpoint(tmp_path_factory.mktemp(geometry), geometry)
            made[geometry] = bind_layer(path, 1, progress=False)
        return made[geometry]

    return layer


@pytest.mark.parametrize("chunk", [None, 2], ids=["walk", "C2"])
@pytest.mark.parametrize("scale", [1.0, 1e-3], ids=["rows", "small_rows"])
@pytest.mark.parametrize("geometry", ["tiny-glm", "tiny-kimi"])
def test_oracle_is_the_formulas_stage_by_stage(layers, geometry, scale, chunk):
    layer = layers(geometry)
    hidden = as_f64(synthetic_hidden(TOKENS, layer.config.hidden, seed=7)) * scale
    start = KdaState.random(layer.config, seed=8, scale=0.1 * scale)
    start.conv *= scale
    expected, expected_state = block_by_the_formulas(layer, hidden, start)
    stages, state = KdaOracle(layer, "float64").prefill(hidden, start, chunk=chunk)
    # float64 both ways, the sums in other orders (and the chunked form's algebra): 1e-9 leaves
    # room for those, and none for a formula that differs.
    bound = 1e-9
    for name in STAGE_ORDER:
        ratio = rms_ratio(stages[name].reshape(TOKENS, -1), expected[name].reshape(TOKENS, -1))
        assert ratio < bound, f"{geometry} x{scale} {chunk}: stage {name} {ratio:.3e} from the formulas (bound {bound})"
    for name in ("conv", "recurrent"):
        ratio = rms_ratio(getattr(state, name), getattr(expected_state, name))
        assert ratio < bound, f"{geometry} x{scale} {chunk}: {name} state {ratio:.3e} from the formulas"


def test_small_rows_make_each_eps_count(layers):
    """At the small scale both eps change the stages they enter by far more than the bound above:
    the L2 eps (query, key) and the norm's eps (o_norm_out); so the test above pins where they sit."""
    layer = layers("tiny-glm")
    hidden = as_f64(synthetic_hidden(TOKENS, layer.config.hidden, seed=7)) * 1e-3
    start = KdaState.random(layer.config, seed=8, scale=1e-4)
    start.conv *= 1e-3
    expected, _ = block_by_the_formulas(layer, hidden, start)
    for field, stages in (("l2_eps", ("query", "key")), ("rms_norm_eps", ("o_norm_out",))):
        # (A KdaConfig refuses an eps of 0: the formulas take any object with its attributes.)
        config = SimpleNamespace(**{**dataclasses.asdict(layer.config), field: 0.0, "bounded": layer.config.bounded})
        without, _ = block_by_the_formulas(SimpleNamespace(config=config, arrays=layer.arrays), hidden, start)
        for name in stages:
            ratio = rms_ratio(without[name], expected[name])
            assert ratio > 1e-3, f"{field} changes {name} by only {ratio:.3e} at the small scale"
