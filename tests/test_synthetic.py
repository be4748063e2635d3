"""Synthetic checkpoints: real names and shapes, realistic scales, deterministic per layer."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from glm_kda.checkpoint import INDEX_FILE, bind_layer, read_safetensors_header
from glm_kda.config import KdaConfig
from glm_kda.synthetic import (
    SYNTHETIC_MARKER,
    config_json,
    kda_layer_tensors,
    shard_filename,
    synthetic_config,
    synthetic_hidden,
    write_synthetic_checkpoint,
)

BF16 = ml_dtypes.bfloat16

# A medium geometry: enough samples for the scale checks, far cheaper than the real ones.
MEDIUM = KdaConfig(hidden=512, heads=4, head_dim=128, conv_kernel=4, gate_law="bounded",
                   gate_lower_bound=-5.0, rms_norm_eps=1e-5, num_layers=1, kda_layers=(0,))


def read_all(path) -> dict[str, np.ndarray]:
    with safe_open(str(path), framework="numpy") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def test_scales_are_realistic():
    tensors = {name: value.astype(np.float64) for name, value in kda_layer_tensors(MEDIUM, 0, seed=3).items()}
    for name, fan_in in [("q_proj.weight", 512), ("f_b_proj.weight", 128), ("o_proj.weight", 512)]:
        std = tensors[name].std()
        assert abs(std * np.sqrt(fan_in) - 1) < 0.05, f"{name}: std {std:.4g}, want 1/sqrt({fan_in})"
    for part in "qkv":
        taps = tensors[f"{part}_conv1d.weight"]
        assert taps.shape == (512, 1, 4) and np.abs(taps).max() <= 0.5 and taps.std() > 0.25
    a_log = tensors["A_log"]
    assert a_log.shape == (4,) and (a_log >= 0).all() and (a_log <= np.log(16)).all()
    dt = np.log1p(np.exp(tensors["dt_bias"]))  # softplus
    assert dt.min() >= 0.99e-3 and dt.max() <= 1.01e-1
    assert -7.0 < tensors["dt_bias"].min() and tensors["dt_bias"].max() < -2.0
    assert abs(tensors["o_norm.weight"].mean() - 1) < 0.05 and 0.05 < tensors["o_norm.weight"].std() < 0.15


def test_dtypes_are_those_of_the_release():
    tensors = kda_layer_tensors(synthetic_config("tiny-kimi"), 0)
    assert {n for n, v in tensors.items() if v.dtype == np.float32} == {"dt_bias", "A_log"}
    assert all(v.dtype == BF16 for n, v in tensors.items() if n not in ("dt_bias", "A_log"))
    assert tensors["A_log"].shape == (1, 1, 2, 1)
    assert kda_layer_tensors(synthetic_config("tiny-glm"), 0)["A_log"].shape == (2,)


def test_same_seed_same_values_other_seed_other_values(tmp_path):
    a = read_all(write_synthetic_checkpoint(tmp_path / "a", "tiny-glm", seed=7) / "model.safetensors")
    b = read_all(write_synthetic_checkpoint(tmp_path / "b", "tiny-glm", seed=7) / "model.safetensors")
    c = read_all(write_synthetic_checkpoint(tmp_path / "c", "tiny-glm", seed=8) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not np.array_equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])



@pytest.mark.parametrize("before,after", [(3, 1), (1, 3), (2, 3)], ids=["sharded_then_one", "one_then_sharded",
                                                                       "two_then_three"])
def test_rewriting_a_folder_binds_what_was_written_last(tmp_path, before, after):
    """A checkpoint written again into the same folder in another sharding leaves none of the first
    one's files behind (an index left over would be read first and bind the old shards)."""
    path = tmp_path / "again"
    write_synthetic_checkpoint(path, "tiny-glm", seed=0, shards=before)
    write_synthetic_checkpoint(path, "tiny-glm", seed=1, shards=after)
    fresh = bind_layer(write_synthetic_checkpoint(tmp_path / "fresh", "tiny-glm", seed=1, shards=after), 2,
                       progress=False)
    bound = bind_layer(path, 2, progress=False)
    assert np.array_equal(bound.q_proj, fresh.q_proj), "the folder bound the weights written first"
    written = {p.name for p in path.iterdir()}
    expected = ({"model.safetensors"} if after == 1 else {shard_filename(i, after) for i in range(after)} | {INDEX_FILE})
    assert written == expected | {"config.json", SYNTHETIC_MARKER}, written


