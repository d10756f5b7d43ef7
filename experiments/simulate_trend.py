"""How the trend of KL per doubling of the position is estimated, and from how many documents its interval decides
(issue 53 item 3): the bias of the old and new estimator, and the new interval's misses, by simulation.

- **old** (kvquant before): the least-squares slope of ``ln`` (a document's mean KL in a bucket) on ``log2`` (the
  bucket's mean position), pooled over documents, percentile bootstrap over documents. Where every document covers
  every bucket (here, and in every committed report) its slope is the mean of the documents' own slopes. The buckets
  double in size, and the log of a mean over few positions is lower than over many (Jensen): where per-position KL
  is noisy the first buckets' logs are pulled down and the slope up, by an amount more documents do not shrink.
- **new** (``kvquant.runner.positions.trend``): the quasi-Poisson fit ``mean KL = exp(a + b log2 position)`` on each
  bucket's summed KL and its positions: ``b`` solves ``sum(x n e^(b x)) / sum(n e^(b x)) = C``, where ``C`` is the
  KL-weighted mean ``x`` over documents, a ratio of sums (``sum_d sum_b x_b KL_db / sum_d sum_b KL_db``) that no
  logarithm of a small-sample mean enters. Its interval is the gate's studentized bootstrap of ``C`` over documents
  (``kvquant.runner.bootstrap.bootstrap_t``) mapped through the increasing ``C -> b`` (a monotone map keeps the
  coverage).

Generators, each a way to draw ``n`` documents' per-bucket summed KL with a known true factor per doubling (the
ratio of the true mean KL per position between buckets, ``factor ** (x_b - x_0)``):

- ``committed``: the committed long reports' own per-position KL (``documents/doc-N.json``) with any trend in
  position removed: each document's positions cut into blocks of 64 (a partial last block left out) that are
  shuffled for every drawn document, so the expected KL is the document's mean at every position (true
  factor 1) while the noise within a bucket, its correlation over a block and the spread between documents are
  the reports'. A draw picks one setting of the group and ``n`` of its documents with replacement. Groups (one
  layout each): SmolLM2 8K (``smollm2-long``, ``smollm2-long-engines``: 10 settings, 8 documents each), Gemma 3 2K
  (``gemma3-where``: 7 x 8), Gemma 3 8K (``gemma3-long-engines``: 5 x 4), Gemma 3 32K (``gemma3-long``: 5 x 3);
  SmolLM2 8K also with a true trend (the shuffled documents' buckets scaled by ``factor ** (x_b - x_0)``).
- ``gamma``: per-position KL independent gamma of shape ``k`` (``k = 1``: exponential; ``k = 0.05``: a
  coefficient of variation of 4.5 per position), a document's scale lognormal (sigma 0.5), the SmolLM2 8K layout;
  a bucket's sum drawn as one gamma of shape ``k`` times its positions (exact).

Per cell (generator, ``n``): the mean of each estimator's ``ln factor`` minus the true one, shown as a factor
(bias), and the new interval's misses: its lower end above the truth (with a true factor 1: a false **grows**) and
its upper end below it (a false **shrinks**), nominal 2.5% each; the old interval's beside it. The count of an end
(``grows``: the lower end, ``shrinks``: the upper) is the smallest ``n`` of the grid at and beyond which every
generator misses at most ``BOUND`` there (nominal + 1 point: 2.9 Monte-Carlo standard errors at 2,000 draws).
Then every committed report's trends, old (its results.json) and new (from its documents/), with the verdicts
today's counts give. ``--write-docs`` writes both into ``docs/gate.md``; ``kvquant.runner.counts`` holds the
counts::

    PYTHONPATH=. nice python experiments/simulate_trend.py --write-docs   # experiments/simulate_trend.json
    PYTHONPATH=. python experiments/simulate_trend.py --render --write-docs   # the tables again, no simulation
"""

from __future__ import annotations

import multiprocessing
import runpy
import sys
from pathlib import Path

import numpy as np

