"""Pre-RoPE keys (``make_cache(model, ..., pre_rope=True)``, kvquant/cache/prerope.py), by value.

- The identity quantizer through pre-RoPE storage equals ``DynamicCache`` on every family kvquant knows the RoPE of
  (tiny random decoders of tests/test_architectures.py: sliding windows, head_dim 80, 96, 112) and on stories260K:
  within 1e-12 in float64 (0.0 measured on stories260K), within 5e-5 in float32 (1.3e-5 measured).
- int4 with per-channel key groups stored before RoPE equals a reference written here: its own RoPE from the config,
  its own un-rotation (the transpose), min-max fake quantization per channel, rotation back, attention by hand.
- A key offset of Qwen2's ``k_proj`` bias removed before RoPE is exact: the codes layer 0 stores are those of the same
  model without the bias, and the logits those of the reference (un-rotate, subtract, quantize, add, rotate).
- Padding, forks, stacked rows and sliding windows read every key at its own position; positions count in
  ``host_bytes`` (4 bytes a key), the stored bytes do not change; what cannot run is refused in one line.
"""

import copy

import pytest
import torch
import transformers
from transformers import DynamicCache

import kvquant
from kvquant.cache import stack_rows
from kvquant.errors import KVQuantError
from kvquant.formats.lowbit import lloyd_max_gaussian
from reference import Spec, codebook_fake_quant, fake_quant_history
from test_architectures import CONFIGS, build

#: the families kvquant takes RoPE off (tests/test_architectures.py's configs; gpt_neox rotates a quarter: refused)
FAMILIES = sorted(name for name in CONFIGS if name != "gpt_neox")


