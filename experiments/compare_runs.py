"""Compare two runs of one config value by value, from their partial results (e.g. one process and two):

    python experiments/compare_runs.py reports/parallel/int4-1process reports/parallel/int4-2processes

For every (candidate, metric) result both runs hold, and every field of it (per-window negative log-likelihoods,
per-position KL divergences, per-document accuracies, read counts, memory), prints how many values are equal
exactly, how many differ, and the largest absolute and relative difference; then the headline numbers of the two
reports side by side. Exit 1 when a result is missing from one run or a field differs in shape.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from kvquant.errors import KVQuantError, parse_args, script_parser, visible
from kvquant.exits import run_guarded


def results(report_dir: Path) -> dict[str, dict]:
    """Every partial result of the report folder ``report_dir``, by ``candidate/metric.json``; one line (exit 2)
    where it is no report folder, holds none, or holds one that is not a result."""
    if not (report_dir / "partial").is_dir():
        raise KVQuantError(f"{report_dir} is not a report folder with partial results ({report_dir / 'partial'} is "
                           "not a folder)")
    out = {}
    for p in sorted((report_dir / "partial").glob("*/*.json")):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as err:
            raise KVQuantError(f"{p}: not a partial result ({getattr(err, 'strerror', None) or err})") from None
        if not isinstance(doc, dict) or "result" not in doc:
            raise KVQuantError(f"{p}: not a partial result (no 'result')")
        out[str(p.relative_to(report_dir / "partial"))] = doc["result"]
    if not out:
        raise KVQuantError(f"{report_dir / 'partial'} holds no partial results: nothing to compare")
    return out


def flat(value, path: str = "") -> dict[str, float | str]:
    """Every number (and string) in a result, keyed by its field and position (``nll[3]``, ``kl[0][17]``)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flat(item, f"{path}.{key}" if path else key).items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{path}[{i}]").items()}
    return {path: value}


def field(path: str) -> str:
    """The top-level field of a value's path (``reads.keys`` -> ``reads``, ``kl[0][17]`` -> ``kl``)."""
    return path.split("[")[0].split(".")[0]


def compare(a: dict, b: dict) -> list[dict]:
    """Per field: values compared, equal exactly, differing, largest absolute and relative difference."""
    fa, fb = flat(a), flat(b)
    if fa.keys() != fb.keys():
        raise ValueError(f"fields differ: {sorted(set(fa) ^ set(fb))[:5]}")
    rows: dict[str, dict] = {}
    for path in fa:
        row = rows.setdefault(field(path), {"field": field(path), "values": 0, "equal": 0, "max_abs": 0.0,
                                            "max_rel": 0.0})
        x, y = fa[path], fb[path]
        row["values"] += 1
        if x == y:
            row["equal"] += 1
        elif isinstance(x, (int, float)) and isinstance(y, (int, float)):
            diff = abs(x - y)
            row["max_abs"] = max(row["max_abs"], diff)
            row["max_rel"] = max(row["max_rel"], diff / max(abs(x), abs(y)) if diff else 0.0)
    return list(rows.values())


def headline(report_dir: Path) -> dict:
    try:
        doc = json.loads((report_dir / "results.json").read_text())
    except (OSError, ValueError) as err:
        raise KVQuantError(f"{report_dir / 'results.json'}: not a report's results "
                           f"({getattr(err, 'strerror', None) or err})") from None
    try:
        out = {"decision": doc["decision"], "processes": doc["results"].get("processes"),
               "seconds": doc["results"].get("seconds")}
        for cand in doc["candidates"]:
            for metric, entry in cand["metrics"].items():
                out[f"{cand['name']} {metric}"] = entry["value"]
    except (KeyError, TypeError, AttributeError) as err:
        raise KVQuantError(f"{report_dir / 'results.json'}: not a report's results (no {err})") from None
    return out


def describe_value(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) and math.isfinite(value) else str(value)


def compare_folders(args) -> int:
    """Exit 0 when both runs hold the same results, shaped alike; 1 when one holds a result the other lacks or a
    field differs in shape."""
    ra, rb = results(args.first), results(args.second)
    if ra.keys() != rb.keys():
        print(f"results held by one run only: {visible(sorted(set(ra) ^ set(rb)))}", file=sys.stderr)
        return 1
    print(f"# {visible(args.first)} vs {visible(args.second)}\n")
    print("| result | field | values | equal | differ | max abs diff | max rel diff |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in ra:
        try:
            rows = compare(ra[name], rb[name])
        except ValueError as err:
            print(f"{visible(name)}: {visible(err)}", file=sys.stderr)
            return 1
        for row in rows:
            differ = row["values"] - row["equal"]
            print(f"| {visible(name)} | {visible(row['field'])} | {row['values']} | {row['equal']} | {differ} | "
                  f"{row['max_abs']:.3g} | {row['max_rel']:.3g} |")
    ha, hb = headline(args.first), headline(args.second)
    print(f"\n| | {visible(args.first.name)} | {visible(args.second.name)} |\n|---|---|---|")
    for key in ha:
        print(f"| {visible(key)} | {visible(describe_value(ha[key]))} | {visible(describe_value(hb.get(key)))} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit 0 the same results, 1 a result or a field's shape differs, 2 bad input (one line), 3 internal error."""
    parser = script_parser("compare_runs", __doc__)
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args
    return run_guarded("compare_runs", lambda: compare_folders(args))


if __name__ == "__main__":
    sys.exit(main())
