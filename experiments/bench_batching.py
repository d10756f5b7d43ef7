"""How much can batching speed up the scoring of short requests on this machine? The model's own forward (no
kvquant, no cache: the ceiling batching can reach) against kvquant's Scorer (simulated mode, a quantized cache),
one request at a time and in batches, on the same random requests of task-like lengths (context 25-59 tokens,
continuation 2-11: ARC-Easy / PIQA). Ratios from one run; writes ``report.md`` and ``results.csv`` to ``--out``.

    python experiments/bench_batching.py --requests 96 --batch-sizes 1 16 --out reports/bench_scoring/batching
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pandas as pd
import torch

import kvquant
from kvquant.errors import at_least, script_parser
from kvquant.exits import run_script
from kvquant.fs import output_dir, write_together
from kvquant.experiment.model_config import ModelConfig
from kvquant.scoring.scorer import Scorer
from kvquant.scoring.models import load_model
from kvquant.runner.report import environment

MODEL = ModelConfig(path="local:models/smollm2-135m-instruct", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                    dtype="float32", device="cpu")


def requests(count: int, vocab: int) -> list[tuple[list[int], list[int]]]:
    gen = torch.Generator().manual_seed(0)

    def tokens(lo, hi):
        return torch.randint(10, vocab, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist()

    return [(tokens(25, 60), tokens(2, 12)) for _ in range(count)]


@torch.inference_mode()
def plain(model, reqs, batch: int) -> float:
    """Seconds to run every request through the model alone, ``batch`` at a time (left-padded, longest first)."""
    order = sorted((c + k for c, k in reqs), key=len, reverse=True)
    start = time.perf_counter()
    for i in range(0, len(order), batch):
        rows = order[i : i + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
        model(ids, attention_mask=mask, logits_to_keep=12)
    return time.perf_counter() - start


def scored(model, reqs, batch: int, quantizer: str) -> float:
    """Seconds for kvquant's Scorer (simulated mode, every token quantized) to score every request."""
    scorer = Scorer(model, kvquant.CacheSpec.of(quantizer, {"residual_length": 0}), "simulated",
                    batch_size=batch)
    start = time.perf_counter()
    scorer.score_many(reqs)
    return time.perf_counter() - start


def main(argv=None):
    parser = script_parser("bench_batching", __doc__)
    parser.add_argument("--requests", type=at_least(1), default=96)
    parser.add_argument("--batch-sizes", type=at_least(1), nargs="+", default=[1, 16])
    parser.add_argument("--quantizers", nargs="+", default=["fp16", "int4"])
    parser.add_argument("--out", type=Path, default=Path("reports/bench_scoring/batching"))
    args = parser.parse_args(argv)
    model, _ = load_model(MODEL)
    reqs = requests(args.requests, model.config.vocab_size)
    plain(model, reqs[:8], 1)  # warm-up
    rows = []
    for batch in args.batch_sizes:
        rows.append({"what": "model forward alone", "batch": batch, "seconds": plain(model, reqs, batch)})
        for name in args.quantizers:
            seconds = scored(model, reqs, batch, name)
            rows.append({"what": f"kvquant Scorer, {name}", "batch": batch, "seconds": seconds})
    df = pd.DataFrame(rows)
    one = {w: s for w, b, s in zip(df.what, df.batch, df.seconds) if b == min(args.batch_sizes)}
    df["speedup_vs_smallest_batch"] = [one[w] / s for w, s in zip(df.what, df.seconds)]
    csv = df.to_csv(index=False, float_format="%.4f")
    env = environment()
    report = "\n".join([
        "# Batching ceiling for scoring short requests", "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {env['date']}; git {env['git_commit']}",
        f"- machine: {env['machine']}; torch {env['torch']}, {torch.get_num_threads()} threads",
        f"- model: SmolLM2-135M-Instruct (float32, CPU); {args.requests} random requests, context 25-59 and "
        "continuation 2-11 tokens", "",
        "```", df.to_string(index=False, float_format=lambda x: f"{x:.3f}"), "```", ""])
    write_together(output_dir(args.out, "--out"), {"results.csv": csv, "report.md": report})
    print(report)


if __name__ == "__main__":
    sys.exit(run_script("bench_batching", main))
