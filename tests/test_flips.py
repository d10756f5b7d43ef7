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


def gated_rows(tiny_config, max_flip_rate, baseline, candidate):
    """metric_rows of one candidate whose tinystories_lastword answers are ``candidate`` against ``baseline``."""
    from kvquant.runner.gate import judge, metric_rows
    from kvquant.experiment.results import Measured, MetricId, Outcomes

    cfg = tiny_config("flips", candidates=[{"quantizer": "int4", "name": "int4"}],
                      eval={"tasks": {"names": ["tinystories_lastword"], "limit": 100}},
                      gate={"tasks": ["tinystories_lastword"], "bootstrap": 1000, "max_flip_rate": max_flip_rate})
    acc = MetricId("acc", "tinystories_lastword")
    results = {"baseline": Measured("baseline", (Outcomes(acc, tuple(map(float, baseline))),)),
               "int4": Measured("int4", (Outcomes(acc, tuple(map(float, candidate))),))}
    rows = metric_rows(cfg, results, ["int4"])
    return rows, [judge(r, cfg.gate) for r in rows]


def test_an_accuracy_row_carries_its_paired_counts(tiny_config):
    """The accuracy row counts both right, only the baseline, only the candidate and neither from the answers
    (what its estimate of the documents still needed projects); the flip-rate row derived from it has none."""
    baseline = [1] * 50 + [0] * 50
    candidate = [0] * 3 + [1] * 47 + [1] * 5 + [0] * 45
    rows, _ = gated_rows(tiny_config, 0.1, baseline, candidate)
    assert [(r.metric.measure, r.paired) for r in rows] == [("acc", (47, 3, 5, 45)), ("flips", None)]


@pytest.mark.parametrize("flipped, verdict", [(1, "pass"), (10, "inconclusive"), (30, "fail")])
def test_the_flip_rate_is_gated_beside_the_accuracy(tiny_config, flipped, verdict):
    """100 documents, half right; the candidate flips ``flipped`` of them, half each way (accuracy unchanged when
    even). Gate: at most 10% flipped. 1 flip: upper end 5.4% (pass); 10: [4.9%, 17.6%] straddles (inconclusive);
    30: lower end 21.2% (fail)."""
    baseline = [1] * 50 + [0] * 50
    candidate = list(baseline)
    for i in range(flipped):
        j = i // 2 if i % 2 == 0 else 50 + i // 2  # right -> wrong from the front, wrong -> right from the middle
        candidate[j] = 1 - candidate[j]
    rows, verdicts = gated_rows(tiny_config, 0.1, baseline, candidate)
    assert [r.metric.name for r in rows] == ["acc/tinystories_lastword", "flips/tinystories_lastword"]
    row = rows[1]
    assert row.value == flipped / 100 and row.n == 100 and row.gated
    assert (row.ci_low, row.ci_high) == exact_interval(flipped, 100, 0.95)
    assert verdicts[1].verdict == verdict


def test_no_flip_rows_without_max_flip_rate(tiny_config):
    rows, _ = gated_rows(tiny_config, None, [1, 0] * 10, [0, 1] * 10)
    assert [r.metric.name for r in rows] == ["acc/tinystories_lastword"]
