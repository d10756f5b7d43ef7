"""Divergence by position, summarised: per position bucket the mean KL divergence and top-1 agreement over
documents with a bootstrap interval, and a trend test of how fast the divergence grows per doubling of the
position. Pure functions over the per-position numbers :func:`kvquant.scoring.longctx.position_divergences`
returns (no model, no files).

- **Buckets** ``[start, stop)`` of positions (default :data:`EDGES`: 0-512, 512-1K, ..., 16-32K). A document's
  value in a bucket is the mean over its positions there; a bucket's value is the mean over the documents that
  reach it, each document weighing the same (a long document does not outvote the others).
- **Intervals** resample documents (paired by construction: a document's KL is already its candidate against
  the baseline on the same tokens), ``iters`` times, seeded, with the studentized bootstrap the gate uses
  (:func:`kvquant.runner.bootstrap.bootstrap_t`): a bucket's of its mean, the trend's of the ratio below.
- **Trend**: the quasi-Poisson fit ``mean KL = exp(a + b x)``, ``x`` the ``log2`` of a bucket's mean position
  (counted from 1), on each bucket's KL summed over its positions (a log-link fit of the mean: no logarithm of a
  mean over few positions, whose downward bias in the small first buckets made the old least-squares slope of
  ``ln`` bucket means grow where per-position KL is noisy; ``docs/gate.md``). ``b`` solves
  ``sum(x n e^(b x)) / sum(n e^(b x)) = C`` (``n``: a bucket's positions), ``C`` the KL-weighted mean ``x``,
  ``sum_d sum_b x_b KL_db / sum_d sum_b KL_db`` over documents ``d`` (the quasi-likelihood estimate, with or
  without a constant per document: every document covers the same positions; a document weighs by its summed KL):
  a ratio of sums, whose interval is the studentized bootstrap's, mapped to ``b`` through that increasing equation.
  ``exp(b)`` is the factor by which the divergence grows per doubling of the position. Over the positions every
  document has (each cut to the shortest: a document's length does not weigh in the trend). It *grows* where the
  whole interval of the factor is above 1, *shrinks* where it is below, and is *flat or undecided* otherwise; over
  fewer than :data:`kvquant.runner.counts.MIN_TREND` documents it is *too few documents*, whatever the interval
  (``experiments/simulate_trend.py``: ``docs/gate.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvquant.runner.bootstrap import bootstrap_t
from kvquant.runner.counts import MIN_TREND, MIN_TREND_GROWS, MIN_TREND_SHRINKS, too_few

#: Default bucket edges (positions): 0-512, 512-1K, 1-2K, 2-4K, 4-8K, 8-16K, 16-32K.
EDGES = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768)
#: The slopes :func:`slope_of` searches (a factor per doubling from e^-64 to e^64).
SLOPE_RANGE = 64.0


def check_edges(edges) -> tuple[int, ...]:
    """``edges`` as a tuple of at least two increasing non-negative integers, else a ValueError naming them."""
    edges = tuple(edges)
    if len(edges) < 2 or any(not isinstance(e, int) or isinstance(e, bool) or e < 0 for e in edges) \
            or any(a >= b for a, b in zip(edges, edges[1:])):
        raise ValueError(f"bucket edges must be at least two increasing non-negative integers, got {list(edges)}")
    return edges


def bucket_means(per_position: list[list[float]], edges=EDGES) -> np.ndarray:
    """``[documents, buckets]``: each document's mean over its positions in each bucket (NaN where it has none)."""
    edges = check_edges(edges)
    out = np.full((len(per_position), len(edges) - 1), np.nan)
    for d, values in enumerate(per_position):
        values = np.asarray(values, dtype=float)
        for b, (start, stop) in enumerate(zip(edges, edges[1:])):
            part = values[start:stop]
            if part.size:
                out[d, b] = part.mean()
    return out


@dataclass(frozen=True)
class Bucket:
    """One bucket's statistic: positions ``[start, stop)``, the documents that reach it, the mean over them of
    their mean in the bucket, and its interval (NaN with fewer than two documents)."""

    start: int
    stop: int
    documents: int
    mean: float
    low: float
    high: float


def buckets(per_position: list[list[float]], edges=EDGES, iters: int = 2000, confidence: float = 0.95,
            seed: int = 0) -> list[Bucket]:
    """Per bucket that at least one document reaches: :class:`Bucket` of ``per_position`` (KL or 0/1 agreement)."""
    edges = check_edges(edges)
    means = bucket_means(per_position, edges)
    rng = np.random.default_rng(seed)
    out = []
    for b, (start, stop) in enumerate(zip(edges, edges[1:])):
        reached = means[~np.isnan(means[:, b]), b]
        if reached.size == 0:
            continue
        low = high = math.nan
        if reached.size >= 2:
            idx = rng.integers(0, reached.size, size=(iters, reached.size))
            low, high = (float(x) for x in bootstrap_t(reached, None, idx, confidence))
        out.append(Bucket(start, stop, int(reached.size), float(reached.mean()), low, high))
    return out


