"""``keys_values``: the keys stored by one quantizer, the values by another (issue 55's where-analysis, K or V), by
value: each stream reads what its own format stores (against tests/reference.py's independent fake-quant and the
format's own codec), a format on both streams is that format bit for bit, memory is each codec's own bytes, and
every misuse is one line."""

import pytest
import torch
import transformers
import yaml
from transformers import DynamicCache

import kvquant
import kvquant.run
from kvquant.errors import KVQuantError
from kvquant.formats.keys_values import KeysValues
from reference import FakeQuantReference, Spec, fake_quant_history
from refusals import one_line, run_refused

INT4 = {"quantizer": "int4", "group_size": 32}
FP16 = {"quantizer": "fp16"}
#: int4 g32 on stories260K (head_dim 8), as tests/reference.py computes it: keys per channel in groups of 32 tokens,
#: values per token in groups of 8 channels (the group capped at head_dim)
INT4_SPECS = {"keys": Spec("int", 4, "channel", 32), "values": Spec("int", 4, "token", 8)}


def forward(model, ids, cache):
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True).logits


def stream(model, ids, cache, chunk=16):
    return torch.cat([forward(model, ids[:, i : i + chunk], cache) for i in range(0, ids.shape[1], chunk)], 1)


def round_trip(quantizer: dict, stream_index: int, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, T, D]`` through ``quantizer``'s own key (0) or value (1) codec: decode(encode(x))."""
    options = dict(quantizer)
    codec = kvquant.get_quantizer(options.pop("quantizer"), **options).codecs(x.shape[-1])[stream_index]
    out = torch.full_like(x, float("nan"))
    codec.decode_into(codec.encode(x), out)
    return out


# --- (a) each stream reads what its own format stores ----------------------------------------------------------


@pytest.mark.parametrize("quantized", ["keys", "values"])
def test_one_stream_is_exact_and_the_other_is_what_int4_stores(model, real_kv, quantized):
    """keys_values{keys: fp16, values: int4 g32} (and the mirror) on stories260K's real states: the fp16 stream reads
    back the states exactly, the int4 stream exactly what the independent fake-quant reference computes and what
    int4's own codec reads back."""
    exact = "values" if quantized == "keys" else "keys"
    cache = kvquant.make_cache(model, "keys_values", **{quantized: INT4, exact: FP16}, residual_length=0)
    index = 0 if quantized == "keys" else 1
    for layer, (keys, values) in enumerate(real_kv):
        read = dict(zip(("keys", "values"), cache.update(keys, values, layer)))
        given = {"keys": keys, "values": values}
        assert torch.equal(read[exact], given[exact])
        expected = fake_quant_history(given[quantized], INT4_SPECS[quantized], sinks=0, residual=0)
        assert not torch.equal(expected, given[quantized])  # int4 changed the states: the test can fail
        assert torch.equal(read[quantized], expected)
        assert torch.equal(read[quantized], round_trip(INT4, index, given[quantized]))


@pytest.mark.parametrize("quantized", ["keys", "values"])
def test_the_model_reads_the_mix_as_the_reference_computes_it(model, story_ids, quantized):
    """The model's logits through the mix, in one pass and streamed, equal those through the fake-quant reference
    that stores only that stream as int4 (and differ from fp16's)."""
    exact = "values" if quantized == "keys" else "keys"
    ids = story_ids[:, :256]
    specs = {quantized: INT4_SPECS[quantized], exact: Spec("exact")}
    for feed in (forward, stream):
        ours = feed(model, ids, kvquant.make_cache(model, "keys_values", **{quantized: INT4, exact: FP16},
                                                   residual_length=0))
        reference = feed(model, ids, FakeQuantReference(model, specs["keys"], specs["values"]))
        assert torch.equal(ours, reference)
        assert not torch.equal(ours, feed(model, ids, DynamicCache(config=model.config)))


# --- (b) a format on both streams is that format --------------------------------------------------------------


