"""make_cache on the real stories260K: attention reads the quantized K/V, in one pass and in streaming."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import kvquant
from kvquant.cache import stack_rows
from reference import FakeQuantReference, Spec

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


#: default settings on stories260K (head_dim 8) for the reference: key groups (tokens), value groups (channels)
DEFAULT_SPECS = {
    "fp8_e4m3": (Spec("fp8", fp8=torch.float8_e4m3fn), Spec("fp8", fp8=torch.float8_e4m3fn)),
    "fp8_e5m2": (Spec("fp8", fp8=torch.float8_e5m2), Spec("fp8", fp8=torch.float8_e5m2)),
    "int8": (Spec("int", 8, "channel", 128), Spec("int", 8, "token", 8)),
    "int4": (Spec("int", 4, "channel", 32), Spec("int", 4, "token", 8)),
    "int2": (Spec("int", 2, "channel", 32), Spec("int", 2, "token", 8)),
}


@pytest.mark.parametrize("name", QUANTIZED)
def test_every_quantizer_generates_what_the_reference_generates(model, story_ids, name):
    prompt = story_ids[:, :300]  # longer than the default residual window, so quantized states are read
    cache = kvquant.make_cache(model, name)
    residual = 128 if name.startswith("int") else 0
    reference = FakeQuantReference(model, *DEFAULT_SPECS[name], residual_length=residual)
    kwargs = dict(max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True)
    out, ref = model.generate(prompt, cache=cache, **kwargs), model.generate(prompt, cache=reference, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), rtol=0, atol=2e-5)
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
        k, v = cache.layers[0].k, cache.layers[0].v
        assert cache.get_seq_length() == length
        assert k.n_sinks[0] == v.n_sinks[0] == min(sinks, length)
        k_tail, v_tail = k.n_tail[0], v.n_tail[0]
        assert k.unit == group and v.unit == 1  # a key unit is a whole group of tokens
        assert k.stored_tokens(0) == v.stored_tokens(0) == length
        if length - sinks >= residual + group:
            assert residual <= k_tail < residual + group  # only the window and an incomplete group
        if length - sinks >= residual:
            assert v_tail == residual  # values are per-token: everything beyond the window is quantized


def test_appending_never_requantizes_stored_codes(model, story_ids):
    cache = kvquant.make_cache(model, "int4", residual_length=0)
    forward(model, story_ids[:, :100], cache)
    def units(store):  # row 0's stored units, in order: role -> [units, H, ...]
        return {role: p[store.table[0, : store.units[0]]].clone() for role, p in store.pool.items()}

    before, before_v = units(cache.layers[2].k), units(cache.layers[2].v)
    for i in range(100, 140):
        forward(model, story_ids[:, i : i + 1], cache)
    after, after_v = units(cache.layers[2].k), units(cache.layers[2].v)
    for k in before:
        assert torch.equal(after[k][: before[k].shape[0]], before[k])
        assert torch.equal(after_v[k][: before_v[k].shape[0]], before_v[k])
    assert after["payload"].shape[0] > before["payload"].shape[0]


def test_memory_report_counts_every_stored_tensor(model, story_ids):
    layers, heads, head_dim, tokens = 5, 4, 8, 320
    cache = kvquant.make_cache(model, "int4", residual_length=0)
    forward(model, story_ids[:, :tokens], cache)
    report = cache.memory_report()
    # every tensor the layers hold (one row written at once: no pool slot reserved, no tail slot unused)
    stored = sum(t.numel() * t.element_size() for layer in cache.layers for s in (layer.k, layer.v)
                 for t in [*s.pool.values(), s.sinks, s.tail])
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


def padded_batch(tokenizer, texts):
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.unk_token
    return tokenizer(texts, return_tensors="pt", padding=True)


@pytest.fixture(scope="module")
def model64(model):
    """stories260K in float64. A batch runs matmuls of other shapes than a row alone, which reorders float sums:
    in fp32 the keys and values then differ by ~1e-6, enough to move an occasional element across a rounding
    boundary of the quantizer (one code level, up to 0.1 in a logit); in float64 the noise (~1e-15) vanishes when
    the cache rounds states to fp32 before quantizing, so rows can be compared with a float tolerance."""
    import copy

    return copy.deepcopy(model).double()


@pytest.mark.parametrize("name", ["fp16", "fp8_e4m3", "int8", "int4", "int2"])
def test_each_row_of_a_left_padded_batch_equals_that_row_alone(model64, tokenizer, stories, name):
    """Rows are stored apart and grouped from their own first real token, padding is never stored: a padded row
    computes what it computes alone (float64, tolerance 1e-9 on logits; see model64). Undeclared padding moved
    int4 logits by 0.27."""
    model = model64
    batch = padded_batch(tokenizer, [stories[0][:600], stories[1][:200], stories[2][:350]])
    pads = (batch.attention_mask == 0).sum(1)
    assert pads[0] == 0 and pads[1] > 32 and pads[2] > 0  # padding longer than a key group
    options = {} if name == "fp16" else {"residual_length": 16}
    gen = dict(max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
    cache = kvquant.make_cache(model, name, **options).set_padding(batch.attention_mask)
    both = model.generate(**batch, cache=cache, **gen)
    for row in range(3):
        ids = batch.input_ids[row : row + 1, pads[row] :]
        alone = model.generate(ids, cache=kvquant.make_cache(model, name, **options), **gen)
        assert torch.equal(both.sequences[row, pads[row] :], alone.sequences[0])
        for step_both, step_alone in zip(both.logits, alone.logits):
            torch.testing.assert_close(step_both[row], step_alone[0], rtol=0, atol=1e-9)
    if name == "fp16":  # the padded fp16 batch also matches DynamicCache's padded batch
        ref = model.generate(**batch, cache=DynamicCache(config=model.config), **gen)
        assert torch.equal(both.sequences, ref.sequences)


def test_padding_not_declared_is_stored_like_real_tokens(model, tokenizer, stories):
    """Without set_padding the cache cannot tell padding apart: it is stored and shares key groups with the
    row's first real tokens, so the padded row no longer equals the row alone under int4 (the documented
    behaviour set_padding exists to fix)."""
    batch = padded_batch(tokenizer, [stories[0][:600], stories[1][:200]])
    pad = int((batch.attention_mask[1] == 0).sum())
    with torch.no_grad():
        padded = model(**batch, cache=kvquant.make_cache(model, "int4", residual_length=0)).logits[1, pad:]
        alone = model(batch.input_ids[1:, pad:], cache=kvquant.make_cache(model, "int4", residual_length=0)).logits[0]
    assert (padded - alone).abs().max() > 1e-2


def test_set_padding_rejects_what_it_cannot_honour(model):
    cache = kvquant.make_cache(model, "int4")
    with pytest.raises(kvquant.KVQuantError, match=r"\[batch, tokens\] attention mask"):
        cache.set_padding(torch.ones(3))
    cache.set_padding(torch.tensor([[0, 1, 1]]))
    forward(model, torch.tensor([[5, 2, 3]]), cache)
    with pytest.raises(kvquant.KVQuantError, match="disagrees with positions this cache has already stored"):
        cache.set_padding(torch.tensor([[1, 1, 1, 1]]))
    with pytest.raises(kvquant.KVQuantError, match="the mask has 2 rows, the cache 1"):
        cache.set_padding(torch.ones(2, 4))
    with pytest.raises(kvquant.KVQuantError, match="covers 2 positions, the cache has written 3"):
        cache.set_padding(torch.tensor([[0, 1]]))  # would forget the padding declared for position 0
    two_rows = kvquant.make_cache(model, "int4")
    forward(model, torch.tensor([[5, 2, 3], [4, 4, 4]]), two_rows)
    with pytest.raises(kvquant.KVQuantError, match="the mask has 3 rows, the cache 2"):
        two_rows.set_padding(torch.ones(3, 4))


@pytest.mark.parametrize("name", ["fp16", "int4"])
def test_padded_batch_with_beam_search(model64, tokenizer, stories, name):
    """generate expands a batch of B rows to B x beams before the first forward; the declared mask follows."""
    batch = padded_batch(tokenizer, [stories[0][:300], stories[1][:120]])
    kwargs = dict(max_new_tokens=6, num_beams=2, do_sample=False)
    cache = kvquant.make_cache(model64, name, residual_length=0).set_padding(batch.attention_mask)
    out = model64.generate(**batch, cache=cache, **kwargs)
    for row in range(2):
        pad = int((batch.attention_mask[row] == 0).sum())
        alone = model64.generate(batch.input_ids[row : row + 1, pad:],
                                 cache=kvquant.make_cache(model64, name, residual_length=0), **kwargs)
        assert torch.equal(out[row, pad:], alone[0])


@pytest.mark.parametrize("name", ["fp16", "int4", "fp8_e4m3"])
def test_padding_anywhere_in_chunks_equals_each_row_alone(model64, story_ids, name):
    """Rows fed in chunks with padding wherever a row has nothing to write (what batched scoring does): every
    row's real positions equal the row fed alone in the same chunks (float64, as for left padding)."""
    model = model64
    ids = story_ids[0, :90].tolist()
    rows = [ids[:40] + ids[40:90], ids[5:25] + ids[25:40], ids[10:12] + ids[12:60]]  # (chunk 1, chunk 2) per row
    splits = [40, 20, 2]
    options = {"residual_length": 0, "group_size": 8} if name == "int4" else {}
    cache = kvquant.make_cache(model, name, **options)
    mask, chunks = [], []
    for step in range(2):
        parts = [r[:s] if step == 0 else r[s:] for r, s in zip(rows, splits)]
        width = max(map(len, parts))
        chunk = torch.tensor([p + [0] * (width - len(p)) for p in parts])
        step_mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in parts])
        mask.append(step_mask)
        full_mask = torch.cat(mask, dim=1)
        positions = (full_mask.cumsum(1) - 1).clamp(min=0)[:, -width:]
        cache.set_padding(full_mask)
        with torch.no_grad():
            logits = model(chunk, attention_mask=full_mask, position_ids=positions, cache=cache).logits
        chunks.append([logits[b, : len(p)] for b, p in enumerate(parts)])
    for b, (row, split) in enumerate(zip(rows, splits)):
        alone_cache = kvquant.make_cache(model, name, **options)
        first = forward(model, torch.tensor([row[:split]]), alone_cache)[0]
        second = forward(model, torch.tensor([row[split:]]), alone_cache)[0]
        torch.testing.assert_close(chunks[0][b], first, rtol=0, atol=1e-9)
        torch.testing.assert_close(chunks[1][b], second, rtol=0, atol=1e-9)


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("name", ["int2", "int4", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_finite_states_at_the_fp16_limit_come_back_finite(model, monkeypatch, name, eager):
    """A group spanning ±65504 rounds its top level one step past fp16's maximum (65520 -> inf); the cache clamps
    to the dtype's range, on the kernel path and the eager one."""
    if eager:
        monkeypatch.setattr(kvquant.formats.kernels, "usable", lambda out: False)
    layer = kvquant.make_cache(model, name, residual_length=0).layers[0]
    x = torch.full((1, 4, 32, 8), 65504.0, dtype=torch.float16)
    x[..., ::2] = -65504.0
    keys, values = layer.update(x, x)
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    assert (keys - x).abs().max() <= 65504 * 2**-1  # still a coarse copy of x, not garbage


def test_fp8_states_beyond_what_its_scales_hold_raise(model):
    layer = kvquant.make_cache(model, "fp8_e4m3").layers[0]
    with pytest.raises(kvquant.KVQuantError, match=r"beyond.*scale_dtype='float32'"):
        layer.update(torch.full((1, 4, 2, 8), 3e7), torch.ones(1, 4, 2, 8))
    layer = kvquant.make_cache(model, "fp8_e4m3", scale_dtype="float32").layers[0]
    keys, _ = layer.update(torch.full((1, 4, 2, 8), 3e7), torch.ones(1, 4, 2, 8))
    assert torch.isfinite(keys).all()


def _feed(model, cache, parts, mask, pad_first=False):
    """One padded forward of ``parts`` (a token list per row) through ``cache``; ``mask`` is the history so far
    ([rows, written] long), returned extended. Logits of each row's real positions."""
    width = max(map(len, parts))
    pad = [[0] * (width - len(p)) for p in parts]
    ids = torch.tensor([z + p if pad_first else p + z for p, z in zip(parts, pad)])
    step = torch.tensor([[0] * len(z) + [1] * len(p) if pad_first else [1] * len(p) + [0] * len(z)
                         for p, z in zip(parts, pad)])
    mask = torch.cat([mask, step], dim=1)
    cache.set_padding(mask)
    positions = (mask.cumsum(1) - 1).clamp(min=0)[:, -width:]
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=positions, cache=cache).logits
    return [logits[b][step[b].bool()] for b in range(len(parts))], mask


def stored_of(cache):
    """Tokens layer 0 stores per row."""
    k = cache.layers[0].k
    return [k.stored_tokens(r) for r in range(k.rows)]


@pytest.mark.parametrize("name", ["fp16", "int4", "int2"])
def test_stacked_rows_continue_as_in_their_own_caches(model64, story_ids, name):
    """Rows prefilled in different caches (a left-padded batch, a single row, a cache with nothing written) are
    stacked into one batch and extended with continuations of different lengths: every row's logits equal that
    row fed alone through its own cache (float64), and the sources are left as they were."""
    model, ids = model64, story_ids[0].tolist()
    options = {"residual_length": 0, "group_size": 8} if name.startswith("int") else {}
    make = lambda: kvquant.make_cache(model, name, **options)  # noqa: E731
    contexts = [ids[:30], ids[40:52], ids[60:80], []]
    batch, single, fresh = make(), make(), make()
    _, batch_mask = _feed(model, batch, contexts[:2], torch.ones(2, 0, dtype=torch.long), pad_first=True)
    _feed(model, single, contexts[2:3], torch.ones(1, 0, dtype=torch.long))
    stored = stored_of(batch)
    sources = [(single, 0), (batch, 1), (batch, 0), (batch, 1), (fresh, 0)]
    which = [2, 1, 0, 1, 3]  # the context of each stacked row
    stacked = stack_rows(sources)
    assert stacked.get_seq_length() == 30 and stacked.rows() == 5
    assert stored_of(stacked) == [20, 12, 30, 12, 0]
    continuations = [ids[100:109], ids[110:113], ids[120:125], ids[130:131], ids[140:147]]
    history = stacked.padding.real(0, 30, 5).long()
    assert history.sum(1).tolist() == [20, 12, 30, 12, 0] and history[:, -1].tolist() == [1, 1, 1, 1, 0]
    logits, _ = _feed(model, stacked, continuations, history)
    for row, (context, cont) in enumerate(zip(which, continuations)):
        alone = make()
        if contexts[context]:
            forward(model, torch.tensor([contexts[context]]), alone)
        torch.testing.assert_close(logits[row], forward(model, torch.tensor([cont]), alone)[0], rtol=0, atol=1e-9)
    assert stored_of(batch) == stored and batch.padding.mask.shape == batch_mask.shape


def test_stack_rows_rejects_what_it_cannot_stack(model):
    a, b = kvquant.make_cache(model, "int4"), kvquant.make_cache(model, "int8")
    forward(model, torch.tensor([[1, 2, 3]]), a)
    with pytest.raises(kvquant.KVQuantError, match="same settings"):
        stack_rows([(a, 0), (b, 0)])
    with pytest.raises(kvquant.KVQuantError, match="row 1 of a cache with 1 rows"):
        stack_rows([(a, 1)])
    with pytest.raises(kvquant.KVQuantError, match="at least one"):
        stack_rows([])


def test_padding_spans_find_one_block_or_scattered_tokens():
    from kvquant.cache import Padding

    padding = Padding()
    assert padding.spans(0, 4, 2) == [(4, 0, 4)] * 2  # nothing declared: all real
    padding.declare(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]]), 0, None)
    assert padding.spans(0, 5, 4) == [(3, 2, 5), (2, 0, 2), (2, 0, 3), (0, 0, 0)]
    assert padding.spans(1, 7, 4) == [(5, 1, 6), (3, 0, 6), (3, 1, 6), (2, 4, 6)]  # beyond the mask: real
    assert padding.count(0, 5, 4) == [3, 2, 2, 0]
    padding.select([1, 0])  # a new mask forgets what was worked out for the old one
    assert padding.spans(0, 5, 2) == [(2, 0, 2), (3, 2, 5)]


