"""Decode speed and cache memory of kvquant's quantizers against transformers' caches, in one process.

    python experiments/bench_decode.py --contexts 512 2048 8192 --steps 160
    python experiments/bench_decode.py --shape smollm2 --batch 64 --contexts 256 --fill direct \
        --only DynamicCache kvquant-int4-r0 kvquant-int4-r0-fused

For each context length (and ``--batch`` rows): fill each cache with a random prompt (chunked prefill through the
model, or with ``--fill direct`` random states written straight into every layer, which is what a long prefill
stores without its compute), run a few warm-up decode steps, then time ``--steps`` single-token steps (best of
``--repeats``) and read the stored bytes. ``--shape smollm2`` is SmolLM2-135M's (30 layers, 9 query and 3 KV heads,
head_dim 64), random-init. Names ending in ``-fused`` run on a copy of the model with
``kvquant.enable_fused_decode``: decode steps attend over the stored codes. Writes ``results.csv`` and
``report.md`` (with the command, machine and date, and the targets as ratios from this run) to ``--out``.
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, QuantizedCache

import kvquant
from kvquant.formats import kernels
from kvquant.cache import stored_bytes
from kvquant.errors import at_least, script_parser
from kvquant.exits import run_script
from kvquant.fs import output_dir, write_together
from kvquant.runner.report import environment

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
    # every token quantized (no full-precision window): what the batched cache's targets are about
    out["kvquant-int4-r0"] = lambda: kvquant.make_cache(config, "int4", residual_length=0)
    for name in ("int4", "int2"):  # what the Hadamard rotation costs (same bytes)
        out[f"kvquant-{name}-hadamard"] = lambda name=name: kvquant.make_cache(config, name, rotation="hadamard")
    return out


FUSED = "-fused"


def fused_caches(config):
    """The same caches on a model with fused decode (``config`` of that model): attention reads the codes."""
    return {
        "kvquant-int4-r0" + FUSED: lambda: kvquant.make_cache(config, "int4", residual_length=0),
        "kvquant-int8" + FUSED: lambda: kvquant.make_cache(config, "int8"),
        "kvquant-fp8_e4m3" + FUSED: lambda: kvquant.make_cache(config, "fp8_e4m3"),
        "kvquant-fp16" + FUSED: lambda: kvquant.make_cache(config, "fp16"),
    }


SHAPES = {
    "bench": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=8,
                  head_dim=128, vocab_size=32000),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, vocab_size=49152, num_hidden_layers=30),
}


def fill(model, cache, prompt, how, chunk=1024):
    """Write ``prompt`` ``[B, T]`` into ``cache``: through the model, or (``direct``) random states per layer."""
    if how == "model":
        for i in range(0, prompt.shape[1], chunk):
            model(prompt[:, i : i + chunk], cache=cache, use_cache=True)
        return
    cfg, param = model.config, next(model.parameters())
    gen = torch.Generator().manual_seed(prompt.shape[1])
    for i in range(0, prompt.shape[1], chunk):
        n = min(chunk, prompt.shape[1] - i)
        for layer in range(cfg.num_hidden_layers):
            k, v = (torch.randn(prompt.shape[0], cfg.num_key_value_heads, n, cfg.head_dim, generator=gen)
                    .to(device=param.device, dtype=param.dtype) for _ in range(2))
            cache.update(k, v, layer)


@torch.inference_mode()
def measure(model, make, context, steps, repeats, batch=1, how="model", warmup=8):
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(context)
    prompt = torch.randint(0, vocab, (batch, context), generator=gen).to(device)
    best = float("inf")
    for _ in range(repeats):
        cache = make()
        fill(model, cache, prompt, how)
        token = torch.randint(0, vocab, (batch, 1), generator=gen).to(device)
        for _ in range(warmup):
            model(token, cache=cache, use_cache=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            model(token, cache=cache, use_cache=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    tokens = cache.get_seq_length()
    layers, kv_heads, head_dim = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    fp16_bytes = 2 * layers * kv_heads * head_dim * 2 * tokens * batch
    return {"batch": batch, "step_ms": 1000 * best / steps, "tokens_per_s": batch * steps / best, "tokens": tokens,
            "bytes": stored_bytes(cache), "fp16_bytes": fp16_bytes}


def main(argv=None):
    parser = script_parser("bench_decode", __doc__)
    parser.add_argument("--contexts", type=at_least(1), nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--steps", type=at_least(1), default=160)
    parser.add_argument("--repeats", type=at_least(1), default=2)
    parser.add_argument("--warmup", type=at_least(0), default=8, help="decode steps before the timed ones")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--layers", type=at_least(1), default=2, help="decoder layers of the 'bench' shape")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--batch", type=at_least(1), nargs="+", default=[1], help="rows decoded together")
    parser.add_argument("--fill", choices=["model", "direct"], default="model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", nargs="*", help="cache names to run (default: all)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench_decode"))
    args = parser.parse_args(argv)

    config = LlamaConfig(**{"num_hidden_layers": args.layers, **SHAPES[args.shape]},
                         max_position_embeddings=max(args.contexts) + 2 * args.steps + 16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    fused_model = LlamaForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    fused_model.load_state_dict(model.state_dict())
    kvquant.enable_fused_decode(fused_model)
    factories = {k: v for k, v in {**caches(config), **fused_caches(fused_model.config)}.items()
                 if not args.only or k in args.only}
    rows = []
    for batch in args.batch:
        for context in args.contexts:
            for name, make in tqdm(factories.items(), desc=f"batch {batch} x context {context}"):
                rows.append({"context": context, "cache": name,
                             **measure(fused_model if name.endswith(FUSED) else model, make, context, args.steps,
                                         args.repeats, batch, args.fill, args.warmup)})
    df = pd.DataFrame(rows)
    key = list(zip(df.batch, df.context))
    base = {k: t for k, t, c in zip(key, df.tokens_per_s, df.cache) if c == "DynamicCache"}
    quanto = {k: t for k, t, c in zip(key, df.tokens_per_s, df.cache) if c == "hf-quanto-int4"}
    df["speed_vs_dynamic"] = [t / base[k] if k in base else float("nan") for k, t in zip(key, df.tokens_per_s)]
    if quanto:
        df["speed_vs_quanto_int4"] = [t / quanto[k] if k in quanto else float("nan")
                                      for k, t in zip(key, df.tokens_per_s)]
    df["memory_vs_fp16"] = df.bytes / df.fp16_bytes
    csv = df.to_csv(index=False, float_format="%.4f")
    report = render(df, args)
    write_together(output_dir(args.out, "--out"), {"results.csv": csv, "report.md": report})
    print(report)


def target_lines(df, args):
    """The core issue's targets, as ratios from this run."""
    def at(cache, context, column, batch=1):
        sel = df[(df.cache == cache) & (df.context == context) & (df.batch == batch)]
        return float(sel[column].iloc[0]) if len(sel) else None

    if args.shape == "smollm2":  # the batched cache's targets (issue 21): step time as a multiple of DynamicCache's
        lines = []
        for (batch, context, bound), cache in itertools.product(((64, 256, 1.3), (16, 8192, 1.1)),
                                                                ("kvquant-int4-r0", "kvquant-int4-r0" + FUSED)):
            speed = at(cache, context, "speed_vs_dynamic", batch)
            if speed is not None:
                lines.append(f"| {cache} | {batch} x {context} | step time / DynamicCache's | "
                             f"{1 / speed:.3f} | "
                             f"<= {bound} | {'PASS' if 1 / speed <= bound else 'FAIL'} |")
        return lines
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


