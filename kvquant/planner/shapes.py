"""Model shapes and the KV-bytes arithmetic on them: what a decoder's cache depends on (layers and their
attention windows, KV heads, head_dim), read from a transformers config or a table of known architectures, each
size within :data:`SIZE_BOUNDS`, and :class:`Planner`, the bytes for any batch and context from each layer's
storage rules (:mod:`kvquant.planner.cost`, read off kvquant's own cache code run on zeros or on meta tensors).
``python -m kvquant.plan`` is the command around it; the runner uses it to check candidates before a model loads.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvquant.cache import attention_layout
from kvquant.cache.build import spec_memory
from kvquant.cache.memory import summarize
from kvquant.yaml_reader import load_yaml
from kvquant.errors import InternalError, KVQuantError, check_int, is_python_int, one_line
from kvquant.planner.cost import MEMORY_KEYS, layer_costs, memory_after_write
from kvquant.formats.quantizers import available_quantizers

FULL_PRECISION = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
MAX_CONTEXT = 1 << 30
#: The largest size a model shape may state, checked before anything is built from it. Real
#: models sit far inside: Llama-3.1-405B has 126 layers, 128 heads, hidden 16,384, MLP 53,248; the largest
#: vocabularies are about 262,144 (Gemma 3); head_dim is at most 256 (Gemma 2); sliding windows 128-262,144.
SIZE_BOUNDS = {"num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
               "head_dim": 4096, "hidden_size": 262_144, "intermediate_size": 1 << 20, "vocab_size": 1 << 21,
               "num_local_experts": 4096, "sliding_window": MAX_CONTEXT}
#: The largest --gpu-memory, --weights or --reserve: 1 PiB.
MAX_BYTES = 1 << 50
#: Answers are re-checked with a full simulation of the cache code (at their equivalent token count within the
#: first repeat of the bytes) when that count is at most this many tokens.
VERIFY_TOKENS = 1 << 16


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
    heads: int | None = None  # attention heads (None: as many as KV heads)

    @property
    def layers(self) -> int:
        return len(self.layout)


def _shape(name, layers, heads, kv_heads, head_dim, params, max_positions, window=None, pattern=None):
    layout = [window if i % (pattern or 1) == 0 else None for i in range(layers)]
    return ModelShape(name, layout, kv_heads, head_dim, params, max_positions, heads=heads)


#: Published architecture facts (layers, attention heads, KV heads, head_dim, parameters, trained context).
KNOWN_MODELS = {
    "llama-2-7b": _shape("llama-2-7b", 32, 32, 32, 128, 6.74e9, 4096),
    "llama-2-13b": _shape("llama-2-13b", 40, 40, 40, 128, 13.02e9, 4096),
    "llama-2-70b": _shape("llama-2-70b", 80, 64, 8, 128, 68.98e9, 4096),
    "llama-3.1-8b": _shape("llama-3.1-8b", 32, 32, 8, 128, 8.03e9, 131072),
    "llama-3.1-70b": _shape("llama-3.1-70b", 80, 64, 8, 128, 70.55e9, 131072),
    "mistral-7b": _shape("mistral-7b", 32, 32, 8, 128, 7.25e9, 32768),  # v0.2/v0.3: full attention
    "mistral-7b-v0.1": _shape("mistral-7b-v0.1", 32, 32, 8, 128, 7.24e9, 32768, window=4096),
    "qwen2.5-7b": _shape("qwen2.5-7b", 28, 28, 4, 128, 7.62e9, 131072),
    "qwen2.5-0.5b": _shape("qwen2.5-0.5b", 24, 14, 2, 64, 0.49e9, 32768),
    "qwen2.5-coder-0.5b": _shape("qwen2.5-coder-0.5b", 24, 14, 2, 64, 0.49e9, 32768),  # packaged: kvquant.packaged
    "gemma-2-9b": _shape("gemma-2-9b", 42, 16, 8, 256, 9.24e9, 8192, window=4096, pattern=2),  # sliding every other
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
    vocab = getattr(cfg, "vocab_size", None) or 0
    embed = vocab * hidden * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    return float(layers * (attn + mlp) + embed)


def shape_from_config(cfg, name: str) -> ModelShape:
    """Facts from a transformers config; missing ``num_key_value_heads`` means MHA, missing ``head_dim`` means
    hidden / heads."""
    text = cfg.get_text_config(decoder=True)
    check_sizes(lambda key: getattr(text, key, None), name)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    notes = [] if getattr(text, "num_key_value_heads", None) else ["num_key_value_heads missing: MHA assumed"]
    layout = attention_layout(cfg)
    for i, window in enumerate(layout):
        if window not in (None, "shared"):
            check_int(f"{name}: the sliding window of layer {i}", window, minimum=1, maximum=MAX_CONTEXT)
    trained = getattr(text, "max_position_embeddings", None)  # only for a note: ignored unless a positive integer
    trained = trained if is_python_int(trained) and trained > 0 else None
    return ModelShape(name, layout, kv_heads, head_dim, _count_params(text), trained, notes, heads)


def check_sizes(get, name: str, complete: bool = True) -> None:
    """The sizes a config states (``get(key)``: the value or None), before anything is built from them: each an
    integer from 1 to its :data:`SIZE_BOUNDS` maximum; KV heads an equal share of the attention heads; without
    head_dim, a hidden size the heads split evenly; ``complete``: layers, heads and hidden size present."""
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size") if get(k) is None]
    if missing and complete:  # transformers would fill in its defaults: a plan for some other model
        raise KVQuantError(f"{name}: the config lacks {', '.join(missing)}")
    for key, most in SIZE_BOUNDS.items():
        if get(key) is not None:
            check_int(f"{name}: {key}", get(key), minimum=1, maximum=most)
    heads, kv_heads, hidden = get("num_attention_heads"), get("num_key_value_heads"), get("hidden_size")
    if heads is None:
        return
    if kv_heads is not None and heads % kv_heads:
        raise KVQuantError(f"{name}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads} "
                           "(each KV head serves an equal group of attention heads)")
    if get("head_dim") is None and hidden is not None and hidden % heads:
        raise KVQuantError(f"{name}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}, and "
                           "the config states no head_dim")


def resolve_model(name: str) -> ModelShape:
    """A known architecture name, a directory or ``config.json``, or a hub id (needs network)."""
    key = name.lower().removeprefix("meta-llama/").removeprefix("mistralai/").removeprefix("qwen/")
    key = re.sub(r"[-_]?(hf|instruct|chat)$", "", key)
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]
    from transformers import AutoConfig, PretrainedConfig

    path = Path(name)
    try:
        path.exists()
    except OSError as err:  # a name too long for the file system (ENAMETOOLONG), ...
        raise KVQuantError(f"--model {name[:60]!r}{'...' if len(name) > 60 else ''} ({len(name):,} characters) is "
                           f"not a path this system can read ({err.strerror}): name a known architecture, a "
                           "directory or config.json, or a hub id") from None
    if not path.exists() and "/" not in name:
        raise KVQuantError(f"unknown model {name!r}: not a known architecture ({', '.join(KNOWN_MODELS)}), "
                           "a local directory or config.json, or a hub id (org/name)")
    try:
        file = path / "config.json" if path.is_dir() else path
        if file.is_file():  # its sizes checked before transformers builds anything from them
            data = json.loads(file.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise ValueError(f"config.json holds a {type(data).__name__}, not a mapping")
            text = data.get("text_config") or data
            # a directory's config may leave sizes to transformers' defaults (e.g. Gemma 3's text_config)
            check_sizes(text.get if isinstance(text, dict) else data.get, name, complete=path.is_file())
        if path.is_file():
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
        valid = ", ".join(dict.fromkeys([*FULL_PRECISION, *available_quantizers()]))  # fp16 is both: named once
        raise KVQuantError(f"unknown cache setting {name!r}; use one of {valid}")
    return {"quantizer": name, **options}


def _number(text: str):
    """An option's value from ``key=value``: true/false (any case) as a bool, else an int, a float or the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
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
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not size <= MAX_BYTES:  # inf (a number of hundreds of digits) too
        raise KVQuantError(f"{flag}: {text!r} is over the largest size the planner takes, {MAX_BYTES:,} B (1 PiB)")
    return int(size)


