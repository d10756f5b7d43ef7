"""experiments/gpu_check.py's decode speed (check 5) and issue 57's decode targets: single-token decode steps per
second over caches filled to 4K/16K/32K tokens at batch 1 and 16, kvquant's caches (eager, and through
``enable_fused_decode``: the Triton kernel reading the codes) against kvquant's own fp16 cache and transformers'
``DynamicCache`` with SDPA, all in bfloat16 in the same run on the same card. The ratio table and the verdicts are
pure functions of the rows (tests/test_gpu_check_targets.py)."""

from __future__ import annotations

import contextlib
import time
import traceback
from dataclasses import dataclass

import torch
from gpu_memory import always, failed, held_bytes, random_chunk, write_chunks
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

import kvquant
from kvquant.cache import stored_bytes

#: the contexts and batches measured (issue 57's table: 4K/16K/32K x 1/16), and the point the targets are judged at
SPEED_CONTEXTS, SPEED_BATCHES, TARGET_POINT = (4096, 16384, 32768), (1, 16), (16384, 16)
#: SDPA's backends but cuDNN's: SDPA sends DynamicCache's decode to cuDNN, which spent 9.6 ms of CPU per call on an
#: H200 (reports/gpu_check/NOTES.md, 2026-11-30); the targets hold kvquant against the faster of the two
NO_CUDNN = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
#: the caches the targets read (``--speed-caches targets``, the default); ``all`` adds every other quantizer
TARGET_CACHES = ("DynamicCache", "DynamicCache-no-cudnn", "kvquant-fp16", "kvquant-fp16-fused", "kvquant-int4",
                 "kvquant-int4-fused", "kvquant-fp8_e4m3", "kvquant-fp8_e4m3-fused")


@dataclass(frozen=True)
class Target:
    """Issue 57's decode target: the fastest of ``candidates`` at least ``least`` times the fastest of
    ``baselines`` (tokens per second at one point, same run and card)."""
    label: str
    candidates: tuple[str, ...]
    baselines: tuple[str, ...]
    least: float


FP16 = ("kvquant-fp16", "kvquant-fp16-fused")
DYNAMIC = ("DynamicCache", "DynamicCache-no-cudnn")
TARGETS = (Target("int4 g32 / kvquant fp16", ("kvquant-int4", "kvquant-int4-fused"), FP16, 1.3),
           Target("int4 g32 / DynamicCache", ("kvquant-int4", "kvquant-int4-fused"), DYNAMIC, 1.0),
           Target("fp8 e4m3 / kvquant fp16", ("kvquant-fp8_e4m3", "kvquant-fp8_e4m3-fused"), FP16, 1.1))


def speed_factories(model, fused, config, quantizers: dict, fused_names, names=None) -> dict:
    """cache name -> (model that decodes, cache maker, SDPA backends or None): ``DynamicCache`` (SDPA's default
    choice, and without cuDNN), each of ``quantizers`` (name -> (quantizer, options)) read through ``model``, and
    those in ``fused_names`` through ``fused`` (``enable_fused_decode``); only ``names`` where given."""
    found = {"DynamicCache": (model, lambda: DynamicCache(config=config), None),
             "DynamicCache-no-cudnn": (model, lambda: DynamicCache(config=config), NO_CUDNN)}
    found.update({f"kvquant-{n}": (model, lambda q=q, o=o: kvquant.make_cache(model, q, **o), None)
                  for n, (q, o) in quantizers.items()})
    found.update({f"kvquant-{n}-fused": (fused, lambda q=q, o=o: kvquant.make_cache(fused, q, **o), None)
                  for n, (q, o) in quantizers.items() if n in fused_names})
    return {k: v for k, v in found.items() if names is None or k in names}


def speed_points(contexts=SPEED_CONTEXTS, batches=SPEED_BATCHES) -> list[tuple[int, int]]:
    """Every (context, batch), ascending, but :data:`TARGET_POINT` first where it is one of them: a run stopped at
    its time limit has measured it."""
    points = sorted({(c, b) for c in contexts for b in batches})
    return sorted(points, key=lambda p: p != TARGET_POINT)


