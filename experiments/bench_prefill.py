"""Prefill time and memory of long contexts through kvquant's caches against transformers' ``DynamicCache``
(issue 40: within 1.5x of DynamicCache's time at 8K, memory bounded).

    python experiments/bench_prefill.py --lengths 2048 4096 8192 --repeats 3
    python experiments/bench_prefill.py --quick --model local:models/stories260K/hf --gguf-file ""   # a smoke run

The first ``max(--lengths)`` tokens of WikiText-2 test (the first window ``experiments/long_divergence.py`` reads)
are prefilled on SmolLM2-135M-Instruct (float32, CPU) through a fresh cache of each setting, in two ways:

- ``chunked``: ``--chunk-size`` tokens per forward (512), as kvquant's long-context scoring feeds a document
  (``kvquant/scoring/longctx.py``, the Scorer's streaming mode): each chunk's attention reads what the cache
  stored for the earlier ones;
- ``single``: the whole context in one forward, as ``model.generate`` prefills a prompt.

Time: the longest length only. Every setting is prefilled once first, untimed (the check below, and a warm-up);
then ``--repeats`` rounds, each timing every setting once in turn (A B C A B C ...), so load from other jobs falls
on all of them alike. Per setting: the median time over rounds, and the ratio to DynamicCache's time in the same
round (median, min and max over rounds). Only the last position's logits are computed (``logits_to_keep=1``, as
``generate`` does), so the output layer does not hide the cache's cost (``--logits all``: every position's, as
scoring computes them).

Check (the untimed pass): the largest difference between each setting's logits and DynamicCache's at the last
position of every forward (the fp16 identity must equal them bit for bit, a quantizer must not), what share of the
keys attention read came through the quantizer (kvquant's read counter), and the bytes each cache stores.

Memory: each setting in a child process of its own (``MALLOC_MMAP_THRESHOLD_`` fixed, so that freed tensors go
back to the system at once), at every length and mode: the resident set just before the prefill (model loaded,
warmed up) and its peak during it (``VmHWM``, reset before each prefill through ``/proc/self/clear_refs``). Their
difference is what the prefill added; per doubling of the length it grows about 2x where everything held is linear
in the length, about 4x where a buffer is quadratic (a single pass's attention scores, where attention builds them).

Writes ``results.json`` and ``report.md`` (command, machine, date, load) to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import kvquant
from kvquant.cache import stored_bytes
from kvquant.cache.reads import Reads
from kvquant.errors import at_least, script_parser
from kvquant.exits import run_script
from kvquant.experiment.config import PerplexitySet
from kvquant.experiment.model_config import ModelConfig
from kvquant.runner.report import benchmark_lines, environment, write_benchmark
from kvquant.scoring.data import windows
from kvquant.scoring.models import load_model

BASELINE = "DynamicCache"
#: setting -> (quantizer, make_cache options); every token quantized (no full-precision window), as in
#: configs/smollm2-long.yaml
SETTINGS: dict[str, tuple[str, dict] | None] = {
    BASELINE: None,
    "fp16": ("fp16", {}),
    "int4-g32": ("int4", {"group_size": 32, "residual_length": 0}),
    "int8": ("int8", {"residual_length": 0}),
    "fp8_e4m3": ("fp8_e4m3", {"residual_length": 0}),
}
TEXT = "local:text/wikitext-2-raw-v1/test-00000-of-00001.parquet"
MODES = ("chunked", "single")
#: what a child process's allocator is told: every allocation of 64 KiB or more is its own mapping, unmapped when
#: freed (no dynamic threshold), so the resident set follows the tensors alive
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def new_cache(model, setting: str):
    """A fresh, empty cache of ``setting`` (a key of :data:`SETTINGS`) for ``model``."""
    if setting not in SETTINGS:
        raise SystemExit(f"bench_prefill: unknown setting {setting!r}; choose from {', '.join(SETTINGS)}")
    if SETTINGS[setting] is None:
        return DynamicCache(config=model.config)
    quantizer, options = SETTINGS[setting]
    return kvquant.make_cache(model, quantizer, **options)


def context(tokenizer, length: int) -> torch.Tensor:
    """``[1, length]``: the first ``length`` tokens of WikiText-2 test, joined as long_divergence joins them."""
    spec = PerplexitySet(name="wikitext2", source=TEXT, layout="stream", limit=1, max_length=length)
    ids = windows(spec, tokenizer)[0].ids
    if len(ids) < length:
        raise SystemExit(f"bench_prefill: the text gives {len(ids)} tokens, fewer than {length}")
    return torch.tensor([ids])


def prefill(model, cache, ids: torch.Tensor, chunk: int | None, logits: str = "last") -> torch.Tensor:
    """Feed ``ids`` ``[1, L]`` through ``cache``, ``chunk`` tokens per forward (None: one forward); returns the
    logits at the last position of every forward, ``[forwards, vocab]``."""
    size = chunk or ids.shape[1]
    last = []
    with torch.inference_mode():
        for start in range(0, ids.shape[1], size):
            out = model(ids[:, start : start + size], cache=cache, use_cache=True,
                        logits_to_keep=1 if logits == "last" else 0)
            last.append(out.logits[0, -1])
    return torch.stack(last)


def check(model, ids: torch.Tensor, settings: list[str], chunk: int | None, logits: str) -> dict[str, dict]:
    """One untimed prefill per setting: its logits against DynamicCache's, what attention read quantized, stored
    bytes (:func:`kvquant.cache.stored_bytes`)."""
    reference, out = None, {}
    for setting in [BASELINE, *[s for s in settings if s != BASELINE]]:
        cache = new_cache(model, setting)
        counter = None
        if setting != BASELINE:
            counter = cache.reads = Reads()
        got = prefill(model, cache, ids, chunk, logits)
        reference = got if reference is None else reference
        row = {"max_abs_logit_diff": float((got - reference).abs().max()),
               "bit_exact": bool(torch.equal(got, reference)), "stored_bytes": stored_bytes(cache),
               "keys_read_quantized_share": counter.share("keys") if counter else 0.0,
               "values_read_quantized_share": counter.share("values") if counter else 0.0}
        out[setting] = row
        del cache
        gc.collect()
    return {s: out[s] for s in settings}


def timed_updates(cache) -> list[float]:
    """Time this cache's ``update`` (the instance's own, which attention calls once a layer and forward: storing,
    quantizing and reading back what attention reads); returns the one-element list the seconds are added to."""
    spent, inner = [0.0], cache.update

    def update(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    cache.update = update
    return spent


def time_rounds(model, ids: torch.Tensor, settings: list[str], chunk: int | None, repeats: int,
                logits: str) -> dict[str, dict[str, list[float]]]:
    """Per setting, per round: ``wall`` seconds of its prefill, ``cpu`` seconds (the process's, all threads: less
    moved by other jobs than the wall clock) and ``update`` seconds inside the cache's update (wall); the settings in
    turn within each round."""
    times = {s: {"wall": [], "cpu": [], "update": []} for s in settings}
    for _ in range(repeats):
        for setting in settings:
            cache = new_cache(model, setting)
            spent = timed_updates(cache)
            gc.collect()
            wall, cpu = time.perf_counter(), time.process_time()
            prefill(model, cache, ids, chunk, logits)
            times[setting]["cpu"].append(time.process_time() - cpu)
            times[setting]["wall"].append(time.perf_counter() - wall)
            times[setting]["update"].append(spent[0])
            del cache
    return times


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratios(times: dict[str, dict[str, list[float]]]) -> dict[str, dict]:
    """Per setting: its seconds per round and their median, min and max (``wall``, ``cpu``, ``update``), its ratio to
    DynamicCache's in the same round (``wall_ratio``, ``cpu_ratio``: median, min and max over rounds) and the share
    of its wall time spent in the cache's update (``update_share``)."""
    base = times[BASELINE]
    out = {}
    for setting, t in times.items():
        row = {"seconds": t}
        for kind in ("wall", "cpu", "update"):
            row[kind] = _spread(t[kind])
        for kind in ("wall", "cpu"):
            row[f"{kind}_ratio"] = _spread([a / b for a, b in zip(t[kind], base[kind])])
        row["update_share"] = _spread([u / w for u, w in zip(t["update"], t["wall"])])
        out[setting] = row
    return out


