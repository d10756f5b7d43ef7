"""The planner's byte arithmetic: what a cache stores after ``n`` tokens, for any ``n``, in constant time.

Why it can be arithmetic (read off :mod:`kvquant.cache.storage` and :mod:`kvquant.cache.layer`): one stream (keys
or values) of one layer stores its quantized units in slots of a fixed size (every unit of a codec has the same
shape; slots reserved for later writes are not counted) and its sinks and full-precision tail at a fixed size per
token. So its bytes are ``units x slot + (sinks + tail) x token``, and after one write of ``n`` tokens to one row:

- sinks: the first ``min(sink_tokens, n)`` tokens; the rest goes to the tail;
- units: the tail's tokens beyond ``residual_length`` in whole units (``unit`` tokens each), the remainder stays;
- a capacity (a sliding window: ``window - 1``; an eviction policy: its sinks + window (+ budget)): the
  ``n - capacity`` oldest tokens after the sinks leave in whole units (position eviction: units first, then the
  tail); an importance policy stops reading exactly those (scores are all equal: the planner writes zeros, or
  shapes only), freeing the units all of whose tokens are no longer read.

Beyond ``sinks + residual + capacity + unit`` tokens the bytes grow by the same amount every ``unit`` tokens (a
fixed per-unit cost plus a per-token tail that repeats), so ``kv_bytes`` is linear in the tokens apart from a
bounded, periodic remainder. ``slot``, ``token`` and ``unit`` depend on the quantizer alone: :func:`layer_costs`
reads them off one short write per quantizer (two blocks of units, no sinks or window) through the cache's own
code and checks the arithmetic against that write's ``memory()``; the rest of a layer's rules are its settings.
:class:`kvquant.planner.shapes.Planner` checks the arithmetic of every kind of layer again at the tokens it answers
(:func:`memory_after_write`, see :meth:`kvquant.planner.shapes.Planner.verify`). Writes are small when they can be
(zeros on the CPU: :data:`CPU_ELEMENTS`), else on meta tensors (shapes, no data).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvquant.formats import kernels
from kvquant.cache import FP16_BYTES, CacheSpec, KVQuantLayer, build_cache, check_importance
from kvquant.cache.layer import block_tokens
from kvquant.cache.memory import STORED_KEYS
from kvquant.formats.roles import by_category
from kvquant.errors import InternalError, KVQuantError
from kvquant.formats.quantizers import Quantizer, available_quantizers, quantizer_options

#: The keys of ``KVQuantLayer.memory()`` (and of ``memory_report()``'s totals), in its order.
MEMORY_KEYS = STORED_KEYS
#: Most kinds of layer one plan takes, over all its cache settings (each costs a write through the cache code when
#: its answer is checked, and its quantizer, the first time, the write that reads its costs).
MAX_LAYER_KINDS = 24
#: Most sink tokens, and most tokens of a layer's block of units (its keys' and values' units' least common
#: multiple), a planned setting may have: the writes through the cache code store each sink, and each unit of two
#: blocks, one by one. Real settings keep 0-64 sinks and quantize groups of 1-128 tokens.
MAX_SINK_TOKENS = MAX_BLOCK_TOKENS = 1 << 16
#: A write of at most this many elements (tokens x KV heads x head_dim) runs on zeros on the CPU, on one thread; a
#: larger one on meta tensors. The cache code stores the same bytes either way (shapes decide them), but a meta op
#: runs PyTorch's Python reference kernels, about half a millisecond whatever the size, and the first one imports
#: torch._dynamo (over a second): zeros this size take a few milliseconds for most quantizers, and at most about
#: 1.3 times a meta write for the costliest (llama.cpp's IQ4_NL search). Llama-3.1-8B (8 KV heads of 128): 512 tokens.
CPU_ELEMENTS = 1 << 19
#: Largest head_dim a setting with a Hadamard rotation (``rotation``, of any of its layers) may plan: the cache code
#: builds a head_dim x head_dim matrix for each ``layers`` entry and each layer it writes, about a millisecond at
#: 256 (the largest real models use) and a tenth of a second at 4,096, and reads each one whole on every write.
MAX_ROTATED_HEAD_DIM = 512


@dataclass(frozen=True)
class StreamCost:
    """One stream of one layer: ``slot`` bytes per quantized unit of ``unit`` tokens, as ``(memory_report category,
    bytes)`` pairs; ``token`` bytes per full-precision token (heads x head_dim x the states' dtype) and
    ``fp16_token`` the same in fp16 (the reference ``bits_per_element`` is measured against)."""

    unit: int
    slot: tuple[tuple[str, int], ...]
    token: int
    fp16_token: int

    @property
    def slot_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.slot)


@dataclass(frozen=True)
class LayerCost:
    """One layer's storage rules (see the module docstring): sinks, residual window, capacity (None: keeps every
    token), whether an eviction policy (not a sliding window) sets that capacity and whether it ranks tokens by
    importance, and its keys' and values' :class:`StreamCost`."""

    sinks: int
    residual: int
    capacity: int | None
    evicting: bool
    importance: bool
    streams: tuple[StreamCost, StreamCost]

    @property
    def block(self) -> int:
        """Tokens after which both streams' bytes repeat (their units' least common multiple)."""
        return math.lcm(*(stream.unit for stream in self.streams))

    @property
    def steady(self) -> int:
        """Tokens from which the bytes grow by the same amount every :attr:`block` tokens."""
        return self.sinks + self.residual + (self.capacity or 0) + self.block

    def counts(self, stream: StreamCost, n: int) -> tuple[int, int]:
        """``(full-precision tokens, units)`` ``stream`` stores after one write of ``n`` tokens to one row."""
        unit = stream.unit
        sinks = min(self.sinks, n)
        flushed = max(n - sinks - self.residual, 0) // unit * unit
        units, tail = flushed // unit, n - sinks - flushed
        if self.capacity is not None and n > self.capacity:
            excess = n - self.capacity  # the oldest tokens after the sinks
            if self.importance:  # no longer read; the units all of whose tokens are freed
                units -= excess // unit
            else:  # evicted in whole units: stored units first, then the tail
                drop = excess // unit * unit
                gone = min(drop, units * unit) // unit
                units, tail = units - gone, tail - (drop - gone * unit)
        return sinks + tail, units

    def memory(self, n: int) -> dict[str, int]:
        """``KVQuantLayer.memory()`` after one write of ``n`` tokens to one row (one row holds no unit twice)."""
        out = dict.fromkeys(MEMORY_KEYS, 0)
        held = n if self.evicting or self.capacity is None else min(n, self.capacity)  # the fp16 reference's
        for stream in self.streams:
            full, units = self.counts(stream, n)
            for category, nbytes in stream.slot:
                out[category] += units * nbytes
            out["full_precision_bytes"] += full * stream.token
            out["fp16_bytes"] += held * stream.fp16_token
            out["shareable_bytes"] += units * stream.slot_bytes
        return out


def _stream_cost(store) -> StreamCost:
    """A :class:`StreamCost` read off a :class:`~kvquant.cache.storage.Store` that has stored at least one unit."""
    slot = by_category(store.codec, store.slot_bytes())
    token = store.heads * store.head_dim
    return StreamCost(store.unit, tuple(slot.items()), token * store.tail.element_size(), token * FP16_BYTES)


@contextmanager
def _one_thread() -> Iterator[None]:
    """PyTorch on one thread (then as before), for the planner's writes and the caches it builds: on a busy machine,
    small ops split over several threads wait for each other far longer than they compute. The fused CPU kernel is
    held back (:func:`kvquant.formats.kernels.eager`): the planner reads bytes, and must never wait for its compile."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with kernels.eager():
            yield
    finally:
        torch.set_num_threads(threads)


