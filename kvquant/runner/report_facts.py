"""What a report states of a run beyond :class:`~kvquant.experiment.results.RunResult`'s own fields, computed once and
typed,
so that ``results.json``, ``report.md`` and the plots read the same objects: per candidate its memory, verdict and
metrics (each with its gate verdict, outcomes, request lengths and, for a divergence metric, the KL quantiles), and
per stage of a staged run its serving figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvquant.experiment.metric import ACCURACY
from kvquant.runner.flips import Flips, flips
from kvquant.runner.gate import quantile_interval
from kvquant.experiment.results import Memory, MetricId, MetricRow, Outcomes, RunResult, Verdict
from kvquant.scoring.tasks import probe_distance

#: The KL divergence quantiles a divergence metric reports, by name.
QUANTILES = (("median", 0.5), ("p99", 0.99))


@dataclass(frozen=True)
class Quantile:
    """A quantile of the per-position values (KL divergence) and its bootstrap interval over windows."""

    value: float
    low: float
    high: float


@dataclass(frozen=True)
class MetricReport:
    """One candidate x metric as reported: the gate's verdict (and through it the row), the candidate's outcomes,
    the baseline's (where its kind is paired with the baseline's outcomes over windows, perplexity: its summed NLL
    and tokens are reported), for a metric with per-position values (KL divergence over windows) the
    quantiles of :data:`QUANTILES` by name, and for an accuracy metric of right-or-wrong documents its
    :class:`~kvquant.runner.flips.Flips` against the baseline."""

    verdict: Verdict
    outcomes: Outcomes
    baseline: Outcomes | None = None
    quantiles: tuple[tuple[str, Quantile], ...] = ()
    flips: Flips | None = None

    @property
    def row(self):
        return self.verdict.row

    def length(self, q: float) -> float:
        """The ``q``-quantile of the scored requests' lengths (nan where what attention read was not counted)."""
        exercise = self.outcomes.exercise
        return exercise.length_quantile(q) if exercise is not None else math.nan

    @property
    def bits_at_median(self) -> float:
        """The cache's bits per element at the median request length (nan where not counted)."""
        exercise = self.outcomes.exercise
        return exercise.bits_per_element if exercise is not None else math.nan


@dataclass(frozen=True)
class CandidateReport:
    """One candidate as reported: its label, memory, whether it passed, its status (pass, fail, inconclusive, not
    exercised) and its metrics by name, in the gate's order."""

    label: str
    memory: Memory
    passed: bool
    status: str
    metrics: dict[str, MetricReport]

    def metric(self, metric: MetricId) -> MetricReport | None:
        return self.metrics.get(metric.name)

    def gated_metrics(self) -> list[MetricReport]:
        return [m for m in self.metrics.values() if m.row.gated]


def _quantiles(outcomes: Outcomes, run: RunResult) -> tuple[tuple[str, Quantile], ...]:
    """The KL quantiles of a divergence metric's per-position values, with bootstrap intervals over windows."""
    cfg = run.config
    out = []
    for name, q in QUANTILES:
        low, high = quantile_interval(outcomes.per_token, q, cfg.gate.bootstrap, cfg.gate.confidence, cfg.eval.seed)
        out.append((name, Quantile(float(np.quantile(np.concatenate(outcomes.per_token), q)), low, high)))
    return tuple(out)


def metric_report(verdict: Verdict, run: RunResult) -> MetricReport:
    row = verdict.row
    derived = row.kind.derived_from is not None
    outcomes = _source_outcomes(run, row) if derived else run.results[row.candidate][row.metric]
    paired = row.kind.windowed and row.kind.reference is None
    baseline = run.results["baseline"][row.metric] if paired else None
    quantiles = _quantiles(outcomes, run) if outcomes.per_token and not derived else ()
    return MetricReport(verdict, outcomes, baseline, quantiles, _flips(row, run))


def _source_outcomes(run: RunResult, row: MetricRow) -> Outcomes:
    """The outcomes a derived row was derived from (a flip rate: its task's standard, gated, accuracy)."""
    return next(o for o in run.results[row.candidate].outcomes if o.metric.kind is row.kind.derived_from
                and o.metric.source == row.metric.source and o.metric.standard)


def _flips(row: MetricRow, run: RunResult) -> Flips | None:
    """The documents whose correctness the candidate changed, for an accuracy metric scored right or wrong per
    document (None for others)."""
    if row.kind is not ACCURACY:
        return None
    base = run.results["baseline"][row.metric].scores
    own = run.results[row.candidate][row.metric].scores
    if not all(s in (0, 1) for s in (*base, *own)):
        return None
    return flips(base, own, run.config.gate.confidence)


def candidate_reports(run: RunResult) -> tuple[CandidateReport, ...]:
    """Every evaluated candidate, in the report's order, with its metrics (one per metric name)."""
    out = []
    for candidate in run.candidates:
        label = candidate.label
        verdicts = {v.row.metric.name: v for v in run.decision.verdicts if v.row.candidate == label}
        out.append(CandidateReport(label, run.results[label].memory, run.decision.passed[label],
                                   run.decision.statuses[label],
                                   {name: metric_report(v, run) for name, v in verdicts.items()}))
    return tuple(out)


@dataclass(frozen=True)
class StageRow:
    """One stage of a staged run (or the baseline) as reported: KV bytes per request, the requests whose KV fits
    the budget, decode latency (ms), the lowest gated relative score, whether it passed and shares the prefix."""

    name: str
    bytes: float
    max_batch: int
    p50: float
    p99: float
    worst: float
    passed: bool
    sharing: bool


def stage_rows(run: RunResult, candidates: tuple[CandidateReport, ...]) -> list[StageRow]:
    """Per stage (the baseline first): serving figures, the lowest gated relative score, pass/fail."""
    staged = run.staged
    by_label = {c.label: c for c in candidates}
    out = []
    for name in ["baseline", *staged.stages]:
        serving = staged.serving[name]
        c = by_label.get(name)
        gated = [m.row.relative for m in c.gated_metrics()] if c else [1.0]
        out.append(StageRow(name, serving.kv_bytes_per_request, serving.max_batch(staged.budget_bytes),
                            serving.p50_ms, serving.p99_ms, min(gated), c.passed if c else True,
                            staged.prefix_sharing.get(name, False)))
    return out


def probe_curve(rows: tuple[MetricRow, ...] | list[MetricRow]) -> dict[str, dict[int, tuple[float, int]]]:
    """``{candidate or "baseline": {distance: (acc, n)}}`` of the long-range probe tasks (``passkey_<D>``)."""
    curve: dict[str, dict[int, tuple[float, int]]] = {}
    for row in rows:
        distance = probe_distance(row.metric.source)
        if row.metric.kind is ACCURACY and row.metric.standard and distance is not None:
            curve.setdefault("baseline", {})[distance] = (row.baseline, row.n)
            curve.setdefault(row.candidate, {})[distance] = (row.value, row.n)
    return curve
