"""The score interval of a ratio of paired 0/1 accuracies (:func:`paired_ratio_bounds`), the table of paired counts
it reads (:func:`paired_table`), and how many documents a table kept in its proportions needs to clear a threshold
(:func:`projected_documents`): pure numpy; the gate that reads result tables is :mod:`kvquant.runner.gate`."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

#: Continuity correction of :func:`paired_ratio_bounds`, in documents: the score statistic's numerator is moved
#: this far toward the null (without it the score test errs up to 2.7% instead of 2.5% at 50 documents).
CONTINUITY = 0.5


def paired_ratio_bounds(both, lost, gained, neither, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """Score interval of the ratio of paired accuracies (candidate / baseline) from the four paired counts.

    ``both``: documents both answered right; ``lost``: only the baseline; ``gained``: only the candidate;
    ``neither``. Counts (numbers or arrays of one shape, each a table of its own); two-sided ``confidence``.
    Returns ``(low, high)`` arrays (NaN where the baseline answered nothing right: no ratio).

    The test of ``H0: ratio = theta`` is the score test of Nam and Blackwelder (2002) and Tang, Tang and Chan
    (2003) for a ratio of paired proportions: the statistic ``both + gained - theta (both + lost)`` (each
    document adds ``1 - theta``, ``-theta``, ``1`` or 0) over its standard deviation under the maximum-likelihood
    fit of the four cells that has the ratio ``theta`` (closed form: a quadratic). Its numerator is moved
    :data:`CONTINUITY` documents toward the null, and the interval holds every ``theta`` not rejected at
    ``(1 - confidence) / 2`` on either side. Unlike an interval from the observed flips alone it is wide where
    none flipped (the fitted cells have flips whenever ``theta`` is not 1), and the exact error of its pass
    (``low >= theta``) at a true ratio ``theta``, summed over every outcome, stayed at or below
    ``(1 - confidence) / 2`` from 50 to 5,000 documents, accuracies 0.2-0.9 and flips one way or both
    (``experiments/simulate_gate.py``, ``docs/gate.md``)."""
    return _bounds(*_paired_counts(both, lost, gained, neither, confidence), confidence)


def _bounds(a, b, c, d, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`paired_ratio_bounds` on counts already checked, float arrays of one shape (scaled counts need not be
    whole: the statistic is continuous in them)."""
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    hat = np.divide(a + c, a + b, out=np.full(a.shape, np.nan), where=a + b > 0)
    low = _score_root(a, b, c, d, z, np.zeros(a.shape), np.nan_to_num(hat), lower=True)
    high = np.exp(_score_root(a, b, c, d, -z, np.log(np.maximum(np.nan_to_num(hat), 1e-9)),
                              np.full(a.shape, math.log(1e9)), lower=False))
    none = a + b == 0
    return np.where(none, np.nan, low), np.where(none, np.nan, high)


def _paired_counts(both, lost, gained, neither, confidence) -> list[np.ndarray]:
    """The four counts of :func:`paired_ratio_bounds` as float arrays of one shape, checked: whole numbers, none
    negative (so neither flip count exceeds the documents), every table of at least one document, and a confidence
    in (0, 1); else a ValueError naming what is wrong."""
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float, np.floating)) or \
            not 0 < confidence < 1:
        raise ValueError(f"paired_ratio_bounds: confidence must be a number in (0, 1), got {confidence!r}")
    try:
        counts = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (both, lost, gained, neither)))
    except (TypeError, ValueError) as err:
        raise ValueError(f"paired_ratio_bounds: counts must be numbers or arrays of one shape ({err})") from None
    for name, x in zip(("both", "lost", "gained", "neither"), counts):
        if not np.all(np.isfinite(x) & (x >= 0) & (x == np.floor(x))):
            bad = x[~(np.isfinite(x) & (x >= 0) & (x == np.floor(x)))].flat[0]
            raise ValueError(f"paired_ratio_bounds: {name} must count documents (a whole number, not negative), "
                             f"got {float(bad):g}")
    if np.any(sum(counts) == 0):
        raise ValueError("paired_ratio_bounds: a table of 0 documents has no interval")
    return counts