def rope(config, positions, layer_type=None):
    """cos, sin ``[B, n, D]`` (float32) of the config's default RoPE at ``positions`` ``[B, n]``, from the formula."""
    params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def turn(x, cos, sin, sign):
    """``x`` ``[B, H, n, D]`` rotated by the angles (``sign`` 1) or back (``sign`` -1): pairs ``(i, i + D/2)``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :, :half].to(x.dtype), sign * sin[:, None, :, :half].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class PreRopeReference(DynamicCache):
    """Keeps every key (as given, after RoPE), value and position; each update returns the whole history with the
    keys turned back by their positions, fake-quantized by ``key``, turned again, and the values by ``value``
    (``key_map``: what to do with the un-rotated keys of a layer instead, e.g. subtract, quantize, add)."""

    def __init__(self, model, key=None, value=None, key_map=None):
        super().__init__(config=model.config)
        self.config, self.key, self.value, self.key_map = model.config, key, value, key_map
        self.history = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        visible = super().update(key_states, value_states, layer_idx, *args, **kwargs)[0].shape[2]
        positions = kwargs["kwargs"]["position_ids"].expand(key_states.shape[0], -1)
        new = (key_states, value_states, positions)
        past = self.history.get(layer_idx)
        self.history[layer_idx] = keys, values, positions = new if past is None else \
            [torch.cat([p, s], -1 if s.dim() == 2 else 2) for p, s in zip(past, new)]
        types = getattr(self.config, "layer_types", None)
        per_type = isinstance(next(iter(self.config.rope_parameters.values())), dict)
        cos, sin = rope(self.config, positions, types[layer_idx] if per_type else None)
        plain = turn(keys, cos, sin, -1)
        quantized = self.key_map(layer_idx, plain) if self.key_map else fake_quant_history(plain, self.key, 0, 0)
        keys = turn(quantized, cos, sin, 1)
        values = fake_quant_history(values, self.value, 0, 0) if self.value else values
        return keys[:, :, -visible:], values[:, :, -visible:]


def run(model, ids, cache, steps=(40, 1, 1, 22), **kwargs):
    """Logits of every position, fed in chunks of ``steps`` tokens."""
    out, fed = [], 0
    with torch.no_grad():
        for n in steps:
            out.append(model(ids[:, fed : fed + n], cache=cache, use_cache=True, **kwargs).logits)
            fed += n
    return torch.cat(out, dim=1)


@pytest.fixture(scope="module")
def model64(model):
    return copy.deepcopy(model).double()


@pytest.mark.parametrize("name", FAMILIES)
def test_the_identity_before_rope_is_dynamic_cache_on_every_family(name):
    """Prefill 40 (past the sliding windows of 24), then decode; float64 within 1e-12, float32 within 5e-5."""
    model = build(name)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 5e-5)):
        model = model.to(dtype)
        want = run(model, ids, DynamicCache(config=model.config))
        got = run(model, ids, kvquant.make_cache(model, "fp16", pre_rope=True))
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance)


def test_the_identity_before_rope_is_dynamic_cache_on_stories(model, model64, story_ids):
    ids = story_ids[:, :100]
    for m, tolerance in ((model64, 1e-12), (model, 5e-5)):
        want = run(m, ids, DynamicCache(config=m.config), steps=(60, 1, 1, 38))
        got = run(m, ids, kvquant.make_cache(m, "fp16", pre_rope=True), steps=(60, 1, 1, 38))
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance)


@pytest.mark.parametrize("name", ["stories", "mistral"])  # mistral: a sliding window of 24
def test_int4_keys_per_channel_before_rope_are_the_reference(name, model, story_ids):
    m = model if name == "stories" else build(name)
    ids = story_ids[:, :64] if name == "stories" else torch.randint(0, 128, (2, 64),
                                                                    generator=torch.Generator().manual_seed(1))
    head_dim = m.config.hidden_size // m.config.num_attention_heads
    values = Spec("int", 4, "token", min(32, head_dim))
    reference = PreRopeReference(m, Spec("int", 4, "channel", 32), values)
    cache = kvquant.make_cache(m, "int4", pre_rope=True, residual_length=0)
    got = run(m, ids, cache)
    torch.testing.assert_close(got, run(m, ids, reference), rtol=0, atol=2e-5)
    after_rope = run(m, ids, kvquant.make_cache(m, "int4", residual_length=0))
    assert (got - after_rope).abs().max() > 1e-3  # quantizing before RoPE stores other keys


def test_a_layer_reads_keys_quantized_before_rope_at_their_own_positions(real_kv, model):
    """One layer given real keys at positions 7.. (not 0..): the keys it returns and attention over them by hand are
    the reference's (un-rotate by the formula, int4 per channel in groups of 32, rotate back)."""
    keys, values = real_kv[0]
    positions = 7 + torch.arange(keys.shape[2])[None]
    cache = kvquant.make_cache(model, "int4", pre_rope=True, residual_length=0)
    got_k, got_v = cache.update(keys, values, 0, kwargs={"position_ids": positions})
    cos, sin = rope(model.config, positions)
    want_k = turn(fake_quant_history(turn(keys, cos, sin, -1), Spec("int", 4, "channel", 32), 0, 0), cos, sin, 1)
    want_v = fake_quant_history(values, Spec("int", 4, "token", 8), 0, 0)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)
    query = torch.randn(1, 4, 5, 8, generator=torch.Generator().manual_seed(2))

    def attend(k, v):
        weights = (query @ k.transpose(-1, -2) / 8**0.5).softmax(-1)
        return weights @ v

    torch.testing.assert_close(attend(got_k, got_v), attend(want_k, want_v), rtol=0, atol=1e-5)
    assert (got_k - turn(fake_quant_history(keys, Spec("int", 4, "channel", 32), 0, 0), cos, sin, 1)).abs().max() > 0


@pytest.fixture(scope="module")
def biased_qwen():
    """A tiny Qwen2 in float64 whose ``k_proj`` biases are Qwen2.5's kind of outlier (a few channels of 40-80), each a
    float32 number (what a ``key_offset`` holds)."""
    model = build("qwen2").double()
    generator = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        bias = layer.self_attn.k_proj.bias
        bias.data = torch.randn(bias.shape, generator=generator, dtype=torch.float64)
        bias.data[::7] = 40 + 40 * torch.rand(bias.data[::7].shape, generator=generator, dtype=torch.float64)
        bias.data = bias.data.float().double()  # a key offset is kept in float32: the same numbers
    return model