@dataclass(frozen=True)
class Trend:
    """How fast the divergence grows with position: ``factor`` (``exp(b)`` of the fit ``mean KL = exp(a + b log2
    position)``: the divergence is multiplied by it per doubling) and its interval; ``verdict`` ``grows``,
    ``shrinks``, ``undecided`` or ``too few documents (n = 3 of the 24 needed)`` (:func:`trend_verdict`)."""

    factor: float
    low: float
    high: float
    verdict: str


def bucket_sums(per_position: list[list[float]], edges=EDGES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the trend reads, over the positions every document has (each cut to the shortest): ``sums``
    ``[documents, buckets]`` (each document's summed KL in each bucket), ``counts`` ``[buckets]`` (positions in
    each bucket) and ``x`` ``[buckets]`` (``log2`` of the bucket's mean position counted from 1); only the buckets
    the shortest document reaches."""
    edges = check_edges(edges)
    length = min((len(v) for v in per_position), default=0)
    spans = [(start, min(stop, length)) for start, stop in zip(edges, edges[1:]) if start < length]
    sums = np.array([[float(np.sum(np.asarray(v[start:stop], dtype=float))) for start, stop in spans]
                     for v in per_position]).reshape(len(per_position), len(spans))
    counts = np.array([stop - start for start, stop in spans], dtype=float)
    x = np.log2([(start + 1 + stop) / 2 for start, stop in spans])
    return sums, counts, x


def slope_of(centre, x: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The slope ``b`` whose model ``mean KL = exp(a + b x)`` puts its KL mass at the mean ``x`` ``centre``
    (``[...]``): ``sum(x n e^(b x)) / sum(n e^(b x)) = centre`` (``n``: ``counts``), increasing in ``b``; ``-inf``
    at or below the smallest ``x``, ``inf`` at or above the largest, NaN for NaN; bisection to 1e-12 within
    ``+-SLOPE_RANGE`` (a centre closer to an end than that slope reaches gets the range's end)."""
    centre = np.asarray(centre, dtype=float)
    low, high = np.full(centre.shape, -SLOPE_RANGE), np.full(centre.shape, SLOPE_RANGE)
    for _ in range(64):
        mid = (low + high) / 2
        z = mid[..., None] * x
        w = counts * np.exp(z - z.max(-1, keepdims=True))
        above = (w * x).sum(-1) / w.sum(-1) > centre
        low, high = np.where(above, low, mid), np.where(above, mid, high)
    b = (low + high) / 2
    return np.where(centre <= x.min(), -np.inf, np.where(centre >= x.max(), np.inf, np.where(np.isnan(centre),
                                                                                                 np.nan, b)))


def trend(per_position: list[list[float]], edges=EDGES, iters: int = 2000, confidence: float = 0.95,
          seed: int = 0) -> Trend:
    """The :class:`Trend` of per-position KL divergences (over the positions every document has; no KL at all, or
    fewer than two buckets: NaN, ``undecided``; one document: no interval)."""
    sums, counts, x = bucket_sums(per_position, edges)
    mass, moment = sums.sum(1), sums @ x  # per document: summed KL, and summed KL times x
    docs = len(sums)
    if x.size < 2 or mass.sum() <= 0:
        return Trend(math.nan, math.nan, math.nan, trend_verdict(math.nan, math.nan, docs))
    factor = float(np.exp(slope_of(moment.sum() / mass.sum(), x, counts)))
    if docs < 2:
        return Trend(factor, math.nan, math.nan, trend_verdict(math.nan, math.nan, docs))
    idx = np.random.default_rng(seed).integers(0, docs, size=(iters, docs))
    low, high = (float(v) for v in np.exp(slope_of(np.array(bootstrap_t(moment, mass, idx, confidence)), x, counts)))
    return Trend(factor, low, high, trend_verdict(low, high, docs))


def trend_verdict(low: float, high: float, documents: int) -> str:
    """What a trend's interval ``[low, high]`` of the factor per doubling says over ``documents`` documents:
    ``grows`` (above 1), ``shrinks`` (below 1), ``undecided``, or too few documents to say it (each end has its
    count, :data:`~kvquant.runner.counts.MIN_TREND_GROWS` and :data:`~kvquant.runner.counts.MIN_TREND_SHRINKS`;
    below the smaller, :data:`~kvquant.runner.counts.MIN_TREND`, nothing is said)."""
    verdict = "grows" if low > 1 else "shrinks" if high < 1 else "undecided"
    need = MIN_TREND if documents < MIN_TREND else {"grows": MIN_TREND_GROWS, "shrinks": MIN_TREND_SHRINKS}.get(verdict)
    return too_few(documents, need) if need is not None and documents < need else verdict
