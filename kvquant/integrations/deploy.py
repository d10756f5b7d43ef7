"""A report's decision as what a serving engine is started with (``python -m kvquant.export REPORT_DIR``).

Reads the report (``REPORT_DIR/results.json``, or the document the runner has just written there), checked and
typed by :mod:`kvquant.integrations.deploy_read`; when the chosen setting is a serving engine's own format
(``kvquant/formats/vllm.py``, ``kvquant/formats/sglang.py``,
every token stored quantized, no rotation, sinks, window or eviction of kvquant's own) or one of llama.cpp's cache
types (``kvquant/formats/llamacpp.py``, one type for every layer: :mod:`kvquant.integrations.deploy_llamacpp`), writes
``REPORT_DIR/DEPLOY.md``: the engine's command-line flags and Python keyword arguments, what was measured (the
verdicts) and what was not. The runner writes it beside every report whose decision is engine-native.

A setting that quantizes nothing (fp16, or a per-layer map keeping every layer at fp16) is deployed as the
model-precision cache: no format flag, no scales. A decision no serving engine runs (KIVI int4 g32, int2,
eviction, ...) is one line and exit 2: "research setting", with the nearest engine format measured in the same
report and its verdict. So is a report directory that holds no report, and a report without a passing decision.
What is read, and from whom, is :mod:`kvquant.integrations.deploy_read`'s; every text taken from the report (names, the
command, the reason, the model path) is rendered inert in ``DEPLOY.md`` (:func:`code`, :func:`prose`).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import torch

from kvquant.integrations import deploy_llamacpp
from kvquant.integrations.deploy_llamacpp import CacheTypes
from kvquant.integrations.deploy_read import Report, CandidateRecord, checked_report, load_report, open_results
from kvquant.errors import KVQuantError, one_line, visible
from kvquant.fs import write_together
from kvquant.formats.quantizers import QUANTIZERS, TOKEN_OPTIONS, Serving

#: the files an export writes together, DEPLOY.md (which names the others) last
DEPLOY_FILES = ("kv_scales.safetensors", "kv_cache_scheme.json", "DEPLOY.md")
def code(text, limit: int = 300) -> str:
    """``text`` as a Markdown code span (literal: no heading, link or HTML), fenced by more backticks than any
    run inside it."""
    shown = visible(text, limit)
    fence = "`" * (max(map(len, re.findall("`+", shown)), default=0) + 1)
    return f"{fence} {shown} {fence}"


#: the characters that make Markdown mid-line: emphasis, code, links and images (a "(" or "!" needs a "["), HTML,
#: entities, table cells, attributes, math, and GitHub's bare links (``https://``, ``www.``, ``a@b.c``)
MARKUP = re.compile(r"[\\`*_{}\[\]<>#|~&^$:.@]")


def prose(text, limit: int = 2000) -> str:
    """``text`` as literal Markdown text on one line: every character of :data:`MARKUP` backslash-escaped (no
    emphasis, link, HTML, entity or table cell break)."""
    return MARKUP.sub(lambda m: "\\" + m.group(), visible(text, limit))


def serving_of(quantizer) -> Serving | None:
    """How an engine runs the format registered as ``quantizer``, as its own class says (``Quantizer.serving``; a
    subclass that does not say it again is a research format); None for any other name."""
    cls = QUANTIZERS.classes.get(quantizer) if isinstance(quantizer, str) else None
    return cls.__dict__.get("serving") if cls is not None else None


def takers_of_scales() -> str:
    """The engine formats that take static ``k_scale``/``v_scale``, as a refusal names them ("a and b")."""
    names = [name for name in QUANTIZERS.names() if (serving := serving_of(name)) is not None and
             serving.takes_scales]
    return " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"


#: kvquant's own options, which no engine has (the cache's token options, the quantizer's ``rotation`` and pre-RoPE
#: keys): a setting using any of them is a research setting
RESEARCH_OPTIONS = (*TOKEN_OPTIONS, "rotation", "pre_rope")

#: per-layer options an engine takes from the checkpoint (exported as scales), not from a flag
CHECKPOINT_OPTIONS = ("k_scale", "v_scale")


def skipped_layers(setting: CandidateRecord) -> list[int] | None:
    """The layers a per-layer setting keeps at model precision (fp16), [] when it has no per-layer settings, or
    None when its layers differ in a way no engine expresses (static scales differ per layer in a checkpoint)."""
    settings, skipped = setting.settings, []
    for layer, own in setting.layers.items():
        if own.get("quantizer") == "fp16":
            skipped.append(layer)
        elif own.get("quantizer", setting.quantizer) != setting.quantizer or any(
                own[k] != settings.get(k) for k in own if k not in ("quantizer", *CHECKPOINT_OPTIONS)):
            return None
    return sorted(skipped)


def native(setting: CandidateRecord) -> tuple[Serving, list[int]] | None:
    """(how the engine runs it, skipped layers) when a cache setting is an engine's own format, else None."""
    serving = serving_of(setting.quantizer)
    if serving is None:
        return None
    if any(setting.settings.get(k) for k in RESEARCH_OPTIONS):
        return None
    skipped = skipped_layers(setting)
    return None if skipped is None else (serving, skipped)