def bias_offsets(model):
    heads = model.config.num_key_value_heads
    return {i: {"key_offset": layer.self_attn.k_proj.bias.detach().reshape(heads, -1).tolist()}
            for i, layer in enumerate(model.model.layers)}


def test_the_k_proj_bias_removed_before_rope_is_exact(biased_qwen):
    model = biased_qwen
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    options = dict(quantizer="lloyd_max", rotation=None, residual_length=0)
    cache = kvquant.make_cache(model, pre_rope=True, layers=bias_offsets(model), **options)
    levels = lloyd_max_gaussian(4)
    heads = model.config.num_key_value_heads

    def subtract_quantize_add(layer, keys):
        bias = model.model.layers[layer].self_attn.k_proj.bias.reshape(1, heads, 1, -1)
        return codebook_fake_quant(keys - bias, levels, "rms") + bias

    reference = PreRopeReference(model, value=Spec("fn", fn=lambda x: codebook_fake_quant(x, levels, "rms")),
                                 key_map=subtract_quantize_add)
    # the codec computes in float32 (the offset subtracted from float32 keys of up to 80): 5.8e-7 measured
    torch.testing.assert_close(run(model, ids, cache), run(model, ids, reference), rtol=0, atol=5e-6)
    # what layer 0's quantizer saw is W x alone: the codes of the same model without the bias
    unbiased = copy.deepcopy(model)
    for layer in unbiased.model.layers:
        layer.self_attn.k_proj.bias.data.zero_()
    plain = kvquant.make_cache(unbiased, pre_rope=True, **options)
    run(unbiased, ids, plain)
    pools = [c.layers[0].k.pool for c in (cache, plain)]
    assert pools[0].keys() == pools[1].keys() and all(torch.equal(pools[0][r], pools[1][r]) for r in pools[0])
    # after RoPE the same offset leaves R_p b - b in the keys: other codes
    after = kvquant.make_cache(model, layers=bias_offsets(model), **options)
    run(model, ids, after)
    assert not torch.equal(after.layers[0].k.pool["payload"], pools[1]["payload"])


@pytest.mark.parametrize("convention", ["counted", "absolute"])
def test_a_padded_batch_reads_each_row_at_its_own_positions(model64, story_ids, convention):
    """Row 0 left-padded by 15; positions counted from each row's first real token (generate's) or including the
    padding (a forward without position_ids): each row as it computes alone at those positions."""
    m = model64
    rows, mask = torch.zeros(2, 60, dtype=torch.long), torch.zeros(2, 60, dtype=torch.long)
    rows[0, 15:], mask[0, 15:] = story_ids[0, :45], 1
    rows[1], mask[1] = story_ids[0, 100:160], 1
    positions = (mask.cumsum(1) - 1).clamp(min=0) if convention == "counted" else torch.arange(60).expand(2, 60)
    cache = kvquant.make_cache(m, "int4", pre_rope=True, residual_length=0).set_padding(mask.bool())
    step = story_ids[:, 200:201].expand(2, 1)
    with torch.no_grad():
        batch = m(rows, attention_mask=mask, position_ids=positions, cache=cache).logits
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        decoded = m(step, attention_mask=mask, position_ids=positions[:, -1:] + 1, cache=cache).logits
    for row, start in ((0, 15), (1, 0)):
        alone = kvquant.make_cache(m, "int4", pre_rope=True, residual_length=0)
        with torch.no_grad():
            want = m(rows[row : row + 1, start:], position_ids=positions[row : row + 1, start:], cache=alone).logits
            next_one = m(step[:1], position_ids=positions[row : row + 1, -1:] + 1, cache=alone).logits
        torch.testing.assert_close(batch[row, start:], want[0], rtol=0, atol=1e-10)
        torch.testing.assert_close(decoded[row], next_one[0], rtol=0, atol=1e-10)