def llama_model(d: int = 64):
    """A small random Llama of head_dim ``d`` (llama.cpp's types need multiples of 32)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=4 * d, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=d)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def teacher_forced(model, ids, cache):
    """A prefill of 7 tokens, then one token at a time: the logits of every position."""
    return torch.cat([forward(model, ids[:, :7], cache)] +
                     [forward(model, ids[:, i : i + 1], cache) for i in range(7, ids.shape[1])], 1)


@pytest.mark.parametrize("spec", [{"quantizer": "vllm_fp8"}, INT4, {"quantizer": "fp8_e4m3"}])
def test_a_format_on_both_streams_is_that_format_bit_for_bit(model, story_ids, spec):
    """With each format's own defaults (int4's residual window of 128 tokens included: a mix keeps the larger of
    its formats')."""
    options = {k: v for k, v in spec.items() if k != "quantizer"}
    ids = story_ids[:, :300]
    for feed in (forward, stream):
        alone = feed(model, ids, kvquant.make_cache(model, spec["quantizer"], **options))
        mixed = feed(model, ids, kvquant.make_cache(model, "keys_values", keys=spec, values=spec))
        assert torch.equal(mixed, alone)
    assert not torch.equal(alone, stream(model, ids, kvquant.make_cache(model, "fp16")))


@pytest.mark.parametrize("keys, values, native", [
    ("q8_0", "q8_0", {}),
    ("q8_0", "f16", {"value_type": "f16"}),  # llama.cpp's own -ctk q8_0 -ctv f16
    ("q4_0", "q8_0", {"key_type": "q4_0"}),
])
def test_llama_cpp_types_mixed_are_llama_cpp_with_ctk_and_ctv(keys, values, native):
    """keys_values of two llama.cpp types equals llama.cpp's own quantizer with those -ctk/-ctv, bit for bit, the
    query converted to K's dot-product type as llama.cpp does (make_cache turns the conversion on for the mix)."""
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    mixed_model, native_model = llama_model(), llama_model()
    mixed = teacher_forced(mixed_model, ids, kvquant.make_cache(
        mixed_model, "keys_values", keys={"quantizer": f"llamacpp_{keys}"}, values={"quantizer": f"llamacpp_{values}"}))
    assert mixed_model.config._attn_implementation == "kvquant_query_sdpa"
    own = teacher_forced(native_model, ids, kvquant.make_cache(native_model, "llamacpp_q8_0", **native))
    assert torch.equal(mixed, own)
    assert not torch.equal(mixed, teacher_forced(llama_model(), ids, kvquant.make_cache(llama_model(), "fp16")))


def test_for_model_reaches_both_inner_quantizers():
    """llama.cpp takes K's channel order from the model (a Llama GGUF's ``norm``; Qwen2's ``neox``), inside a mix
    too; a given order is kept."""
    spec = {"quantizer": "llamacpp_q8_0"}
    mix = kvquant.get_quantizer("keys_values", keys=spec, values=spec)
    llama, qwen = llama_model().config, transformers.Qwen2Config(num_hidden_layers=1)
    assert [q.rope_layout for q in (mix.keys, mix.values)] == [None, None]
    assert [q.rope_layout for q in (mix.for_model(llama).keys, mix.for_model(llama).values)] == ["norm", "norm"]
    assert mix.for_model(qwen).keys.rope_layout == "neox"
    given = kvquant.get_quantizer("keys_values", keys={**spec, "rope_layout": "neox"}, values=FP16)
    assert given.for_model(llama).keys.rope_layout == "neox"


def test_a_run_states_no_other_k_order_than_the_models_inside_a_mix():
    """A llama.cpp quantizer inside keys_values (at the top or in a ``layers`` entry) stating a K channel order other
    than the model's is refused as a llama.cpp setting is; the model's own passes."""
    from kvquant.formats.llamacpp_gguf import check_rope_layout

    llama = llama_model().config
    wrong, right = ({"quantizer": "llamacpp_q8_0", "rope_layout": layout} for layout in ("neox", "norm"))
    with pytest.raises(KVQuantError) as err:
        check_rope_layout(llama, "keys_values", {"keys": wrong, "values": FP16}, "c")
    assert one_line(err).startswith("c: keys: rope_layout 'neox', but llama.cpp stores this model's K ('llama')")
    with pytest.raises(KVQuantError) as err:
        check_rope_layout(llama, "int4", {"layers": {"0": {"quantizer": "keys_values", "keys": FP16,
                                                           "values": wrong}}}, "c")
    assert one_line(err).startswith("c: layers['0']: values: rope_layout 'neox'")
    check_rope_layout(llama, "keys_values", {"keys": right, "values": right}, "c")


