"""The gate's error on a share of positions near 0 (``kl_tail/<set>``, and ``top1/<set>`` through its disagreement):
how often a setting whose true share is exactly at the limit passes (nominal at most 2.5% at 95%), how often the
95% interval covers the true share, and how often a setting below the limit passes (power), by simulation.

Each draw is what the gate reads of one candidate on one perplexity set: ``n`` windows of ``m`` positions each,
per window the positions counted (above ``gate.kl_tail_nats``, or whose top-1 token changed), and is judged by the
gate's own functions: :func:`kvquant.runner.gate.paired_interval` (the studentized bootstrap over windows,
``iters`` resamples seeded per draw) and :func:`kvquant.runner.gate.judge` (the counts of
:mod:`kvquant.runner.counts` included), with ``gate.max_kl_tail_share`` at the limit. Top-1 agreement is the same
interval of ``m - count`` (an affine image: its interval is the mirror of the share's), judged against
``gate.min_top1_agreement = 1 - limit`` on the draws at the limit: its false pass is checked beside the tail's.

The per-window counts are overdispersed: a window's share ``p`` is drawn from a beta distribution of mean
``share / (1 - zeros)`` and concentration ``kappa`` (its variance ``mean (1 - mean) / (kappa + 1)``: kappa 20 is
strong window-to-window variation, 200 mild), with probability ``zeros`` it is 0 (a zero-inflated setting: most
windows count nothing), and the count is binomial(``m``, ``p``). Windows of 63, 511 and 1,023 positions (64-,
512- and 1,024-token windows), and one setting of lengths uniform in 63-1,023. The true share is the limit, 0.8 of
it and half of it; ``n`` 96 (the fewest windows that decide a pass, :data:`kvquant.runner.counts.MIN_PASS`) and
384::

    PYTHONPATH=. nice python experiments/simulate_shares.py --write-docs   # experiments/simulate_shares.json
    PYTHONPATH=. python experiments/simulate_shares.py --render --write-docs   # the table again, no simulation
"""

from __future__ import annotations

import math
import multiprocessing
import sys

import numpy as np
from simulate_counts import run

from kvquant.exits import run_script
from kvquant.experiment.metric import AGREEMENT, TAIL
from kvquant.runner.gate import PASS, judge, paired_interval
from kvquant.experiment.gate_config import GateConfig
from kvquant.experiment.results import MetricId, MetricRow

SEED = 20261210
CONFIDENCE = 0.95
ALPHA = (1 - CONFIDENCE) / 2
WINDOWS = (96, 192)
#: The true share as a multiple of the limit: at it (false pass), and below it (power; the second draws a quarter).
FACTORS = (1.0, 0.8, 0.5)
#: ``name: (positions per window (an int, or (low, high) uniform), limit, kappa, zeros)``.
SETTINGS = {
    "511 positions, limit 0.01, kappa 200": (511, 0.01, 200.0, 0.0),
    "511 positions, limit 0.01, kappa 20": (511, 0.01, 20.0, 0.0),
    "63 positions, limit 0.05, kappa 20": (63, 0.05, 20.0, 0.0),
    "63-1,023 positions, limit 0.01, kappa 20": ((63, 1023), 0.01, 20.0, 0.0),
    "1,023 positions, limit 0.001, kappa 20": (1023, 0.001, 20.0, 0.0),
    "63 positions, limit 0.001, kappa 20": (63, 0.001, 20.0, 0.0),
    "511 positions, limit 0.01, 90% windows zero": (511, 0.01, 20.0, 0.9),
    "511 positions, limit 0.01, 97% windows zero": (511, 0.01, 20.0, 0.97),
    "1,023 positions, limit 0.001, 90% windows zero": (1023, 0.001, 20.0, 0.9),
}
#: The settings whose false pass the first run (seed 20261210, 1,000 draws) found beyond the bound: a beta of shape
#: ``kappa x share`` = 0.02, most windows near 0 and a rare one far above (4.6% at 96 windows, 4.9% at 192). Shown and
#: said as a limit, not claimed: the studentized bootstrap misses a mean this skewed (as it does lognormal sigma 0.9
#: in ``simulate_windows.py``), and no count of the grid brings it back within the bound.
UNCLAIMED = ("1,023 positions, limit 0.001, kappa 20",)
BEGIN, END = "<!-- simulate_shares: begin -->", "<!-- simulate_shares: end -->"


def windows(rng, n: int, positions, share: float, kappa: float, zeros: float) -> np.ndarray:
    """One draw's per-window ``[n, 2]`` rows of (positions counted, positions): zero-inflated beta-binomial."""
    m = rng.integers(positions[0], positions[1] + 1, n) if isinstance(positions, tuple) else np.full(n, positions)
    mean = share / (1 - zeros)
    p = rng.beta(mean * kappa, (1 - mean) * kappa, n) * (rng.random(n) >= zeros)
    return np.stack([rng.binomial(m, p), m], axis=1).astype(float)


