"""Decode speed and cache memory of kvquant's quantizers against transformers' caches, in one process.

    python experiments/bench_decode.py --contexts 512 2048 8192 --steps 160

For each context length: fill each cache with a random prompt (chunked prefill), run a few warm-up decode
steps, then time ``--steps`` single-token steps (best of ``--repeats``) and read the stored bytes. Writes
``results.csv`` and ``report.md`` (with the command, machine and date, and the targets as ratios from this
run) to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, QuantizedCache

import kvquant
from kvquant import kernels
from kvquant.cache import stored_bytes
from kvquant.report import environment

GROUP, RESIDUAL = 32, 128


def caches(config):
    """name -> factory of a fresh cache."""
    out = {
        "DynamicCache": lambda: DynamicCache(config=config),
        "hf-quanto-int4": lambda: QuantizedCache("quanto", config, nbits=4, q_group_size=GROUP,
                                                 residual_length=RESIDUAL),
        "hf-fp8": lambda: QuantizedCache("fp8", config),
    }
    for name in kvquant.available_quantizers():  # each with its defaults (int4/int2: group 32, residual 128)
        out[f"kvquant-{name}"] = lambda name=name: kvquant.make_cache(config, name)
    for name in ("int4", "int2"):  # what the Hadamard rotation costs (same bytes)
        out[f"kvquant-{name}-hadamard"] = lambda name=name: kvquant.make_cache(config, name, rotation="hadamard")
    return out


@torch.inference_mode()
def measure(model, make, context, steps, repeats, prefill_chunk=1024, warmup=8):
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(context)
    prompt = torch.randint(0, vocab, (1, context), generator=gen)
    best = float("inf")
    for _ in range(repeats):
        cache = make()
        for i in range(0, context, prefill_chunk):
            model(prompt[:, i : i + prefill_chunk], cache=cache, use_cache=True)
        token = torch.randint(0, vocab, (1, 1), generator=gen)
        for _ in range(warmup):
            model(token, cache=cache, use_cache=True)
        start = time.perf_counter()
        for _ in range(steps):
            model(token, cache=cache, use_cache=True)
        best = min(best, time.perf_counter() - start)
    tokens = cache.get_seq_length()
    layers, kv_heads, head_dim = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    fp16_bytes = 2 * layers * kv_heads * head_dim * 2 * tokens
    return {"tokens_per_s": steps / best, "tokens": tokens, "bytes": stored_bytes(cache), "fp16_bytes": fp16_bytes}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="cache names to run (default: all)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench_decode"))
    args = parser.parse_args(argv)

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                         max_position_embeddings=max(args.contexts) + 2 * args.steps)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    factories = {k: v for k, v in caches(config).items() if not args.only or k in args.only}
    rows = []
    for context in args.contexts:
        for name, make in tqdm(factories.items(), desc=f"context {context}"):
            rows.append({"context": context, "cache": name, **measure(model, make, context, args.steps, args.repeats)})
    df = pd.DataFrame(rows)
    base = df[df.cache == "DynamicCache"].set_index("context")
    quanto = df[df.cache == "hf-quanto-int4"].set_index("context")
    df["speed_vs_dynamic"] = df.tokens_per_s / df.context.map(base.tokens_per_s)
    if not quanto.empty:
        df["speed_vs_quanto_int4"] = df.tokens_per_s / df.context.map(quanto.tokens_per_s)
    df["memory_vs_fp16"] = df.bytes / df.fp16_bytes
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "results.csv", index=False, float_format="%.4f")
    report = render(df, args)
    (args.out / "report.md").write_text(report)
    print(report)


def target_lines(df):
    """The core issue's targets, as ratios from this run."""
    def at(cache, context, column):
        sel = df[(df.cache == cache) & (df.context == context)]
        return float(sel[column].iloc[0]) if len(sel) else None

    checks = [("kvquant-int4", 8192, "memory_vs_fp16", "<=", 0.33),
              ("kvquant-int2", 8192, "memory_vs_fp16", "<=", 0.21)]
    checks += [(f"kvquant-{n}", 8192, "memory_vs_fp16", "<=", 0.54) for n in ("int8", "fp8_e4m3", "fp8_e5m2")]
    checks += [("kvquant-int4", 2048, "speed_vs_dynamic", ">=", 0.8),
               ("kvquant-int4", 8192, "speed_vs_dynamic", ">=", 0.6)]
    checks += [("kvquant-int4", c, "speed_vs_quanto_int4", ">=", 1.3) for c in (2048, 8192)]
    lines = []
    for cache, context, column, op, bound in checks:
        value = at(cache, context, column) if column in df else None
        if value is None:
            continue
        ok = value <= bound if op == "<=" else value >= bound
        lines.append(f"| {cache} | {context} | {column} | {value:.3f} | {op} {bound} | {'PASS' if ok else 'FAIL'} |")
    return lines


def render(df, args):
    command = "python " + " ".join([sys.argv[0], *sys.argv[1:]])
    env = environment()
    return "\n".join([
        "# Decode speed and KV-cache memory",
        "",
        f"- command: `{command}`",
        f"- date: {env['date']}; git {env['git_commit']}",
        f"- machine: {env['machine']}, {torch.get_num_threads()} torch threads; torch {env['torch']}, transformers "
        f"{env['transformers']}",
        f"- kvquant's fused CPU dequantization kernel: {'used' if kernels.available() else 'unavailable (eager path)'}",
        f"- model: random-init Llama, {args.layers} layers, hidden 1024, 8 KV heads, head_dim 128, {args.dtype}",
        "- kvquant settings (defaults): "
        + "; ".join(f"{n}: {kvquant.make_cache(LlamaConfig(), n).settings()}" for n in kvquant.available_quantizers()),
        f"- transformers quanto int4: q_group_size {GROUP}, residual {RESIDUAL}; transformers fp8: per-tensor scale "
        "frozen on the prompt",
        f"- timing: {args.steps} single-token decode steps after 8 warm-up steps, best of {args.repeats}; "
        "memory: bytes of every stored tensor at the end",
        "",
        "## Targets (ratios measured in this run)",
        "",
        "| cache | context | metric | value | target | |",
        "|---|---|---|---|---|---|",
        *target_lines(df),
        "",
        "## All measurements",
        "",
        "```",
        df.to_string(index=False, float_format=lambda v: f"{v:.3f}"),
        "```",
        "",
    ])


if __name__ == "__main__":
    main()
