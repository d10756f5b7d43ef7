"""experiments/gpu_check.py's model-level checks, on random-init models of real attention shapes: the identity
cache against ``DynamicCache`` and each quantizer's logit error on the GPU against the CPU's (check 7), decode
logits through the Triton kernel against the dequantized copy (check 6), K/V codes read back alike on both devices
(check 5), and their verdicts."""

from __future__ import annotations

import contextlib
import copy
import traceback

import torch
from gpu_memory import failed
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import kvquant

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


def logit_verdicts(logits: dict) -> list[str]:
    """Checks 7: the identity equals ``DynamicCache``; each quantizer differs from it with the CPU's error."""
    lines = []
    for shape, per_q in logits.items():
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
    return lines


def codes_verdicts(codes: dict) -> list[str]:
    """Check 5: reads on the GPU equal the CPU's (a code flipped at a rounding boundary is fine)."""
    lines = []
    for q, r in codes.items():
        if failed(lines, f"codes {q}", r):
            continue
        good = min(r["keys_equal_fraction"], r["values_equal_fraction"]) >= 0.95 and r["max_abs_diff"] <= r["bound"]
        lines.append(f"{'PASS' if good else 'FAIL'} codes {q}: GPU reads equal the CPU's for "
                     f"{r['keys_equal_fraction']:.4%} of keys, {r['values_equal_fraction']:.4%} of values "
                     f"(at least 95% each; max |diff| {r['max_abs_diff']:.3g}, at most {r['bound']:.3g})")
    return lines


def fused_verdicts(fused: dict) -> list[str]:
    """Check 6: the kernel ran, and its logits are the copy's to a bound well below the quantizer's own error."""
    lines = []
    for shape, per_q in fused.items():
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
    return lines