from kvquant.errors import KVQuantError
from kvquant.exits import run_script
from kvquant.fs import read_json
from kvquant.runner.bootstrap import bootstrap_t
from kvquant.runner.positions import bucket_sums, slope_of, trend, trend_verdict

SEED = 20261209
GRID = (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
BOUND = 0.035
ALPHA = 0.025
BLOCK = 64
GROUPS = {"SmolLM2 8K": (("smollm2-long", "smollm2-long-engines"), (0, 512, 1024, 2048, 4096, 8192)),
          "Gemma 3 2K": (("gemma3-where",), (0, 512, 1024, 2048)),
          "Gemma 3 8K": (("gemma3-long-engines",), (0, 512, 1024, 2048, 4096, 8192)),
          "Gemma 3 32K": (("gemma3-long",), (0, 512, 1024, 2048, 4096, 8192, 16384, 32768))}
REPORTS = tuple(r for reports, _ in GROUPS.values() for r in reports)
BEGIN, END = "<!-- simulate_trend: begin -->", "<!-- simulate_trend: end -->"
HERE = Path(__file__).resolve().parent


def documents(report: Path) -> tuple[dict[str, list[list[float]]], dict]:
    """Per setting, each committed document's per-position KL, and the report's results.json."""
    doc = read_json(report / "results.json", "--root")
    if not isinstance(doc.get("candidates"), dict) or "edges" not in doc:
        raise KVQuantError(f"--root: {report / 'results.json'} is not a long report of experiments/long_divergence.py")
    kept = [read_json(report / "documents" / f"doc-{d}.json", "--root")["result"] for d in range(doc["documents"])]
    return {label: [k[label]["kl"] for k in kept] for label in doc["candidates"]}, doc


class Layout:
    """A report layout cut into ``blocks`` blocks of ``BLOCK`` positions (a partial last one left out): the first
    block of each bucket, the buckets' positions ``counts`` and ``x`` (as ``positions.bucket_sums`` gives them)."""

    def __init__(self, edges: tuple[int, ...], length: int):
        self.blocks = length // BLOCK
        _, self.counts, self.x = bucket_sums([[0.0] * (self.blocks * BLOCK)], edges)
        self.starts = np.array(edges[:len(self.x)]) // BLOCK


def committed_group(root: Path, reports, edges) -> tuple[Layout, list[np.ndarray]]:
    """A group's layout and, per setting, its documents' block sums ``[documents, blocks]``."""
    settings = [v for r in reports for v in documents(root / r)[0].values()]
    layout = Layout(edges, min(len(kl) for docs in settings for kl in docs))
    used = layout.blocks * BLOCK
    return layout, [np.array([np.asarray(kl[:used], float).reshape(-1, BLOCK).sum(1) for kl in docs])
                    for docs in settings]


def shuffled(layout: Layout, blocks: list[np.ndarray], factor: float):
    """Draw ``(rng, k, n) -> [k, n, buckets]`` summed KL: per draw a setting, ``n`` documents, blocks shuffled."""
    scale = factor ** (layout.x - layout.x[0])

    def draw(rng, k, n):
        out = np.empty((k, n, len(layout.x)))
        for i in range(k):
            pool = blocks[rng.integers(len(blocks))]
            chosen = pool[rng.integers(0, len(pool), n)]                  # [n, blocks]
            mixed = rng.permuted(chosen, axis=1)
            out[i] = np.add.reduceat(mixed, layout.starts, axis=1) * scale
        return out
    return draw


def gamma(layout: Layout, shape: float, factor: float):
    """Draw ``(rng, k, n) -> [k, n, buckets]``: per-position gamma(``shape``) KL summed exactly per bucket."""
    mean = factor ** (layout.x - layout.x[0])

    def draw(rng, k, n):
        scale = rng.lognormal(0.0, 0.5, size=(k, n, 1))
        return rng.gamma(shape * layout.counts, size=(k, n, len(layout.x))) * scale * mean / shape
    return draw


def generators(root: Path) -> dict[str, tuple]:
    """``{name: (draw, layout, true factor)}``."""
    out = {}
    groups = {name: committed_group(root, reports, edges) for name, (reports, edges) in GROUPS.items()}
    for name, (layout, blocks) in groups.items():
        factors = (1.0, 1.1, 1 / 1.1) if name == "SmolLM2 8K" else (1.0,)
        for f in factors:
            out[f"committed {name} ({len(blocks)} settings), x{f:.3f}"] = (shuffled(layout, blocks, f), layout, f)
    smol = groups["SmolLM2 8K"][0]
    for k, f in ((1.0, 1.0), (0.05, 1.0), (0.05, 1.1)):
        out[f"gamma shape {k}, x{f:.3f}"] = (gamma(smol, k, f), smol, f)
    return out


def estimates(sums: np.ndarray, layout: Layout, idx: np.ndarray) -> dict[str, np.ndarray]:
    """``ln factor`` and its interval ends ``[k]`` each, old and new, for summed KL ``[k, n, buckets]`` and
    resamples ``[k, iters, n]``."""
    x, counts = layout.x, layout.counts
    dx = x - x.mean()
    own = (np.log(sums / counts) * dx).sum(-1) / (dx * dx).sum()            # [k, n]: each document's old slope
    boot = np.take_along_axis(np.broadcast_to(own[:, None, :], idx.shape), idx, -1).mean(-1)
    old_low, old_high = np.quantile(boot, [ALPHA, 1 - ALPHA], axis=-1, method="inverted_cdf")
    mass, moment = sums.sum(-1), sums @ x
    low, high = bootstrap_t(moment, mass, idx, 1 - 2 * ALPHA)
    return {"old": own.mean(-1), "old low": old_low, "old high": old_high,
            "new": slope_of(moment.sum(-1) / mass.sum(-1), x, counts), "new low": slope_of(low, x, counts),
            "new high": slope_of(high, x, counts)}


def cell(draw, layout: Layout, factor: float, n: int, reps: int, iters: int, rng) -> dict[str, float]:
    """Bias of each estimator (mean ``ln factor`` error) and each interval's misses at each end."""
    data_rng, boot_rng = rng.spawn(2)
    truth = np.log(factor)
    sums = {k: 0.0 for k in ("old bias", "new bias", "old grows", "old shrinks", "new grows", "new shrinks")}
    block = max(1, 2_000_000 // (iters * n))
    for start in range(0, reps, block):
        k = min(block, reps - start)
        e = estimates(draw(data_rng, k, n), layout, boot_rng.integers(0, n, size=(k, iters, n)))
        for m in ("old", "new"):
            sums[f"{m} bias"] += float((e[m] - truth).sum())
            sums[f"{m} grows"] += float((e[f"{m} low"] > truth).sum())
            sums[f"{m} shrinks"] += float((e[f"{m} high"] < truth).sum())
    return {k: v / reps for k, v in sums.items()}


_GENERATORS: dict[str, tuple] = {}  # what the worker processes draw from (inherited at fork)


def _cell(job: tuple[int, int, int, int, int]) -> dict[str, float]:
    j, n, reps, iters, seed = job
    draw, layout, factor = list(_GENERATORS.values())[j]
    return cell(draw, layout, factor, n, reps, iters, np.random.default_rng([seed, j, n]))


def minimum(cells: dict, end: str, method: str = "new") -> int | None:
    """The smallest ``n`` from which every generator misses at most BOUND at ``end`` (``grows``: the lower end,
    ``shrinks``: the upper); None: no ``n`` of the grid."""
    found = None
    for n in reversed(GRID):
        if all(by_n[str(n)][f"{method} {end}"] <= BOUND for by_n in cells.values()):
            found = n
        else:
            break
    return found


def committed_trends(root: Path) -> list[dict]:
    """Every committed long report's trend per setting: old (as its results.json holds it) and new."""
    out = []
    for report in REPORTS:
        kl, doc = documents(root / report)
        for label, per_position in kl.items():
            t = trend(per_position, tuple(doc["edges"]))
            out.append({"report": report, "setting": label, "documents": doc["documents"],
                        "old": doc["candidates"][label]["trend"], "new": vars(t)})
    return out


def simulate(args) -> dict:
    _GENERATORS.update(generators(args.root))
    jobs = [(j, n, args.reps, args.iters, args.seed) for j in range(len(_GENERATORS)) for n in GRID]
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        found = pool.map(_cell, jobs, chunksize=1)
        pool.close()  # the workers end on their own (terminated, each printed kvquant.exits' Terminated)
        pool.join()
    cells = {name: {} for name in _GENERATORS}
    for (j, n, *_), got in zip(jobs, found):
        cells[list(_GENERATORS)[j]][str(n)] = got
    return {"cells": cells, "minimum": {end: minimum(cells, end) for end in ("grows", "shrinks")},
            "old minimum": {end: minimum(cells, end, "old") for end in ("grows", "shrinks")},
            "committed": committed_trends(args.root)}


def _pct(x: float) -> str:
    return f"**{x:.1%}**" if x > BOUND else f"{x:.1%}"


def _interval(t: dict) -> str:
    return f"{t['factor']:.3f} [{t['low']:.3f}, {t['high']:.3f}]"


def table(results: dict, reps: int, iters: int, seed: int) -> str:
    cells, se = results["cells"], (ALPHA * (1 - ALPHA) / reps) ** 0.5
    head = "| generator | | " + " | ".join(map(str, GRID)) + " |"
    rule = "|---|---|" + "---:|" * len(GRID)
    lines = [f"Trend per doubling over n documents: bias of each estimator (the mean estimated factor over the true "
             f"one, from the mean of ln factor) and misses of each 95% interval: lower end above the truth (with a "
             f"true factor 1: a false grows) / upper end below it (a false shrinks); nominal 2.5% each, bound "
             f"{BOUND:.1%} (Monte-Carlo standard error {se:.2%} per miss rate); {reps:,} draws per cell, {iters:,} "
             f"resamples each (seed {seed}). **Bold**: above the bound.", "", head, rule]
    for g, by_n in cells.items():
        for m, what in (("old", "old: bias; misses (percentile)"), ("new", "new: bias; misses (bootstrap-t)")):
            lines.append(f"| {g} | {what} | " + " | ".join(
                f"{np.exp(c[f'{m} bias']):.3f}; {_pct(c[f'{m} grows'])} / {_pct(c[f'{m} shrinks'])}"
                for c in (by_n[str(n)] for n in GRID)) + " |")
    mins, old = results["minimum"], results["old minimum"]
    lines += ["", f"Counts (the smallest n from which every generator stays within the bound at that end): new: "
              f"grows {mins['grows'] or 'none'}, shrinks {mins['shrinks'] or 'none'}; old: grows "
              f"{old['grows'] or 'none'}, shrinks {old['shrinks'] or 'none'}.", "",
              "The committed reports' trends, old (their results.json: the old estimator and interval) and new "
              "(`positions.trend` on their documents/), each judged under today's counts:", "",
              "| report | setting | documents | old factor [95%] | old verdict | new factor [95%] | new verdict |",
              "|---|---|---:|---|---|---|---|"]
    for r in results["committed"]:
        old_verdict = trend_verdict(r["old"]["low"], r["old"]["high"], r["documents"])
        lines.append(f"| {r['report']} | {r['setting']} | {r['documents']} | {_interval(r['old'])} | {old_verdict} | "
                     f"{_interval(r['new'])} | {trend_verdict(r['new']['low'], r['new']['high'], r['documents'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    run = runpy.run_path(str(HERE / "simulate_counts.py"))["run"]  # its command runner (experiments/ is no package)
    return run(argv, "simulate_trend", __doc__, simulate,
               lambda results, args: table(results, args.reps, args.iters, args.seed), (BEGIN, END), BOUND,
               reps=2000, iters=500, seed=SEED, jobs=True)


if __name__ == "__main__":
    sys.exit(run_script("simulate_trend", main))
