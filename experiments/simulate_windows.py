"""Which interval of a mean over windows (documents) holds its error with skewed per-window KL, and from how many
windows (issue 53 item 3): the coverage of four 95% intervals of a mean over ``n`` windows, by simulation.

The intervals, each from the same ``iters`` resamples ``rng.integers(0, n, size=(iters, n))`` the gate draws:

- **percentile**: the percentile bootstrap kvquant used before (ranks ``iters x 0.025`` and ``iters x 0.975``);
- **bootstrap-t**: the studentized bootstrap kvquant uses now (``kvquant.runner.bootstrap.bootstrap_t``, called
  here on whole batches of samples: the gate's own function);
- **BCa**: the bias-corrected and accelerated percentile interval (Efron 1987; the acceleration from the jackknife,
  closed form for a mean);
- **Student t**: ``mean +- t(n-1) sd / sqrt(n)``, no resampling.

The generators (each a distribution of per-window values; only their shape matters, every interval being
equivariant under scale):

- ``committed windows``: per-window mean KL of ``reports/smollm2-decide``'s five candidates on WikiText-2 (its
  carried partial results: 16 windows of 1,024 tokens, each cut into two of 512, as ``make run`` reads them), each
  divided by its candidate's mean, pooled (160 values);
- ``committed NLL excess``: the candidate's minus the baseline's summed NLL per window (the perplexity ratio's
  numerator), standardised per candidate, pooled (80 values);
- ``committed long buckets``: the long reports' per-document bucket KL relative to its bucket's mean
  (``simulate_counts.py``'s ``committed`` mean generator, 568 values: a heavy-tailed mixture);
- lognormal (sigma 0.25, 0.5, 0.9) and gamma (shape 2, 0.5): skew 0.8, 1.8, 3.9, 1.4, 2.8.

Per cell (generator, ``n``, interval): the misses at each end (true mean above the upper end: for a loss a wrong
pass, the PASS margin's error; below the lower end: a wrong fail), nominal 2.5% each; the **false PASS** with the
true mean 1% beyond the threshold (``upper < truth / 1.01``; at the threshold it is the upper end's miss); and the
**power**: how often a setting whose true mean is half the threshold passes (``upper < 2 truth``; not for the NLL
excess, whose mean is not a scale). The minimum count of an end is the smallest ``n`` of the grid at and beyond
which every generator deciding that end misses at most ``BOUND`` there (nominal + 1 point: 2.9 Monte-Carlo
standard errors at 2,000 draws; :func:`decides`): both ends the committed windows and NLL excess, lognormal 0.25 and
0.5, gamma 2; the fail end only the pooled long-bucket mixture (the first run had it decide both: its pass end
reaches the bound at no ``n`` under any of the four intervals, so it is shown there and said as a limit, as
``simulate_counts.py`` does); neither lognormal 0.9 and gamma 0.5 (skewer than any committed spread), shown with
the count they would need. ``kvquant.runner.counts`` holds the bootstrap-t's counts (a fail's raised to 4, the
fewest windows whose 95% interval can be bounded)::

    PYTHONPATH=. nice python experiments/simulate_windows.py --write-docs   # experiments/simulate_windows.json
    PYTHONPATH=. python experiments/simulate_windows.py --render --write-docs   # the table again, no simulation
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np
from scipy.stats import t as student

from kvquant.exits import run_script
from kvquant.fs import read_json
from kvquant.runner.bootstrap import bootstrap_t

SEED = 20261208
GRID = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
BOUND = 0.035
ALPHA = 0.025
METHODS = ("percentile", "bootstrap-t", "BCa", "Student t")
DECIDED_BY = "bootstrap-t"
BEGIN, END = "<!-- simulate_windows: begin -->", "<!-- simulate_windows: end -->"
HERE = Path(__file__).resolve().parent


def _counts_module():
    spec = importlib.util.spec_from_file_location("simulate_counts", HERE / "simulate_counts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed_windows(root: Path) -> tuple[np.ndarray, np.ndarray]:
    """Relative per-window KL (512-token halves) and standardised per-window NLL excess of smollm2-decide."""
    carried = root / "smollm2-decide" / "carried"
    base = np.asarray(read_json(carried / "baseline" / "ppl__wikitext2.json", "carried")["result"]["nll"], float)
    relative, excess = [], []
    for folder in sorted(p for p in carried.iterdir() if p.name != "baseline" and (p / "kl__wikitext2.json").exists()):
        per_token = read_json(folder / "kl__wikitext2.json", "carried")["result"]["kl"]
        w = np.array([np.mean(t[a:a + 512]) for t in per_token for a in range(0, len(t), 512)])
        relative.append(w / w.mean())
        e = np.asarray(read_json(folder / "ppl__wikitext2.json", "carried")["result"]["nll"], float) - base
        excess.append((e - e.mean()) / e.std(ddof=1))
    return np.concatenate(relative), np.concatenate(excess)


def generators(root: Path) -> dict[str, tuple]:
    """``{name: (draw(rng, shape), true mean, scaled)}`` (``scaled``: the mean is a positive scale)."""
    windows, excess = committed_windows(root)
    buckets, _ = _counts_module().committed_values(root)

    def empirical(values):
        return lambda rng, shape: rng.choice(values, size=shape)

    def lognormal(sigma):
        return lambda rng, shape: rng.lognormal(0.0, sigma, size=shape)

    def gamma(shape_k):
        return lambda rng, shape: rng.gamma(shape_k, 1.0, size=shape)

    return {
        f"committed windows ({len(windows)} values)": (empirical(windows), float(windows.mean()), True),
        f"committed NLL excess ({len(excess)} values)": (empirical(excess), float(excess.mean()), False),
        f"committed long buckets ({len(buckets)} values)": (empirical(buckets), float(buckets.mean()), True),
        "lognormal sigma 0.25": (lognormal(0.25), float(np.exp(0.25 ** 2 / 2)), True),
        "lognormal sigma 0.5": (lognormal(0.5), float(np.exp(0.5 ** 2 / 2)), True),
        "gamma shape 2": (gamma(2.0), 2.0, True),
        "lognormal sigma 0.9": (lognormal(0.9), float(np.exp(0.9 ** 2 / 2)), True),
        "gamma shape 0.5": (gamma(0.5), 0.5, True),
    }


def decides(name: str) -> tuple[str, ...]:
    """The ends a generator's misses set a count for: the pooled long-bucket mixture the fail end only (its pass end
    reaches the bound at no n of the grid under any of the four intervals: a scale mixture of buckets heavier-tailed
    than any one bucket; shown, and said as a limit), the two skewest parametric ones neither, the others both."""
    if name.startswith("committed long buckets"):
        return ("fail",)
    return () if name in ("lognormal sigma 0.9", "gamma shape 0.5") else ("pass", "fail")


def bca(y: np.ndarray, means: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """BCa interval of the mean from samples ``y`` ``[k, n]`` and their resampled means ``[k, iters]``."""
    normal = NormalDist()
    m = y.mean(-1)
    iters = means.shape[-1]
    share = np.clip((means < m[:, None]).mean(-1), 1 / iters, 1 - 1 / iters)
    z0 = np.array([normal.inv_cdf(s) for s in share])
    u = y - m[:, None]
    spread = (u * u).sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        accel = np.where(spread > 0, (u ** 3).sum(-1) / (6 * spread ** 1.5), 0.0)
    ordered = np.sort(means, axis=-1)
    ends = []
    for z in (normal.inv_cdf(ALPHA), normal.inv_cdf(1 - ALPHA)):
        level = np.array([normal.cdf(v) for v in z0 + (z0 + z) / (1 - accel * (z0 + z))])
        rank = np.clip(np.ceil(level * iters).astype(int) - 1, 0, iters - 1)
        ends.append(np.take_along_axis(ordered, rank[:, None], -1)[:, 0])
    return ends[0], ends[1]


def intervals(y: np.ndarray, idx: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each method's ``(low, high)`` ``[k]`` for samples ``y`` ``[k, n]`` and resample indices ``[k, iters, n]``."""
    n = y.shape[-1]
    means = np.take_along_axis(np.broadcast_to(y[:, None, :], idx.shape), idx, -1).mean(-1)
    low, high = np.quantile(means, [ALPHA, 1 - ALPHA], axis=-1, method="inverted_cdf")
    half = student.ppf(1 - ALPHA, n - 1) * y.std(-1, ddof=1) / np.sqrt(n)
    return {"percentile": (low, high), "bootstrap-t": bootstrap_t(y, None, idx, 1 - 2 * ALPHA), "BCa": bca(y, means),
            "Student t": (y.mean(-1) - half, y.mean(-1) + half)}


