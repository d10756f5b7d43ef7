"""Flips: the documents whose answer a quantized cache changes, beside the accuracy it leaves (issue 39 item 2; the
gate and the report do not read it yet).

Two caches can score the same accuracy while answering different documents correctly; "Accuracy is Not All You
Need" (Dutta et al., 2024) counts such changes for compressed models. Over the documents both scored, paired by
document: **right to wrong** (the baseline's answer was right, the candidate's is not) and **wrong to right**,
each as a share of the documents with an exact (Clopper-Pearson) interval, and the flip rate (both together).
Pure functions over per-document 0/1 outcomes (``Outcomes.scores`` of an accuracy metric).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy.stats import beta


def exact_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Clopper-Pearson interval of a share ``k / n`` at ``confidence`` (two-sided; NaN for ``n = 0``)."""
    if n == 0:
        return math.nan, math.nan
    alpha = 1 - confidence
    low = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    high = 1.0 if k == n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
    return low, high


@dataclass(frozen=True)
class Flips:
    """Of ``n`` documents both scored: how many the candidate turned from right to wrong and from wrong to right,
    each share's exact interval, and the flip rate (both together) with its interval."""

    n: int
    right_to_wrong: int
    wrong_to_right: int
    right_to_wrong_interval: tuple[float, float]
    wrong_to_right_interval: tuple[float, float]
    rate_interval: tuple[float, float]

    @property
    def rate(self) -> float:
        """Share of documents whose correctness changed (NaN without documents)."""
        return (self.right_to_wrong + self.wrong_to_right) / self.n if self.n else math.nan


def flips(baseline: tuple[float, ...], candidate: tuple[float, ...], confidence: float = 0.95) -> Flips:
    """:class:`Flips` of per-document 0/1 outcomes of one task, paired by position (the candidate may have scored
    fewer documents: only those both scored count). Scores other than 0 and 1 (a task without a right answer per
    document) are refused: flips need one."""
    n = min(len(baseline), len(candidate))
    pairs = list(zip(baseline[:n], candidate[:n]))
    if any(b not in (0, 1) or c not in (0, 1) for b, c in pairs):
        raise ValueError("flips need a right or wrong answer per document (0/1 outcomes); this metric has others")
    down = sum(1 for b, c in pairs if b == 1 and c == 0)
    up = sum(1 for b, c in pairs if b == 0 and c == 1)
    return Flips(n, down, up, exact_interval(down, n, confidence), exact_interval(up, n, confidence),
                 exact_interval(down + up, n, confidence))
