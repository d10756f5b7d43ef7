"""The gate's thresholds as a config section (``gate:``): what a candidate must keep, decided how, and the
bounds past which a gate passes any cache; and its sequential looks (``gate.max_documents``): the documents each
look scores (:func:`looks`, which decides what is measured) and the confidence of each look's interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvquant.experiment.binding import check_at_least, require

MAX_BOOTSTRAP = 100_000
#: A run's bootstrap: at least this many resamples, and at least :data:`MIN_TAIL_RESAMPLES` beyond each end of an
#: interval (a percentile interval's end is the resample at rank ``bootstrap * (1 - confidence) / 2``; with a
#: handful beyond it, the end is noise, and one resample is a zero-width interval that passes anything). 1,000 at
#: 95% (25 beyond each end) is the least Efron and Tibshirani advise for percentile intervals.
MIN_BOOTSTRAP, MIN_TAIL_RESAMPLES = 1000, 25
#: A gated metric needs at least this share of what attention read quantized to count toward a pass: below half,
#: most of what attention read was stored at full precision, and the metric shows the unquantized cache.
MIN_QUANTIZED_SHARE = 0.5
MAX_DOCUMENTS = 1_000_000
MAX_KL_DIVERGENCE = 1.0
#: The loosest gate that is still a gate: half the accuracy kept, perplexity doubled.
MIN_ACCURACY_RATIO, MAX_PERPLEXITY_RATIO = 0.5, 2.0
#: The least confidence of a gate's intervals: a wrong pass has at most 5% chance (one-sided) at 0.9. Below it, an
#: interval narrow enough to pass is one that excludes little: "paired 1% intervals" turn inconclusive into PASS.
MIN_CONFIDENCE = 0.9


@dataclass(frozen=True)
class GateConfig:
    """The ``gate:`` section. A setting added to it defaults to what kvquant did before it had the setting (a new
    gated metric: off), so a plan recorded before it reads it at its default (``kvquant.runner.lookplan``)."""

    #: Minimum candidate/baseline accuracy on every gated task.
    min_relative_accuracy: float = 0.97
    #: Maximum candidate/baseline perplexity on every gated perplexity set.
    max_perplexity_ratio: float = 1.05
    #: ``interval``: pass / fail / inconclusive from the paired bootstrap interval (see ``kvquant.runner.gate``);
    #: ``point``: on the point estimate alone (not a test: its verdicts say so).
    decide_on: Literal["interval", "point"] = "interval"
    #: Two-sided confidence of the intervals: a wrong pass (or a wrong fail) has at most half of 1 - confidence.
    confidence: float = 0.95
    bootstrap: int = 1000
    #: Sequential documents: per task, score up to this many (doubling from ``eval.tasks.limit``) while a
    #: candidate's verdict on it is open (null: the first ``limit`` only).
    max_documents: int | None = None
    #: A gated metric counts only when at least this share of the keys and of the values attention read was
    #: quantized (else: not exercised).
    min_quantized_share: float = 0.9
    #: Gate the perplexity sets on the mean KL divergence from the baseline (nats per token) and on the share
    #: of positions whose most likely token is the baseline's (null: reported, not gated).
    max_kl_divergence: float | None = None
    min_top1_agreement: float | None = None
    #: Gate the perplexity sets on the share of positions whose KL divergence from the baseline exceeds
    #: ``kl_tail_nats`` (null: reported only where set, not gated): the rare large changes a mean hides.
    max_kl_tail_share: float | None = None
    kl_tail_nats: float = 0.1
    #: The largest share of a gated task's documents a candidate may turn from right to wrong or from wrong to
    #: right (both together; exact interval), or null: flips are reported, not gated.
    max_flip_rate: float | None = None
    #: The context (tokens) up to which every long-context metric must be shown to pass: the divergence of each
    #: ``eval.long_context`` position bucket ending at or below it, and each gated needle task of that length or
    #: shorter (null: the longest passing context is reported per candidate, and the decision does not read it).
    min_context: int | None = None
    #: Gated tasks and perplexity sets (null = all of them); the others are reported only.
    tasks: list[str] | None = None
    perplexity: list[str] | None = None

    def __post_init__(self):
        require(0 < self.min_relative_accuracy <= 1,
                f"min_relative_accuracy must be in (0, 1], got {self.min_relative_accuracy!r}")
        require(math.isfinite(self.max_perplexity_ratio),
                f"max_perplexity_ratio must be a finite number, got {self.max_perplexity_ratio!r}")
        require(self.max_perplexity_ratio >= 1,
                f"max_perplexity_ratio must be a finite number >= 1, got {self.max_perplexity_ratio!r}")
        require(0 < self.confidence < 1, f"confidence must be in (0, 1), got {self.confidence!r}")
        require(1 <= self.bootstrap <= MAX_BOOTSTRAP,
                f"bootstrap must be in 1..{MAX_BOOTSTRAP} resamples, got {self.bootstrap!r}")
        check_at_least("max_documents", self.max_documents, 1, nullable=True)
        require(self.max_documents is None or self.max_documents <= MAX_DOCUMENTS,
                f"max_documents must be at most {MAX_DOCUMENTS}, got {self.max_documents!r}")
        require(0 <= self.min_quantized_share <= 1,
                f"min_quantized_share must be in [0, 1], got {self.min_quantized_share!r}")
        require(self.max_kl_divergence is None or 0 < self.max_kl_divergence <= MAX_KL_DIVERGENCE,
                f"max_kl_divergence must be in (0, {MAX_KL_DIVERGENCE}] nats per token or null, got "
                f"{self.max_kl_divergence!r}")
        require(self.min_top1_agreement is None or 0.5 <= self.min_top1_agreement <= 1,
                f"min_top1_agreement must be in [0.5, 1] or null, got {self.min_top1_agreement!r}")
        require(self.max_kl_tail_share is None or 0 < self.max_kl_tail_share < 1,
                f"max_kl_tail_share must be in (0, 1) (a share of positions) or null, got {self.max_kl_tail_share!r}")
        require(0 < self.kl_tail_nats <= MAX_KL_DIVERGENCE,
                f"kl_tail_nats must be in (0, {MAX_KL_DIVERGENCE}] nats, got {self.kl_tail_nats!r}")
        check_at_least("min_context", self.min_context, 1, nullable=True)
        require(self.max_flip_rate is None or 0 < self.max_flip_rate < 1,
                f"max_flip_rate must be in (0, 1) (a share of documents) or null, got {self.max_flip_rate!r}")

    def check_is_a_gate(self) -> None:
        """The run's gate must be one: thresholds looser than these pass any cache (the search's calibration
        target is the search's own affair, so this is checked on the config's gate only)."""
        off = "a looser gate passes any cache, int2 included: it is switched off, not a gate"
        require(MIN_ACCURACY_RATIO <= self.min_relative_accuracy,
                f"gate.min_relative_accuracy must be in [{MIN_ACCURACY_RATIO}, 1], got "
                f"{self.min_relative_accuracy!r}; {off}")
        require(self.max_perplexity_ratio <= MAX_PERPLEXITY_RATIO,
                f"gate.max_perplexity_ratio must be in [1, {MAX_PERPLEXITY_RATIO}], got "
                f"{self.max_perplexity_ratio!r}; {off}")
        require(self.min_quantized_share >= MIN_QUANTIZED_SHARE,
                f"gate.min_quantized_share must be in [{MIN_QUANTIZED_SHARE}, 1], got {self.min_quantized_share!r}: "
                "below half, most of what attention read was not quantized, so a pass would show the full-precision "
                "cache, not the quantizer")
        require(self.confidence >= MIN_CONFIDENCE,
                f"gate.confidence must be in [{MIN_CONFIDENCE}, 1), got {self.confidence!r}: a wrong pass has half of "
                "1 - confidence chance, so a lower one turns undecided results into passes")
        self._check_bootstrap()

    def check_gated_tasks(self, gated: list[str]) -> None:
        """Settings that act on gated tasks need one (``gated``: the config's): flips are counted, and sequential
        documents scored, on gated tasks only, so without one the setting would silently do nothing."""
        for key, what in (("max_flip_rate", "flips are counted on the documents of gated tasks (a right or wrong "
                           "answer each)"), ("max_documents", "sequential documents are scored on gated tasks only")):
            require(getattr(self, key) is None or bool(gated),
                    f"gate.{key}: {what}, and none is gated; gate a task (gate.tasks) or drop {key}")

    def _check_bootstrap(self) -> None:
        """Enough resamples for the interval's ends (:data:`MIN_BOOTSTRAP`, :data:`MIN_TAIL_RESAMPLES`)."""
        tail = (1 - self.confidence) / 2
        least = max(MIN_BOOTSTRAP, math.ceil(round(MIN_TAIL_RESAMPLES / tail, 6)))
        require(least <= MAX_BOOTSTRAP, f"gate.confidence {self.confidence!r} needs more than {MAX_BOOTSTRAP} "
                f"bootstrap resamples ({least}) for {MIN_TAIL_RESAMPLES} beyond each end of an interval; lower it")
        require(self.bootstrap >= least,
                f"gate.bootstrap must be at least {least} resamples for {self.confidence:.4g} intervals, got "
                f"{self.bootstrap!r}: each end is read from the {tail:.4g} of resamples beyond it, so fewer leave "
                f"noise there (1 gives a zero-width interval that passes anything)")


def looks(limit: int, max_documents: int | None) -> list[int]:
    """Documents scored at each look of a sequential task: ``limit``, doubling, up to ``max_documents``."""
    if limit < 1:
        raise ValueError(f"a task's first look needs documents, got limit {limit}")
    counts = [limit]
    while max_documents is not None and counts[-1] < max_documents:
        counts.append(min(2 * counts[-1], max_documents))
    return counts


def look_confidence(policy: GateConfig, planned_looks: int) -> float:
    """Two-sided confidence of each look's interval so that ``planned_looks`` looks together err with at most
    ``1 - policy.confidence`` (half of it on each side: a wrong pass, a wrong fail)."""
    return 1 - (1 - policy.confidence) / max(planned_looks, 1)
