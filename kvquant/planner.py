"""Model shapes and the KV-bytes arithmetic on them: what a decoder's cache depends on (layers and their
attention windows, KV heads, head_dim), read from a transformers config or a table of known architectures, and
:class:`Planner`, which runs kvquant's own cache code on meta tensors (shapes, no data) for any batch and context.
``python -m kvquant.plan`` is the command around it; the runner uses it to check candidates before a model loads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .cache import attention_layout, simulate_memory
from .config import load_yaml
from .errors import KVQuantError, check_int, one_line
from .quantizers import available_quantizers

FULL_PRECISION = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MAX_CONTEXT = 1 << 30
@dataclass(frozen=True)
class ModelShape:
    """What the KV cache of a decoder depends on; ``layout`` as :func:`kvquant.cache.attention_layout`."""

    name: str
    layout: list
    kv_heads: int
    head_dim: int
    params: float  # for the weights estimate
    max_positions: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def layers(self) -> int:
        return len(self.layout)


def _known(name, layers, kv_heads, head_dim, params, max_positions, window=None, pattern=None):
    layout = [window if i % (pattern or 1) == 0 else None for i in range(layers)]
    return ModelShape(name, layout, kv_heads, head_dim, params, max_positions)


#: Published architecture facts (layers, KV heads, head_dim, parameters, trained context).
KNOWN_MODELS = {
    "llama-2-7b": _known("llama-2-7b", 32, 32, 128, 6.74e9, 4096),
    "llama-2-13b": _known("llama-2-13b", 40, 40, 128, 13.02e9, 4096),
    "llama-2-70b": _known("llama-2-70b", 80, 8, 128, 68.98e9, 4096),
    "llama-3.1-8b": _known("llama-3.1-8b", 32, 8, 128, 8.03e9, 131072),
    "llama-3.1-70b": _known("llama-3.1-70b", 80, 8, 128, 70.55e9, 131072),
    "mistral-7b": _known("mistral-7b", 32, 8, 128, 7.25e9, 32768),  # v0.2/v0.3: full attention
    "mistral-7b-v0.1": _known("mistral-7b-v0.1", 32, 8, 128, 7.24e9, 32768, window=4096),
    "qwen2.5-7b": _known("qwen2.5-7b", 28, 4, 128, 7.62e9, 131072),
    "gemma-2-9b": _known("gemma-2-9b", 42, 8, 256, 9.24e9, 8192, window=4096, pattern=2),  # sliding every other layer
}


def _count_params(cfg) -> float:
    """Parameters of a decoder from its config (attention, gated MLP, embeddings); an estimate for the weights."""
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    experts = getattr(cfg, "num_local_experts", None) or 1
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * inter * experts
    embed = cfg.vocab_size * hidden * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    return float(layers * (attn + mlp) + embed)


def shape_from_config(cfg, name: str) -> ModelShape:
    """Facts from a transformers config; missing ``num_key_value_heads`` means MHA, missing ``head_dim`` means
    hidden / heads."""
    text = cfg.get_text_config(decoder=True)
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size") if getattr(text, k, None) is None]
    if missing:
        raise KVQuantError(f"{name}: the config lacks {', '.join(missing)}")
    for k in ("num_hidden_layers", "num_attention_heads", "hidden_size", "num_key_value_heads", "head_dim"):
        value = getattr(text, k, None)
        if value is not None:
            check_int(f"{name}: {k}", value, minimum=1)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    notes = [] if getattr(text, "num_key_value_heads", None) else ["num_key_value_heads missing: MHA assumed"]
    return ModelShape(name, attention_layout(cfg), kv_heads, head_dim, _count_params(text),
                      getattr(text, "max_position_embeddings", None), notes)


def resolve_model(name: str) -> ModelShape:
    """A known architecture name, a directory or ``config.json``, or a hub id (needs network)."""
    key = name.lower().removeprefix("meta-llama/").removeprefix("mistralai/").removeprefix("qwen/")
    key = re.sub(r"[-_]?(hf|instruct|chat)$", "", key)
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]
    from transformers import AutoConfig, PretrainedConfig

    path = Path(name)
    if not path.exists() and "/" not in name:
        raise KVQuantError(f"unknown model {name!r}: not a known architecture ({', '.join(KNOWN_MODELS)}), "
                           "a local directory or config.json, or a hub id (org/name)")
    try:
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise ValueError(f"config.json holds a {type(data).__name__}, not a mapping")
            text = data.get("text_config") or data
            missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size") if k not in text]
            if missing:  # transformers would fill in its defaults: a plan for some other model
                raise KVQuantError(f"{name}: the config lacks {', '.join(missing)}")
            model_type = data.get("model_type")
            from transformers import CONFIG_MAPPING

            cfg = CONFIG_MAPPING[model_type].from_dict(data) if model_type in CONFIG_MAPPING else \
                PretrainedConfig.from_dict(data)
        else:
            cfg = AutoConfig.from_pretrained(name, trust_remote_code=False)
    except KVQuantError:
        raise
    except Exception as err:  # transformers and json raise many types for a config they cannot read
        known = ", ".join(KNOWN_MODELS)
        raise KVQuantError(f"unknown model {name!r}: not a known architecture ({known}), and no config could be "
                           f"read ({type(err).__name__}: {one_line(err)[:200]})") from None
    return shape_from_config(cfg, name)


def parse_setting(text: str) -> dict:
    """``int4`` or ``int4:group_size=64,residual_length=0`` -> make_cache settings; ``fp16``/``bf16``/``fp32``;
    or a YAML/JSON mapping of make_cache arguments, per-layer settings included:
    ``{quantizer: int4, group_size: 32, layers: {0-3: {quantizer: int8}}}``."""
    if text.strip().startswith("{"):
        settings = load_yaml(text, f"cache setting {text!r}", "not a YAML mapping")
        if not isinstance(settings, dict) or settings.get("quantizer") not in available_quantizers():
            raise KVQuantError(f"cache setting {text!r}: a mapping needs quantizer: one of "
                               f"{', '.join(available_quantizers())}")
        return settings
    name, _, opts = text.partition(":")
    options = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise KVQuantError(f"cache setting {text!r}: options are key=value, got {item!r}")
        if key.strip() in options:
            raise KVQuantError(f"cache setting {text!r}: {key.strip()} is set twice")
        options[key.strip()] = _number(value.strip())
    if name in FULL_PRECISION:
        if options:
            raise KVQuantError(f"cache setting {text!r}: {name} takes no options")
        return {"quantizer": "fp16"}
    if name not in available_quantizers():
        valid = ", ".join([*FULL_PRECISION, *available_quantizers()])
        raise KVQuantError(f"unknown cache setting {name!r}; use one of {valid}")
    return {"quantizer": name, **options}


def _number(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text: str, flag: str = "size") -> int:
    """``80GB`` (decimal), ``80GiB`` (binary) or a plain byte count (never negative)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise KVQuantError(f"{flag}: cannot read {text!r} as a size; write e.g. 80GB, 80GiB or 85899345920")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def human(nbytes: float) -> str:
    return f"{nbytes:,.0f} B ({nbytes / 2**30:,.2f} GiB = {nbytes / 1e9:,.2f} GB)"