# --- (c) memory: each stream's bytes are its own format's ------------------------------------------------------


def test_memory_report_counts_each_stream_in_its_own_format():
    """keys vllm_fp8 (1 byte per element, a static scale stored per layer, not per token), values int4 g32 (half a
    byte per element, an fp16 scale and zero point per 32 channels): the closed form, and the same bytes as the
    two formats' own caches give their streams."""
    model = llama_model()
    heads, tokens, d, layers = 2, 96, 64, 2
    x = torch.randn(1, heads, tokens, d, generator=torch.Generator().manual_seed(0)).half()

    def report(quantizer, **options):
        cache = kvquant.make_cache(model, quantizer, residual_length=0, **options)
        for layer in range(layers):
            cache.update(x, x, layer)
        return cache.memory_report()

    fp8, int4 = {"quantizer": "vllm_fp8"}, {"quantizer": "int4", "group_size": 32}
    mixed = report("keys_values", keys=fp8, values=int4)
    elements = layers * heads * tokens * d
    assert mixed["payload_bytes"] == elements * 1 + elements // 2
    assert mixed["scale_bytes"] == layers * heads * tokens * (d // 32) * 2 * 2
    assert mixed["full_precision_bytes"] == 0
    assert mixed["fp16_bytes"] == 2 * elements * 2
    assert mixed["bits_per_element"] == (8 + 4 + 32 / 32) / 2
    mirror = report("keys_values", keys=int4, values=fp8)
    alone = report("vllm_fp8"), report("int4", group_size=32)
    for category in ("payload_bytes", "scale_bytes", "full_precision_bytes", "total_bytes"):
        assert mixed[category] + mirror[category] == alone[0][category] + alone[1][category], category


# --- (d) one-line refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, needle", [
    ({"values": FP16}, "quantizer 'keys_values' needs keys"),
    ({"keys": {"group_size": 32}, "values": FP16}, "keys_values: keys needs a quantizer (keys: {quantizer: NAME"),
    ({"keys": {"quantizer": "vllm_fp9"}, "values": FP16}, "keys_values: keys: unknown quantizer 'vllm_fp9'; "
                                                          "available: fitted_levels"),
    ({"keys": FP16, "values": {"quantizer": "vllm_fp8", "group_size": 32}},
     "keys_values: values: quantizer 'vllm_fp8' has no option 'group_size'; its options: k_scale"),
    ({"keys": {"quantizer": "keys_values", "keys": FP16, "values": FP16}, "values": FP16},
     "keys_values: keys cannot be keys_values itself"),
    ({"keys": FP16, "values": kvquant.get_quantizer("keys_values", keys=FP16, values=FP16)},
     "keys_values: values cannot be keys_values itself"),
    ({"keys": {**INT4, "residual_length": 0}, "values": FP16},
     "keys_values: keys.residual_length is the cache's option, not an inner quantizer's; give it beside quantizer: "
     "keys_values"),
    ({"keys": FP16, "values": {**INT4, "layers": {0: FP16}}}, "keys_values: values.layers is the cache's option"),
    ({"keys": {**INT4, "pre_rope": True}, "values": FP16}, "keys_values: keys.pre_rope is the cache's option"),
    ({"keys": INT4, "values": FP16, "rotation": "hadamard"},
     "keys_values: rotation is an inner quantizer's option; put it on the one it rotates"),
    ({"keys": INT4, "values": FP16, "rotation_seed": 3}, "keys_values: rotation_seed is an inner quantizer's option"),
    ({"keys": "int4", "values": FP16}, "keys_values: keys must be a quantizer spec (keys: {quantizer: NAME, ...its "
                                       "options}) or a Quantizer, got str 'int4'"),
    ({"keys": FP16, "values": {"quantizer": "int4", "key_bits": 3}}, "keys_values: values: int4: key_bits must be 2, "
                                                                      "4 or 8, got 3"),
])
def test_what_a_mix_cannot_be_is_refused_in_one_line(options, needle):
    with pytest.raises(KVQuantError) as err:
        kvquant.get_quantizer("keys_values", **options)
    assert needle in one_line(err)