def test_the_writer_refuses_a_directory_it_did_not_write(tmp_path):
    """A real checkpoint (or anything else) in the directory: refused before a file is touched."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text("{}")
    (real / "model.safetensors").write_bytes(b"weights")
    before = {p.name: p.read_bytes() for p in real.iterdir()}
    with pytest.raises(ValueError, match=r"real: holds files this writer did not write \(config.json, model.safetensors"):
        write_synthetic_checkpoint(real, "tiny-glm")
    assert {p.name: p.read_bytes() for p in real.iterdir()} == before, "a refused write changed the directory"
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="a_file: not a directory"):
        write_synthetic_checkpoint(tmp_path / "a_file", "tiny-glm")


def test_synthetic_kimi_stack_of_27_layers_is_the_published_one():
    config = synthetic_config("kimi", num_layers=27)
    full = [i + 1 for i in range(27) if i not in config.kda_layers]
    assert full == [4, 8, 12, 16, 20, 24, 27] and len(config.kda_layers) == 20
    assert synthetic_config("tiny-kimi", num_layers=1).kda_layers == (0,)
    assert synthetic_config("glm", num_layers=27).kda_layers[-1] == 26, "GLM's stack keeps its rule"
    parsed = KdaConfig.from_dict(config_json(config))
    assert parsed.kda_layers == config.kda_layers

def test_a_layer_does_not_depend_on_the_others(tmp_path):
    four = bind_layer(write_synthetic_checkpoint(tmp_path / "four", "tiny-glm"), 2, progress=False)
    eight = bind_layer(write_synthetic_checkpoint(tmp_path / "eight", "tiny-glm", num_layers=8, shards=3), 2,
                       progress=False)
    assert all(np.array_equal(four.arrays()[n], eight.arrays()[n]) for n in four.arrays())
    other = bind_layer(tmp_path / "four", 1, progress=False)
    assert not np.array_equal(four.q_proj, other.q_proj)


@pytest.mark.parametrize("geometry", ["tiny-glm", "tiny-kimi"])
def test_attention_layers_hold_stand_ins_only(tmp_path, geometry):
    header = read_safetensors_header(write_synthetic_checkpoint(tmp_path / "c", geometry) / "model.safetensors")
    layer3 = sorted(n for n in header if n.startswith("model.layers.3."))
    assert layer3 == [
        "model.layers.3.mlp.gate_proj.weight",
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.3.self_attn.q_a_proj.weight",
    ]
    assert all(f"model.layers.{i}.mlp.gate_proj.weight" in header for i in range(4))
    assert len([n for n in header if n.startswith("model.layers.0.self_attn.")]) == 15


def test_transformers_layout_names(tmp_path):
    header = read_safetensors_header(
        write_synthetic_checkpoint(tmp_path / "t", "tiny-glm", layout="transformers") / "model.safetensors"
    )
    attn = sorted(n[len("model.layers.0.self_attn."):] for n in header if n.startswith("model.layers.0.self_attn."))
    assert attn == sorted([
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "conv1d.weight",
        "forget_gate.f_a_proj.weight", "forget_gate.f_b_proj.weight", "forget_gate.dt_bias", "forget_gate.A_log",
        "b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "o_norm.weight", "o_proj.weight",
    ])
    assert header["model.layers.0.self_attn.conv1d.weight"] == ("BF16", (96, 1, 4))


def test_shards_are_contiguous_and_the_index_is_complete(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "s", "tiny-glm", num_layers=8, shards=4)
    index = json.loads((path / INDEX_FILE).read_text())
    total = 0
    for shard in range(4):
        file = shard_filename(shard, 4)
        header = read_safetensors_header(path / file)
        layers = {int(n.split(".")[2]) for n in header if n.startswith("model.layers.")}
        assert layers == {2 * shard, 2 * shard + 1}
        assert all(index["weight_map"][n] == file for n in header)
        total += sum(v.nbytes for v in read_all(path / file).values())
    shards = set(index["weight_map"].values())
    assert len(index["weight_map"]) == sum(len(read_safetensors_header(path / f)) for f in shards)
    assert index["metadata"]["total_size"] == total


def test_a_kda_config_picks_its_config_form(tmp_path):
    kimi_like = KdaConfig(hidden=64, heads=2, head_dim=16, conv_kernel=4, gate_law="softplus",
                          gate_lower_bound=None, rms_norm_eps=1e-6)
    path = write_synthetic_checkpoint(tmp_path / "k", kimi_like, num_layers=5)
    raw = json.loads((path / "config.json").read_text())
    assert raw["linear_attn_config"]["kda_layers"] == [1, 2, 3, 5]
    assert raw["linear_attn_config"]["full_attn_layers"] == [4]
    assert "gate_lower_bound" not in raw["linear_attn_config"]
    parsed = KdaConfig.from_file(path / "config.json")
    assert (parsed.gate_law, parsed.rms_norm_eps, parsed.kda_layers) == ("softplus", 1e-6, (0, 1, 2, 4))
    assert bind_layer(path, 4, progress=False).a_log.shape == (2,)


def test_config_forms_must_fit_the_gate_law():
    with pytest.raises(ValueError, match="does not fit the bounded gate law"):
        config_json(synthetic_config("tiny-glm"), "kimi")
    with pytest.raises(ValueError, match="does not fit the softplus gate law"):
        config_json(synthetic_config("tiny-kimi"), "flat")


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="geometry must be"):
        synthetic_config("llama")
    with pytest.raises(ValueError, match="layout must be"):
        write_synthetic_checkpoint(tmp_path, "tiny-glm", layout="gguf")
    with pytest.raises(ValueError, match="conv_order"):
        write_synthetic_checkpoint(tmp_path, "tiny-glm", conv_order=("q", "q", "v"))
    with pytest.raises(ValueError, match="shards must be in 1..4"):
        write_synthetic_checkpoint(tmp_path, "tiny-glm", shards=5)


def test_synthetic_hidden():
    rows = synthetic_hidden(257, 512, seed=1)
    assert rows.shape == (257, 512) and rows.dtype == BF16
    rms = np.sqrt(np.mean(rows.astype(np.float64) ** 2))
    assert abs(rms - 1) < 0.02
    assert np.array_equal(rows, synthetic_hidden(257, 512, seed=1))
    assert not np.array_equal(rows, synthetic_hidden(257, 512, seed=2))
