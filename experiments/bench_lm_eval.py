"""lm-eval scoring throughput as a user gets it: ``python -m kvquant.lm_eval`` run as a command, once per mode and
``--batch_size``, on the same tasks and documents. Prints and writes wall-clock seconds (the whole command: imports,
lm-eval's task index and the model load included, so the ratios understate the scoring speed-up), the speed of each
batch size relative to ``--batch_size 1`` in the same mode, and whether the scores are equal.

    python experiments/bench_lm_eval.py --limit 60 --batch-sizes 1 16 --modes simulated streaming
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvquant.errors import at_least, script_parser
from kvquant.exits import run_script
from kvquant.fs import output_dir, write_together
from kvquant.paths import data_dir
from kvquant.runner.report import environment

MODEL = "models/smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def run(args, mode: str, batch: int) -> dict:
    """One command; its wall-clock seconds and the accuracy per task."""
    model_args = (f"pretrained={data_dir() / MODEL},gguf_file={GGUF},quantizer={args.quantizer},mode={mode},"
                  f"chunk_size={args.chunk_size}")
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "kvquant.lm_eval", "--model", "kvquant", "--model_args", model_args,
                   "--tasks", ",".join(args.tasks), "--limit", str(args.limit), "--batch_size", str(batch),
                   "--output_path", out, "--seed", "0"]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        result = json.loads(next(Path(out).rglob("results_*.json")).read_text())["results"]
    scores = {task: next(v for k, v in result[task].items() if k.startswith(("acc,", "acc_norm,"))) for task in result}
    return {"mode": mode, "batch_size": batch, "seconds": seconds, "scores": scores,
            "command": shlex.join(["python", *command[1:-4], "--seed", "0"])}


def main(argv=None):
    parser = script_parser("bench_lm_eval", __doc__)
    parser.add_argument("--tasks", nargs="+", default=["arc_easy_local", "piqa_local"])
    parser.add_argument("--limit", type=at_least(1), default=60)
    parser.add_argument("--quantizer", default="int4")
    parser.add_argument("--chunk-size", type=at_least(1), default=512)
    parser.add_argument("--batch-sizes", type=at_least(1), nargs="+", default=[1, 16])
    parser.add_argument("--modes", nargs="+", default=["simulated", "streaming"])
    parser.add_argument("--out", type=Path, default=Path("reports/bench_scoring/lm_eval_cli"))
    args = parser.parse_args(argv)
    rows = [run(args, mode, batch) for mode in args.modes for batch in args.batch_sizes]
    base = {r["mode"]: r for r in rows if r["batch_size"] == args.batch_sizes[0]}
    env = environment()
    lines = [
        "# lm-eval scoring through `python -m kvquant.lm_eval`, by batch size",
        "",
        f"- command: `python {' '.join([sys.argv[0], *sys.argv[1:]])}`",
        f"- date: {env['date']}; git {env['git_commit']}; machine: {env['machine']}, {torch.get_num_threads()} "
        f"torch threads; torch {env['torch']}, transformers {env['transformers']}",
        f"- SmolLM2-135M-Instruct (GGUF Q4_1, float32), quantizer {args.quantizer}, tasks {', '.join(args.tasks)}, "
        f"--limit {args.limit}; wall-clock of each whole command (imports, task index and model load included)",
        "",
        f"| mode | --batch_size | seconds | speed vs --batch_size {args.batch_sizes[0]} | scores equal | scores |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base[r["mode"]]
        scores = ", ".join(f"{t} {v:.4f}" for t, v in sorted(r["scores"].items()))
        lines.append(f"| {r['mode']} | {r['batch_size']} | {r['seconds']:.1f} | {b['seconds'] / r['seconds']:.2f}x | "
                     f"{'yes' if r['scores'] == b['scores'] else 'NO'} | {scores} |")
    lines += ["", "Commands (one per row, `--batch_size` and `mode=` varied):", "", "```",
              *(r["command"] for r in rows), "```", ""]
    write_together(output_dir(args.out, "--out"),
                   {"report.md": "\n".join(lines), "results.json": json.dumps(rows, indent=2)})
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(run_script("bench_lm_eval", main))
