"""Qwen2.5's key-projection bias removed before RoPE and after it (issue 56): KL of each cache against the model's own
``DynamicCache`` on stories, keys before and after RoPE.

    python experiments/prerope_bias.py [--documents 1] [--out reports/prerope_bias]

Qwen2.5-Coder-0.5B (``make setup`` prepares it; float32) over ``--documents`` TinyStories validation stories of
200-300 tokens (the first that long), fed as a prefill of 128 tokens, two single tokens, then the rest: each
cache's mean KL(model || cache) per position (nats) and the largest |logit| difference. The caches: the identity
(fp16) stored before RoPE; Lloyd-Max 4-bit (rotated, per token and head) after and before RoPE, with and without a
``key_offset`` of each layer's ``k_proj`` bias (before RoPE the keys are ``W x + b``, so removing ``b`` leaves ``W x``;
after RoPE they are ``R_p (W x + b)`` and removing ``b`` leaves ``R_p W x + (R_p b - b)``); int4 and int2 with
per-channel key groups of 32, after and before RoPE. Point values of a few documents, no intervals: what the gate
decides is a run's (configs/, kvquant.run). Writes ``report.md`` and ``results.csv`` to ``--out``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from transformers import DynamicCache

import kvquant
from kvquant.errors import at_least, script_parser
from kvquant.exits import run_script
from kvquant.experiment.model_config import ModelConfig
from kvquant.fs import output_dir, write_together
from kvquant.paths import resolve
from kvquant.runner.report import environment
from kvquant.scoring.models import load_model

MODEL = ModelConfig(path="package:qwen2.5-coder-0.5b-instruct-q4-k-m-gguf",
                    gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", dtype="float32")
STORIES = "local:text/tinystories/validation-first1000.jsonl"
STEPS = (128, 1, 1)  # then the rest of the document


def candidates(model) -> dict[str, dict]:
    """The caches compared (module docstring), as make_cache options."""
    heads = model.config.num_key_value_heads
    bias = {i: {"key_offset": layer.self_attn.k_proj.bias.detach().reshape(heads, -1).tolist()}
            for i, layer in enumerate(model.model.layers)}
    lloyd = {"quantizer": "lloyd_max", "residual_length": 0}
    return {
        "fp16, before RoPE": {"quantizer": "fp16", "pre_rope": True},
        "lloyd_max 4, after RoPE": lloyd,
        "lloyd_max 4, after RoPE, bias removed": {**lloyd, "layers": bias},
        "lloyd_max 4, before RoPE": {**lloyd, "pre_rope": True},
        "lloyd_max 4, before RoPE, bias removed": {**lloyd, "pre_rope": True, "layers": bias},
        **{f"{name} g32, {where} RoPE": {"quantizer": name, "group_size": 32, "residual_length": 0,
                                          **({"pre_rope": True} if where == "before" else {})}
           for name in ("int4", "int2") for where in ("after", "before")},
    }


def logits(model, ids: torch.Tensor, cache) -> torch.Tensor:
    out, fed = [], 0
    for n in (*STEPS, ids.shape[1] - sum(STEPS)):
        out.append(model(ids[:, fed : fed + n], cache=cache, use_cache=True).logits[0])
        fed += n
    return torch.cat(out)


@torch.inference_mode()
def measure(documents: int) -> pd.DataFrame:
    model, tokenizer = load_model(MODEL)
    with open(resolve(STORIES), encoding="utf-8") as f:
        texts = (json.loads(line)["text"] for line in f)
        docs = [ids for ids in (tokenizer(t).input_ids for t in texts) if 200 <= len(ids) <= 300][:documents]
    rows = []
    for index, ids in enumerate(docs):
        ids = torch.tensor([ids])
        want = logits(model, ids, DynamicCache(config=model.config))
        for name, options in candidates(model).items():
            start = time.perf_counter()
            got = logits(model, ids, kvquant.make_cache(model, **options))
            kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                            reduction="batchmean")
            rows.append({"document": index, "tokens": ids.shape[1], "cache": name, "kl": float(kl),
                         "max_abs_logit_diff": float((got - want).abs().max()),
                         "seconds": time.perf_counter() - start})
    return pd.DataFrame(rows)


def render(df: pd.DataFrame, load: tuple[float, float]) -> str:
    env = environment()
    mean = df.groupby("cache", sort=False).agg(kl=("kl", "mean"), largest=("max_abs_logit_diff", "max"))
    lines = ["| cache | mean KL (nats) | largest abs logit difference |", "|---|---:|---:|"]
    lines += [f"| {name} | {kl:.3g} | {largest:.3g} |" for name, kl, largest in zip(mean.index, mean.kl, mean.largest)]
    return "\n".join([
        "# Qwen2.5's key bias removed before and after RoPE (issue 56)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {env['date']}; git {env['git_commit']}; kvquant from {Path(kvquant.__file__).parent}",
        f"- machine: {env['machine']}, shared; load average {load[0]:.2f} before, {load[1]:.2f} after (1 minute)",
        f"- {df.document.nunique()} TinyStories validation documents of {', '.join(map(str, df.tokens.unique()))} "
        f"tokens, fed {' + '.join(map(str, STEPS))} + the rest; point values, no intervals",
        "",
        *lines,
        "",
    ])


def main(argv=None):
    parser = script_parser("prerope_bias", __doc__)
    parser.add_argument("--documents", type=at_least(1), default=1)
    parser.add_argument("--out", type=Path, default=Path("reports/prerope_bias"))
    args = parser.parse_args(argv)
    before = os.getloadavg()[0]
    df = measure(args.documents)
    report = render(df, (before, os.getloadavg()[0]))
    write_together(output_dir(args.out, "--out"), {"results.csv": df.to_csv(index=False, float_format="%.6g"),
                                                   "report.md": report})
    print(report)


if __name__ == "__main__":
    sys.exit(run_script("prerope_bias", main))
