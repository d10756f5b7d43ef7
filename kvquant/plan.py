"""Capacity planner: how much KV cache, how many sequences, how long a context fit a GPU, per cache setting.

    python -m kvquant.plan --model llama-3.1-8b --context 32768 --gpu-memory 80GB --cache fp16 --cache int4
    python -m kvquant.plan --model llama-2-70b --context 32768 --batch 1 --cache fp16 --json
    python -m kvquant.plan --model llama-3.1-8b --context-from reports/long:int4-g32 --gpu-memory 80GB --cache int4

KV bytes come from kvquant's own cache code (each quantizer written once, on zeros or on meta tensors, its storage
rules then applied to any context, and each answer checked against a full run of the cache code), so a plan counts
what a cache really stores: payload, scales, zero points, residual and sink windows, incomplete groups; fp16, bf16
and fp32 are the identity quantizer at that dtype. Sliding-window layers stop growing at their window. Every size
has a bound (docs/planner.md), so every plan takes seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

import torch

from kvquant.cache.storage import Store
from kvquant.errors import EXIT_PASS, KVQuantError, OneLineParser, parse_args, visible
from kvquant.exits import run_guarded
from kvquant.importpath import drop_working_dir
from kvquant.scoring.models import DTYPES
from kvquant.planner.cost import MAX_LAYER_KINDS
from kvquant.planner.fitted import FittedContext, fitted_context
from kvquant.planner.shapes import (FULL_PRECISION, KNOWN_MODELS, MAX_CONTEXT, Planner, human, parse_bytes,
    parse_setting, resolve_model, tensor_parallel)

DEFAULT_SETTINGS = ["fp16", "fp8_e4m3", "int8", "int4", "int2"]
MAX_BATCH = 1_000_000
#: Most --cache values (and plan_cost.MAX_LAYER_KINDS kinds of layer in all of them): bounds a plan's work.
MAX_SETTINGS = 16


def parse_reserve(text: str, budget: int) -> int:
    """``--reserve``: a share of the budget (``10%``, from 0 up to but excluding 100%) or a size (``4GiB``)."""
    if not text.strip().endswith("%"):
        return parse_bytes(text, "--reserve")
    share = text.strip()[:-1]
    if not re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", share) or not 0 <= float(share) < 100:
        raise KVQuantError(f"--reserve: {text!r} must be a share from 0% to below 100% or a size such as 4GiB")
    return int(budget * float(share) / 100)


def per_gpu_scales(settings: dict, model_heads: int, gpu_heads: int, text: str) -> dict:
    """``settings`` with per-head static scales (``k_scale``/``v_scale`` lists, top level and per ``layers`` entry)
    given per KV head of the model cut to one tensor-parallel GPU's share (its first ``gpu_heads``; the bytes do not
    depend on the values); a list of another length is one line naming the model's count."""
    out = dict(settings)
    for key in ("k_scale", "v_scale"):
        value = out.get(key)
        if isinstance(value, list) and model_heads != gpu_heads:
            if len(value) != model_heads:
                raise KVQuantError(f"--cache {text[:80]!r}: {key} has {len(value)} per-head scales for a model of "
                                   f"{model_heads} KV heads; give one per KV head of the model (each GPU takes "
                                   "its heads' share under --tensor-parallel), or one number for the whole layer")
            out[key] = value[:gpu_heads]
    if isinstance(out.get("layers"), dict):
        out["layers"] = {span: per_gpu_scales(layer, model_heads, gpu_heads, text) if isinstance(layer, dict)
                         else layer for span, layer in out["layers"].items()}
    return out


