"""Compare two report folders file by file, provenance aside: the check that a change of code changed no result.

    python experiments/compare_reports.py BEFORE/tiny-sweep AFTER/tiny-sweep [--ignore REGEX ...]

JSON files are compared value by value, leaving out the keys that record where and when a run happened
(:data:`PROVENANCE`; NaN equals NaN); text files (``.md``, ``.yaml``, ``.csv``) line by line, leaving out the
lines that name the run, its command, environment and output folder, and any line matching an ``--ignore``
pattern; other files (plots) byte for byte. ``partial/`` (signed with the run's key and code version) is skipped:
:mod:`compare_runs` compares those. Exit 1 when anything differs.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from kvquant.errors import KVQuantError, parse_args, script_parser, visible
from kvquant.exits import run_guarded

#: results.json keys that record the run, not its results
PROVENANCE = {"run_id", "environment", "signature", "command", "output_dir", "seconds"}
#: report lines that record the run: its command, environment and id, the output folder
PROVENANCE_LINE = r"^- (command|environment|run [0-9a-f]{12})|^# run [0-9a-f]{12}|searched by run [0-9a-f]{12}|" \
                  r"output_dir:|^# python -m kvquant\.run "


def json_differences(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            if key in PROVENANCE:
                continue
            if key not in a or key not in b:
                out.append(f"{where}/{key}: on one side only")
            else:
                out += json_differences(a[key], b[key], f"{where}/{key}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in json_differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{where}: {str(a)[:60]} | {str(b)[:60]}"]


def differences(a: Path, b: Path, ignore: re.Pattern) -> list[str]:
    """What differs between one file of each folder (empty: the same, provenance aside)."""
    if a.suffix == ".json":
        return json_differences(json.loads(a.read_text()), json.loads(b.read_text()))
    if a.suffix in (".md", ".yaml", ".csv", ".txt"):
        la, lb = ([line for line in p.read_text().splitlines() if not ignore.search(line)] for p in (a, b))
        out = [f"line: {x[:90]!r} | {y[:90]!r}" for x, y in zip(la, lb) if x != y]
        return out + ([f"{len(la)} lines vs {len(lb)}"] if len(la) != len(lb) else [])
    return [] if a.read_bytes() == b.read_bytes() else ["bytes differ"]


def report_folder(path: Path, what: str) -> Path:
    """``path`` when it is a folder holding at least one file outside ``partial/``; else one line (exit 2)."""
    if not path.is_dir():
        why = "a file" if path.exists() else "it does not exist"
        raise KVQuantError(f"{what}: {path} is not a report folder ({why})")
    if not any(p.is_file() and "partial" not in p.relative_to(path).parts for p in path.rglob("*")):
        raise KVQuantError(f"{what}: {path} holds no report files (only partial/ or nothing): nothing to compare")
    return path


def compare_folders(args) -> int:
    """Exit 0 when every file is identical (provenance aside), 1 when any differs."""
    for pattern in args.ignore:
        try:
            re.compile(pattern)
        except re.error as err:
            raise KVQuantError(f"--ignore {pattern[:80]!r} is not a regular expression ({err})") from None
    before, after = report_folder(args.before, "before"), report_folder(args.after, "after")
    ignore = re.compile("|".join([PROVENANCE_LINE, *args.ignore]))
    files = sorted({p.relative_to(root) for root in (before, after) for p in root.rglob("*")
                    if p.is_file() and "partial" not in p.relative_to(root).parts})
    differ = 0
    for rel in files:
        a, b = before / rel, after / rel
        try:
            found = [f"only in {'after' if b.exists() else 'before'}"] if not (a.exists() and b.exists()) else \
                differences(a, b, ignore)
        except (OSError, ValueError) as err:  # unreadable, or JSON that does not parse (UnicodeError is one)
            found = [f"cannot be compared ({getattr(err, 'strerror', None) or err})"]
        differ += bool(found)
        print(f"{visible(rel)}: {'DIFFERENT' if found else 'identical (provenance aside)'}")
        for line in found[:20]:
            print(f"    {visible(line)}")
    print(f"compare_reports: {len(files) - differ} of {len(files)} files identical, provenance aside")
    return 1 if differ else 0


def main(argv=None) -> int:
    """Exit 0 identical, 1 different, 2 bad input (one line), 3 an internal error."""
    parser = script_parser("compare_reports", __doc__)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--ignore", action="append", default=[], metavar="REGEX",
                        help="also leave out text lines matching this (e.g. a module's old and new name)")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args
    return run_guarded("compare_reports", lambda: compare_folders(args))


if __name__ == "__main__":
    sys.exit(main())
