"""Eviction policies composed with quantizers: an evicting cache equals an independent reference that masks the
same positions out of full attention (DynamicCache, or a non-evicting kvquant cache of the same quantizer), left-
padded rows equal the row alone, the bytes equal the closed form and the planner, and bad settings are errors."""

import json

import pytest
import torch
import transformers
from transformers import DynamicCache

import kvquant
from kvquant.errors import KVQuantError
from kvquant.plan import main as plan_main
from reference import stream_bytes

HEADS, HEAD_DIM, LAYERS = 2, 16, 3
CHUNKS = [5, 1, 3, 1, 1, 7, 1, 1, 2, 1, 1, 1, 9, 1, 1]  # prefill, decode steps, chunks crossing the window


def model_of(dtype=torch.float64):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(dtype)


def reference_mask(c: int, n: int, sinks: int, window: int, dtype) -> torch.Tensor:
    """``[1, 1, n, c + n]`` additive mask: query ``c + i`` sees the past positions ``< sinks`` and
    ``[c - window, c)``, and ``[c, c + i]`` (the policy's semantics, written from its definition)."""
    k = torch.arange(c + n)
    q = torch.arange(c, c + n)[:, None]
    allowed = (k < min(sinks, c)) | ((k >= c - window) & (k < c)) | ((k >= c) & (k <= q))
    return torch.zeros(1, 1, n, c + n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def feed(model, ids, cache, masks=None):
    """Logits of every chunk of CHUNKS; with ``masks``, each forward gets the reference 4D mask."""
    out, c = [], 0
    with torch.no_grad():
        for n in CHUNKS:
            kwargs = {"attention_mask": masks(c, n)} if masks else {}
            out.append(model(ids[:, c : c + n], cache=cache, position_ids=torch.arange(c, c + n)[None],
                             **kwargs).logits)
            c += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("sinks, window, policy", [(2, 5, "sink_window"), (0, 6, "window"), (4, 32, "sink_window")])
def test_identity_eviction_equals_full_attention_with_the_positions_masked(sinks, window, policy):
    model = model_of()
    ids = torch.randint(0, 64, (1, sum(CHUNKS)), generator=torch.Generator().manual_seed(1))
    cache = kvquant.make_cache(model, "fp16", eviction=policy, sink_tokens=sinks, window=window)
    got = feed(model, ids, cache)
    want = feed(model, ids, DynamicCache(config=model.config),
                lambda c, n: reference_mask(c, n, sinks, window, torch.float64))
    # bit-exact: sdpa in float64 (eager attention takes its softmax in fp32, where the masked reference sums more
    # terms and differs by ~1e-8)
    assert torch.equal(got, want), (got - want).abs().max()
    no_eviction = feed(model, ids, kvquant.make_cache(model, "fp16"))
    if sinks + window < sum(CHUNKS):
        assert not torch.allclose(got, no_eviction, atol=1e-6)  # the reference is not trivially full attention


@pytest.mark.parametrize("group", [4, 8])
def test_int4_eviction_equals_the_same_quantizer_with_the_positions_masked(group):
    """A key group partly out of the window is stored whole but not read: the evicting int4 cache reads exactly
    what a non-evicting int4 cache reads under the policy's mask (same codes: groups are aligned at the sinks and
    never re-quantized)."""
    model = model_of()
    ids = torch.randint(0, 64, (1, sum(CHUNKS)), generator=torch.Generator().manual_seed(2))
    opts = dict(group_size=group, residual_length=0, sink_tokens=2)
    got = feed(model, ids, kvquant.make_cache(model, "int4", eviction="sink_window", window=6, **opts))
    want = feed(model, ids, kvquant.make_cache(model, "int4", **opts),
                lambda c, n: reference_mask(c, n, 2, 6, torch.float64))
    assert torch.equal(got, want), (got - want).abs().max()
    identity = feed(model, ids, kvquant.make_cache(model, "fp16", eviction="sink_window", window=6, sink_tokens=2))
    assert not torch.allclose(got, identity, atol=1e-4)  # and int4 is really quantized


def test_left_padded_rows_compute_what_each_row_computes_alone():
    model = model_of()
    gen = torch.Generator().manual_seed(3)
    lengths = [30, 22, 13]
    width = max(lengths)
    ids = torch.randint(0, 64, (3, width), generator=gen)
    mask = torch.zeros(3, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, width - n :] = 1
    opts = dict(eviction="sink_window", sink_tokens=2, window=7, group_size=4, residual_length=0)
    cache = kvquant.make_cache(model, "int4", **opts).set_padding(mask)
    steps = 4
    with torch.no_grad():
        position = (mask.cumsum(1) - 1).clamp(min=0)
        batch_logits = [model(ids, attention_mask=mask, cache=cache, position_ids=position).logits[:, -1]]
        token = ids[:, -1:]
        for i in range(steps):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
            pos = position[:, -1:] + 1 + i
            batch_logits.append(model(token, attention_mask=mask, cache=cache, position_ids=pos).logits[:, -1])
        for r, n in enumerate(lengths):
            alone = kvquant.make_cache(model, "int4", **opts)
            row = [model(ids[r : r + 1, width - n :], cache=alone).logits[:, -1]]
            for i in range(steps):
                row.append(model(token[r : r + 1], cache=alone,
                                 position_ids=torch.tensor([[n + i]])).logits[:, -1])
            for step, (a, b) in enumerate(zip(batch_logits, row)):
                assert torch.allclose(a[r], b[0], rtol=0, atol=1e-10), f"row {r}, step {step}"


def test_padding_behind_tokens_is_refused_with_eviction():
    model = model_of()
    cache = kvquant.make_cache(model, "int4", eviction="window", window=4, residual_length=0).set_padding(
        torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(KVQuantError, match="left padding"):
        with torch.no_grad():
            model(torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
                  cache=cache)


@pytest.mark.parametrize("tokens", [3, 9, 10, 11, 40, 77])
def test_evicted_tokens_free_their_bytes_as_the_closed_form_and_the_planner_say(tokens, tmp_path, capsys):
    model = model_of(torch.float32)
    sinks, window, group = 2, 8, 4
    settings = {"quantizer": "int4", "eviction": "sink_window", "sink_tokens": sinks, "window": window,
                "group_size": group, "residual_length": 1}
    cache = kvquant.make_cache(model, **settings)
    ids = torch.randint(0, 64, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        model(ids[:, :1], cache=cache)
        for i in range(1, tokens):
            model(ids[:, i : i + 1], cache=cache)
    # whole units leave once all their tokens are out of the window: keys (units of `group` tokens) keep the sinks
    # and the last whole groups reaching back to cover the window; values (units of one token) keep exactly the
    # sinks and the window. Each is stored as if the layer had only ever seen that many tokens after the sinks.
    keys = tokens - max(tokens - sinks - window, 0) // group * group
    values = min(tokens, sinks + window)
    key_bytes = stream_bytes(keys, None, group, 4, HEAD_DIM, sinks, 1, HEADS, HEAD_DIM, 4)
    value_bytes = stream_bytes(values, None, 1, 4, HEAD_DIM // group, sinks, 1, HEADS, HEAD_DIM, 4)
    expected = LAYERS * (key_bytes + value_bytes)
    report = cache.memory_report()
    assert report["total_bytes"] == expected
    # fp16 reference: every token written (a full fp16 cache), so the ratio shows what eviction saves
    assert report["fp16_bytes"] == LAYERS * 2 * HEADS * HEAD_DIM * 2 * tokens
    (tmp_path / "config.json").write_text(model.config.to_json_string())
    assert plan_main(["--model", str(tmp_path / "config.json"), "--context", str(tokens), "--dtype", "float32",
                      "--cache", json.dumps(settings), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes"] == expected


def test_settings_name_the_policy_and_forks_keep_it():
    model = model_of()
    cache = kvquant.make_cache(model, "fp8_e4m3", eviction="sink_window", sink_tokens=4, window=16)
    settings = cache.settings()
    assert (settings["eviction"], settings["window"], settings["sink_tokens"]) == ("sink_window", 16, 4)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(ids[:, :30], cache=cache)
        stacked = kvquant.cache.stack_rows([(cache, 0), (cache, 0)])
        single = kvquant.cache.stack_rows([(cache, 0)])
        a = model(ids[:, 30:31], cache=cache).logits
        b = model(torch.cat([ids[:, 30:31]] * 2), cache=stacked).logits
        c = model(ids[:, 30:31], cache=single).logits
    assert torch.equal(a, c) and torch.equal(b[0], b[1])
    assert torch.allclose(a[0], b[0], rtol=0, atol=1e-12)  # a batch of two rounds float64 sums its own way
    assert stacked.layers[0].get_mask_sizes(1) == (4 + 16 + 1, 31 - 20)


@pytest.mark.parametrize("options, message", [
    ({"window": 8}, "window and budget are options of an eviction policy"),
    ({"eviction": "window", "window": 8, "budget": 4}, "eviction policy 'window' has no option 'budget'"),
    ({"eviction": "key_norm", "window": 8}, "eviction policy 'key_norm' needs budget"),
    ({"eviction": "key_norm", "window": 8, "budget": 0}, "budget must be an integer >= 1"),
    ({"eviction": "key_norm", "window": 8, "budget": 4, "group_size": 8, "residual_length": 4},
     r"window 8 must cover residual_length 4 plus a quantized unit \(8 tokens\) - 1 = 11"),
    ({"eviction": "h2o", "window": 8}, "unknown eviction policy 'h2o'"),
    ({"eviction": "window", "window": 8, "sink_tokens": 4}, "keeps no sinks"),
    ({"eviction": "sink_window", "window": 8}, "needs sink_tokens >= 1"),
    ({"eviction": "window", "window": 0}, "window must be an integer >= 1"),
    ({"eviction": "window"}, "window must be an integer >= 1"),
    ({"eviction": "window", "window": True}, "window must be an integer >= 1"),
    ({"eviction": "sink_window", "window": 8, "sink_tokens": 2, "residual_length": 0,
      "layers": {"0": {"sink_tokens": 5}}}, "every full-attention layer keeps the cache's sink_tokens"),
    ({"eviction": "sink_window", "window": 64, "sink_tokens": 4}, "residual_length 128 is not below the eviction "
     "window 64"),
])
def test_bad_eviction_settings_are_one_line_errors(options, message):
    with pytest.raises(KVQuantError, match=message):
        kvquant.make_cache(model_of(), "int4", **options)


def _reference_key_norm(chunks, sinks, window, budget):
    """Independent reference of key_norm on one layer: per update, the keys and values attention reads (the
    kept past then the chunk), and after it, drop the largest-norm tokens between the sinks and the window."""
    kept, reads = [], []  # kept: (ordinal, k [H, D], v [H, D])
    ordinal = 0
    for k, v in chunks:
        new = [(ordinal + i, k[0, :, i], v[0, :, i]) for i in range(k.shape[2])]
        ordinal += k.shape[2]
        seen = kept + new
        reads.append((torch.stack([t[1] for t in seen], 1)[None], torch.stack([t[2] for t in seen], 1)[None]))
        kept += new
        excess = len(kept) - (sinks + window + budget)
        if excess > 0:
            middle = kept[sinks : len(kept) - window]
            # largest mean-over-heads L2 norm first; ties: the older
            worst = sorted(middle, key=lambda t: (-float(t[1].float().norm(dim=-1).mean()), t[0]))[:excess]
            gone = {t[0] for t in worst}
            kept = [t for t in kept if t[0] not in gone]
    return reads


def test_key_norm_keeps_exactly_the_tokens_its_scores_select():
    gen = torch.Generator().manual_seed(7)
    chunks = []
    for n in [6, 1, 1, 3, 1, 1, 1, 5, 1, 1, 2, 1, 1, 1, 1, 7, 1, 1]:
        k = torch.randn(1, HEADS, n, HEAD_DIM, generator=gen, dtype=torch.float64)
        k = k * (torch.rand(1, 1, n, 1, generator=gen, dtype=torch.float64) * 3)  # norms spread out
        chunks.append((k, torch.randn(1, HEADS, n, HEAD_DIM, generator=gen, dtype=torch.float64)))
    layer = kvquant.cache.build_cache([None], "fp16", head_dim=HEAD_DIM, eviction="key_norm", sink_tokens=2,
                                      window=4, budget=3).layers[0]
    for step, ((k, v), (want_k, want_v)) in enumerate(zip(chunks, _reference_key_norm(chunks, 2, 4, 3))):
        got_k, got_v = layer.update(k, v)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), step
        assert layer.get_mask_sizes(1)[0] == min(layer.cumulative_length, 2 + 4 + 3) + 1


@pytest.mark.parametrize("axes", [{}, {"key_axis": "token", "value_axis": "channel"},
                                  {"value_axis": "channel", "value_group_size": 2}],
                         ids=["kivi", "swapped", "channel-groups-differ"])
@pytest.mark.parametrize("group", [4, 8])
def test_key_norm_frees_whole_units_and_its_bytes_do_not_depend_on_the_data(group, axes):
    """int4 keys (or, axes swapped, values) are stored in groups of tokens: tokens are dropped block by block (at
    most one block partly read), so each stream stores at most a block - 1 tokens more than it reads, and the bytes
    are the same for any data, the planner's shape-only run included. Swapped, the per-token keys free each
    dropped token at once while the values still hold its group: a block is whole all the same. Both streams on
    the channel axis with other groups: a block holds several units of one stream, freed in order."""
    opts = dict(eviction="key_norm", sink_tokens=2, window=group + 2, budget=2 * group, group_size=group,
                residual_length=2, **axes)
    sizes = [9, 1, 1, 4, 1, 1, 1, 6, 1, 1, 1, 1, 1, 13, 1, 1, 1, 2, 1, 1] * 2
    layers = [kvquant.cache.build_cache([None], "int4", head_dim=HEAD_DIM, **opts).layers[0] for _ in range(3)]
    for seed, layer in enumerate(layers):
        gen = torch.Generator().manual_seed(seed)
        for n in sizes:
            if seed == 2:  # shapes only, as the planner runs the cache
                k = v = torch.empty(1, HEADS, n, HEAD_DIM, device="meta")
            else:
                k = torch.randn(1, HEADS, n, HEAD_DIM, generator=gen) * torch.rand(1, 1, n, 1, generator=gen) * 4
                v = torch.randn(1, HEADS, n, HEAD_DIM, generator=gen)
            out, _ = layer.update(k, v)
            capacity = 2 + group + 2 + 2 * group
            assert out.shape[2] == min(layer.cumulative_length - n, capacity) + n
            for store in (layer.k, layer.v):
                assert len(store.read_ordinals(0)) == min(layer.cumulative_length, capacity)
                assert store.stored_tokens(0) - len(store.read_ordinals(0)) <= group - 1
        assert layer.cumulative_length > 3 * capacity
    assert layers[0].memory() == layers[1].memory() == layers[2].memory()


def test_key_norm_in_a_model_reads_less_once_past_capacity_and_all_before():
    model = model_of()
    ids = torch.randint(0, 64, (1, sum(CHUNKS)), generator=torch.Generator().manual_seed(8))
    roomy = feed(model, ids, kvquant.make_cache(model, "fp16", eviction="key_norm", window=40, budget=10))
    full = feed(model, ids, DynamicCache(config=model.config))
    assert torch.equal(roomy, full)  # capacity 50 > 36 tokens: nothing evicted
    tight = feed(model, ids, kvquant.make_cache(model, "fp16", eviction="key_norm", window=4, budget=4))
    assert not torch.allclose(tight, full, atol=1e-6)
    assert torch.equal(tight[:, :8], full[:, :8])  # the first 8 positions have nothing to evict yet


def test_a_padded_batch_without_declared_padding_is_refused_with_eviction():
    model = model_of()
    cache = kvquant.make_cache(model, "fp16", eviction="sink_window", sink_tokens=2, window=4)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with pytest.raises(KVQuantError, match="call cache.set_padding"):
        with torch.no_grad():
            model(torch.ones(2, 5, dtype=torch.long), attention_mask=mask, cache=cache,
                  position_ids=(mask.cumsum(1) - 1).clamp(min=0))


def test_forks_that_evict_keep_sharing_what_they_all_still_hold():
    """Forked rows that evict part of the shared prefix still share what they hold: one storage per page, counted
    once; the pages every row has evicted are freed."""
    model = model_of()
    ids = torch.randint(0, 64, (1, 60), generator=torch.Generator().manual_seed(9))
    opts = dict(eviction="sink_window", sink_tokens=2, window=40, group_size=4, residual_length=0)
    first = kvquant.make_cache(model, "int4", **opts)
    with torch.no_grad():
        model(ids[:, :40], cache=first)
        prefix = first.memory_report()["shareable_bytes"]
        batch = kvquant.cache.stack_rows([(first, 0)] * 3)
        del first
        model(ids[:, 40:50].repeat(3, 1), cache=batch)  # every row evicts the prefix's oldest groups
    report = batch.memory_report()
    assert 0 < report["shared_bytes"] < prefix  # still shared, and the pages all rows evicted are gone
    assert report["shared_saved_bytes"] == 2 * report["shared_bytes"]


@pytest.mark.parametrize("rows", [1, 3])
def test_evicted_units_of_a_shared_prefix_are_freed_by_the_formula(rows):
    """fp8 (one token per unit): a 64-token prefix shared by ``rows`` rows; after every row has evicted ``e`` of
    its tokens, the prefix holds its last 64 - e units (each unit is its own slot, freed once no row holds it): its
    bytes times that share, and the rows read what one unshared row reads."""
    model = model_of()
    ids = torch.randint(0, 64, (1, 84), generator=torch.Generator().manual_seed(4))
    opts = dict(eviction="window", window=64, residual_length=0)  # the prefix fits: nothing evicted before the fork
    first, alone = kvquant.make_cache(model, "fp8_e4m3", **opts), kvquant.make_cache(model, "fp8_e4m3", **opts)
    with torch.no_grad():
        model(ids[:, :64], cache=first)
        prefix = first.memory_report()["shareable_bytes"]
        batch = kvquant.cache.stack_rows([(first, 0)] * rows)
        del first
        shared_before = batch.memory_report()["total_bytes"]
        out = model(ids[:, 64:].repeat(rows, 1), cache=batch).logits
        model(ids[:, :64], cache=alone)
        ref = model(ids[:, 64:], cache=alone).logits
    evicted = batch.layers[0].k.evicted[0]
    assert 8 <= evicted <= 64 and all(e == evicted for layer in batch.layers for s in (layer.k, layer.v)
                                      for e in s.evicted)
    assert shared_before == prefix  # sharing costs nothing beyond the prefix itself
    report = batch.memory_report()
    kept = prefix * (64 - evicted) // 64
    per_token = prefix // 64
    assert report["total_bytes"] == kept + rows * 20 * per_token  # each row's own 20 tokens, the prefix once
    assert report["shared_bytes"] == (kept if rows > 1 else 0)
    assert torch.equal(out, ref.expand_as(out))


@pytest.mark.parametrize("quantizer, options", [
    ("fp16", {}), ("fp8_e5m2", {"granularity": "tensor"}), ("int4", {}),
    ("int4", {"rotation": "hadamard", "key_bits": 8, "key_group_size": 16, "value_group_size": 4}),
    ("int2", {"eviction": "sink_window", "sink_tokens": 4, "window": 40, "residual_length": 0, "group_size": 8}),
    ("int8", {"layers": {"0": {"quantizer": "int2"}}, "residual_length": 8}),
])
def test_settings_round_trip_through_make_cache(quantizer, options):
    """settings() holds options only (derived groups are in derived_settings()): make_cache(**settings()) rebuilds a
    cache whose settings, derived values and stored K/V are the original's."""
    model = model_of()
    cache = kvquant.make_cache(model, quantizer, **options)
    rebuilt = kvquant.make_cache(model, **cache.settings())
    assert rebuilt.settings() == cache.settings() and rebuilt.derived_settings() == cache.derived_settings()
    ids = torch.randint(0, 64, (1, 50), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert torch.equal(model(ids, cache=cache).logits, model(ids, cache=rebuilt).logits)
