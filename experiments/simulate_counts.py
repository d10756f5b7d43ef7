"""How many documents a percentile bootstrap needs (issue 53 item 3): the coverage of kvquant's bootstrap intervals
over ``n`` documents (or windows), by simulation, and the minimum count below which the gate says "too few
documents" instead of a verdict.

Two kinds of interval, both a percentile bootstrap over documents (``iters`` resamples, the ends at ranks
``iters x 0.025`` and ``iters x 0.975``, ``method="inverted_cdf"``):

- **mean**: the mean over documents of a per-document value: a position bucket (``positions.buckets``, the
  runner's ``kl/<text>@<end>`` and ``top1/<text>@<end>``), and a perplexity set's KL, top-1 and perplexity ratio
  over windows (``gate.paired_interval``: sums over equal windows, so the mean of each window's value).
- **trend**: the trend kvquant had before issue 53's fix (``positions.trend`` now is a quasi-Poisson fit with a
  studentized interval, simulated by ``experiments/simulate_trend.py``, which sets its count): the slope of ``ln KL``
  on ``log2`` position. Where every document reaches every bucket (as in every committed report) the pooled slope
  is the mean of the documents' own slopes (the same ``x`` for each), and a resample's slope the mean of its
  documents' slopes: the same bootstrap of a mean, over the per-document slopes. Its rows stay as the record of that
  interval's misses.

Each cell draws ``reps`` samples of ``n`` documents from a generating distribution and resamples each exactly as
kvquant does (the same ``rng.integers(0, n, size=(iters, n))``); a miss is the true mean above the upper end (the
dangerous one for KL: a wrong pass) or below the lower end. Nominal is 2.5% on each side. The generators:

- ``committed``: the per-document values of the committed long reports with at least 8 documents
  (``reports/smollm2-long``, ``smollm2-long-engines``, ``gemma3-where``): for the mean, each document's KL in a
  bucket divided by that bucket's mean over the report's documents (all candidates and buckets pooled: a
  skewed, heavy-tailed mixture); for the trend, each document's slope minus its candidate's mean slope, over its
  candidate's standard deviation, pooled;
- lognormal variants (``sigma`` of ``ln KL`` across documents: 0.1-0.3 in most committed buckets, up to 0.9 in
  Gemma's first 512 positions), a normal, and for slopes Student's t with 3 degrees of freedom (heavy tails).

A verdict reads one end: for a loss (KL, the disagreement of top-1, the excess NLL behind a perplexity ratio) a
pass reads the upper end (a miss there is a wrong pass) and a fail the lower end. The minimum count of an end is
the smallest ``n`` of the grid at and beyond which every generator that decides it misses at most ``BOUND``
(nominal 2.5% + 1 point: 4 Monte-Carlo standard errors at 4,000 draws) there; a trend's ends are alike (grows,
shrinks). Deciding: for the mean's fail end the right-skewed generators (``committed``, lognormal 0.25: every
committed spread is right-skewed); for its pass end lognormal 0.25, the typical spread within a committed bucket
(the ``committed`` mixture and the lognormals 0.5 and 0.9 reach the bound at no ``n`` of the grid: shown, not
deciding); for the trend all three. ``--write-docs`` puts the table into ``docs/gate.md``; today's counts are
``simulate_windows.py``'s and ``simulate_trend.py``'s::

    PYTHONPATH=. python experiments/simulate_counts.py --write-docs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from kvquant.errors import KVQuantError, at_least, script_parser
from kvquant.exits import run_script
from kvquant.fs import marked_section, read_json, writable_target, write_file
from kvquant.experiment.gate_config import MAX_BOOTSTRAP

SEED = 20261207
GRID = (2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 96, 128, 192, 256)
BOUND = 0.035
NOMINAL = 0.025
REPORTS = ("smollm2-long", "smollm2-long-engines", "gemma3-where")
BEGIN, END = "<!-- simulate_counts: begin -->", "<!-- simulate_counts: end -->"
DOCS = Path("docs/gate.md")
#: the most samples per cell (each resampled ``iters`` times: more is hours, not minutes)
MAX_DRAWS = 100_000


def per_document(report: Path) -> tuple[list[np.ndarray], list[int]]:
    """Each candidate's ``[documents, buckets]`` per-document mean KL of a committed long report."""
    doc = read_json(report / "results.json", "--root")
    if not isinstance(doc.get("candidates"), dict) or "edges" not in doc:
        raise KVQuantError(f"--root: {report / 'results.json'} is not a long report of experiments/long_divergence.py")
    return [np.asarray(c["per_document_kl"], dtype=float) for c in doc["candidates"].values()], doc["edges"]