def layer_memory_after_write(layer: KVQuantLayer, tokens: int, kv_heads: int, head_dim: int,
                             dtype: torch.dtype) -> dict[str, int]:
    """``layer.memory()`` after one write of ``tokens`` tokens (states ``[1, kv_heads, tokens, head_dim]``): zeros
    on the CPU up to :data:`CPU_ELEMENTS` elements, meta tensors (shapes, no data) beyond."""
    if tokens * kv_heads * head_dim <= CPU_ELEMENTS:
        states = torch.zeros(1, kv_heads, tokens, head_dim, dtype=dtype)
    else:
        states = torch.empty(1, kv_heads, tokens, head_dim, dtype=dtype, device="meta")
    layer.update(states, states)
    memory = layer.memory()
    return {key: memory[key] for key in MEMORY_KEYS}  # stored bytes: what one write's arithmetic gives


def _probe(quantizer: Quantizer, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[StreamCost, StreamCost]:
    """The keys' and values' :class:`StreamCost` of every layer of ``quantizer``: two blocks of units written through
    a layer that keeps no sinks, no full-precision window and every token; the arithmetic must give the bytes it
    reports."""
    block = block_tokens(*quantizer.codecs(head_dim))
    if block > MAX_BLOCK_TOKENS:
        raise KVQuantError(f"{quantizer.name}: its keys' and values' quantized units span {block:,} tokens "
                           f"(their token groups' least common multiple), over the {MAX_BLOCK_TOKENS:,} the planner "
                           "takes; use smaller token groups (group_size, key_group_size, value_group_size)")
    layer = build_cache([None], quantizer, residual_length=0, head_dim=head_dim).layers[0]
    reported = layer_memory_after_write(layer, 2 * block, kv_heads, head_dim, dtype)
    streams = (_stream_cost(layer.k), _stream_cost(layer.v))
    plain = LayerCost(0, 0, None, False, False, streams)
    if plain.memory(2 * block) != reported:
        raise InternalError(f"the planner's arithmetic gives {plain.memory(2 * block)} after {2 * block} tokens of "
                            f"{quantizer.name}, the cache stores {reported}; please report this")
    return streams


def bytes_key(layer: KVQuantLayer) -> tuple:
    """What a layer's bytes depend on besides the model's shapes: its quantizer and options (but a rotation's seed,
    which picks its matrix's signs and never a byte), full-precision window, sinks, sliding window and eviction
    policy."""
    quantizer = layer.quantizer
    if quantizer.rotation_seed:
        quantizer = dataclasses.replace(quantizer, rotation_seed=0)
    return quantizer, layer.residual_length, layer.sink_tokens, layer.sliding_window, layer.eviction


def _rotates(spec: dict, quantizer) -> bool:
    """Whether a quantizer spec (``quantizer`` named there, else the one given) rotates: its ``rotation`` or the
    quantizer's default one (Lloyd-Max and normal-float rotate unless told not to), or one of a ``keys_values``
    mix's inner quantizers does."""
    name = spec.get("quantizer", quantizer)
    default = quantizer_options(name).get("rotation") if name in available_quantizers() else None
    return spec.get("rotation", default) is not None or any(
        isinstance(spec.get(stream), dict) and _rotates(spec[stream], None) for stream in ("keys", "values"))


def _check_rotation(settings: dict, head_dim: int) -> None:
    """Settings with a rotation (for the whole cache, in a ``layers`` entry, by a quantizer's default or inside a
    keys/values mix) only up to :data:`MAX_ROTATED_HEAD_DIM`, before any matrix is built."""
    entries = settings.get("layers")
    entries = [options for options in entries.values() if isinstance(options, dict)] if isinstance(entries, dict) \
        else []
    cache = {k: v for k, v in settings.items() if k != "layers"}
    # an entry that names no quantizer changes the cache's own options for its layers
    entries = [entry if "quantizer" in entry else {**cache, **entry} for entry in entries]
    if head_dim > MAX_ROTATED_HEAD_DIM and any(_rotates(options, settings.get("quantizer"))
                                               for options in [cache, *entries]):
        raise KVQuantError(f"rotation: the planner takes a Hadamard rotation up to head_dim {MAX_ROTATED_HEAD_DIM}, "
                           f"this model's is {head_dim:,} (the cache code builds a head_dim x head_dim matrix for "
                           "each layers entry and each layer; real models use at most 256)")


def storing_layers(layout: list, settings: dict, head_dim: int) -> dict[int, KVQuantLayer]:
    """The layers (by index) that store anything of a cache built for ``layout`` (as
    :func:`kvquant.cache.attention_layout`) with ``settings`` (make_cache arguments, ``layers`` included), not yet
    written. Bad settings raise :class:`KVQuantError` here, as make_cache would."""
    _check_rotation(settings, head_dim)
    settings = dict(settings)
    spec = CacheSpec.of(settings.pop("quantizer"), settings)  # refused as make_cache refuses, pre_rope's value too
    cache = build_cache(layout, spec.stored_bytes_spec(), head_dim=head_dim)
    return {i: layer for i, layer in enumerate(cache.layers) if isinstance(layer, KVQuantLayer)}


@_one_thread()
def layer_costs(layout: list, settings: dict, kv_heads: int, head_dim: int, dtype: torch.dtype,
                max_kinds: int | None = None) -> dict[int, LayerCost]:
    """Per layer that stores anything, its :class:`LayerCost` under ``settings`` (see :func:`storing_layers`); there
    may be at most ``max_kinds`` kinds of layer (:func:`bytes_key`). The streams' costs depend on the quantizer alone
    (every layer stores its units alike), so each quantizer is written once (:func:`_probe`), whatever the layers'
    windows, sinks, eviction and rotation seeds; the rest of a kind is its layer's own settings."""
    layers = storing_layers(layout, settings, head_dim)
    kinds = {i: bytes_key(layer) for i, layer in layers.items()}
    if max_kinds is not None and len(set(kinds.values())) > max_kinds:
        raise KVQuantError(f"{len(set(kinds.values()))} kinds of layer (quantizer and options, window, sinks) in "
                           f"this setting, over the {max_kinds} left of the {MAX_LAYER_KINDS} one plan takes in all "
                           "its --cache values; plan fewer per-layer settings or --cache values at a time")
    probed: dict[Quantizer, tuple[StreamCost, StreamCost]] = {}  # by the kinds' quantizers
    costs: dict[tuple, LayerCost] = {}
    for i, layer in layers.items():
        if kinds[i] in costs:
            continue
        if layer.sink_tokens > MAX_SINK_TOKENS:
            raise KVQuantError(f"sink_tokens must be <= {MAX_SINK_TOKENS:,} for the planner, got {layer.sink_tokens:,}")
        if kinds[i][0] not in probed:
            probed[kinds[i][0]] = _probe(layer.quantizer, kv_heads, head_dim, dtype)
        if layer.eviction_by_importance:  # as the layer's first write would
            check_importance(layer.eviction, *layer.quantizer.codecs(head_dim), layer.residual_length)
        costs[kinds[i]] = LayerCost(layer.sink_tokens, layer.residual_length, layer.capacity,
                                    layer.eviction is not None, layer.eviction_by_importance, probed[kinds[i][0]])
    return {i: costs[kinds[i]] for i in layers}


@_one_thread()
def memory_after_write(layout: list, settings: dict, kv_heads: int, head_dim: int, dtype: torch.dtype,
                       tokens: int) -> dict[int, dict[str, int]]:
    """Per layer that stores anything, ``memory()`` after one write of ``tokens`` tokens to one row, by the cache
    code in full (:func:`write`); layers of one :func:`bytes_key` are written once."""
    layers = storing_layers(layout, settings, head_dim)
    seen: dict[tuple, dict[str, int]] = {}
    for layer in layers.values():
        if bytes_key(layer) not in seen:
            seen[bytes_key(layer)] = layer_memory_after_write(layer, tokens, kv_heads, head_dim, dtype)
    return {i: seen[bytes_key(layer)] for i, layer in layers.items()}