@torch.inference_mode()
def check_speed(factories: dict, config, points, steps=32, device="cuda", allocated=None, in_time=always) -> dict:
    """Per (context, batch) point and cache: a cache filled to ``context`` tokens of random bfloat16 K/V through
    ``cache.update`` in chunks of 2,048 (the chunked prefill's writes, without its cost), the allocator's growth and
    the cache's bytes, then 4 warm-up and ``steps`` timed single-token decode steps of the model. Before each point,
    ``in_time()``: when it says no, the check stops there and says so (``stopped``)."""
    cuda = str(device).startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    allocated = allocated or torch.cuda.memory_allocated
    rows = []
    for context, batch in points:
        if not in_time():
            return {"rows": add_ratios(rows), "stopped": f"time limit, before {context} x {batch}"}
        chunk = random_chunk(config, batch, device, seed=3)
        token = torch.randint(0, config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(3))
        for name, (runner, make, backends) in factories.items():
            row, cache = {"cache": name, "context": context, "batch": batch}, None
            try:
                sync()
                if cuda:
                    torch.cuda.empty_cache()
                before = allocated()
                cache = make()
                write_chunks(cache, chunk, config.num_hidden_layers, 0, context)
                sync()
                row.update(allocated_bytes=allocated() - before, reported_bytes=stored_bytes(cache),
                           held_bytes=held_bytes(cache))
                if hasattr(cache, "memory_report"):
                    row["tensor_bytes"] = cache.memory_report()["tensor_bytes"]
                with sdpa_kernel(list(backends)) if backends else contextlib.nullcontext():
                    row["steps_per_s"] = decode_rate(runner, cache, token.to(device), steps, sync)
                row["tokens_per_s"] = batch * row["steps_per_s"]
            except Exception:  # noqa: BLE001 (recorded, the run goes on)
                row["error"] = traceback.format_exc(limit=4)
            cache = None  # also when it failed: not counted in the next row's "before"
            rows.append(row)
    return {"rows": add_ratios(rows)}


def decode_rate(model, cache, token: torch.Tensor, steps: int, sync) -> float:
    """Single-token decode steps per second of ``model`` over ``cache`` (``token``: ``[B, 1]``), after 4 warm-up
    steps."""
    for _ in range(4):
        model(token, cache=cache, use_cache=True)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        model(token, cache=cache, use_cache=True)
    sync()
    return steps / (time.perf_counter() - start)


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each measured row's speed and allocator bytes against ``DynamicCache``'s and its speed against
    ``kvquant-fp16``'s at the same (context, batch)."""
    def at(name):
        return {(r["context"], r["batch"]): r for r in rows if r["cache"] == name and "error" not in r}

    base, same = at("DynamicCache"), at("kvquant-fp16")
    for r in rows:
        b, f = base.get((r["context"], r["batch"])), same.get((r["context"], r["batch"]))
        if b and "error" not in r:
            r["speed_vs_dynamic"] = r["steps_per_s"] / b["steps_per_s"]
            if b["allocated_bytes"] > 0:  # a fake allocator's zero (the CPU) gives no ratio
                r["allocated_vs_dynamic"] = r["allocated_bytes"] / b["allocated_bytes"]
        if f and "error" not in r:
            r["speed_vs_kvquant_fp16"] = r["steps_per_s"] / f["steps_per_s"]
    return rows


def fastest(rows: list[dict], names, point) -> tuple[float, str] | None:
    """(steps per second, cache) of the fastest of ``names`` measured at ``point`` (context, batch); None if none."""
    found = [(r["steps_per_s"], r["cache"]) for r in rows
             if r["cache"] in names and (r["context"], r["batch"]) == tuple(point) and "steps_per_s" in r]
    return max(found) if found else None


def target_ratio(rows: list[dict], target: Target, point) -> dict | None:
    """The target's ratio at ``point``: the fastest candidate's speed over the fastest baseline's, with both
    names and tokens per second; None where either side has no measured row there."""
    cand, base = fastest(rows, target.candidates, point), fastest(rows, target.baselines, point)
    if cand is None or base is None:
        return None
    return {"ratio": cand[0] / base[0], "candidate": cand[1], "baseline": base[1],
            "candidate_tokens_per_s": cand[0] * point[1], "baseline_tokens_per_s": base[0] * point[1]}


def ratio_table(rows: list[dict], targets=TARGETS) -> list[dict]:
    """Per measured (context, batch), ascending: each target's ratio (:func:`target_ratio`, None if unmeasured)."""
    points = sorted({(r["context"], r["batch"]) for r in rows})
    return [{"context": c, "batch": b, "ratios": {t.label: target_ratio(rows, t, (c, b)) for t in targets}}
            for c, b in points]