def tensor_parallel(shape: ModelShape, ranks: int) -> ModelShape:
    """The shape one of ``ranks`` tensor-parallel GPUs holds, as vLLM splits attention: each rank keeps
    ``kv_heads / ranks`` KV heads, or one head replicated ``ranks / kv_heads`` times when there are fewer KV heads
    than ranks (vLLM needs one count to divide the other)."""
    check_int("--tensor-parallel", ranks, minimum=1)
    if shape.kv_heads % ranks and ranks % shape.kv_heads:
        raise KVQuantError(f"--tensor-parallel {ranks} does not split {shape.kv_heads} KV heads: one must divide the "
                           f"other (vLLM's rule), e.g. {', '.join(map(str, _splits(shape.kv_heads)))}")
    if ranks == 1:
        return shape
    return replace(shape, kv_heads=max(shape.kv_heads // ranks, 1), params=shape.params / ranks)


def _splits(kv_heads: int) -> list[int]:
    return [n for n in (1, 2, 4, 8, 16, 32, 64) if kv_heads % n == 0 or n % kv_heads == 0]


class Planner:
    """KV bytes of one model and one cache setting at any batch and context."""

    def __init__(self, shape: ModelShape, settings: dict, dtype: torch.dtype = torch.float16):
        self.shape, self.settings, self.dtype = shape, settings, dtype
        simulate_memory(shape.layout, settings, batch=1, kv_heads=1, head_dim=shape.head_dim, tokens=1,
                        dtype=dtype)  # reject bad options (e.g. a group that does not fit head_dim) up front

    def memory(self, batch: int, context: int) -> dict:
        return simulate_memory(self.shape.layout, self.settings, batch=batch, kv_heads=self.shape.kv_heads,
                               head_dim=self.shape.head_dim, tokens=context, dtype=self.dtype)

    def kv_bytes(self, batch: int, context: int) -> int:
        return int(self.memory(batch, context)["total_bytes"]) if context > 0 and batch > 0 else 0

    def max_batch(self, context: int, available: int) -> int:
        """Every stored tensor has a batch dimension, so bytes are linear in the batch."""
        per_sequence = self.kv_bytes(1, context)
        return available // per_sequence if per_sequence else 0

    def max_context(self, batch: int, available: int) -> int:
        """Longest context whose cache fits ``available`` bytes (bytes never shrink as the context grows)."""
        if self.kv_bytes(batch, 1) > available:
            return 0
        lo, hi = 1, 2
        while hi < MAX_CONTEXT and self.kv_bytes(batch, hi) <= available:
            lo, hi = hi, hi * 2
        if hi >= MAX_CONTEXT and self.kv_bytes(batch, MAX_CONTEXT) <= available:
            return MAX_CONTEXT  # sliding-window-only models stop growing
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.kv_bytes(batch, mid) <= available else (lo, mid)
        return lo


def check_candidate(candidate, shape: ModelShape, key: str) -> None:
    """The candidate's quantizer and options on the model's shapes, through kvquant's own cache code (on meta
    tensors: no data, no compute), so a bad name, type, range or a group that does not fit head_dim fails now."""
    if "quantizer" in candidate.options:
        raise KVQuantError(f"{key}.options: 'quantizer' is not an option; set {key}.quantizer")
    try:
        simulate_memory(shape.layout, {"quantizer": candidate.quantizer, **candidate.options}, batch=1,
                        kv_heads=shape.kv_heads, head_dim=shape.head_dim, tokens=1)
    except KVQuantError as err:
        raise KVQuantError(f"{key}: {one_line(err)}") from None