def committed_values(root: Path) -> tuple[np.ndarray, np.ndarray]:
    """The two ``committed`` generators: relative per-document KL and standardised per-document slopes."""
    relative, slopes = [], []
    for name in REPORTS:
        cells, edges = per_document(root / name)
        x = np.log2([(a + 1 + b) / 2 for a, b in zip(edges, edges[1:])])
        x = x - x.mean()
        for m in cells:
            relative.append((m / m.mean(axis=0)).ravel())
            s = (np.log(m) * x).sum(1) / (x * x).sum()
            slopes.append((s - s.mean()) / s.std(ddof=1))
    return np.concatenate(relative), np.concatenate(slopes)


def generators(root: Path) -> dict[str, dict]:
    """Per kind, ``{name: (draw(rng, shape), true mean, the ends it decides: "pass" (upper), "fail" (lower))}``."""
    relative, slopes = committed_values(root)

    def empirical(values):
        return lambda rng, shape: rng.choice(values, size=shape)

    def lognormal(sigma):
        return lambda rng, shape: rng.lognormal(0.0, sigma, size=shape)

    return {
        "mean": {
            f"committed KL ({len(relative)} values)": (empirical(relative), float(relative.mean()), ("fail",)),
            "lognormal sigma 0.25": (lognormal(0.25), float(np.exp(0.25 ** 2 / 2)), ("pass", "fail")),
            "lognormal sigma 0.5": (lognormal(0.5), float(np.exp(0.5 ** 2 / 2)), ()),
            "lognormal sigma 0.9": (lognormal(0.9), float(np.exp(0.9 ** 2 / 2)), ()),
            "normal": (lambda rng, shape: rng.normal(size=shape), 0.0, ()),
        },
        "trend": {
            f"committed slopes ({len(slopes)} values)": (empirical(slopes), float(slopes.mean()), ("pass", "fail")),
            "normal": (lambda rng, shape: rng.normal(size=shape), 0.0, ("pass", "fail")),
            "t, 3 df": (lambda rng, shape: rng.standard_t(3, size=shape), 0.0, ("pass", "fail")),
        },
    }


def misses(draw, truth: float, n: int, reps: int, iters: int, rng, block: int = 50) -> tuple[float, float]:
    """Shares of ``reps`` samples of ``n`` whose percentile-bootstrap 95% interval of the mean lies below the
    true mean (the upper end under it: a miss at the upper end) and above it; each resampled as kvquant does."""
    above = below = 0
    data_rng, boot_rng = rng.spawn(2)
    for start in range(0, reps, block):
        k = min(block, reps - start)
        x = draw(data_rng, (k, n))
        idx = boot_rng.integers(0, n, size=(k, iters, n))  # k calls of size (iters, n): the same stream
        stats = np.take_along_axis(x[:, None, :], idx, axis=2).mean(2)
        low, high = np.quantile(stats, [NOMINAL, 1 - NOMINAL], axis=1, method="inverted_cdf")
        above += int((high < truth).sum())
        below += int((low > truth).sum())
    return above / reps, below / reps


def minimum(cells: dict[str, dict[int, tuple[float, float]]], decides: dict[str, tuple[str, ...]],
            end: str) -> int | None:
    """The smallest ``n`` of the grid at and beyond which every generator deciding ``end`` (``pass``: the upper
    end, ``fail``: the lower) misses at most BOUND there (None: no ``n`` of the grid)."""
    side = {"pass": 0, "fail": 1}[end]
    found = None
    for n in reversed(GRID):
        if all(cells[g][n][side] <= BOUND for g in cells if end in decides[g]):
            found = n
        else:
            break
    return found


def simulate(args) -> dict:
    out = {}
    for k, (kind, gens) in enumerate(generators(args.root).items()):
        cells, decides = {}, {}
        for j, (name, (draw, truth, deciding)) in enumerate(gens.items()):
            cells[name] = {n: misses(draw, truth, n, args.reps, args.iters, np.random.default_rng([args.seed, k, j, n]))
                           for n in GRID}
            decides[name] = deciding
            print(f"simulate_counts: {kind} / {name}: " + ", ".join(
                f"{n}: {a:.1%}/{b:.1%}" for n, (a, b) in cells[name].items()), flush=True)
        out[kind] = {"cells": {g: {str(n): v for n, v in c.items()} for g, c in cells.items()}, "decides": decides,
                     "minimum": {end: minimum(cells, decides, end) for end in ("pass", "fail")}}
    return out


