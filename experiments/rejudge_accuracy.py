"""Judge a committed report's gated accuracy rows again with today's interval (issue 53: the paired score interval
that replaced the Dirichlet one), from the per-document answers its partial results hold, without a model:

    python experiments/rejudge_accuracy.py reports/smollm2-decide --partial reports/smollm2-decide/carried

For every candidate and gated task of ``REPORT/results.json``, the baseline's and the candidate's right-or-wrong
answers on the same first ``n`` documents (the task's first result, then its sequential looks in order) are paired
(both right, lost, gained, neither) and judged at the row's own confidence and threshold. Prints one Markdown row
per gated accuracy metric: the flips, the interval and verdict the report holds, and today's; exit 0. A row whose
answers are not all in ``--partial`` is named and left out.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kvquant.errors import KVQuantError, is_python_int, script_parser, visible
from kvquant.exits import run_script
from kvquant.fs import read_json
from kvquant.runner.paired import paired_ratio_bounds


def answers(partial: Path, label: str, task: str, measure: str) -> list[float] | None:
    """``label``'s answers on ``task`` (``measure``: acc or acc_norm), its first result then each look in order of
    its first document; None where it has none."""
    folder = partial / label
    if folder.is_symlink():
        raise KVQuantError(f"{folder} is a symlink, not a candidate's folder of answers")
    parts = []
    for path in folder.glob(f"task__{task}*.json") if folder.is_dir() else ():
        look = re.fullmatch(rf"task__{re.escape(task)}(?:@(\d+)-(\d+))?\.json", path.name)
        if look:
            result = read_json(path, "partial answers").get("result")
            part = result.get(measure) if isinstance(result, dict) else None
            if part is not None and not (isinstance(part, list) and all(x in (0, 1) for x in part)):
                raise KVQuantError(f"{path}: its {measure!r} is not a list of right-or-wrong answers (0 or 1)")
            parts.append((int(look[1] or 0), part))
    if not parts or any(p is None for _, p in parts):
        return None
    return [x for _, part in sorted(parts, key=lambda p: p[0]) for x in part]


def checked(metric: dict, where: str) -> tuple[int, float, float]:
    """A gated accuracy row's ``n`` (a positive integer), ``confidence`` (in (0, 1)) and ``threshold`` (finite)."""
    n, confidence, limit = metric.get("n"), metric.get("confidence"), metric.get("threshold")
    if not (is_python_int(n) and n > 0):
        raise KVQuantError(f"{where}: n is {str(n)[:40]}, not a positive number of documents")
    if not (isinstance(confidence, float) and 0 < confidence < 1):
        raise KVQuantError(f"{where}: confidence is {str(confidence)[:40]}, not in (0, 1)")
    if not (isinstance(limit, (int, float)) and not isinstance(limit, bool) and abs(limit) < float("inf")):
        raise KVQuantError(f"{where}: threshold is {str(limit)[:40]}, not a number")
    return n, confidence, float(limit)


def rejudged(report: Path, partial: Path) -> list[str]:
    try:
        return _rejudged(report, partial)
    except (KeyError, TypeError, AttributeError) as err:
        raise KVQuantError(f"{report / 'results.json'}: not a report's results (a field missing or of "
                           f"another kind: {str(err)[:80]})") from None


def _rejudged(report: Path, partial: Path) -> list[str]:
    doc = read_json(report / "results.json", "report")
    rows = ["| candidate | metric | n | lost | gained | report: interval, verdict | today: interval, verdict |",
            "|---|---|---:|---:|---:|---|---|"]
    gated, left_out = 0, []
    for cand in doc["candidates"]:
        for name, m in cand["metrics"].items():
            measure, _, task = name.partition("/")
            if m["kind"] != "accuracy" or not m["gated"]:
                continue
            gated += 1
            base, got = answers(partial, "baseline", task, measure), answers(partial, cand["name"], task, measure)
            n, confidence, limit = checked(m, f"{report / 'results.json'}: {visible(cand['name'])} {visible(name)}")
            if base is None or got is None or len(base) < n or len(got) < n:
                left_out.append(f"rejudge_accuracy: {visible(cand['name'])} {visible(name)}: the answers of {n} "
                                f"documents are not in {visible(partial)}; left out")
                continue
            pairs = list(zip(base[:n], got[:n]))
            both, lost, gained = (sum(p == q for p in pairs) for q in ((1, 1), (1, 0), (0, 1)))
            low, high = (float(x) for x in paired_ratio_bounds(both, lost, gained, n - both - lost - gained,
                                                              confidence))
            verdict = "pass" if low >= limit else "fail" if high < limit else "inconclusive"
            rows.append(f"| {visible(cand['name'])} | {visible(name)} | {n} | {lost} | {gained} | "
                        f"[{m['ci_low']:.4f}, {m['ci_high']:.4f}] {m['verdict']} | [{low:.4f}, {high:.4f}] "
                        f"{'**' + verdict + '**' if verdict != m['verdict'] else verdict} |")
    if not gated:  # an empty table with exit 0 would read as "nothing changed"
        raise KVQuantError(f"{visible(report / 'results.json')} holds no gated accuracy row: nothing to rejudge")
    if len(rows) == 2:
        raise KVQuantError(f"the answers of none of the {gated} gated accuracy rows of {visible(report)} are in "
                           f"{visible(partial)}: nothing rejudged (name the partial results with --partial)")
    if left_out:
        print("\n".join(left_out), file=sys.stderr)
    return rows


def main(argv=None) -> int:
    parser = script_parser("rejudge_accuracy", __doc__)
    parser.add_argument("report", type=Path)
    parser.add_argument("--partial", type=Path, help="the partial results (default: REPORT/partial)")
    args = parser.parse_args(argv)
    print("\n".join(rejudged(args.report, args.partial or args.report / "partial")))
    return 0


if __name__ == "__main__":
    sys.exit(run_script("rejudge_accuracy", main))