def llamacpp_research(setting: CandidateRecord) -> str | None:
    """Why llama.cpp does not run a ``llamacpp_*`` setting (kvquant's own options, layers apart), else None."""
    own = [k for k in RESEARCH_OPTIONS if setting.settings.get(k)]
    if own:
        return (f"it uses kvquant's own {', '.join(own)} (llama.cpp stores every token in the cache type, with no "
                "residual tokens, sinks, window, eviction or rotation of kvquant's)")
    if skipped_layers(setting) != []:
        return ("its layers differ (llama.cpp has one -ctk/-ctv for every layer and keeps none at full precision: a "
                "per-layer map is kvquant's)")
    return None


def deployable(setting: CandidateRecord) -> bool:
    """Whether a setting is an engine format export writes ``DEPLOY.md`` for (a vLLM/SGLang format or a llama.cpp
    cache type)."""
    if deploy_llamacpp.is_llamacpp(setting):
        return llamacpp_research(setting) is None
    return native(setting) is not None


def kernel_needs(setting: CandidateRecord) -> str:
    """What a kernel would store to run a research setting as it was measured, as a refusal says it ("a kernel would
    store keys as ...; "): its format's class says its codes (:meth:`Quantizer.kernel_layout`), and kvquant's own
    options add the tokens kept in the model's dtype, pre-RoPE keys and rotation. "" where the class does not say
    it, the layers differ or tokens are evicted."""
    settings = setting.settings
    cls = QUANTIZERS.classes.get(setting.quantizer)
    layout = cls.kernel_layout(settings) if cls is not None else None
    evicts = (k for k in TOKEN_OPTIONS if k not in ("residual_length", "sink_tokens"))
    if layout is None or setting.layers or any(settings.get(k) for k in evicts):
        return ""
    parts = [layout]
    if settings.get("sink_tokens"):
        parts.append(f"the first {settings['sink_tokens']} tokens in the model's dtype, groups counted from the token "
                     "after them (layers with a sliding window keep none)")
    if settings.get("residual_length"):
        parts.append(f"the newest {settings['residual_length']} tokens in the model's dtype too, key groups formed "
                     "only from tokens older than them")
    if settings.get("pre_rope"):
        parts.append("keys stored before RoPE, which is applied to them as they are read")
    if settings.get("rotation"):
        block = settings.get("rotation_block", settings.get("key_rotation_block"))
        parts.append(f"keys and values rotated along head_dim ({settings['rotation']}"
                     f"{f' blocks of {block}' if block else ''}, seed {settings.get('rotation_seed', 0)}: kvquant's "
                     "random signs) before they are quantized, and back as they are read")
    return (f"a kernel would store {'; '.join(parts)}; {setting.bits_per_element:.2f} bits/element all-in as the "
            "report measured them; ")


