"""Scoring throughput through a kvquant cache against the bare model on the same batches (issue 39 item 5: at
least 0.8x the bare model's tokens per second, in both modes).

    python experiments/bench_throughput.py --limit 20 --rounds 3
    python experiments/bench_throughput.py --quick --model local:models/stories260K/hf --gguf-file "" \\
        --tasks tinystories_lastword   # a smoke run

The requests are lm-eval's own: its tasks (``--tasks``, ``--limit`` documents each, zero-shot) are run once through
``KVQuantLM`` with a recorder in place of its scorer, which keeps every ``(context, continuation)`` pair exactly as
the scorer would receive it. Then, on those requests, in rounds (each variant once per round, in turn, so load from
other jobs falls on all of them alike):

- ``bare``: the model alone, no cache object (``use_cache=False``): the requests sorted longest first and cut into
  batches of at most ``--batch-size`` rows by the scorer's own rule (fewest padded positions plus a forward's
  cost), right-padded with an attention mask, one forward per batch through the decoder; only the scored positions
  go through the output layer, as the scorer projects them. Log-probabilities of every continuation are computed.
- ``<mode> <quantizer>``: kvquant's :class:`~kvquant.scoring.scorer.Scorer` in ``simulated`` mode (one forward per
  batch, K/V quantized as written and read back dequantized) and ``streaming`` mode (contexts prefilled
  ``--chunk-size`` tokens at a time and shared by the requests that have them, continuations after), batch
  ``--batch-size``, for each ``--quantizers`` setting (fp16: the identity quantizer; others with every token
  quantized, ``residual_length`` 0).

Tokens counted: context + continuation of every request, the same for every variant (streaming mode feeds fewer, a
shared context once). Every variant is run once untimed first (a warm-up, and the check); then per variant the
median tokens/s over the timed rounds and the ratio to ``bare`` in the same round (median, min, max). Check (the
untimed pass): the fp16 identity's summed log-likelihood per request against the bare model's (float noise only: a
few 1e-5), and a quantizer's apart from it.

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
from kvquant.errors import at_least
from kvquant.exits import run_script
from kvquant.runner.preview import recorded_requests
from kvquant.runner.report import (benchmark_doc, benchmark_end, benchmark_lines, benchmark_parser, benchmark_start,
                                   write_benchmark)
from kvquant.scoring.scorer import Scorer, _cut

TASKS = ("arc_easy", "hellaswag", "piqa", "lambada_openai")
MODES = ("simulated", "streaming")
BARE = "bare"
#: the issue's target: scoring through the cache at no less than this share of the bare model's tokens/s
TARGET = 0.8


@torch.inference_mode()
def bare_scores(model, requests, batch_size: int) -> list[float]:
    """Each request's summed continuation log-probability from the model alone (no cache object), in batches cut
    by the scorer's rule from the requests sorted longest first."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    device = head.weight.device
    order = sorted(range(len(requests)), key=lambda i: -sum(map(len, requests[i])))
    out: list[float] = [0.0] * len(requests)
    start = 0
    for size in _cut([sum(map(len, requests[i])) for i in order], batch_size):
        batch = order[start : start + size]
        start += size
        width = sum(map(len, requests[batch[0]]))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        keep = torch.zeros(len(batch), width, dtype=torch.bool)
        targets = []
        for r, i in enumerate(batch):
            context, continuation = requests[i]
            n = len(context) + len(continuation)
            ids[r, :n] = torch.tensor(context + continuation)
            mask[r, :n] = 1
            keep[r, len(context) - 1 : n - 1] = True  # the positions that predict the continuation
            targets += continuation
        hidden = decoder(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).last_hidden_state
        logprobs = torch.log_softmax(head(hidden[keep.to(device)]).float(), dim=-1)
        picked = logprobs.gather(1, torch.tensor(targets, device=device)[:, None])[:, 0].double().cpu()
        for i, part in zip(batch, picked.split([len(requests[i][1]) for i in batch])):
            out[i] = float(part.sum())
    return out


def scorer_scores(model, requests, mode: str, quantizer: str, args) -> list[float]:
    """Each request's summed continuation log-probability through kvquant's scorer."""
    options = {} if quantizer == "fp16" else {"residual_length": 0}
    scorer = Scorer(model, CacheSpec.of(quantizer, options), mode=mode, chunk_size=args.chunk_size,
                    batch_size=args.batch_size)
    return [float(s.logprobs.double().sum()) for s in scorer.score_many(requests)]


