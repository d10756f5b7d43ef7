"""Every quantizer x attention layout x prompt length x feeding, checked by value.

- ``fp16`` is bit-identical to ``DynamicCache`` (logits and generated tokens);
- every quantizer's logits equal those of the independent fake-quant reference in ``reference.py`` (float
  tolerance: both dequantize in fp32 and round once; the kernel may contract ``zero + code * scale`` into one
  FMA, which moves a value by one ulp), and greedy ``generate`` picks the reference's tokens;
- beam search equals the reference's beams (the reference reorders its full-precision history and recomputes
  every quantized group from scratch: no reorder shortcut on quantized state).

Unwritten memory is NaN in this session (conftest), so a read of it cannot pass.
"""

import pytest
import torch
import transformers
from transformers import DynamicCache

import kvquant
from kvquant.formats.lowbit import lloyd_max_gaussian, normal_float
from reference import FakeQuantReference, Spec, codebook_fake_quant
from slow_cases import slow_where

WINDOW = 24
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
LAYOUTS = {  # head_dim 16 everywhere
    "full": ("LlamaConfig", dict(num_hidden_layers=2)),
    "sliding": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "gemma2_alternating": ("Gemma2Config", dict(num_hidden_layers=4, head_dim=16, sliding_window=WINDOW)),
    "gemma3_5to1": ("Gemma3TextConfig", dict(num_hidden_layers=6, head_dim=16, sliding_window=WINDOW)),
}
PROMPTS = slow_where([5, WINDOW - 1, WINDOW, 3 * WINDOW], lambda tokens: tokens >= WINDOW)
DECODE = 8
SINKS, RESIDUAL, GROUP = 2, 3, 8
KEY_LEVELS = [-0.9, -0.15, 0.35, 1.0]
VALUE_LEVELS = [-1.0, -0.6, -0.3, -0.05, 0.1, 0.4, 0.7, 0.95]
#: quantizer -> (make_cache options, key spec, value spec) for head_dim 16
SETTINGS = {
    "fp16": ({}, Spec("exact"), Spec("exact")),
    "fp8_e4m3": ({}, Spec("fp8", fp8=torch.float8_e4m3fn), Spec("fp8", fp8=torch.float8_e4m3fn)),
    "fp8_e5m2": ({}, Spec("fp8", fp8=torch.float8_e5m2), Spec("fp8", fp8=torch.float8_e5m2)),
    "int8": ({"group_size": GROUP}, Spec("int", 8, "channel", GROUP), Spec("int", 8, "token", GROUP)),
    "int4": ({"group_size": GROUP}, Spec("int", 4, "channel", GROUP), Spec("int", 4, "token", GROUP)),
    "int2": ({}, Spec("int", 2, "channel", 32), Spec("int", 2, "token", 16)),  # default groups: 32 tokens, 16 channels
    # unrotated here (the rotation around them: test_lowbit.py); the levels are checked there against their definition
    "lloyd_max": ({"rotation": None, "key_bits": 3, "value_bits": 2},
                  Spec("fn", fn=lambda x: codebook_fake_quant(x, lloyd_max_gaussian(3).float(), "rms")),
                  Spec("fn", fn=lambda x: codebook_fake_quant(x, lloyd_max_gaussian(2).float(), "rms"))),
    "normal_float": ({"rotation": None},
                     Spec("fn", fn=lambda x: codebook_fake_quant(x, normal_float(4).float(), "absmax")),
                     Spec("fn", fn=lambda x: codebook_fake_quant(x, normal_float(4).float(), "absmax"))),
    # levels as calibration fits them (kvquant/formats/fitted.py): given here, uneven on purpose
    "fitted_levels": ({"key_bits": 2, "value_bits": 3, "key_levels": KEY_LEVELS, "value_levels": VALUE_LEVELS},
                      Spec("fn", fn=lambda x: codebook_fake_quant(x, torch.tensor(KEY_LEVELS), "absmax")),
                      Spec("fn", fn=lambda x: codebook_fake_quant(x, torch.tensor(VALUE_LEVELS), "absmax"))),
    # keys stored as int4 stores its keys, values as fp8_e5m2 stores its values (kvquant/formats/keys_values.py)
    "keys_values": ({"keys": {"quantizer": "int4", "group_size": GROUP}, "values": {"quantizer": "fp8_e5m2"}},
                    Spec("int", 4, "channel", GROUP), Spec("fp8", fp8=torch.float8_e5m2)),
}


def test_every_registered_quantizer_is_in_the_matrix():
    """Serving engines' formats are checked against their own references in test_engines.py, llama.cpp's in
    test_llamacpp.py."""
    engines = {n for n in kvquant.available_quantizers() if n.startswith(("vllm_", "sglang_", "llamacpp_"))}
    assert set(SETTINGS) == set(kvquant.available_quantizers()) - engines


_MODELS = {}


def build(layout):
    if layout not in _MODELS:
        config_cls, extra = LAYOUTS[layout]
        config = getattr(transformers, config_cls)(**COMMON, **extra)
        torch.manual_seed(0)
        _MODELS[layout] = transformers.AutoModelForCausalLM.from_config(config).eval()
    return _MODELS[layout]


def caches(model, name):
    options, key, value = SETTINGS[name]
    ours = kvquant.make_cache(model, name, sink_tokens=SINKS, residual_length=RESIDUAL, **options)
    if name == "fp16":
        return ours, DynamicCache(config=model.config)
    return ours, FakeQuantReference(model, key, value, SINKS, RESIDUAL)


def teacher_forced(model, ids, prompt, cache):
    """Prefill ``prompt`` tokens, then feed the rest one at a time; logits of every position."""
    with torch.no_grad():
        logits = [model(ids[:, :prompt], cache=cache, use_cache=True).logits]
        for i in range(prompt, ids.shape[1]):
            logits.append(model(ids[:, i : i + 1], cache=cache, use_cache=True).logits)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", SETTINGS)
def test_prefill_then_decode_equals_reference(name, layout, prompt):
    model = build(layout)
    ids = torch.randint(0, 128, (2, prompt + DECODE), generator=torch.Generator().manual_seed(prompt))
    ours, ref = caches(model, name)
    got, want = teacher_forced(model, ids, prompt, ours), teacher_forced(model, ids, prompt, ref)
    if name == "fp16":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
        assert not torch.equal(got, teacher_forced(model, ids, prompt, DynamicCache(config=model.config)))
    assert ours.get_seq_length() == prompt + DECODE


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", SETTINGS)
def test_generate_equals_reference(name, layout, prompt):
    model = build(layout)
    ids = torch.randint(0, 128, (2, prompt), generator=torch.Generator().manual_seed(100 + prompt))
    kwargs = dict(max_new_tokens=DECODE, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ours, ref = caches(model, name)
    got, want = model.generate(ids, cache=ours, **kwargs), model.generate(ids, cache=ref, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    if name == "fp16":
        assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    else:
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=2e-5)


@pytest.mark.parametrize("layout", ["full", "gemma2_alternating"])
@pytest.mark.parametrize("name", ["fp16", "fp8_e4m3", "int4", "int2"])
def test_beam_search_equals_reference(name, layout):
    model = build(layout)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=10, num_beams=3, num_return_sequences=3, do_sample=False,
                  output_scores=True, return_dict_in_generate=True)
    ours, ref = caches(model, name)
    got, want = model.generate(ids, cache=ours, **kwargs), model.generate(ids, cache=ref, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, rtol=0, atol=1e-5)
