"""Does the model do the long-range probe (``kvquant.scoring.passkey``) in full precision? Accuracy per distance.

    python experiments/probe_calibration.py --model /tmp/smollm2-hf --per-distance 6

Builds the pass-key documents, scores each with one teacher-forced forward pass through a plain ``DynamicCache``
(fp32), and prints a markdown table: per distance D (tokens) the number of documents, ``acc`` (the whole target
is the greedy continuation, as lm-eval scores it), the fraction of target tokens that are greedy, the mean
target log-likelihood (nats) and seconds per document; then the same for the no-information baseline (the
documents of ``--baseline-distance`` without the key sentences). ``--model`` is a Hugging Face model directory,
or a directory holding ``--gguf-file`` (default: SmolLM2-135M-Instruct's GGUF in the data directory).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvquant.errors import at_least
from kvquant.exits import run_script
from kvquant.paths import data_dir
from kvquant.scoring.passkey import probe_documents

SMOLLM2 = ("models/smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")


@torch.inference_mode()
def score(model, tokenizer, doc: dict) -> dict:
    """Teacher-forced score of ``doc["target"]`` after ``doc["context"]``, tokenized as lm-eval does."""
    whole = tokenizer(doc["context"] + doc["target"]).input_ids
    context = tokenizer(doc["context"]).input_ids
    if whole[: len(context)] != context:
        raise SystemExit(f"the context's tokens change when the target is appended (distance {doc['distance']})")
    start = time.perf_counter()
    ids = torch.tensor([whole])
    logits = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits[0]
    logits = logits[len(context) - 1 : -1].float()
    targets = ids[0, len(context) :]
    greedy = logits.argmax(-1) == targets
    loglik = logits.log_softmax(-1).gather(1, targets[:, None]).sum()
    return {"acc": float(greedy.all()), "token_acc": float(greedy.float().mean()), "loglik": float(loglik),
            "tokens": len(whole), "seconds": time.perf_counter() - start}


def row(label: str, distance, results: list[dict]) -> str:
    n = len(results)
    mean = {k: sum(r[k] for r in results) / n for k in ("acc", "token_acc", "loglik", "seconds")}
    return (f"| {label} | {distance} | {n} | {mean['acc']:.2f} | {mean['token_acc']:.2f} | {mean['loglik']:.2f} | "
            f"{max(r['tokens'] for r in results)} | {mean['seconds']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: SmolLM2's GGUF in the data directory)")
    parser.add_argument("--gguf-file", help="GGUF file inside --model (default: SmolLM2's when --model is unset)")
    parser.add_argument("--distances", type=at_least(1), nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--per-distance", type=at_least(1), default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-distance", type=at_least(1), default=256)
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model_dir, gguf = args.model, args.gguf_file
    if model_dir is None:
        root = data_dir()
        if root is None:
            raise SystemExit("no data directory: pass --model or set KVQUANT_DATA")
        model_dir, gguf = str(root / SMOLLM2[0]), gguf or SMOLLM2[1]
    extra = {"gguf_file": gguf} if gguf else {}
    extra["trust_remote_code"] = False  # never run a model folder's own Python
    tokenizer = AutoTokenizer.from_pretrained(model_dir, **extra)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra).eval()

    print(f"- command: `python {shlex.join(sys.argv)}`")
    print(f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"- machine: {platform.platform()}, CPU ({os.cpu_count()} cores), {torch.get_num_threads()} torch "
          f"thread(s); torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"- model: {model_dir}{' / ' + gguf if gguf else ''}, fp32 weights and compute, DynamicCache; "
          f"seed {args.seed}")
    print()
    print("| documents | distance (tokens) | n | acc | token acc | mean log-lik (nats) | max tokens | s/doc |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    docs = probe_documents(tokenizer, args.distances, args.per_distance, args.seed)
    for distance in args.distances:
        results = [score(model, tokenizer, d) for d in docs if d["distance"] == distance]
        print(row("pass key", distance, results), flush=True)
    docs = probe_documents(tokenizer, [args.baseline_distance], args.per_distance, args.seed, baseline=True)
    print(row("no-information baseline", f"({args.baseline_distance})", [score(model, tokenizer, d) for d in docs]),
          flush=True)


if __name__ == "__main__":
    sys.exit(run_script("probe_calibration", main))