def nearest_engine_format(report: Report, chosen: CandidateRecord) -> str:
    """The engine format measured in this report nearest the chosen setting's bits, with its verdict."""
    measured = [c for c in report.candidates if deployable(c)]
    if not measured:
        return "no engine format was measured in this report (configs/smollm2-engines.yaml measures them)"
    near = min(measured, key=lambda c: abs(c.bits_per_element - chosen.bits_per_element))
    return (f"the nearest engine format measured here is {near.quantizer} ({visible(near.name)}, "
            f"{near.bits_per_element:.2f} bits/element): {near.verdict.upper()}")


def checkpoint_scales(setting: CandidateRecord) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """For static fp8 with per-layer scales (calibrated): the compressed-tensors ``quantization_config`` that
    declares them (``kv_cache_scheme``: 8-bit float, symmetric, static, per ``tensor`` or ``attn_head``) and the
    tensors as compressed-tensors names them (``model.layers.N.self_attn.k_scale``: ``[1]`` per tensor,
    ``[kv_heads, 1, 1]`` per head), float32 as measured; None when there are none to ship."""
    settings = setting.settings
    serving = serving_of(setting.quantizer)
    if serving is None or not serving.layer_scales or not setting.layers:
        return None
    tensors, per_head = {}, False
    for layer, own in setting.layers.items():
        if own.get("quantizer") == "fp16":
            continue  # kept at full precision: a skipped layer, no scales
        for role in ("k_scale", "v_scale"):
            value = own.get(role, settings.get(role, 1.0))
            per_head = per_head or isinstance(value, list)
            scale = torch.tensor(value, dtype=torch.float32)
            tensors[f"model.layers.{layer}.self_attn.{role}"] = scale.reshape(-1, 1, 1) if scale.dim() else \
                scale.reshape(1)
    if len({t.shape for t in tensors.values()}) > 1:
        raise KVQuantError(f"the static scales mix shapes {sorted({tuple(t.shape) for t in tensors.values()})} "
                           "(one per tensor and one per KV head, or per-head lists of other lengths): one checkpoint "
                           "declares one strategy; rerun python -m kvquant.run")
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
              "strategy": "attn_head" if per_head else "tensor"}
    return {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
            "kv_cache_scheme": scheme}, tensors


def unshippable_scales(setting: CandidateRecord) -> str | None:
    """Why static scales that were measured (anything but 1.0, at the top or in any layer) cannot be exported, else
    None: kvquant writes them per layer (``layers``) for a format whose class says so (:attr:`Serving.layer_scales`:
    vllm_fp8), not one scale for all layers nor what a format's :attr:`Serving.unshipped_scales` says (nvfp4's
    global scales), and no other format takes any."""
    def any_measured(values: list) -> bool:
        return any(v not in (None, 1.0) for v in values)

    top = [setting.settings.get(k) for k in CHECKPOINT_OPTIONS]
    per_layer = [own.get(k) for own in setting.layers.values() for k in CHECKPOINT_OPTIONS]
    serving = serving_of(setting.quantizer)
    if serving is not None and serving.layer_scales:
        return serving.unshipped_scales if any_measured(top) else None
    if not any_measured([*top, *per_layer]):
        return None
    if serving is not None and serving.unshipped_scales:
        return serving.unshipped_scales
    return (f"{setting.quantizer} takes no static k_scale/v_scale (only {takers_of_scales()} do), yet the setting "
            "records some other than 1.0")


def engine_own_skips(serving: Serving, skipped: list[int], layers: int) -> str:
    """The boundary layers the engine keeps at model precision on its own (:attr:`Serving.boundary_layers`: vLLM's
    TurboQuant) that the measured setting stored in the format (what the engine runs then stores more there than was
    measured); ``layers``: the model's."""
    ends = serving.boundary_layers
    if not ends or layers < 2 * ends:
        return ""
    own = sorted({*range(ends), *range(layers - ends, layers)} - set(skipped))
    return (f" kvquant measured layers {', '.join(map(str, own))} in the format, which vLLM keeps at model precision "
            "on its own: what it runs stores more than was measured there, and is no less accurate for it."
            if own else "")


