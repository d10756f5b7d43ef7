"""What attention read quantized: counts equal to hand-counted values, and KL divergence / top-1 agreement equal
to an independent computation from logits."""

import itertools

import pytest
import torch

from kvquant.cache import CacheSpec, build_cache, make_cache
from kvquant.scoring.data import Window
from kvquant.scoring.divergence import divergence_samples
from kvquant.scoring.scorer import Scorer
from kvquant.cache.reads import Reads, causal_counts


def brute_force(flags: list[bool], queries: int) -> tuple[int, int]:
    """Query j of the last ``queries`` reads the first m - queries + j + 1 tokens."""
    m = len(flags)
    reads = [flags[: m - queries + j + 1] for j in range(queries)]
    return sum(sum(r) for r in reads), sum(len(r) for r in reads)


@pytest.mark.parametrize("flags", [[True] * 5, [False] * 3 + [True] * 4 + [False] * 2, [True, False] * 4,
                                   [False] * 6, [False, True, True, False, True]])
@pytest.mark.parametrize("queries", [1, 2, 5])
def test_causal_counts_match_a_brute_force_count(flags, queries):
    runs = [(flag, len(list(run))) for flag, run in itertools.groupby(flags)]
    queries = min(queries, len(flags))
    assert causal_counts(runs, queries) == brute_force(flags, queries)


def layer_cache(quantizer="int4", **options):
    return build_cache([None], quantizer, head_dim=16, **options)


def write(cache, tokens: int, seed: int = 0, rows: int = 1):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(rows, 2, tokens, 16, generator=g), torch.randn(rows, 2, tokens, 16, generator=g)
    cache.update(k, v, 0)


def counted(quantizer="int4", steps=(40,), **options) -> Reads:
    cache = layer_cache(quantizer, **options)
    cache.reads = Reads()
    for i, n in enumerate(steps):
        write(cache, n, seed=i)
    return cache.reads


def test_incomplete_key_group_is_read_at_full_precision():
    # 40 tokens through 32-token key groups: keys 0..31 quantized, 32..39 not; query j reads the first j + 1
    reads = counted(group_size=32, residual_length=0)
    assert (reads.keys_quantized, reads.keys) == (sum(min(j, 32) for j in range(1, 41)), 820)  # 784 of 820
    assert (reads.values_quantized, reads.values) == (820, 820)  # values: one token per unit, all quantized
    # one decoding step: 41 keys read, 32 of them quantized
    reads = counted(group_size=32, residual_length=0, steps=(40, 1))
    assert (reads.keys_quantized, reads.keys) == (784 + 32, 820 + 41)


def test_a_key_group_longer_than_the_request_hides_every_key():
    reads = counted(group_size=128, residual_length=0)
    assert reads.keys_quantized == 0 and reads.share("keys") == 0 and reads.quantized_share == 0


def test_residual_window_is_read_at_full_precision():
    # residual 16: no whole 32-token key group beyond it (40 - 16 < 32); values: 24 quantized, the last 16 not
    reads = counted(group_size=32, residual_length=16)
    assert reads.keys_quantized == 0
    assert (reads.values_quantized, reads.values) == (sum(min(j, 24) for j in range(1, 41)), 820)  # 684


def test_sinks_are_read_at_full_precision():
    # 4 sinks, then 32 quantized keys, then 4 in an incomplete group
    reads = counted(group_size=32, residual_length=0, sink_tokens=4)
    assert reads.keys_quantized == sum(min(max(j - 4, 0), 32) for j in range(1, 41))  # 656
    assert reads.values_quantized == sum(max(j - 4, 0) for j in range(1, 41))  # 666
    assert reads.keys == reads.values == 820


def test_evicted_tokens_are_not_read():
    # fp8 (one token per unit), residual 4, a window of 8 past tokens, 20 decoding steps: step t reads
    # min(t, 8) + 1 tokens, the last min(4, that) of them at full precision
    reads = counted("fp8_e4m3", steps=(1,) * 20, residual_length=4, eviction="window", window=8)
    read = [min(t, 8) + 1 for t in range(20)]
    assert reads.keys == reads.values == sum(read) == 144
    assert reads.keys_quantized == reads.values_quantized == sum(m - min(4, m) for m in read) == 70


def test_padding_is_neither_a_query_nor_a_read_token():
    cache = layer_cache(group_size=32, residual_length=0)
    cache.reads = Reads()
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :8] = False  # row 1: 32 real tokens after 8 of padding
    cache.set_padding(mask)
    write(cache, 40, rows=2)
    alone = sum(min(j, 32) for j in range(1, 41)), 820
    assert (cache.reads.keys_quantized, cache.reads.keys) == (alone[0] + 528, alone[1] + 528)


def test_scorer_counts_every_cache_it_used(model, tokenizer, stories):
    """Prefix sharing forks rows into new caches; their reads land in the one counter."""
    ids = tokenizer(stories[0]).input_ids[:60]
    scorer = Scorer(model, CacheSpec.of("fp8_e4m3", {"residual_length": 0}), "streaming", 16)
    scorer.score_many([(ids[:50], ids[50:]), (ids[:50], ids[50:55])])
    assert scorer.lengths == [60, 55]
    # fp8, no residual window: everything read is quantized; every query of every layer counted
    layers = model.config.num_hidden_layers
    assert scorer.reads.keys_quantized == scorer.reads.keys > 0
    single = Scorer(model, CacheSpec.of("fp8_e4m3", {"residual_length": 0}), "simulated")
    single.score(ids, 50)
    assert single.reads.keys == layers * sum(range(1, 61))


def test_divergence_equals_an_independent_computation(model, tokenizer, stories):
    ids = tokenizer(stories[1]).input_ids[:80]
    windows = [Window(ids[:64], 1), Window(ids[16:80], 1)]
    make = {"fp16": CacheSpec.of("fp16", {"residual_length": 0}),
            "int2": CacheSpec.of("int2", {"group_size": 8, "residual_length": 0})}
    out = divergence_samples(Scorer(model, make["fp16"]), Scorer(model, make["int2"]), windows)
    for w, kl, top1, tokens in zip(windows, out["kl"], out["top1"], out["tokens"]):
        x = torch.tensor([w.ids])
        with torch.no_grad():
            p = model(x).logits[0, :-1].double().log_softmax(-1)  # no cache: the model's own attention
            q = model(x, cache=make_cache(model, make["int2"]), use_cache=True).logits[0, :-1].double().log_softmax(-1)
        expected = torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1)
        assert tokens == len(w.ids) - 1
        assert torch.allclose(torch.tensor(kl, dtype=torch.double), expected, rtol=1e-4, atol=1e-7)
        assert top1 == int((p.argmax(-1) == q.argmax(-1)).sum())
        assert expected.mean() > 1e-4  # int2 changes the distribution: this compares something
    same = divergence_samples(Scorer(model, make["fp16"]), Scorer(model, make["fp16"]), windows)
    assert max(max(kl) for kl in same["kl"]) < 1e-6 and same["top1"] == same["tokens"]
