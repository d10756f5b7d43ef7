"""Per-layer settings (``make_cache(model, layers={...})``): each layer stores and returns exactly what a uniform
cache of its own setting does, bytes per layer equal the closed form, the planner agrees with a measured cache,
and bad layer maps are one-line errors."""

import json

import pytest
import torch
import transformers

import kvquant
from kvquant.cache import build_cache
from kvquant.errors import KVQuantError
from kvquant.plan import main as plan_main

from reference import layer_bytes

LAYERS = 6
HEADS, HEAD_DIM = 2, 16


def model_of(window=None):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=LAYERS,
                                      num_attention_heads=2, num_key_value_heads=HEADS, head_dim=HEAD_DIM)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


MAP = {"0-1": {"quantizer": "int8"}, 2: {"key_bits": 8}, "4": {"quantizer": "fp16"},
       "5": {"quantizer": "int2", "residual_length": 3}}
#: what each layer must behave as: (quantizer, options) of a uniform cache
EXPECTED = [("int8", {"residual_length": 0}), ("int8", {"residual_length": 0}),  # another quantizer: its defaults
            ("int4", {"group_size": 8, "key_bits": 8, "residual_length": 0}),
            ("int4", {"group_size": 8, "residual_length": 0}), ("fp16", {}),
            ("int2", {"residual_length": 3})]