def verdict_table(chosen: CandidateRecord) -> str:
    """The chosen setting's gated metrics as a Markdown table (names rendered inert)."""
    rows = "\n".join(f"| {prose(m.name, 200)} | {m.value:.4g} (baseline {m.baseline:.4g}) | "
                     f"{prose(m.verdict, 40)} |" for m in chosen.metrics if m.gated)
    return f"| metric | value | verdict |\n|---|---:|---|\n{rows}"


def provenance(report: Report) -> str:
    """Which run decided (its id and command, as code spans)."""
    return f"Report: {code(report.run_id, 40)}, command {code(report.command, 2000)}."


def context_text(report: Report) -> str:
    """What the run showed of long contexts for the chosen setting (its length verdict), as a paragraph that bounds
    the context to serve; empty where it measured none."""
    if report.lengths is None:
        return ""
    safe, fails = report.lengths
    shown = f"shown safe up to {safe:,} tokens of context" if safe else "shown safe at no context length measured"
    shown += f" and shown to fail from {fails:,}" if fails else ""
    bound = (f" Serve at most {safe:,} tokens per sequence (vLLM `--max-model-len {safe}`, SGLang "
             f"`--context-length {safe}`, llama.cpp `-c {safe}`): longer contexts were not shown safe.") if safe else ""
    return f"\n\n**Context**: this setting was {shown} (the report's length verdict).{bound}"


def measured_on(report: Report) -> str:
    """The model the report measured, as a code span."""
    return code(report.model, 500)


#: each engine's Python call that starts it with a format's flag and the layers it keeps at model precision
PYTHON_CALLS = {
    "vLLM": lambda flag, skipped: (f"LLM(model=..., kv_cache_dtype={flag!r}" + (
        f", kv_cache_dtype_skip_layers={[str(i) for i in skipped]!r}" if skipped else "") + ")"),
    "SGLang": lambda flag, skipped: f"sglang.Engine(model_path=..., kv_cache_dtype={flag!r})",
}


def deploy_text(report: Report, chosen: CandidateRecord, found: tuple[Serving, list[int]], layers: int) -> str:
    """``DEPLOY.md``: what to run, what was measured, the verdicts, what was not measured."""
    serving, skipped = found
    engine, flag, needs = serving.engine, serving.flag, serving.needs
    cli = f"--kv-cache-dtype {flag}" + (f" --kv-cache-dtype-skip-layers {' '.join(map(str, skipped))}"
                                         if skipped else "")
    python = PYTHON_CALLS[engine](flag, skipped)
    return f"""# Deploying {code(chosen.name, 200)} ({engine} `--kv-cache-dtype {flag}`)

Run {engine} with {code(cli, 100_000)} (Python: {code(python, 100_000)}). Needs: {needs}.\
{engine_own_skips(serving, skipped, layers)}
kvquant measured this format ({code(chosen.quantizer, 100)}, {chosen.bits_per_element:.3f} bits per
element as the engine stores it) on {measured_on(report)} against the fp16 baseline through the same cache, with
attention reading the stored K/V, and the gate decided **PASS**: {prose(report.reason)}{context_text(report)}

{verdict_table(chosen)}

Not measured: the engine itself (kvquant emulates its numerics; see docs/quantizers.md for where an engine's GPU
arithmetic may differ by an ulp), speed, other models, tasks or lengths than the report's, and the engine's
prefill, which may attend to unquantized states where kvquant quantizes on write. {provenance(report)}
"""


