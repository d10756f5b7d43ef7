"""The planner's byte arithmetic: what a cache stores after ``n`` tokens, for any ``n``, in constant time.

Why it can be arithmetic (read off :mod:`kvquant.cache.storage` and :mod:`kvquant.cache.layer`): one stream (keys
or values) of one layer stores its quantized units in slots of a fixed size (every unit of a codec has the same
shape; slots reserved for later writes are not counted) and its sinks and full-precision tail at a fixed size per
token. So its bytes are ``units x slot + (sinks + tail) x token``, and after one write of ``n`` tokens to one row:

- sinks: the first ``min(sink_tokens, n)`` tokens; the rest goes to the tail;
- units: the tail's tokens beyond ``residual_length`` in whole units (``unit`` tokens each), the remainder stays;
- a capacity (a sliding window: ``window - 1``; an eviction policy: its sinks + window (+ budget)): the
  ``n - capacity`` oldest tokens after the sinks leave in whole units (position eviction: units first, then the
  tail); an importance policy stops reading exactly those (scores are all equal on shapes), freeing the units all
  of whose tokens are no longer read.

Beyond ``sinks + residual + capacity + unit`` tokens the bytes grow by the same amount every ``unit`` tokens (a
fixed per-unit cost plus a per-token tail that repeats), so ``kv_bytes`` is linear in the tokens apart from a
bounded, periodic remainder. :func:`layer_costs` reads ``slot``, ``token`` and ``unit`` off a short write
(``sinks + residual + 2 units`` tokens, on meta tensors: shapes, no data) through the cache's own code, and checks
the arithmetic against that write's ``memory()``; :class:`kvquant.planner.Planner` checks it again at the tokens
it answers (see :meth:`kvquant.planner.Planner.verify`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .cache import FP16_BYTES, KVQuantLayer, build_cache
from .cache.layer import _ROLE, block_tokens
from .errors import InternalError, KVQuantError

#: The keys of ``KVQuantLayer.memory()`` (and of ``memory_report()``'s totals), in its order.
MEMORY_KEYS = ("payload_bytes", "scale_bytes", "full_precision_bytes", "fp16_bytes", "shared_saved_bytes",
               "shareable_bytes", "shared_bytes")
#: Most kinds of layer one plan probes, over all its cache settings (each costs a write and a few simulations).
MAX_LAYER_KINDS = 24
#: Most sink tokens, and most tokens of a layer's block of units (its keys' and values' units' least common
#: multiple), a planned setting may have: the short write that reads a layer's costs stores each sink and each unit
#: of two blocks one by one. Real settings keep 0-64 sinks and quantize groups of 1-128 tokens.
MAX_SINK_TOKENS = MAX_BLOCK_TOKENS = 1 << 16


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
    slot: dict[str, int] = {}
    for role, nbytes in store.slot_bytes().items():
        category = _ROLE.get(role, "full_precision_bytes")
        slot[category] = slot.get(category, 0) + nbytes
    token = store.heads * store.head_dim
    return StreamCost(store.unit, tuple(slot.items()), token * store.tail.element_size(), token * FP16_BYTES)


def _probe(layer: KVQuantLayer, kv_heads: int, head_dim: int, dtype: torch.dtype) -> LayerCost:
    """Write ``sinks + residual + 2 units`` tokens (meta tensors) through ``layer`` and read its costs off it; the
    arithmetic must give the bytes the layer reports."""
    if layer.sink_tokens > MAX_SINK_TOKENS:
        raise KVQuantError(f"sink_tokens must be <= {MAX_SINK_TOKENS:,} for the planner, got {layer.sink_tokens:,}")
    block = block_tokens(*layer.quantizer.codecs(head_dim))
    if block > MAX_BLOCK_TOKENS:
        raise KVQuantError(f"{layer.quantizer.name}: its keys' and values' quantized units span {block:,} tokens "
                           f"(their token groups' least common multiple), over the {MAX_BLOCK_TOKENS:,} the planner "
                           "takes; use smaller token groups (group_size, key_group_size, value_group_size)")
    n = layer.sink_tokens + layer.residual_length + 2 * block
    states = torch.empty(1, kv_heads, n, head_dim, dtype=dtype, device="meta")
    layer.update(states, states)
    cost = LayerCost(layer.sink_tokens, layer.residual_length, layer.capacity, layer.eviction is not None,
                     layer.eviction_by_importance, (_stream_cost(layer.k), _stream_cost(layer.v)))
    if cost.memory(n) != layer.memory():
        raise InternalError(f"the planner's arithmetic gives {cost.memory(n)} after {n} tokens, the cache stores "
                            f"{layer.memory()}; please report this")
    return cost


def layer_costs(layout: list, settings: dict, kv_heads: int, head_dim: int, dtype: torch.dtype,
                max_kinds: int | None = None) -> dict[int, LayerCost]:
    """Per layer that stores anything (``layout`` as :func:`kvquant.cache.attention_layout`), its
    :class:`LayerCost` under ``settings`` (make_cache arguments, ``layers`` included); layers of one kind (quantizer
    and options, windows, sinks, eviction) are probed once, and there may be at most ``max_kinds`` kinds. Bad
    settings raise :class:`KVQuantError` here, as make_cache would."""
    settings = dict(settings)
    cache = build_cache(layout, settings.pop("quantizer"), head_dim=head_dim, **settings)
    layers = {i: layer for i, layer in enumerate(cache.layers) if isinstance(layer, KVQuantLayer)}
    kind = {i: (layer.quantizer, layer.residual_length, layer.sink_tokens, layer.sliding_window, layer.eviction)
            for i, layer in layers.items()}
    if max_kinds is not None and len(set(kind.values())) > max_kinds:
        raise KVQuantError(f"{len(set(kind.values()))} kinds of layer (quantizer and options, window, sinks) in "
                           f"this setting, over the {max_kinds} left of the {MAX_LAYER_KINDS} one plan takes in all "
                           "its --cache values; plan fewer per-layer settings or --cache values at a time")
    probed: dict[tuple, LayerCost] = {}
    for i, layer in layers.items():
        if kind[i] not in probed:
            probed[kind[i]] = _probe(layer, kv_heads, head_dim, dtype)
    return {i: probed[kind[i]] for i in layers}
