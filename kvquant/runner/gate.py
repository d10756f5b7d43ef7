"""The accuracy gate: pure functions over result tables (no model, no files). See ``docs/gate.md``.

Each gated metric gets one of three verdicts from a paired test of non-inferiority. Its statistic: the relative
score (candidate / baseline accuracy, baseline / candidate perplexity: higher is better, 1.0 is no loss), or the
value itself for the divergence metrics (mean KL divergence from the baseline, lower is better; top-1 agreement,
higher is better). The paired interval of the statistic (for 0/1 accuracies a score interval of the ratio of paired
proportions, :func:`kvquant.runner.paired.paired_ratio_bounds`; otherwise a paired studentized bootstrap,
:mod:`kvquant.runner.bootstrap`, documents or windows resampled with the baseline's and the candidate's outcome of
each kept together) is compared with the threshold:

- **pass**: the whole interval is on the good side (the candidate is shown to lose no more than the margin);
- **fail**: the whole interval is on the bad side (shown to lose more);
- **inconclusive**: it straddles the threshold; the verdict says about how many documents would decide it;
- **too few documents**: a bootstrap interval (a perplexity set's windows, a position bucket's documents) over fewer
  than its end needs to hold its error (:mod:`kvquant.runner.counts`, from a simulation): never a pass or a fail;
  for the decision, as inconclusive.

A gated metric whose requests read less than ``gate.min_quantized_share`` of their keys or values quantized is
**not exercised** (the accuracy says nothing about the quantizer) and cannot count toward a pass. With sequential
documents (``gate.max_documents``), a task is looked at after ``limit``, ``2 limit``, ... documents; each look's
interval is widened so that all looks together keep the chance of a wrong pass at ``(1 - confidence) / 2``
(Bonferroni alpha-spending over the planned looks: valid whatever is decided at each look; tested by
simulation). ``decide_on: point`` compares the point estimate alone: not a test; its verdicts say so.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from kvquant.experiment.config import ExperimentConfig
from kvquant.experiment.gate_config import GateConfig, look_confidence
from kvquant.experiment.long_config import needle_task
from kvquant.experiment.metric import ACCURACY, LOG_RATIO, MEAN, METRICS, SCORE_RATIO, SHARE, PERPLEXITY, Metric
from kvquant.experiment.results import (Decision, Measured, MetricId, MetricRow, Outcomes, Verdict, BUCKET,
    bucket_end, relative_score)
from kvquant.runner.bootstrap import log_ratio_interval, mean_interval, share_interval
from kvquant.runner.counts import TOO_FEW, settled_verdict, too_few
from kvquant.runner.derived import DERIVE
from kvquant.runner.lengths import LengthVerdict, _length, longest_passing
from kvquant.runner.paired import paired_ratio_bounds, paired_table, projected_documents
from kvquant.scoring.needles import needle_chance

__all__ = ["ACCURACY", "FAIL", "INCONCLUSIVE", "NOT_EXERCISED", "NOT_GATED", "PASS", "PERPLEXITY", "TOO_FEW",
           "Decision", "LengthVerdict", "MetricRow", "Verdict", "paired_interval", "decide", "is_gated", "judge",
           "longest_passing", "metric_rows", "quantile_interval", "relative_score"]

PASS, FAIL, INCONCLUSIVE, NOT_EXERCISED, NOT_GATED = "pass", "fail", "inconclusive", "not exercised", "not gated"

#: Paired-bootstrap resamples behind the interval of a ratio of scores that are not 0/1.
RATIO_RESAMPLES = 2_000
def ratio_interval(baseline: np.ndarray, candidate: np.ndarray, confidence: float,
                   seed: int = 0) -> tuple[float, float]:
    """Interval of the ratio of paired accuracies ``mean(candidate) / mean(baseline)`` over per-document scores
    ``[n]`` of both: 0/1 outcomes by :func:`paired_ratio_bounds` on their four paired counts; other scores by a
    paired bootstrap of the documents (:data:`RATIO_RESAMPLES`, seeded)."""
    b, c = np.asarray(baseline, dtype=float), np.asarray(candidate, dtype=float)
    n = len(b)
    if n < 2 or len(c) != n:
        return math.nan, math.nan
    table = paired_table(b, c)
    if table is not None:
        low, high = paired_ratio_bounds(*table, confidence)
        return float(low), float(high)
    idx = np.random.default_rng(seed).integers(0, n, size=(RATIO_RESAMPLES, n))
    sb, sc = b[idx].sum(1), c[idx].sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(sb == 0, np.where(sc == 0, 1.0, np.inf), sc / sb)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(ratios, [alpha, 1 - alpha], method="inverted_cdf")
    return float(low), float(high)


def paired_interval(
    kind: Metric | str, baseline: np.ndarray | None, candidate: np.ndarray, iters: int, confidence: float, seed: int
) -> tuple[float, float]:
    """The paired interval of a metric's statistic at ``confidence`` (two-sided), by the kind's
    :attr:`~kvquant.experiment.metric.Metric.interval`.

    score ratio (accuracy): ``baseline``/``candidate`` are per-document scores ``[n]`` (:func:`ratio_interval`). The
    others by a paired studentized bootstrap over windows (:func:`kvquant.runner.bootstrap.bootstrap_t`, ``iters``
    resamples; at least 2 windows): log ratio (perplexity) from per-window ``[n, 2]`` rows of (summed NLL, tokens) of
    both (the interval of the log of the ratio, ``sum(baseline NLL - candidate NLL) / sum(baseline tokens)``,
    exponentiated); mean (divergence, agreement) from the candidate's per-window ``[n, 2]`` rows of (sum, positions)
    (``baseline`` unused).
    """
    method = Metric.of(kind).interval
    return _INTERVALS[method](None if baseline is None else np.asarray(baseline, dtype=float),
                              np.asarray(candidate, dtype=float), iters, confidence, seed)


def _score_ratio_interval(baseline, candidate, iters, confidence, seed) -> tuple[float, float]:
    return ratio_interval(baseline, candidate, confidence, seed)


#: The paired interval of each method a metric kind names (the flip rate's exact interval is
#: :func:`kvquant.runner.derived.flip_row`'s).
_INTERVALS = {SCORE_RATIO: _score_ratio_interval, LOG_RATIO: log_ratio_interval, MEAN: mean_interval,
              SHARE: share_interval}


def quantile_interval(windows: tuple[tuple[float, ...], ...], q: float, iters: int, confidence: float,
                      seed: int) -> tuple[float, float]:
    """Bootstrap interval of the ``q``-quantile of per-position values (KL divergence), resampling windows."""
    if not windows:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    arrays = [np.asarray(w, dtype=float) for w in windows]
    stats = np.array([np.quantile(np.concatenate([arrays[i] for i in rng.integers(0, len(arrays), len(arrays))]), q)
                      for _ in range(min(iters, QUANTILE_RESAMPLES))])
    alpha = (1 - confidence) / 2
    low, high = np.quantile(stats, [alpha, 1 - alpha], method="inverted_cdf")
    return float(low), float(high)


#: Resamples for a quantile's interval (each sorts every position: fewer than a mean's).
QUANTILE_RESAMPLES = 200


def more_documents(row: MetricRow, limit: float) -> int | None:
    """About how many more documents (windows) would decide an inconclusive row, were the estimate to stay (None
    when it sits on the threshold). A ratio of 0/1 scores with its paired counts (:attr:`MetricRow.paired`): by
    :func:`projected_documents`. Otherwise an interval narrows as ``1 / sqrt(n)``, so it clears ``limit`` once its
    reach toward the limit is below the distance of the estimate from it (for paired 0/1 scores that rule
    is off: where few documents flip the score interval narrows faster than ``1 / sqrt(n)``, so it overstates)."""
    if row.paired is not None and 0 < row.confidence < 1:
        total = projected_documents(row.paired, row.confidence, limit)
        return None if total is None else max(total - row.n, 1)
    distance = abs(row.statistic - limit)
    half = row.ci_high - row.statistic if row.statistic < limit else row.statistic - row.ci_low  # toward the limit
    if not (distance > 0 and math.isfinite(half)):
        return None
    return max(math.ceil(row.n * (half / distance) ** 2) - row.n, 1)


def judge(row: MetricRow, policy: GateConfig, counted: bool = True) -> Verdict:
    """The verdict on one row (see the module docstring); ``counted=False``: not held to the counts of
    :mod:`kvquant.runner.counts` (for an interval of another method, whose counts differ)."""
    limit = row.kind.threshold(policy)
    point = policy.decide_on == "point"
    if not row.gated or math.isnan(limit):
        return Verdict(row, limit, row.statistic, NOT_GATED)
    good = (lambda x: x <= limit) if row.kind.lower_is_better else (lambda x: x >= limit)
    near, far = (row.ci_high, row.ci_low) if row.kind.lower_is_better else (row.ci_low, row.ci_high)
    if point:
        verdict = Verdict(row, limit, row.statistic, PASS if good(row.statistic) else FAIL, point=True)
    elif math.isnan(near) or math.isnan(far):
        verdict = Verdict(row, limit, row.statistic, INCONCLUSIVE)
    elif good(near):
        verdict = Verdict(row, limit, row.statistic, PASS)
    elif not good(far):
        verdict = Verdict(row, limit, row.statistic, FAIL)
    else:
        verdict = Verdict(row, limit, row.statistic, INCONCLUSIVE, more=more_documents(row, limit))
    # over too few windows or documents for the end a verdict reads (fewer than the smallest count: for any
    # verdict): no decision
    settled, need = settled_verdict(row.kind, verdict.verdict, row.n) if counted else (None, None)
    if settled == TOO_FEW:
        verdict = Verdict(row, limit, row.statistic, TOO_FEW, point=point, more=need - row.n)
    # a loss shown through a mostly unquantized cache is still a loss; only a pass (or the hope of one) needs the
    # quantizer to have been read
    exercised = math.isnan(row.quantized_share) or row.quantized_share >= policy.min_quantized_share
    if verdict.verdict != FAIL and not exercised:
        return Verdict(row, limit, row.statistic, NOT_EXERCISED, point=point)
    return verdict


def with_more_seconds(v: Verdict, pace: dict[tuple[str, str], float]) -> Verdict:
    """``v`` with the time its ``more`` documents would take at ``pace`` (where it is known)."""
    per_document = pace.get((v.row.candidate, v.row.metric.source))
    if v.more is None or per_document is None:
        return v
    return dataclasses.replace(v, more_seconds=v.more * per_document)


def with_documents_left(v: Verdict, sizes: dict[str, int]) -> Verdict:
    """``v`` with the documents its task holds beyond those scored (``sizes``: documents per task, where known;
    a task's rows only: a perplexity set's windows are not its documents, whatever its name)."""
    size = sizes.get(v.row.metric.source) if v.row.kind.on_tasks else None
    if v.more is None or size is None:
        return v
    return dataclasses.replace(v, left=max(size - v.row.n, 0))


def status(verdicts: list[Verdict]) -> str:
    """A candidate's verdict from its rows': fail if any fails, else inconclusive if any is inconclusive or has too
    few documents (a row that cannot be decided is as open as one that straddles), else not exercised if any is,
    else pass."""
    found = {INCONCLUSIVE if v.verdict == TOO_FEW else v.verdict for v in verdicts}
    return next((s for s in (FAIL, INCONCLUSIVE, NOT_EXERCISED) if s in found), PASS)


def verdict_text(v: Verdict) -> str:
    """A verdict as a report writes it: ``too few documents (n = 3 of the 20 needed)``, else the verdict."""
    return too_few(v.row.n, v.row.n + v.more) if v.verdict == TOO_FEW and v.more else v.verdict


def duration(seconds: float) -> str:
    """A time as a person reads it: seconds, minutes or hours."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _open(v: Verdict) -> str:
    more = f", ~{v.more} more documents would decide it" if v.more else ""
    if v.more and v.more_seconds is not None:
        more += f" (~{duration(v.more_seconds)} at this run's pace)"
    if v.beyond_task:
        more += f", more than the {v.left:,} the task has left"
    if v.verdict == NOT_EXERCISED:
        return (f"{v.row.metric.name} not exercised ({v.row.quantized_share:.0%} of what attention read was "
                "quantized)")
    if v.verdict == TOO_FEW:
        return (f"{v.row.metric.name} {v.row.ci_low:.4f}..{v.row.ci_high:.4f} vs {v.threshold:.4f}: "
                f"{verdict_text(v)}, counted as inconclusive")
    # the note first: a row that takes no more looks says so before what more documents would do
    note = f" ({v.note})" if v.note else ""
    return f"{v.row.metric.name} {v.row.ci_low:.4f}..{v.row.ci_high:.4f} straddles {v.threshold:.4f}{note}{more}"