def config_file(tmp_path, candidate: dict):
    cfg = {"name": "mix", "model": {"path": "local:models/stories260K/hf"}, "output_dir": str(tmp_path / "out"),
           "candidates": [{"name": "mix", **candidate}],
           "eval": {"perplexity": [{"name": "stories", "source": "local:text/tinystories/validation-first1000.jsonl",
                                    "limit": 4, "max_length": 64}]},
           "gate": {"perplexity": ["stories"], "bootstrap": 1000},
           **({"calibration": {"windows": 2}} if "calibrate" in candidate else {})}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "c.yaml"


@pytest.mark.parametrize("candidate, needle", [
    ({"quantizer": "keys_values", "options": {"keys": {**INT4, "sink_tokens": 4}, "values": FP16}},
     "keys_values: keys.sink_tokens is the cache's option"),
    ({"quantizer": "keys_values", "calibrate": "tensor",
      "options": {"keys": {"quantizer": "vllm_fp8"}, "values": FP16}},
     "calibrate: 'keys_values' has no static scales (k_scale, v_scale) to calibrate"),
    ({"quantizer": "int4", "options": {"layers": {1: {"quantizer": "keys_values", "keys": FP16,
                                                      "values": {"quantizer": "nope"}}}}},
     "layers[1]: keys_values: values: unknown quantizer 'nope'"),
])
def test_the_runner_refuses_a_bad_mix_before_the_model_loads(tmp_path, capsys, no_model_load, candidate, needle):
    run_refused(capsys, [config_file(tmp_path, candidate)], needle)
    assert not (tmp_path / "out").exists()  # nothing written


# --- (e) the setting's own description rebuilds it -------------------------------------------------------------


@pytest.mark.parametrize("keys, values", [
    ({"quantizer": "vllm_fp8", "k_scale": [0.5, 2.0]}, FP16),
    (INT4, {"quantizer": "llamacpp_q8_0", "attn_rot": False}),
    ({"quantizer": "lloyd_max", "key_bits": 3, "rotation_seed": 7}, {"quantizer": "fp8_e4m3", "granularity": "tensor"}),
])
def test_describe_rebuilds_an_equal_quantizer(keys, values):
    mix = kvquant.get_quantizer("keys_values", keys=keys, values=values)
    described = mix.describe()
    assert described["quantizer"] == "keys_values" and described["keys"]["quantizer"] == keys["quantizer"]
    rebuilt = kvquant.get_quantizer(described.pop("quantizer"), **described)
    assert rebuilt == mix and hash(rebuilt) == hash(mix) and isinstance(rebuilt.keys, kvquant.Quantizer)
    assert rebuilt != kvquant.get_quantizer("keys_values", keys=values, values=keys)


def test_a_cache_and_a_layers_entry_keep_the_mix_in_their_settings(model):
    """``cache.settings()`` (what a report records) rebuilds the same cache; a ``layers`` entry takes a mix, and a
    ``layers`` entry without a quantizer changes one inner spec of a mix at the top."""
    cache = kvquant.make_cache(model, "int4", residual_length=0, layers={"1-2": {
        "quantizer": "keys_values", "keys": FP16, "values": {"quantizer": "vllm_fp8"}}})
    assert isinstance(cache.layers[1].quantizer, KeysValues) and cache.layers[0].quantizer.name == "int4"
    assert cache.layers[2].quantizer.values.name == "vllm_fp8"
    again = kvquant.make_cache(model, **cache.settings())
    assert [layer.quantizer for layer in again.layers] == [layer.quantizer for layer in cache.layers]
    top = kvquant.make_cache(model, "keys_values", keys=INT4, values=FP16, layers={3: {"values": INT4}})
    assert top.layers[3].quantizer.values.name == "int4" and top.layers[2].quantizer.values.name == "fp16"
    assert top.residual_length == 128  # int4's window, the larger of the two formats'


def test_derived_settings_are_those_of_the_stream_each_format_stores():
    mix = kvquant.get_quantizer("keys_values", keys={"quantizer": "int4", "group_size": 128},
                                values={"quantizer": "lloyd_max"})
    assert mix.derived_settings(64) == {"key_group": 128, "value_rotation_block": 64}