def llamacpp_text(report: Report, chosen: CandidateRecord, types: CacheTypes) -> str:
    """``DEPLOY.md`` for a llama.cpp cache type: llama.cpp's flags, Ollama's line (or why none), llama-cpp-python's
    keyword arguments, what was measured, the verdicts, what was not measured."""
    return f"""# Deploying {code(chosen.name, 200)} (llama.cpp `-ctk {types.key} -ctv {types.value}`)

{deploy_llamacpp.run_text(types)}

kvquant measured this cache ({code(chosen.quantizer, 100)}, {chosen.bits_per_element:.3f} bits per
element as llama.cpp stores it) on {measured_on(report)} against the fp16 baseline through the same cache, emulating
llama.cpp's arithmetic (ggml's blocks and rounding, the rotation as above, the query converted to K's dot-product type),
and the gate decided **PASS**: {prose(report.reason)}{context_text(report)}

{verdict_table(chosen)}

Not measured: llama.cpp itself in this run (kvquant emulates it; the order of its float32 sums is not
reproduced).{deploy_llamacpp.cpu_text(types)} Nor speed, other models, tasks or lengths than the report's, nor the
GGUF's own weights where the report measured another file of the model (llama.cpp runs the GGUF). {provenance(report)}
"""


def keeps_model_precision(setting: CandidateRecord, layers: int) -> bool:
    """Whether a setting quantizes nothing: fp16 for every one of the model's ``layers`` (its own, or a layer's
    own), with none of kvquant's own cache options (:data:`RESEARCH_OPTIONS`)."""
    settings = setting.settings
    if any(settings.get(k) for k in RESEARCH_OPTIONS):
        return False
    return all(own.get("quantizer", setting.quantizer) == "fp16" and not any(own.get(k) for k in RESEARCH_OPTIONS)
               for own in (setting.layers.get(i, settings) for i in range(layers)))


