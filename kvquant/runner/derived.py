"""The rows of metric kinds derived from another kind's outcomes beside that kind's row (the
:attr:`~kvquant.experiment.metric.Metric.derived_from` of a kind), not measured on their own: the flip rate of a task
from its accuracy outcomes. :func:`kvquant.runner.gate.derived_rows` decides where the gate has them.
"""

from __future__ import annotations

from kvquant.experiment.metric import FLIPS
from kvquant.runner.flips import flips
from kvquant.runner.results import MetricId, MetricRow


def flip_row(accuracy: MetricRow, baseline: tuple[float, ...], candidate: tuple[float, ...]) -> MetricRow:
    """The gated flip rate of a task (``flips/<task>``) beside its accuracy row: the share of documents whose
    correctness the candidate changed, with its exact interval at the accuracy row's confidence."""
    found = flips(baseline, candidate, accuracy.confidence)
    low, high = found.rate_interval
    return MetricRow(accuracy.candidate, MetricId(FLIPS.measures[0], accuracy.metric.source), found.rate, 0.0, found.n,
                     True, low, high, accuracy.quantized_share, accuracy.confidence)


#: How each derived kind's rows (one, or none where its source's outcomes cannot give it) are made from its source
#: row, the baseline's and the candidate's outcomes (``Outcomes``), the config and ``interval``
#: (:func:`kvquant.runner.gate.paired_interval`, the interval of the kind's method).
DERIVE = {FLIPS: lambda row, baseline, outcomes, cfg, interval: [flip_row(row, baseline.scores, outcomes.scores)]}
