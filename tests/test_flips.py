"""Flips (kvquant/runner/flips.py): counts written here by hand, and the exact interval against the binomial
distribution it inverts."""

import math

import pytest
from scipy.stats import binom

from kvquant.runner.flips import exact_interval, flips


def test_counts_by_hand():
    baseline = (1, 1, 1, 0, 0, 1, 0, 1, 1, 0)
    candidate = (1, 0, 1, 1, 0, 0, 0, 1, 1, 0)
    # right -> wrong: documents 1 and 5; wrong -> right: document 3; the same accuracy would hide 2 of the 3
    got = flips(baseline, candidate)
    assert (got.n, got.right_to_wrong, got.wrong_to_right) == (10, 2, 1)
    assert got.rate == pytest.approx(0.3)
    same_accuracy = flips((1, 0, 1, 0), (0, 1, 0, 1))
    assert (same_accuracy.right_to_wrong, same_accuracy.wrong_to_right, same_accuracy.rate) == (2, 2, 1.0)


def test_only_documents_both_scored_count():
    got = flips((1, 1, 0, 0, 1, 1), (0, 1, 1))  # the candidate scored the first 3 (a sequential look)
    assert (got.n, got.right_to_wrong, got.wrong_to_right) == (3, 1, 1)


@pytest.mark.parametrize("k, n", [(0, 20), (3, 20), (20, 20), (1, 500), (37, 200)])
def test_the_exact_interval_inverts_the_binomial(k, n):
    """Clopper-Pearson: at the upper end, k or fewer flips have probability alpha/2; at the lower end, k or more."""
    low, high = exact_interval(k, n, 0.95)
    if k < n:
        assert binom.cdf(k, n, high) == pytest.approx(0.025, rel=1e-6)
    else:
        assert high == 1.0
    if k > 0:
        assert binom.sf(k - 1, n, low) == pytest.approx(0.025, rel=1e-6)
    else:
        assert low == 0.0
    assert low <= k / n <= high


def test_no_flips_still_bound_the_rate():
    """None of 100 documents flipped does not show that none of 10,000 would: the rate's upper end is about 3.6%."""
    got = flips((1,) * 60 + (0,) * 40, (1,) * 60 + (0,) * 40)
    assert got.rate == 0 and got.rate_interval[0] == 0 and got.rate_interval[1] == pytest.approx(0.0362, abs=1e-4)


def test_no_documents_and_non_binary_scores():
    empty = flips((), ())
    assert empty.n == 0 and math.isnan(empty.rate) and math.isnan(empty.rate_interval[0])
    with pytest.raises(ValueError, match="0/1 outcomes"):
        flips((0.5, 1.0), (1.0, 1.0))