def build_plan(args) -> dict:
    whole = resolve_model(args.model)
    shape = tensor_parallel(whole, args.tensor_parallel)  # what one GPU holds (weights and KV heads)
    if args.context is None or args.context <= 0 or args.context > MAX_CONTEXT:
        raise KVQuantError(f"--context must be between 1 and {MAX_CONTEXT:,} tokens, got {args.context}")
    if args.batch <= 0 or args.batch > MAX_BATCH:
        raise KVQuantError(f"--batch must be between 1 and {MAX_BATCH:,}, got {args.batch}")
    if len(args.cache or ()) > MAX_SETTINGS:
        raise KVQuantError(f"--cache is given {len(args.cache)} times, over the {MAX_SETTINGS} one plan takes")
    if args.shared_prefix < 0 or args.shared_prefix > args.context:
        raise KVQuantError(f"--shared-prefix must be between 0 and --context ({args.context}), "
                           f"got {args.shared_prefix}")
    weight_size = torch.empty(0, dtype=getattr(torch, args.weights_dtype)).element_size()
    weights = parse_bytes(args.weights, "--weights") if args.weights else int(shape.params * weight_size)
    budget = parse_bytes(args.gpu_memory, "--gpu-memory") if args.gpu_memory else None
    available = None
    if budget is not None:
        reserve = parse_reserve(args.reserve, budget)
        available = budget - weights - reserve
        if available <= 0:
            raise KVQuantError(f"the budget {human(budget)} does not cover the weights {human(weights)} plus the "
                               f"reserve {human(reserve)}")
    rows, kinds_left = [], MAX_LAYER_KINDS
    for text in args.cache or DEFAULT_SETTINGS:
        name = text.partition(":")[0]
        setting = per_gpu_scales(parse_setting(text), whole.kv_heads, shape.kv_heads, text)
        planner = Planner(shape, setting, FULL_PRECISION.get(name, getattr(torch, args.dtype)), kinds_left)
        kinds_left -= planner.layer_kinds
        mem = planner.memory(args.batch, args.context)
        row = {"cache": text, "settings": planner.settings, "kv_bytes": int(mem["total_bytes"]),
               "bytes_per_token": mem["total_bytes"] / (args.batch * args.context),
               "bits_per_element": mem["bits_per_element"], "breakdown": {k: int(mem[k]) for k in (
                   "payload_bytes", "scale_bytes", "full_precision_bytes")},
               "per_layer": [{"layer": p["layer"], "kv_bytes": int(p["total_bytes"]),
                              "bits_per_element": p["bits_per_element"]} for p in mem["per_layer"]]}
        if args.shared_prefix:
            # the prefix's quantized units (and complete sinks) stored once instead of once per sequence; its
            # full-precision tail is copied into each sequence at its first write
            row["shared_prefix_saving_bytes"] = (args.batch - 1) * int(
                planner.memory(1, args.shared_prefix)["shareable_bytes"])
        if available is not None:
            row["max_batch_at_context"] = planner.max_batch(args.context, available)
            row["max_context_at_batch"] = planner.max_context(args.batch, available)
            row["fits"] = row["kv_bytes"] <= available
        planner.verify(row.get("max_context_at_batch", args.context))  # the final answer, by the cache code
        rows.append(row)
    fp16 = next((r["kv_bytes"] for r in rows if r["settings"] == {"quantizer": "fp16"} and r["cache"] == "fp16"), None)
    fp16 = fp16 or Planner(shape, {"quantizer": "fp16"}, torch.float16).kv_bytes(args.batch, args.context)
    for row in rows:
        row["gain_over_fp16"] = fp16 / row["kv_bytes"]
    return {"model": shape.name, "layers": shape.layers, "kv_heads": whole.kv_heads, "head_dim": shape.head_dim,
            "tensor_parallel": args.tensor_parallel, "kv_heads_per_gpu": shape.kv_heads,
            "sliding_layers": sum(isinstance(w, int) for w in shape.layout),
            "context": args.context, "batch": args.batch, "weights_bytes": weights, "gpu_memory_bytes": budget,
            "available_for_kv_bytes": available, "kv_bytes": rows[0]["kv_bytes"], "settings": rows,
            "max_positions": shape.max_positions, "notes": shape.notes, "kv_bytes_are": "stored_bytes",
            "reserved_tokens_max": Store.CHUNK_TOKENS}


#: A ``--cache`` text longer than this (a per-layer mapping, a searched map) is numbered in the table and spelled out
#: under it
LONG_CACHE_TEXT = 48


