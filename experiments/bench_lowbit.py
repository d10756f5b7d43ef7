"""What the low-bit quantizers of issue 56 cost on the CPU against int4 g32, as ratios measured in one run.

    python experiments/bench_lowbit.py [--config configs/smollm2-lowbit.yaml] [--repeats 5] [--out reports/bench_lowbit]

Each candidate of ``--config`` (its quantizer and options, as the run builds its cache) on one layer of the
config's shape (default SmolLM2-135M's: 3 KV heads of head_dim 64, float32 states), random Gaussian states:

- ``encode`` / ``decode``: the layer's key and value codecs alone, on ``--batch`` rows of ``--tokens`` tokens
  (``encode``: the states to what is stored; ``decode``: what is stored back to states);
- ``prefill``: a cache filled as the streaming evaluation fills it, ``--tokens`` tokens in chunks of ``--chunk``,
  each chunk stored and the whole history read back (what one layer costs one window, less the model);
- ``decode_step``: then one more token per row, stored and the history read back (a decode step's cache work,
  without fused decode).

A candidate with ``pre_rope: true`` gets its cache from a one-layer model of the shape (random weights: its RoPE is
what counts), so RoPE is taken off each chunk's keys and put back on every read; every update carries its tokens'
positions, as transformers' attention passes them.

A calibrated candidate (``calibrate:``) is timed with stand-ins of what calibration gives it, since the cost is its
codec's, not the fit's (the fit runs once, offline): ``key_offset`` a fixed per-channel offset (Gaussian, seed 0),
``fisher_kmeans`` evenly spaced levels in [-1, 1] per stream.

Times are CPU seconds of this process (``time.process_time``: the load of a shared machine slows the wall clock far
more than it changes the CPU time) and wall seconds, each the best of ``--repeats``, the candidates taken in turn
within each repeat so that load falls on all alike; ``x int4`` is the ratio to the int4 g32 candidate's CPU time
(``--anchor``) in this run. Writes ``report.md`` and ``results.csv`` to ``--out``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig

import kvquant
from kvquant.errors import KVQuantError, at_least, script_parser
from kvquant.exits import run_script
from kvquant.fs import output_dir, write_together
from kvquant.runner.report import environment

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             vocab_size=49152, num_hidden_layers=1)
PARTS = ("encode", "decode", "prefill", "decode_step")


def timed(fn) -> tuple[float, float]:
    """``(CPU seconds, wall seconds)`` of ``fn()``."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def calibrated_stand_in(candidate: dict, head_dim: int) -> dict:
    """``candidate`` with what its ``calibrate:`` would give it replaced by fixed values of the same shape (module
    docstring); a candidate without ``calibrate`` as it is."""
    kind, options = candidate.get("calibrate"), dict(candidate.get("options") or {})
    if kind == "key_offset":
        options["key_offset"] = torch.randn(head_dim, generator=torch.Generator().manual_seed(0)).tolist()
    elif kind == "fisher_kmeans":
        for stream in ("key", "value"):
            bits = options.get(f"{stream}_bits", 4)
            options[f"{stream}_levels"] = torch.linspace(-1, 1, 2**bits).tolist()
    elif kind is not None:
        raise KVQuantError(f"{candidate.get('name')}: no stand-in for calibrate: {kind} (bench_lowbit times "
                           "key_offset and fisher_kmeans)")
    return {**candidate, "options": options}


def timed_candidates(spec: dict) -> dict[str, dict]:
    """The candidates of a config ``spec`` by name, as timed: calibrated ones with their stand-ins."""
    return {c.get("name", c["quantizer"]): calibrated_stand_in(c, SHAPE["head_dim"]) for c in spec["candidates"]}


def parts(model, candidate: dict, states: torch.Tensor, chunk: int) -> dict[str, tuple[float, float]]:
    """The four timings of one candidate (module docstring) on ``states`` ``[2, B, H, T, D]`` (keys, values), its
    cache made for ``model`` (one layer of the shape) where it stores keys before RoPE, else for its config."""
    quantizer, options = candidate["quantizer"], dict(candidate.get("options") or {})
    cache_options = {k: options.pop(k) for k in ("residual_length", "sink_tokens", "pre_rope") if k in options}
    codecs = kvquant.get_quantizer(quantizer, **options).codecs(model.config.head_dim)
    encoded = [codec.encode(x) for codec, x in zip(codecs, states)]
    out = torch.empty_like(states[0])
    cache = kvquant.make_cache(model if cache_options.get("pre_rope") else model.config, quantizer, **options,
                               **cache_options)
    length = states.shape[3]
    positions = torch.arange(length + 1)[None]

    def prefill():
        for start in range(0, length, chunk):
            cache.update(states[0, :, :, start : start + chunk], states[1, :, :, start : start + chunk], 0,
                         kwargs={"position_ids": positions[:, start : start + chunk]})

    return {"encode": timed(lambda: [codec.encode(x) for codec, x in zip(codecs, states)]),
            "decode": timed(lambda: [codec.decode_into(enc, out) for codec, enc in zip(codecs, encoded)]),
            "prefill": timed(prefill),
            "decode_step": timed(lambda: cache.update(states[0, :, :, :1], states[1, :, :, :1], 0,
                                                      kwargs={"position_ids": positions[:, length:]}))}