def length_failures(rows: Sequence[MetricRow], policy: GateConfig,
                    at_chance: frozenset[str] = frozenset()) -> dict[str, int]:
    """Per candidate, the shortest context at which a long-context metric is shown to fail (judged as the length
    verdict judges it, :func:`length_verdicts`), where ``gate.min_context`` is unset: a loss shown at a length is a
    loss, so it stands against a pass whatever length it is at. With ``gate.min_context``, the lengths up to it are
    gated rows already, and a failure beyond it bounds the context a deployment may serve (DEPLOY.md), not the
    decision."""
    if policy.min_context is not None:
        return {}
    out: dict[str, int] = {}
    for row in rows:
        length = metric_length(row.metric)
        if length is None or row.gated or row.metric.source in at_chance or not is_gated_metric(row.metric, policy):
            continue
        if judge(dataclasses.replace(row, gated=True), policy).verdict == FAIL:
            out[row.candidate] = min(length, out.get(row.candidate, length))
    return out


def decide(rows: list[MetricRow], bits_per_element: dict[str, float], policy: GateConfig,
           pace: dict[tuple[str, str], float] | None = None, sizes: dict[str, int] | None = None,
           at_chance: frozenset[str] = frozenset(), counted: bool = True, annotate=None) -> Decision:
    """Judge every row; per candidate a status (:func:`status`), a fail also where a long context is shown to fail
    (:func:`length_failures`; ``at_chance``: the needle tasks :func:`needles_at_chance` leaves out); the cheapest
    passing candidate is the answer, else "fail" when every candidate fails, else "inconclusive", naming what would
    decide it. ``pace``: seconds per document of a (candidate, task) as this run scored them, baseline included, to
    state the time more documents would take; ``sizes``: documents per task, to state where more would be needed
    than it holds; ``counted=False``: rows not held to the counts (a search's check of a map on its calibration
    windows, which picks a map and decides nothing); ``annotate(verdicts, statuses)``: the verdicts with what the
    caller adds to their notes, before the reason quotes them (the rows that take no more looks,
    :func:`kvquant.runner.judging.halt_notes`; a render's looks not stored)."""
    verdicts = [with_documents_left(with_more_seconds(judge(r, policy, counted), pace or {}), sizes or {})
                for r in rows]
    gated = {v.row.candidate for v in verdicts if v.verdict != NOT_GATED}
    too_long = length_failures(rows, policy, at_chance)
    # a candidate with no gated row left (a needle the baseline cannot do is left out) is shown nothing
    statuses = {name: FAIL if name in too_long else status([v for v in verdicts if v.row.candidate == name])
                if name in gated else INCONCLUSIVE for name in bits_per_element}
    verdicts = annotate(verdicts, statuses) if annotate else verdicts
    passed = {name: s == PASS for name, s in statuses.items()}
    winners = sorted((bits_per_element[n], n) for n, ok in passed.items() if ok)
    basis = "point estimate, not a test" if policy.decide_on == "point" else \
        f"paired {policy.confidence:.0%} intervals"
    if winners:
        chosen = winners[0][1]
        cheaper = [n for n, s in statuses.items() if s != FAIL and bits_per_element[n] < winners[0][0]]
        also = f"; cheaper and undecided: {', '.join(cheaper)}" if cheaper else ""
        reason = (f"{chosen} is the cheapest setting ({winners[0][0]:.2f} bits/element) whose every gated metric "
                  f"passes ({basis}){also}")
        return Decision(PASS, chosen, passed, verdicts, reason, statuses)
    if all(s == FAIL for s in statuses.values()):
        failing = [f"{v.row.candidate}: {v.row.metric.name} {v.statistic:.4f} (interval {v.row.ci_low:.4f}.."
                   f"{v.row.ci_high:.4f}) vs {v.threshold:.4f}" for v in verdicts if v.verdict == FAIL]
        failing += [f"{name}: fails from {_length(length)} tokens of context (its length verdict)"
                    for name, length in too_long.items()]
        return Decision(FAIL, None, passed, verdicts, f"no setting passes ({basis}); " + "; ".join(failing),
                        statuses)
    undecided = [f"{v.row.candidate}: {_open(v)}" for v in verdicts
                 if v.verdict in (INCONCLUSIVE, TOO_FEW, NOT_EXERCISED) and statuses[v.row.candidate] != FAIL]
    undecided += [f"{name}: no gated metric was left to judge (a needle task whose baseline is not shown above "
                  "chance is left out)" for name in bits_per_element if name not in gated]
    return Decision(INCONCLUSIVE, None, passed, verdicts, f"no setting is shown to pass ({basis}); undecided: "
                    + "; ".join(undecided), statuses)