def target_verdicts(rows: list[dict], targets=TARGETS, point=TARGET_POINT) -> list[str]:
    """Issue 57's targets at ``point``: MET / NOT MET with the measured ratio, or NOT MEASURED."""
    lines = []
    for t in targets:
        where = f"target {t.label} >= {t.least}x at {point[0]} tokens x batch {point[1]}"
        r = target_ratio(rows, t, point)
        if r is None:
            lines.append(f"NOT MEASURED {where}: no measured row of {' or '.join(t.candidates)} and of "
                         f"{' or '.join(t.baselines)} there")
            continue
        lines.append(f"{'MET' if r['ratio'] >= t.least else 'NOT MET'} {where}: {r['ratio']:.2f}x ({r['candidate']} "
                     f"{r['candidate_tokens_per_s']:,.1f} tokens/s, {r['baseline']} {r['baseline_tokens_per_s']:,.1f}"
                     f"; each side the faster of {', '.join(t.candidates)} and of {', '.join(t.baselines)})")
    return lines


def speed_memory_verdicts(rows: list[dict]) -> list[str]:
    """The allocator's growth for each kvquant cache filled in the speed check against its own tensors (within 5%),
    and ``memory_report()``'s tensor bytes equal to those tensors."""
    lines = []
    for r in rows:
        if failed(lines, f"speed {r['cache']} at {r['context']} x {r.get('batch')}", r) or not r["cache"].startswith(
                "kvquant-"):
            continue
        where = f"memory {r['cache']} at {r['context']} tokens x {r.get('batch')}"
        held = r.get("held_bytes")
        if held is None:  # results of runs before held_bytes was recorded
            excess = r["allocated_bytes"] / r["reported_bytes"] - 1
            lines.append(f"{'PASS' if abs(excess) <= 0.05 else 'FAIL'} {where}: the allocator holds {excess:+.2%} "
                         "of memory_report() (at most 5% either way)")
            continue
        off = r["allocated_bytes"] / held - 1
        lines.append(f"{'PASS' if abs(off) <= 0.05 else 'FAIL'} {where}: the allocator holds {off:+.2%} of the "
                     f"cache's own tensors (at most 5% either way); those are {held / r['reported_bytes'] - 1:+.2%} "
                     "over memory_report()'s stored bytes (pool slots reserved for later writes)")
        if "tensor_bytes" in r:  # runs since memory_report() reports reserved bytes too
            lines.append(f"{'PASS' if r['tensor_bytes'] == held else 'FAIL'} {where}: memory_report()'s "
                         f"tensor_bytes (stored + reserved) {r['tensor_bytes']:,}, the cache's own tensors {held:,}")
    return lines


def speed_markdown(rows: list[dict], steps: int, layers: int) -> list[str]:
    """report.md's decode sections: the targets' ratio table, then every row."""
    def cell(r):
        return "" if r is None else f"{r['ratio']:.2f}x ({r['candidate'].removeprefix('kvquant-')})"

    lines = ["", f"## Decode targets (issue 57; Llama-3-8B attention shape, {layers} layers, bfloat16, {steps} "
             "steps)", "", "Each ratio: the faster of the candidate's eager and fused rows over the faster of the "
             "baseline's rows, same run, same card.", "",
             "| context | batch | " + " | ".join(f"{t.label} (>= {t.least}x)" for t in TARGETS) + " |",
             "|---:|---:|" + "---:|" * len(TARGETS)]
    lines += [f"| {p['context']} | {p['batch']} | " + " | ".join(cell(p["ratios"][t.label]) for t in TARGETS) + " |"
              for p in ratio_table(rows)]
    lines += ["", "## Memory and decode speed, every row", "",
              "| context | batch | cache | allocator bytes | memory_report stored bytes | vs DynamicCache (allocator) "
              "| tokens/s | speed vs DynamicCache | speed vs kvquant fp16 |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        head = f"| {r['context']} | {r.get('batch', '')} | {r['cache']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'].strip().splitlines()[-1]} | | | | | |")
            continue
        tokens = r.get("tokens_per_s", r["steps_per_s"] * r.get("batch", 1))
        lines.append(f"{head} {r['allocated_bytes']:,} | {r['reported_bytes']:,} | "
                     f"{r.get('allocated_vs_dynamic', float('nan')):.3f} | {tokens:,.1f} | "
                     f"{r.get('speed_vs_dynamic', float('nan')):.3f} | "
                     f"{r.get('speed_vs_kvquant_fp16', float('nan')):.3f} |")
    return lines
