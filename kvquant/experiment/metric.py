"""The kinds of metric a run judges, one :class:`Metric` each in a registry (:data:`METRICS`): what each is
measured on, which way is better, where its threshold comes from in the gate's config, the interval the gate puts
around it, whether it is held to the fewest documents a bootstrap decides with, and how reports state it. The gate,
the counts, the sequential looks and the report read these fields; none of them checks a kind by its name. See
``docs/gate.md``.

A metric's name is ``<measure>/<source>`` (``acc_norm/hellaswag``, ``kl/wikitext2``, ``top1/wikitext2@4096``):
:data:`MEASURES` maps each measure to its kind. Adding a gated metric is one entry here, its threshold in the gate's
config (``kvquant/runner/gate_config.py``) and the outcomes it is read from (``kvquant/runner/results.py``; for a
kind derived from another kind's outcomes, as the flip rate and the KL tail share are, how in
``kvquant/runner/derived.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: The paired intervals a metric can have (``kvquant.runner.gate.paired_interval`` computes each):
#: the score interval of a ratio of paired 0/1 accuracies (``paired_ratio_bounds``), the studentized bootstrap of the
#: log of a ratio of perplexities over windows, the studentized bootstrap of a token-weighted mean over windows (or
#: documents) of the candidate's own per-window sums (of a share of positions: the same, but bounded exactly where no
#: window counts any, ``kvquant.runner.bootstrap.share_interval``), and the exact (Clopper-Pearson) interval of a
#: share of documents (flips, ``kvquant.runner.flips``).
SCORE_RATIO, LOG_RATIO, MEAN, SHARE, EXACT = "score ratio", "log ratio", "mean", "share", "exact"
#: The intervals that are bootstraps over documents or windows: held to the counts of ``kvquant.runner.counts``.
BOOTSTRAPS = (LOG_RATIO, MEAN, SHARE)


@dataclass(frozen=True, eq=False)
class Metric:
    """One kind of metric (compared by identity: :data:`METRICS` holds each once)."""

    #: the kind's name, as results.json records it
    kind: str
    #: the measures of this kind (a metric's name is ``<measure>/<source>``)
    measures: tuple[str, ...]
    #: the gate's config field its threshold comes from (nan where that field is null: reported, not gated)
    threshold_key: str
    lower_is_better: bool
    #: the paired interval of its statistic (:data:`SCORE_RATIO`, :data:`LOG_RATIO`, :data:`MEAN`, :data:`SHARE`,
    #: :data:`EXACT`)
    interval: str
    #: measured on a task's documents (judged on ``gate.tasks``, looked at sequentially); else on a text's windows
    #: or the long documents (judged on ``gate.perplexity``)
    on_tasks: bool = False
    #: per sample a sum over positions (``Outcomes.tokens`` of them): its value is the token-weighted mean
    windowed: bool = False
    #: its value is ``exp`` of that mean, and the relative score and threshold are baseline / candidate (perplexity)
    inverted: bool = False
    #: compared by its own value (not relative to the baseline's)
    by_value: bool = False
    #: the baseline's own value where the candidate's is measured against the baseline directly (a divergence of
    #: the next-token distributions), so no baseline outcomes pair with it; None: paired with the baseline's outcomes
    reference: float | None = None
    #: also measured per position bucket of the long documents (``<measure>/<text>@<end>``)
    bucketed: bool = False
    #: the kind whose outcomes it is derived from, beside that kind's row, where it is not measured on its own (flips:
    #: from a task's accuracy); ``kvquant.runner.gate`` holds how
    derived_from: Metric | None = None
    #: what the report calls it where it states the config's limit (None: not stated there), and the limit's unit
    phrase: str | None = None
    unit: str = ""
    #: what the Metrics table's footnote says its value is (metrics compared by value only)
    explained: str | None = None
    #: the long-context section's heading of its per-bucket table, and the digits it shows
    title: str | None = None
    digits: int = 4

    @property
    def is_bootstrap(self) -> bool:
        """Whether its interval is a bootstrap, held to the fewest documents one decides with."""
        return self.interval in BOOTSTRAPS

    @property
    def relative_to_baseline(self) -> bool:
        """Whether a relative score (candidate against baseline) means anything: not where the baseline's value
        against itself is 0 (a divergence, a flip rate)."""
        return self.reference != 0.0 and self.derived_from is None

    def threshold(self, policy) -> float:
        """Its threshold under the gate config ``policy`` (nan where the config sets none)."""
        limit = getattr(policy, self.threshold_key)
        if limit is None:
            return math.nan
        return 1.0 / limit if self.inverted else float(limit)

    def relative(self, value: float, baseline: float) -> float:
        """candidate / baseline (baseline / candidate where :attr:`inverted`): 1.0 = no loss; nan where no ratio
        means anything."""
        if not self.relative_to_baseline:
            return math.nan
        num, den = (baseline, value) if self.inverted else (value, baseline)
        if den == 0:
            return 1.0 if num == 0 else math.inf
        return num / den

    def value(self, scores: tuple[float, ...], tokens: tuple[int, ...]) -> float:
        """The value of per-sample ``scores`` (and per-sample positions ``tokens`` where :attr:`windowed`)."""
        if not self.windowed:
            return float(np.mean(scores)) if scores else math.nan
        mean = float(np.sum(scores) / np.sum(tokens))
        return float(np.exp(mean)) if self.inverted else mean

    def samples(self, scores: tuple[float, ...], tokens: tuple[int, ...]) -> np.ndarray:
        """What the paired interval resamples: ``[n]`` scores, or ``[n, 2]`` rows of (sum, positions)."""
        if not self.windowed:
            return np.asarray(scores, dtype=float)
        return np.column_stack([np.asarray(scores, dtype=float), np.asarray(tokens, dtype=float)])

    @property
    def upper_limit(self) -> bool:
        """Whether the config's value is the most it may reach (``max_*``), not the least."""
        return self.lower_is_better != self.inverted

    def limit_phrase(self, limit: float | None, words: bool = False) -> str | None:
        """The config's ``limit`` as a report states it: ``top-1 agreement >= 0.9``, or with ``words`` ``top-1
        agreement at least 0.9`` (None where it is not set, or not stated)."""
        if not (self.phrase and limit):
            return None
        if words:
            return f"{self.phrase} {'at most' if self.upper_limit else 'at least'} {limit:g}{self.unit}"
        return f"{self.phrase} {'<=' if self.upper_limit else '>='} {limit}{self.unit}"

    @staticmethod
    def of(kind: Metric | str) -> Metric:
        """The metric kind ``kind`` (its :attr:`kind` name, or itself)."""
        return kind if isinstance(kind, Metric) else KINDS[kind]


