"""Batched, prefix-shared scoring computes what one-request-at-a-time scoring computes.

float64 copies of stories260K: a batch runs matmuls of other shapes than a single row, which moves fp32 states by
~1e-6 and can push an element across a quantizer's rounding boundary; in float64 that noise vanishes when the
cache rounds states to fp32 before quantizing, so batched and single scores can be compared to 1e-9."""

import copy

import pytest
import torch

import kvquant
from kvquant.scoring.scorer import Scorer


@pytest.fixture(scope="module")
def model64(model):
    return copy.deepcopy(model).double()


@pytest.fixture(scope="module")
def requests(tokenizer, stories):
    """Multiple-choice-like requests: 3 contexts of different lengths, each with 3 continuations."""
    out = []
    for k, story in enumerate(stories[10:13]):
        ids = tokenizer(story).input_ids
        cut = 12 + 11 * k
        for c in range(3):
            out.append((ids[:cut], ids[cut + 3 * c : cut + 3 * c + 4 + c]))
    return out


def scores(model, name, requests, **kwargs):
    options = {"residual_length": 0, "group_size": 8} if name.startswith("int") else {}
    scorer = Scorer(model, kvquant.CacheSpec.of(name, options), **kwargs)
    return scorer.score_many(requests)


@pytest.mark.parametrize("name", ["fp16", "int4", "int2"])
@pytest.mark.parametrize("mode, chunk", [("streaming", 8), ("streaming", 3), ("simulated", 64)])
def test_batched_and_shared_scoring_equals_one_request_at_a_time(model64, requests, name, mode, chunk):
    single = scores(model64, name, requests, mode=mode, chunk_size=chunk, batch_size=1, share_prefix=False)
    batched = scores(model64, name, requests, mode=mode, chunk_size=chunk, batch_size=5, share_prefix=True)
    for a, b in zip(single, batched):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-9)
        assert torch.equal(a.greedy, b.greedy)


def test_a_forked_cache_scores_exactly_as_a_fresh_one(model64, requests):
    """Prefill a context once, fork it into two rows, extend each: every row equals a fresh cache fed the same
    chunks (and the forks do not see each other's writes)."""
    context, (cont_a, cont_b) = requests[4][0], (requests[4][1][:4], requests[5][1][:4])
    make = lambda: kvquant.make_cache(model64, "int4", residual_length=0, group_size=8)  # noqa: E731
    shared = make()
    with torch.no_grad():
        model64(torch.tensor([context]), cache=shared)
        shared.fork([0, 0])
        forked = model64(torch.tensor([cont_a, cont_b]), cache=shared).logits
        for row, cont in enumerate((cont_a, cont_b)):
            fresh = make()
            model64(torch.tensor([context]), cache=fresh)
            alone = model64(torch.tensor([cont]), cache=fresh).logits[0]
            torch.testing.assert_close(forked[row], alone, rtol=0, atol=1e-9)
            k, k_fresh = shared.layers[0].k, fresh.layers[0].k
            assert k.n_tail[row] == k_fresh.n_tail[0]
            assert torch.equal(k.tail[row, :, : k.n_tail[row]], k_fresh.tail[0, :, : k_fresh.n_tail[0]])


def test_sharing_feeds_each_context_once(model64, requests, monkeypatch):
    from kvquant.scoring import scorer as evaluate

    fed = []
    original = evaluate._Batch.step
    monkeypatch.setattr(evaluate._Batch, "step", lambda self, tokens, *args, **kwargs: fed.append(sum(map(len, tokens)))
                        or original(self, tokens, *args, **kwargs))
    scores(model64, "fp16", requests, mode="streaming", chunk_size=512, batch_size=9, share_prefix=True)
    shared, fed[:] = sum(fed), []
    scores(model64, "fp16", requests, mode="streaming", chunk_size=512, batch_size=1, share_prefix=False)
    contexts = {tuple(c) for c, _ in requests}
    assert sum(fed) - shared == sum(len(c) - 1 for c, _ in requests) - sum(len(c) - 1 for c in contexts)