def keep_text(report: Report, chosen: CandidateRecord, layers: int) -> str:
    """``DEPLOY.md`` for a setting that quantizes nothing: keep the engine's default, model-precision cache."""
    kept = f"a per-layer setting that keeps all {layers} layers at fp16" if chosen.layers else "fp16"
    return f"""# Deploying {code(chosen.name, 200)}: keep the model-precision KV cache

The gate decided **PASS** for a setting that quantizes nothing ({kept}): every layer's keys and values stay at the
model's precision, so there is no KV-cache format to turn on and no scales to ship. Start the engine with its
default cache: vLLM and SGLang without `--kv-cache-dtype` (or with `--kv-cache-dtype auto`), which stores the cache
in the model's dtype (fp16 or bf16). llama.cpp (`llama-server`, `llama-cli`), Ollama and llama-cpp-python keep
their default f16 cache (`-ctk f16 -ctv f16`, no flag needed; `OLLAMA_KV_CACHE_TYPE` unset or `f16`; `type_k` and
`type_v` unset): the model's precision for an fp16 model, while for a bf16 or float32 model llama.cpp rounds K and V
to f16, which `llamacpp_f16` measures and this setting did not. Measured on {measured_on(report)}:
{prose(report.reason)}

{verdict_table(chosen)}

Not measured: the engine itself, speed, other models, tasks or lengths than the report's. {provenance(report)}
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


def deploy_files(report_dir: Path, report: Report) -> dict[str, str | bytes]:
    """The files that deploy a checked report's decision (:func:`kvquant.integrations.deploy_read.checked_report`),
    or one line saying why there are none."""
    chosen = report.chosen
    if chosen is None:
        raise KVQuantError(f"{report_dir}: the decision is {report.decision.upper()}, with no setting chosen; "
                           "nothing to deploy")
    name, layers = visible(chosen.name), report.layers
    if keeps_model_precision(chosen, layers):
        return {"DEPLOY.md": keep_text(report, chosen, layers)}
    if deploy_llamacpp.is_llamacpp(chosen):
        why = llamacpp_research(chosen)
        if why:
            raise KVQuantError(f"research setting: llama.cpp does not run {name} ({visible(chosen.quantizer)}): "
                               f"{why}; {nearest_engine_format(report, chosen)}")
        return {"DEPLOY.md": llamacpp_text(report, chosen, deploy_llamacpp.read(chosen, report.path))}
    found = native(chosen)
    if found is None:
        raise KVQuantError(f"research setting: no serving engine runs {name} ({visible(chosen.quantizer)}); "
                           f"{kernel_needs(chosen)}{nearest_engine_format(report, chosen)}")
    unshipped = unshippable_scales(chosen)
    if unshipped:
        raise KVQuantError(f"{name}: {unshipped}; the engine would run at 1.0, not at the scales the gate "
                           "measured, so there is nothing honest to deploy")
    text, files = deploy_text(report, chosen, found, layers), {}
    shipped = checkpoint_scales(chosen)
    if shipped is not None and shipped[1]:
        from safetensors.torch import save

        config, tensors = shipped
        files["kv_scales.safetensors"] = save(tensors)
        files["kv_cache_scheme.json"] = json.dumps({"quantization_config": config}, indent=2)
        text += (
            "\nThe calibrated scales the gate measured are in `kv_scales.safetensors` (compressed-tensors names, "
            "float32) and `kv_cache_scheme.json` declares them: merge both into the checkpoint (config.json's "
            "`quantization_config`, a weights file) and vLLM loads them. The names assume the model's attention "
            "modules are `model.layers.N.self_attn` (Llama, Mistral, Qwen, Gemma).\n\n" + sglang_text(config))
    return {**files, "DEPLOY.md": text}


def write_set(report_dir: Path, files: dict[str, str | bytes]) -> None:
    """Put ``files`` (of :data:`DEPLOY_FILES`) in ``report_dir`` together and remove an earlier export's others:
    every target is checked first (a file or a symlink, which is replaced, never followed; a directory or anything
    else there is refused before anything is written), then all are staged under temporary names and renamed."""
    for name in DEPLOY_FILES:
        target = report_dir / name
        try:
            mode = os.lstat(target).st_mode
        except FileNotFoundError:
            continue
        except OSError as err:
            raise KVQuantError(f"cannot check {target} ({err.strerror})") from None
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise KVQuantError(f"{target} is {kind}; move it away: export writes {', '.join(DEPLOY_FILES)} there "
                               "together, and nothing was written")
    try:
        write_together(report_dir, files)
        for name in set(DEPLOY_FILES) - set(files):  # an earlier export's, which this one does not describe
            (report_dir / name).unlink(missing_ok=True)
    except OSError as err:
        raise KVQuantError(f"cannot write DEPLOY.md in {report_dir} ({err.strerror or err})") from None


def export(report_dir: Path, trust_unsigned: bool = False) -> Path:
    """Write ``DEPLOY.md`` (and the checkpoint scales it names) for the report's chosen setting; one
    :class:`KVQuantError` line, with nothing written, when there is nothing to deploy or the report is not this
    user's signed, well-formed report (``trust_unsigned``: a signature is not required)."""
    write_set(report_dir, deploy_files(report_dir, load_report(report_dir, trust_unsigned)))
    return report_dir / "DEPLOY.md"


def deploy_beside(report_dir: Path, document: dict) -> tuple[Path | None, str | None]:
    """The runner's step after writing a report: (``DEPLOY.md``, None) when its decision chose a setting that
    deploys, (None, why not: one line) when it chose one that does not, (None, None) when it chose none.
    ``document``: what the run has just written to ``report_dir/results.json``, as a reader parses it
    (:func:`kvquant.runner.report.write`), checked as export checks it; the directory and the file are checked as
    export checks them (whose, how large), and the file is not read back."""
    try:
        os.close(open_results(report_dir))
        report = checked_report(document, report_dir / "results.json")
        if report.chosen is None:
            return None, None
        write_set(report_dir, deploy_files(report_dir, report))
    except KVQuantError as err:
        return None, one_line(err)
    return report_dir / "DEPLOY.md", None