def human(nbytes: float) -> str:
    return f"{nbytes:,.0f} B ({nbytes / 2**30:,.2f} GiB = {nbytes / 1e9:,.2f} GB)"


def tensor_parallel(shape: ModelShape, ranks: int) -> ModelShape:
    """The shape one of ``ranks`` tensor-parallel GPUs holds, as vLLM splits attention: ``ranks`` must divide the
    attention heads (vLLM's ``verify_with_parallel_config``); each rank keeps ``kv_heads / ranks`` KV heads, or one
    head replicated ``ranks / kv_heads`` times when there are fewer KV heads than ranks (``QKVParallelLinear``: one
    count must divide the other)."""
    check_int("--tensor-parallel", ranks, minimum=1)
    heads, kv_heads = shape.heads or shape.kv_heads, shape.kv_heads
    if heads % ranks:
        raise KVQuantError(f"--tensor-parallel {ranks} does not divide the {heads} attention heads of {shape.name} "
                           f"(vLLM's rule: every GPU holds an equal share); use one of {_splits(heads, kv_heads)}")
    if kv_heads % ranks and ranks % kv_heads:
        raise KVQuantError(f"--tensor-parallel {ranks} does not split {kv_heads} KV heads: one must divide the "
                           f"other (vLLM's rule); use one of {_splits(heads, kv_heads)}")
    if ranks == 1:
        return shape
    return replace(shape, kv_heads=max(kv_heads // ranks, 1), params=shape.params / ranks)


def _splits(heads: int, kv_heads: int) -> str:
    """The tensor-parallel sizes vLLM accepts for these heads."""
    return ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0))


