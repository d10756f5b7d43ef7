"""A report's decision as what a serving engine is started with (``python -m kvquant.export REPORT_DIR``).

Reads ``REPORT_DIR/results.json``; when the chosen setting is a serving engine's own format (``kvquant/engines.py``,
every token stored quantized, no rotation, sinks, window or eviction of kvquant's own), writes
``REPORT_DIR/DEPLOY.md``: the engine's command-line flags and Python keyword arguments, what was measured (the
verdicts) and what was not. The runner writes it beside every report whose decision is engine-native.

A decision no serving engine runs (KIVI int4 g32, int2, eviction, ...) is one line and exit 2: "research
setting", with the nearest engine format measured in the same report and its verdict. So is a report directory
that holds no report, and a report without a passing decision.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import KVQuantError
from .fs import read_file, write_together
from .quantizers import QUANTIZERS


def engine_flags(quantizer) -> tuple[str, str, str] | None:
    """(engine, the engine's --kv-cache-dtype value, what else it needs) of an engine format, as its own class says
    (``Quantizer.serving``; a subclass that does not say it again is a research format); None for any other name."""
    cls = QUANTIZERS.classes.get(quantizer) if isinstance(quantizer, str) else None
    return cls.__dict__.get("serving") if cls is not None else None


#: kvquant cache options that no engine has: a setting using any of them is a research setting
RESEARCH_OPTIONS = ("residual_length", "sink_tokens", "window", "budget", "eviction", "rotation")


def load_report(report_dir: Path) -> dict:
    """``results.json`` of a report directory, or one line naming what is wrong."""
    path = report_dir / "results.json"
    try:
        doc = json.loads(read_file(path).decode("utf-8"))
    except OSError as err:
        raise KVQuantError(f"{report_dir} is not a kvquant report directory: cannot read {path.name} "
                           f"({err.strerror or err})") from None
    except (UnicodeError, ValueError):
        raise KVQuantError(f"{path} is not a kvquant results.json (not JSON)") from None
    if not isinstance(doc, dict) or not {"decision", "chosen", "candidates"} <= set(doc):
        raise KVQuantError(f"{path} is not a kvquant results.json (no decision, chosen or candidates)")
    return doc


def layer_indices(selector) -> range:
    """The layers a per-layer settings key names: ``5``, ``"5"`` or ``"0-3"``."""
    low, _, high = str(selector).partition("-")
    return range(int(low), int(high or low) + 1)


#: per-layer options an engine takes from the checkpoint (exported as scales), not from a flag
CHECKPOINT_OPTIONS = ("k_scale", "v_scale")


def skipped_layers(settings: dict) -> list[int] | None:
    """The layers a per-layer setting keeps at model precision (fp16), [] when it has no per-layer settings, or
    None when its layers differ in a way no engine expresses (static scales differ per layer in a checkpoint)."""
    skipped = []
    for selector, own in (settings.get("layers") or {}).items():
        if own.get("quantizer") == "fp16":
            skipped += layer_indices(selector)
        elif own.get("quantizer", settings["quantizer"]) != settings["quantizer"] or any(
                own[k] != settings.get(k) for k in own if k not in ("quantizer", *CHECKPOINT_OPTIONS)):
            return None
    return sorted(skipped)


def native(settings: dict) -> tuple[str, str, str, list[int]] | None:
    """(engine, flag value, needs, skipped layers) when a cache setting is an engine's own format, else None."""
    flags = engine_flags(settings.get("quantizer"))
    if flags is None:
        return None
    if any(settings.get(k) for k in RESEARCH_OPTIONS):
        return None
    skipped = skipped_layers(settings)
    return None if skipped is None else (*flags, skipped)


def nearest_engine_format(doc: dict, chosen: dict) -> str:
    """The engine format measured in this report nearest the chosen setting's bits, with its verdict."""
    measured = [c for c in doc["candidates"] if native(c["settings"])]
    if not measured:
        return "no engine format was measured in this report (configs/smollm2-engines.yaml measures them)"
    near = min(measured, key=lambda c: abs(c["bits_per_element"] - chosen["bits_per_element"]))
    return (f"the nearest engine format measured here is {near['settings']['quantizer']} ({near['name']}, "
            f"{near['bits_per_element']:.2f} bits/element): {near['verdict'].upper()}")


def checkpoint_scales(settings: dict) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """For static fp8 with per-layer scales (calibrated): the compressed-tensors ``quantization_config`` that
    declares them (``kv_cache_scheme``: 8-bit float, symmetric, static, per ``tensor`` or ``attn_head``) and the
    tensors as compressed-tensors names them (``model.layers.N.self_attn.k_scale``: ``[1]`` per tensor,
    ``[kv_heads, 1, 1]`` per head), float32 as measured; None when there are none to ship."""
    layers = settings.get("layers") or {}
    if settings.get("quantizer") != "vllm_fp8" or not layers:
        return None
    tensors, per_head = {}, False
    for selector, own in layers.items():
        if own.get("quantizer") == "fp16":
            continue  # kept at full precision: a skipped layer, no scales
        for layer in layer_indices(selector):
            for role in ("k_scale", "v_scale"):
                value = own.get(role, settings.get(role, 1.0))
                per_head = per_head or isinstance(value, list)
                scale = torch.tensor(value, dtype=torch.float32)
                tensors[f"model.layers.{layer}.self_attn.{role}"] = scale.reshape(-1, 1, 1) if scale.dim() else \
                    scale.reshape(1)
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
              "strategy": "attn_head" if per_head else "tensor"}
    return {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
            "kv_cache_scheme": scheme}, tensors