def cell(draw, truth: float, n: int, reps: int, iters: int, rng, block: int = 100) -> dict[str, list[float]]:
    """Per method: [upper-end miss, lower-end miss, false pass 1% beyond the threshold, power at half of it]."""
    data_rng, boot_rng = rng.spawn(2)
    found = {m: np.zeros(4) for m in METHODS}
    for start in range(0, reps, block):
        k = min(block, reps - start)
        y = draw(data_rng, (k, n))
        idx = boot_rng.integers(0, n, size=(k, iters, n))
        for method, (low, high) in intervals(y, idx).items():
            found[method] += [(high < truth).sum(), (low > truth).sum(), (high < truth / 1.01).sum(),
                              (high < 2 * truth).sum()]
    return {m: [float(v) / reps for v in found[m]] for m in METHODS}


def minimum(cells: dict, method: str, end: str, deciding=decides) -> int | None:
    """The smallest ``n`` from which every generator deciding ``end`` (``pass``: the upper end, ``fail``: the
    lower) misses at most BOUND there under ``method``; None: no ``n`` of the grid."""
    side = {"pass": 0, "fail": 1}[end]
    found = None
    for n in reversed(GRID):
        if all(cells[g][str(n)][method][side] <= BOUND for g in cells if end in deciding(g)):
            found = n
        else:
            break
    return found