class Planner:
    """KV bytes of one model and one cache setting at any batch and context, in constant time: each layer's
    storage rules (:class:`kvquant.planner.cost.LayerCost`) read off a short write through kvquant's own cache code,
    and answers re-checked against a full simulation of that code (:meth:`verify`)."""

    def __init__(self, shape: ModelShape, settings: dict, dtype: torch.dtype = torch.float16,
                 max_kinds: int | None = None):
        self.shape, self.settings, self.dtype = shape, settings, dtype
        # bad options (e.g. a group that does not fit head_dim) are rejected here
        self.layers = layer_costs(shape.layout, settings, shape.kv_heads, shape.head_dim, dtype, max_kinds)
        if not self.layers:
            raise KVQuantError(f"{shape.name}: no layer stores a KV cache (every layer reuses another's)")
        self.kinds = Counter(self.layers.values())  # LayerCost -> how many layers follow it
        self.layer_kinds = len({id(cost) for cost in self.layers.values()})  # one LayerCost per kind of layer
        self.steady = max(cost.steady for cost in self.kinds)  # from here the bytes repeat every `period` tokens
        self.period = math.lcm(*(cost.block for cost in self.kinds))

    def _totals(self, context: int) -> dict[str, int]:
        """The layers' summed ``memory()`` for one row after ``context`` tokens."""
        out = dict.fromkeys(MEMORY_KEYS, 0)
        for cost, count in self.kinds.items():
            for key, nbytes in cost.memory(context).items():
                out[key] += count * nbytes
        return out

    def memory(self, batch: int, context: int) -> dict:
        """``simulate_memory``'s report: ``memory_report()`` of the cache after ``context`` tokens, ``batch`` rows."""
        per_kind = {cost: cost.memory(context) for cost in self.kinds}
        return summarize({i: {key: nbytes * batch for key, nbytes in per_kind[cost].items()}
                          for i, cost in self.layers.items()}, context)

    def kv_bytes(self, batch: int, context: int) -> int:
        if context <= 0 or batch <= 0:
            return 0
        totals = self._totals(context)
        return batch * (totals["payload_bytes"] + totals["scale_bytes"] + totals["full_precision_bytes"])

    def verify(self, context: int) -> None:
        """The arithmetic against kvquant's cache code, run in full (:func:`kvquant.planner.cost.memory_after_write`,
        one write per kind of layer): at ``context`` tokens, or past :attr:`steady` at the same place in the bytes'
        repeat (where the bytes differ from ``context``'s by whole repeats); skipped when that is over
        :data:`VERIFY_TOKENS`. A difference is a kvquant bug (exit 3), never an answer. ``python -m kvquant.plan``
        checks each setting's final answer so."""
        tokens = context if context < self.steady else self.steady + (context - self.steady) % self.period
        if tokens > VERIFY_TOKENS or tokens <= 0:
            return
        real = memory_after_write(self.shape.layout, self.settings, self.shape.kv_heads, self.shape.head_dim,
                                  self.dtype, tokens)
        for i, cost in self.layers.items():
            if cost.memory(tokens) != real[i]:
                raise InternalError(f"the planner's arithmetic gives {cost.memory(tokens)} for layer {i} at {tokens} "
                                    f"tokens, the cache code {real[i]}; please report this")

    def max_batch(self, context: int, available: int) -> int:
        """Every stored tensor has a batch dimension, so bytes are linear in the batch."""
        per_sequence = self.kv_bytes(1, context)
        return available // per_sequence if per_sequence else 0

    def max_context(self, batch: int, available: int) -> int:
        """Longest context whose cache fits ``available`` bytes: doubling, then bisection (the bytes dip a little
        whenever a unit is quantized, so this finds a context that fits with the next one not fitting)."""
        if self.kv_bytes(batch, 1) > available:
            return 0
        lo, hi = 1, 2
        while hi < MAX_CONTEXT and self.kv_bytes(batch, hi) <= available:
            lo, hi = hi, hi * 2
        if hi >= MAX_CONTEXT and self.kv_bytes(batch, MAX_CONTEXT) <= available:
            lo = hi = MAX_CONTEXT  # sliding-window-only models stop growing
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.kv_bytes(batch, mid) <= available else (lo, mid)
        return lo


def check_candidate(candidate, shape: ModelShape, key: str) -> None:
    """The candidate's quantizer and options on the model's shapes, through kvquant's own cache code (on meta
    tensors: no data, no compute), so a bad name, type, range, a group that does not fit head_dim or sinks beyond the
    model's trained context (as make_cache bounds them) fail now."""
    if "quantizer" in candidate.options:
        raise KVQuantError(f"{key}.options: 'quantizer' is not an option; set {key}.quantizer")
    try:
        spec_memory(candidate.spec, shape, tokens=1, dtype=torch.float16, context=shape.max_positions)
    except KVQuantError as err:
        raise KVQuantError(f"{key}: {one_line(err)}") from None
