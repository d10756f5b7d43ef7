"""The accuracy gate's error and power by simulation (issue 53 item 1): kvquant's interval beside the one it replaced.

Paired 0/1 outcomes of ``n`` documents are drawn as their four counts (both right, only the baseline, only the
candidate, neither: a multinomial, as independent documents give), with the baseline right on a share ``acc`` of
documents and the candidate's true accuracy ratio ``ratio``: **one way**, every flip is a loss; **two way**, 2% of
documents are also gained (and as many more lost). A PASS is a lower end at or above the margin 0.97 (gate.py's
``judge``). Columns:

- one look at 95% (a config without sequential looks: a wrong pass may err 2.5%);
- one look at a 6-look plan's confidence (``look_confidence``: 99.17%, 0.42% one-sided);
- the whole sequential plan, ``looks(limit, 32 limit)`` (6 looks), judged at each look as
  ``kvquant.runner.judging.add_documents`` does: stop at a pass or a fail (a wrong pass may err 2.5% over all looks);
- power: the fewest documents (of 50, 100, 200, ...) at which a lossless candidate (ratio 1) passes one 95% look
  in at least 80% of draws.

``new`` is :func:`kvquant.runner.paired.paired_ratio_bounds`; ``old`` is :func:`old_dirichlet_interval`, the interval
the gate used before (kept here only to compare). Results go to a JSON file (``--json``), one section per call
(each well under 10 minutes on one core), and ``--write-docs`` puts the table into ``docs/gate.md``::

    PYTHONPATH=. python experiments/simulate_gate.py --section one-look
    PYTHONPATH=. python experiments/simulate_gate.py --section plan
    PYTHONPATH=. python experiments/simulate_gate.py --section power --write-docs
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from kvquant.errors import KVQuantError, at_least, script_parser
from kvquant.exits import run_script
from kvquant.fs import marked_section, read_json, writable_target, write_file
from kvquant.experiment.gate_config import look_confidence, looks
from kvquant.runner.paired import paired_ratio_bounds
from kvquant.experiment.gate_config import GateConfig

MARGIN = 0.97
DOCUMENTS = (50, 100, 200, 400, 1000, 2000, 5000)
ACCURACIES = (0.2, 0.5, 0.85)
FLIPS = {"one way": 0.0, "two way": 0.02}
RATIOS = (0.97, 0.96)  # at the margin, and 1% inside the null
PLAN_LIMITS = (50, 150)  # first looks of 6-look plans: to 1,600 and 4,800 documents
PLAN_LOOKS = 6
POWER_DOCUMENTS = tuple(50 * 2 ** k for k in range(11))  # 50 .. 51,200
SEED = 20261206
BEGIN, END = "<!-- simulate_gate: begin -->", "<!-- simulate_gate: end -->"
DOCS = Path("docs/gate.md")
#: the most draws per cell (a cell holds ``reps`` tables of four counts; more than this is hours, not minutes)
MAX_REPS = 1_000_000


def old_dirichlet_interval(table, confidences, draws: int = 20_000, seed: int = 0) -> list[tuple[float, float]]:
    """The interval gate.py used before issue 53, at each of ``confidences`` (from the same draws): the central
    ``confidence`` of the ratio under the Dirichlet posterior of the four counts with Jeffreys' half count on each
    (``draws`` seeded draws). It errs too often where few documents flip (kvquant no longer uses it)."""
    p = np.random.default_rng(seed).dirichlet(np.asarray(table, dtype=float) + 0.5, size=draws)
    ratios = (p[:, 0] + p[:, 2]) / (p[:, 0] + p[:, 1])
    ends = [e for c in confidences for e in ((1 - c) / 2, (1 + c) / 2)]
    found = np.quantile(ratios, ends, method="inverted_cdf")
    return [(float(found[2 * i]), float(found[2 * i + 1])) for i in range(len(confidences))]


class Old:
    """:func:`old_dirichlet_interval` remembered per table, at 95% and a 6-look plan's confidence (the only two
    the simulation asks for): the same table is judged once."""

    def __init__(self):
        self.confidences = (0.95, look_confidence(GateConfig(), PLAN_LOOKS))
        self.known: dict[tuple, list[tuple[float, float]]] = {}

    def __call__(self, tables: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray]:
        which = self.confidences.index(confidence)
        out = []
        for t in map(tuple, tables.astype(int).tolist()):
            if t not in self.known:
                self.known[t] = old_dirichlet_interval(t, self.confidences)
            out.append(self.known[t][which])
        low, high = np.array(out).T
        return low, high


def new(tables: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray]:
    return paired_ratio_bounds(*tables.T, confidence)


def cells(acc: float, ratio: float, gained: float) -> np.ndarray:
    """Probabilities of (both right, only the baseline, only the candidate, neither)."""
    lost = (1 - ratio) * acc + gained
    return np.array([acc - lost, lost, gained, 1 - acc - gained])


def draw(n: int, p: np.ndarray, reps: int, rng) -> np.ndarray:
    return rng.multinomial(n, p, size=reps)


def one_look(args, rng, old: Old) -> list[dict]:
    rows, conf_look = [], look_confidence(GateConfig(), PLAN_LOOKS)
    for ratio in RATIOS:
        for flips, gained in FLIPS.items():
            for acc in ACCURACIES:
                for n in DOCUMENTS:
                    tables = draw(n, cells(acc, ratio, gained), args.reps, rng)
                    if any((r["ratio"], r["flips"], r["acc"], r["n"]) == (ratio, flips, acc, n) for r in args.done):
                        continue
                    row = {"ratio": ratio, "flips": flips, "acc": acc, "n": n, "reps": args.reps,
                           "old_reps": args.old_reps}
                    for name, conf in (("95", 0.95), ("look", conf_look)):
                        row[f"new_{name}"] = float(np.mean(new(tables, conf)[0] >= MARGIN))
                        row[f"old_{name}"] = float(np.mean(old(tables[: args.old_reps], conf)[0] >= MARGIN))
                    rows.append(row)
                    args.save(rows)
                    print(f"one look: ratio {ratio} {flips} acc {acc} n {n}: new {row['new_95']:.4f} "
                          f"{row['new_look']:.4f}, old {row['old_95']:.4f} {row['old_look']:.4f}", flush=True)
    return rows


def plan_verdicts(tables_at: list[np.ndarray], interval, confidence: float) -> np.ndarray:
    """Per draw, whether the looks pass (stopping at the first pass or fail, as the runner does)."""
    open_ = np.ones(len(tables_at[0]), dtype=bool)
    passed = np.zeros_like(open_)
    for tables in tables_at:
        idx = np.flatnonzero(open_)
        if not len(idx):
            break
        low, high = interval(tables[idx], confidence)
        passed[idx[low >= MARGIN]] = True
        open_[idx[(low >= MARGIN) | (high < MARGIN)]] = False
    return passed


def plan(args, rng, old: Old) -> list[dict]:
    rows = []
    for limit in PLAN_LIMITS:
        counts = looks(limit, 32 * limit)
        confidence = look_confidence(GateConfig(max_documents=counts[-1]), len(counts))
        for flips, gained in FLIPS.items():
            for acc in ACCURACIES:
                p = cells(acc, MARGIN, gained)
                steps = [draw(m - k, p, args.reps, rng) for k, m in zip([0, *counts[:-1]], counts)]
                tables_at = list(np.cumsum(steps, axis=0))
                if any((r["limit"], r["flips"], r["acc"]) == (limit, flips, acc) for r in args.done):
                    continue
                row = {"limit": limit, "looks": counts, "flips": flips, "acc": acc, "ratio": MARGIN,
                       "reps": args.reps, "old_reps": args.old_reps,
                       "new": float(np.mean(plan_verdicts(tables_at, new, confidence))),
                       "old": float(np.mean(plan_verdicts([t[: args.old_reps] for t in tables_at], old,
                                                          confidence)))}
                rows.append(row)
                args.save(rows)
                print(f"plan {counts[0]}..{counts[-1]} {flips} acc {acc}: new {row['new']:.4f}, old {row['old']:.4f}",
                      flush=True)
    return rows


def power(args, rng, old: Old) -> list[dict]:
    """Fewest documents for a lossless candidate to pass one 95% look in 80% of draws (None: beyond the grid)."""
    rows = []
    for flips, gained in {"none": 0.0, "two way": 0.02}.items():
        for acc in ACCURACIES:
            row = {"flips": flips, "acc": acc}
            for name, interval, reps in (("new", new, args.reps), ("old", old, args.power_reps)):
                row[name] = None
                for n in POWER_DOCUMENTS:
                    tables = draw(n, cells(acc, 1.0, gained), reps, rng)
                    if np.mean(interval(tables, 0.95)[0] >= MARGIN) >= 0.8:
                        row[name] = n
                        break
            rows.append(row)
            print(f"power {flips} acc {acc}: new {row['new']}, old {row['old']}", flush=True)
    return rows


def se_bound(rate: float, reps: int) -> float:
    """The nominal rate plus 3 Monte-Carlo standard errors of ``reps`` draws."""
    return rate + 3 * math.sqrt(rate * (1 - rate) / reps)


def table(results: dict) -> list[str]:
    look = (1 - look_confidence(GateConfig(), PLAN_LOOKS)) / 2
    lines = ["False PASS (new / old) at a true ratio at the margin 0.97 and 1% inside it (0.96); one look at 95% "
             f"(nominal 2.5%) and one look at a 6-look plan's confidence (nominal {look:.2%}). "
             f"{results['one-look'][0]['reps']:,} draws per cell for new, the first "
             f"{results['one-look'][0]['old_reps']:,} of them for old.", "",
             "| ratio | flips | accuracy | " + " | ".join(f"{n:,}" for n in DOCUMENTS) + " |",
             "|---|---|---:|" + "---:|" * len(DOCUMENTS)]
    for conf, title in (("95", "one look, 95%"), ("look", "one look, 99.17%")):
        lines.append(f"| **{title}** |" + " |" * (2 + len(DOCUMENTS)))
        for ratio in RATIOS:
            for flips in FLIPS:
                for acc in ACCURACIES:
                    found = {r["n"]: r for r in results["one-look"]
                             if (r["ratio"], r["flips"], r["acc"]) == (ratio, flips, acc)}
                    cells_ = [f"{found[n][f'new_{conf}']:.1%} / {found[n][f'old_{conf}']:.1%}" for n in DOCUMENTS]
                    lines.append(f"| {ratio} | {flips} | {acc} | " + " | ".join(cells_) + " |")
    lines += ["", "The whole sequential plan (6 looks, doubling, each at 99.17%; a pass or a fail stops it), true "
              "ratio 0.97 (nominal 2.5%):", "", "| looks | flips | accuracy | new | old |", "|---|---|---:|---:|---:|"]
    for r in results["plan"]:
        lines.append(f"| {r['looks'][0]:,}..{r['looks'][-1]:,} | {r['flips']} | {r['acc']} | {r['new']:.2%} | "
                     f"{r['old']:.2%} |")
    lines += ["", "Power: the fewest documents (50, 100, 200, ...) at which a lossless candidate (ratio 1) passes "
              "one 95% look in at least 80% of draws (no flips; or 2% of documents lost and 2% gained):", "",
              "| flips | accuracy | new | old |", "|---|---:|---:|---:|"]
    for r in results["power"]:
        lines.append(f"| {r['flips']} | {r['acc']} | {r['new'] or '> 51,200':,} | {r['old'] or '> 51,200':,} |")
    worst = max(results["one-look"], key=lambda r: r["new_95"] / se_bound(0.025, r["reps"]))
    worst_look = max(results["one-look"], key=lambda r: r["new_look"] / se_bound(look, r["reps"]))
    worst_plan = max(results["plan"], key=lambda r: r["new"])
    lines += ["", f"Worst new cells: {worst['new_95']:.2%} at one 95% look (ratio {worst['ratio']}, {worst['flips']}, "
              f"accuracy {worst['acc']}, {worst['n']:,} documents; bound {se_bound(0.025, worst['reps']):.2%}), "
              f"{worst_look['new_look']:.2%} at one 99.17% look ({worst_look['flips']}, accuracy {worst_look['acc']}, "
              f"{worst_look['n']:,} documents; bound {se_bound(look, worst_look['reps']):.2%}), "
              f"{worst_plan['new']:.2%} over a whole plan ({worst_plan['flips']}, accuracy {worst_plan['acc']}); "
              "bounds: nominal + 3 Monte-Carlo standard errors."]
    return lines


def write_docs(results: dict, path: Path) -> None:
    head, tail = marked_section(path, BEGIN, END, "--write-docs")
    write_file(path, head + BEGIN + "\n" + "\n".join(table(results)) + "\n" + END + tail)


def main(argv=None) -> int:
    parser = script_parser("simulate_gate", __doc__)
    parser.add_argument("--section", choices=["one-look", "plan", "power"], action="append", default=[])
    parser.add_argument("--reps", type=at_least(1, MAX_REPS), default=4000,
                        help="draws per cell for kvquant's interval")
    parser.add_argument("--old-reps", type=at_least(1, MAX_REPS), default=1000,
                        help="of those, draws for the old one (slow)")
    parser.add_argument("--power-reps", type=at_least(1, MAX_REPS), default=400,
                        help="draws per document count for old's power")
    parser.add_argument("--seed", type=at_least(0), default=SEED)
    parser.add_argument("--json", type=Path, default=Path("experiments/simulate_gate.json"))
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/gate.md")
    args = parser.parse_args(argv)
    results = read_json(args.json, "--json", missing={})
    writable_target(args.json, "--json")  # before the simulation, not after it
    if not args.section and not args.write_docs:
        raise KVQuantError("nothing to do: name a --section (one-look, plan, power) to simulate, or --write-docs to "
                           "render the table from --json's results")
    if args.write_docs:
        marked_section(DOCS, BEGIN, END, "--write-docs")
    old = Old()
    for section in args.section:  # a section stopped part way goes on from its last cell (same draws)
        rng = np.random.default_rng([args.seed, ["one-look", "plan", "power"].index(section)])
        args.done = results.get(section, []) if section != "power" else []

        def save(rows, section=section):
            results[section] = [*args.done, *rows]
            write_file(args.json, json.dumps(results, indent=1) + "\n")

        args.save = save
        save({"one-look": one_look, "plan": plan, "power": power}[section](args, rng, old))
    if args.write_docs:
        write_docs(results, DOCS)
    return 0


if __name__ == "__main__":
    sys.exit(run_script("simulate_gate", main))