def metric_length(metric: MetricId) -> int | None:
    """The context length a long-context metric stands for: a position bucket's end (``kl/wikitext2@4096``) or a
    needle task's length (``acc/needle_single_4096``, and its flips); None for any other metric."""
    end = bucket_end(metric)
    if end is not None or not metric.kind.on_tasks:
        return end
    found = needle_task(metric.source)
    return found[1] if found else None


def is_gated(metric: MetricId, policy: GateConfig) -> bool:
    """A task's standard metric or a perplexity set's metrics, named by ``gate.tasks``/``gate.perplexity`` (None:
    all); divergence metrics only where the gate sets their threshold. A long-context metric (a position bucket,
    a needle task) only at a length up to ``gate.min_context`` (none without it): longer ones are reported, and
    judged for the longest context that passes."""
    length = metric_length(metric)
    return is_gated_metric(metric, policy) and (length is None or (policy.min_context is not None
                                                            and length <= policy.min_context))


def is_gated_metric(metric: MetricId, policy: GateConfig) -> bool:
    """Whether the gate judges ``metric`` at any length: a standard metric with a threshold, among
    ``gate.tasks``/``gate.perplexity`` (None: all; every position bucket of the long documents)."""
    names = policy.tasks if metric.kind.on_tasks else policy.perplexity
    listed = names is None or metric.source in names or bucket_end(metric) is not None
    return metric.standard and listed and not math.isnan(metric.kind.threshold(policy))


