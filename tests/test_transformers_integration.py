"""glm_kda.integrations.transformers: a small random Kimi-Linear model from transformers' own
config class (no download) with its KDA blocks replaced. On the CPU the blocks run the BF16-faithful
NumPy oracle; on a GPU the CUDA kernels. Logits against transformers' float32 run are within 1.5x
of what transformers' own BF16 run differs by; the cache holds what the original blocks leave;
generate works on a batch of prompts of different lengths; restore() puts the blocks back."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the transformers integration needs torch (an optional extra)")
transformers = pytest.importorskip("transformers", minversion="5.17",
                                   reason="the transformers integration needs transformers >= 5.17 (an optional extra)")

from glm_kda.integrations.transformers import _cached_states, use_glm_kda  # noqa: E402

E2E_FACTOR = 1.5


def _model(kind: str, dtype=torch.float32):
    """A random four-layer model (KDA layers 0, 1, 2, then attention), hidden 512, 8 KDA heads of 128
    (the low-rank projections' 2·128 + 8 rows: a multiple of 8, as the GEMV kernels need)."""
    if kind == "kimi":
        if not hasattr(transformers, "KimiLinearConfig"):
            pytest.skip(f"transformers {transformers.__version__} has no Kimi-Linear model")
        config = transformers.KimiLinearConfig(
            vocab_size=256, hidden_size=512, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_token=2,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
            linear_attn_config={"head_dim": 128, "num_heads": 8, "short_conv_kernel_size": 4,
                                "kda_layers": [1, 2, 3], "full_attn_layers": [4]})
        make = transformers.KimiLinearForCausalLM
    else:
        if not hasattr(transformers, "Glm5NextConfig"):
            pytest.skip(f"transformers {transformers.__version__} has no GLM-5.3-Flash model (glm5_next)")
        text = dict(vocab_size=256, hidden_size=512, intermediate_size=512, moe_intermediate_size=256,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                    num_experts_per_tok=2, kv_lora_rank=64, q_lora_rank=128, v_head_dim=64, qk_nope_head_dim=64,
                    index_topk=16, index_head_dim=32, index_n_heads=2, linear_head_dim=128, linear_num_heads=8,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
        vision = dict(hidden_size=64, depth=1, num_heads=2, out_hidden_size=512, intermediate_size=64)
        config = transformers.Glm5NextConfig(text_config=text, vision_config=vision)
        make = transformers.Glm5NextForConditionalGeneration
    torch.manual_seed(0)
    model = make(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a forget gate that forgets (A_log and dt_bias start uninitialised or zero)
        for module in model.modules():
            if type(module).__name__ in ("KimiLinearForgetGate", "Glm5NextTextForgetGate"):
                module.A_log.copy_(torch.linspace(-1.0, 0.5, module.A_log.numel()).view_as(module.A_log))
                module.dt_bias.copy_(torch.randn(module.dt_bias.shape, generator=generator) * 0.5)
    return model.to(dtype)


def _layers(model):
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return inner.layers


def _rms_ratio(a, b) -> float:
    a, b = a.double(), b.double()
    return float(torch.sqrt(torch.mean((a - b) ** 2)) / torch.sqrt(torch.mean(b ** 2)))


def _fla_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("fla") is not None


def _model_params():
    """(kind, device) of every model: on the CPU and, where one is, on CUDA."""
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        # Where flash-linear-attention is importable, transformers runs its own KDA blocks through
        # fla's Triton kernels, which take CUDA tensors only: its CPU run, the reference, cannot run.
        marks = pytest.mark.skipif(device == "cpu" and _fla_importable(),
                                   reason="flash-linear-attention is importable: transformers' CPU run of the model "
                                          "calls its Triton kernels, which take CUDA tensors only")
        for kind in ("kimi", "glm"):
            yield pytest.param((kind, device), marks=marks, id=f"{kind}-{device}")


@pytest.fixture(scope="module", params=list(_model_params()))
def model(request):
    """(kind, device, model): on the CPU the blocks run the NumPy oracle, on CUDA the kernels."""
    kind, device = request.param
    return kind, device, _model(kind).to(device)


def _logits(model, ids, steps: int):
    """Logits of a prefill of ids[:, :-steps], then of its last `steps` tokens one at a time through
    the cache (the same tokens for every model compared: no run's sampling steers another's input)."""
    with torch.no_grad():
        out = model(input_ids=ids[:, :-steps], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(ids.shape[1] - steps, ids.shape[1]):
            out = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
    return torch.cat(logits, dim=1), cache


def test_logits_of_prefill_and_decode_hold_the_contract(model):
    kind, device, model = model
    ids = torch.randint(3, 256, (1, 264), generator=torch.Generator().manual_seed(1)).to(device)
    reference, ref_cache = _logits(model, ids, 64)
    bf16, _ = _logits(_model(kind, torch.bfloat16).to(device), ids, 64)
    floor = _rms_ratio(bf16.float(), reference)
    swap = use_glm_kda(model)
    try:
        assert len(swap.blocks) == 3
        ours, cache = _logits(model, ids, 64)
    finally:
        swap.restore()
    ratio = _rms_ratio(ours.float(), reference)
    print(f"{kind} on {device}: logits rms-ratio against float32: ours {ratio:.3e}, transformers BF16 {floor:.3e}")
    assert ratio <= E2E_FACTOR * floor, (f"{kind}: logits rms-ratio {ratio:.3e} against float32; bound {E2E_FACTOR}x "
                                        f"transformers' own BF16 run's {floor:.3e}")
    for layer in range(3):  # the states left in the cache: transformers' layout and length
        (our_conv, ours_state), (their_conv, theirs) = _cached_states(cache, layer), _cached_states(ref_cache, layer)
        assert ours_state.shape == theirs.shape and ours_state.dtype == torch.float32
        state_ratio = _rms_ratio(ours_state, theirs)
        # BF16 rows and projections put it near 5e-3 (measured 5.1e-3 .. 6.3e-3 on the CPU path).
        assert state_ratio < 0.02, f"layer {layer}: recurrent state rms-ratio {state_ratio:.3e} against float32"
        assert our_conv.shape == their_conv.shape
    assert int(cache.get_seq_length()) == int(ref_cache.get_seq_length()) == 264


def test_generate_on_a_batch_of_prompts_of_different_lengths(model):
    kind, device, model = model
    rng = np.random.default_rng(2)
    lengths = [5, 12, 3, 9]
    ids = torch.zeros((4, max(lengths)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):  # left padding
        ids[row, -length:] = torch.from_numpy(rng.integers(3, 256, length))
        mask[row, -length:] = 1
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    swap = use_glm_kda(model)
    try:
        with torch.no_grad():
            got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    finally:
        swap.restore()
    assert got.shape == expected.shape == (4, max(lengths) + 6)
    agree = float((got[:, max(lengths):] == expected[:, max(lengths):]).float().mean())
    assert agree >= 0.75, f"{kind}: greedy tokens agree {agree:.0%} with transformers' float32 run:\n{got}\n{expected}"


def test_restore_puts_the_original_blocks_back(model):
    _, _, model = model
    before = [type(layer.self_attn).__name__ for layer in _layers(model)]
    swap = use_glm_kda(model)
    assert [type(layer.self_attn).__name__ for layer in _layers(model)][:3] == ["KdaBlock"] * 3
    swap.restore()
    swap.restore()
    assert [type(layer.self_attn).__name__ for layer in _layers(model)] == before


def test_a_block_that_cannot_be_replaced_leaves_the_model_as_it_was(monkeypatch):
    import glm_kda.integrations.transformers as integration

    model = _model("kimi")
    before = [type(layer.self_attn).__name__ for layer in _layers(model)]
    bind = integration.bound_from_module

    def fail_on_the_second(module, config, layer_idx):
        if layer_idx == 1:
            raise ValueError("a weight of layer 1 is bad")
        return bind(module, config, layer_idx)

    monkeypatch.setattr(integration, "bound_from_module", fail_on_the_second)
    with pytest.raises(ValueError, match="layer 1 is bad"):
        use_glm_kda(model)
    assert [type(layer.self_attn).__name__ for layer in _layers(model)] == before


def test_a_model_without_kda_blocks_is_refused():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(ValueError, match="use_glm_kda: LlamaForCausalLM has no KDA block .looked for KimiLinearDeltaAttention"):
        use_glm_kda(transformers.LlamaForCausalLM(config))