def test_padding_is_never_checked_against_the_scale_limit(model):
    """The range check runs once over the batch; when that fails, only rows' real tokens are checked: a padded
    position holding a huge state is neither stored nor an error, a real one is."""
    cache = kvquant.make_cache(model, "fp8_e4m3")
    layer = cache.layers[0]
    cache.set_padding(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    keys = torch.ones(2, 4, 3, 8)
    keys[0, :, 2] = 3e7  # padding
    out, _ = layer.update(keys, torch.ones(2, 4, 3, 8))
    assert torch.isfinite(out).all() and [layer.k.stored_tokens(r) for r in range(2)] == [2, 3]
    cache = kvquant.make_cache(model, "fp8_e4m3")
    cache.set_padding(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    keys[1, :, 0] = 3e7  # real
    with pytest.raises(kvquant.KVQuantError, match="beyond"):
        cache.layers[0].update(keys, torch.ones(2, 4, 3, 8))


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_integer_states_whose_range_overflows_float32_raise_instead_of_reading_nan(model, name):
    """Finite states near float32's maximum with float32 scales: max - min overflowed to inf and every value read
    back was NaN, with no error. Now refused; half that range is stored and read back finite."""
    layer = kvquant.make_cache(model, name, group_size=8, residual_length=0, scale_dtype="float32").layers[0]
    x = torch.zeros(1, 4, 8, 8)
    x[..., 0::2, :], x[..., 1::2, :] = 3e38, -3e38
    with pytest.raises(kvquant.KVQuantError, match="beyond the"):
        layer.update(x, x)
    layer = kvquant.make_cache(model, name, group_size=8, residual_length=0, scale_dtype="float32").layers[0]
    keys, values = layer.update(x / 2, x / 2)
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