def unshippable_scales(settings: dict) -> str | None:
    """Why static scales that were measured (anything but 1.0) cannot be exported, else None: kvquant writes
    them for vllm_fp8 per layer (``layers``), not yet for one scale for all layers nor for nvfp4's global scales."""
    if "k_scale" not in settings:
        return None
    per_layer = [own.get(k) for own in (settings.get("layers") or {}).values() for k in CHECKPOINT_OPTIONS]
    top = [settings.get(k) for k in CHECKPOINT_OPTIONS]
    if settings["quantizer"] == "vllm_fp8":
        return None if all(v in (None, 1.0) for v in top) else (
            "one k_scale/v_scale for all layers is not exported (calibrate: tensor gives per-layer scales, which are)")
    if any(v not in (None, 1.0) for v in [*top, *per_layer]):
        return (f"exporting {settings['quantizer']}'s global scales (ModelOpt's hf_quant_config.json) is not built "
                "yet")
    return None


def engine_own_skips(chosen: dict, skipped: list[int]) -> str:
    """For TurboQuant: the boundary layers vLLM keeps at model precision on its own that the measured setting
    stored in the format (what vLLM runs then stores more there than was measured)."""
    layers = len(chosen.get("memory", {}).get("per_layer") or [])
    if not chosen["settings"]["quantizer"].startswith("vllm_turboquant") or layers < 4:
        return ""
    own = sorted({0, 1, layers - 2, layers - 1} - set(skipped))
    return (f" kvquant measured layers {', '.join(map(str, own))} in the format, which vLLM keeps at model precision "
            "on its own: what it runs stores more than was measured there, and is no less accurate for it."
            if own else "")


def deploy_text(doc: dict, chosen: dict, engine: str, flag: str, needs: str, skipped: list[int]) -> str:
    """``DEPLOY.md``: what to run, what was measured, the verdicts, what was not measured."""
    cli = f"--kv-cache-dtype {flag}" + (f" --kv-cache-dtype-skip-layers {' '.join(map(str, skipped))}"
                                         if skipped else "")
    python = (f"LLM(model=..., kv_cache_dtype={flag!r}"
              + (f", kv_cache_dtype_skip_layers={[str(i) for i in skipped]!r}" if skipped else "") + ")")
    if engine == "SGLang":
        python = f"sglang.Engine(model_path=..., kv_cache_dtype={flag!r})"
    verdicts = "\n".join(f"| {name} | {m['value']:.4g} (baseline {m['baseline']:.4g}) | {m['verdict']} |"
                         for name, m in chosen["metrics"].items() if m.get("gated"))
    model = doc.get("config", {}).get("model", {}).get("path", "?")
    return f"""# Deploying {chosen['name']} ({engine} `--kv-cache-dtype {flag}`)

Run {engine} with `{cli}` (Python: `{python}`). Needs: {needs}.{engine_own_skips(chosen, skipped)}
kvquant measured this format ({chosen['settings']['quantizer']}, {chosen['bits_per_element']:.3f} bits per
element as the engine stores it) on `{model}` against the fp16 baseline through the same cache, with attention
reading the stored K/V, and the gate decided **{doc['decision'].upper()}**: {doc['reason']}

| metric | value | verdict |
|---|---:|---|
{verdicts}

Not measured: the engine itself (kvquant emulates its numerics; see docs/quantizers.md for where an engine's GPU
arithmetic may differ by an ulp), speed, other models, tasks or lengths than the report's, and the engine's
prefill, which may attend to unquantized states where kvquant quantizes on write. Report: `{doc.get('run_id')}`,
command `{doc.get('command')}`.
"""


