"""make_cache on the real stories260K: attention reads the quantized K/V, in one pass and in streaming."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import kvquant
from kvquant.errors import NonFiniteKVError

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2"]


def forward(model, ids, cache, **kwargs):
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True, **kwargs).logits


def stream(model, ids, cache, chunk):
    """Feed ``ids`` through ``cache`` ``chunk`` tokens at a time; the logits of every position."""
    return torch.cat([forward(model, ids[:, i : i + chunk], cache) for i in range(0, ids.shape[1], chunk)], dim=1)


def kl(ref_logits, logits):
    """Mean KL(ref || q) per position."""
    ref, q = ref_logits.flatten(0, -2).log_softmax(-1), logits.flatten(0, -2).log_softmax(-1)
    return float(F.kl_div(q, ref, log_target=True, reduction="batchmean"))


def test_fp16_reproduces_dynamic_cache_exactly(model, story_ids):
    ids = story_ids[:, :200]
    ref = forward(model, ids, DynamicCache(config=model.config))
    assert torch.equal(forward(model, ids, kvquant.make_cache(model, "fp16")), ref)
    ref_stream = stream(model, ids, DynamicCache(config=model.config), 7)
    assert torch.equal(stream(model, ids, kvquant.make_cache(model, "fp16"), 7), ref_stream)


def test_fp16_generate_matches_dynamic_cache(model, story_ids):
    prompt = story_ids[:, :50]
    kwargs = dict(max_new_tokens=30, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(prompt, cache=DynamicCache(config=model.config), **kwargs)
    out = model.generate(prompt, cache=kvquant.make_cache(model, "fp16"), **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))


@pytest.mark.parametrize("name", QUANTIZED)
def test_every_quantizer_generates(model, story_ids, name):
    prompt = story_ids[:, :300]  # longer than the default residual window, so quantized states are read
    cache = kvquant.make_cache(model, name)
    out = model.generate(prompt, cache=cache, max_new_tokens=20, do_sample=False)
    assert out.shape == (1, 320)
    assert cache.get_seq_length() == 319  # the last generated token is never fed back
    report = cache.memory_report()
    assert report["tokens"] == 319 and report["payload_bytes"] > 0
    assert report["total_bytes"] < 2 * report["fp16_bytes"]  # less than the fp32 DynamicCache of this model


@pytest.mark.parametrize("residual_length", [0, 128])
def test_single_forward_reads_quantized_kv(model, story_ids, residual_length):
    ref = forward(model, story_ids, DynamicCache(config=model.config))
    cache = kvquant.make_cache(model, "int4", residual_length=residual_length)
    assert (forward(model, story_ids, cache) - ref).abs().max() > 0.1


@pytest.mark.parametrize("chunk", [1, 16])
def test_streaming_reads_quantized_kv(model, story_ids, chunk):
    ids = story_ids[:, :160]
    ref = forward(model, ids, DynamicCache(config=model.config))
    streamed = stream(model, ids, kvquant.make_cache(model, "int4", residual_length=0), chunk)
    # The first position attends to its own (quantized) value only; every later one reads quantized states.
    assert kl(ref[:, 1:], streamed[:, 1:]) > 1e-3
    int8 = stream(model, ids, kvquant.make_cache(model, "int8", residual_length=0), chunk)
    assert kl(ref, int8) < kl(ref, streamed) / 10


@pytest.mark.parametrize("stream_name", ["key", "value"])
def test_model_error_grows_as_bits_shrink_per_stream(model, story_ids, stream_name):
    ref = forward(model, story_ids, DynamicCache(config=model.config))
    err = {}
    for bits in (8, 4, 2):
        options = {f"{stream_name}_bits": bits}
        cache = kvquant.make_cache(model, "int8", residual_length=0, **options)  # the other stream stays int8
        err[bits] = kl(ref, forward(model, story_ids, cache))
    assert 0 < err[8] < err[4] < err[2]


def test_int2_worse_than_int8_end_to_end(model, story_ids):
    ref = forward(model, story_ids, DynamicCache(config=model.config))
    int8 = kl(ref, forward(model, story_ids, kvquant.make_cache(model, "int8", residual_length=0)))
    int2 = kl(ref, forward(model, story_ids, kvquant.make_cache(model, "int2", residual_length=0)))
    assert int2 > 10 * int8 > 0


def test_bookkeeping_of_windows_and_groups(model, story_ids):
    group, residual, sinks = 32, 40, 4
    cache = kvquant.make_cache(model, "int4", group_size=group, residual_length=residual, sink_tokens=sinks)
    for length in (30, 31, 70, 119, 200, 201):  # prompt of 30, then uneven chunks
        forward(model, story_ids[:, cache.get_seq_length() : length], cache)
        layer = cache.layers[0]
        assert cache.get_seq_length() == length
        assert layer.k.sinks.shape[2] == layer.v.sinks.shape[2] == min(sinks, length)
        k_tail, v_tail = layer.k.tail.shape[2], layer.v.tail.shape[2]
        assert layer.k.n_enc % group == 0
        assert len(layer.k) == len(layer.v) == length
        if length - sinks >= residual + group:
            assert residual <= k_tail < residual + group  # only the window and an incomplete group
        if length - sinks >= residual:
            assert v_tail == residual  # values are per-token: everything beyond the window is quantized


def test_appending_never_requantizes_stored_codes(model, story_ids):
    cache = kvquant.make_cache(model, "int4", residual_length=0)
    forward(model, story_ids[:, :100], cache)
    before = {k: v.clone() for k, v in cache.layers[2].k.enc.items()}
    before_v = {k: v.clone() for k, v in cache.layers[2].v.enc.items()}
    for i in range(100, 140):
        forward(model, story_ids[:, i : i + 1], cache)
    after, after_v = cache.layers[2].k.enc, cache.layers[2].v.enc
    for k in before:
        assert torch.equal(after[k][:, :, : before[k].shape[2]], before[k])
        assert torch.equal(after_v[k][:, :, : before_v[k].shape[2]], before_v[k])
    assert after["payload"].shape[2] > before["payload"].shape[2]


def test_memory_report_counts_every_stored_tensor(model, story_ids):
    layers, heads, head_dim, tokens = 5, 4, 8, 320
    cache = kvquant.make_cache(model, "int4", residual_length=0)
    forward(model, story_ids[:, :tokens], cache)
    report = cache.memory_report()
    stored = sum(t.numel() * t.element_size() for layer in cache.layers for s in (layer.k, layer.v) for t in s.tensors().values())
    assert report["total_bytes"] == stored
    assert report["fp16_bytes"] == 2 * layers * heads * head_dim * 2 * tokens
    # keys: 4 bits + fp16 scale and zero per channel per 32 tokens (1 bit); values: 4 bits + fp16 scale and
    # zero per token per 8 channels (4 bits): 6.5 bits per element on average.
    assert report["bits_per_element"] == pytest.approx(6.5)
    assert report["ratio"] == pytest.approx(6.5 / 16)


def test_fp8_memory_and_no_saturation_on_a_later_larger_prompt(model):
    cache = kvquant.make_cache(model, "fp8_e4m3")
    layer = cache.layers[0]
    layer.update(torch.randn(1, 4, 8, 8) * 0.01, torch.randn(1, 4, 8, 8) * 0.01)
    big = torch.randn(1, 4, 8, 8) * 100
    keys, _ = layer.update(big, big)
    assert (keys[:, :, 8:] - big).abs().max() <= big.abs().max() * 2**-3  # no clipping at a frozen scale
    # payload 1 byte + one fp16 scale per token and head of 8 channels: 10 bits per element
    assert cache.memory_report()["bits_per_element"] == pytest.approx(10.0)


def test_batch_with_left_padding_does_not_leak_across_rows(model, tokenizer, stories):
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.unk_token
    texts = [stories[0][:600], stories[1][:200]]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    assert batch.attention_mask[1, 0] == 0 and batch.attention_mask[0].all()
    gen = dict(max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
    both = model.generate(**batch, cache=kvquant.make_cache(model, "int4", residual_length=16), **gen)
    alone = model.generate(batch.input_ids[:1], cache=kvquant.make_cache(model, "int4", residual_length=16), **gen)
    assert torch.equal(both.sequences[0], alone.sequences[0])
    assert torch.allclose(both.logits[0][0], alone.logits[0][0], atol=1e-4)
    ref = model.generate(**batch, cache=DynamicCache(config=model.config), **gen)
    fp16 = model.generate(**batch, cache=kvquant.make_cache(model, "fp16"), **gen)
    assert torch.equal(fp16.sequences, ref.sequences)


def test_beam_search(model, story_ids):
    prompt = story_ids[:, :64]
    kwargs = dict(max_new_tokens=12, num_beams=3, do_sample=False)
    ref = model.generate(prompt, cache=DynamicCache(config=model.config), **kwargs)
    assert torch.equal(model.generate(prompt, cache=kvquant.make_cache(model, "fp16"), **kwargs), ref)
    out = model.generate(prompt, cache=kvquant.make_cache(model, "int4", residual_length=8), **kwargs)
    assert out.shape == ref.shape


def test_reorder_cache_permutes_quantized_rows_exactly(model):
    cache = kvquant.make_cache(model, "int4", residual_length=0)
    layer = cache.layers[0]
    k = torch.randn(3, 4, 40, 8)
    keys, values = layer.update(k, k * 2)
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    keys2, values2 = layer.update(torch.zeros(3, 4, 0, 8), torch.zeros(3, 4, 0, 8))
    assert torch.equal(keys2, keys[[2, 0, 1]]) and torch.equal(values2, values[[2, 0, 1]])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", ["int4", "fp8_e4m3", "fp16"])
def test_non_finite_states_raise(model, bad, name):
    layer = kvquant.make_cache(model, name).layers[0]
    k = torch.randn(1, 4, 5, 8)
    k[0, 1, 2, 3] = bad
    with pytest.raises(NonFiniteKVError, match="keys hold NaN or Inf"):
        layer.update(k, torch.randn(1, 4, 5, 8))


def test_states_beyond_fp16_scales_raise(model):
    layer = kvquant.make_cache(model, "int8").layers[0]
    with pytest.raises(kvquant.KVQuantError, match="beyond"):
        layer.update(torch.randn(1, 4, 5, 8), torch.full((1, 4, 5, 8), 1e6))


@pytest.mark.parametrize("name", QUANTIZED)
def test_all_zero_states_stay_zero(model, name):
    layer = kvquant.make_cache(model, name, residual_length=0).layers[0]
    zeros = torch.zeros(2, 4, 64, 8)
    keys, values = layer.update(zeros, zeros)
    assert torch.equal(keys, zeros) and torch.equal(values, zeros)


def test_bad_cache_arguments(model):
    with pytest.raises(kvquant.KVQuantError, match="residual_length must be a non-negative integer"):
        kvquant.make_cache(model, "int4", residual_length=-1)
    with pytest.raises(kvquant.KVQuantError, match="need a transformers model or config"):
        kvquant.make_cache(object(), "int4")
    with pytest.raises(kvquant.KVQuantError, match="has no option 'groupsize'"):
        kvquant.make_cache(model, "int4", groupsize=32)
    with pytest.raises(kvquant.KVQuantError, match="cannot be cropped"):
        kvquant.make_cache(model, "int4").crop(-1)


def test_model_without_attention_cache_is_refused():
    from transformers import MambaConfig

    with pytest.raises(kvquant.KVQuantError, match="no attention KV cache"):
        kvquant.make_cache(MambaConfig(num_hidden_layers=2, hidden_size=16, vocab_size=32), "int4")
