"""``python -m kvquant.export REPORT_DIR``: write ``DEPLOY.md`` for a report whose decision a serving engine runs
(the engine's flags, what was measured and what was not; :mod:`kvquant.integrations.deploy`): vLLM's or SGLang's
``--kv-cache-dtype``, or for a llama.cpp cache type llama.cpp's ``-ctk/-ctv/-fa on``, Ollama's
``OLLAMA_KV_CACHE_TYPE`` where Ollama can run it, and llama-cpp-python's ``type_k``/``type_v``.

Exports only a report your own run wrote: a real directory (not a symlink) and a results.json you own, signed
with your key (the runner signs it; --trust-unsigned accepts one it did not, e.g. of an older kvquant, after you
have checked it), every value export reads well formed. A setting that quantizes nothing becomes "keep the
model-precision cache".

Exit codes: 0 written, 2 bad input (not a report, not yours, unsigned or edited, malformed, no decision, or a
research setting no engine runs: one line naming the nearest engine format measured and its verdict; nothing is
written), 3 internal error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvquant.integrations.deploy import export
from kvquant.errors import OneLineParser, parse_args
from kvquant.exits import run_guarded
from kvquant.importpath import drop_working_dir


def main(argv: list[str] | None = None) -> int:
    drop_working_dir()
    parser = OneLineParser("kvquant", prog="python -m kvquant.export", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report_dir", type=Path, help="a report directory written by python -m kvquant.run")
    parser.add_argument("--trust-unsigned", action="store_true",
                        help="export a results.json your key did not sign (a report of an older kvquant, or copied "
                             "from another machine) once you have checked it; it must still be yours and well formed")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args

    def run() -> int:
        print(f"kvquant: wrote {export(args.report_dir, args.trust_unsigned)}")
        return 0

    return run_guarded("kvquant", run)


if __name__ == "__main__":
    sys.exit(main())
