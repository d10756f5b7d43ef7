"""The accuracy gate: pure functions over result tables (no model, no files).

Relative score per metric: candidate / baseline for accuracy, baseline / candidate for perplexity, so higher
is better for both and 1.0 means "no loss". A candidate passes when every gated metric meets its threshold
(``min_relative_accuracy``; ``1 / max_perplexity_ratio`` for perplexity), judged on the point estimate or on
the lower end of a paired bootstrap interval. Among passing candidates, the cheapest (fewest bits per
element) is chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .config import ExperimentConfig, GateConfig
from .tasks import gated_metric

ACCURACY, PERPLEXITY = "accuracy", "perplexity"


@dataclass(frozen=True)
class MetricRow:
    candidate: str
    metric: str
    kind: str  # ACCURACY or PERPLEXITY
    value: float
    baseline: float
    n: int
    gated: bool = True
    ci_low: float = math.nan
    ci_high: float = math.nan

    @property
    def relative(self) -> float:
        return relative_score(self.kind, self.value, self.baseline)


@dataclass(frozen=True)
class Verdict:
    row: MetricRow
    threshold: float
    statistic: float  # what was compared with the threshold
    passed: bool


@dataclass(frozen=True)
class Decision:
    decision: str  # "pass" or "fail"
    chosen: str | None  # cheapest passing candidate
    passed: dict[str, bool]
    verdicts: list[Verdict]
    reason: str


def relative_score(kind: str, value: float, baseline: float) -> float:
    """candidate/baseline for accuracy, baseline/candidate for perplexity (1.0 = no loss)."""
    num, den = (value, baseline) if kind == ACCURACY else (baseline, value)
    if den == 0:
        return 1.0 if num == 0 else math.inf
    return num / den


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
    failing = [f"{v.row.candidate}: {v.row.metric} {v.statistic:.4f} < {v.threshold:.4f}"
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


def metric_rows(cfg: ExperimentConfig, results: dict, labels: list[str], baseline: str = "baseline") -> list[MetricRow]:
    """One row per candidate in ``labels`` x metric of ``results`` (``{label: {metric: result}}``, as
    :func:`kvquant.measure.measure` returns), with paired bootstrap intervals of the relative score against
    ``results[baseline]``; gated as ``cfg.gate`` says."""
    gate = cfg.gate
    rows = []
    base = results[baseline]
    for label in labels:
        for metric, res in results[label].items():
            ref = base[metric]
            if metric.startswith("ppl/"):
                name = metric[4:]
                b, c = np.column_stack([ref["nll"], ref["tokens"]]), np.column_stack([res["nll"], res["tokens"]])
                entries = [(metric, PERPLEXITY, float(np.exp(c[:, 0].sum() / c[:, 1].sum())),
                            float(np.exp(b[:, 0].sum() / b[:, 1].sum())), len(b), b, c,
                            gate.perplexity is None or name in gate.perplexity)]
            else:
                name = metric[5:]
                entries = [(f"{m}/{name}", ACCURACY, float(np.mean(res[m])), float(np.mean(ref[m])), len(ref[m]),
                            np.array(ref[m]), np.array(res[m]),
                            m == gated_metric(name) and (gate.tasks is None or name in gate.tasks))
                           for m in ("acc", "acc_norm") if m in res]
            for metric_name, kind, value, baseline_value, n, b, c, gated in entries:
                low, high = bootstrap_interval(kind, b, c, gate.bootstrap, gate.confidence, cfg.eval.seed)
                rows.append(MetricRow(label, metric_name, kind, value, baseline_value, n, gated, low, high))
    return rows
