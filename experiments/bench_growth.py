"""What the pool's growth policy costs and reserves (issue 57), on the CPU, in one run.

    OMP_NUM_THREADS=1 python experiments/bench_growth.py [--contexts 4096 16384 32768] [--steps 1024]

One layer's keys and values (Llama-3-8B's attention shape: 8 KV heads of 128, bfloat16) are prefilled in chunks of
2,048 tokens to each context, then written one token per row per step, ``--steps`` times, through ``Store.append``
alone (no read: the growth's copies are all that differs, so this is its worst case; ``--read``: each step also
reads the rows back, as a decode step without fused decode does). Two policies, alternated per
repeat in the same process: ``1.25x`` (the pool grows by a quarter whatever its size: kvquant before issue 57,
``Store.CHUNK_TOKENS`` unbounded) and ``chunked`` (a quarter while small, at most ``Store.CHUNK_TOKENS`` tokens per
row once large: the default). Prints, per quantizer and context, the reserved share of the stores' tensors after
the prefill and after the steps (``memory``: reserved / stored bytes) and the steps' time, best of ``--repeats``,
with the ratio chunked / 1.25x.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import kvquant
from kvquant.errors import KVQuantError, at_least, script_parser
from kvquant.exits import run_script
from kvquant.cache import Store

HEADS, HEAD_DIM, CHUNK = 8, 128, 2048
#: the most one row's token can take while measured: keys and values in bfloat16, twice (the pool's reserve and the
#: rows read back with ``--read``)
BYTES_PER_TOKEN = 2 * 2 * HEADS * HEAD_DIM * 2
UNBOUNDED = 1 << 62


def reserved_share(stores) -> float:
    stored = sum(sum(s.slot_bytes().values()) * int((s.holders() > 0).sum()) + s.full_precision_bytes()
                 for s in stores)
    return sum(s.reserved_bytes() for s in stores) / stored


def run(quantizer: str, context: int, steps: int, rows: int, chunk_tokens: int,
        read: bool = False) -> tuple[float, float, float]:
    """``(reserved share after the prefill, after the steps, seconds of the steps)``."""
    Store.CHUNK_TOKENS = chunk_tokens
    codecs = kvquant.get_quantizer(quantizer).codecs(HEAD_DIM)
    like = torch.zeros(rows, HEADS, 0, HEAD_DIM, dtype=torch.bfloat16)
    stores = [Store(codec, 0, 0, like, rows) for codec in codecs]
    gen = torch.Generator().manual_seed(0)
    block = torch.randn(rows, HEADS, CHUNK, HEAD_DIM, generator=gen).to(torch.bfloat16)
    for start in range(0, context, CHUNK):
        n = min(CHUNK, context - start)
        for store in stores:
            store.append(block[:, :, :n], [n] * rows)
    after_prefill = reserved_share(stores)
    token = block[:, :, :1].contiguous()
    began = time.perf_counter()
    out = None
    for step in range(steps):
        for store in stores:
            store.append(token, [1] * rows)
            if read:  # what a decode step also does without fused decode: dequantize the row's whole history
                out = torch.empty(rows, HEADS, context + step + 1, HEAD_DIM, dtype=torch.bfloat16)
                store.read(out, None, [context + step + 1] * rows)
    return after_prefill, reserved_share(stores), time.perf_counter() - began


def main(argv=None) -> None:
    parser = script_parser("bench_growth", __doc__)
    parser.add_argument("--contexts", type=at_least(1, 1 << 24), nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--quantizers", nargs="+", default=["int4", "fp8_e4m3"])
    parser.add_argument("--steps", type=at_least(1, 1 << 24), default=1024)
    parser.add_argument("--rows", type=at_least(1, 1024), default=2)
    parser.add_argument("--repeats", type=at_least(1, 1000), default=3)
    parser.add_argument("--read", action="store_true", help="each step also reads every row back (Store.read), as "
                        "a decode step without fused decode does")
    args = parser.parse_args(argv)
    for quantizer in args.quantizers:  # a name it does not know, before anything is printed or measured
        kvquant.get_quantizer(quantizer)
    tokens = args.rows * (max(args.contexts) + args.steps)
    need, have = tokens * BYTES_PER_TOKEN, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise KVQuantError(f"--rows {args.rows} x (the longest context {max(args.contexts):,} + --steps "
                           f"{args.steps:,}) tokens need about {need / 2**30:,.1f} GiB, more than this machine's "
                           f"{have / 2**30:,.1f} GiB")
    default = Store.CHUNK_TOKENS
    policies = {"1.25x": UNBOUNDED, "chunked": default}
    print(f"bench_growth: {HEADS} KV heads x {HEAD_DIM}, bfloat16, {args.rows} rows, prefill in chunks of {CHUNK}, "
          f"then {args.steps} single-token steps through Store.append{' and Store.read' if args.read else ''} (keys "
          f"and values); CHUNK_TOKENS={default}; "
          f"torch threads {torch.get_num_threads()}")
    print("quantizer  context  policy   reserved/stored after prefill  after steps  steps s (best of "
          f"{args.repeats})  chunked/1.25x")
    try:
        for quantizer in args.quantizers:
            for context in args.contexts:
                best = {name: None for name in policies}
                for _ in range(args.repeats):
                    for name, chunk_tokens in policies.items():
                        got = run(quantizer, context, args.steps, args.rows, chunk_tokens, args.read)
                        if best[name] is None or got[2] < best[name][2]:
                            best[name] = got
                for name in policies:
                    prefill, steps, seconds = best[name]
                    ratio = seconds / best["1.25x"][2]
                    print(f"{quantizer:9}  {context:7}  {name:7}  {prefill:29.2%}  {steps:11.2%}  {seconds:21.3f}  "
                          f"{ratio:13.3f}", flush=True)
    finally:
        Store.CHUNK_TOKENS = default


if __name__ == "__main__":
    sys.exit(run_script("bench_growth", main))
