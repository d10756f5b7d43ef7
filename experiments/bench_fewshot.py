"""Shared few-shot prefixes, measured (issue 39 item 1): model tokens and seconds per document with the first
examples in front of every document prefilled once and shared, against each document prefilling its own.

    python experiments/bench_fewshot.py --limit 24 --shots 5 10 25 --rounds 2
    python experiments/bench_fewshot.py --quick --model local:models/stories260K/hf --gguf-file ""   # a smoke run

The requests are lm-eval's own: ``--task`` (ARC-Easy), ``--limit`` documents from document ``--first`` on,
``--shots`` examples by lm-eval's ``first_n`` sampler (:func:`kvquant.scoring.task_setup.use_sampler`), recorded as
``KVQuantLM`` hands them to its scorer. The offline ARC copy draws its examples from the evaluated documents, and
a document among the first N examples is left out of its own prompt, so documents 0 to N-1 of a run share only the
examples before their own; ``--first`` (default 26, past every prompt of up to 25 shots) measures the documents
every later one is like. Per shot count:

- model tokens per document, planned (:func:`kvquant.scoring.prefixes.model_tokens`) at every ``--plan-chunks``
  chunk size: ``unshared`` (each document prefills its whole context, once for all its choices, as kvquant did
  before: ``Scorer.share_chunks`` off) and ``shared`` (the whole chunks the documents begin with alike fed once,
  then each document's own); both then feed each choice's scored tokens;
- seconds per document of a :class:`~kvquant.scoring.scorer.Scorer` in streaming mode (``--quantizer``, chunk
  ``--chunk-size``, batch ``--batch-size``), shared and unshared in turn, ``--rounds`` timed rounds after an
  untimed pass, with the tokens it really fed (checked equal to the plan);
- the check: every request's log-likelihood shared against unshared, batched (rows that share a batch differ
  between the two, which moves float32 states by rounding and can tip a quantized code: tests/test_evaluate.py),
  and on the first ``--exact-documents`` documents one row per batch, where the two run the same arithmetic and
  must agree bit for bit.

Writes ``results.json`` and ``report.md`` (command, machine, date, load) to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import statistics
import time
from pathlib import Path

import torch

from kvquant.cache import CacheSpec
from kvquant.errors import InternalError, at_least
from kvquant.exits import run_script
from kvquant.runner.preview import recorded_requests
from kvquant.runner.report import (benchmark_doc, benchmark_end, benchmark_lines, benchmark_parser, benchmark_start,
                                   write_benchmark)
from kvquant.scoring.prefixes import model_tokens
from kvquant.scoring.scorer import Scorer

#: the issue's target: at least this many times fewer model tokens per document at 25 shots on ARC-Easy
TARGET = 5


def score(model, requests, share: bool, args, batch_size: int | None = None) -> tuple[list[float], int, float]:
    """Each request's log-likelihood through the scorer, the tokens it fed, and its seconds."""
    scorer = Scorer(model, CacheSpec.of(args.quantizer, args.options), mode="streaming", chunk_size=args.chunk_size,
                    batch_size=batch_size or args.batch_size)
    scorer.share_chunks = share
    start = time.perf_counter()
    scored = scorer.score_many(requests)
    seconds = time.perf_counter() - start
    return [float(s.logprobs.double().sum()) for s in scored], scorer.tokens_fed, seconds


def measure(model, requests, documents: int, args) -> dict:
    """One shot count: planned tokens, measured seconds and the check (see the module docstring)."""
    plan = {str(chunk): {way: model_tokens(requests, "streaming", chunk, True, way == "shared") / documents
                         for way in ("unshared", "shared")} for chunk in args.plan_chunks}
    scores, fed, seconds = {}, {}, {"unshared": [], "shared": []}
    for way in seconds:  # untimed: the check, and a warm-up
        scores[way], fed[way], _ = score(model, requests, way == "shared", args)
        if fed[way] != model_tokens(requests, "streaming", args.chunk_size, True, way == "shared"):
            raise InternalError(f"the {way} scorer fed {fed[way]} tokens, not the planned count")
    for _ in range(args.rounds):
        for way in seconds:
            seconds[way].append(score(model, requests, way == "shared", args)[2] / documents)
    ratios = [u / s for u, s in zip(seconds["unshared"], seconds["shared"])]
    few = exact_requests(requests, args.exact_documents)
    alone = [score(model, few, share, args, batch_size=1)[0] for share in (False, True)]
    return {"documents": documents, "requests": len(requests),
            "request_tokens_per_document": sum(len(c) + len(t) for c, t in requests) / documents,
            "planned_tokens_per_document": plan,
            "fed_tokens_per_document": {way: n / documents for way, n in fed.items()},
            "seconds_per_document": seconds,
            "speedup": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
            "max_abs_loglik_diff": max(abs(a - b) for a, b in zip(scores["shared"], scores["unshared"])),
            "exact": {"requests": len(few), "max_abs_loglik_diff": max(abs(a - b) for a, b in zip(*alone))}}


