"""make_cache on small random decoders of several families and head_dims, checked by value against
``DynamicCache`` (fp16, bit-exact) and the independent fake-quant reference (int4 with default options)."""

import pytest
import torch
import transformers
from transformers import DynamicCache

import kvquant
from kvquant.formats import kernels
from reference import FakeQuantReference, Spec

COMMON = dict(vocab_size=128, intermediate_size=128, num_hidden_layers=3)
CONFIGS = {  # name: (config class, options, head_dim)
    "llama": ("LlamaConfig", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2), 16),
    "qwen2": ("Qwen2Config", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2), 16),
    "mistral": ("MistralConfig", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      sliding_window=24), 16),
    "phi3_head_dim_96": ("Phi3Config", dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=2,
                                            pad_token_id=0), 96),
    "llama_head_dim_80": ("LlamaConfig", dict(hidden_size=160, num_attention_heads=2, num_key_value_heads=1), 80),
    "llama_head_dim_112": ("LlamaConfig", dict(hidden_size=224, num_attention_heads=2, num_key_value_heads=1), 112),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=64, num_attention_heads=4), 16),
    "gemma2": ("Gemma2Config", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    sliding_window=24), 16),
    "gemma3": ("Gemma3TextConfig", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        sliding_window=24), 16),
}


def build(name):
    config_cls, extra, _ = CONFIGS[name]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def run(model, ids, cache, prefill=40):
    """Prefill, then decode the rest one token at a time; logits of every position."""
    with torch.no_grad():
        logits = [model(ids[:, :prefill], cache=cache, use_cache=True).logits]
        for i in range(prefill, ids.shape[1]):
            logits.append(model(ids[:, i : i + 1], cache=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


def largest_divisor(n, at_most):
    return max(d for d in range(1, at_most + 1) if n % d == 0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_architecture(name):
    model = build(name)
    head_dim = CONFIGS[name][2]
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    ref = run(model, ids, DynamicCache(config=model.config))
    assert torch.equal(run(model, ids, kvquant.make_cache(model, "fp16")), ref)
    # int4 with its defaults (groups of 32 tokens for keys, the largest divisor of head_dim <= 32 for values),
    # no residual window so every token beyond an incomplete key group is read quantized
    cache = kvquant.make_cache(model, "int4", residual_length=0)
    value_group = largest_divisor(head_dim, 32)
    assert cache.derived_settings()["key_group"] == 32 and cache.derived_settings()["value_group"] == value_group
    reference = FakeQuantReference(model, Spec("int", 4, "channel", 32), Spec("int", 4, "token", value_group))
    quantized = run(model, ids, cache)
    torch.testing.assert_close(quantized, run(model, ids, reference), rtol=0, atol=2e-5)
    assert (quantized - ref).abs().max() > 1e-3


@pytest.mark.parametrize("prefill", [10, 40])  # shorter and longer than the sliding windows (24)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_decode_on_every_architecture(name, prefill, monkeypatch):
    """With fused decode, the fp16 cache still equals DynamicCache (within float rounding: the kernel sums in
    another order) and int4 still equals the fake-quant reference path through the dequantized copy; Gemma2's
    soft-capped attention goes through the copy (the kernel does not soft-cap)."""
    model = build(name)
    ids = torch.randint(0, 128, (2, 60), generator=torch.Generator().manual_seed(1))
    ref = run(model, ids, DynamicCache(config=model.config), prefill)
    unfused = run(model, ids, kvquant.make_cache(model, "int4", residual_length=0), prefill)
    calls = []
    kernel = kernels.attend_into
    monkeypatch.setattr(kernels, "attend_into", lambda *a: calls.append(1) or kernel(*a))
    kvquant.enable_fused_decode(model)
    cache = kvquant.make_cache(model, "fp16")
    torch.testing.assert_close(run(model, ids, cache, prefill), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(run(model, ids, kvquant.make_cache(model, "int4", residual_length=0), prefill),
                               unfused, atol=1e-4, rtol=0)
    assert bool(calls) == (name != "gemma2"), "the kernel ran where it cannot, or did not run where it can"