def _score(a, b, c, d, theta, toward):
    """The continuity-corrected score statistic at ratio ``theta`` (``toward``: +1 for the lower end, -1 for the
    upper); -inf/+inf where the fitted variance vanishes (no flips at ratio 1)."""
    n = a + b + c + d
    qa, qb = n * (1 + theta), (a + b) * theta ** 2 - (a + c + 2 * b)  # the fitted share of lost documents
    qc = b * (1 - theta) * (a + b + c) / n
    lost = (-qb + np.sqrt(np.maximum(qb * qb - 4 * qa * qc, 0))) / (2 * qa)
    variance = n * (1 + theta) * lost + (a + b + c) * (theta - 1)
    numerator = a + c - theta * (a + b) - toward * CONTINUITY
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(variance > 0, numerator / np.sqrt(np.maximum(variance, 0)), -toward * np.inf)


def _score_root(a, b, c, d, z, lo, hi, lower: bool, steps: int = 64):
    """Bisection for the ratio where the score statistic crosses ``z`` (it falls as the ratio grows): in
    ``[lo, hi]`` on the ratio for the lower end, on its logarithm for the upper."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        above = _score(a, b, c, d, mid if lower else np.exp(mid), 1 if lower else -1) >= z
        lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
    return lo if lower else hi


def paired_table(baseline, candidate) -> tuple[int, int, int, int] | None:
    """The four counts of :func:`paired_ratio_bounds` (both, lost, gained, neither) from per-document scores ``[n]``
    of both, paired by position; None unless every score is 0 or 1 and the two have one length."""
    b, c = np.asarray(baseline, dtype=float), np.asarray(candidate, dtype=float)
    if b.shape != c.shape or b.ndim != 1 or not (np.all((b == 0) | (b == 1)) and np.all((c == 0) | (c == 1))):
        return None
    return (int(np.sum((b == 1) & (c == 1))), int(np.sum((b == 1) & (c == 0))), int(np.sum((b == 0) & (c == 1))),
            int(np.sum((b == 0) & (c == 0))))


#: How far :func:`projected_documents` looks: up to this many times the documents scored.
PROJECTION_REACH = 100_000


def projected_documents(table: tuple[int, int, int, int], confidence: float, limit: float) -> int | None:
    """The fewest documents (a whole number, at least the table's) at which a paired table ``(both, lost, gained,
    neither)`` kept in its proportions gives a :func:`paired_ratio_bounds` interval at ``confidence`` wholly on one
    side of ``limit`` (its lower end at or above it, or its upper end below it, as
    :func:`kvquant.runner.gate.judge` reads them); None if none up to :data:`PROJECTION_REACH` times the documents
    does (a ratio on the limit, or no document the baseline answered right). The counts are scaled, not rounded:
    rounded, a small flip count's rounding would make the interval open and close again as the total grows, and the
    answer jump with it. Found by doubling the total, then bisecting between the last open and the first decided."""
    counts = np.asarray(table, dtype=float)
    n = counts.sum()
    if n == 0 or counts[0] + counts[1] == 0:
        return None

    def decided(totals: np.ndarray) -> np.ndarray:
        low, high = _bounds(*(counts[:, None] * totals / n), confidence)
        return (low >= limit) | (high < limit)

    doublings = n * 2.0 ** np.arange(math.ceil(math.log2(PROJECTION_REACH)) + 1)
    found = np.flatnonzero(decided(doublings))
    if not found.size:
        return None
    if found[0] == 0:
        return int(n)
    lo, hi = int(doublings[found[0] - 1]), int(doublings[found[0]])  # open at lo, decided at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if decided(np.array([float(mid)]))[0] else (mid, hi)
    return hi
