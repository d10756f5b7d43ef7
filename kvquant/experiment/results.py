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

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from kvquant.cache.reads import Reads
from kvquant.experiment.metric import (ACCURACY, AGREEMENT, DIVERGENCE, FLIPS, MEASURES, METRICS,  # noqa: F401
    PERPLEXITY, Metric)  # the kinds are also imported from here, where they were defined before

@dataclass(frozen=True)
class MetricId:
    """``measure`` (``ppl``, ``kl``, ``top1``, ``acc``, ``acc_norm`` or ``flips``: the measures of
    :data:`kvquant.experiment.metric.MEASURES`) of ``source`` (a perplexity set or a task name)."""

    measure: str
    source: str
    standard: bool = True  # the source's standard metric (perplexity sets: always; a task: acc_norm or acc)

    @property
    def kind(self) -> Metric:
        return MEASURES[self.measure]

    @property
    def name(self) -> str:
        """How reports name it: ``ppl/wikitext2``, ``acc_norm/hellaswag``."""
        return f"{self.measure}/{self.source}"

    @classmethod
    def parse(cls, name: str) -> MetricId:
        """The metric a report names ``name`` (:attr:`name`); a ValueError where its measure is unknown."""
        measure, sep, source = name.partition("/")
        if not sep or not source or measure not in MEASURES:
            raise ValueError(f"{name!r} is no metric name (<measure>/<source>, measures: {', '.join(MEASURES)})")
        return cls(measure, source)


@dataclass(frozen=True)
class Exercise:
    """How much a measurement exercised the cache: what attention read (:class:`kvquant.cache.reads.Reads`), the
    length of every scored request (context + continuation tokens; per window for a perplexity set), and the
    cache's bits per element at their median length."""

    reads: Reads
    lengths: tuple[int, ...]
    bits_per_element: float = math.nan

    @property
    def quantized_share(self) -> float:
        return self.reads.quantized_share

    def length_quantile(self, q: float) -> float:
        return float(np.quantile(self.lengths, q)) if self.lengths else math.nan

    def concat(self, other: Exercise) -> Exercise:
        lengths = self.lengths + other.lengths
        bits = self.bits_per_element if len(self.lengths) >= len(other.lengths) else other.bits_per_element
        return Exercise(self.reads.add(other.reads), lengths, bits)


@dataclass(frozen=True)
class Outcomes:
    """Per-sample outcomes of one metric: accuracy per document (``scores``, 0..1), or per window a sum
    (``scores``: negative log-likelihood, KL divergence, or positions whose top-1 token agrees) over the
    positions it predicted (``tokens``); ``per_token``: the KL divergence of every position, per window;
    ``exercise``: what attention read meanwhile."""

    metric: MetricId
    scores: tuple[float, ...]
    tokens: tuple[int, ...] = ()
    exercise: Exercise | None = None
    per_token: tuple[tuple[float, ...], ...] = ()

    @property
    def n(self) -> int:
        return len(self.scores)

    @property
    def value(self) -> float:
        """Accuracy (the mean score), perplexity ``exp(summed NLL / tokens)``, mean KL divergence per token, or
        the share of positions whose most likely token is the baseline's (:meth:`Metric.value`)."""
        return self.metric.kind.value(self.scores, self.tokens)

    def samples(self) -> np.ndarray:
        """What the paired bootstrap resamples: ``[n]`` scores, or ``[n, 2]`` rows of (sum, positions)."""
        return self.metric.kind.samples(self.scores, self.tokens)

    def first(self, n: int) -> Outcomes:
        """The outcomes of the first ``n`` samples (what a candidate scored of the documents the baseline did)."""
        if n >= self.n:
            return self
        return dataclasses.replace(self, scores=self.scores[:n], tokens=self.tokens[:n],
                                   per_token=self.per_token[:n])

    @staticmethod
    def concat(parts: list[Outcomes]) -> Outcomes:
        """These outcomes of one metric, one part after another (documents measured in stages)."""
        first = parts[0]
        exercise = first.exercise
        for part in parts[1:]:
            exercise = exercise.concat(part.exercise) if exercise and part.exercise else exercise or part.exercise
        return Outcomes(first.metric, sum((p.scores for p in parts), ()), sum((p.tokens for p in parts), ()),
                        exercise, sum((p.per_token for p in parts), ()))


def _exercise(raw: dict, bits: float) -> Exercise | None:
    if "reads" not in raw:
        return None
    return Exercise(Reads(**raw["reads"]), tuple(map(int, raw.get("lengths", ()))), bits)


