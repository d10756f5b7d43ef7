"""A cache setting is built once, from its CacheSpec to storage, and what is a format's own is asked of the format's
class: what a quantizer takes from the model (``Quantizer.for_model``), how an engine runs it (``Quantizer.serving``:
its flag, static scales, the layers it keeps at model precision on its own). Issue 54, items 4 and 5."""

import dataclasses
import json
from typing import ClassVar

import pytest
import torch
import transformers

import kvquant
import kvquant.cache.spec
from kvquant.cache import CacheSpec, build_cache
from kvquant.export import main as export_main
from kvquant.formats.llamacpp_gguf import GgufOrderCodec
from kvquant.formats.quantizers import QUANTIZERS, Serving
from kvquant.formats.research import Int4
from kvquant.formats.vllm import VllmInt8PerTokenHead

LAYERS = 6


def llama(head_dim: int = 32, layers: int = 3) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=96, hidden_size=4 * head_dim, intermediate_size=64,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=head_dim)


@pytest.fixture
def registered():
    """Register test quantizers by name for one test; removed after it."""
    names = []

    def register(name, cls):
        kvquant.register_quantizer(name)(cls)
        names.append(name)
        return cls

    yield register
    for name in names:
        del QUANTIZERS.classes[name]


def test_a_spec_given_to_make_cache_is_not_taken_apart_and_built_again(monkeypatch):
    """make_cache(model, spec) stores with the spec's own quantizer (failed before: the spec was turned back into a
    name and options and validated again, a new quantizer built each time)."""
    spec = CacheSpec.of("int4", {"group_size": 16, "residual_length": 0, "layers": {"1": {"key_bits": 8}}})
    built = []
    original = kvquant.cache.spec.get_quantizer
    monkeypatch.setattr(kvquant.cache.spec, "get_quantizer", lambda *a, **k: built.append(a) or original(*a, **k))
    cache = kvquant.make_cache(llama(), spec)
    assert built == []  # the setting not validated and built again from its name
    assert cache.quantizer is spec.quantizer and cache.layers[0].quantizer is spec.quantizer
    assert cache.layers[1].quantizer == dataclasses.replace(spec.quantizer, key_bits=8)
    assert cache.layer_options == {"1": {**dataclasses.replace(spec.quantizer, key_bits=8).describe(),
                                         "residual_length": 0, "sink_tokens": 0}}


def test_what_a_quantizer_takes_from_the_model_applies_to_the_setting_and_every_layer_entry(registered):
    """``for_model`` of the cache's quantizer and of each ``layers`` entry's (named or inherited), not of an entry
    that states the option (failed before: make_cache knew llama.cpp's rope_layout alone, by name)."""

    @dataclasses.dataclass(frozen=True)
    class Seeing(Int4):
        model_type: str | None = None

        def for_model(self, model_or_config):
            seen = model_or_config.model_type
            return self if self.model_type is not None else dataclasses.replace(self, model_type=seen)

    registered("seeing_int4", Seeing)
    cache = kvquant.make_cache(llama(), "seeing_int4", residual_length=0,
                               layers={"1": {"quantizer": "seeing_int4", "key_bits": 8},
                                       "2": {"model_type": "stated"}})
    assert [layer.quantizer.model_type for layer in cache.layers] == ["llama", "llama", "stated"]
    assert cache.quantizer.model_type == "llama"
    assert cache.layer_options["1"]["model_type"] == "llama" and cache.layer_options["1"]["key_bits"] == 8
    assert build_cache([None] * 3, "seeing_int4").quantizer.model_type is None  # no model: as given


def test_a_llamacpp_quantizer_instance_takes_the_models_k_order_as_its_name_does():
    """llama.cpp's K channel order comes from the model for an instance too (failed before: only a name got it)."""
    instance = kvquant.get_quantizer("llamacpp_q4_0")
    by_name, by_instance = (kvquant.make_cache(llama(64), q) for q in ("llamacpp_q4_0", instance))
    for cache in (by_name, by_instance):
        assert cache.quantizer.rope_layout == "norm"
        assert isinstance(cache.layers[0].quantizer.codecs(64)[0], GgufOrderCodec)
    x = torch.randn(1, 2, 32, 64, generator=torch.Generator().manual_seed(0))
    keys = [cache.layers[0].update(x, x.clone())[0] for cache in (by_name, by_instance)]
    assert torch.equal(keys[0], keys[1])


def document(quantizer: str, layers: dict | None = None, **settings) -> dict:
    """A report choosing ``quantizer`` (a model of :data:`LAYERS` layers), as export reads one."""
    def candidate(name, quantizer, verdict, **more):
        metric = {"value": 1.01, "baseline": 1.0, "verdict": verdict, "gated": True}
        return {"name": name, "settings": {"quantizer": quantizer, "residual_length": 0, "sink_tokens": 0, **more},
                "verdict": verdict, "bits_per_element": 8.0, "metrics": {"ppl/wikitext2": metric},
                "memory": {"per_layer": [{"layer": i} for i in range(LAYERS)]}}

    chosen = candidate("mine", quantizer, "pass", **settings, **({"layers": layers} if layers else {}))
    return {"run_id": "abc", "decision": "pass", "chosen": "mine", "reason": "mine is the cheapest passing",
            "command": "python -m kvquant.run x.yaml", "config": {"model": {"path": "local:models/m"}},
            "candidates": [chosen]}


def exported(tmp_path, capsys, doc: dict) -> tuple[int, str]:
    """export's exit code and DEPLOY.md (or its one-line refusal)."""
    (tmp_path / "results.json").write_text(json.dumps(doc))
    code = export_main(["--trust-unsigned", str(tmp_path)])
    return code, (tmp_path / "DEPLOY.md").read_text() if code == 0 else capsys.readouterr().err


def test_an_engine_format_says_how_it_deploys_in_its_own_class(tmp_path, capsys, registered):
    """A new engine format's flag, the layers its engine keeps at model precision on its own and why its static
    scales do not ship come from its class's Serving, with no name of it in export's code."""

    @dataclasses.dataclass(frozen=True)
    class Edge(VllmInt8PerTokenHead):
        serving: ClassVar[Serving] = Serving("vLLM", "edge_int8", "an edge backend", boundary_layers=3,
                                             unshipped_scales="edge scales are not exported yet")
        k_scale: float = 1.0
        v_scale: float = 1.0

    registered("vllm_edge_int8", Edge)
    code, text = exported(tmp_path, capsys, document("vllm_edge_int8", {"1": {"quantizer": "fp16"}}))
    assert code == 0 and "--kv-cache-dtype edge_int8 --kv-cache-dtype-skip-layers 1" in text
    assert "Needs: an edge backend." in text
    assert "kvquant measured layers 0, 2, 3, 4, 5 in the format, which vLLM keeps at model precision" in text
    code, text = exported(tmp_path, capsys, document("vllm_edge_int8", k_scale=0.5))
    assert code == 2 and "mine: edge scales are not exported yet; the engine would run at 1.0" in text
    code, text = exported(tmp_path, capsys, document("vllm_int8_per_token_head", k_scale=0.5))
    assert code == 2 and ("vllm_int8_per_token_head takes no static k_scale/v_scale (only vllm_edge_int8, "
                          "vllm_fp8 and vllm_nvfp4 do)") in text
