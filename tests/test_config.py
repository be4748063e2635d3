"""config.json parsing: docs/maths.md section 1. Every value is read, a missing key is named."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from glm_kda.config import ConfigError, KdaConfig
from glm_kda.synthetic import GLM_FORMS, config_json, synthetic_config, write_synthetic_checkpoint

GLM = synthetic_config("glm", num_layers=45)


def write_config(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def kimi_linear_config() -> dict:
    """Kimi-Linear-48B-A3B as published: 27 layers, full attention at 4, 8, ..., 24 and 27 (1-indexed)."""
    full = [4, 8, 12, 16, 20, 24, 27]
    return {
        "model_type": "kimi_linear",
        "hidden_size": 2304,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "num_hidden_layers": 27,
        "linear_attn_config": {
            "num_heads": 32,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "kda_layers": [i for i in range(1, 28) if i not in full],
            "full_attn_layers": full,
        },
    }


@pytest.mark.parametrize("form", GLM_FORMS)
def test_every_glm_form_parses_to_the_same_config(tmp_path, form):
    parsed = KdaConfig.from_file(write_config(tmp_path, config_json(GLM, form)))
    assert parsed == GLM
    assert (parsed.hidden, parsed.heads, parsed.head_dim, parsed.conv_kernel) == (4096, 64, 128, 4)
    assert (parsed.gate_law, parsed.gate_lower_bound, parsed.rms_norm_eps) == ("bounded", -5.0, 1e-5)
    assert len(parsed.kda_layers) == 34 and 3 not in parsed.kda_layers and 44 in parsed.kda_layers


def test_kimi_one_indexed_layers_become_zero_based(tmp_path):
    parsed = KdaConfig.from_file(write_config(tmp_path, kimi_linear_config()))
    assert (parsed.hidden, parsed.heads, parsed.head_dim, parsed.gate_law) == (2304, 32, 128, "softplus")
    assert parsed.gate_lower_bound is None
    assert len(parsed.kda_layers) == 20
    assert parsed.kda_layers[:4] == (0, 1, 2, 4)
    assert 3 not in parsed.kda_layers and 26 not in parsed.kda_layers and 25 in parsed.kda_layers


def test_synthetic_kimi_config_round_trips(tmp_path):
    kimi = synthetic_config("kimi", num_layers=8)
    assert KdaConfig.from_file(write_config(tmp_path, config_json(kimi))) == kimi


def test_glm_layer_types_list_overrides_the_pattern(tmp_path):
    custom = dataclasses.replace(synthetic_config("tiny-glm", num_layers=6), kda_layers=(0, 2, 3, 5))
    raw = config_json(custom, "linear_attn_config")
    assert "layer_types" in raw
    assert KdaConfig.from_file(write_config(tmp_path, raw)).kda_layers == (0, 2, 3, 5)


def _drop(raw: dict, dotted: str) -> dict:
    *parents, key = dotted.split(".")
    node = raw
    for parent in parents:
        node = node[parent]
    del node[key]
    return raw


MISSING_KEYS = [
    ("flat", "hidden_size", "'hidden_size'"),
    ("flat", "rms_norm_eps", "'rms_norm_eps'"),
    ("flat", "linear_lower_bound", "'linear_lower_bound'"),
    ("flat", "linear_head_dim", "'linear_head_dim'"),
    ("linear_attn_config", "linear_attn_config.head_dim", "'linear_attn_config.head_dim'"),
    ("linear_attn_config", "linear_attn_config.gate_lower_bound", "'linear_attn_config.gate_lower_bound'"),
    ("legacy", "linear_attn_config.lower_bound", "'linear_attn_config.gate_lower_bound'"),
    ("text_config", "text_config.rms_norm_eps", "'rms_norm_eps'"),
    ("text_config", "text_config.linear_attn_config.short_conv_kernel_size",
     "'linear_attn_config.short_conv_kernel_size'"),
]


@pytest.mark.parametrize("form, dropped, named", MISSING_KEYS, ids=[f"{f}-{d}" for f, d, _ in MISSING_KEYS])
def test_missing_key_is_named_with_the_file(tmp_path, form, dropped, named):
    path = write_config(tmp_path, _drop(config_json(GLM, form), dropped))
    with pytest.raises(ConfigError) as err:
        KdaConfig.from_file(path)
    message = str(err.value)
    assert named in message and str(path) in message


def test_kimi_missing_head_dim_is_named(tmp_path):
    path = write_config(tmp_path, _drop(kimi_linear_config(), "linear_attn_config.head_dim"))
    with pytest.raises(ConfigError, match=r"missing key 'linear_attn_config\.head_dim'"):
        KdaConfig.from_file(path)


def test_zero_based_kimi_list_is_refused(tmp_path):
    raw = kimi_linear_config()
    raw["linear_attn_config"]["kda_layers"] = [0, 1, 2]
    with pytest.raises(ConfigError, match="1-indexed"):
        KdaConfig.from_file(write_config(tmp_path, raw))


def test_kimi_list_beyond_the_stack_is_refused(tmp_path):
    raw = kimi_linear_config()
    raw["linear_attn_config"]["kda_layers"].append(28)
    with pytest.raises(ConfigError, match="lists layer 28 .* num_hidden_layers is 27"):
        KdaConfig.from_file(write_config(tmp_path, raw))


def test_other_activation_is_refused(tmp_path):
    raw = config_json(GLM, "flat") | {"hidden_act": "gelu"}
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        KdaConfig.from_file(write_config(tmp_path, raw))



@pytest.mark.parametrize("form", GLM_FORMS)
def test_missing_activation_is_refused(tmp_path, form):
    raw = config_json(GLM, form)
    cfg = raw.get("text_config", raw)
    del cfg["hidden_act"]
    with pytest.raises(ConfigError, match="missing key 'hidden_act'"):
        KdaConfig.from_file(write_config(tmp_path, raw))


@pytest.mark.parametrize("key,value,needle", [
    ("linear_attn_config.num_heads", None, "'linear_attn_config.num_heads' = None is not a whole number"),
    ("linear_attn_config.head_dim", 127.9, "'linear_attn_config.head_dim' = 127.9 is not a whole number"),
    ("linear_attn_config.short_conv_kernel_size", "4", "'linear_attn_config.short_conv_kernel_size' = '4'"),
    ("linear_attn_config.gate_lower_bound", None, "'linear_attn_config.gate_lower_bound' = None is not a finite"),
    ("rms_norm_eps", "1e-5x", "'rms_norm_eps' = '1e-5x' is not a finite number"),
    ("rms_norm_eps", True, "'rms_norm_eps' = True"),
    ("hidden_size", 4096.5, "'hidden_size' = 4096.5"),
    ("num_hidden_layers", "45", "'num_hidden_layers' = '45'"),
])
def test_values_of_the_wrong_type_name_their_key(tmp_path, key, value, needle):
    """A config value that is not the number it must be (null, a string, a bool, a fraction for a
    count) is refused with the key and the file named, never converted or cut."""
    raw = config_json(GLM, "text_config")
    where = raw.get("text_config", raw)
    *parents, leaf = key.split(".")
    for parent in parents:
        where = where[parent]
    where[leaf] = value
    path = write_config(tmp_path, raw)
    with pytest.raises(ConfigError, match=re.escape(needle)) as caught:
        KdaConfig.from_file(path)
    assert str(path) in str(caught.value)


def test_whole_floats_are_read_as_counts(tmp_path):
    raw = config_json(GLM, "text_config")
    raw.get("text_config", raw)["linear_attn_config"]["num_heads"] = 64.0
    assert KdaConfig.from_file(write_config(tmp_path, raw)).heads == 64


def test_kimi_layer_list_entries_are_whole_numbers(tmp_path):
    raw = kimi_linear_config()
    raw["linear_attn_config"]["kda_layers"][2] = "3"
    with pytest.raises(ConfigError, match=re.escape("'linear_attn_config.kda_layers[]' = '3'")):
        KdaConfig.from_file(write_config(tmp_path, raw))
    raw["linear_attn_config"]["kda_layers"] = 20
    with pytest.raises(ConfigError, match="kda_layers must be a list"):
        KdaConfig.from_file(write_config(tmp_path, raw))

def test_config_without_kda_geometry_is_refused(tmp_path):
    raw = {"model_type": "llama", "hidden_size": 64, "rms_norm_eps": 1e-5}
    with pytest.raises(ConfigError, match="no KDA geometry.*'llama'"):
        KdaConfig.from_file(write_config(tmp_path, raw))


def test_unreadable_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        KdaConfig.from_file(tmp_path / "absent.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        KdaConfig.from_file(bad)


def test_gate_law_and_bound_must_agree():
    fields = dict(hidden=64, heads=2, head_dim=16, conv_kernel=4, rms_norm_eps=1e-5)
    with pytest.raises(ConfigError, match="gate_lower_bound is required"):
        KdaConfig(**fields, gate_law="bounded", gate_lower_bound=None)
    with pytest.raises(ConfigError, match="meaningless for softplus"):
        KdaConfig(**fields, gate_law="softplus", gate_lower_bound=-5.0)
    with pytest.raises(ConfigError, match="gate_law must be"):
        KdaConfig(**fields, gate_law="sigmoid", gate_lower_bound=None)


@pytest.mark.parametrize("geometry", ["glm", "kimi"])
def test_real_geometries_pass_validate(geometry):
    config = synthetic_config(geometry)
    assert config.validate() is config
    assert config.down_dim == 2 * 128 + config.heads


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(head_dim=64, heads=4), r"head_dim=64: .*exactly 128 floats in registers"),
        (dict(conv_kernel=5), r"conv_kernel=5: .*4 registers"),
        (dict(chunk=128), r"chunk=128: .*shared memory"),
        (dict(hidden=4100), r"hidden=4100.*multiples of 8"),
        (dict(heads=60), r"2\*head_dim\+heads=316.*multiples of 8"),
    ],
    ids=["head_dim", "conv_kernel", "chunk", "hidden", "down_dim"],
)
def test_validate_names_the_reason(change, reason):
    with pytest.raises(ConfigError, match=reason):
        dataclasses.replace(synthetic_config("glm"), **change).validate()


def test_from_pretrained_reads_a_directory_and_a_hub_repo(tmp_path, fake_hub):
    path = write_synthetic_checkpoint(tmp_path / "ckpt", "tiny-kimi")
    assert KdaConfig.from_pretrained(path) == synthetic_config("tiny-kimi")
    requests = fake_hub(path)
    assert KdaConfig.from_pretrained("org/tiny-kimi", chunk=16) == synthetic_config("tiny-kimi").with_chunk(16)
    assert [filename for _, filename, _ in requests] == ["config.json"]
