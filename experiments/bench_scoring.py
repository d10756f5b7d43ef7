"""Throughput of lm-eval scoring through a kvquant cache: one request at a time (the old path) vs batched rows
with each multiple-choice context prefilled once and forked (the new path), on the same documents, in one
process. Prints tokens/s of both, their ratio, and how far the scores of the two paths are apart.

    python experiments/bench_scoring.py --limit 40 --quantizers fp16 int4

Tokens counted: context + continuation of every request, as the one-request-at-a-time path feeds them. Timed:
``lm_eval.simple_evaluate`` (documents, requests, scoring, metrics), after lm-eval's task index was built once.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
import time

import lm_eval
import numpy as np
import torch

from kvquant.errors import at_least, script_parser
from kvquant.exits import run_script
from kvquant.fs import output_dir, write_together
from kvquant.experiment.model_config import ModelConfig
from kvquant.scoring.lm_eval_model import KVQuantLM  # registers the lm-eval model
from kvquant.scoring.models import load_model
from kvquant.scoring.tasks import resolve_task, task_manager

TASKS = ["arc_easy", "hellaswag", "piqa", "lambada_openai"]


def evaluate(lm, tasks, limit):
    task_manager()  # built once per process (~15 s of lm-eval's YAML index, no scoring): not timed for either path
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=task_manager(), log_samples=True,
                                  bootstrap_iters=0, verbosity="ERROR", random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0, fewshot_random_seed=0)
    return time.perf_counter() - start, out


def request_tokens(lm, out) -> int:
    total = 0
    for samples in out["samples"].values():
        for sample in samples:
            for context, continuation in sample["arguments"]:
                total += len(lm.tok_encode(context)) + len(lm.tok_encode(continuation, add_special_tokens=False))
    return total


def flat(out) -> tuple[np.ndarray, dict[str, float]]:
    values, accuracy = [], {}
    for task, samples in out["samples"].items():
        for s in sorted(samples, key=lambda s: s["doc_id"]):
            values += [float(r[0][0]) for r in s["resps"]]
        metric = "acc_norm,none" if "acc_norm,none" in out["results"][task] else "acc,none"
        accuracy[task] = out["results"][task][metric]
    return np.array(values), accuracy


def main() -> None:
    parser = script_parser("bench_scoring", __doc__)
    parser.add_argument("--model", default="local:models/smollm2-135m-instruct")
    parser.add_argument("--gguf-file", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--limit", type=at_least(1), default=40, help="documents per task")
    parser.add_argument("--batch-size", type=at_least(1), default=16)
    parser.add_argument("--chunk-size", type=at_least(1), default=512, help="streaming chunk (512: one prefill pass)")
    parser.add_argument("--quantizers", nargs="+", default=["fp16", "int4"])
    parser.add_argument("--output", default="reports/bench_scoring")
    parser.add_argument("--threads", type=at_least(1), default=None,
                        help="torch threads (default: torch's); 1 on a machine whose cores other jobs are using, where "
                             "threads waiting on each other make every op slow")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load_model(ModelConfig(path=args.model, gguf_file=args.gguf_file, dtype="float32",
                                              device="cpu"))
    tasks = [resolve_task(t) for t in TASKS]
    rows = []
    for quantizer in args.quantizers:
        options = {} if quantizer == "fp16" else {"residual_length": 0}
        common = dict(tokenizer=tokenizer, quantizer=quantizer, mode="streaming", chunk_size=args.chunk_size, **options)
        old = KVQuantLM(model, batch_size=1, share_prefix=False, **common)
        new = KVQuantLM(model, batch_size=args.batch_size, share_prefix=True, **common)
        old_s, old_out = evaluate(old, tasks, args.limit)
        new_s, new_out = evaluate(new, tasks, args.limit)
        tokens = request_tokens(old, old_out)
        old_ll, old_acc = flat(old_out)
        new_ll, new_acc = flat(new_out)
        row = {"quantizer": quantizer, "options": options, "requests": len(old_ll), "tokens": tokens,
               "old_seconds": old_s, "new_seconds": new_s, "old_tokens_per_s": tokens / old_s,
               "new_tokens_per_s": tokens / new_s, "speedup": old_s / new_s,
               "max_abs_loglikelihood_diff": float(np.abs(old_ll - new_ll).max()),
               "accuracy_old": old_acc, "accuracy_new": new_acc}
        rows.append(row)
        print(json.dumps(row))
    out_dir = output_dir(args.output, "--output")
    env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.platform(),
           "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    results = json.dumps({"args": vars(args), "environment": env, "rows": rows}, indent=2)
    lines = ["# Scoring throughput: one request at a time vs batched + prefix-shared", "",
             f"- command: `python {shlex.join(sys.argv)}`",
             f"- {env['date']}, {env['machine']}, {env['cpus']} CPUs, torch {env['torch']} ({env['threads']} threads)",
             f"- model SmolLM2-135M-Instruct (GGUF Q4_1 weights, fp32 compute); tasks {', '.join(TASKS)}, "
             f"{args.limit} documents each; streaming mode, chunk {args.chunk_size}; new path batch {args.batch_size}",
             "",
             "| cache | requests | tokens | old tok/s | new tok/s | speedup | max abs Δ loglik | accuracy old → new |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        acc = "; ".join(f"{t}: {r['accuracy_old'][t]:.3f} → {r['accuracy_new'][t]:.3f}" for t in r["accuracy_old"])
        lines.append(f"| {r['quantizer']} | {r['requests']} | {r['tokens']} | {r['old_tokens_per_s']:.0f} | "
                     f"{r['new_tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
                     f"{r['max_abs_loglikelihood_diff']:.2e} | {acc} |")
    if (out_dir / "NOTES.md").exists():  # written by hand about one run; a rerun keeps them, pointing at them
        lines += ["", "Hand-written notes on a run (the date they name): [NOTES.md](NOTES.md)."]
    write_together(out_dir, {"results.json": results, "report.md": "\n".join(lines) + "\n"})
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(run_script("bench_scoring", main))