def perplexity_outcomes(name: str, raw: dict, bits: float = math.nan) -> Outcomes:
    """A perplexity set's stored result (``{"nll": [...], "tokens": [...], "reads": {...}}``) as outcomes."""
    tokens = tuple(map(int, raw["tokens"]))
    return Outcomes(MetricId("ppl", name), tuple(map(float, raw["nll"])), tokens,
                    _exercise(raw, bits))


def divergence_outcomes(name: str, raw: dict, bits: float = math.nan) -> list[Outcomes]:
    """A perplexity set's stored divergence from the baseline (``{"kl": [[...] per window], "top1": [...],
    "tokens": [...]}``) as two metrics: ``kl`` (mean KL divergence per position) and ``top1`` (agreement)."""
    tokens = tuple(map(int, raw["tokens"]))
    per_token = tuple(tuple(map(float, w)) for w in raw["kl"])
    exercise = _exercise(raw, bits)
    return [Outcomes(MetricId("kl", name), tuple(float(sum(w)) for w in per_token), tokens, exercise, per_token),
            Outcomes(MetricId("top1", name), tuple(map(float, raw["top1"])), tokens, exercise)]


#: Between a long text's name and a position bucket's end in a metric's source: ``wikitext2@4096`` (no perplexity
#: set's name holds it).
BUCKET = "@"


def bucket_end(metric: MetricId) -> int | None:
    """The end of the position bucket a long-context divergence metric covers (``kl/wikitext2@4096``: 4096), else
    None."""
    name, sep, end = metric.source.rpartition(BUCKET)
    return int(end) if sep and metric.kind.bucketed else None


def long_outcomes(text: str, raw: dict, lengths: list[int], bits: float = math.nan) -> list[Outcomes]:
    """A candidate's stored divergence by position on long documents (``{"kl": [[...] per position] per document,
    "top1": [[0/1 ...]], "reads": ..., "lengths": ...}``, :func:`kvquant.scoring.longctx.position_divergences`) as
    per position bucket ``kl`` and ``top1`` metrics (bucket ``i``: positions ``lengths[i-1]..lengths[i] - 1``; per
    document the sum over its positions there and their count). A bucket past every document's end is left out."""
    out = []
    for start, stop in zip([0, *lengths[:-1]], lengths):
        tokens = tuple(len(d[start:stop]) for d in raw["kl"])
        if not any(tokens):
            continue
        exercise = _bucket_exercise(raw, start, stop, bits)
        for measure in (m.measures[0] for m in METRICS if m.bucketed):  # kl, top1
            sums = tuple(float(sum(d[start:stop])) for d in raw[measure])
            out.append(Outcomes(MetricId(measure, f"{text}{BUCKET}{stop}"), sums, tokens, exercise))
    return out


def _bucket_exercise(raw: dict, start: int, stop: int, bits: float) -> Exercise | None:
    """What attention read for the queries of positions ``start .. stop - 1``: the reads of every chunk of
    positions that overlaps them (``raw["chunk_reads"]``; a chunk across a bucket's edge counts in both), so a
    bucket inside a full-precision window shows it; the whole documents' reads where chunks were not kept."""
    if "chunk_reads" not in raw:
        return _exercise(raw, bits)
    reads = Reads()
    for first, last, counted in raw["chunk_reads"]:
        if first < stop and last > start:
            reads = reads.add(Reads(**counted))
    return Exercise(reads, tuple(map(int, raw.get("lengths", ()))), bits)


def task_outcomes(task: str, raw: dict, standard: str, bits: float = math.nan) -> list[Outcomes]:
    """A task's stored result (``{"acc": [...], "acc_norm": [...]}``, either may be absent, ``reads`` and
    ``lengths``) as outcomes; ``standard``: the measure gated for this task."""
    exercise = _exercise(raw, bits)
    return [Outcomes(MetricId(m, task, m == standard), tuple(map(float, raw[m])), (), exercise)
            for m in ACCURACY.measures if m in raw]


#: Tokens per sequence at which every cache's memory is also stated (the planner's arithmetic).
LONG_CONTEXT = 8192


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
        return [o for o in self.outcomes if o.metric.kind is PERPLEXITY]