def exact_requests(requests: list, documents: int) -> list:
    """The requests of the first ``documents`` contexts (a document's choices share its context)."""
    contexts = list(dict.fromkeys(tuple(c) for c, _ in requests))[:documents]
    return [r for r in requests if tuple(r[0]) in set(contexts)]


def render(doc: dict) -> str:
    a = doc["args"]
    *head, model = benchmark_lines(doc, "Shared few-shot prefixes: tokens and seconds per document")
    chunks = [str(c) for c in a["plan_chunks"]]
    lines = [*head, f"{model}; lm-eval's {a['task']} requests, documents {a['first']}-{a['first'] + a['limit'] - 1}"
             ", the first N examples in "
             f"front of every document (sampler first_n); scorer: streaming mode, {a['quantizer']} "
             f"{a['options']}, chunk {a['chunk_size']}, batch {a['batch_size']}; one untimed pass, then "
             f"{a['rounds']} timed rounds, unshared and shared in turn",
             f"- target (issue 39 item 1): at least {TARGET}x fewer model tokens per document at 25 shots", "",
             "| shots | request tokens / doc | " + " | ".join(
                 f"model tokens / doc, chunk {c}: unshared -> shared (x fewer)" for c in chunks) +
             " | s / doc unshared | s / doc shared | **speedup** (min-max) | max abs Δ loglik, batched | "
             "max abs Δ loglik, one row per batch |",
             "|---:|---:|" + "---:|" * len(chunks) + "---:|---:|---:|---:|---:|"]
    for shots, r in doc["shots"].items():
        plan = r["planned_tokens_per_document"]
        cells = [f"{plan[c]['unshared']:.0f} -> {plan[c]['shared']:.0f} "
                 f"(**{plan[c]['unshared'] / plan[c]['shared']:.1f}x**)" for c in chunks]
        s, up = r["seconds_per_document"], r["speedup"]
        lines.append(f"| {shots} | {r['request_tokens_per_document']:.0f} | {' | '.join(cells)} | "
                     f"{statistics.median(s['unshared']):.3f} | {statistics.median(s['shared']):.3f} | "
                     f"**{up['median']:.1f}x** ({up['min']:.1f}-{up['max']:.1f}) | {r['max_abs_loglik_diff']:.1e} | "
                     f"{r['exact']['max_abs_loglik_diff']:.1e} ({r['exact']['requests']} requests) |")
    lines += ["", "model tokens: what the scorer feeds the model (context chunks, then each choice's scored tokens); "
              f"at chunk {a['chunk_size']} the scorer's own count, checked equal to the plan. Only whole chunks fed "
              "from the first token are shared, so each document keeps the chunk boundaries (and key groups) it "
              "has alone: a larger chunk shares less of the prefix."]
    return benchmark_end(lines, doc)


def parse(argv=None) -> argparse.Namespace:
    parser = benchmark_parser("bench_fewshot", __doc__)
    parser.add_argument("--task", default="arc_easy")
    parser.add_argument("--limit", type=at_least(1), default=24, help="documents")
    parser.add_argument("--first", type=at_least(0), default=26, help="the first document measured")
    parser.add_argument("--shots", type=at_least(1), nargs="+", default=[5, 10, 25])
    parser.add_argument("--quantizer", default="int4")
    parser.add_argument("--group-size", type=at_least(1), default=32)
    parser.add_argument("--chunk-size", type=at_least(1), default=64)
    parser.add_argument("--plan-chunks", type=at_least(1), nargs="+", default=[64, 512])
    parser.add_argument("--batch-size", type=at_least(1), default=16)
    parser.add_argument("--rounds", type=at_least(1), default=2)
    parser.add_argument("--exact-documents", type=at_least(1), default=4, help="documents checked one row per batch")
    parser.add_argument("--threads", type=at_least(1), default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 documents, 2 shots, 1 round")
    parser.add_argument("--out", type=Path, default=Path("reports/bench_fewshot"))
    args = parser.parse_args(argv)
    if args.quick:
        args.limit, args.shots, args.rounds, args.first = 4, [2], 1, 3
    args.options = {"group_size": args.group_size, "residual_length": 0} if args.quantizer.startswith("int") else {}
    return args


@torch.no_grad()
def main(argv=None) -> dict:
    args = parse(argv)
    model, tokenizer, load_start = benchmark_start(args)
    shots = {}
    for n in args.shots:
        requests = recorded_requests(model, tokenizer, [args.task], args.limit, n, "first_n", first=args.first)
        shots[str(n)] = measure(model, requests, args.limit, args)
        print(f"{n} shots: {shots[str(n)]['speedup']['median']:.1f}x", flush=True)
    doc = benchmark_doc("experiments/bench_fewshot.py", argv, args, load_start, shots=shots)
    write_benchmark(args.out, doc, render)
    return doc


if __name__ == "__main__":
    sys.exit(run_script("bench_fewshot", main))
