"""The gate on hand-made tables."""

import math

import numpy as np
import pytest

from kvquant.config import GateConfig
from kvquant.gate import bootstrap_interval, decide
from kvquant.results import ACCURACY, PERPLEXITY, MetricId, MetricRow, relative_score

POLICY = GateConfig(min_relative_accuracy=0.97, max_perplexity_ratio=1.05)


def acc(candidate, value, baseline=0.5, ci=(math.nan, math.nan), gated=True, metric="acc/task"):
    return MetricRow(candidate, MetricId(*metric.split("/")), value, baseline, 200, gated, *ci)


def ppl(candidate, value, baseline=4.0, ci=(math.nan, math.nan)):
    return MetricRow(candidate, MetricId("ppl", "text"), value, baseline, 50, True, *ci)


def test_relative_scores():
    assert relative_score(ACCURACY, 0.45, 0.5) == pytest.approx(0.9)
    assert relative_score(PERPLEXITY, 5.0, 4.0) == pytest.approx(0.8)  # baseline / candidate
    assert relative_score(ACCURACY, 0.0, 0.0) == 1.0


def test_pass_and_fail():
    assert decide([acc("a", 0.49), ppl("a", 4.1)], {"a": 4.5}, POLICY).decision == "pass"
    d = decide([acc("a", 0.40), ppl("a", 4.1)], {"a": 4.5}, POLICY)
    assert d.decision == "fail" and d.chosen is None and "acc/task" in d.reason


def test_thresholds_on_both_sides():
    at, below = 0.5 * 0.97, 0.5 * 0.97 - 1e-9
    assert decide([acc("a", at)], {"a": 4}, POLICY).decision == "pass"
    assert decide([acc("a", below)], {"a": 4}, POLICY).decision == "fail"
    assert decide([ppl("a", 4.0 * 1.05)], {"a": 4}, POLICY).decision == "pass"
    assert decide([ppl("a", 4.0 * 1.05 + 1e-6)], {"a": 4}, POLICY).decision == "fail"
    # better than the baseline passes
    assert decide([acc("a", 0.6), ppl("a", 3.9)], {"a": 4}, POLICY).decision == "pass"


def test_lower_bound_mode_uses_the_interval():
    row = acc("a", 0.49, ci=(0.95, 1.01))  # point 0.98 passes, lower bound 0.95 does not
    assert decide([row], {"a": 4}, POLICY).decision == "pass"
    strict = GateConfig(decide_on="lower_bound")
    d = decide([row], {"a": 4}, strict)
    assert d.decision == "fail" and "lower confidence bound" in d.reason
    assert decide([acc("a", 0.49, ci=(0.975, 1.0))], {"a": 4}, strict).decision == "pass"
    assert decide([acc("a", 0.49)], {"a": 4}, strict).decision == "fail"  # no interval: cannot pass


def test_ungated_metrics_are_reported_not_gated():
    rows = [acc("a", 0.49), acc("a", 0.1, gated=False, metric="acc/near_chance")]
    d = decide(rows, {"a": 4}, POLICY)
    assert d.decision == "pass" and len(d.verdicts) == 2


def test_sweep_chooses_the_cheapest_passing_setting():
    rows = [acc("int8", 0.5), acc("int4", 0.49), acc("int2", 0.2)]
    d = decide(rows, {"int8": 8.5, "int4": 4.5, "int2": 2.5}, POLICY)
    assert d.decision == "pass" and d.chosen == "int4"
    assert d.passed == {"int8": True, "int4": True, "int2": False}


def test_bootstrap_interval_accuracy():
    rng = np.random.default_rng(0)
    base = (rng.random(400) < 0.6).astype(float)
    cand = base.copy()
    cand[:20] = 0  # a candidate that loses some answers
    low, high = bootstrap_interval(ACCURACY, base, cand, 2000, 0.95, seed=1)
    point = cand.mean() / base.mean()
    assert low < point < high < 1.0 + 1e-9
    assert (low, high) == bootstrap_interval(ACCURACY, base, cand, 2000, 0.95, seed=1)  # reproducible
    same = bootstrap_interval(ACCURACY, base, base, 500, 0.95, seed=1)
    assert same == (1.0, 1.0)  # paired: identical outcomes give no spread


def test_bootstrap_interval_perplexity():
    base = np.array([[100.0, 50], [120.0, 60], [90.0, 40], [110.0, 55]])
    cand = base * [1.02, 1]
    low, high = bootstrap_interval(PERPLEXITY, base, cand, 500, 0.9, seed=0)
    point = math.exp((base[:, 0].sum() - cand[:, 0].sum()) / base[:, 1].sum())
    assert low <= point <= high < 1