def test_forks_and_stacked_rows_read_each_key_at_its_own_position(model64, story_ids):
    m, ids = model64, story_ids
    settings = dict(pre_rope=True, residual_length=0)
    cache = kvquant.make_cache(m, "int4", **settings)
    run(m, ids[:, :50], cache, steps=(50,))
    cache.fork([0, 0])
    both = torch.stack([ids[0, 50:70], ids[0, 100:120]])
    forked = run(m, both, cache, steps=(19, 1))
    for row, part in enumerate(both):
        alone = kvquant.make_cache(m, "int4", **settings)
        want = run(m, torch.cat([ids[0, :50], part])[None], alone, steps=(50, 19, 1))[0, 50:]
        torch.testing.assert_close(forked[row], want, rtol=0, atol=1e-10)
    short, long = (kvquant.make_cache(m, "int4", **settings) for _ in range(2))
    run(m, ids[:, :30], short, steps=(30,))
    run(m, ids[:, 200:250], long, steps=(50,))
    empty = kvquant.make_cache(m, "int4", **settings)  # a row nothing was written to (the scorer stacks such)
    stacked = stack_rows([(short, 0), (long, 0), (empty, 0)])  # the short row padded in front by 20, the empty by 50
    positions, mask = torch.tensor([[30], [50], [0]]), torch.cat([stacked.padding.mask, torch.ones(3, 1, dtype=bool)],
                                                                 1)
    with torch.no_grad():
        got = m(ids[:, 300:301].expand(3, 1), attention_mask=mask.long(), position_ids=positions, cache=stacked).logits
        for row, source in enumerate((short, long, empty)):
            want = m(ids[:, 300:301], position_ids=positions[row : row + 1], cache=source).logits
            torch.testing.assert_close(got[row], want[0], rtol=0, atol=1e-10)


def test_bits_do_not_change_and_positions_count_on_the_host(model, story_ids):
    reports = []
    for pre_rope in (False, True):
        cache = kvquant.make_cache(model, "int4", pre_rope=pre_rope, residual_length=0)
        run(model, story_ids[:, :70], cache, steps=(64, 6))
        reports.append(cache.memory_report())
    plain, rotated = reports
    for key in ("stored_bytes", "payload_bytes", "scale_bytes", "full_precision_bytes", "bits_per_element",
                "reserved_bytes"):
        assert rotated[key] == plain[key], key
    layers, cache_tables = model.config.num_hidden_layers, kvquant.cache.build.rotary_tables(model).tensors()
    tables = sum(t.numel() * t.element_size() for t in cache_tables)
    positions = rotated["host_bytes"] - plain["host_bytes"] - tables
    # int32 positions of each layer's keys: 64 columns for the first 64 keys, grown like a block table (a quarter, plus
    # one) to 81 for 70
    assert positions == layers * 4 * (int(64 * 1.25) + 1)
    assert cache.settings()["pre_rope"] is True and "pre_rope" not in kvquant.make_cache(model, "int4").settings()


def test_refusals_are_one_line(model):
    cases = [
        (lambda: kvquant.make_cache(model, "int4", pre_rope=True, eviction="window", window=64),
         "pre_rope is not supported with an eviction policy ('window')"),
        (lambda: kvquant.make_cache(model, "int4", pre_rope="yes"), "pre_rope must be true or false, got str 'yes'"),
        (lambda: kvquant.make_cache(model.config, "int4", pre_rope=True), "pre_rope needs the loaded model"),
        (lambda: kvquant.cache.build_cache([None], "int4", pre_rope=True), "pre_rope needs the loaded model"),
        (lambda: kvquant.make_cache(build("gpt_neox"), "fp16", pre_rope=True),
         "pre_rope: model type 'gpt_neox' is not one kvquant knows the RoPE of"),
    ]
    scaled = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    cases.append((lambda: kvquant.make_cache(transformers.AutoModelForCausalLM.from_config(scaled), "fp16",
                                             pre_rope=True), "pre_rope: RoPE type 'dynamic' is not supported"))
    keys = torch.zeros(1, 4, 3, 8)
    cases.append((lambda: kvquant.make_cache(model, "fp16", pre_rope=True).update(keys, keys, 0),
                  "pre_rope: the update must carry the integer position_ids [batch, 3]"))
    cases.append((lambda: kvquant.make_cache(model, "fp16", pre_rope=True).update(
        keys, keys, 0, kwargs={"position_ids": torch.tensor([[-1, 0, 1]])}),
        "pre_rope: position_ids of real tokens must be in 0-16777216, got -1-1"))
    for call, message in cases:
        with pytest.raises(KVQuantError) as err:
            call()
        assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_simulated_memory_of_a_pre_rope_setting_is_the_plain_settings():
    args = dict(batch=1, kv_heads=4, head_dim=8, tokens=100)
    assert kvquant.cache.simulate_memory([None] * 2, {"quantizer": "int4", "pre_rope": True}, **args) == \
        kvquant.cache.simulate_memory([None] * 2, {"quantizer": "int4"}, **args)


