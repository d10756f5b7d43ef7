"""What a run measures and decides, as frozen dataclasses: the one vocabulary of measure, gate, search, stages
and report (no metric name is ever sliced apart).

- :class:`MetricId`: which metric (``ppl`` of a perplexity set, ``acc``/``acc_norm`` of a task) and whether it is
  the task's standard metric, the one a gate may gate;
- :class:`Outcomes`: its per-sample outcomes for one candidate (per document, or per window), in sample order,
  so candidate and baseline pair sample by sample;
- :class:`Memory`: the cache's settings and bytes, measured after the run's probe tokens and simulated at a long
  context;
- :class:`Measured`: one candidate's (or the baseline's) outcomes and memory;
- :class:`MetricRow`, :class:`Verdict`, :class:`Decision`: the gate's table, verdicts and decision.

The result store keeps raw JSON (``{"nll": [...], "tokens": [...]}`` per perplexity set, ``{"task": ..., "acc":
[...], "acc_norm": [...]}`` per task); :func:`perplexity_outcomes` and :func:`task_outcomes` read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

ACCURACY, PERPLEXITY = "accuracy", "perplexity"


@dataclass(frozen=True)
class MetricId:
    """``measure`` (``ppl``, ``acc`` or ``acc_norm``) of ``source`` (a perplexity set or a task name)."""

    measure: str
    source: str
    standard: bool = True  # the source's standard metric (perplexity: always; a task: acc_norm or acc)

    @property
    def kind(self) -> str:
        return PERPLEXITY if self.measure == "ppl" else ACCURACY

    @property
    def name(self) -> str:
        """How reports name it: ``ppl/wikitext2``, ``acc_norm/hellaswag``."""
        return f"{self.measure}/{self.source}"


@dataclass(frozen=True)
class Outcomes:
    """Per-sample outcomes of one metric: accuracy per document (``scores``, 0..1), or per window the summed
    negative log-likelihood (``scores``) and the tokens it predicted (``tokens``)."""

    metric: MetricId
    scores: tuple[float, ...]
    tokens: tuple[int, ...] = ()

    @property
    def n(self) -> int:
        return len(self.scores)

    @property
    def value(self) -> float:
        """Accuracy (the mean score), or perplexity ``exp(summed NLL / tokens)``."""
        if self.metric.kind == ACCURACY:
            return float(np.mean(self.scores))
        return float(np.exp(np.sum(self.scores) / np.sum(self.tokens)))

    def samples(self) -> np.ndarray:
        """What the paired bootstrap resamples: ``[n]`` scores, or ``[n, 2]`` rows of (summed NLL, tokens)."""
        if self.metric.kind == ACCURACY:
            return np.asarray(self.scores, dtype=float)
        return np.column_stack([np.asarray(self.scores, dtype=float), np.asarray(self.tokens, dtype=float)])


def perplexity_outcomes(name: str, raw: dict) -> Outcomes:
    """A perplexity set's stored result (``{"nll": [...], "tokens": [...]}``) as outcomes."""
    return Outcomes(MetricId("ppl", name), tuple(map(float, raw["nll"])), tuple(map(int, raw["tokens"])))


def task_outcomes(task: str, raw: dict, standard: str) -> list[Outcomes]:
    """A task's stored result (``{"acc": [...], "acc_norm": [...]}``, either may be absent) as outcomes;
    ``standard``: the measure gated for this task."""
    return [Outcomes(MetricId(m, task, m == standard), tuple(map(float, raw[m]))) for m in ("acc", "acc_norm")
            if m in raw]


@dataclass(frozen=True)
class Memory:
    """A cache's settings (options and what it derived, e.g. the groups used), ``memory_report()`` after the
    run's probe tokens (``measured``) and the same cache code on shape-only tensors at a long context
    (``long``)."""

    settings: dict
    measured: dict
    long: dict = field(default_factory=dict)

    @property
    def bits_per_element(self) -> float:
        return self.measured["bits_per_element"]


@dataclass(frozen=True)
class Measured:
    """What one candidate (or the baseline) measured: its outcomes per metric, in measuring order, and memory."""

    label: str
    outcomes: tuple[Outcomes, ...]
    memory: Memory | None = None

    def __getitem__(self, metric: MetricId) -> Outcomes:
        return next(o for o in self.outcomes if o.metric == metric)

    def perplexity(self) -> list[Outcomes]:
        return [o for o in self.outcomes if o.metric.kind == PERPLEXITY]


@dataclass(frozen=True)
class MetricRow:
    """One candidate x metric against the baseline; ``ci_low``/``ci_high``: the paired interval of the
    relative score."""

    candidate: str
    metric: MetricId
    value: float
    baseline: float
    n: int
    gated: bool = True
    ci_low: float = math.nan
    ci_high: float = math.nan

    @property
    def kind(self) -> str:
        return self.metric.kind

    @property
    def relative(self) -> float:
        return relative_score(self.kind, self.value, self.baseline)


def relative_score(kind: str, value: float, baseline: float) -> float:
    """candidate/baseline for accuracy, baseline/candidate for perplexity (1.0 = no loss)."""
    num, den = (value, baseline) if kind == ACCURACY else (baseline, value)
    if den == 0:
        return 1.0 if num == 0 else math.inf
    return num / den


@dataclass(frozen=True)
class Verdict:
    row: MetricRow
    threshold: float
    statistic: float  # what was compared with the threshold
    passed: bool


@dataclass(frozen=True)
class Decision:
    decision: str  # "pass" or "fail"
    chosen: str | None  # the answer: the cheapest passing candidate, or a staged run's last stage before a fail
    passed: dict[str, bool]
    verdicts: list[Verdict]
    reason: str


@dataclass(frozen=True)
class Provenance:
    """Where a run's results came from: ``computed`` in this run or ``reused`` from ``partial/``, the partial
    results ``set_aside`` as unreadable (and recomputed), and the run's warnings."""

    computed: int
    reused: int
    set_aside: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunResult:
    """Everything a report renders: the config as given (never rewritten), the candidates evaluated (the config's
    candidates, or its stages, and a search's map), what each measured, the gate's rows and decision, and what a
    search or a staged run adds (``search``: the map found and every step checked; ``staged``: the serving
    measurements and the stages' order)."""

    config: object  # the ExperimentConfig
    candidates: tuple  # Candidate or Stage, in the report's order
    results: dict[str, Measured]
    rows: tuple[MetricRow, ...]
    decision: Decision
    command: str
    provenance: Provenance
    search: dict | None = None
    staged: dict | None = None