def sglang_text(config: dict) -> str:
    """What ``DEPLOY.md`` says of SGLang 0.5.23 for exported static fp8 scales (read from its wheel)."""
    if config["kv_cache_scheme"]["strategy"] != "tensor":
        return ("SGLang: not for these scales. SGLang 0.5.23 takes compressed-tensors KV scales per tensor only "
                "(`CompressedTensorsKVCacheMethod.is_supported_scheme`, "
                "srt/layers/quantization/compressed_tensors/compressed_tensors.py:1276-1285) and ignores a per-head "
                "scheme with a warning (:213-224), running at scale 1.0; calibrate per tensor for SGLang.\n")
    return ("SGLang 0.5.23 loads the same checkpoint scales (per tensor: "
            "srt/layers/quantization/compressed_tensors/compressed_tensors.py:1267-1285, "
            "srt/layers/quantization/kv_cache.py:51-83): `python -m sglang.launch_server --model-path MERGED "
            "--kv-cache-dtype fp8_e4m3`. It divides by the scale in the model's dtype before the e4m3 cast "
            "(srt/mem_cache/memory_pool.py:2926-2932) where vLLM divides in float32: the same codes for a float32 "
            "model, possibly a rounding apart for bf16/fp16 (kvquant measured vLLM's). SGLang's FlashAttention 3 "
            "backend also casts the query to e4m3 (srt/layers/attention/flashattention_backend.py:1426-1436), "
            "which kvquant does not measure.\n\n"
            "SGLang's `--quantization-param-path` JSON is not written: in 0.5.23 its scales (one per layer for "
            "keys and values alike) are set as plain floats on `attn.k_scale`/`attn.v_scale`, never on "
            "`k_scale_float`/`v_scale_float` (srt/models/llama.py:522-524), which the "
            "FlashInfer and Triton backends divide by when they store K/V "
            "(srt/layers/attention/flashinfer_backend.py:997-1000, triton_backend.py:1735-1743) while their "
            "attention reads `k_scale_float` (flashinfer_backend.py:1437, triton_backend.py:1835-1837), which only "
            "checkpoint scales set (kv_cache.py:82); FlashAttention 3 calls `.expand` on `layer.k_scale` "
            "(flashattention_backend.py:1434), which a float does not have. Use the checkpoint scales above.\n")


def export(report_dir: Path) -> Path:
    """Write ``DEPLOY.md`` for the report's chosen setting; :class:`KVQuantError` when there is none to deploy."""
    doc = load_report(report_dir)
    if doc["chosen"] is None:
        raise KVQuantError(f"{report_dir}: the decision is {str(doc['decision']).upper()}, with no setting chosen; "
                           "nothing to deploy")
    chosen = next((c for c in doc["candidates"] if c.get("name") == doc["chosen"]), None)
    if chosen is None:
        raise KVQuantError(f"{report_dir / 'results.json'}: the chosen setting {doc['chosen']!r} is not among its "
                           "candidates")
    found = native(chosen["settings"])
    if found is None:
        raise KVQuantError(f"research setting: no serving engine runs {doc['chosen']} "
                           f"({chosen['settings'].get('quantizer')}); {nearest_engine_format(doc, chosen)}")
    unshipped = unshippable_scales(chosen["settings"])
    if unshipped:
        raise KVQuantError(f"{doc['chosen']}: {unshipped}; the engine would run at 1.0, not at the scales the gate "
                           "measured, so there is nothing honest to deploy")
    files = {"DEPLOY.md": deploy_text(doc, chosen, *found)}
    shipped = checkpoint_scales(chosen["settings"])
    if shipped is not None:
        from safetensors.torch import save

        config, tensors = shipped
        files["kv_cache_scheme.json"] = json.dumps({"quantization_config": config}, indent=2)
        files["kv_scales.safetensors"] = save(tensors)
        files["DEPLOY.md"] += (
            "\nThe calibrated scales the gate measured are in `kv_scales.safetensors` (compressed-tensors names, "
            "float32) and `kv_cache_scheme.json` declares them: merge both into the checkpoint (config.json's "
            "`quantization_config`, a weights file) and vLLM loads them. The names assume the model's attention "
            "modules are `model.layers.N.self_attn` (Llama, Mistral, Qwen, Gemma).\n\n" + sglang_text(config))
    write_together(report_dir, files)
    return report_dir / "DEPLOY.md"


def deploy_beside(report_dir: Path) -> Path | None:
    """The runner's step after a report: ``DEPLOY.md`` when the decision chose an engine's own format, else None."""
    doc = load_report(report_dir)
    chosen = next((c for c in doc["candidates"] if c.get("name") == doc["chosen"]), None)
    return export(report_dir) if chosen is not None and native(chosen["settings"]) else None
