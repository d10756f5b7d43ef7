"""Building a :class:`~kvquant.cache.KVQuantCache` for a model: its attention layout, per-layer settings, the
cache options, and the memory a setting would take (the planner's simulation on shapes only)."""

from __future__ import annotations

import dataclasses
import re
import weakref

import torch
from transformers.cache_utils import DummyLayer, get_layer_types_and_kwargs
from transformers.configuration_utils import get_head_shapes

from kvquant.compat.rope import rotary_tables
from kvquant.compat.transformers import tensor_parallel_size
from kvquant.errors import KVQuantError, is_python_int
from kvquant.formats.quantizers import QUANTIZERS, Quantizer, check_tokens, get_quantizer
from kvquant.cache.cache import KVQuantCache
from kvquant.cache.fused import is_fused
from kvquant.cache.query import enable_query_conversion
from kvquant.cache.checks import describe_value
from kvquant.cache.layer import KVQuantLayer, check_importance
from kvquant.cache.memory import STORED_KEYS, summarize
from kvquant.cache.padding import Padding
from kvquant.cache.prerope import PreRope
from kvquant.cache.spec import CacheSpec, check_not_options

SLIDING_TYPES = ("sliding_attention", "chunked_attention")


def attention_layout(model_or_config) -> list[int | None | str]:
    """Per decoder layer: ``None`` for full attention, the window for sliding-window attention, ``"shared"`` for a
    layer that reuses another layer's KV (it stores nothing). Errors name layers kvquant cannot cache."""
    if isinstance(model_or_config, type):
        raise KVQuantError(f"model_or_config must be a transformers model or config instance, got the class "
                           f"{model_or_config.__name__} (load one, e.g. with from_pretrained)")
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "get_text_config"):
        raise KVQuantError(f"model_or_config must be a transformers model or config instance, got "
                           f"{describe_value(model_or_config)}")
    text_config = config.get_text_config(decoder=True)
    if getattr(text_config, "is_encoder_decoder", False):
        raise KVQuantError("kvquant quantizes decoder-only self-attention caches; this model is encoder-decoder")
    try:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    except (AttributeError, TypeError) as err:
        raise KVQuantError(f"cannot read the attention layers of {type(config).__name__}: {err}") from err
    layout = []
    for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        if kind == "full_attention":
            layout.append(None)
        elif kind in SLIDING_TYPES:
            layout.append(kwargs["sliding_window"])
        elif kind == "dummy":
            layout.append("shared")
        else:
            raise KVQuantError(
                f"layer {i} is {kind!r}, which keeps no attention KV cache kvquant can quantize "
                f"(supported: full_attention, {', '.join(SLIDING_TYPES)})"
            )
    if all(w == "shared" for w in layout):
        raise KVQuantError(f"{type(config).__name__} has no attention layers with a KV cache to quantize")
    return layout


def head_dim_of(model_or_config) -> int | None:
    """The attention head dimension of a model or config (``head_dim``, else hidden_size / heads); None where the
    layers differ in it (transformers' per-layer config, e.g. Gemma 4: make_cache checks each layer's own)."""
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config(decoder=True)
    if "head_dim" in (getattr(text, "per_layer_attributes", None) or ()):
        return None
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None and getattr(text, "hidden_size", None) and getattr(text, "num_attention_heads", None):
        head_dim = text.hidden_size // text.num_attention_heads
    return head_dim


def context_of(model_or_config) -> int | None:
    """The positions a model or config was trained for (``max_position_embeddings``), None where it gives none."""
    config = getattr(model_or_config, "config", model_or_config)
    positions = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    return positions if is_python_int(positions) and positions > 0 else None


#: a layer's ``(KV heads, head_dim)`` for keys and for values; None where not known
Shapes = tuple[tuple[int, int] | None, tuple[int, int] | None]


def _projects(attention: torch.nn.Module, name: str, shape: tuple[int, int]) -> bool:
    """The attention module's projection ``name`` (``k_proj``, ``v_proj``) outputs ``heads * head_dim`` features."""
    features = getattr(getattr(attention, name, None), "out_features", None)
    return is_python_int(features) and features == shape[0] * shape[1]


