"""CacheSpec: one typed cache setting. Built from a name and options it builds the very cache make_cache builds
(same logits bit for bit, same settings and bytes), sizes it as simulate_memory does, and refuses what make_cache
refuses, in one line; a config's candidate carries it."""

import pytest
import torch
import transformers

import kvquant
from kvquant.cache import CacheSpec, simulate_memory, spec_memory
from kvquant.errors import KVQuantError
from kvquant.experiment.config import Candidate

SETTINGS = [  # (quantizer, options): plain, per-layer overrides, sinks, eviction, an engine's and llama.cpp's formats
    ("fp16", {}),
    ("int4", {"group_size": 16, "residual_length": 0}),
    ("int2", {"group_size": 16, "residual_length": 8, "sink_tokens": 4,
              "layers": {"0": {"quantizer": "int8"}, "1-2": {"key_bits": 4}}}),
    ("int4", {"group_size": 16, "residual_length": 0, "eviction": "sink_window", "sink_tokens": 2, "window": 24}),
    ("vllm_int8_per_token_head", {}),
    ("llamacpp_q4_0", {}),
]


def tiny_model():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def logits(model, cache, ids):
    """Prefill 20 tokens, then one token at a time (head_dim 32: llama.cpp's blocks fit)."""
    with torch.no_grad():
        out = [model(ids[:, :20], cache=cache, use_cache=True).logits]
        out += [model(ids[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(20, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("quantizer,options", SETTINGS, ids=lambda x: x if isinstance(x, str) else "")
def test_a_spec_builds_the_cache_make_cache_builds(quantizer, options):
    torch.utils.deterministic.fill_uninitialized_memory = True
    model = tiny_model()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    spec = CacheSpec.of(quantizer, options)
    direct = kvquant.make_cache(model, quantizer, **options)
    built = kvquant.make_cache(model, spec)
    assert torch.equal(logits(model, built, ids), logits(model, direct, ids))
    assert built.settings() == direct.settings()
    assert built.memory_report()["total_bytes"] == direct.memory_report()["total_bytes"] > 0


def test_the_fields_say_what_the_options_mean():
    spec = CacheSpec.of("int2", {"group_size": 16, "residual_length": 8, "sink_tokens": 4, "eviction": "sink_window",
                                 "window": 32, "layers": {"0": {"quantizer": "int8"}}})
    assert (spec.quantizer.name, spec.quantizer.group_size, spec.quantizer.key_bits) == ("int2", 16, 2)
    assert (spec.residual_length, spec.sink_tokens, spec.eviction.name, spec.eviction.window) == (8, 4,
                                                                                                 "sink_window", 32)
    assert spec.layers == {"0": {"quantizer": "int8"}}
    assert CacheSpec.of("int4").residual_length == 128  # the quantizer's default
    assert CacheSpec.of("fp8_e4m3").residual_length == kvquant.get_quantizer("fp8_e4m3").default_residual_length
    # replace: a changed option (None removes one), validated anew; the original is unchanged
    other = spec.replace(group_size=32, layers=None)
    assert (other.quantizer.group_size, other.layers, spec.quantizer.group_size) == (32, None, 16)
    assert "layers" not in other.options


def test_spec_memory_is_simulate_memory_of_the_same_setting():
    class Shape:
        layout, kv_heads, head_dim = [None, 24, None], 2, 64

    options = {"group_size": 32, "residual_length": 16, "layers": {"1": {"quantizer": "int8"}}}
    expected = simulate_memory(Shape.layout, {"quantizer": "int4", **options}, batch=3, kv_heads=2, head_dim=64,
                               tokens=300, dtype=torch.float32)
    got = spec_memory(CacheSpec.of("int4", options), Shape, tokens=300, dtype=torch.float32, batch=3)
    assert got == expected and got["total_bytes"] > 0


@pytest.mark.parametrize("quantizer,options,message", [
    ("int5", {}, "unknown quantizer 'int5'"),
    ("int4", {"group_sise": 32}, "quantizer 'int4' has no option 'group_sise'"),
    ("int4", {"group_size": 0}, "group_size"),
    ("int4", {"residual_length": -1}, "residual_length"),
    ("int4", {"sink_tokens": 2**40}, "sink_tokens"),
    ("int4", {"window": 64}, "window and budget are options of an eviction policy"),
    ("int4", {"eviction": "lru"}, "unknown eviction policy 'lru'"),
    ("int4", {"head_dim": 64}, "head_dim is not an option"),
])
def test_bad_settings_are_refused_in_one_line(quantizer, options, message):
    with pytest.raises(KVQuantError, match=message) as err:
        CacheSpec.of(quantizer, options)
    assert "\n" not in str(err.value)


def test_an_instance_takes_no_quantizer_options_and_a_spec_takes_none():
    instance = kvquant.get_quantizer("int4", group_size=32)
    assert CacheSpec.of(instance, {"residual_length": 0}).quantizer is instance
    with pytest.raises(KVQuantError, match="given with a Quantizer instance"):
        CacheSpec.of(instance, {"group_size": 64})
    spec = CacheSpec.of("int4")
    assert CacheSpec.of(spec) is spec
    with pytest.raises(KVQuantError, match="given with a CacheSpec"):
        kvquant.make_cache(tiny_model(), spec, residual_length=0)


def test_a_candidate_carries_its_spec():
    candidate = Candidate("int4", {"group_size": 32, "residual_length": 0}, "g32")
    assert candidate.spec == CacheSpec.of("int4", {"group_size": 32, "residual_length": 0})
    assert candidate.spec is candidate.spec  # built once
    with pytest.raises(KVQuantError, match="has no option 'nope'"):
        _ = Candidate("int4", {"nope": 1}).spec
