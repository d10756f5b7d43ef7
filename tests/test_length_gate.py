"""The longest context that passes (issue 40, item 3) on hand-made per-bucket verdicts: every order of pass, fail,
inconclusive and not exercised over three buckets (one and two metrics each) against the rule written out
directly in the test, explicit cases with their sentences, and the inputs refused."""

import itertools

import pytest

from kvquant.runner.gate import FAIL, INCONCLUSIVE, NOT_EXERCISED, NOT_GATED, PASS, LengthVerdict, longest_passing

P, F, U, N = PASS, FAIL, INCONCLUSIVE, NOT_EXERCISED
LENGTHS = [1024, 4096, 16384]


def expected(buckets):
    """The rule, read off the docstring literally and computed another way than gate.py does."""
    def state(verdicts):
        values = set(verdicts.values())
        if FAIL in values:
            return FAIL
        if values == {PASS}:
            return PASS
        return INCONCLUSIVE if INCONCLUSIVE in values else NOT_EXERCISED

    states = [(length, state(v)) for length, v in buckets]
    safe = [length for length, _ in states if all(s == PASS for m, s in states if m <= length)]
    failing = [length for length, s in states if s == FAIL]
    up_to, fails = max(safe, default=None), min(failing, default=None)
    low, high = up_to or 0, fails or float("inf")
    return LengthVerdict(up_to, fails, tuple(n for n, s in states if low < n < high and s == INCONCLUSIVE),
                         tuple(n for n, s in states if low < n < high and s == NOT_EXERCISED))


@pytest.mark.parametrize("order", list(itertools.product([P, F, U, N], repeat=3)))
def test_every_order_of_one_metric(order):
    buckets = [(n, {"acc/needle_single": v}) for n, v in zip(LENGTHS, order)]
    assert longest_passing(buckets) == expected(buckets)


def test_every_order_of_two_metrics():
    pairs = list(itertools.product([P, F, U, N], repeat=2))
    for order in itertools.product(pairs, repeat=3):  # 4,096 tables
        buckets = [(n, {"acc/needle_single": a, "kl/long": b}) for n, (a, b) in zip(LENGTHS, order)]
        assert longest_passing(buckets) == expected(buckets), buckets


@pytest.mark.parametrize("table, result, text", [
    ([(4096, P), (8192, U), (16384, F)], LengthVerdict(4096, 16384, (8192,)),
     "passes up to 4K, fails from 16K, inconclusive at 8K"),
    ([(1024, P), (2048, P), (4096, P)], LengthVerdict(4096, None), "passes up to 4K"),
    ([(1024, F), (2048, P)], LengthVerdict(None, 1024), "passes at no length, fails from 1K"),
    ([(1024, U), (2048, P), (4096, F)], LengthVerdict(None, 4096, (1024,)),
     "passes at no length, fails from 4K, inconclusive at 1K"),
    ([(1024, P), (2048, F), (4096, P)], LengthVerdict(1024, 2048), "passes up to 1K, fails from 2K"),
    ([(512, P), (1024, N), (2048, U), (4096, P), (8192, U)], LengthVerdict(512, None, (2048, 8192), (1024,)),
     "passes up to 512, inconclusive at 2K, 8K, not exercised at 1K"),
    ([(1000, P), (3000, U), (5000, F), (7000, U)], LengthVerdict(1000, 5000, (3000,)),
     "passes up to 1000, fails from 5000, inconclusive at 3000"),
    ([(2048, N)], LengthVerdict(None, None, (), (2048,)), "passes at no length, not exercised at 2K"),
    ([(2048, P)], LengthVerdict(2048, None), "passes up to 2K"),
    ([(2048, F)], LengthVerdict(None, 2048), "passes at no length, fails from 2K"),
    ([], LengthVerdict(None, None), "no length buckets"),
])
def test_explicit_cases_and_their_sentences(table, result, text):
    verdict = longest_passing([(n, {"acc/needle_multikey": v}) for n, v in table])
    assert verdict == result and verdict.describe() == text


def test_a_bucket_passes_only_if_all_its_metrics_pass():
    buckets = [(1024, {"a": P, "b": P, "c": P}), (2048, {"a": P, "b": U, "c": P}), (4096, {"a": P, "b": P, "c": N}),
               (8192, {"a": N, "b": U, "c": F}), (16384, {"a": P, "b": P, "c": P})]
    verdict = longest_passing(buckets)
    assert verdict == LengthVerdict(1024, 8192, (2048,), (4096,))
    assert verdict.describe() == "passes up to 1K, fails from 8K, inconclusive at 2K, not exercised at 4K"


@pytest.mark.parametrize("buckets, message", [
    ([(2048, {"a": P}), (1024, {"a": P})], "length buckets out of order or repeated: 1024 after 2048"),
    ([(1024, {"a": P}), (1024, {"a": F})], "length buckets out of order or repeated: 1024 after 1024"),
    ([(0, {"a": P})], "length bucket 0 is not a positive integer"),
    ([(-512, {"a": P})], "length bucket -512 is not a positive integer"),
    ([(True, {"a": P})], "length bucket True is not a positive integer"),
    ([(1024.0, {"a": P})], "length bucket 1024.0 is not a positive integer"),
    ([(1024, {"a": P}), (2048, {})], "length bucket 2048 has no gated long-context metric"),
    ([(1024, {"a": NOT_GATED})], "length bucket 1024: verdicts must be pass, fail, inconclusive, too few documents "
                                 "or not exercised, got 'not gated'"),
    ([(1024, {"a": "PASS", "b": P})], "got 'PASS'"),
])
def test_bad_buckets_are_refused(buckets, message):
    with pytest.raises(ValueError, match=f"^{message}$" if message.startswith("length") else message):
        longest_passing(buckets)


def test_a_bucket_is_judged_on_the_metrics_it_has():
    """Needles may be measured at some lengths only: a bucket without them is judged on its divergence alone, and
    a needle that fails where it is measured still fails its bucket."""
    assert longest_passing([(1024, {"kl": P}), (2048, {"kl": P, "needle": P}), (4096, {"kl": P})]) == \
        LengthVerdict(4096, None)
    assert longest_passing([(1024, {"kl": P}), (2048, {"kl": P, "needle": F}), (4096, {"kl": P})]) == \
        LengthVerdict(1024, 2048)