def length_verdicts(rows: Sequence[MetricRow], policy: GateConfig,
                    at_chance: frozenset[str] = frozenset()) -> dict[str, LengthVerdict]:
    """Per candidate with long-context metrics, the longest context they show it safe at (:func:`longest_passing`):
    every :func:`is_gated_metric` long-context row judged as if gated (also beyond ``gate.min_context``), grouped by its
    length; the needle tasks of ``at_chance`` (:func:`needles_at_chance`) are left out (they say nothing of a
    cache)."""
    buckets: dict[str, dict[int, dict[str, str]]] = {}
    short: dict[str, tuple[int, int]] = {}  # per candidate, the fewest documents of a too-few row, and its need
    for row in rows:
        length = metric_length(row.metric)
        if length is None or not is_gated_metric(row.metric, policy) or row.metric.source in at_chance:
            continue
        v = judge(dataclasses.replace(row, gated=True), policy)
        family = f"{row.metric.measure}/{row.metric.source.rpartition(BUCKET)[0] or row.metric.source}"
        buckets.setdefault(row.candidate, {}).setdefault(length, {})[family] = v.verdict
        if v.verdict == TOO_FEW:
            short[row.candidate] = min(short.get(row.candidate, (row.n, row.n + v.more)), (row.n, row.n + v.more))
    return {label: dataclasses.replace(longest_passing(sorted(found.items())), shortfall=short.get(label))
            for label, found in buckets.items()}


