"""Bad inputs on the host side: each is refused with the named exception, a message that names
the offending key, tensor, file, shape, dtype or value, and nothing changed (files, states)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from glm_kda import cli
from glm_kda.checkpoint import CheckpointError, bind_layer, check_layers
from glm_kda.config import ConfigError, KdaConfig
from glm_kda.reference import KdaOracle
from glm_kda.state import KdaState
from glm_kda.synthetic import config_json, synthetic_config, synthetic_hidden, write_synthetic_checkpoint

TINY = synthetic_config("tiny-glm")


# Config values -------------------------------------------------------------------------------
@pytest.mark.parametrize("change,needle", [
    ({"gate_lower_bound": 2.0}, "gate_lower_bound must be a finite number <= 0"),
    ({"gate_lower_bound": math.nan}, "gate_lower_bound must be a finite number <= 0 .a log-decay., got nan"),
    ({"gate_lower_bound": -math.inf}, "gate_lower_bound must be a finite number <= 0 .a log-decay., got -inf"),
    ({"gate_lower_bound": "-5"}, "gate_lower_bound must be a finite number <= 0 .a log-decay., got '-5'"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps must be a finite number > 0, got inf"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps must be a finite number > 0, got nan"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps must be a finite number > 0"),
    ({"l2_eps": -1e-6}, "l2_eps must be a finite number > 0"),
    ({"num_layers": 0}, "num_layers .* must be a positive integer, got 0"),
    ({"num_layers": -3}, "num_layers .* must be a positive integer, got -3"),
    ({"kda_layers": (0, 9)}, r"kda_layers \[9\] lie outside the stack of 4 layers"),
    ({"heads": True}, "heads must be a positive integer, got True"),
    ({"chunk": 0}, "chunk must be a positive integer, got 0"),
], ids=lambda v: str(v)[:40])
def test_a_bad_config_value_is_refused_by_name(change, needle):
    with pytest.raises(ConfigError, match=needle):
        dataclasses.replace(TINY, **change)


def _lac(**changes) -> dict:
    """A Kimi-form config.json (linear_attn_config) with `changes` made inside linear_attn_config."""
    raw = config_json(synthetic_config("tiny-glm", num_layers=6), "linear_attn_config")
    raw["linear_attn_config"].update(changes)
    return raw


def _raw(**changes) -> dict:
    raw = config_json(synthetic_config("tiny-glm", num_layers=6), "linear_attn_config")
    raw.update(changes)
    return raw


@pytest.mark.parametrize("raw,needle", [
    ([], "expected a JSON object, got a list"),
    ("text", "expected a JSON object, got a str"),
    (_raw(num_hidden_layers=0), "'num_hidden_layers' = 0 is not a positive layer count"),
    (_raw(num_hidden_layers=-3), "'num_hidden_layers' = -3 is not a positive layer count"),
    (_raw(layer_types=["linear_attention"] * 5), "'layer_types' lists 5 layers, num_hidden_layers is 6"),
    (_raw(layer_types=["linear_attention"] * 5 + [None]), "'layer_types' must be a list of layer type names"),
    (_raw(layer_types="linear_attention"), "'layer_types' must be a list of layer type names"),
    (_raw(num_hidden_layers=10**9), "'num_hidden_layers' = 1000000000 is not a plausible layer count"),
    (_raw(hidden_size=0), "key 'hidden_size': hidden must be a positive integer, got 0"),
    (_raw(rms_norm_eps=-1e-5), "key 'rms_norm_eps': rms_norm_eps must be a finite number > 0"),
    (_lac(num_heads=-2), "key 'linear_attn_config.num_heads': heads must be a positive integer, got -2"),
    (_lac(short_conv_kernel_size=0), "key 'linear_attn_config.short_conv_kernel_size': conv_kernel must be"),
    (_lac(gate_lower_bound=2.5), "key 'linear_attn_config.gate_lower_bound': gate_lower_bound must be a finite"),
], ids=lambda v: str(v)[:30])
def test_a_bad_config_json_is_refused_naming_the_key(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        KdaConfig.from_dict(raw, source="config.json")


def test_layer_types_name_kda_layers_exactly():
    kinds = ["linear_attention", "nonlinear_attention", "full_attention", "kda", "linear_attention_v2", "kda"]
    assert KdaConfig.from_dict(_raw(layer_types=kinds)).kda_layers == (0, 3, 5)


# Checkpoint files ----------------------------------------------------------------------------
@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return write_synthetic_checkpoint(tmp_path / "ckpt", "tiny-glm")


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_a_truncated_shard_is_named_by_inspect_and_bind(checkpoint):
    shard = checkpoint / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    before = _snapshot(checkpoint)
    for call in (lambda: check_layers(checkpoint), lambda: bind_layer(checkpoint, 0, progress=False)):
        with pytest.raises(CheckpointError, match=r"model.safetensors: truncated: tensor '.*' ends at byte \d+, the file at"):
            call()
    assert _snapshot(checkpoint) == before


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weights_are_refused_at_bind_naming_the_tensor(tmp_path, bad):
    from safetensors.numpy import load_file, save_file

    path = write_synthetic_checkpoint(tmp_path / "ckpt", "tiny-glm")
    shard = path / "model.safetensors"
    tensors = load_file(str(shard))
    name = "model.layers.0.self_attn.dt_bias"
    tensors[name] = tensors[name].copy()
    tensors[name][3] = bad
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' holds 1 NaN or Inf values"):
        bind_layer(path, 0, progress=False)
    bind_layer(path, 1, progress=False)  # the other layers bind
    from glm_kda.tp import bind_layer_shard

    # Channel 3 belongs to rank 0 of two: its shard is refused, rank 1's binds.
    with pytest.raises(CheckpointError, match="layer 0 rank 0: dt_bias holds NaN or Inf values"):
        bind_layer_shard(path, 0, 2, 0, progress=False)
    bind_layer_shard(path, 0, 2, 1, progress=False)


def test_inspect_of_a_config_that_is_a_list_prints_one_error_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps([]))
    assert cli.main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "expected a JSON object" in err, err


# Oracle inputs -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def oracle():
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        bound = bind_layer(write_synthetic_checkpoint(Path(folder) / "c", "tiny-glm"), 0, progress=False)
    return KdaOracle(bound, "bf16")


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.bool_, np.uint16])
def test_oracle_rows_of_another_dtype_are_refused(oracle, dtype):
    rows = np.zeros((3, TINY.hidden), dtype)
    with pytest.raises(TypeError, match=rf"prefill: hidden must be an array of BF16, float32 or float64 rows, got ndarray of dtype {np.dtype(dtype)}"):
        oracle.prefill(rows)


@pytest.mark.parametrize("shape", [(3, TINY.hidden + 8), (0, TINY.hidden), (2, 3, TINY.hidden)])
def test_oracle_rows_of_another_shape_are_refused(oracle, shape):
    with pytest.raises(ValueError, match=re.escape(f"prefill: hidden must be [T >= 1, {TINY.hidden}], got {list(shape)}")):
        oracle.prefill(np.zeros(shape, np.float32))


@pytest.mark.parametrize("chunk", [0, -4, 2.5, True])
def test_oracle_chunk_must_be_a_positive_int(oracle, chunk):
    state = KdaState.random(TINY, seed=1)
    before = (state.conv.copy(), state.recurrent.copy())
    with pytest.raises(ValueError, match=rf"prefill: chunk must be None \(token by token\) or an int >= 1, got {chunk!r}"):
        oracle.prefill(synthetic_hidden(3, TINY.hidden), state, chunk=chunk)
    assert np.array_equal(state.conv, before[0]) and np.array_equal(state.recurrent, before[1])


def test_oracle_verify_of_no_rows_is_refused(oracle):
    with pytest.raises(ValueError, match=r"verify: hidden_rows must be \[K >= 1"):
        oracle.verify(np.zeros((0, TINY.hidden), ml_dtypes.bfloat16))


def test_the_bf16_oracle_rounds_fp32_rows_to_bf16(oracle):
    rows = np.random.default_rng(5).standard_normal((4, TINY.hidden)).astype(np.float32)
    from_fp32, _ = oracle.prefill(rows)
    from_bf16, _ = oracle.prefill(rows.astype(ml_dtypes.bfloat16))
    assert all(np.array_equal(from_fp32[name], from_bf16[name]) for name in from_bf16)


# State import ----------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["transformers", "vllm"])
@pytest.mark.parametrize("case,error,needle", [
    ("recurrent 2-D", ValueError, r"recurrent state must be \[H, D, D\], got shape \[2, 128\]"),
    ("recurrent not square", ValueError, r"recurrent state must be \[H, D, D\], got shape \[2, 128, 64\]"),
    ("conv channels", ValueError, r"conv state must be \[3 \* H \* D = 768"),
    ("int conv", TypeError, "conv state must hold floating-point values, got dtype int32"),
    ("NaN recurrent", ValueError, "recurrent state holds NaN or Inf values"),
    ("other geometry", ValueError, "does not fit hidden 64, heads 4"),
])
def test_state_import_checks_shapes_dtypes_values_and_geometry(source, case, error, needle):
    config = dataclasses.replace(TINY, heads=4)
    k = config.conv_kernel - (source == "vllm")
    conv, recurrent = np.zeros((3 * 2 * 128, k), np.float32), np.zeros((2, 128, 128), np.float32)
    given = config if case == "other geometry" else None
    if case == "recurrent 2-D":
        recurrent = np.zeros((2, 128), np.float32)
    elif case == "recurrent not square":
        recurrent = np.zeros((2, 128, 64), np.float32)
    elif case == "conv channels":
        conv = np.zeros((100, k), np.float32)
    elif case == "int conv":
        conv = conv.astype(np.int32)
    elif case == "NaN recurrent":
        recurrent[1, 2, 3] = np.nan
    importer = KdaState.from_transformers if source == "transformers" else KdaState.from_vllm
    with pytest.raises(error, match=needle):
        importer(conv, recurrent, config=given)


def test_state_round_trips_through_both_layouts():
    state = KdaState.random(TINY, seed=3)
    for export, importer in ((KdaState.to_transformers, KdaState.from_transformers), (KdaState.to_vllm, KdaState.from_vllm)):
        back = importer(*export(state), config=TINY)
        assert np.array_equal(back.recurrent, state.recurrent)
        assert np.array_equal(back.conv[:, 1:], state.conv[:, 1:]), "the slots that are read survive"


# Paths and the CLI -----------------------------------------------------------------------------
def test_a_mistyped_local_path_never_goes_to_the_hub(tmp_path, monkeypatch, fake_hub):
    requests = fake_hub(tmp_path / "nowhere")
    (tmp_path / "checkpoints").mkdir()
    monkeypatch.chdir(tmp_path)
    for location in ("checkpoints/glm-typo", "typo", "./checkpoints/glm"):
        with pytest.raises(CheckpointError, match="no such checkpoint directory"):
            KdaConfig.from_pretrained(location)
    assert not requests, f"sent to the hub: {requests}"


def test_offline_a_repo_missing_from_the_cache_fails_at_once(tmp_path, monkeypatch):
    import time

    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="hub repo 'someorg/no-such-repo': no file 'config.json' .or not in the local cache while offline"):
        KdaConfig.from_pretrained("someorg/no-such-repo", cache_dir=str(tmp_path))
    assert time.perf_counter() - start < 5, "offline, nothing should wait on the network"
    assert not any(tmp_path.iterdir()), "a refused lookup wrote into the cache"


@pytest.mark.parametrize("argv,needle", [
    (["inspect", "/no/such/checkpoint"], "no such checkpoint directory"),
    (["inspect", "{config_list}"], "expected a JSON object"),
    (["inspect", "{not_json}"], "not valid JSON"),
])
def test_the_cli_answers_bad_input_with_one_error_line(tmp_path, capsys, argv, needle):
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[]")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    argv = [a.format(config_list=tmp_path / "list", not_json=tmp_path / "bad") for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


def test_the_cli_says_its_version(capsys):
    from glm_kda import __version__

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"glm-kda {__version__}"


# Binder, pool and oracle objects ---------------------------------------------------------------
@pytest.mark.parametrize("layer_idx,error,needle", [
    (3, CheckpointError, "layer 3 is an attention .* layer, not KDA; KDA layers: 0, 1, 2"),
    (-1, CheckpointError, "layer -1 is outside the stack of 4 layers"),
    (4, CheckpointError, "layer 4 is outside the stack of 4 layers"),
    (1.5, TypeError, "layer_idx must be an int .0-based., got float 1.5"),
    ("0", TypeError, "layer_idx must be an int .0-based., got str '0'"),
    (True, TypeError, "layer_idx must be an int .0-based., got bool True"),
])
def test_the_binder_names_a_bad_layer_index(checkpoint, layer_idx, error, needle):
    with pytest.raises(error, match=needle):
        bind_layer(checkpoint, layer_idx, progress=False)


def test_the_binder_names_a_config_of_another_type(checkpoint):
    with pytest.raises(TypeError, match="bind_layer: config must be a KdaConfig or None .read from config.json., got str"):
        bind_layer(checkpoint, 0, config="tiny-glm", progress=False)


@pytest.mark.parametrize("slots,error,needle", [
    (0, ValueError, "a pool needs >= 1 slot, got 0"),
    (-2, ValueError, "a pool needs >= 1 slot, got -2"),
    (2.5, TypeError, r"slots \(the pool's size\) must be an int, got float 2.5"),
])
def test_a_pool_of_a_bad_size_is_refused(slots, error, needle):
    from glm_kda.state import StatePool

    with pytest.raises(error, match=needle):
        StatePool(TINY, slots, np)


@pytest.mark.parametrize("slot,error,needle", [
    (3, IndexError, "slot 3 outside this pool of 3 slots"),
    (-1, IndexError, "slot -1 outside this pool of 3 slots"),
    (1.5, TypeError, "slot must be an int, got float 1.5"),
    ("1", TypeError, "slot must be an int, got str '1'"),
])
@pytest.mark.parametrize("use", ["state", "reset"])
def test_a_bad_slot_is_refused_and_the_pool_unchanged(slot, error, needle, use):
    from glm_kda.state import StatePool

    pool = StatePool(TINY, 3, np)
    pool.recurrent[...] = 1.0
    with pytest.raises(error, match=needle):
        pool.state(slot) if use == "state" else pool.reset(0, slot)
    assert (pool.recurrent == 1.0).all(), "a refused reset zeroed a slot"


def test_the_oracle_names_what_it_was_given(oracle):
    with pytest.raises(TypeError, match="state must be a KdaState .or None for a new sequence., got tuple"):
        oracle.prefill(np.zeros((2, TINY.hidden), np.float32), (1, 2))
    with pytest.raises(TypeError, match="KdaOracle: layer must be a BoundLayer .* object lacks qkv_weight, down_weight"):
        KdaOracle(object())
    with pytest.raises(ValueError, match=r"precision must be one of \('float64', 'bf16'\), got 'fp16'"):
        KdaOracle(object(), "fp16")


# Checkpoint files, one fault each: bind_layer refuses naming the file, tensor or key; inspect's
# header check (check_layers) reports the same fault without reading data; no file changes ------
_ATTN = "model.layers.0.self_attn."


def _retensor(path: Path, change) -> None:
    from safetensors.numpy import load_file, save_file

    shard = path / "model.safetensors"
    tensors = load_file(str(shard))
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _set(name: str, make):
    return lambda path: _retensor(path, lambda t: t.__setitem__(_ATTN + name, make(t[_ATTN + name])))


def _config_without(key: str):
    def change(path: Path) -> None:
        raw = json.loads((path / "config.json").read_text())
        raw.pop(key)
        (path / "config.json").write_text(json.dumps(raw))
    return change


def _write(name: str, data: bytes):
    return lambda path: (path / name).write_bytes(data)


def _index(weight_map) -> callable:
    def change(path: Path) -> None:
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return change


FILE_FAULTS = {
    "dt_bias in float16": (_set("dt_bias", lambda a: a.astype(np.float16)), CheckpointError,
                           "tensor 'model.layers.0.self_attn.dt_bias' has wrong dtype: expected F32, found F16", True),
    "A_log as int32": (_set("A_log", lambda a: a.astype(np.int32)), CheckpointError,
                       "'model.layers.0.self_attn.A_log' has wrong dtype: expected F32, found I32", True),
    "dt_bias one short": (_set("dt_bias", lambda a: a[:-1].copy()), CheckpointError,
                          "'model.layers.0.self_attn.dt_bias' has wrong shape: expected [32], found [31]", True),
    "o_proj transposed": (_set("o_proj.weight", lambda a: a.T.copy()), CheckpointError,
                          "'model.layers.0.self_attn.o_proj.weight' has wrong shape", True),
    "dt_bias missing": (lambda p: _retensor(p, lambda t: t.pop(_ATTN + "dt_bias")), CheckpointError,
                        "missing tensor 'model.layers.0.self_attn.dt_bias' (expected [32] F32", True),
    "no config.json": (lambda p: (p / "config.json").unlink(), CheckpointError, "no file 'config.json'", False),
    "config.json not JSON": (_write("config.json", b"{"), ConfigError, "config.json: not valid JSON", False),
    "config.json without hidden_size": (_config_without("hidden_size"), ConfigError, "missing key 'hidden_size'", False),
    "a shard's header not JSON": (_write("model.safetensors", b"\x10" + bytes(7) + b"not json at all!"), CheckpointError,
                                  "model.safetensors: unreadable safetensors header", False),
    "a shard of three bytes": (_write("model.safetensors", b"abc"), CheckpointError,
                               "model.safetensors: not a safetensors file (shorter than its 8-byte header length)", False),
    "a shard's header length past its end": (_write("model.safetensors", (1 << 40).to_bytes(8, "little")), CheckpointError,
                                             "model.safetensors: not a safetensors file (header length", False),
    "no shard at all": (lambda p: (p / "model.safetensors").unlink(), CheckpointError, "no safetensors files", False),
    "index not JSON": (_write("model.safetensors.index.json", b"[oops"), CheckpointError,
                       "model.safetensors.index.json: not valid JSON", False),
    "index without weight_map": (_write("model.safetensors.index.json", b"{}"), CheckpointError,
                                 "model.safetensors.index.json: no 'weight_map' object", False),
    "index that is a list": (_write("model.safetensors.index.json", b"[]"), CheckpointError,
                             "model.safetensors.index.json: no 'weight_map' object", False),
    "index naming a missing shard": (_index({_ATTN + "dt_bias": "model-00009.safetensors"}), CheckpointError,
                                     "names shard 'model-00009.safetensors', which is not in", True),
}


@pytest.mark.parametrize("fault", list(FILE_FAULTS))
def test_a_faulty_checkpoint_file_is_named_and_left_as_it_was(checkpoint, fault):
    change, error, needle, header_check_reports = FILE_FAULTS[fault]
    change(checkpoint)
    before = _snapshot(checkpoint)
    with pytest.raises(error) as info:
        bind_layer(checkpoint, 0, progress=False)
    assert needle in str(info.value), f"{fault}: {info.value}"
    if header_check_reports:
        report = {layer: (ok, message) for layer, ok, message in check_layers(checkpoint)}
        assert report[0][0] is False and needle in report[0][1], f"{fault}: inspect's header check says {report[0]}"
    else:
        with pytest.raises(error, match=re.escape(needle)):
            check_layers(checkpoint)
    assert _snapshot(checkpoint) == before, f"{fault}: a refused bind changed a file"


# The CLI's arguments: argparse's own refusals exit 2 with a usage line and one error line ------
@pytest.mark.parametrize("argv,needle", [
    (["demo", "--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    (["demo", "--prompt", "-5"], "argument --prompt: expected an integer >= 1, got -5"),
    (["demo", "--prompt", "many"], "argument --prompt: expected an integer >= 1, got 'many'"),
    (["demo", "--geometry", "gpt"], "argument --geometry: invalid choice: 'gpt'"),
    (["demo", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["inspect"], "the following arguments are required: path"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["bench", "nonesuch"], "argument bench: invalid choice: 'nonesuch'"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_cli_arguments_exit_2_naming_the_argument(argv, needle, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert done.value.code == 2 and len(errors) == 1 and needle in errors[0], err
    assert "Traceback" not in err


# Found by a fuzz of the oracle's surface: each named, none an obscure numpy or attribute error --
@pytest.mark.parametrize("call,error,needle", [
    (lambda o: o.prefill(np.zeros((2, TINY.hidden), np.float32),
                         KdaState(np.zeros(TINY.conv_state_shape, np.int32), np.zeros(TINY.recurrent_state_shape, np.int32))),
     TypeError, "state.conv must hold floating-point values, got dtype int32"),
    (lambda o: KdaState.zeros("glm"), TypeError, "KdaState.zeros: config must be a KdaConfig .* got str"),
    (lambda o: __import__("glm_kda").compare_stages({"a": np.zeros(3)}, {"b": np.zeros(3)}), ValueError,
     r"compare_stages: no stage in both: \['a'\] against \['b'\]"),
    (lambda o: __import__("glm_kda").rms_ratio(np.zeros(3), np.zeros(4)), ValueError,
     r"rms_ratio: \[3\] against a reference of \[4\]: not the same elements"),
], ids=["int state", "zeros of a str", "no common stage", "rms_ratio sizes"])
def test_the_oracles_helpers_name_what_they_were_given(oracle, call, error, needle):
    with pytest.raises(error, match=needle):
        call(oracle)