@pytest.mark.parametrize("name", ["fp16", "int4"])
@pytest.mark.parametrize("mode, chunk", [("streaming", 4), ("streaming", 1), ("streaming", 64), ("simulated", 64)])
def test_batched_scoring_on_a_sliding_window_model(name, mode, chunk):
    """A sliding-window mask counts positions, padding included: batches must never put padding between two real
    tokens of a row. Window 6, contexts of 1 to 12 tokens, shared and not."""
    import transformers

    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, sliding_window=6)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().double()
    gen = torch.Generator().manual_seed(3)
    requests = []
    for length in (1, 3, 9, 12, 5):
        context = torch.randint(0, 64, (length,), generator=gen).tolist()
        for c in range(3):
            requests.append((context, torch.randint(0, 64, (1 + 2 * c,), generator=gen).tolist()))
    single = scores(model, name, requests, mode=mode, chunk_size=chunk, batch_size=1, share_prefix=False)
    batched = scores(model, name, requests, mode=mode, chunk_size=chunk, batch_size=6, share_prefix=True)
    for a, b in zip(single, batched):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-9)


def test_cut_finds_the_cheapest_runs():
    from kvquant.scoring.scorer import _cut

    lengths = [9, 9, 8, 3, 3, 3, 1]
    assert _cut(lengths, most=10, forward_cost=0) == [2, 1, 3, 1]  # no price per run: no padding at all
    assert _cut(lengths, most=10, forward_cost=100) == [7]  # runs dearer than any padding: one
    assert _cut(lengths, most=2, forward_cost=100) == [2, 1, 2, 2]  # at most 2 a run: 18 + 8 + 6 + 6 padded
    # 9+9+8 padded to 9 costs 1 more than alone, a run costs 4: [9,9,8] [3,3,3,1] = 27 + 12 + 8 = 47
    assert _cut(lengths, most=10, forward_cost=4) == [3, 4]
    assert _cut([], most=4) == []


def test_rows_are_regrouped_by_length_so_nothing_is_padded(model64, monkeypatch):
    """Long contexts with short continuations and short contexts with long ones: contexts are prefilled in batches
    of their own lengths and continuations in batches of theirs, so with no price per forward pass no position
    is padding, and every score equals the request scored alone."""
    from kvquant.scoring import scorer as evaluate

    ids = list(range(3, 200))
    requests = []
    for k, (context, cont) in enumerate([(30, 1), (30, 2), (4, 20), (4, 21), (30, 1), (17, 9)]):
        start = 7 * k
        requests += [(ids[start : start + context], ids[start + context + c : start + context + c + cont + c])
                     for c in range(2)]
    fed, padded = [], []
    original = evaluate._Batch.step

    def step(self, tokens, *args, **kwargs):
        fed.append(sum(map(len, tokens)))
        padded.append(max(map(len, tokens)) * len(tokens))
        return original(self, tokens, *args, **kwargs)

    monkeypatch.setattr(evaluate._Batch, "step", step)
    monkeypatch.setattr(evaluate, "FORWARD_COST", 0)
    batched = scores(model64, "int4", requests, mode="streaming", chunk_size=512, batch_size=12, share_prefix=True)
    assert fed == padded and len(fed) == 3 + 8  # context lengths 29, 16, 3; 8 continuation lengths
    monkeypatch.undo()
    single = scores(model64, "int4", requests, mode="streaming", chunk_size=512, batch_size=1, share_prefix=False)
    for a, b in zip(single, batched):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-9)
        assert torch.equal(a.greedy, b.greedy)


@pytest.mark.parametrize("mode", ["simulated", "streaming"])
def test_only_scored_positions_reach_the_output_layer(model64, requests, mode, monkeypatch):
    """Padding and context positions of batched rows are never projected onto the vocabulary: the output layer
    sees one row per scored token (plus, in streaming mode, one per prefilled batch row, which transformers keeps
    by default). Forward passes priced high, so that every batch has several rows (a row alone is projected
    whole, as a plain forward does)."""
    from kvquant.scoring import scorer as evaluate

    monkeypatch.setattr(evaluate, "FORWARD_COST", 10**6)
    seen = []
    hook = model64.get_output_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[:-1].numel()))
    try:
        scores(model64, "fp16", requests, mode=mode, chunk_size=512, batch_size=5, share_prefix=True)
    finally:
        hook.remove()
    contexts = len({tuple(c) for c, _ in requests}) if mode == "streaming" else 0
    assert sum(seen) == sum(len(c) for _, c in requests) + contexts
