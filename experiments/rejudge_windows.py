"""Judge committed reports' gated perplexity-set rows (``ppl``, ``kl``, ``top1`` over windows) again under today's
rules (issue 53 item 3), without a model: the count a verdict's end needs (``kvquant.runner.counts``) and, where the
per-window results are at hand, today's interval (the studentized bootstrap, ``kvquant.runner.bootstrap``)::

    python experiments/rejudge_windows.py reports/int4 reports/gemma3-270m ...
    python experiments/rejudge_windows.py reports/smollm2-decide --partial reports/smollm2-decide/carried

For each report, every gated row of a perplexity set in ``REPORT/results.json`` is judged by
``kvquant.runner.gate.judge`` at its own confidence under the report's gate. Where ``--partial`` holds the baseline's
and the candidate's per-window results of that set (``ppl__<set>.json``, ``kl__<set>.json``), its interval is
computed again from them (today's studentized bootstrap, the gate's own seeded resamples) and held to today's
counts; elsewhere the report's own interval (a percentile bootstrap) is held to the counts the same simulation gives
that interval (``--counts``: a pass from 256 windows, a fail from 16). Then each candidate's status
with its other rows as the report judged them, and the decision they give (the cheapest passing candidate). Prints
one Markdown row per gated row (a changed verdict in bold), one per changed status and decision; exit 0.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kvquant.errors import KVQuantError, is_int, script_parser, visible
from kvquant.exits import run_script
from kvquant.fs import read_json
from kvquant.runner.counts import TOO_FEW, too_few
from kvquant.runner.gate import judge, paired_interval, status, verdict_text
from kvquant.experiment.gate_config import GateConfig
from kvquant.experiment.results import AGREEMENT, DIVERGENCE, PERPLEXITY, MetricId, MetricRow

WINDOWS = (PERPLEXITY, DIVERGENCE, AGREEMENT)


def windows(partial: Path | None, label: str, kind: str, source: str) -> np.ndarray | None:
    """``label``'s per-window ``[n, 2]`` rows of a perplexity set as the gate reads them (perplexity: summed NLL,
    tokens; KL: summed KL, positions; top-1: agreements, positions), None where ``partial`` has none."""
    if partial is None:
        return None
    path = partial / label / (f"ppl__{source}.json" if kind == PERPLEXITY else f"kl__{source}.json")
    if not path.is_file():
        return None
    result = read_json(path, "partial results")["result"]
    if kind == PERPLEXITY:
        return np.stack([np.asarray(result["nll"], float), np.asarray(result["tokens"], float)], axis=1)
    if kind == DIVERGENCE:
        return np.array([[sum(w), len(w)] for w in result["kl"]], dtype=float)
    return np.stack([np.asarray(result["top1"], float), np.asarray(result["tokens"], float)], axis=1)


def interval(row: MetricRow, partial: Path | None, gate: GateConfig, seed: int) -> tuple[float, float] | None:
    """Today's interval of ``row`` from the per-window results in ``partial`` (None where they are not there)."""
    got = windows(partial, row.candidate, row.kind, row.metric.source)
    base = windows(partial, "baseline", PERPLEXITY, row.metric.source) if row.kind == PERPLEXITY else None
    if got is None or (row.kind == PERPLEXITY and base is None) or len(got) != row.n:
        return None
    return paired_interval(row.kind, base, got, gate.bootstrap, row.confidence, seed)


def percentile_settled(verdict: str, n: int, counts: dict[str, int]) -> tuple[str, str]:
    """``verdict`` of a percentile interval over ``n`` windows under that interval's counts (``counts``: the
    windows its ``pass`` and ``fail`` need, from ``experiments/simulate_windows.json``): ``(verdict, its text)``."""
    small = min(counts.values())
    need = small if n < small else counts.get(verdict)
    return (TOO_FEW, too_few(n, need)) if need is not None and n < need else (verdict, verdict)


def read_counts(path: Path) -> dict[str, int]:
    """The windows a percentile interval's ``pass`` and ``fail`` need, from a simulate_windows.py result
    (``results.minimum.percentile``): whole numbers, else one line naming ``--counts`` (a simulation that found no
    count within its largest n gives None: it cannot judge)."""
    found = read_json(path, "--counts")
    for key in ("results", "minimum", "percentile"):
        found = found.get(key) if isinstance(found, dict) else None
    if not (isinstance(found, dict) and all(is_int(found.get(end)) and found[end] >= 1 for end in ("pass", "fail"))):
        raise KVQuantError(f"--counts: {path} gives no whole windows counts for a percentile interval's pass and "
                           f"fail (results.minimum.percentile), got {visible(repr(found), 60)}; a simulation that "
                           "found none within its n cannot judge (experiments/simulate_windows.json does)")
    return {end: int(found[end]) for end in ("pass", "fail")}


