"""Divergence by position, summarised: per position bucket the mean KL divergence and top-1 agreement over
documents with a bootstrap interval, and a trend test of how fast the divergence grows per doubling of the
position. Pure functions over the per-position numbers :func:`kvquant.scoring.longctx.position_divergences`
returns (no model, no files).

- **Buckets** ``[start, stop)`` of positions (default :data:`EDGES`: 0-512, 512-1K, ..., 16-32K). A document's
  value in a bucket is the mean over its positions there; a bucket's value is the mean over the documents that
  reach it, each document weighing the same (a long document does not outvote the others).
- **Intervals** resample documents (paired by construction: a document's KL is already its candidate against
  the baseline on the same tokens), ``iters`` times, seeded: a bucket's is the studentized bootstrap the gate uses
  (:func:`kvquant.runner.bootstrap.studentized`), the trend's a percentile bootstrap of its slope.
- **Trend**: ``ln KL`` of each (document, bucket) regressed on ``log2`` of the bucket's mean position (one
  pooled least-squares slope ``b``); ``exp(b)`` is the factor by which the divergence grows per doubling of the
  position, with a bootstrap interval over documents. It *grows* where the whole interval of ``b`` is above 0,
  *shrinks* where it is below, and is *flat or undecided* otherwise; over fewer than
  :data:`kvquant.runner.counts.MIN_TREND` documents it is *too few documents*, whatever the interval (a percentile
  bootstrap over fewer misses too often: ``docs/gate.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvquant.runner.bootstrap import studentized
from kvquant.runner.counts import MIN_TREND, too_few

#: Default bucket edges (positions): 0-512, 512-1K, 1-2K, 2-4K, 4-8K, 8-16K, 16-32K.
EDGES = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768)


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
            low, high = (float(x) for x in studentized(reached, None, idx, confidence))
        out.append(Bucket(start, stop, int(reached.size), float(reached.mean()), low, high))
    return out


@dataclass(frozen=True)
class Trend:
    """How fast the divergence grows with position: ``factor`` (``exp`` of the slope of ``ln KL`` on ``log2``
    position: the divergence is multiplied by it per doubling) and its interval; ``verdict`` ``grows``,
    ``shrinks``, ``undecided`` or ``too few documents (n = 3 of the 24 needed)`` (:func:`trend_verdict`)."""

    factor: float
    low: float
    high: float
    verdict: str


def _slope(x: np.ndarray, y: np.ndarray) -> float:
    """Least-squares slope of ``y`` on ``x`` (NaN where ``x`` has no spread)."""
    dx = x - x.mean()
    var = float((dx * dx).sum())
    return float((dx * (y - y.mean())).sum() / var) if var > 0 else math.nan


def trend(per_position: list[list[float]], edges=EDGES, iters: int = 2000, confidence: float = 0.95,
          seed: int = 0) -> Trend:
    """The :class:`Trend` of per-position KL divergences (buckets where a document's mean is 0 are left out: no
    logarithm; fewer than two documents or one bucket: NaN, ``undecided``)."""
    edges = check_edges(edges)
    means = bucket_means(per_position, edges)
    # log2 of each bucket's mean position counted from 1 (positions start..stop-1 -> 1-based start+1..stop)
    x_of = np.log2([(start + 1 + stop) / 2 for start, stop in zip(edges, edges[1:])])
    points = [[(x_of[b], math.log(v)) for b, v in enumerate(row) if not np.isnan(v) and v > 0] for row in means]

    def slope(docs) -> float:
        pairs = [p for d in docs for p in points[d]]
        if not pairs:
            return math.nan
        x, y = np.array(pairs).T
        return _slope(x, y)

    b = slope(range(len(points)))
    if len(points) < 2 or math.isnan(b):
        return Trend(math.exp(b) if not math.isnan(b) else math.nan, math.nan, math.nan,
                     trend_verdict(math.nan, math.nan, len(points)))
    rng = np.random.default_rng(seed)
    draws = np.array([slope(rng.integers(0, len(points), len(points))) for _ in range(iters)])
    draws = draws[~np.isnan(draws)]
    alpha = (1 - confidence) / 2
    low, high = np.quantile(draws, [alpha, 1 - alpha], method="inverted_cdf")
    return Trend(math.exp(b), math.exp(low), math.exp(high), trend_verdict(math.exp(low), math.exp(high), len(points)))


def trend_verdict(low: float, high: float, documents: int) -> str:
    """What a trend's interval ``[low, high]`` of the factor per doubling says over ``documents`` documents:
    ``grows`` (above 1), ``shrinks`` (below 1), ``undecided``, or too few documents to say either."""
    if documents < MIN_TREND:
        return too_few(documents, MIN_TREND)
    return "grows" if low > 1 else "shrinks" if high < 1 else "undecided"