def test_fused_decode_reads_pre_rope_keys_through_the_rotated_copy(monkeypatch):
    """The fused kernel reads stored codes, which hold keys without RoPE: a pre-RoPE cache's decode steps go through
    the copy rotated back (the kernel never runs for it), and still equal the cache without fused decode."""
    from kvquant.formats import kernels

    model = build("llama")
    ids = torch.randint(0, 128, (2, 60), generator=torch.Generator().manual_seed(1))
    unfused = run(model, ids, kvquant.make_cache(model, "int4", pre_rope=True, residual_length=0))
    calls = []
    kernel = kernels.attend_into
    monkeypatch.setattr(kernels, "attend_into", lambda *a: calls.append(1) or kernel(*a))
    kvquant.enable_fused_decode(model)
    fused = run(model, ids, kvquant.make_cache(model, "int4", pre_rope=True, residual_length=0))
    torch.testing.assert_close(fused, unfused, rtol=0, atol=1e-5)
    assert not calls
    run(model, ids, kvquant.make_cache(model, "int4", residual_length=0))
    assert calls  # the same model's plain cache does use the kernel


@pytest.mark.slow
def test_on_qwen2_5_the_identity_is_the_models_logits_and_the_bias_comes_off_before_rope(stories):
    """Qwen2.5-0.5B (where ``make setup`` prepared it), one story through experiments/prerope_bias.py's caches: the
    identity before RoPE within 5e-4 of the model's logits (1.3e-4 measured; they reach 32), and Lloyd-Max 4-bit
    keys with the ``k_proj`` bias removed before RoPE far closer to the model than with it removed after RoPE."""
    from conftest import experiment
    from test_qwen import real_file

    real_file()
    bench = experiment("prerope_bias")
    model, tokenizer = bench.load_model(bench.MODEL)
    ids = torch.tensor([next(t for s in stories if 200 <= len(t := tokenizer(s).input_ids) <= 300)])
    caches = bench.candidates(model)
    with torch.no_grad():
        want = bench.logits(model, ids, DynamicCache(config=model.config))
        got = {name: bench.logits(model, ids, kvquant.make_cache(model, **caches[name])) for name in
               ("fp16, before RoPE", "lloyd_max 4, after RoPE, bias removed", "lloyd_max 4, before RoPE, bias removed")}
    torch.testing.assert_close(got["fp16, before RoPE"], want, rtol=0, atol=5e-4)

    def kl(name):
        return float(torch.nn.functional.kl_div(got[name].log_softmax(-1), want.log_softmax(-1), log_target=True,
                                                reduction="batchmean"))

    assert kl("lloyd_max 4, before RoPE, bias removed") * 5 < kl("lloyd_max 4, after RoPE, bias removed")


def test_the_scorer_shares_prefixes_and_batches_rows_of_a_pre_rope_cache(model64, story_ids):
    """Streaming scoring (shared contexts prefilled once, rows stacked in batches, padded in front, and an empty
    cache stacked beside them): the identity before RoPE scores what the identity scores, in float64."""
    from kvquant.scoring.scorer import Scorer

    ids = story_ids[0].tolist()
    requests = [(ids[:40], ids[40:52]), (ids[:40], ids[60:66]), (ids[:23], ids[23:40]), (ids[100:170], ids[170:175])]
    scores = [Scorer(model64, kvquant.CacheSpec.of("fp16", options), mode="streaming", chunk_size=16,
                     batch_size=3).score_many(requests) for options in ({"pre_rope": True}, {})]
    for got, want in zip(*scores):
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-10)