#: :func:`written_shapes` of each model, read once (make_cache runs per batch; a loaded model keeps its shapes)
_WRITTEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def written_shapes(model) -> dict[int, Shapes]:
    """Per decoder layer of a loaded ``model``: the ``(KV heads, head_dim)`` its attention writes to the cache, for
    keys and for values, where the config (transformers' own ``get_head_shapes``) and the layer's own ``k_proj`` /
    ``v_proj`` agree on it. Layers without such projections (fused QKV, MLA, shared KV), with a key or value size
    of their own (``qk_head_dim``, ``v_head_dim``), a model split by tensor parallelism, or a config alone: not
    known (nothing to check against)."""
    if not isinstance(model, torch.nn.Module) or tensor_parallel_size(model) > 1:
        return {}
    if model not in _WRITTEN:
        _WRITTEN[model] = _read_shapes(model)
    return dict(_WRITTEN[model])


def _read_shapes(model: torch.nn.Module) -> dict[int, Shapes]:
    """:func:`written_shapes`, read from the model's config and modules."""
    try:
        text = model.config.get_text_config(decoder=True)
        layer_configs = list(text.per_layer_config)
        heads, dims = get_head_shapes(text)
        decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
    except (AttributeError, TypeError, ValueError, ZeroDivisionError, NotImplementedError):
        return {}
    count = len(layer_configs)
    heads, dims = (x if isinstance(x, list) else [x] * count for x in (heads, dims))
    found: dict[int, Shapes] = {}
    for attention in decoder.modules() if isinstance(decoder, torch.nn.Module) else ():
        i = getattr(attention, "layer_idx", None)
        if not is_python_int(i) or not 0 <= i < min(count, len(heads), len(dims)) or any(
                getattr(layer_configs[i], name, None) is not None for name in ("qk_head_dim", "v_head_dim")):
            continue
        shape = (heads[i], dims[i])
        if not all(is_python_int(n) and n > 0 for n in shape):
            continue
        key, value = (shape if _projects(attention, name, shape) else None for name in ("k_proj", "v_proj"))
        if key or value:
            found[i] = (key, value) if found.get(i, (key, value)) == (key, value) else (None, None)
    return {i: shapes for i, shapes in found.items() if shapes != (None, None)}


def _with_options(quantizer: Quantizer, options: dict) -> Quantizer:
    """``quantizer`` with some of its options changed (validated as a new quantizer)."""
    QUANTIZERS.check_options(quantizer.name, options)
    return dataclasses.replace(quantizer, **options) if options else quantizer


def layer_bounds(selector) -> tuple[int, int] | None:
    """The first and last layer a ``layers=`` key names: ``5``, ``"5"`` or the inclusive range ``"0-3"`` (spaces
    around the numbers allowed); None for anything else. The one reading of a layer selector: make_cache's
    (:func:`layer_range`) and export's of a report's keys (:func:`kvquant.integrations.deploy_read.layer_map`)."""
    if is_python_int(selector):
        return selector, selector
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", selector) if isinstance(selector, str) else None
    return (int(match.group(1)), int(match.group(2) or match.group(1))) if match else None


def layer_range(selector, count: int) -> range:
    """Layers named by a ``layers=`` key (:func:`layer_bounds`), within ``count``."""
    bounds = layer_bounds(selector)
    if bounds is None:
        raise KVQuantError(f"layers: {selector!r} is not a layer or a layer range (write 5 or '0-3')")
    low, high = bounds
    if not 0 <= low <= high < count:
        raise KVQuantError(f"layers: {selector!r} is outside the model's layers 0-{count - 1}" if low <= high else
                           f"layers: {selector!r} runs backwards (write low-high)")
    return range(low, high + 1)


