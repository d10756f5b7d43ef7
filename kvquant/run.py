"""``python -m kvquant.run configs/int4.yaml``: may I ship this KV-cache quantization for this model?

Measures the fp16 baseline (the identity quantizer, through the same cache code) and every candidate on the
same model, token windows and task documents, with the quantized K/V read by attention; gates the result and
writes ``reports/<name>/``.

Exit code: 0 the gate passes, 1 it fails, 4 it cannot tell yet (inconclusive: more documents would decide), 2 bad
input (config, data, model, device, quantizer options: one line naming the key, file or value), 3 an internal
error (the traceback goes to error.log in the report directory), 130 interrupted. Everything is checked before
the model loads, and nothing is written into the report directory until then. Every finished (candidate,
metric) result is saved at once under a key of its inputs and the code version, so an interrupted run resumes
where it stopped; a lock refuses a second run into the same directory.

Under ``torchrun`` or ``accelerate launch`` the run's processes share out the scoring of every measurement (each
scores its share of the windows and documents through its own quantized cache, and every process gathers all the
scores, so all of them take the same steps); process 0 alone holds the lock and writes partial results and the
report (``docs/parallel.md``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from kvquant.errors import OneLineParser, parse_args
from kvquant.importpath import drop_working_dir
from kvquant.integrations.deploy import deploy_beside
from kvquant.planner.shapes import check_candidate, parse_bytes, shape_from_config
from kvquant.experiment.binding import add_set_option
from kvquant.runner.pipeline import RunOptions, run_experiment
from kvquant.runner.preflight import AboveRunner

#: what the run takes from the packages above ``kvquant/runner/`` (docs/layout.md), handed in from here
ABOVE_RUNNER = AboveRunner(shape_of=shape_from_config, check_candidate=check_candidate, parse_bytes=parse_bytes,
                           deploy_beside=deploy_beside)


def main(argv: list[str] | None = None) -> int:
    drop_working_dir()
    parser = OneLineParser("kvquant", prog="python -m kvquant.run", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="experiment YAML, e.g. configs/int4.yaml")
    add_set_option(parser, "override a config key, e.g. --set eval.tasks.limit=50 (repeatable)")
    once = parser.add_mutually_exclusive_group()
    once.add_argument("--dry-run", action="store_true", help="print what the run would score and cost, then exit")
    once.add_argument("--render-only", action="store_true", help="judge the stored results (--partial, default: the "
                      "report's partial/) with today's gate and write the report; no model loaded, nothing measured")
    parser.add_argument("--partial", type=Path, help="with --render-only: a folder of stored results you vouch for")
    parser.add_argument("--replan", action="store_true", help="go on where the partial results were measured under "
                        "another plan, and report the error over every look taken (docs/gate.md)")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args
    command = "python -m kvquant.run " + shlex.join(sys.argv[1:] if argv is None else argv)
    options = RunOptions(args.config, args.overrides, args.dry_run, args.render_only, args.partial, args.replan)
    return run_experiment(options, command, ABOVE_RUNNER)


if __name__ == "__main__":
    sys.exit(main())