@dataclass(frozen=True)
class MetricRow:
    """One candidate x metric against the baseline; ``ci_low``/``ci_high``: the paired interval of its
    :attr:`statistic` at ``confidence``; ``quantized_share``: of what attention read, the share stored quantized
    (keys or values, the smaller; nan where not counted); ``paired``: for a ratio of 0/1 scores, the documents both
    answered right, only the baseline, only the candidate and neither (None otherwise)."""

    candidate: str
    metric: MetricId
    value: float
    baseline: float
    n: int
    gated: bool = True
    ci_low: float = math.nan
    ci_high: float = math.nan
    quantized_share: float = math.nan
    confidence: float = math.nan
    paired: tuple[int, int, int, int] | None = None

    @property
    def kind(self) -> Metric:
        return self.metric.kind

    @property
    def relative(self) -> float:
        return self.kind.relative(self.value, self.baseline)

    @property
    def statistic(self) -> float:
        """What the gate compares with its threshold: the relative score, or the value of a metric compared by
        value (a divergence, agreement, a flip rate)."""
        return self.value if self.kind.by_value else self.relative


def relative_score(kind: Metric | str, value: float, baseline: float) -> float:
    """candidate/baseline for accuracy (and agreement), baseline/candidate for perplexity: 1.0 = no loss
    (:meth:`Metric.relative`; nan for a divergence or a flip rate: the baseline's against itself is 0)."""
    return Metric.of(kind).relative(value, baseline)


@dataclass(frozen=True)
class Verdict:
    """The gate's verdict on a row: ``pass``, ``fail``, ``inconclusive`` (``more``: about how many more documents
    would decide it; ``more_seconds``: how long they would take; ``left``: how many the task holds beyond those
    scored), ``not exercised`` or ``not gated``; ``point``: judged on the point estimate alone."""

    row: MetricRow
    threshold: float
    statistic: float  # what was compared with the threshold
    verdict: str
    more: int | None = None
    point: bool = False
    #: about how long ``more`` documents would take at the pace this run scored the row's task (baseline and
    #: candidate together); None where unknown
    more_seconds: float | None = None
    #: documents the row's task holds beyond the ``n`` scored (None where its size is unknown): ``more`` beyond
    #: them cannot be had from this task
    left: int | None = None
    #: what the report adds to the verdict: a report rendered from stored results names the look it lacks
    note: str | None = None

    @property
    def beyond_task(self) -> bool:
        """Whether more documents would decide it than the task has left."""
        return self.more is not None and self.left is not None and self.more > self.left

    @property
    def passed(self) -> bool | None:
        """Whether the row passes; None where it is not gated (reported only: neither passed nor failed)."""
        return None if self.verdict == "not gated" else self.verdict == "pass"


@dataclass(frozen=True)
class Decision:
    decision: str  # "pass", "fail" or "inconclusive"
    chosen: str | None  # the answer: the cheapest passing candidate, or a staged run's last stage before a fail
    passed: dict[str, bool]
    verdicts: list[Verdict]
    reason: str
    statuses: dict[str, str] = field(default_factory=dict)  # per candidate: pass, fail, inconclusive, not exercised


@dataclass(frozen=True)
class Provenance:
    """Where a run's results came from: ``computed`` in this run or ``reused`` from ``partial/``, the partial
    results ``set_aside`` as unreadable (and recomputed), the run's warnings, how many data-parallel
    ``processes`` ran it and its wall-clock ``seconds`` (model load to gate)."""

    computed: int
    reused: int
    set_aside: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    processes: int = 1
    seconds: float | None = None
    #: a report rendered from stored results (``--render-only``): the code that measured them and the code that
    #: judged them, where they were read and what was not there (:meth:`kvquant.runner.render.Replay.render_provenance`)
    rendered: dict | None = None


@dataclass(frozen=True)
class RunPlan:
    """A run's steps, decided by preflight before the model loads (:func:`.preflight.plan_steps`); the runner
    takes them in this order and the report lists them. ``candidates`` are the labels measured against the baseline
    on the evaluation split, in the report's order (the config's candidates or stages, then a searched map)."""

    candidates: tuple[str, ...]
    #: candidates whose per-layer options (static scales, a key offset, codebook levels) are observed on the
    #: calibration split first
    calibrate: tuple[str, ...] = ()
    #: the name under which a per-layer map, searched on the calibration split, joins the candidates
    search: str | None = None
    #: a staged run: each stage's serving figures are measured before the gate chooses among them
    staged: bool = False
    #: per gated task, the sequential looks planned (empty: each task's first ``limit`` documents only)
    looks: dict[str, int] = field(default_factory=dict)

    def steps(self) -> list[str]:
        """The steps in the order the runner takes them, as the report lists them."""
        looks = ", ".join(f"{task}: {n} looks" for task, n in self.looks.items())
        return [*(["calibrate per-layer options on the calibration split (or from the weights): " +
                   ", ".join(self.calibrate)] if self.calibrate else []),
                *([f"search a per-layer map on the calibration split ({self.search})"] if self.search else []),
                *(["measure each stage's serving memory"] if self.staged else []),
                f"measure the baseline and {', '.join(self.candidates)} on the evaluation split",
                *([f"sequential looks while a verdict is inconclusive ({looks})"] if looks else []),
                "gate" + (" (the last stage before the first that does not pass)" if self.staged else ""), "report"]