def model_line(args):
    if args.shape == "smollm2":
        return "SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 KV heads, head_dim 64)"
    return f"{args.layers} layers, hidden 1024, 8 KV heads, head_dim 128"


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
        f"- model: random-init Llama, {model_line(args)}, {args.dtype}, on {args.device}; caches filled "
        + ("through the model (chunked prefill)" if args.fill == "model" else "with random states written into every "
           "layer (--fill direct)"),
        "- kvquant settings (defaults): "
        + "; ".join(f"{n}: {kvquant.make_cache(LlamaConfig(), n).settings()}" for n in kvquant.available_quantizers()),
        f"- transformers quanto int4: q_group_size {GROUP}, residual {RESIDUAL}; transformers fp8: per-tensor scale "
        "frozen on the prompt",
        f"- timing: {args.steps} single-token decode steps after {args.warmup} warm-up steps, best of {args.repeats}; "
        "memory: bytes of every stored tensor at the end",
        "",
        "## Targets (ratios measured in this run)",
        "",
        "| cache | context | metric | value | target | |",
        "|---|---|---|---|---|---|",
        *target_lines(df, args),
        "",
        "## All measurements",
        "",
        "```",
        df.to_string(index=False, float_format=lambda v: f"{v:.3f}"),
        "```",
        "",
    ])


if __name__ == "__main__":
    sys.exit(run_script("bench_decode", main))
