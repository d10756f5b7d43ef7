"""The interval of a mean over documents (windows): the studentized bootstrap (bootstrap-t). See ``docs/gate.md``.

Every gated statistic over windows or documents is a ratio of sums over them, ``R = sum(y) / sum(x)``: a perplexity
set's KL (``y``: a window's summed KL, ``x``: its positions) and top-1 agreement, the log of its perplexity ratio
(``y``: the baseline's NLL minus the candidate's, ``x``: the baseline's tokens), a position bucket's KL over
documents. Per-window KL is skewed toward bad windows, and the percentile bootstrap kvquant used before misses the
true mean most on that side, the end a pass reads: 5-6% instead of 2.5% at 96-256 documents for the committed long
reports' spread (``experiments/simulate_counts.py``). The studentized bootstrap resamples ``t = (R* - R) / se*``
(``se``: the ratio's linearised standard error, ``sqrt(sum((y - R x)^2) n / (n - 1)) / sum(x)``) and reads the
interval as ``R - t_(1-a) se .. R - t_(a) se``: second-order accurate (Hall 1988; Efron and Tibshirani 1993,
ch. 12), so a skewed sample widens the side it is skewed to. ``experiments/simulate_windows.py`` compares it with
the percentile, BCa and Student-t intervals at 2-256 documents and sets each end's count
(:mod:`kvquant.runner.counts`).
"""

from __future__ import annotations

import math

import numpy as np


def _ratio(y: np.ndarray, x: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``sum(y) / sum(x)`` over the last axis (``[..., n]`` -> ``[...]``) and its linearised standard error, from
    sums (``x`` None: each 1)."""
    n = y.shape[-1]
    sy, syy = y.sum(-1), (y * y).sum(-1)
    sx, sxy, sxx = (n, sy, n) if x is None else (x.sum(-1), (x * y).sum(-1), (x * x).sum(-1))
    ratio = sy / sx
    spread = np.maximum(syy - 2 * ratio * sxy + ratio * ratio * sxx, 0.0)  # sum((y - ratio x)^2)
    return ratio, np.sqrt(spread * n / (n - 1)) / sx


def bootstrap_t(y, x, idx, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap-t interval of ``sum(y) / sum(x)`` at two-sided ``confidence``.

    ``y``, ``x``: per-document numerator and denominator ``[..., n]`` (``x`` > 0, None: each 1, a plain mean;
    leading axes are independent samples, as a simulation draws them); ``idx``: resampled document indices
    ``[..., iters, n]`` (the gate's ``rng.integers(0, n, size=(iters, n))``). Returns ``(low, high)``, each
    ``[...]``. A resample of one document repeated (no spread) has an infinite ``t`` of its sign; a sample with no
    spread at all has the interval ``[R, R]``. At least two documents."""
    y = np.asarray(y, dtype=float)
    x = None if x is None else np.asarray(x, dtype=float)
    if y.shape[-1] < 2:
        raise ValueError(f"a studentized interval needs at least two documents, got {y.shape[-1]}")
    ratio, se = _ratio(y, x)

    def resample(v):
        return np.take_along_axis(np.broadcast_to(v[..., None, :], idx.shape), idx, axis=-1)

    rb, seb = _ratio(resample(y), None if x is None else resample(x))
    shift = rb - ratio[..., None]
    # a resample with no spread: t is +-inf by the sign of its shift (0 where it did not move)
    scale = np.where(seb > 0, seb, 1.0)
    t = np.where(seb > 0, shift / scale, np.where(shift > 0, np.inf, np.where(shift < 0, -np.inf, 0.0)))
    alpha = (1 - confidence) / 2
    q_low, q_high = np.quantile(t, [alpha, 1 - alpha], axis=-1, method="inverted_cdf")
    flat = se == 0
    with np.errstate(invalid="ignore"):
        low = np.where(flat, ratio, ratio - q_high * se)
        high = np.where(flat, ratio, ratio - q_low * se)
    return low, high


def log_ratio_interval(baseline: np.ndarray, candidate: np.ndarray, iters: int, confidence: float,
                       seed: int) -> tuple[float, float]:
    """The interval of a ratio of perplexities, baseline / candidate, from per-window ``[n, 2]`` rows of (summed
    NLL, tokens) of both: :func:`bootstrap_t` of the log of the ratio, ``sum(baseline NLL - candidate NLL) /
    sum(baseline tokens)``, exponentiated (``iters`` seeded resamples; nan with fewer than 2 windows)."""
    n = len(candidate)
    if n < 2 or len(baseline) != n:  # one window shows no spread at all
        return math.nan, math.nan
    idx = np.random.default_rng(seed).integers(0, n, size=(iters, n))
    with np.errstate(over="ignore"):  # an unbounded log-ratio interval (too few windows) is an unbounded ratio
        low, high = np.exp(bootstrap_t(baseline[:, 0] - candidate[:, 0], baseline[:, 1], idx, confidence))
    return float(low), float(high)


def mean_interval(baseline: np.ndarray | None, candidate: np.ndarray, iters: int, confidence: float,
                  seed: int) -> tuple[float, float]:
    """The interval of a token-weighted mean over windows from the candidate's per-window ``[n, 2]`` rows of (sum,
    positions): :func:`bootstrap_t` (``iters`` seeded resamples; ``baseline`` unused: the value is measured against
    the baseline already; nan with fewer than 2 windows)."""
    n = len(candidate)
    if n < 2:  # one window shows no spread at all
        return math.nan, math.nan
    idx = np.random.default_rng(seed).integers(0, n, size=(iters, n))
    low, high = bootstrap_t(candidate[:, 0], candidate[:, 1], idx, confidence)
    return float(low), float(high)


def share_interval(baseline: np.ndarray | None, candidate: np.ndarray, iters: int, confidence: float,
                   seed: int) -> tuple[float, float]:
    """:func:`mean_interval` of a share of positions (top-1 agreement, the KL tail share) from the candidate's
    per-window ``[n, 2]`` rows of (positions counted, positions), save where no window counted any position (or
    every window all): there the studentized interval has no spread, ``[0, 0]``, and passed a share at its limit
    whenever a clustered share (most windows none) left every window empty (at a limit of 0.005 with 98% of 96
    windows counting none, 14% of draws: ``tests/test_shares.py``; ``experiments/simulate_shares.py``). Its end
    there is the exact bound of the share of windows that count any (Clopper-Pearson for 0 of ``n``,
    ``1 - a ** (1 / n)``, ``a`` half of ``1 - confidence``), which bounds the mean share (a window's share is at
    most 1; exact for windows of equal positions)."""
    low, high = mean_interval(baseline, candidate, iters, confidence, seed)
    n = len(candidate)
    if n >= 2:
        bound = 1 - ((1 - confidence) / 2) ** (1 / n)
        high = bound if not candidate[:, 0].any() else high
        low = 1 - bound if np.all(candidate[:, 0] == candidate[:, 1]) else low
    return low, high