def variants(args) -> list[str]:
    return [BARE, *(f"{mode} {q}" for mode in args.modes for q in args.quantizers)]


def run_variant(model, requests, name: str, args) -> list[float]:
    if name == BARE:
        return bare_scores(model, requests, args.batch_size)
    mode, quantizer = name.split()
    return scorer_scores(model, requests, mode, quantizer, args)


def time_rounds(model, requests, args) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per variant: its log-likelihoods from an untimed first pass (the check, and a warm-up), then its seconds in
    each of ``args.rounds`` timed rounds."""
    scores = {name: run_variant(model, requests, name, args) for name in variants(args)}
    seconds: dict[str, list[float]] = {v: [] for v in variants(args)}
    for r in range(args.rounds):
        for name in variants(args):
            start = time.perf_counter()
            run_variant(model, requests, name, args)
            seconds[name].append(time.perf_counter() - start)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{v} {s[-1]:.1f} s" for v, s in seconds.items()),
              flush=True)
    return seconds, scores


def summarize(seconds: dict[str, list[float]], scores: dict[str, list[float]], tokens: int) -> dict:
    """Per variant: tokens/s (median over rounds), its ratio to bare's in the same round (median, min, max), and
    the largest difference of a request's log-likelihood from the bare model's."""
    out = {}
    for name, times in seconds.items():
        ratios = [b / t for b, t in zip(seconds[BARE], times)]
        out[name] = {"seconds": times, "tokens_per_s": tokens / statistics.median(times),
                     "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
                     "max_abs_loglik_diff": max(abs(a - b) for a, b in zip(scores[name], scores[BARE]))}
    return out


def render(doc: dict) -> str:
    a = doc["args"]
    *head, model = benchmark_lines(doc, "Scoring throughput through the cache against the bare model")
    lines = [*head, f"{model}; lm-eval's requests of "
             f"{', '.join(a['tasks'])}, {a['limit']} documents each, zero-shot: {doc['requests']} requests, "
             f"{doc['tokens']} tokens (context + continuation); batch {a['batch_size']}, streaming chunk "
             f"{a['chunk_size']}; one untimed pass, then {a['rounds']} timed rounds, each variant once per round in "
             "turn",
             f"- target (issue 39 item 5): every variant at >= {TARGET}x the bare model's tokens/s", "",
             "| variant | tokens/s (median) | **/ bare, same round** | max abs Δ loglik vs bare | meets 0.8x |",
             "|---|---:|---:|---:|---|"]
    for name, v in doc["variants"].items():
        r = v["ratio"]
        meets = "-" if name == BARE else ("yes" if r["median"] >= TARGET else "**no**")
        lines.append(f"| {name} | {v['tokens_per_s']:.0f} | **{r['median']:.2f}x** ({r['min']:.2f}-{r['max']:.2f}) "
                     f"| {v['max_abs_loglik_diff']:.2e} | {meets} |")
    return benchmark_end(lines, doc)


def parse(argv=None) -> argparse.Namespace:
    parser = benchmark_parser("bench_throughput", __doc__)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--limit", type=at_least(1), default=20, help="documents per task")
    parser.add_argument("--batch-size", type=at_least(1), default=16)
    parser.add_argument("--chunk-size", type=at_least(1), default=512)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--quantizers", nargs="+", default=["fp16", "int4", "int8", "fp8_e4m3"])
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--threads", type=at_least(1), default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 documents, 1 round")
    parser.add_argument("--out", type=Path, default=Path("reports/bench_throughput"))
    args = parser.parse_args(argv)
    if args.quick:
        args.limit, args.rounds = 2, 1
    return args


@torch.no_grad()
def main(argv=None) -> dict:
    args = parse(argv)
    model, tokenizer, load_start = benchmark_start(args)
    requests = recorded_requests(model, tokenizer, args.tasks, args.limit)
    tokens = sum(len(c) + len(t) for c, t in requests)
    seconds, scores = time_rounds(model, requests, args)
    doc = benchmark_doc("experiments/bench_throughput.py", argv, args, load_start, requests=len(requests),
                        tokens=tokens, variants=summarize(seconds, scores, tokens))
    write_benchmark(args.out, doc, render)
    return doc


if __name__ == "__main__":
    sys.exit(run_script("bench_throughput", main))