def layer_settings(layout: list, quantizer: Quantizer, residual_length: int, sink_tokens: int,
                   layers: dict | None, head_dim: int | None = None, context: int | None = None, model=None
                   ) -> tuple[list[tuple[Quantizer, int, int] | None], dict[str, dict]]:
    """Per layer of ``layout``: ``(quantizer, residual_length, sink_tokens)`` (None for a shared layer), and the
    normalized ``layers`` mapping (keys ``"a-b"``, every option spelled out, so it rebuilds the same layers).
    Each ``layers`` entry maps a layer or inclusive range to options: without ``quantizer`` they change the
    cache's quantizer's options for those layers; naming a quantizer (even the cache's), that quantizer with its
    own defaults and these options. ``residual_length`` and ``sink_tokens`` default to the cache's. A layer named
    twice, an entry naming only shared layers and sinks on a sliding-window layer (which keeps none) are
    errors; with ``head_dim`` each entry's quantizer is checked against it, with ``context`` its sinks; with
    ``model`` each entry's quantizer is the one that runs on it (:meth:`Quantizer.for_model`)."""
    plan = [None if w == "shared" else (quantizer, residual_length, sink_tokens) for w in layout]
    if layers is None:
        return plan, {}
    if not isinstance(layers, dict):
        raise KVQuantError(f"layers must map layers or ranges ('0-3') to options, got {type(layers).__name__}")
    owner: dict[int, object] = {}
    normalized: dict[int, tuple[str, dict]] = {}  # by the entry's first layer: (its key, its options)
    for selector, options in layers.items():
        span = layer_range(selector, len(layout))
        if not isinstance(options, dict):
            raise KVQuantError(f"layers[{selector!r}] must be a mapping of options, got {type(options).__name__} "
                               f"{options!r}")
        clash = next((i for i in span if i in owner), None)
        if clash is not None:
            raise KVQuantError(f"layers: layer {clash} is named by both {owner[clash]!r} and {selector!r}")
        owner.update(dict.fromkeys(span, selector))
        options = dict(options)
        name = options.pop("quantizer", None)
        residual, sinks = options.pop("residual_length", residual_length), options.pop("sink_tokens", sink_tokens)
        check_tokens(f"layers[{selector!r}].residual_length", residual)
        check_tokens(f"layers[{selector!r}].sink_tokens", sinks)
        check_sinks(f"layers[{selector!r}]: sink_tokens", sinks, context)
        if all(layout[i] == "shared" for i in span):
            raise KVQuantError(f"layers[{selector!r}]: names only layers that reuse another layer's KV (they store "
                               "nothing)")
        sliding = next((i for i in span if isinstance(layout[i], int) and not isinstance(layout[i], bool)), None)
        if sinks and sliding is not None:
            raise KVQuantError(f"layers[{selector!r}]: layer {sliding} is a sliding-window layer, which keeps no "
                               "sink tokens")
        try:
            chosen = _with_options(quantizer, options) if name is None else get_quantizer(name, **options)
            chosen = chosen if model is None else chosen.for_model(model)
            if head_dim is not None:
                chosen.codecs(head_dim)
        except KVQuantError as err:
            raise KVQuantError(f"layers[{selector!r}]: {err}") from None
        for i in span:
            if plan[i] is not None:
                plan[i] = (chosen, residual, sinks)
        key = f"{span.start}-{span.stop - 1}" if len(span) > 1 else str(span.start)
        normalized[span.start] = key, {**chosen.describe(), "residual_length": residual, "sink_tokens": sinks}
    return plan, dict(entry for _, entry in sorted(normalized.items()))


def check_sinks(name: str, sinks: int, context: int | None) -> None:
    """Sinks are allocated up front for every row and head: no more than the model's ``context`` (None: unknown)."""
    if context is not None and sinks > context:
        raise KVQuantError(f"{name} {sinks} is beyond the model's {context} positions (sinks are a sequence's first "
                           "tokens, kept at full precision in memory reserved up front; StreamingLLM keeps 4)")


def check_layout(layout) -> None:
    """Each entry of an :func:`attention_layout`: None, ``"shared"`` or a sliding window of at least one token."""
    if not isinstance(layout, (list, tuple)) or not layout:
        raise KVQuantError(f"layout must be a non-empty list (see attention_layout), got {describe_value(layout)}")
    for i, entry in enumerate(layout):
        if entry is not None and entry != "shared" and not (is_python_int(entry) and entry >= 1):
            window = describe_value(entry).split(' ', 1)[-1]
            raise KVQuantError(f"layout: layer {i} has sliding window {window}; a window is "
                               "an integer >= 1 (None: full attention, 'shared': a layer that reuses another's KV)")


