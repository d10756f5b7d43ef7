"""The accuracy gate: pure functions over result tables (no model, no files).

Relative score per metric: candidate / baseline for accuracy, baseline / candidate for perplexity, so higher
is better for both and 1.0 means "no loss". A candidate passes when every gated metric meets its threshold
(``min_relative_accuracy``; ``1 / max_perplexity_ratio`` for perplexity), judged on the point estimate or on
the lower end of a paired bootstrap interval. Among passing candidates, the cheapest (fewest bits per
element) is chosen.
"""

from __future__ import annotations

import math

import numpy as np

from .config import ExperimentConfig, GateConfig
from .results import ACCURACY, PERPLEXITY, Decision, Measured, MetricId, MetricRow, Verdict, relative_score

__all__ = ["ACCURACY", "PERPLEXITY", "Decision", "MetricRow", "Verdict", "bootstrap_interval", "decide", "is_gated",
           "judge", "metric_rows", "relative_score", "threshold"]


def threshold(kind: str, policy: GateConfig) -> float:
    return policy.min_relative_accuracy if kind == ACCURACY else 1.0 / policy.max_perplexity_ratio


def judge(row: MetricRow, policy: GateConfig) -> Verdict:
    limit = threshold(row.kind, policy)
    statistic = row.ci_low if policy.decide_on == "lower_bound" else row.relative
    passed = (not row.gated) or (not math.isnan(statistic) and statistic >= limit)
    return Verdict(row, limit, statistic, passed)


def decide(rows: list[MetricRow], bits_per_element: dict[str, float], policy: GateConfig) -> Decision:
    """Judge every row; a candidate passes when all its gated rows pass; choose the cheapest passing one."""
    verdicts = [judge(r, policy) for r in rows]
    passed = {name: all(v.passed for v in verdicts if v.row.candidate == name) for name in bits_per_element}
    winners = sorted((bits_per_element[n], n) for n, ok in passed.items() if ok)
    basis = "lower confidence bound" if policy.decide_on == "lower_bound" else "point estimate"
    if winners:
        chosen = winners[0][1]
        reason = (f"{chosen} is the cheapest setting ({winners[0][0]:.2f} bits/element) whose every gated metric "
                  f"meets its threshold ({basis})")
        return Decision("pass", chosen, passed, verdicts, reason)
    failing = [f"{v.row.candidate}: {v.row.metric.name} {v.statistic:.4f} < {v.threshold:.4f}"
               for v in verdicts if not v.passed]
    return Decision("fail", None, passed, verdicts, f"no setting passes ({basis}); " + "; ".join(failing))


def bootstrap_interval(
    kind: str, baseline: np.ndarray, candidate: np.ndarray, iters: int, confidence: float, seed: int
) -> tuple[float, float]:
    """Paired bootstrap interval of the relative score, resampling samples (documents or windows).

    accuracy: ``baseline``/``candidate`` are per-sample scores ``[n]``.
    perplexity: per-sample ``[n, 2]`` rows of (summed NLL, token count).
    """
    baseline, candidate = np.asarray(baseline, dtype=float), np.asarray(candidate, dtype=float)
    n = len(baseline)
    if n == 0 or len(candidate) != n:
        return math.nan, math.nan
    idx = np.random.default_rng(seed).integers(0, n, size=(iters, n))
    if kind == ACCURACY:
        b, c = baseline[idx].mean(1), candidate[idx].mean(1)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = np.where(b == 0, np.where(c == 0, 1.0, np.inf), c / b)
    else:
        tokens = baseline[idx, 1].sum(1)
        ratios = np.exp((baseline[idx, 0].sum(1) - candidate[idx, 0].sum(1)) / tokens)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(ratios, [alpha, 1 - alpha], method="inverted_cdf")  # no interpolation across inf
    return float(low), float(high)


def is_gated(metric: MetricId, policy: GateConfig) -> bool:
    """A task's standard metric or a perplexity set, named by ``gate.tasks``/``gate.perplexity`` (None: all)."""
    names = policy.perplexity if metric.kind == PERPLEXITY else policy.tasks
    return metric.standard and (names is None or metric.source in names)


def metric_rows(cfg: ExperimentConfig, results: dict[str, Measured], labels: list[str],
                baseline: str = "baseline") -> list[MetricRow]:
    """One row per candidate in ``labels`` x metric it measured, with the paired bootstrap interval of the
    relative score against ``results[baseline]`` (the same samples, in the same order); gated as ``cfg.gate``
    says."""
    gate, base = cfg.gate, results[baseline]
    rows = []
    for label in labels:
        for outcomes in results[label].outcomes:
            ref = base[outcomes.metric]
            low, high = bootstrap_interval(outcomes.metric.kind, ref.samples(), outcomes.samples(), gate.bootstrap,
                                           gate.confidence, cfg.eval.seed)
            rows.append(MetricRow(label, outcomes.metric, outcomes.value, ref.value, ref.n,
                                  is_gated(outcomes.metric, gate), low, high))
    return rows
