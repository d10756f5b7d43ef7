"""kvquant on a CUDA GPU: the checks CPU-only CI cannot make, in one short run.

    python experiments/gpu_check.py --out reports/gpu_check

On random-init models of real shapes (SmolLM2-135M, a Llama-3-8B layer stack, Mistral's sliding window,
head_dim 80 and 256), in bfloat16 on the GPU:

1. **identity**: the fp16 quantizer's logits equal ``DynamicCache``'s bit for bit (chunked prefill + decode);
2. **quantized K/V are read, on the GPU too**: each quantizer's logits differ from ``DynamicCache``'s, int2 more
   than int8, and the error is the CPU's (the same model in float32 on the CPU, same cache settings);
3. **codes**: K/V written to a cache on the GPU read back as on the CPU (same float32 tensors);
4. **memory**: what the CUDA allocator holds for each cache after a long prefill, against ``memory_report()``; and
   (``--checks memory``, cheap: no model) one cache per quantizer written to 4K, 16K and 32K tokens (chunks of
   2,048, then single-token steps across growths of its pools), ``torch.cuda.memory_allocated`` deltas against
   ``memory_report()``'s ``stored_bytes + reserved_bytes`` (``tensor_bytes``), which must also equal the cache's
   own tensors exactly, and the reserved share within the growth policy's bound;
5. **decode speed**: single-token steps per second at long contexts, against ``DynamicCache``, measured in the
   same run, also with ``enable_fused_decode`` (the Triton kernel reading the codes);
6. **fused decode**: decode logits through the Triton kernel against the same cache read through its dequantized
   copy (float32: equal to rounding; the kernel's calls counted, so a silent fallback shows);
7. **the kernel's own tests** (tests/test_triton_attend.py) compiled on the GPU instead of Triton's interpreter.

Writes ``results.json`` and ``report.md`` (command, machine, date) to ``--out``. Every check records its error
instead of stopping the run.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import kvquant
from kvquant.cache import stored_bytes
from kvquant.errors import KVQuantError, at_least, script_parser
from kvquant.exits import run_script
from kvquant.fs import output_dir, read_json, write_file
from kvquant.runner.report import environment

QUANTIZERS = {  # name -> make_cache arguments
    "fp16": ("fp16", {}),
    "fp8_e4m3": ("fp8_e4m3", {}),
    "fp8_e5m2": ("fp8_e5m2", {}),
    "int8": ("int8", {}),
    "int4": ("int4", {}),
    "int4-hadamard": ("int4", {"rotation": "hadamard"}),
    "int2": ("int2", {}),
}


#: quantizers also measured with ``kvquant.enable_fused_decode`` (the Triton kernel reads their codes)
FUSED = ("fp16", "fp8_e4m3", "int8", "int4")


def shapes() -> dict:
    """name -> (model class, config): real models' attention shapes, few layers, random weights."""
    llama = dict(vocab_size=32000, rms_norm_eps=1e-5, max_position_embeddings=32768)
    return {
        "smollm2-135m": (LlamaForCausalLM, LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                                       num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                                       **llama)),
        "llama3-8b-4layers": (LlamaForCausalLM, LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                                            num_hidden_layers=4, num_attention_heads=32,
                                                            num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                                                            **llama)),
        "mistral-sliding256": (MistralForCausalLM, MistralConfig(hidden_size=1024, intermediate_size=2816,
                                                                 num_hidden_layers=4, num_attention_heads=8,
                                                                 num_key_value_heads=2, head_dim=128,
                                                                 sliding_window=256, **llama)),
        "head_dim80": (LlamaForCausalLM, LlamaConfig(hidden_size=640, intermediate_size=1792, num_hidden_layers=4,
                                                     num_attention_heads=8, num_key_value_heads=4, head_dim=80,
                                                     **llama)),
        "head_dim256": (LlamaForCausalLM, LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                                      num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                                      **llama)),
    }


def build(cls, config, device, dtype):
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config)
    return model.to(dtype).eval()