def build_cache(
    layout: list[int | None | str], quantizer: str | Quantizer | CacheSpec = "int4", *, head_dim: int | None = None,
    context: int | None = None, **options
) -> KVQuantCache:
    """A :class:`KVQuantCache` for an :func:`attention_layout`; see :func:`make_cache` for the arguments (or a
    :class:`CacheSpec` alone). With ``head_dim`` the quantizer's settings are checked against it now rather than at
    the first forward; with ``context`` (the model's positions) the sinks too. Every size (sinks, residual window,
    groups of tokens, eviction window and budget) is at most :data:`~kvquant.formats.quantizers.MAX_TOKENS`,
    checked before anything is allocated."""
    check_layout(layout)
    return cache_of_spec(layout, CacheSpec.of(quantizer, options), head_dim=head_dim, context=context)


def cache_of_spec(layout: list[int | None | str], setting: CacheSpec, *, head_dim: int | None = None,
                  context: int | None = None, model=None) -> KVQuantCache:
    """The :class:`KVQuantCache` of a validated ``setting`` for a checked ``layout``: the one path from a
    :class:`CacheSpec` to storage (``build_cache`` and ``make_cache`` both end here). ``head_dim`` and ``context`` as
    :func:`build_cache`; ``model`` (a transformers model or config): every quantizer of the setting as it runs on it
    (:meth:`~kvquant.formats.quantizers.Quantizer.for_model`, e.g. llama.cpp's K channel order)."""
    quantizer, residual_length, sink_tokens = setting.quantizer, setting.residual_length, setting.sink_tokens
    quantizer = quantizer if model is None else quantizer.for_model(model)
    policy = setting.eviction
    check_sinks("sink_tokens", sink_tokens, context)
    plan, normalized = layer_settings(layout, quantizer, residual_length, sink_tokens, setting.layers, head_dim,
                                      context, model)
    if policy:
        longest = max(spec[1] for spec in plan if spec is not None)
        if longest >= policy.window and not all(spec[0].name == "fp16" for spec in plan if spec is not None):
            raise KVQuantError(f"residual_length {longest} is not below the eviction window {policy.window}: tokens "
                               "would leave the full-precision window before ever being quantized (set "
                               "residual_length=0 or a smaller one)")
    if policy and any(spec[2] != sink_tokens for spec in plan if spec is not None):
        raise KVQuantError("layers: with eviction every full-attention layer keeps the cache's sink_tokens (the "
                           "model's one causal mask is sized for all of them)")
    if head_dim is not None:
        quantizer.codecs(head_dim)
        if policy and policy.importance:
            for chosen, residual, _ in {spec for spec in plan if spec is not None}:
                check_importance(policy, *chosen.codecs(head_dim), residual)
    tables = _rope_of(model) if setting.pre_rope else None
    padding = Padding()
    built = [DummyLayer() if spec is None else
             KVQuantLayer(*spec, sliding, padding, policy, tables and PreRope(tables, i))
             for i, (spec, sliding) in enumerate(zip(plan, layout))]
    return KVQuantCache(built, quantizer, residual_length, sink_tokens, head_dim, normalized, policy,
                        setting.pre_rope)


def _rope_of(model):
    """The model's RoPE tables for a pre-RoPE cache (:mod:`kvquant.compat.rope`); one line where it has none kvquant
    can take off (a config, a family or RoPE type it does not know, partial rotary)."""
    try:
        return rotary_tables(model)
    except ValueError as err:
        raise KVQuantError(str(err)) from None


def _check_heads(layer: KVQuantLayer, shapes: Shapes) -> None:
    """The layer's codecs can store the KV heads the model writes there (e.g. one per-head scale each)."""
    for stream, name, shape in ((0, "keys", shapes[0]), (1, "values", shapes[1])):
        if shape is not None:
            try:
                layer.quantizer.codecs(shape[1])[stream].check_heads(shape[0], name)
            except KVQuantError as err:
                raise KVQuantError(f"make_cache: layer {layer.index}: {err}") from None


