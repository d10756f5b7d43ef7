"""experiments/gpu_check.py's memory check (check 4): caches written without a model, the CUDA allocator's growth
against ``memory_report()``'s stored + reserved bytes and against the cache's own tensors walked here; and the
helpers the speed check shares (:func:`write_chunks`, :func:`held_bytes`, :func:`failed`). Runs on the CPU with a
fake allocator (tests/test_gpu_check_memory.py)."""

from __future__ import annotations

import copy
import traceback

import torch

import kvquant

#: tokens per ``cache.update`` while a cache is filled (the chunked prefill's chunk)
CHUNK = 2048
#: contexts at which ``--checks memory`` measures one growing cache per quantizer, and the decode steps after the last
MEMORY_CONTEXTS, MEMORY_STEPS = (4096, 16384, 32768), 600


def always() -> bool:
    """The default ``in_time``: no time limit."""
    return True


def write_chunks(cache, chunk: torch.Tensor, layers: int, written: int, upto: int) -> int:
    """Write ``chunk``'s first tokens (``[B, kv_heads, CHUNK, head_dim]``, the same K and V) to every layer of
    ``cache`` through ``cache.update``, at most :data:`CHUNK` per call, from ``written`` to ``upto`` tokens; the
    reads it returns are dropped at once. Returns ``upto``."""
    while written < upto:
        n = min(chunk.shape[2], upto - written)
        for i in range(layers):
            cache.update(chunk[:, :, :n], chunk[:, :, :n], i)
        written += n
    return written


