"""The kinds of metric (:mod:`kvquant.experiment.metric`): each measure's kind, its threshold from the gate's config,
its relative score and value, its name parsed back."""

import dataclasses
import math

import numpy as np
import pytest

from kvquant.experiment.metric import (ACCURACY, AGREEMENT, DIVERGENCE, FLIPS, KINDS, MEASURES, METRICS, PERPLEXITY,
    Metric, divergence_limits)
from kvquant.experiment.gate_config import GateConfig
from kvquant.experiment.results import MetricId


def test_every_measure_has_one_kind_and_every_kind_its_threshold_field():
    assert {m: k.kind for m, k in MEASURES.items()} == {
        "acc": "accuracy", "acc_norm": "accuracy", "ppl": "perplexity", "kl": "divergence", "top1": "agreement",
        "kl_tail": "tail", "flips": "flips"}
    fields = {f.name for f in dataclasses.fields(GateConfig)}
    assert all(m.threshold_key in fields for m in METRICS) and KINDS == {m.kind: m for m in METRICS}
    assert Metric.of("divergence") is DIVERGENCE and Metric.of(DIVERGENCE) is DIVERGENCE


def test_thresholds_directions_and_relative_scores():
    gate = GateConfig(min_relative_accuracy=0.97, max_perplexity_ratio=1.05, max_kl_divergence=0.01,
                      min_top1_agreement=0.9, max_flip_rate=0.2)
    assert ACCURACY.threshold(gate) == 0.97 and PERPLEXITY.threshold(gate) == pytest.approx(1 / 1.05)
    assert (DIVERGENCE.threshold(gate), AGREEMENT.threshold(gate), FLIPS.threshold(gate)) == (0.01, 0.9, 0.2)
    assert math.isnan(AGREEMENT.threshold(GateConfig()))  # not set: not gated
    assert [m.lower_is_better for m in METRICS] == [False, False, True, False, True, True]
    assert PERPLEXITY.relative(5.0, 4.0) == pytest.approx(0.8) and ACCURACY.relative(0.45, 0.5) == pytest.approx(0.9)
    assert AGREEMENT.relative(0.93, 1.0) == pytest.approx(0.93)
    assert math.isnan(DIVERGENCE.relative(0.02, 0.0)) and math.isnan(FLIPS.relative(0.1, 0.0))
    assert [m.is_bootstrap for m in METRICS] == [False, True, True, True, True, False]  # bootstraps: held to counts
    assert divergence_limits(gate) == {"max_kl_divergence": 0.01, "min_top1_agreement": 0.9}
    assert divergence_limits(GateConfig(min_top1_agreement=0.9), bucketed=True) == {"min_top1_agreement": 0.9}
    assert AGREEMENT.limit_phrase(0.9) == "top-1 agreement >= 0.9"
    assert PERPLEXITY.limit_phrase(1.05, words=True) == "perplexity ratio at most 1.05"


def test_values_of_windows_and_documents():
    assert ACCURACY.value((1.0, 0.0, 1.0, 1.0), ()) == 0.75
    assert AGREEMENT.value((60.0, 30.0), (63, 37)) == pytest.approx(0.9)  # positions, not windows, weigh
    assert PERPLEXITY.value((100.0, 50.0), (50, 50)) == pytest.approx(math.exp(1.5))
    np.testing.assert_array_equal(AGREEMENT.samples((60.0, 30.0), (63, 37)), [[60, 63], [30, 37]])


def test_a_metric_name_parses_back():
    for metric in (MetricId("acc_norm", "hellaswag"), MetricId("top1", "wikitext2@4096"), MetricId("ppl", "a/b")):
        assert MetricId.parse(metric.name) == metric
    for bad in ("kl", "nll/wikitext2", "acc/"):
        with pytest.raises(ValueError, match="no metric name"):
            MetricId.parse(bad)