def make_cache(model_or_config, quantizer: str | Quantizer | CacheSpec = "int4", **options) -> KVQuantCache:
    """Build a quantized cache for a decoder model (or its config).

    quantizer: a registered name (see ``kvquant.available_quantizers()``), a :class:`Quantizer`, or a
    :class:`CacheSpec` (a whole setting, no other options).
    residual_length: most recent tokens kept in full precision (default: the quantizer's, 128 for integers).
    sink_tokens: first tokens kept in full precision (full-attention layers only).
    eviction, window: an eviction policy for the full-attention layers (``"window"``, ``"sink_window"``: see
    :mod:`kvquant.cache.eviction`) and its window, e.g. ``eviction="sink_window", sink_tokens=4, window=1024``.
    layers: per-layer settings, e.g. ``{"0-3": {"quantizer": "int8"}, 5: {"key_bits": 8}}``: a layer or inclusive
    range of layers and its options (see :func:`layer_settings`); the other layers use the arguments above.
    Other options are the quantizer's own, e.g. ``group_size=32``, ``key_bits=8``.
    For a left-padded batch, call ``cache.set_padding(attention_mask)`` before the first forward.
    On a model given to :func:`kvquant.enable_fused_decode` first, decode steps attend over the stored codes.
    """
    layout = attention_layout(model_or_config)  # first: refuses what is no model or config instance
    cache = cache_of_spec(layout, CacheSpec.of(quantizer, options), head_dim=head_dim_of(model_or_config),
                          context=context_of(model_or_config), model=model_or_config)
    checked = set()  # (quantizer, shapes) whose codecs were checked: once for the layers sharing them
    for i, shapes in written_shapes(model_or_config).items():  # checked at each layer's first update
        if i < len(cache.layers) and isinstance(cache.layers[i], KVQuantLayer):
            if (id(cache.layers[i].quantizer), shapes) not in checked:
                _check_heads(cache.layers[i], shapes)
                checked.add((id(cache.layers[i].quantizer), shapes))
            cache.layers[i].expected = shapes
    if is_fused(getattr(model_or_config, "config", model_or_config)):
        for layer in cache.layers:
            if isinstance(layer, KVQuantLayer):
                layer.fused = True
    if hasattr(model_or_config, "set_attn_implementation") and any(
            getattr(getattr(layer, "quantizer", None), "converts_query", False) for layer in cache.layers):
        enable_query_conversion(model_or_config)  # the engine's query arithmetic (llama.cpp): kvquant/cache/query.py
    return cache


def simulate_memory(
    layout: list[int | None | str], settings: dict | CacheSpec, *, batch: int, kv_heads: int, head_dim: int,
    tokens: int, dtype: torch.dtype = torch.float16, context: int | None = None,
) -> dict[str, float]:
    """``memory_report()``'s stored bytes of a cache after ``tokens`` tokens were written in one call, computed by
    running the cache's own code on meta tensors (shapes only, no data, no compute) for one row; unshared rows hold
    their own units, so ``batch`` rows take ``batch`` times its bytes. ``settings``: make_cache arguments,
    ``{"quantizer": "int4", "group_size": 32, ...}`` (``layers`` included); ``context``: the model's positions,
    which bound its sinks as in :func:`make_cache` (None: unknown); or a :class:`CacheSpec`."""
    if not isinstance(settings, CacheSpec):
        settings = dict(settings)
        quantizer = settings.pop("quantizer")
        check_not_options("settings", settings)
        settings = CacheSpec.of(quantizer, settings)
    settings = settings.stored_bytes_spec()
    states = torch.empty(1, kv_heads, tokens, head_dim, dtype=dtype, device="meta")
    cache = build_cache(layout, settings, head_dim=head_dim, context=context)
    parts, seen = {}, {}
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, KVQuantLayer):
            continue
        kind = (layer.quantizer, layer.residual_length, layer.sink_tokens, layer.sliding_window, layer.eviction)
        if kind not in seen:  # layers of one kind store the same: simulate one each
            layer.update(states, states)
            memory = layer.memory()  # stored bytes: a one-call write's, as the planner counts them
            seen[kind] = {key: memory[key] * batch for key in STORED_KEYS}
        parts[i] = seen[kind]
    return summarize(parts, tokens)


def spec_memory(spec: CacheSpec, shape, *, tokens: int, dtype: torch.dtype, batch: int = 1,
                context: int | None = None) -> dict[str, float]:
    """:func:`simulate_memory` of ``spec`` on a model of ``shape`` (its ``layout``, ``kv_heads`` and ``head_dim``: a
    :class:`kvquant.planner.shapes.ModelShape` or a session's) after ``tokens`` tokens of one row, times ``batch``."""
    return simulate_memory(shape.layout, spec, batch=batch, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                           tokens=tokens, dtype=dtype, context=context)
