"""``python -m kvquant.export REPORT_DIR``: write ``DEPLOY.md`` for a report whose decision a serving engine runs
(the engine's flags, what was measured and what was not; :mod:`kvquant.deploy`).

Exit codes: 0 written, 2 bad input (not a report, no decision, or a research setting no engine runs: one line
naming the nearest engine format measured and its verdict), 3 internal error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .deploy import export
from .errors import OneLineParser, guarded, parse_args


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser("kvquant", prog="python -m kvquant.export", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report_dir", type=Path, help="a report directory written by python -m kvquant.run")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args

    def run() -> int:
        print(f"kvquant: wrote {export(args.report_dir)}")
        return 0

    return guarded("kvquant", run)


if __name__ == "__main__":
    sys.exit(main())