def rejudged(report: Path, partial: Path | None, old_counts: dict[str, int]) -> list[str]:
    try:
        return _rejudged(report, partial, old_counts)
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise KVQuantError(f"{report / 'results.json'}: not a report's results (a field missing or of "
                           f"another kind: {str(err)[:80]})") from None


def _rejudged(report: Path, partial: Path | None, old_counts: dict[str, int]) -> list[str]:
    doc = read_json(report / "results.json", "report")
    gate = GateConfig(**doc["config"]["gate"])
    seed = doc["config"]["eval"]["seed"]
    lines, statuses = [], {}
    for cand in doc["candidates"]:
        before, after = [], []
        for name, m in cand["metrics"].items():
            if not m["gated"]:
                continue
            # a report from before verdicts were written (tiny-sweep) judged the point estimate: passed or not
            m = {"verdict": "pass" if m["passed"] else "fail", "confidence": gate.confidence, **m}
            row = MetricRow(cand["name"], MetricId(*name.split("/", 1)), m["value"], m["baseline"], m["n"], True,
                            m["ci_low"], m["ci_high"], m.get("quantized_share", math.nan),
                            m["confidence"])
            before.append(m["verdict"])
            if row.kind not in WINDOWS:
                after.append(m["verdict"])
                continue
            found = interval(row, partial, gate, seed)
            if found is not None:  # today's interval: today's counts
                row = dataclasses.replace(row, ci_low=found[0], ci_high=found[1])
                v = judge(row, gate)
                verdict, text = v.verdict, verdict_text(v)
            else:  # the report's percentile interval: that interval's counts
                verdict, text = percentile_settled(judge(row, gate, counted=False).verdict, row.n, old_counts)
            after.append(verdict)
            lines.append(f"| {report.name} | {visible(cand['name'])} | {visible(name)} | {m['n']} | "
                         f"[{m['ci_low']:.4f}, {m['ci_high']:.4f}] {m['verdict']} | "
                         f"{'today' if found is not None else 'report'}: [{row.ci_low:.4f}, {row.ci_high:.4f}] "
                         f"{text if text == m['verdict'] else '**' + text + '**'} |")
        old, new = _status(before), _status(after)
        statuses[cand["name"]] = (new, cand["bits_per_element"])
        if old != new:
            lines.append(f"| {report.name} | {visible(cand['name'])} | status | | {old} | **{new}** |")
    decision = _decision(statuses)
    if decision != (doc["decision"], doc["chosen"]):
        lines.append(f"| {report.name} | | decision | | {_named(doc['decision'], doc['chosen'])} | "
                     f"**{_named(*decision)}** |")
    return lines


def _named(decision: str, chosen: str | None) -> str:
    return decision if chosen is None else f"{decision} ({visible(chosen)})"


def _decision(statuses: dict[str, tuple[str, float]]) -> tuple[str, str | None]:
    """The decision of :func:`kvquant.runner.gate.decide` from each candidate's status and bits per element: the
    cheapest passing candidate, else fail where every one fails, else inconclusive (a staged run decides by its
    stages instead: read its line as the statuses' decision)."""
    passing = sorted((bits, name) for name, (s, bits) in statuses.items() if s == "pass")
    if passing:
        return "pass", passing[0][1]
    return ("fail" if all(s == "fail" for s, _ in statuses.values()) else "inconclusive"), None


def _status(verdicts: list[str]) -> str:
    """A candidate's status from its rows' verdicts (:func:`kvquant.runner.gate.status`)."""
    return status([SimpleNamespace(verdict=v) for v in verdicts])


def main(argv=None) -> int:
    parser = script_parser("rejudge_windows", __doc__)
    parser.add_argument("reports", type=Path, nargs="+")
    parser.add_argument("--partial", type=Path, help="per-window partial results of the (one) report, if any")
    parser.add_argument("--counts", type=Path, default=Path("experiments/simulate_windows.json"),
                        help="the simulation whose percentile counts judge a report's own (percentile) intervals")
    args = parser.parse_args(argv)
    if args.partial is not None and len(args.reports) != 1:
        parser.error("--partial goes with one report")
    if args.partial is not None and not args.partial.is_dir():  # read as "none there" it judged silently without
        raise KVQuantError(f"--partial {str(args.partial)[:200]!r} is not a folder of partial results")
    print("| report | candidate | metric | windows | report: interval, verdict | rejudged: interval, verdict |\n"
          "|---|---|---|---:|---|---|")
    old_counts = read_counts(args.counts)
    for report in args.reports:
        print("\n".join(rejudged(report, args.partial, old_counts)))
    return 0


if __name__ == "__main__":
    sys.exit(run_script("rejudge_windows", main))
