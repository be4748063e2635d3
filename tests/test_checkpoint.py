"""The checkpoint loader: docs/maths.md section 2.

Both layouts of the same weights bind to identical arrays, sharding changes nothing, only
the layer's shards are fetched from a hub repo, and every malformed checkpoint is refused
with an error that names the tensor, what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import glm_kda.checkpoint as checkpoint
from glm_kda.checkpoint import (
    INDEX_FILE,
    BoundLayer,
    CheckpointError,
    bind_layer,
    check_layers,
    read_safetensors_header,
    resolve_file,
)
from glm_kda.config import KdaConfig
from glm_kda.synthetic import kda_layer_tensors, shard_filename, synthetic_config, write_synthetic_checkpoint

BF16 = ml_dtypes.bfloat16
ATTN0 = "model.layers.0.self_attn."

# tiny-glm: hidden 64, H 2, D 16, qkv 32, K 4.
TINY_QKV, TINY_HIDDEN, TINY_K = 32, 64, 4


def rewrite(directory: Path, edit, filename: str = "model.safetensors") -> None:
    """Load every tensor of one file, let `edit` change the dict, write it back."""
    path = directory / filename
    with safe_open(str(path), framework="numpy") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def assert_same_layer(a: BoundLayer, b: BoundLayer) -> None:
    for name, value in a.arrays().items():
        other = b.arrays()[name]
        assert value.dtype == other.dtype, name
        assert value.shape == other.shape, name
        assert np.array_equal(value.view(np.uint8), other.view(np.uint8)), f"{name} differs"


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write_synthetic_checkpoint(tmp_path / "tiny", "tiny-glm")


# Layouts and geometry --------------------------------------------------------------------
@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_release_and_transformers_layouts_bind_identical_arrays(real_checkpoint, geometry):
    release = bind_layer(real_checkpoint(geometry, "release"), 0, progress=False)
    transformers = bind_layer(real_checkpoint(geometry, "transformers"), 0, progress=False)
    assert (release.layout, transformers.layout) == ("release", "transformers")
    assert_same_layer(release, transformers)

    cfg = release.config
    hidden, heads, head_dim, qkv, kernel = cfg.hidden, cfg.heads, cfg.head_dim, cfg.qkv, cfg.conv_kernel
    expected = {
        "q_proj": ((qkv, hidden), BF16), "k_proj": ((qkv, hidden), BF16), "v_proj": ((qkv, hidden), BF16),
        "conv_weight": ((3 * qkv, kernel), BF16),
        "f_a": ((head_dim, hidden), BF16), "f_b": ((qkv, head_dim), BF16),
        "dt_bias": ((qkv,), np.float32), "a_log": ((heads,), np.float32),
        "b_proj": ((heads, hidden), BF16), "g_a": ((head_dim, hidden), BF16), "g_b": ((qkv, head_dim), BF16),
        "o_norm": ((head_dim,), BF16), "o_proj": ((hidden, qkv), BF16),
    }
    got = {name: (value.shape, value.dtype) for name, value in release.arrays().items()}
    assert got == {name: (shape, np.dtype(dtype)) for name, (shape, dtype) in expected.items()}
    assert release.qkv_weight.shape == (3 * qkv, hidden)
    assert release.down_weight.shape == (2 * head_dim + heads, hidden)


@pytest.mark.parametrize("geometry, stored", [("glm", [64]), ("kimi", [1, 1, 32, 1])], ids=["glm-H", "kimi-11H1"])
def test_a_log_is_per_head_whatever_its_stored_shape(real_checkpoint, geometry, stored):
    path = real_checkpoint(geometry, "release")
    header = read_safetensors_header(path / "model.safetensors")
    assert list(header[ATTN0 + "A_log"][1]) == stored
    layer = bind_layer(path, 0, progress=False)
    assert layer.a_log.shape == (layer.config.heads,)
    assert layer.dt_bias.shape == (layer.config.qkv,)


def test_bound_arrays_are_the_written_tensors_with_conv_in_q_k_v_order(tiny):
    config = synthetic_config("tiny-glm")
    layer = bind_layer(tiny, 1, progress=False)
    written = kda_layer_tensors(config, 1, seed=0)
    for part, rows in zip("qkv", np.split(layer.conv_weight, 3)):
        assert np.array_equal(rows, written[f"{part}_conv1d.weight"][:, 0, :])
    assert np.array_equal(layer.f_b, written["f_b_proj.weight"])
    assert np.array_equal(layer.g_b, written["g_b_proj.weight"])
    assert np.array_equal(layer.qkv_weight, np.concatenate([layer.q_proj, layer.k_proj, layer.v_proj]))
    assert np.array_equal(layer.down_weight, np.concatenate([layer.f_a, layer.g_a, layer.b_proj]))



# BoundLayer field -> the release tensor it is (the conv taps are checked above, q|k|v fused).
_WRITTEN_AS = {"q_proj": "q_proj.weight", "k_proj": "k_proj.weight", "v_proj": "v_proj.weight",
               "f_a": "f_a_proj.weight", "f_b": "f_b_proj.weight", "dt_bias": "dt_bias", "a_log": "A_log",
               "b_proj": "b_proj.weight", "g_a": "g_a_proj.weight", "g_b": "g_b_proj.weight",
               "o_norm": "o_norm.weight", "o_proj": "o_proj.weight"}


@pytest.mark.parametrize("layout", ["release", "transformers"])
@pytest.mark.parametrize("geometry", ["tiny-glm", "tiny-kimi"])
def test_every_bound_array_holds_the_values_written(tmp_path, geometry, layout):
    """Each of the 12 non-conv arrays a layer binds holds the values of the tensor written under its
    name, element for element and in order (Kimi's A_log stored [1, 1, H, 1]): a loader that
    permuted, negated or reversed one (A_log, dt_bias: per head and per channel) binds the wrong
    layer whatever the layout, which comparing two layouts with each other cannot see."""
    config = synthetic_config(geometry)
    layer = bind_layer(write_synthetic_checkpoint(tmp_path, geometry, layout=layout), 1, progress=False)
    written = kda_layer_tensors(config, 1, seed=0)
    assert set(_WRITTEN_AS) | {"conv_weight"} == set(layer.ARRAY_FIELDS)
    for field, name in _WRITTEN_AS.items():
        got, expected = getattr(layer, field), written[name]
        assert got.size == expected.size, f"{field}: {got.shape} against the written {expected.shape}"
        assert np.array_equal(got.reshape(-1).view(np.uint8), np.ascontiguousarray(expected).reshape(-1).view(np.uint8)), \
            f"{field} is not the tensor {name} as written ({geometry}, {layout} layout)"

@pytest.mark.parametrize("layout", ["release", "transformers"])
def test_swapped_conv_order_puts_k_taps_first(tmp_path, layout):
    good = bind_layer(write_synthetic_checkpoint(tmp_path / "good", "tiny-glm", layout=layout), 0, progress=False)
    bad_path = write_synthetic_checkpoint(tmp_path / "bad", "tiny-glm", layout=layout, conv_order=("k", "q", "v"))
    bad = bind_layer(bad_path, 0, progress=False)
    qkv = good.config.qkv
    assert np.array_equal(bad.conv_weight[:qkv], good.conv_weight[qkv : 2 * qkv])
    assert np.array_equal(bad.conv_weight[qkv : 2 * qkv], good.conv_weight[:qkv])
    assert not np.array_equal(bad.conv_weight, good.conv_weight)


# Files -----------------------------------------------------------------------------------
@pytest.mark.parametrize("geometry", ["tiny-glm", "tiny-kimi"])
def test_four_shards_bind_like_one_file(tmp_path, geometry):
    single = write_synthetic_checkpoint(tmp_path / "single", geometry)
    sharded = write_synthetic_checkpoint(tmp_path / "sharded", geometry, shards=4)
    assert (sharded / INDEX_FILE).is_file() and not (sharded / "model.safetensors").exists()
    for layer_idx in (0, 1, 2):
        assert_same_layer(bind_layer(single, layer_idx, progress=False), bind_layer(sharded, layer_idx, progress=False))


def test_shards_without_an_index_are_found_by_their_headers(tmp_path):
    single = write_synthetic_checkpoint(tmp_path / "single", "tiny-glm")
    loose = write_synthetic_checkpoint(tmp_path / "loose", "tiny-glm", shards=4)
    (loose / INDEX_FILE).unlink()
    assert_same_layer(bind_layer(single, 2, progress=False), bind_layer(loose, 2, progress=False))


def test_only_the_layers_own_shards_are_needed(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "ckpt", "tiny-glm", shards=4)
    (path / shard_filename(0, 4)).unlink()
    bind_layer(path, 2, progress=False)  # shard 3 of 4: unaffected
    with pytest.raises(CheckpointError) as err:
        bind_layer(path, 0, progress=False)
    message = str(err.value)
    assert INDEX_FILE in message and shard_filename(0, 4) in message and ATTN0 + "q_proj.weight" in message


def test_progress_bar_does_not_change_the_result(tiny):
    assert_same_layer(bind_layer(tiny, 0, progress=True), bind_layer(tiny, 0, progress=False))


# Errors that name the culprit ------------------------------------------------------------
def test_missing_tensor_lists_near_names(tiny):
    rewrite(tiny, lambda t: t.pop(ATTN0 + "k_conv1d.weight"))
    with pytest.raises(CheckpointError) as err:
        bind_layer(tiny, 0, progress=False)
    message = str(err.value)
    assert "layer 0" in message and "missing tensor" in message
    assert f"'{ATTN0}k_conv1d.weight'" in message
    assert f"expected [{TINY_QKV}, 1, {TINY_K}] BF16" in message
    assert ATTN0 + "q_conv1d.weight" in message.split("near names:")[1]


def test_renamed_tensor_is_suggested(tiny):
    rewrite(tiny, lambda t: t.update({ATTN0 + "f_a.weight": t.pop(ATTN0 + "f_a_proj.weight")}))
    with pytest.raises(CheckpointError, match=r"missing tensor .*f_a_proj\.weight.*near names: .*f_a\.weight"):
        bind_layer(tiny, 0, progress=False)


def test_wrong_shape_names_expected_and_found(tiny):
    wide = np.zeros((TINY_QKV, TINY_HIDDEN + 8), dtype=BF16)
    rewrite(tiny, lambda t: t.update({ATTN0 + "q_proj.weight": wide}))
    with pytest.raises(CheckpointError) as err:
        bind_layer(tiny, 0, progress=False)
    message = str(err.value)
    assert f"'{ATTN0}q_proj.weight'" in message
    assert f"expected [{TINY_QKV}, {TINY_HIDDEN}], found [{TINY_QKV}, {TINY_HIDDEN + 8}]" in message


def test_dt_bias_per_head_is_a_wrong_shape(tiny):
    rewrite(tiny, lambda t: t.update({ATTN0 + "dt_bias": np.zeros(2, dtype=np.float32)}))
    with pytest.raises(CheckpointError, match=rf"dt_bias' has wrong shape: expected \[{TINY_QKV}\], found \[2\]"):
        bind_layer(tiny, 0, progress=False)


def test_wrong_dtype_names_expected_and_found(tiny):
    rewrite(tiny, lambda t: t.update({ATTN0 + "dt_bias": t[ATTN0 + "dt_bias"].astype(BF16)}))
    with pytest.raises(CheckpointError) as err:
        bind_layer(tiny, 0, progress=False)
    message = str(err.value)
    assert f"'{ATTN0}dt_bias'" in message and "expected F32, found BF16" in message


def test_rank_two_conv_in_release_layout_is_refused(tiny):
    rewrite(tiny, lambda t: t.update({ATTN0 + "v_conv1d.weight": t[ATTN0 + "v_conv1d.weight"][:, 0, :]}))
    with pytest.raises(CheckpointError) as err:
        bind_layer(tiny, 0, progress=False)
    message = str(err.value)
    assert f"'{ATTN0}v_conv1d.weight'" in message
    assert f"expected [{TINY_QKV}, 1, {TINY_K}], found [{TINY_QKV}, {TINY_K}]" in message


def test_transformers_fused_conv_shape_is_checked(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "t", "tiny-glm", layout="transformers")
    rewrite(path, lambda t: t.update({ATTN0 + "conv1d.weight": t[ATTN0 + "conv1d.weight"][:TINY_QKV]}))
    with pytest.raises(CheckpointError, match=rf"conv1d\.weight' has wrong shape: expected \[{3 * TINY_QKV}, 1, 4\]"):
        bind_layer(path, 0, progress=False)


def test_attention_layer_is_refused_by_the_config(tiny):
    expected = r"layer 3 is an attention \(MLA/DSA\) layer, not KDA; KDA layers: 0, 1, 2$"
    with pytest.raises(CheckpointError, match=expected):
        bind_layer(tiny, 3, progress=False)


def test_attention_layer_is_recognised_without_a_layer_list(tiny):
    config = dataclasses.replace(KdaConfig.from_file(tiny / "config.json"), kda_layers=())
    with pytest.raises(CheckpointError, match=r"layer 3 is an attention \(MLA/DSA\) layer.*q_a_proj"):
        bind_layer(tiny, 3, config, progress=False)


def test_layer_outside_the_stack_is_refused(tiny):
    with pytest.raises(CheckpointError, match="layer 4 is outside the stack of 4 layers"):
        bind_layer(tiny, 4, progress=False)


def test_directory_without_safetensors_is_refused(tiny):
    (tiny / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors files"):
        bind_layer(tiny, 0, progress=False)


def test_missing_directory_and_missing_config_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        bind_layer(tmp_path / "absent", 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no file 'config.json'"):
        resolve_file(tmp_path / "empty", "config.json")


def test_geometry_mismatch_with_the_config_is_refused(real_checkpoint):
    kimi = synthetic_config("kimi", num_layers=1)
    expected = r"q_proj\.weight' has wrong shape: expected \[4096, 2304\], found \[8192, 4096\]"
    with pytest.raises(CheckpointError, match=expected):
        bind_layer(real_checkpoint("glm", "release"), 0, kimi, progress=False)


# Hub -------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer_idx, shard", [(0, 0), (1, 1), (2, 2)])
def test_hub_downloads_only_config_index_and_the_layers_shard(tmp_path, fake_hub, layer_idx, shard):
    local = write_synthetic_checkpoint(tmp_path / "repo", "tiny-glm", shards=4)
    requests = fake_hub(local)
    layer = bind_layer("org/synthetic-glm", layer_idx, progress=False, revision="main")
    assert [filename for _, filename, _ in requests] == ["config.json", INDEX_FILE, shard_filename(shard, 4)]
    assert all(repo == "org/synthetic-glm" and kwargs == {"revision": "main"} for repo, _, kwargs in requests)
    assert_same_layer(layer, bind_layer(local, layer_idx, progress=False))


def test_hub_single_file_repo(tmp_path, fake_hub):
    local = write_synthetic_checkpoint(tmp_path / "repo", "tiny-kimi")
    requests = fake_hub(local)
    layer = bind_layer("org/synthetic-kimi", 1, progress=False)
    assert [filename for _, filename, _ in requests] == ["config.json", INDEX_FILE, "model.safetensors"]
    assert layer.config.gate_law == "softplus"


def test_hub_missing_file_is_a_checkpoint_error(tmp_path, fake_hub):
    fake_hub(tmp_path)
    with pytest.raises(CheckpointError, match="hub repo 'org/empty': no file 'config.json'"):
        resolve_file("org/empty", "config.json")


# Header-only check -----------------------------------------------------------------------
def test_check_layers_reads_headers_only(tiny, monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("check_layers read tensor data")

    monkeypatch.setattr(checkpoint, "safe_open", no_data)
    assert [(i, ok) for i, ok, _ in check_layers(tiny)] == [(0, True), (1, True), (2, True)]


def test_check_layers_reports_each_bad_layer(tmp_path):
    path = write_synthetic_checkpoint(tmp_path / "ckpt", "tiny-glm", num_layers=8)
    rewrite(path, lambda t: t.pop("model.layers.5.self_attn.A_log"))
    report = {i: (ok, message) for i, ok, message in check_layers(path)}
    assert sorted(report) == [0, 1, 2, 4, 5, 6]
    assert [i for i, (ok, _) in report.items() if not ok] == [5]
    assert "missing tensor 'model.layers.5.self_attn.A_log'" in report[5][1]
    assert "[2] or [1, 1, 2, 1] F32" in report[5][1]


def test_check_layers_finds_kda_layers_without_a_list(tiny):
    config = dataclasses.replace(KdaConfig.from_file(tiny / "config.json"), kda_layers=())
    assert [i for i, ok, _ in check_layers(tiny, config) if ok] == [0, 1, 2]


def test_check_layers_on_a_hub_repo_uses_remote_headers(tmp_path, fake_hub, monkeypatch):
    local = write_synthetic_checkpoint(tmp_path / "repo", "tiny-glm", shards=2)
    index = json.loads((local / INDEX_FILE).read_text())
    files = {
        file: SimpleNamespace(tensors={
            name: SimpleNamespace(dtype=dtype, shape=list(shape))
            for name, (dtype, shape) in read_safetensors_header(local / file).items()
        })
        for file in set(index["weight_map"].values())
    }
    monkeypatch.setattr(checkpoint, "get_safetensors_metadata", lambda repo_id, **kwargs: SimpleNamespace(
        sharded=True, weight_map=index["weight_map"], files_metadata=files))
    requests = fake_hub(local)
    checked = [(index, ok) for index, ok, _ in check_layers("org/synthetic-glm")]
    assert checked == [(index, True) for index in KdaConfig.from_pretrained(local).kda_layers], checked
    assert [filename for _, filename, _ in requests] == ["config.json"]