def random_chunk(config, batch: int, device, seed: int) -> torch.Tensor:
    """Random K/V for :func:`write_chunks`: ``[batch, kv_heads, CHUNK, head_dim]`` bfloat16 on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    chunk = torch.randn(batch, config.num_key_value_heads, CHUNK, config.head_dim, generator=gen)
    return chunk.to(device=device, dtype=torch.bfloat16)


def held_bytes(cache) -> int | None:
    """Bytes of the tensors a kvquant cache's stores hold on their device (pools, sinks, tails; each storage once),
    walked here, not taken from ``memory_report()``; None for other caches. The block tables stay on the CPU."""
    total, seen = 0, set()
    for layer in getattr(cache, "layers", []):
        for store in (getattr(layer, "k", None), getattr(layer, "v", None)):
            if store is None or not hasattr(store, "pool"):
                continue
            for t in (*store.pool.values(), store.sinks, store.tail):
                if t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
    return total if seen else None


@torch.inference_mode()
def check_memory(device, config, quantizers: dict, contexts=MEMORY_CONTEXTS, batch=4, steps=MEMORY_STEPS, layers=4,
                 allocated=None, in_time=always) -> dict:
    """Check 4 without a model: per quantizer (``quantizers``: name -> (quantizer, make_cache options)), one cache
    of ``config``'s attention shape (``layers`` layers, bfloat16) written through ``cache.update`` in chunks of
    2,048 tokens, measured as it passes each context, then ``steps`` single-token steps (across growths of its
    pools), measured again. A row: the allocator's growth since the cache was made (``allocated``: a callable,
    ``torch.cuda.memory_allocated`` on a GPU), the report's stored, reserved and tensor bytes, and the stores'
    tensors walked here (:func:`held_bytes`). Before each quantizer, ``in_time()``: when it says no, the check
    stops there and says so (``stopped``)."""
    if allocated is None:
        allocated = torch.cuda.memory_allocated
    cuda = str(device).startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    chunk = random_chunk(config, batch, device, seed=5)
    rows = []
    for name, (q, opts) in quantizers.items():
        if not in_time():
            return {"rows": rows, "stopped": f"time limit, before kvquant-{name}"}
        cache = None
        try:
            sync()
            if cuda:
                torch.cuda.empty_cache()
            before = allocated()
            cache = kvquant.make_cache(config, q, **opts)
            written = 0
            for point in sorted(set(contexts)):
                written = write_chunks(cache, chunk, layers, written, point)
                sync()
                rows.append(memory_row(name, cache, written, "prefill", batch, allocated() - before))
            for _ in range(steps):
                written = write_chunks(cache, chunk, layers, written, written + 1)
            sync()
            rows.append(memory_row(name, cache, written, f"+{steps} steps", batch, allocated() - before))
        except Exception:  # noqa: BLE001 (recorded, the run goes on)
            rows.append({"cache": f"kvquant-{name}", "error": traceback.format_exc(limit=4)})
        cache = None
    return {"rows": rows}


def memory_row(name, cache, tokens, point, batch, allocated) -> dict:
    """One row of :func:`check_memory`: the allocator's growth, the report's bytes and the tensors walked here."""
    from kvquant.cache import Store

    report = cache.memory_report()
    return {"cache": f"kvquant-{name}", "tokens": tokens, "point": point, "batch": batch,
            "allocated_bytes": allocated, "stored_bytes": report["stored_bytes"],
            "reserved_bytes": report["reserved_bytes"], "tensor_bytes": report["tensor_bytes"],
            "host_bytes": report["host_bytes"], "held_bytes": held_bytes(cache), "chunk_tokens": Store.CHUNK_TOKENS}


def memory_verdicts(rows: list[dict]) -> list[str]:
    """``--checks memory``: per row, the report's stored + reserved bytes equal the cache's own tensors exactly, the
    allocator's growth is within 5% of them (it rounds each block up, and may hand out a cached block up to 1 MiB
    larger), and from 4 x ``CHUNK_TOKENS`` tokens on the reserved share is within ``CHUNK_TOKENS / tokens`` (the
    growth policy's bound; 1.25x growth reserved up to 25%)."""
    lines = []
    for r in rows:
        if failed(lines, f"memory {r['cache']}", r):
            continue
        where = f"memory {r['cache']} at {r['tokens']} tokens ({r['point']})"
        exact = r["stored_bytes"] + r["reserved_bytes"] == r["tensor_bytes"] == r["held_bytes"]
        lines.append(f"{'PASS' if exact else 'FAIL'} {where}: stored {r['stored_bytes']:,} + reserved "
                     f"{r['reserved_bytes']:,} = {r['stored_bytes'] + r['reserved_bytes']:,} bytes, the cache's "
                     f"tensors {r['held_bytes']:,}")
        off = r["allocated_bytes"] / r["tensor_bytes"] - 1
        lines.append(f"{'PASS' if abs(off) <= 0.05 else 'FAIL'} {where}: the allocator grew by "
                     f"{r['allocated_bytes']:,} bytes, {off:+.2%} of memory_report()'s tensor_bytes (at most 5% "
                     f"either way; stored bytes alone: {r['allocated_bytes'] / r['stored_bytes'] - 1:+.2%})")
        share = r["reserved_bytes"] / r["stored_bytes"]
        if r["tokens"] >= 4 * r["chunk_tokens"]:
            bound = r["chunk_tokens"] / r["tokens"]
            lines.append(f"{'PASS' if share <= bound else 'FAIL'} {where}: reserved {share:.2%} of the stored bytes "
                         f"(at most {bound:.2%}: CHUNK_TOKENS {r['chunk_tokens']} per row)")
    return lines


def memory_markdown(rows: list[dict]) -> list[str]:
    """report.md's table of the memory check's measured rows (none: no lines)."""
    rows = [r for r in rows if "error" not in r]
    if not rows:
        return []
    return ["", f"## Memory against the allocator (no model; Llama-3-8B attention shape, batch {rows[0]['batch']})",
            "", "| cache | tokens | when | allocator bytes | stored | reserved | reserved / stored | "
            "allocator / (stored + reserved) |", "|---|---:|---|---:|---:|---:|---:|---:|",
            *(f"| {r['cache']} | {r['tokens']} | {r['point']} | {r['allocated_bytes']:,} | {r['stored_bytes']:,} | "
              f"{r['reserved_bytes']:,} | {r['reserved_bytes'] / r['stored_bytes']:.2%} | "
              f"{r['allocated_bytes'] / r['tensor_bytes']:.4f} |" for r in rows)]


def failed(lines: list[str], label: str, r: dict) -> bool:
    """Whether a check recorded an error instead of numbers (then a FAIL line with its last line is added)."""
    if "error" in r:
        lines.append(f"FAIL {label}: {r['error'].strip().splitlines()[-1]}")
    return "error" in r