def table(results: dict, reps: int, iters: int) -> str:
    lines = [f"Misses of the percentile bootstrap's 95% interval of a mean over n documents: true mean above the "
             f"upper end / below the lower end (nominal 2.5% each; bound {BOUND:.1%}); {reps:,} draws per cell, "
             f"{iters:,} resamples each (seed {SEED}).", "",
             "| kind | generator | " + " | ".join(map(str, GRID)) + " |", "|---|---|" + "---:|" * len(GRID)]
    for kind, r in results.items():
        for g, cells in r["cells"].items():
            mark = f" (decides: {', '.join(r['decides'][g])})" if r["decides"][g] else " (shown)"
            lines.append(f"| {kind} | {g}{mark} | " + " | ".join(
                " / ".join(f"**{m:.1%}**" if m > BOUND else f"{m:.1%}" for m in cells[str(n)]) for n in GRID) + " |")
    lines += ["", "Each cell: upper end / lower end; **bold**: above the bound. For a loss a miss at the upper end is "
              "a wrong pass, at the lower end a wrong fail. Minimum counts (the smallest n from which every generator "
              "deciding that end stays within the bound): " + "; ".join(
                  f"{kind}: pass **{r['minimum']['pass']}**, fail **{r['minimum']['fail']}**"
                  for kind, r in results.items()) + "."]
    return "\n".join(lines)


def write_docs(text: str, path: Path, begin: str = BEGIN, end: str = END) -> None:
    """``text`` between the markers ``begin`` and ``end`` of ``path`` (the simulations' tables in docs/gate.md)."""
    head, tail = marked_section(path, begin, end, "--write-docs")
    write_file(path, head + begin + "\n" + text + "\n" + end + tail)


def saved_or_simulated(args, simulate, bound: float) -> dict:
    """``--render``: the results saved in ``--json`` (their draws, resamples and seed put into ``args``); else
    ``simulate(args)``'s, saved there first (``--json`` checked writable before the simulation, not after it)."""
    if args.render:
        done = read_json(args.json, "--render")
        args.reps, args.iters, args.seed = done["reps"], done["iters"], done["seed"]
        return done["results"]
    writable_target(args.json, "--json")
    results = simulate(args)
    write_file(args.json, json.dumps({"reps": args.reps, "iters": args.iters, "seed": args.seed, "bound": bound,
                                      "results": results}, indent=1) + "\n")
    return results


def run(argv, name: str, doc: str, simulate, render, marks: tuple[str, str], bound: float, reps: int, iters: int,
        seed: int, jobs: bool = False) -> int:
    """A simulation of the counts as a command (``simulate_counts``, ``_windows``, ``_trend``): its arguments
    (``--jobs`` where ``jobs``), ``simulate(args)`` saved to ``experiments/NAME.json`` (or the saved results with
    ``--render``), ``render(results, args)`` printed and with ``--write-docs`` put between ``marks`` in docs/gate.md
    (the markers checked before the simulation, not after it)."""
    parser = script_parser(name, doc)
    parser.add_argument("--reps", type=at_least(100, MAX_DRAWS), default=reps, help="samples per cell")
    parser.add_argument("--iters", type=at_least(100, MAX_BOOTSTRAP), default=iters,
                        help="bootstrap resamples (gate.bootstrap)")
    parser.add_argument("--seed", type=at_least(0), default=seed)
    if jobs:
        parser.add_argument("--jobs", type=at_least(1), default=2, help="processes (the cells are seeded alike)")
    parser.add_argument("--root", type=Path, default=Path("reports"), help="where the committed reports are")
    parser.add_argument("--json", type=Path, default=Path(f"experiments/{name}.json"))
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/gate.md")
    parser.add_argument("--render", action="store_true", help="simulate nothing: the table from --json's results")
    args = parser.parse_args(argv)
    if args.write_docs:
        marked_section(DOCS, *marks, "--write-docs")
    text = render(saved_or_simulated(args, simulate, bound), args)
    print(text)
    if args.write_docs:
        write_docs(text, DOCS, *marks)
    return 0


def main(argv=None) -> int:
    return run(argv, "simulate_counts", __doc__, simulate, lambda results, args: table(results, args.reps, args.iters),
               (BEGIN, END), BOUND, reps=4000, iters=1000, seed=SEED)


if __name__ == "__main__":
    sys.exit(run_script("simulate_counts", main))