def render_plan(plan: dict) -> str:
    lines = [f"model {plan['model']}: {plan['layers']} layers ({plan['sliding_layers']} sliding-window), "
             f"{plan['kv_heads']} KV heads, head_dim {plan['head_dim']}",
             f"batch {plan['batch']} x context {plan['context']:,} tokens; B = bytes, GiB = 2^30 B, GB = 10^9 B"]
    if plan.get("context_from"):
        fitted = plan["context_from"]
        lines.append(f"context from {visible(fitted['report'])}: {visible(fitted['verdict'])}")
        if fitted.get("warning"):
            lines.append(f"WARNING: {fitted['warning']}")
    if plan["tensor_parallel"] > 1:
        ranks, heads = plan["tensor_parallel"], plan["kv_heads_per_gpu"]
        copies = ranks * heads // plan["kv_heads"]
        lines.append(f"per GPU of {ranks} (tensor parallel): {heads} KV head{'s' if heads > 1 else ''} each"
                     + (f", each head replicated on {copies} GPUs" if copies > 1 else "")
                     + "; bytes, weights and budget below are one GPU's")
    if plan["max_positions"] and plan["context"] > plan["max_positions"]:
        lines.append(f"note: the context exceeds the model's trained length ({plan['max_positions']:,})")
    lines += [f"note: {n}" for n in plan["notes"]]
    if plan["available_for_kv_bytes"] is not None:
        lines += [f"GPU memory {human(plan['gpu_memory_bytes'])}, weights {human(plan['weights_bytes'])}, "
                  f"left for the KV cache {human(plan['available_for_kv_bytes'])}"]
    lines.append("")
    header = ["cache", "KV bytes", "GiB", "bits/elem", "vs fp16"]
    if plan["available_for_kv_bytes"] is not None:
        header += ["max batch @context", "max context @batch"]
    if "shared_prefix_saving_bytes" in plan["settings"][0]:
        header += ["prefix shared saves (GiB)"]
    table, spelled = [header], []
    for r in plan["settings"]:
        name = r["cache"]
        if len(name) > LONG_CACHE_TEXT:  # a per-layer mapping: spelled out under the table, not across it
            spelled.append(f"[{len(spelled) + 1}] {name}")
            name = f"[{len(spelled)}]"
        row = [name, f"{r['kv_bytes']:,}", f"{r['kv_bytes'] / 2**30:,.2f}", f"{r['bits_per_element']:.2f}",
               f"{r['gain_over_fp16']:.2f}x"]
        if plan["available_for_kv_bytes"] is not None:
            row += [f"{r['max_batch_at_context']:,}", f"{r['max_context_at_batch']:,}"]
        if "shared_prefix_saving_bytes" in r:
            row += [f"{r['shared_prefix_saving_bytes'] / 2**30:,.2f}"]
        table.append(row)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in table]
    lines += spelled
    lines.append(f"KV bytes are stored bytes (memory_report()'s stored_bytes); a running cache also holds capacity for "
                 f"growth (reserved_bytes): at most {Store.CHUNK_TOKENS} tokens' worth per sequence and "
                 "layer once its pools are large, a quarter of what it stores while they are small")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0 done, 2 bad input (one line), 3 internal error (traceback in a log file), 130 interrupted."""
    drop_working_dir()
    parser = OneLineParser("kvquant", prog="python -m kvquant.plan", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help=f"known name ({', '.join(KNOWN_MODELS)}), a directory or "
                        "config.json, or a hub id")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--context", type=int, help="tokens per sequence")
    where.add_argument("--context-from", metavar="REPORT:CANDIDATE",
                       help="the longest context a run showed CANDIDATE safe at (results.json's length verdict, "
                       "e.g. reports/smollm2-long-gate:int4-g32), read from a report your own run signed")
    parser.add_argument("--trust-unsigned", action="store_true",
                        help="with --context-from: accept a results.json your run did not sign, once you checked it")
    parser.add_argument("--batch", type=int, default=1, help="concurrent sequences (default 1)")
    parser.add_argument("--cache", action="append", help="fp16, bf16, fp32 or a quantizer with options, e.g. "
                        "int4:group_size=32,residual_length=128, or a YAML mapping with per-layer settings, e.g. "
                        "'{quantizer: int4, layers: {0-3: {quantizer: int8}}}' (repeatable; default: fp16 fp8_e4m3 "
                        "int8 int4 int2)")
    parser.add_argument("--dtype", default="float16", choices=list(DTYPES),
                        help="dtype of the full-precision windows of quantized caches (the model's dtype)")
    parser.add_argument("--gpu-memory", help="memory budget, e.g. 80GB or 80GiB")
    parser.add_argument("--weights", help="weights size (default: parameter count x --weights-dtype)")
    parser.add_argument("--weights-dtype", default="float16", choices=[*DTYPES, "int8", "float8_e4m3fn"])
    parser.add_argument("--reserve", default="10%", help="held back for activations and the runtime: a share of "
                        "--gpu-memory (10%%) or a size (4GiB)")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                        help="a prompt prefix shared by all sequences: how much storing it once saves")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="GPUs one model is split over (vLLM's tensor parallelism): answers per GPU, its KV "
                        "heads split across them, replicated when there are fewer KV heads than GPUs")
    parser.add_argument("--json", action="store_true", help="print one JSON object (kv_bytes: the first --cache)")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args
    return run_guarded("kvquant", lambda: _print_plan(args))


def model_warning(fitted: FittedContext, model: str) -> str | None:
    """A loud line where the plan's ``--model`` is not the model the report measured (or the report does not say
    which): the context was shown safe for that model only."""
    if fitted.model is not None and fitted.model.removeprefix("local:").rstrip("/") == model.rstrip("/"):
        return None
    measured = visible(fitted.model, 200) if fitted.model else "a model the report does not name"
    return (f"the context was shown safe for {visible(fitted.label, 80)} on {measured}, not on {visible(model, 200)}: "
            "this plan is not a measured context for this model; measure it (eval.long_context) before relying on it")


def _print_plan(args) -> int:
    fitted = None
    if args.context_from is not None:
        if args.cache:
            raise KVQuantError("--context-from plans the cache setting the report showed safe at its context (the "
                               "candidate's own); leave out --cache, or plan other settings with --context N")
        fitted = fitted_context(args.context_from, args.trust_unsigned)
        args.context, args.cache = fitted.length, [fitted.setting]
    plan = build_plan(args)
    if fitted is not None:
        plan["settings"][0]["cache"] = f"{visible(fitted.label, 80)} (as measured)"
        warning = model_warning(fitted, args.model)
        plan["context_from"] = {"report": args.context_from, "verdict": fitted.summary, "model": fitted.model,
                                "warning": warning}
        if warning:
            print(f"kvquant: warning: {warning}", file=sys.stderr)
    print(json.dumps(plan, indent=2, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
          if args.json else render_plan(plan))
    return EXIT_PASS


if __name__ == "__main__":
    sys.exit(main())