ACCURACY = Metric("accuracy", ("acc", "acc_norm"), "min_relative_accuracy", False, SCORE_RATIO, on_tasks=True,
                  phrase="accuracy ratio", digits=3)
PERPLEXITY = Metric("perplexity", ("ppl",), "max_perplexity_ratio", False, LOG_RATIO, windowed=True, inverted=True,
                    phrase="perplexity ratio")
DIVERGENCE = Metric(
    "divergence", ("kl",), "max_kl_divergence", True, MEAN, windowed=True, by_value=True, reference=0.0,
    bucketed=True, phrase="mean KL divergence", unit=" nats/token",
    explained="mean KL divergence of the candidate's next-token distribution from the baseline's, nats per position; "
              "the baseline is the model's own computation, for an engine's format too, not the engine's own 16-bit "
              "cache: docs/quantizers.md, what an engine format's KL means", title="KL divergence", digits=5)
AGREEMENT = Metric("agreement", ("top1",), "min_top1_agreement", False, SHARE, windowed=True, by_value=True,
                   reference=1.0, bucketed=True, phrase="top-1 agreement",
                   explained="share of positions whose most likely token is the baseline's", title="Top-1 agreement")
TAIL = Metric("tail", ("kl_tail",), "max_kl_tail_share", True, SHARE, windowed=True, by_value=True, reference=0.0,
              derived_from=DIVERGENCE, phrase="KL tail share",
              explained="share of positions whose KL divergence from the baseline exceeds `gate.kl_tail_nats`: the "
                        "rare large changes of the next-token distribution a mean hides")
FLIPS = Metric("flips", ("flips",), "max_flip_rate", True, EXACT, on_tasks=True, by_value=True, derived_from=ACCURACY,
               explained="share of a task's documents whose answer went from right to wrong or from wrong to right; "
                         "exact interval")

#: Every kind of metric, in the order reports list them.
METRICS = (ACCURACY, PERPLEXITY, DIVERGENCE, AGREEMENT, TAIL, FLIPS)
KINDS = {m.kind: m for m in METRICS}
#: The kind of each measure (the part of a metric's name before ``/``).
MEASURES = {measure: m for m in METRICS for measure in m.measures}


def divergence_limits(policy, bucketed: bool = False) -> dict[str, float]:
    """The thresholds ``policy`` sets on the divergence metrics (those with a :attr:`Metric.reference`: measured
    against the baseline's next-token distributions on perplexity sets, some also on the long documents'
    position buckets), by config field, in :data:`METRICS`' order: empty where none is gated; ``bucketed``: only
    those measured per position bucket."""
    return {m.threshold_key: getattr(policy, m.threshold_key) for m in METRICS
            if (m.bucketed if bucketed else m.reference is not None) and getattr(policy, m.threshold_key) is not None}