# -- memory (child processes) ---------------------------------------------------------------------------------
def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def peak_growth(model, setting: str, ids: torch.Tensor, chunk: int | None, logits: str) -> dict[str, int]:
    """Resident bytes before a prefill of ``ids`` through a fresh cache, and how far above them it peaked."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    cache = new_cache(model, setting)
    prefill(model, cache, ids, chunk, logits)
    peak, held = _status("VmHWM"), _status("VmRSS")
    stored = stored_bytes(cache)
    del cache
    gc.collect()
    return {"baseline_bytes": before, "peak_growth_bytes": peak - before, "held_after_bytes": held - before,
            "stored_bytes": stored}


def memory_child(args) -> None:
    """The ``--memory-child SETTING`` process: one JSON line of :func:`peak_growth` per mode and length."""
    model, tokenizer = load(args)
    ids = context(tokenizer, max(args.lengths))
    prefill(model, new_cache(model, args.memory_child), ids[:, : min(args.lengths)], args.chunk_size, args.logits)
    rows = []
    for mode in args.modes:
        for length in sorted(args.lengths):
            chunk = args.chunk_size if mode == "chunked" else None
            row = peak_growth(model, args.memory_child, ids[:, :length], chunk, args.logits)
            rows.append({"setting": args.memory_child, "mode": mode, "length": length, **row})
    print("MEMORY " + json.dumps(rows), flush=True)


def measure_memory(args, settings: list[str]) -> list[dict]:
    """:func:`memory_child` of each setting, each in a process of its own."""
    rows = []
    for setting in settings:
        command = [sys.executable, str(Path(__file__).resolve()), "--memory-child", setting, "--model", args.model,
                   "--gguf-file", args.gguf_file or "", "--threads", str(args.threads), "--chunk-size",
                   str(args.chunk_size), "--logits", args.logits, "--lengths", *map(str, args.lengths),
                   "--modes", *args.modes]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **MALLOC_ENV})
        line = next((x for x in done.stdout.splitlines() if x.startswith("MEMORY ")), None)
        if done.returncode or line is None:
            raise SystemExit(f"bench_prefill: the memory child for {setting} failed:\n{done.stderr[-3000:]}")
        rows += json.loads(line[len("MEMORY "):])
        print(f"memory: {setting} done", flush=True)
    return rows


def doubling(memory: list[dict]) -> list[dict]:
    """Per setting and mode: peak growth at each length over that at the length before (x2 per doubling expected
    where everything is linear in the length)."""
    out = []
    keyed = {(r["setting"], r["mode"], r["length"]): r for r in memory}
    for (setting, mode, length), row in keyed.items():
        half = keyed.get((setting, mode, length // 2))
        if half and half["peak_growth_bytes"] > 0:
            out.append({"setting": setting, "mode": mode, "length": length,
                        "factor": row["peak_growth_bytes"] / half["peak_growth_bytes"]})
    return out


# -- report -----------------------------------------------------------------------------------------------------
def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _range(x: dict, unit: str = "", digits: int = 3) -> str:
    return f"{x['median']:.{digits}f}{unit} ({x['min']:.{digits}f}-{x['max']:.{digits}f})"


def per_setting_table(doc: dict, part: str, header: str, rule: str, cells) -> list[str]:
    """One row per mode and setting of ``doc["time"][mode][part]``: ``| mode | setting | cells(entry) |``, under
    ``header`` and the alignment ``rule`` of its columns."""
    lines = [f"| mode | setting | {header} |", f"|---|---|{rule}"]
    for mode, measured in doc["time"].items():
        for setting, entry in measured[part].items():
            lines.append(f"| {mode} | {setting} | " + " | ".join(cells(entry)) + " |")
    return lines


def time_table(doc: dict) -> list[str]:
    return per_setting_table(
        doc, "timing", "wall s | **/ DynamicCache, wall** | / DynamicCache, CPU | in the cache's update", "---:|" * 4,
        lambda t: [_range(t["wall"], digits=2), f"**{_range(t['wall_ratio'], 'x')}**", _range(t["cpu_ratio"], "x"),
                   f"{t['update_share']['median']:.1%}"])


def check_table(doc: dict) -> list[str]:
    return per_setting_table(
        doc, "check", "max abs logit diff | bit exact | keys / values read quantized | stored MB",
        "---:|---|---:|---:|",
        lambda c: [f"{c['max_abs_logit_diff']:.3g}", "yes" if c["bit_exact"] else "no",
                   f"{c['keys_read_quantized_share']:.3f} / {c['values_read_quantized_share']:.3f}",
                   _mb(c["stored_bytes"])])


def memory_table(doc: dict) -> list[str]:
    lengths = sorted({r["length"] for r in doc["memory"]})
    factors = {(f["setting"], f["mode"], f["length"]): f["factor"] for f in doc["doubling"]}
    peaks = {(r["setting"], r["mode"], r["length"]): r for r in doc["memory"]}
    lines = ["| mode | setting | " + " | ".join(f"peak growth MB at {n}" for n in lengths) + " | "
             + " | ".join(f"x {n // 2}->{n}" for n in lengths[1:]) + f" | stored MB at {lengths[-1]} |",
             "|---|---|" + "---:|" * (2 * len(lengths))]
    for mode in dict.fromkeys(r["mode"] for r in doc["memory"]):
        for setting in dict.fromkeys(r["setting"] for r in doc["memory"]):
            if (setting, mode, lengths[0]) not in peaks:
                continue
            cells = [_mb(peaks[setting, mode, n]["peak_growth_bytes"]) for n in lengths]
            cells += [f"{factors[setting, mode, n]:.2f}" if (setting, mode, n) in factors else "-" for n in lengths[1:]]
            lines.append(f"| {mode} | {setting} | " + " | ".join(cells) + " | "
                         f"{_mb(peaks[setting, mode, lengths[-1]]['stored_bytes'])} |")
    return lines


def render(doc: dict) -> str:
    a = doc["args"]
    *head, model = benchmark_lines(doc, "Prefill through the cache: time and memory against DynamicCache")
    lines = [*head, f"{model}; {doc['length']} tokens of WikiText-2 test; "
             f"chunked = {a['chunk_size']} tokens per forward, single = one forward; logits kept: {a['logits']}; "
             f"{a['repeats']} timed rounds after one untimed pass per setting", "",
             f"## Time at {doc['length']} tokens", "",
             "Median over rounds (min-max); a ratio is to DynamicCache's time in the same round. CPU: the process's "
             "CPU seconds (other jobs move them less than the wall clock). Update: share of the wall time spent in "
             "the cache's update (storing, quantizing, reading back).", "", *time_table(doc), "",
             "Check (the untimed pass): logits at the last position of every forward against DynamicCache's; what "
             "share of the keys and values attention read came through the quantizer; bytes the cache stores.", "",
             *check_table(doc), ""]
    if doc["memory"]:
        lines += ["## Memory: peak resident growth during the prefill", "",
                  "Peak resident set during the prefill over the resident set just before it, each setting in a "
                  "process of its own; `x a->b`: the growth at b over that at a (about 2 where everything held "
                  "grows linearly with the length, about 4 for a quadratic buffer).", "", *memory_table(doc), ""]
    if doc.get("notes"):
        lines += ["Hand-written notes on a run (the date they name): [NOTES.md](NOTES.md).", ""]
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------------------------
def load(args):
    torch.set_num_threads(args.threads)
    spec = ModelConfig(path=args.model, gguf_file=args.gguf_file or None, dtype="float32", device="cpu")
    return load_model(spec)


def parse(argv=None):
    parser = script_parser("bench_prefill", __doc__)
    parser.add_argument("--model", default="local:models/smollm2-135m-instruct")
    parser.add_argument("--gguf-file", default="SmolLM2-135M-Instruct.Q4_1.gguf", help="'' for none")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--memory-settings", nargs="*", default=None, choices=list(SETTINGS),
                        help="settings whose memory is measured (default: --settings; none: no memory)")
    parser.add_argument("--lengths", nargs="+", type=at_least(1), default=[2048, 4096, 8192],
                        help="memory at each; time at the longest")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--chunk-size", type=at_least(1), default=512)
    parser.add_argument("--repeats", type=at_least(1), default=3)
    parser.add_argument("--logits", choices=("last", "all"), default="last")
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch threads (1: the cores are shared)")
    parser.add_argument("--quick", action="store_true", help="lengths 64 128 256, chunk 32, 2 rounds (a smoke test)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench_prefill"))
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.chunk_size, args.repeats = [64, 128, 256], 32, 2
    if BASELINE not in args.settings:
        args.settings = [BASELINE, *args.settings]
    if args.memory_settings is None:
        args.memory_settings = list(args.settings)
    return args


@torch.no_grad()  # for this call only: a caller (a test) keeps its autograd
def main(argv=None) -> dict | None:
    args = parse(argv)
    if args.memory_child:
        memory_child(args)
        return None
    load_start = os.getloadavg()[0]
    model, tokenizer = load(args)
    length = max(args.lengths)
    ids = context(tokenizer, length)
    doc = {"command": "python " + " ".join(sys.argv if argv is None else ["experiments/bench_prefill.py", *argv]),
           "environment": environment(), "args": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in vars(args).items()},
           "length": length, "time": {}}
    for mode in args.modes:
        chunk = args.chunk_size if mode == "chunked" else None
        checked = check(model, ids, args.settings, chunk, args.logits)
        timing = ratios(time_rounds(model, ids, args.settings, chunk, args.repeats, args.logits))
        doc["time"][mode] = {"check": checked, "timing": timing}
        print(f"{mode}: " + ", ".join(f"{s} {t['wall_ratio']['median']:.3f}x" for s, t in timing.items()), flush=True)
    del model
    doc["memory"] = measure_memory(args, args.memory_settings) if args.memory_settings else []
    doc["doubling"] = doubling(doc["memory"])
    doc["load"] = [load_start, os.getloadavg()[0]]
    write_benchmark(args.out, doc, render)
    return doc


if __name__ == "__main__":
    sys.exit(run_script("bench_prefill", main))
