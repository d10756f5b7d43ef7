"""``python -m kvquant.adopt CONFIG FOLDER [FOLDER ...]``: adopt partial results measured on another machine or in
another session, so that ``python -m kvquant.run CONFIG`` reuses them instead of measuring them again.

A run's partial results (``<report>/partial/<candidate>/<metric>.json``) are signed under a key that never leaves
the machine, so a run sets aside (``*.corrupt``) and recomputes a result copied from elsewhere. Copy the other
machine's ``partial/`` folder here and adopt it: every result in the folders is checked, the folders are merged,
and each result is written into this config's ``<output_dir>/<name>/partial/`` signed under your key, under the
run's lock; the folders named are only read. By adopting you vouch for the results' values, which no check can
confirm (docs/trust.md, "Results that travel").

Refused, with one line naming the file (exit 2, nothing written): a folder that is not a run's partial results (a
file or symlink in place of a candidate's folder or a result, or no result in it); a result whose key is not the
digest of its inputs (edited) or whose path is not the candidate and metric it is the result of (copied, renamed);
one measured by other code (kvquant's measuring source, torch, transformers or lm-eval); one whose inputs are not
those this config's run would key it with (a candidate or metric the run does not measure, the model, mode,
batch, seed, cache settings, the token windows read, the task's documents, shots and data file); results of
different model weights, or of weights other than this machine's own results name; results without the
``plan.json`` they were judged under (their looks travel in it alone: results of a folder with ids need their own
folder's plan, task results from before ids a plan); two files of one candidate and metric of other
inputs, or of the same inputs with different results; a plan here that is unknown (its file does not
verify, is another report folder's, or is missing beside results measured under one). Identical copies are one. A
result already here that verifies for the same inputs is kept; one of other inputs is moved to
``partial.old-<time>/``.

Exit codes: 0 adopted (or everything was already here), 2 refused, 3 internal error, 130 interrupted (the results
adopted so far are in place, each whole and signed; run the same command to adopt the rest).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from pathlib import Path

from kvquant.errors import OneLineParser, parse_args
from kvquant.exits import run_guarded
from kvquant.fs import check_env_dirs
from kvquant.importpath import drop_working_dir
from kvquant.runner.preflight import check_report_dir, context_length
from kvquant.experiment import provenance
from kvquant.experiment.config import load_config
from kvquant.experiment.binding import add_set_option
from kvquant.runner.expected import Expected
from kvquant.runner.store import ResultStore, RunLock, check_partial
from kvquant.runner.lookplan import LookPlan, PlanRecord
from kvquant.runner.travel import (check_documents, check_found, check_looks_carried, check_weights, local_weights,
    merge, place, read_folder, read_plan, refuse)
from kvquant.scoring.models import check_model


def adopt(config: str, overrides: list[str], folders: list[Path], dry_run: bool) -> int:
    """Check every result in ``folders`` against ``config``'s run (with ``overrides``), then place them in its
    ``partial/`` (with ``dry_run``: say how many would be, and write nothing)."""
    cfg = load_config(config, overrides)
    check_env_dirs()
    out_dir = Path(cfg.output_dir) / cfg.name
    partial = out_dir / "partial"
    check_report_dir(out_dir)
    for folder in folders:
        if partial.is_dir() and folder.exists() and os.path.samefile(folder, partial):
            refuse(f"{folder} is this run's own partial folder")
    code, model_config = provenance.code_version(), check_model(cfg.model)
    expected = Expected(cfg, model_config, context_length(cfg, model_config))
    read, plans = [], []
    for folder in folders:
        found, plan = read_folder(folder), read_plan(folder)
        check_looks_carried(folder, found)
        read, plans = read + found, plans + plan
    for found in read:
        check_found(found, code, expected)
    merged = merge(read)
    check_documents(merged)
    with contextlib.nullcontext() if dry_run else RunLock(out_dir):  # a dry run writes nothing, not even a lock
        check_partial(partial)
        store = ResultStore(partial, code, [])
        check_weights(merged, local_weights(store, code, cfg.model), partial)
        plan = PlanRecord(store, LookPlan.of(cfg))
        plan.adopt(plans, write=False)  # refused here, before anything is written
        if dry_run:
            print(f"kvquant: {_many(len(merged), 'result')} from {_many(len(folders), 'folder')} can be adopted "
                  f"into {partial}; nothing written (--dry-run)")
            return 0
        try:
            placed, kept = place(merged, store)
            plan.adopt(plans)
        finally:
            store.note_retired()
    print(f"kvquant: adopted {_many(placed, 'result')} from {_many(len(folders), 'folder')} into {partial}, signed "
          "with your key" + (f"; {kept} already there, kept" if kept else ""))
    sets = [arg for pair in overrides for arg in ("--set", pair)]
    print(f"kvquant: python -m kvquant.run {shlex.join([config, *sets])} reuses them")
    return 0


def _many(count: int, thing: str) -> str:
    return f"{count} {thing}{'s' if count != 1 else ''}"


def main(argv: list[str] | None = None) -> int:
    drop_working_dir()
    parser = OneLineParser("kvquant", prog="python -m kvquant.adopt", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the experiment YAML whose run reuses the results, e.g. configs/int4.yaml")
    parser.add_argument("folders", nargs="+", type=Path, metavar="FOLDER",
                        help="a run's partial results (<report>/partial), copied from another machine or session")
    add_set_option(parser, "override a config key, as given to python -m kvquant.run (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="check everything and write nothing")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args
    return run_guarded("kvquant", lambda: adopt(args.config, args.overrides, args.folders, args.dry_run),
                       on_interrupt=lambda: "; the results adopted so far are in place, each whole and signed; run the "
                                            "same command to adopt the rest")


if __name__ == "__main__":
    sys.exit(main())
