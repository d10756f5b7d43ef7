"""memory_report() and the planner equal closed-form bytes, written here from the storage rules alone, for full,
sliding and hybrid models at contexts below, at and above the window."""

import json

import pytest
import torch
import transformers

import kvquant
from kvquant.plan import main as plan_main
from reference import layer_bytes


WINDOW = 24
SETTINGS = [("fp16", 0, 0, 0), ("int4", 8, 2, 3), ("int2", 32, 0, 5), ("int8", 8, 0, 0)]


@pytest.mark.parametrize("tokens", [10, WINDOW - 1, WINDOW, WINDOW + 1, 61])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s[0])
def test_memory_report_equals_closed_form_on_a_hybrid_model(setting, tokens):
    config = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
                                       num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                       sliding_window=WINDOW)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    name, group, sinks, residual = setting
    options = {} if name == "fp16" else dict(group_size=group, sink_tokens=sinks, residual_length=residual)
    cache = kvquant.make_cache(model, name, **options)
    ids = torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    prefill = min(7, tokens)
    with torch.no_grad():
        model(ids[:, :prefill], cache=cache)
        for i in range(prefill, tokens):
            model(ids[:, i : i + 1], cache=cache)
    expected = sum(layer_bytes(tokens, WINDOW if kind == "sliding_attention" else None, setting, 2, 16, 4)
                   for kind in config.layer_types)
    report = cache.memory_report()
    assert report["total_bytes"] == expected
    held = sum(min(tokens, WINDOW - 1) if kind == "sliding_attention" else tokens for kind in config.layer_types)
    assert report["fp16_bytes"] == 2 * 2 * 16 * 2 * held


def plan_bytes(capsys, cache, context):
    assert plan_main(["--model", "gemma-2-9b", "--context", str(context), "--cache", cache, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["kv_bytes"]


@pytest.mark.parametrize("context", [1000, 4000, 4096, 8192])
def test_planner_equals_closed_form_for_gemma_2_9b(capsys, context):
    """gemma-2-9b: 42 layers alternating sliding (window 4096) and full, 8 KV heads, head_dim 256."""
    def model_bytes(setting):
        return 21 * (layer_bytes(context, 4096, setting, 8, 256, 2) + layer_bytes(context, None, setting, 8, 256, 2))

    fp16 = plan_bytes(capsys, "fp16", context)
    assert fp16 == model_bytes(("fp16", 0, 0, 0))
    if context == 4000:
        assert fp16 == 1_376_256_000  # 42 layers x 4000 tokens x 2 x 8 x 256 x 2 bytes
    int4 = plan_bytes(capsys, "int4:group_size=32,residual_length=128,sink_tokens=4", context)
    assert int4 == model_bytes(("int4", 32, 4, 128))


def test_each_layer_stores_on_its_own_layer_device_and_memory_is_reported_per_device():
    """A model split over devices (here what a CPU machine honestly has: layer 0's states on the CPU, layer 1's on
    the meta device, where tensors have shapes and no data) keeps each layer's cache where that layer's states are,
    and memory_report() sums the bytes per device."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    cache = kvquant.make_cache(config, "int4", group_size=8, residual_length=4)
    for layer, device in ((0, "cpu"), (1, "meta")):
        states = torch.randn(1, 2, 20, 16).to(device)
        cache.update(states, states, layer)
    for layer, device in zip(cache.layers, ("cpu", "meta")):
        held = [layer.k.tail, layer.v.tail, layer.k.sinks, *layer.k.pool.values(), *layer.v.pool.values()]
        assert {t.device.type for t in held} == {device}
    report = cache.memory_report()
    assert [entry["device"] for entry in report["per_layer"]] == ["cpu", "meta"]
    one = report["per_layer"][0]["total_bytes"]
    assert report["per_device"] == {"cpu": one, "meta": one} and report["total_bytes"] == 2 * one
    # 16 tokens in two int4 key groups of 8 (payload + fp16 scale and zero per channel), 16 int4 value tokens
    # (payload + one fp16 pair per 8 channels), 4 full-precision float32 tokens, 2 heads, keys and values
    keys = 2 * (16 * 8 + 2 * 2 * 16 * 2)
    values = 2 * 16 * (8 + 2 * 2 * 2)
    assert one == keys + values + 2 * 2 * 4 * 16 * 4


def test_a_model_placed_by_a_device_map_keeps_each_layers_cache_on_that_layers_device():
    """stories260K dispatched by accelerate's device map: the embedding and layers 0-1 on the CPU, layers 2-4 and the
    head on the meta device (a second device a CPU machine honestly has; accelerate's hooks move each layer's input
    there). A forward through the base model (the top-level hook would copy meta outputs back to the CPU, which
    meta cannot do) writes every layer's cache where the layer runs, and the bytes are reported per device."""
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    from kvquant.paths import resolve

    model = AutoModelForCausalLM.from_pretrained(resolve("local:models/stories260K/hf"), dtype=torch.float32).eval()
    placed = ["cpu", "cpu", "meta", "meta", "meta"]
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "meta", "lm_head": "meta",
                  **{f"model.layers.{i}": device for i, device in enumerate(placed)}}
    model = dispatch_model(model, device_map=device_map, main_device="cpu")
    assert [layer.self_attn.k_proj.weight.device.type for layer in model.model.layers] == placed
    cache = kvquant.make_cache(model, "int4", group_size=8, residual_length=4)
    with torch.no_grad():
        model.model(torch.arange(1, 30)[None], cache=cache, use_cache=True)
    for layer, device in zip(cache.layers, placed):
        held = [layer.k.tail, layer.v.tail, *layer.k.pool.values(), *layer.v.pool.values()]
        assert {t.device.type for t in held} == {device}
    cpu = cache.layers[0].k.tail
    assert torch.isfinite(cpu).all() and cpu.abs().sum() > 0  # the CPU layers hold real states
    report = cache.memory_report()
    assert [entry["device"] for entry in report["per_layer"]] == placed
    one = report["per_layer"][0]["total_bytes"]
    assert report["per_device"] == {"cpu": 2 * one, "meta": 3 * one} and report["total_bytes"] == 5 * one