def verdict(kind, rows: np.ndarray, policy: GateConfig, iters: int, seed: int) -> tuple[float, float, bool]:
    """The gate's interval of ``kind`` over ``rows`` and whether it judges a pass."""
    low, high = paired_interval(kind, None, rows, iters, CONFIDENCE, seed)
    value = rows[:, 0].sum() / rows[:, 1].sum()
    row = MetricRow("sim", MetricId(kind.measures[0], "sim"), value, kind.reference, len(rows), True, low, high,
                    math.nan, CONFIDENCE)
    return low, high, judge(row, policy).verdict == PASS


def cell(setting: tuple, n: int, factor: float, reps: int, iters: int, seed: int, rng) -> dict[str, float]:
    """Over ``reps`` draws: the share of tail passes and of intervals covering the truth, that of upper ends below
    it (a miss: at the limit, a false pass), and where ``factor`` is 1 top-1 agreement's passes on the same draws."""
    positions, limit, kappa, zeros = setting
    truth = factor * limit
    policy = GateConfig(max_kl_tail_share=limit, min_top1_agreement=1 - limit)
    found = {"pass": 0, "cover": 0, "upper miss": 0, "top1 pass": 0, "zero": 0}
    for r in range(reps):
        rows = windows(rng, n, positions, truth, kappa, zeros)
        low, high, passed = verdict(TAIL, rows, policy, iters, seed + r)
        found["pass"] += passed
        found["cover"] += low <= truth <= high
        found["upper miss"] += high < truth
        found["zero"] += rows[:, 0].sum() == 0
        if factor == 1.0:
            found["top1 pass"] += verdict(AGREEMENT, np.stack([rows[:, 1] - rows[:, 0], rows[:, 1]], 1), policy,
                                          iters, seed + r)[2]
    return {k: v / reps for k, v in found.items()}


def _cell(job: tuple) -> dict[str, float]:
    j, n, f, reps, iters, seed = job
    reps = reps if FACTORS[f] == 1.0 else max(reps // 4, 1)
    return cell(list(SETTINGS.values())[j], n, FACTORS[f], reps, iters, seed,
                np.random.default_rng([seed, j, n, f]))


def simulate(args) -> dict:
    jobs = [(j, n, f, args.reps, args.iters, args.seed) for j in range(len(SETTINGS)) for n in WINDOWS
            for f in range(len(FACTORS))]
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        found = pool.map(_cell, jobs, chunksize=1)
    cells = {name: {} for name in SETTINGS}
    for (j, n, f, *_), got in zip(jobs, found):
        cells[list(SETTINGS)[j]].setdefault(str(n), {})[str(FACTORS[f])] = got
    return {"cells": cells, "limits": {name: s[1] for name, s in SETTINGS.items()}}


def mc_error(p: float, reps: int) -> float:
    """The Monte-Carlo standard error of a rate ``p`` over ``reps`` draws."""
    return (p * (1 - p) / reps) ** 0.5


def table(results: dict, reps: int, iters: int, seed: int) -> str:
    power_reps = max(reps // 4, 1)
    lines = [f"False PASS of a share of positions with its true value at the limit (nominal at most {ALPHA:.1%}; "
             f"Monte-Carlo standard error {mc_error(ALPHA, reps):.2%} at {reps:,} draws), the same draws' top-1 "
             f"agreement against 1 - limit, the 95% interval's coverage, the share of draws that counted no position "
             f"at all, and the power (passes) at 0.8 and 0.5 of the limit ({power_reps:,} draws; standard error at "
             f"most {mc_error(0.5, power_reps):.1%}); {iters:,} resamples each (seed {seed}). **Bold**: a false pass "
             f"beyond {ALPHA:.1%} + 3 standard errors; (not claimed): a setting whose false pass is beyond it (a "
             f"limit).", "",
             "| setting | limit | windows | false PASS (tail) | false PASS (top-1) | coverage | none counted "
             "| power at 0.8 | power at 0.5 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    bound = ALPHA + 3 * mc_error(ALPHA, reps)
    for name, by_n in results["cells"].items():
        for n, c in by_n.items():
            at = c["1.0"]
            wrong = f"**{at['pass']:.2%}**" if at["pass"] > bound else f"{at['pass']:.2%}"
            mark = " (not claimed)" if name in UNCLAIMED else ""
            lines.append(f"| {name}{mark} | {results['limits'][name]:g} | {n} | {wrong} | {at['top1 pass']:.2%} | "
                         f"{at['cover']:.1%} | {at['zero']:.1%} | {c['0.8']['pass']:.0%} | {c['0.5']['pass']:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    return run(argv, "simulate_shares", __doc__, simulate,
               lambda done, args: table(done, args.reps, args.iters, args.seed), (BEGIN, END), ALPHA,
               reps=1000, iters=1000, seed=SEED, jobs=True)


if __name__ == "__main__":
    sys.exit(run_script("simulate_shares", main))