def test_each_layer_stores_and_returns_what_a_uniform_cache_of_its_setting_does():
    model = model_of()
    cache = kvquant.make_cache(model, "int4", group_size=8, residual_length=0, layers=MAP)
    gen = torch.Generator().manual_seed(1)
    for step, n in enumerate((13, 1, 9)):  # prefill, a decode step, a chunk
        k = torch.randn(1, HEADS, n, HEAD_DIM, generator=gen) * 3
        v = torch.randn(1, HEADS, n, HEAD_DIM, generator=gen)
        if step == 0:
            uniform = [kvquant.make_cache(model, name, **opts).layers[0] for name, opts in EXPECTED]
        for i, (layer, alone) in enumerate(zip(cache.layers, uniform)):
            got, want = layer.update(k, v), alone.update(k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"layer {i}, step {step}"
            assert layer.memory() == alone.memory(), f"layer {i}"
    # and the settings differ where they should: int2 is not int4
    assert not torch.equal(cache.layers[5].update(k, v)[0], cache.layers[3].update(k, v)[0])


def test_bytes_per_layer_equal_the_closed_form_and_the_planner(tmp_path, capsys):
    model = model_of()
    settings = {"quantizer": "int4", "group_size": 8, "residual_length": 2, "layers": {
        "0": {"quantizer": "fp16"}, "1-2": {"quantizer": "int8", "sink_tokens": 4}, "5": {"quantizer": "int2"}}}
    cache = kvquant.make_cache(model, **settings)
    tokens = 37
    with torch.no_grad():
        model(torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(0)), cache=cache)
    # another quantizer takes its own defaults (group 32) and the cache's residual_length
    per_layer = [("fp16", 0, 0, 0), ("int8", 32, 4, 2), ("int8", 32, 4, 2), ("int4", 8, 0, 2), ("int4", 8, 0, 2),
                 ("int2", 32, 0, 2)]
    expected = [layer_bytes(tokens, None, s, HEADS, HEAD_DIM, 4) for s in per_layer]
    report = cache.memory_report()
    assert [p["total_bytes"] for p in report["per_layer"]] == expected
    assert report["total_bytes"] == sum(expected)
    fp16 = HEADS * HEAD_DIM * tokens * 2 * 2
    assert [p["bits_per_element"] for p in report["per_layer"]] == [16 * e / fp16 for e in expected]
    # the planner reads the same map from the command line and gets the same bytes, layer by layer
    (tmp_path / "config.json").write_text(model.config.to_json_string())
    assert plan_main(["--model", str(tmp_path / "config.json"), "--context", str(tokens), "--dtype", "float32",
                      "--cache", json.dumps(settings), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["settings"][0]
    assert planned["kv_bytes"] == sum(expected)
    assert [p["kv_bytes"] for p in planned["per_layer"]] == expected


def test_a_map_naming_every_layer_is_the_uniform_cache_and_settings_rebuild_it():
    model = model_of()
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mapped = model(ids, cache=kvquant.make_cache(model, "int4", group_size=8, residual_length=0,
                                                     layers={f"0-{LAYERS - 1}": {"quantizer": "int2"}})).logits
        uniform = model(ids, cache=kvquant.make_cache(model, "int2", residual_length=0)).logits  # int2 defaults
        int4 = model(ids, cache=kvquant.make_cache(model, "int4", group_size=8, residual_length=0)).logits
    assert torch.equal(mapped, uniform)
    assert not torch.equal(mapped, int4)
    cache = kvquant.make_cache(model, "int4", group_size=8, layers=MAP)
    settings = cache.settings()
    assert list(settings["layers"]) == ["0-1", "2", "4", "5"]  # normalized keys, in layer order
    assert settings["layers"]["2"]["key_bits"] == 8 and settings["layers"]["2"]["group_size"] == 8  # spelled out
    rebuilt = kvquant.make_cache(model, "int4", group_size=8, layers=settings["layers"])
    assert [(layer.quantizer, layer.residual_length, layer.sink_tokens) for layer in rebuilt.layers] == \
        [(layer.quantizer, layer.residual_length, layer.sink_tokens) for layer in cache.layers]


def test_an_entry_naming_the_cache_quantizer_takes_its_defaults_and_one_without_changes_options():
    layers = build_cache([None] * 3, "int4", head_dim=HEAD_DIM, group_size=8, rotation="hadamard",
                         layers={0: {"quantizer": "int4", "key_bits": 8}, 1: {"key_bits": 8}}).layers
    assert layers[0].quantizer == kvquant.get_quantizer("int4", key_bits=8)  # not the cache's group or rotation
    assert layers[1].quantizer == kvquant.get_quantizer("int4", group_size=8, rotation="hadamard", key_bits=8)
    assert layers[2].quantizer == kvquant.get_quantizer("int4", group_size=8, rotation="hadamard")


def test_equivalent_maps_stack_and_write_alike():
    model = model_of()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    a = kvquant.make_cache(model, "int4", layers={"0-1": {"quantizer": "int8"}})
    b = kvquant.make_cache(model, "int4", layers={0: {"quantizer": "int8"}, 1: {"quantizer": "int8"}})
    with torch.no_grad():
        model(ids, cache=a)
        model(ids, cache=b)
    stacked = kvquant.cache.stack_rows([(a, 0), (b, 0)])
    with torch.no_grad():
        out = model(torch.tensor([[5], [5]]), cache=stacked).logits
    # the same stored codes in both rows: equal up to how a batched fp32 matmul splits its rows over threads
    assert torch.allclose(out[0], out[1], rtol=0, atol=1e-6)
    k = stacked.layers[0].k
    assert k.units[0] == k.units[1] and k.n_tail[0] == k.n_tail[1]
    assert all(torch.equal(p[k.table[0, : k.units[0]]], p[k.table[1, : k.units[1]]]) for p in k.pool.values())
    assert torch.equal(k.tail[0], k.tail[1])


@pytest.mark.parametrize("layers, message", [
    ({"0-9": {"quantizer": "int8"}}, "outside the model's layers 0-5"),
    ({"3-1": {}}, "runs backwards"),
    ({"first": {}}, "is not a layer or a layer range"),
    ({1.5: {}}, "is not a layer or a layer range"),
    ({"0-2": {"quantizer": "int8"}, 2: {"key_bits": 8}}, "layer 2 is named by both '0-2' and 2"),
    ({0: {"quantizer": "int9"}}, "unknown quantizer 'int9'"),
    ({0: {"group_sise": 8}}, "has no option 'group_sise'"),
    ({0: {"quantizer": "int8", "bits": 3}}, "has no option 'bits'"),
    ({0: {"residual_length": -1}}, "residual_length must be an integer >= 0, got int -1"),
    ({0: "int8"}, "must be a mapping of options"),
    (["int8"], "layers must map layers or ranges"),
    ({0: {"key_bits": 3}}, "key_bits must be"),
    ({0: {"group_size": 7}}, r"layers\[0\]: int4: group_size 7"),
])
def test_bad_layer_maps_are_one_line_errors(layers, message):
    with pytest.raises(KVQuantError, match=message if "\\" in message else
                       message.replace("(", r"\(").replace(")", r"\)")):
        build_cache([None] * LAYERS, "int4", head_dim=HEAD_DIM, layers=layers)


def test_maps_that_cannot_take_effect_are_errors():
    with pytest.raises(KVQuantError, match="sliding-window layer, which keeps no sink tokens"):
        build_cache([4, None], "int4", head_dim=HEAD_DIM, layers={0: {"sink_tokens": 4}})
    with pytest.raises(KVQuantError, match="names only layers that reuse another layer's KV"):
        build_cache([None, "shared"], "int4", head_dim=HEAD_DIM, layers={1: {"quantizer": "int8"}})
    build_cache([None, "shared", None], "int4", head_dim=HEAD_DIM, layers={"0-2": {"quantizer": "int8"}})  # fine