def reached(cells: dict, generator: str, method: str, end: str) -> int | None:
    """The smallest ``n`` from which ``generator`` alone stays within BOUND at ``end``."""
    return minimum({generator: cells[generator]}, method, end, lambda g: (end,))


def minima(cells: dict) -> dict[str, dict[str, int | None]]:
    """Per interval, the count of each end (:func:`minimum`)."""
    return {m: {end: minimum(cells, m, end) for end in ("pass", "fail")} for m in METHODS}


_GENERATORS: dict[str, tuple] = {}  # what the worker processes draw from (inherited at fork)


def _cell(job: tuple[int, int, int, int, int]) -> dict[str, list[float]]:
    j, n, reps, iters, seed = job
    draw, truth, _ = list(_GENERATORS.values())[j]
    return cell(draw, truth, n, reps, iters, np.random.default_rng([seed, j, n]))


def simulate(args) -> dict:
    _GENERATORS.update(generators(args.root))
    jobs = [(j, n, args.reps, args.iters, args.seed) for j in range(len(_GENERATORS)) for n in GRID]
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        found = pool.map(_cell, jobs, chunksize=1)
    cells = {name: {} for name in _GENERATORS}
    for (j, n, *_), got in zip(jobs, found):
        cells[list(_GENERATORS)[j]][str(n)] = got
    return {"cells": cells, "scaled": {name: g[2] for name, g in _GENERATORS.items()}, "minimum": minima(cells)}


def _pct(x: float) -> str:
    return f"**{x:.1%}**" if x > BOUND else f"{x:.1%}"


def table(results: dict, reps: int, iters: int, seed: int) -> str:
    cells, shown = results["cells"], (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    se = (ALPHA * (1 - ALPHA) / reps) ** 0.5
    head = "| generator | interval | " + " | ".join(map(str, shown)) + " |"
    rule = "|---|---|" + "---:|" * len(shown)
    lines = [f"Misses of four 95% intervals of a mean over n windows: the true mean above the upper end (the PASS "
             f"margin's error: a false pass with the true mean at the threshold) / below the lower end (a false fail); "
             f"nominal 2.5% each, bound {BOUND:.1%} (Monte-Carlo standard error {se:.2%}); {reps:,} draws per cell, "
             f"{iters:,} resamples each (seed {seed}). **Bold**: above the bound.", "", head, rule]
    for g, by_n in cells.items():
        mark = f" (decides: {', '.join(decides(g))})" if decides(g) else " (shown)"
        for m in METHODS:
            lines.append(f"| {g}{mark} | {m} | " + " | ".join(
                f"{_pct(by_n[str(n)][m][0])} / {_pct(by_n[str(n)][m][1])}" for n in shown) + " |")
    lines += ["", "False PASS with the true mean 1% beyond the threshold / power (passes with the true mean at half "
              "the threshold), percentile (old) and bootstrap-t (new):", "", head, rule]
    for g, by_n in cells.items():
        if results["scaled"][g]:
            for m in ("percentile", "bootstrap-t"):
                lines.append(f"| {g} | {m} | " + " | ".join(
                    f"{by_n[str(n)][m][2]:.1%} / {by_n[str(n)][m][3]:.0%}" for n in shown) + " |")
    mins = minima(cells)
    lines += ["", "Minimum counts (the smallest n from which every deciding generator stays within the bound at that "
              "end; pass: the upper end, fail: the lower): " + "; ".join(
                  f"{m}: pass {mins[m]['pass'] or 'none'}, fail {mins[m]['fail'] or 'none'}" for m in METHODS)
              + ". Shown generators under bootstrap-t reach the bound at the upper end from: " + "; ".join(
                  f"{g} {reached(cells, g, DECIDED_BY, 'pass') or 'beyond 256'}" for g in cells
                  if "pass" not in decides(g)) + "."]
    return "\n".join(lines)


def main(argv=None) -> int:
    return _counts_module().run(argv, "simulate_windows", __doc__, simulate,
                                lambda results, args: table(results, args.reps, args.iters, args.seed), (BEGIN, END),
                                BOUND, reps=2000, iters=1000, seed=SEED, jobs=True)


if __name__ == "__main__":
    sys.exit(run_script("simulate_windows", main))