def needles_at_chance(baseline: Measured, policy: GateConfig) -> frozenset[str]:
    """The needle tasks whose baseline accuracy (every document it scored) is not shown above chance: one-sided
    exact binomial test at half of ``1 - gate.confidence``, decided once per task for every candidate."""
    return frozenset(o.metric.source for o in baseline.outcomes
                     if o.metric.kind is ACCURACY and o.metric.standard and needle_task(o.metric.source)
                     and not above_chance(round(sum(o.scores)), o.n, needle_chance(o.metric.source),
                                          policy.confidence))


def above_chance(right: int, n: int, chance: float, confidence: float) -> bool:
    """Whether ``right`` of ``n`` right answers show an accuracy above ``chance``: the one-sided exact binomial
    test at half of ``1 - confidence`` (the error a gated interval allows on one side)."""
    from scipy.stats import binom

    return n > 0 and float(binom.sf(right - 1, n, chance)) < (1 - confidence) / 2


def metric_rows(cfg: ExperimentConfig, results: dict[str, Measured], labels: list[str],
                baseline: str = "baseline", planned_looks: dict[str, int] | None = None) -> list[MetricRow]:
    """One row per candidate in ``labels`` x metric it measured, with the paired bootstrap interval of its
    statistic against ``results[baseline]`` (the same samples, in the same order), gated as ``cfg.gate`` says;
    ``planned_looks``: per task, the looks a sequential gate plans (its intervals are widened for them)."""
    gate, base = cfg.gate, results[baseline]
    planned_looks = planned_looks or {}
    at_chance = needles_at_chance(base, gate)
    rows = []
    for label in labels:
        for outcomes in results[label].outcomes:
            metric = outcomes.metric
            kind = metric.kind
            ref = None if kind.reference is not None else base[metric]
            if ref is not None and kind.on_tasks:
                ref = ref.first(outcomes.n)  # the baseline may have scored more documents (sequential looks)
            confidence = look_confidence(gate, planned_looks.get(metric.source, 1) if kind.on_tasks else 1)
            low, high = paired_interval(kind, None if ref is None else ref.samples(), outcomes.samples(),
                                           gate.bootstrap, confidence, cfg.eval.seed)
            reference = kind.reference if ref is None else ref.value
            share = outcomes.exercise.quantized_share if outcomes.exercise else math.nan
            gated = is_gated(metric, gate)
            table = paired_table(ref.samples(), outcomes.samples()) \
                if ref is not None and kind.interval == SCORE_RATIO else None
            row = MetricRow(label, metric, outcomes.value, reference, outcomes.n, gated, low, high, share, confidence,
                            table)
            if gated and metric.source in at_chance:
                row = dataclasses.replace(row, gated=False)  # the baseline cannot do it here: says nothing of a cache
            rows += [row, *derived_rows(row, ref, outcomes, cfg, at_chance)]
    return rows


def derived_rows(row: MetricRow, baseline: Outcomes | None, outcomes: Outcomes, cfg: ExperimentConfig,
                 at_chance: frozenset[str]) -> list[MetricRow]:
    """The rows of the kinds derived from ``row``'s kind (:attr:`~kvquant.experiment.metric.Metric.derived_from`),
    from its outcomes (``baseline``: the baseline's, where paired) by :data:`kvquant.runner.derived.DERIVE`: each
    where the gate gates it (its threshold set, its source gated), from the source's standard metric, not on a
    needle task the baseline cannot do."""
    return [derived for kind in METRICS
            if kind.derived_from is row.kind and row.metric.standard and row.metric.source not in at_chance
            and is_gated(MetricId(kind.measures[0], row.metric.source), cfg.gate)
            for derived in DERIVE[kind](row, baseline, outcomes, cfg, paired_interval)]