@torch.inference_mode()
def measure(args) -> pd.DataFrame:
    spec = yaml.safe_load(args.config.read_text())
    candidates = timed_candidates(spec)
    if args.anchor not in candidates:
        raise KVQuantError(f"--anchor {args.anchor!r} is not a candidate of {args.config}: {', '.join(candidates)}")
    config = LlamaConfig(**SHAPE, max_position_embeddings=args.tokens + 16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(2, args.batch, config.num_key_value_heads, args.tokens, config.head_dim, generator=gen)
    best: dict[tuple[str, str], tuple[float, float]] = {}
    for repeat in range(args.repeats + 1):  # the first is a warm-up, not counted
        for name, candidate in candidates.items():
            for part, (cpu, wall) in parts(model, candidate, states, args.chunk).items():
                if repeat:
                    old = best.get((name, part), (float("inf"),) * 2)
                    best[name, part] = (min(old[0], cpu), min(old[1], wall))
    rows = [{"candidate": name, "part": part, "cpu_ms": 1000 * cpu, "wall_ms": 1000 * wall}
            for (name, part), (cpu, wall) in best.items()]
    df = pd.DataFrame(rows)
    anchor = {part: cpu for name, part, cpu in zip(df.candidate, df.part, df.cpu_ms) if name == args.anchor}
    df["x_int4"] = [cpu / anchor[part] for part, cpu in zip(df.part, df.cpu_ms)]
    return df


def render(df: pd.DataFrame, args, load: tuple[float, float]) -> str:
    env = environment()
    table = df.pivot(index="candidate", columns="part", values="x_int4").reindex(df.candidate.unique())[list(PARTS)]
    cpu = df.pivot(index="candidate", columns="part", values="cpu_ms").reindex(df.candidate.unique())[list(PARTS)]
    lines = ["| candidate | " + " | ".join(f"{p} ms (x {args.anchor})" for p in PARTS) + " |",
             "|---|" + "---|" * len(PARTS)]
    lines += [f"| {name} | " + " | ".join(f"{cpu.loc[name, p]:.1f} ({table.loc[name, p]:.2f})" for p in PARTS)
              + " |" for name in table.index]
    return "\n".join([
        "# The low-bit quantizers' CPU cost against int4 g32 (issue 56)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {env['date']}; git {env['git_commit']}; kvquant from {Path(kvquant.__file__).parent}",
        f"- machine: {env['machine']}, shared; load average {load[0]:.2f} before, {load[1]:.2f} after (1 minute); "
        f"{torch.get_num_threads()} torch threads; torch {env['torch']}",
        f"- shape: one layer, {args.batch} rows x {SHAPE['num_key_value_heads']} KV heads x {args.tokens} tokens x "
        f"head_dim {SHAPE['head_dim']}, float32; prefill in chunks of {args.chunk}; candidates of {args.config}",
        f"- timing: CPU milliseconds of the process, best of {args.repeats} after a warm-up, candidates in turn; "
        f"in brackets the ratio to {args.anchor}'s in this run; calibrated candidates with stand-ins of their "
        "calibration (a fixed key offset, evenly spaced levels: the codec's cost, not the fit's)",
        "",
        *lines,
        "",
        "Wall times beside the CPU times: results.csv.",
        "",
    ])


def main(argv=None):
    parser = script_parser("bench_lowbit", __doc__)
    parser.add_argument("--config", type=Path, default=Path("configs/smollm2-lowbit.yaml"))
    parser.add_argument("--anchor", default="int4-g32", help="the candidate the ratios divide by")
    parser.add_argument("--batch", type=at_least(1), default=16)
    parser.add_argument("--tokens", type=at_least(1), default=1024)
    parser.add_argument("--chunk", type=at_least(1), default=64)
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--threads", type=at_least(1), default=1,
                        help="torch threads (1: a thread waiting on a descheduled one spins, which counts as CPU)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench_lowbit"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    before = os.getloadavg()[0]
    df = measure(args)
    report = render(df, args, (before, os.getloadavg()[0]))
    write_together(output_dir(args.out, "--out"), {"results.csv": df.to_csv(index=False, float_format="%.4f"),
                                                   "report.md": report})
    print(report)


if __name__ == "__main__":
    sys.exit(run_script("bench_lowbit", main))
