"""The rows of metric kinds derived from another kind's outcomes beside that kind's row (the
:attr:`~kvquant.experiment.metric.Metric.derived_from` of a kind), not measured on their own: the flip rate of a task
from its accuracy outcomes, the KL tail share of a perplexity set from its KL divergence per position.
:func:`kvquant.runner.gate.derived_rows` decides where the gate has them.
"""

from __future__ import annotations

from kvquant.experiment.metric import FLIPS, TAIL
from kvquant.runner.flips import flips
from kvquant.experiment.results import MetricId, MetricRow, Outcomes


def flip_row(accuracy: MetricRow, baseline: tuple[float, ...], candidate: tuple[float, ...]) -> MetricRow:
    """The gated flip rate of a task (``flips/<task>``) beside its accuracy row: the share of documents whose
    correctness the candidate changed, with its exact interval at the accuracy row's confidence."""
    found = flips(baseline, candidate, accuracy.confidence)
    low, high = found.rate_interval
    return MetricRow(accuracy.candidate, MetricId(FLIPS.measures[0], accuracy.metric.source), found.rate, 0.0, found.n,
                     True, low, high, accuracy.quantized_share, accuracy.confidence)


def tail_rows(kl: MetricRow, outcomes: Outcomes, cfg, interval) -> list[MetricRow]:
    """The share of positions whose KL divergence from the baseline exceeds ``gate.kl_tail_nats``
    (``kl_tail/<set>``) beside a perplexity set's KL row: per window the positions above the level, over all
    positions (token-weighted), at the KL row's confidence; its interval the kind's (``mean``: the studentized
    bootstrap over windows KL and top-1 have). None for a position bucket (its positions' values are not kept)."""
    if not outcomes.per_token:
        return []
    level = cfg.gate.kl_tail_nats
    tail = Outcomes(MetricId(TAIL.measures[0], kl.metric.source),
                    tuple(float(sum(1 for x in window if x > level)) for window in outcomes.per_token), outcomes.tokens)
    low, high = interval(TAIL, None, tail.samples(), cfg.gate.bootstrap, kl.confidence, cfg.eval.seed)
    return [MetricRow(kl.candidate, tail.metric, tail.value, TAIL.reference, tail.n, True, low, high,
                      kl.quantized_share, kl.confidence)]


#: How each derived kind's rows (one, or none where its source's outcomes cannot give it) are made from its source
#: row, the baseline's and the candidate's outcomes (``Outcomes``), the config and ``interval``
#: (:func:`kvquant.runner.gate.paired_interval`, the interval of the kind's method).
DERIVE = {FLIPS: lambda row, baseline, outcomes, cfg, interval: [flip_row(row, baseline.scores, outcomes.scores)],
          TAIL: lambda row, baseline, outcomes, cfg, interval: tail_rows(row, outcomes, cfg, interval)}