@torch.inference_mode()
def logits_run(model, cache, prompt, chunk, steps) -> torch.Tensor:
    """Chunked prefill of ``prompt[:, :-steps]`` (``[B, T]``), then its last ``steps`` tokens one at a time
    (teacher-forced, so every cache reads the same tokens); the last position's logits of every forward,
    ``[forwards, B, vocab]`` float32 on the CPU."""
    out, head = [], prompt.shape[1] - steps
    for i in range(0, head, chunk):
        out.append(model(prompt[:, i : min(i + chunk, head)], cache=cache, use_cache=True).logits[:, -1].float().cpu())
    for t in range(head, prompt.shape[1]):
        out.append(model(prompt[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1].float().cpu())
    return torch.stack(out)


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def check_logits(name, cls, config, device, prompt_len=600, chunk=256, steps=16) -> dict:
    """Checks 1 and 2 on one shape: the identity in bfloat16, every quantizer in float32 on both devices (so the
    GPU's and the CPU's errors are the quantizer's, not bfloat16's)."""
    prompt = torch.randint(0, config.vocab_size, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    bf16 = build(cls, config, device, torch.bfloat16)
    runs = {}
    for backend in ("default", "math"):  # the math backend: one SDPA kernel, whatever the shapes
        with contextlib.ExitStack() as stack:
            if backend == "math":
                stack.enter_context(sdpa_kernel(SDPBackend.MATH))
            runs[backend] = [logits_run(bf16, make(), prompt.to(device), chunk, steps)
                             for make in (lambda: DynamicCache(config=config), lambda: DynamicCache(config=config),
                                          lambda: kvquant.make_cache(config, "fp16"))]
    ref, again, got = runs["default"]
    diff = (got - ref).abs().amax(dim=(1, 2))
    out = {"fp16-bfloat16": {"max_abs_diff_vs_dynamic": float(diff.max()),
                             "dynamic_repeat_max_diff": float((again - ref).abs().max()),
                             "math_backend_max_diff": float((runs["math"][2] - runs["math"][0]).abs().max())}}
    del bf16
    gpu = build(cls, config, device, torch.float32)
    cpu = build(cls, config, "cpu", torch.float32)
    ref_gpu = logits_run(gpu, DynamicCache(config=config), prompt.to(device), chunk, steps)
    ref_cpu = logits_run(cpu, DynamicCache(config=config), prompt, chunk, steps)
    for qname, (q, opts) in QUANTIZERS.items():
        try:
            got = logits_run(gpu, kvquant.make_cache(gpu, q, residual_length=0, **opts), prompt.to(device), chunk,
                             steps)
            got_cpu = logits_run(cpu, kvquant.make_cache(cpu, q, residual_length=0, **opts), prompt, chunk, steps)
            out[qname] = {"max_abs_diff_vs_dynamic": float((got - ref_gpu).abs().max()),
                          "rel_error_gpu": rel_error(got, ref_gpu), "rel_error_cpu": rel_error(got_cpu, ref_cpu),
                          "finite": bool(torch.isfinite(got).all())}
        except Exception:  # noqa: BLE001 (recorded, the run goes on)
            out[qname] = {"error": traceback.format_exc(limit=4)}
    del gpu, cpu
    torch.cuda.empty_cache()
    return out


@torch.inference_mode()
def check_fused(name, cls, config, device, prompt_len=600, chunk=256, steps=16) -> dict:
    """Check 6 on one shape: decode steps through the Triton kernel (``enable_fused_decode``, reading the codes)
    against the same cache read through its dequantized copy and the model's SDPA, in float32 (where both paths
    should agree to float rounding: the kernel's dots are IEEE fp32) and in bfloat16, where both are also held
    against the same weights and cache setting computed in float32 (which of the two is nearer it). Counts the
    kernel's calls, so a run that silently fell back to the copy shows up."""
    from kvquant.cache import triton_attend

    calls = {"n": 0}
    original = triton_attend.attend

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    prompt = torch.randint(0, config.vocab_size, (2, prompt_len), generator=torch.Generator().manual_seed(4))
    prompt = prompt.to(device)
    out = {}
    triton_attend.attend = counted
    try:
        for dtype in (torch.float32, torch.bfloat16):
            eager = build(cls, config, device, dtype)
            fused = build(cls, config, device, dtype)
            kvquant.enable_fused_decode(fused)
            ref = logits_run(eager, DynamicCache(config=config), prompt, chunk, steps)[-steps:]
            for q in FUSED:
                key = f"{q}-{str(dtype).removeprefix('torch.')}"
                try:
                    calls["n"] = 0
                    a = logits_run(eager, kvquant.make_cache(eager, q, residual_length=0), prompt, chunk,
                                   steps)[-steps:]
                    eager_calls = calls["n"]
                    b = logits_run(fused, kvquant.make_cache(fused, q, residual_length=0), prompt, chunk,
                                   steps)[-steps:]
                    out[key] = {"rel_diff_fused_vs_copy": rel_error(b, a), "max_abs_diff": float((b - a).abs().max()),
                                "rel_error_vs_dynamic": rel_error(a, ref), "finite": bool(torch.isfinite(b).all()),
                                "kernel_calls": calls["n"] - eager_calls, "expected_calls":
                                    steps * config.num_hidden_layers}
                    if dtype != torch.float32:  # the same weights and setting in float32, through the copy
                        exact = copy.deepcopy(eager).float()
                        c = logits_run(exact, kvquant.make_cache(exact, q, residual_length=0), prompt, chunk,
                                       steps)[-steps:]
                        out[key].update(copy_vs_float32=rel_error(a, c), fused_vs_float32=rel_error(b, c))
                        del exact
                except Exception:  # noqa: BLE001
                    out[key] = {"error": traceback.format_exc(limit=4)}
            del eager, fused
            torch.cuda.empty_cache()
    finally:
        triton_attend.attend = original
    return out


def run_kernel_tests(device) -> dict:
    """Check 7: tests/test_triton_attend.py compiled on the GPU (``KVQUANT_TEST_DEVICE``) instead of under Triton's
    interpreter: the kernel against float64 attention written in the test, over hand-built streams."""
    import os
    import subprocess

    env = dict(os.environ, KVQUANT_TEST_DEVICE=device)
    env.pop("TRITON_INTERPRET", None)
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton_attend.py"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=400)
    tail = (done.stdout + done.stderr).strip().splitlines()
    return {"returncode": done.returncode, "summary": tail[-1] if tail else "", "output_tail": "\n".join(tail[-60:])}


@torch.inference_mode()
def check_codes(device) -> dict:
    """Check 3: the same float32 K/V written to a cache on the GPU and on the CPU read back alike."""
    out = {}
    config = shapes()["llama3-8b-4layers"][1]
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(2, 8, 300, 128, generator=gen) * torch.linspace(0.1, 8, 128)  # outlier channels
    v = torch.randn(2, 8, 300, 128, generator=gen)
    for qname, (q, opts) in QUANTIZERS.items():
        try:
            reads = []
            for dev in ("cpu", device):
                cache = kvquant.make_cache(config, q, residual_length=0, **opts)
                kk, vv = cache.update(k.to(dev), v.to(dev), 0)
                reads.append((kk.float().cpu(), vv.float().cpu()))
            (kc, vc), (kg, vg) = reads
            step = float((k.amax() - k.amin()) / 3)  # at most one int2 step of the whole range
            out[qname] = {"keys_equal_fraction": float((kc == kg).float().mean()),
                          "values_equal_fraction": float((vc == vg).float().mean()),
                          "max_abs_diff": max(float((kc - kg).abs().max()), float((vc - vg).abs().max())),
                          "bound": step}
        except Exception:  # noqa: BLE001
            out[qname] = {"error": traceback.format_exc(limit=4)}
    return out


@torch.inference_mode()
def check_memory_and_speed(device, contexts, batch, steps) -> dict:
    """Checks 4 and 5 on the Llama-3-8B layer stack in bfloat16."""
    cls, config = shapes()["llama3-8b-4layers"]
    model = build(cls, config, device, torch.bfloat16)
    fused = build(cls, config, device, torch.bfloat16)  # the same weights; decode steps attend over the codes
    fused.load_state_dict(model.state_dict())
    kvquant.enable_fused_decode(fused)
    factories = {"DynamicCache": (model, lambda: DynamicCache(config=config))}
    factories.update({f"kvquant-{n}": (model, lambda q=q, o=o: kvquant.make_cache(model, q, **o))
                      for n, (q, o) in QUANTIZERS.items()})
    factories.update({f"kvquant-{n}-fused": (fused, lambda q=q, o=o: kvquant.make_cache(fused, q, **o))
                      for n, (q, o) in QUANTIZERS.items() if n in FUSED})
    rows = []
    cache = None
    for context in contexts:
        prompt = torch.randint(0, config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(3))
        prompt = prompt.to(device)
        for name, (runner, make) in factories.items():
            row = {"cache": name, "context": context, "batch": batch}
            cache = None  # the last row's, also when it failed: not counted in this row's "before"
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                before = torch.cuda.memory_allocated()
                cache = make()
                for i in range(0, context, 2048):
                    runner(prompt[:, i : i + 2048], cache=cache, use_cache=True, logits_to_keep=1)
                torch.cuda.synchronize()
                row["allocated_bytes"] = torch.cuda.memory_allocated() - before
                row["reported_bytes"] = stored_bytes(cache)
                row["held_bytes"] = held_bytes(cache)
                if hasattr(cache, "memory_report"):
                    row["tensor_bytes"] = cache.memory_report()["tensor_bytes"]
                token = prompt[:, -1:]
                for _ in range(4):
                    runner(token, cache=cache, use_cache=True)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(steps):
                    runner(token, cache=cache, use_cache=True)
                torch.cuda.synchronize()
                row["steps_per_s"] = steps / (time.perf_counter() - start)
                del cache
            except Exception:  # noqa: BLE001
                row["error"] = traceback.format_exc(limit=4)
            rows.append(row)
    base = {r["context"]: r for r in rows if r["cache"] == "DynamicCache" and "error" not in r}
    same = {r["context"]: r for r in rows if r["cache"] == "kvquant-fp16" and "error" not in r}
    for r in rows:
        b, f = base.get(r["context"]), same.get(r["context"])
        if b and "error" not in r:
            r["speed_vs_dynamic"] = r["steps_per_s"] / b["steps_per_s"]
            r["allocated_vs_dynamic"] = r["allocated_bytes"] / b["allocated_bytes"]
        if f and "error" not in r:
            r["speed_vs_kvquant_fp16"] = r["steps_per_s"] / f["steps_per_s"]
    return {"rows": rows}


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


#: contexts at which ``--checks memory`` measures one growing cache per quantizer, and the decode steps after the last
MEMORY_CONTEXTS, MEMORY_STEPS = (4096, 16384, 32768), 600


@torch.inference_mode()
def check_memory(device, contexts=MEMORY_CONTEXTS, batch=4, steps=MEMORY_STEPS, layers=4, allocated=None) -> dict:
    """Check 4 without a model: per quantizer, one cache of the Llama-3-8B attention shape (``layers`` layers, 8 KV
    heads of 128, bfloat16) written through ``cache.update`` in chunks of 2,048 tokens, measured as it passes each
    context, then ``steps`` single-token steps (across growths of its pools), measured again. A row: the allocator's
    growth since the cache was made (``allocated``: a callable, ``torch.cuda.memory_allocated`` on a GPU), the
    report's stored, reserved and tensor bytes, and the stores' tensors walked here (:func:`held_bytes`)."""
    if allocated is None:
        allocated = torch.cuda.memory_allocated
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    config = shapes()["llama3-8b-4layers"][1]
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    heads, head_dim = config.num_key_value_heads, config.head_dim
    gen = torch.Generator().manual_seed(5)
    chunk = torch.randn(batch, heads, 2048, head_dim, generator=gen).to(device=device, dtype=torch.bfloat16)
    rows = []
    for name, (q, opts) in QUANTIZERS.items():
        cache = None
        try:
            sync()
            if str(device).startswith("cuda"):
                torch.cuda.empty_cache()
            before = allocated()
            cache = kvquant.make_cache(config, q, **opts)
            written = 0
            for point in sorted(set(contexts)):
                while written < point:
                    n = min(2048, point - written)
                    for i in range(layers):
                        cache.update(chunk[:, :, :n], chunk[:, :, :n], i)  # the read it returns is dropped at once
                    written += n
                sync()
                rows.append(memory_row(name, cache, written, "prefill", batch, allocated() - before))
            for _ in range(steps):
                for i in range(layers):
                    cache.update(chunk[:, :, :1], chunk[:, :, :1], i)
                written += 1
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


def failed(lines: list[str], label: str, r: dict) -> bool:
    """Whether a check recorded an error instead of numbers (then a FAIL line with its last line is added)."""
    if "error" in r:
        lines.append(f"FAIL {label}: {r['error'].strip().splitlines()[-1]}")
    return "error" in r


def verdicts(results: dict) -> list[str]:
    """The properties the checks stand for, each PASS/FAIL with its numbers."""
    lines = []
    for shape, per_q in results["logits"].items():
        if failed(lines, shape, per_q):
            continue
        ok = {q: r for q, r in per_q.items() if not failed(lines, f"{shape} {q}", r)}
        for q in ("fp16-bfloat16", "fp16"):
            if q in ok:
                r = ok[q]
                d = r["max_abs_diff_vs_dynamic"]
                # equal, or as equal as DynamicCache is to itself, and exactly equal under one fixed kernel
                good = d == 0 or (d <= r.get("dynamic_repeat_max_diff", 0) and r.get("math_backend_max_diff") == 0)
                more = (f"; DynamicCache against itself {r['dynamic_repeat_max_diff']} (the default SDPA backend is "
                        f"not deterministic here), under the math SDPA backend {r['math_backend_max_diff']}"
                        if "math_backend_max_diff" in r and d else "")
                lines.append(f"{'PASS' if good else 'FAIL'} {shape}: {q} quantizer equals DynamicCache "
                             f"(max |diff| {d}{more})")
        for q, r in ok.items():
            if q.startswith("fp16"):
                continue
            g, c = r["rel_error_gpu"], r["rel_error_cpu"]
            good = r["finite"] and g > 0 and c > 0 and 0.8 <= g / c <= 1.25
            lines.append(f"{'PASS' if good else 'FAIL'} {shape}: {q} differs from DynamicCache; logit error GPU "
                         f"{g:.4f} vs CPU {c:.4f}")
        if "int2" in ok and "int8" in ok:
            a, b = ok["int2"]["rel_error_gpu"], ok["int8"]["rel_error_gpu"]
            lines.append(f"{'PASS' if a > b else 'FAIL'} {shape}: int2 error {a:.4f} > int8 error {b:.4f}")
    for q, r in results["codes"].items():
        if failed(lines, f"codes {q}", r):
            continue
        # a code flipped at a rounding boundary is fine; a read that is not the CPU's is not
        good = min(r["keys_equal_fraction"], r["values_equal_fraction"]) >= 0.95 and r["max_abs_diff"] <= r["bound"]
        lines.append(f"{'PASS' if good else 'FAIL'} codes {q}: GPU reads equal the CPU's for "
                     f"{r['keys_equal_fraction']:.4%} of keys, {r['values_equal_fraction']:.4%} of values "
                     f"(at least 95% each; max |diff| {r['max_abs_diff']:.3g}, at most {r['bound']:.3g})")
    for shape, per_q in results.get("fused", {}).items():
        if failed(lines, f"fused {shape}", per_q):
            continue
        for key, r in per_q.items():
            if failed(lines, f"fused {shape} {key}", r):
                continue
            # The kernel's difference from the copy must be negligible beside what is measured, the quantizer's own
            # error: float32 at most 1% of it (1e-5 for the identity), bfloat16 at most 10% (identity: recorded)
            diff, err = r["rel_diff_fused_vs_copy"], r["rel_error_vs_dynamic"]
            f32 = key.endswith("float32")
            bound = max(1e-5, 0.01 * err) if f32 else (None if key.startswith("fp16") else 0.1 * err)
            good = r["kernel_calls"] >= r["expected_calls"] and r["finite"] and (bound is None or diff <= bound)
            lines.append(f"{'PASS' if good else 'FAIL'} fused {shape} {key}: the Triton kernel ran "
                         f"{r['kernel_calls']} times (at least {r['expected_calls']}); decode logits differ from the "
                         f"dequantized copy's by {diff:.2e} relative"
                         f"{'' if bound is None else f' (at most {bound:.2e})'}; the quantizer's own error {err:.2e}")
            if "fused_vs_float32" in r:  # which is nearer the same computation in float32 (at most 25% farther)
                f, c = r["fused_vs_float32"], r["copy_vs_float32"]
                lines.append(f"{'PASS' if f <= 1.25 * c else 'FAIL'} fused {shape} {key} against float32: the "
                             f"kernel's logits are {f:.2e} from the float32 computation, the copy's {c:.2e}")
    if "kernel_tests" in results:
        t = results["kernel_tests"]
        lines.append(f"{'PASS' if t['returncode'] == 0 else 'FAIL'} tests/test_triton_attend.py compiled on the GPU: "
                     f"{t['summary']}")
    speed = results["speed"]
    failed(lines, "memory and speed", speed)
    for r in speed["rows"]:
        if not failed(lines, f"memory {r['cache']} at {r['context']}", r) and r["cache"].startswith("kvquant-"):
            excess = r["allocated_bytes"] / r["reported_bytes"] - 1
            held = r.get("held_bytes")
            if held is None:  # results of runs before held_bytes was recorded
                lines.append(f"{'PASS' if abs(excess) <= 0.05 else 'FAIL'} memory {r['cache']} at {r['context']} "
                             f"tokens: the allocator holds {excess:+.2%} of memory_report() (at most 5% either way)")
                continue
            off = r["allocated_bytes"] / held - 1
            lines.append(f"{'PASS' if abs(off) <= 0.05 else 'FAIL'} memory {r['cache']} at {r['context']} tokens: "
                         f"the allocator holds {off:+.2%} of the cache's own tensors (at most 5% either way); those "
                         f"are {held / r['reported_bytes'] - 1:+.2%} over memory_report()'s stored bytes (pool slots "
                         f"reserved for later writes)")
            if "tensor_bytes" in r:  # runs since memory_report() reports reserved bytes too
                lines.append(f"{'PASS' if r['tensor_bytes'] == held else 'FAIL'} memory {r['cache']} at "
                             f"{r['context']} tokens: memory_report()'s tensor_bytes (stored + reserved) "
                             f"{r['tensor_bytes']:,}, the cache's own tensors {held:,}")
    lines += memory_verdicts(results.get("memory", {}).get("rows", []))
    return lines


def render(results: dict, args, command: str | None = None) -> str:
    env = results["environment"]
    lines = ["# kvquant on a GPU", "",
             f"- command: `{command or 'python ' + ' '.join(sys.argv)}`",
             f"- date: {env['date']}; git {env['git_commit']}",
             f"- machine: {env['machine']}; torch {env['torch']}, transformers {env['transformers']}",
             "- models: random-init; logit checks with residual_length 0 (every token read quantized), 600-token "
             "prompts (prefill in chunks of 256, the last 16 tokens one at a time), batch 2, float32 on both devices "
             "(identity also in bfloat16 on the GPU); memory and speed in bfloat16 with the quantizers' defaults",
             "", "## Checks", ""]
    for check, run in results.get("taken_from", {}).items():
        lines.append(f"- *{check}*: taken from an earlier run ({run}); this run did not repeat it")
    if results.get("taken_from"):
        lines.append("")
    lines += [f"- {v}" for v in verdicts(results)]
    memory = [r for r in results.get("memory", {}).get("rows", []) if "error" not in r]
    if memory:
        lines += ["", f"## Memory against the allocator (no model; Llama-3-8B attention shape, batch "
                  f"{memory[0]['batch']})", "",
                  "| cache | tokens | when | allocator bytes | stored | reserved | reserved / stored | "
                  "allocator / (stored + reserved) |", "|---|---:|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['cache']} | {r['tokens']} | {r['point']} | {r['allocated_bytes']:,} | {r['stored_bytes']:,} | "
                  f"{r['reserved_bytes']:,} | {r['reserved_bytes'] / r['stored_bytes']:.2%} | "
                  f"{r['allocated_bytes'] / r['tensor_bytes']:.4f} |" for r in memory]
    lines += ["", f"## Memory and decode speed (Llama-3-8B attention shape, 4 layers, batch {args.batch}, "
              f"{args.steps} steps)", "",
              "| context | cache | allocator bytes | memory_report stored bytes | vs DynamicCache (allocator) | "
              "steps/s | speed vs DynamicCache | speed vs kvquant fp16 |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results["speed"]["rows"]:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['cache']} | error: {r['error'].strip().splitlines()[-1]} | | | | | |")
            continue
        lines.append(f"| {r['context']} | {r['cache']} | {r['allocated_bytes']:,} | {r['reported_bytes']:,} | "
                     f"{r.get('allocated_vs_dynamic', float('nan')):.3f} | {r['steps_per_s']:.1f} | "
                     f"{r.get('speed_vs_dynamic', float('nan')):.3f} | "
                     f"{r.get('speed_vs_kvquant_fp16', float('nan')):.3f} |")
    return "\n".join(lines) + "\n"


def stage_logits(args, results):
    for name, (cls, config) in shapes().items():
        print(f"gpu_check: logits on {name}", flush=True)
        try:
            results["logits"][name] = check_logits(name, cls, config, args.device)
        except Exception:  # noqa: BLE001
            results["logits"][name] = {"error": traceback.format_exc(limit=4)}


def stage_fused(args, results):
    for name in ("smollm2-135m", "mistral-sliding256", "head_dim80", "head_dim256"):
        print(f"gpu_check: fused decode on {name}", flush=True)
        cls, config = shapes()[name]
        try:
            results["fused"][name] = check_fused(name, cls, config, args.device)
        except Exception:  # noqa: BLE001
            results["fused"][name] = {"error": traceback.format_exc(limit=4)}


def stage_kernel_tests(args, results):
    print("gpu_check: the Triton kernel's tests, compiled", flush=True)
    try:
        results["kernel_tests"] = run_kernel_tests(args.device)
    except Exception:  # noqa: BLE001
        results["kernel_tests"] = {"returncode": -1, "summary": traceback.format_exc(limit=2).splitlines()[-1]}


def stage_codes(args, results):
    print("gpu_check: codes", flush=True)
    results["codes"] = check_codes(args.device)


def stage_memory(args, results):
    print("gpu_check: memory against the allocator", flush=True)
    try:
        results["memory"] = check_memory(args.device, args.memory_contexts, args.batch)
    except Exception:  # noqa: BLE001
        results["memory"] = {"rows": [], "error": traceback.format_exc(limit=4)}


def stage_speed(args, results):
    print("gpu_check: memory and speed", flush=True)
    try:
        results["speed"] = check_memory_and_speed(args.device, args.contexts, args.batch, args.steps)
    except Exception:  # noqa: BLE001
        results["speed"] = {"rows": [], "error": traceback.format_exc(limit=4)}


#: check name -> stage, in the default order
STAGES = {"logits": stage_logits, "fused": stage_fused, "kernel_tests": stage_kernel_tests, "codes": stage_codes,
          "memory": stage_memory, "speed": stage_speed}


def main(argv=None):
    parser = script_parser("gpu_check", __doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", type=at_least(1), nargs="+", default=[4096, 16384])
    parser.add_argument("--memory-contexts", type=at_least(1), nargs="+", default=list(MEMORY_CONTEXTS),
                        help="contexts --checks memory measures its growing caches at")
    parser.add_argument("--batch", type=at_least(1), default=4)
    parser.add_argument("--steps", type=at_least(1), default=32)
    parser.add_argument("--checks", nargs="+", choices=list(STAGES), default=list(STAGES),
                        help="which checks to run, in this order (default: all)")
    parser.add_argument("--keep-from", type=Path, help="an earlier run's results.json: the checks not run now are "
                        "taken from it, and the report says so (one lease may not fit every check)")
    parser.add_argument("--out", type=Path, default=Path("reports/gpu_check"))
    parser.add_argument("--render", action="store_true", help="rewrite report.md from --out's results.json only")
    args = parser.parse_args(argv)
    if args.render:
        results = read_json(args.out / "results.json", "--render")
        if not isinstance(results.get("environment"), dict):
            raise KVQuantError(f"--render: {args.out / 'results.json'} is not a results.json gpu_check writes")
        write_file(output_dir(args.out, "--out") / "report.md", render(results, args, results.get("command")))
        return
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here")
    results = {"command": f"python {' '.join(sys.argv)}", "environment": environment(), "logits": {}, "fused": {},
               "codes": {}, "memory": {"rows": []}, "speed": {"rows": []}}
    if args.keep_from:
        earlier = json.loads(args.keep_from.read_text())
        env = earlier["environment"]
        for check in STAGES:
            if check not in args.checks and check in earlier:
                results[check] = earlier[check]
                results.setdefault("taken_from", {})[check] = f"{env['date']}, git {env['git_commit']}"
    out = output_dir(args.out, "--out")
    for check in args.checks:
        STAGES[check](args, results)
        # after each check, so a run stopped at its time limit keeps what it measured
        write_file(out / "results.json", json.dumps(results, indent=1))
    report = render(results, args, results["command"])
    write_file(out / "report.md", report)
    print(report)


if __name__ == "__main__":
    sys.exit(run_script("gpu_check", main))
