"""make_cache on small random decoders of several families, sliding-window layers included."""

import pytest
import torch
import transformers
from transformers import DynamicCache

import kvquant

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
CONFIGS = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=24)),
    "phi3": ("Phi3Config", dict(num_key_value_heads=4, pad_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", dict()),
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, sliding_window=24)),
    "gemma3": ("Gemma3TextConfig", dict(num_key_value_heads=2, head_dim=16, sliding_window=24)),
}


def build(name):
    config_cls, extra = CONFIGS[name]
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


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_architecture(name):
    model = build(name)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    ref = run(model, ids, DynamicCache(config=model.config))
    fp16_cache = kvquant.make_cache(model, "fp16")
    assert torch.equal(run(model, ids, fp16_cache), ref)
    sliding = [layer.is_sliding for layer in fp16_cache.layers]
    if getattr(model.config, "sliding_window", None):
        assert any(sliding)  # kept, not rejected: the window of 24 is crossed by these 64 tokens
        report = fp16_cache.memory_report()
        held = [23 if s else 64 for s in sliding]  # a sliding layer holds window - 1 tokens, as DynamicCache
        head_dim = fp16_cache.layers[0].k.tail.shape[-1]
        kv_heads = fp16_cache.layers[0].k.tail.shape[1]
        assert report["fp16_bytes"] == sum(2 * 2 * kv_heads * head_dim * h * 2 for h in held)
    cache = kvquant.make_cache(model, "int4", group_size=8, residual_length=0)
    quantized = run(model, ids, cache)
    assert (quantized - ref).abs().max() > 1e-3
    out = model.generate(ids[:, :20], cache=kvquant.make_cache(model, "int4", group_size=8, residual_length=4),
                         max_new_tokens=8, do_sample=False)
    assert out.shape == (2, 28)
