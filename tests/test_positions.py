"""Position buckets and the trend test (kvquant/runner/positions.py), by value on hand-made per-position numbers."""

import math

import numpy as np
import pytest

from kvquant.runner.bootstrap import studentized
from kvquant.runner.counts import MIN_TREND
from kvquant.runner.positions import bucket_means, buckets, check_edges, trend, trend_verdict

EDGES = (0, 2, 4, 8)


def test_bucket_means_by_hand():
    docs = [[1.0, 3.0, 5.0, 7.0, 9.0], [2.0, 4.0], [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0]]
    got = bucket_means(docs, EDGES)
    want = np.array([[2.0, 6.0, 9.0],          # [1, 3] [5, 7] [9]
                     [3.0, np.nan, np.nan],    # [2, 4]
                     [15.0, 35.0, 65.0]])      # [10, 20] [30, 40] [50..80]; position 8 is past the last edge
    np.testing.assert_array_equal(got, want)


def test_buckets_weigh_each_document_alike_and_skip_unreached_ones():
    docs = [[1.0, 3.0, 5.0, 7.0, 9.0], [2.0, 4.0], [10.0, 20.0, 30.0, 40.0]]
    got = buckets(docs, EDGES + (16,), iters=500, seed=3)
    assert [(b.start, b.stop, b.documents) for b in got] == [(0, 2, 3), (2, 4, 2), (4, 8, 1)]  # 8-16: nobody
    assert got[0].mean == pytest.approx((2.0 + 3.0 + 15.0) / 3)
    assert got[1].mean == pytest.approx((6.0 + 35.0) / 2)
    assert got[0].low <= got[0].mean <= got[0].high and got[0].low < got[0].high
    # one document: a mean, no interval
    assert got[2].mean == 9.0 and math.isnan(got[2].low) and math.isnan(got[2].high)
    # the interval is the studentized bootstrap over documents (the gate's), on the seeded stream's first draw
    idx = np.random.default_rng(3).integers(0, 3, size=(500, 3))
    np.testing.assert_allclose((got[0].low, got[0].high), studentized(np.array([2.0, 3.0, 15.0]), None, idx, 0.95))
    again = buckets(docs, EDGES + (16,), iters=500, seed=3)  # seeded: the same intervals
    assert [(b.low, b.high) for b in again[:2]] == [(b.low, b.high) for b in got[:2]]


def power_law(alpha: float, scales: list[float], length: int = 64) -> list[list[float]]:
    """Per document ``c * (p + 1) ** alpha`` at positions ``p`` (exactly; no noise)."""
    return [[c * (p + 1) ** alpha for p in range(length)] for c in scales]


def test_trend_recovers_the_growth_per_doubling():
    """KL proportional to the position: each bucket's mean is c times its mean position, so ln KL on log2 position
    has slope ln 2 exactly, whatever each document's constant: twice per doubling."""
    edges = (0, 4, 8, 16, 32, 64)
    t = trend(power_law(1.0, [0.01 * (1 + i % 5) for i in range(MIN_TREND)]), edges, iters=300)
    assert t.factor == pytest.approx(2.0, rel=1e-12)
    assert t.verdict == "grows" and t.low <= 2.0 <= t.high


def test_a_trend_over_too_few_documents_decides_nothing():
    """The same exact growth over 4 documents: the interval is as narrow, but a percentile bootstrap over 4
    documents misses 10-14% at each end (docs/gate.md), so it is not said to grow."""
    t = trend(power_law(1.0, [0.01, 0.03, 0.02, 0.05]), (0, 4, 8, 16, 32, 64), iters=300)
    assert t.factor == pytest.approx(2.0, rel=1e-12)
    assert t.verdict == f"too few documents (n = 4 of the {MIN_TREND} needed)"
    assert trend_verdict(1.5, 2.5, MIN_TREND - 1).startswith("too few documents")
    assert (trend_verdict(1.5, 2.5, MIN_TREND), trend_verdict(0.5, 0.9, MIN_TREND),
            trend_verdict(0.9, 1.1, MIN_TREND)) == ("grows", "shrinks", "undecided")


def test_trend_of_flat_and_falling_divergence():
    edges = (0, 4, 8, 16, 32, 64)
    rng = np.random.default_rng(0)
    flat = [[0.02 * math.exp(rng.normal(0, 0.5)) for _ in range(64)] for _ in range(MIN_TREND)]
    t = trend(flat, edges, iters=500)
    assert t.verdict == "undecided" and t.low < 1.0 < t.high
    falling = trend(power_law(-0.5, [0.1, 0.2, 0.15] * -(-MIN_TREND // 3)), edges, iters=300)
    assert falling.verdict == "shrinks" and falling.factor < 1.0


def test_trend_needs_two_documents_and_two_buckets():
    assert trend([[0.1] * 64], (0, 4, 8, 16, 32, 64)).verdict.startswith("too few documents (n = 1 of")
    one_bucket = trend(power_law(1.0, [0.1, 0.2] * (MIN_TREND // 2), length=4), (0, 4, 8))
    assert one_bucket.verdict == "undecided" and math.isnan(one_bucket.factor)


@pytest.mark.parametrize("edges", [(0,), (0, 4, 4), (0, 8, 4), (-1, 4), (0, 2.5), (False, True)])
def test_bad_edges_are_refused(edges):
    with pytest.raises(ValueError, match="increasing non-negative integers"):
        check_edges(edges)