@dataclass(frozen=True)
class StageServing:
    """One stage on a staged run's serving shape (:func:`kvquant.scoring.stages.serve`): KV bytes at the end (all
    requests, per request, what several requests still share, what each further request adds), the bytes prefix
    sharing saved, fp16's bytes for the same tokens, and each decode step's latency (ms, this machine)."""

    requests: int
    tokens_per_request: int
    kv_bytes: int
    kv_bytes_per_request: float
    shared_bytes: int
    own_bytes_per_request: float
    shared_saved_bytes: int
    fp16_bytes: int
    step_ms: tuple[float, ...]
    p50_ms: float
    p99_ms: float

    def max_batch(self, budget: int) -> int:
        """Requests whose KV fits ``budget`` bytes: the shared bytes once, then each request's own."""
        left = budget - self.shared_bytes
        return max(int(left // self.own_bytes_per_request), 0) if self.own_bytes_per_request > 0 else 0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "step_ms": list(self.step_ms)}

    @classmethod
    def from_dict(cls, d: dict) -> StageServing:
        return cls(**{**d, "step_ms": tuple(d["step_ms"])})


@dataclass(frozen=True)
class Staged:
    """A staged run's serving step: each stage's (and the baseline's) :class:`StageServing`, the stages in order, the
    memory budget in bytes, the serving shape as configured, which stages share the prefix, and, once the gate
    has judged them, the first stage that does not pass (None: every stage passes)."""

    serving: dict[str, StageServing]
    stages: tuple[str, ...]
    budget_bytes: int
    shape: dict
    prefix_sharing: dict[str, bool]
    first_failing: str | None = None

    def to_dict(self) -> dict:
        return {"serving": {label: s.to_dict() for label, s in self.serving.items()}, "stages": list(self.stages),
                "budget_bytes": self.budget_bytes, "shape": self.shape, "prefix_sharing": self.prefix_sharing,
                "first_failing": self.first_failing}


@dataclass(frozen=True)
class SearchSummary:
    """What a per-layer search found (:mod:`kvquant.runner.search`): the map's ``name``, the bit budget (None: a
    target),
    whether a map passed the gate on the calibration split (``found``), the step chosen of ``steps``, the ladder
    (each rung's name, quantizer, options and bits/element), the map (layer -> rung name), each layer's sensitivity
    per rung and the full-precision loss it is relative to, every map checked, and the calibration split and gate."""

    name: str
    max_bits: float | None
    found: bool
    step: int
    steps: int
    ladder: tuple[dict, ...]
    map: dict[str, str]
    sensitivity: dict[str, list[float]]
    reference_loss: float
    checked: tuple[dict, ...]
    calibration: dict

    def to_dict(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "ladder": list(self.ladder), "checked": list(self.checked)}


@dataclass(frozen=True)
class RunResult:
    """Everything a report renders: the config as given (never rewritten), the candidates evaluated (the config's
    candidates, or its stages, and a search's map), what each measured, the gate's rows and decision, and what a
    search or a staged run adds (``search``: the map found and every step checked; ``staged``: the serving
    measurements and the stages' order), and per calibrated candidate its static scales (``calibration``)."""

    config: object  # the ExperimentConfig
    candidates: tuple  # Candidate or Stage, in the report's order
    results: dict[str, Measured]
    rows: tuple[MetricRow, ...]
    decision: Decision
    command: str
    provenance: Provenance
    search: SearchSummary | None = None
    staged: Staged | None = None
    calibration: dict = dataclasses.field(default_factory=dict)
    plan: RunPlan | None = None
    #: where the partial results were measured under more than one plan (``--replan``): the union bound over every
    #: look taken, the worst metric's, and what changed (:func:`kvquant.runner.lookplan.replanned_error`)
    replanned: dict | None = None
