"""Eviction policies: which past tokens a full-attention layer keeps, found by name in a registry.

A policy is a small frozen dataclass whose fields are its options. It composes with any quantizer in the same
cache (``make_cache(model, "fp8_e4m3", eviction="sink_window", sink_tokens=4, window=1024)``): the cache keeps
what the policy says and frees the rest, in whole quantized units (see :mod:`kvquant.cache.storage`).

Semantics (what attention reads): a forward over positions ``[c, c + n)`` reads the tokens the policy kept of
``[0, c)`` plus the chunk itself, causally. Decoding one token at a time that is exactly the policy's window;
a prefill chunk of ``n`` tokens reads up to ``n - 1`` more recent tokens, as eviction between steps does in
serving. Adding a policy is one file in this folder (or in your own code): one class plus
``@register_eviction("name")``. A position policy says how many tokens it keeps (:meth:`Eviction.capacity`)
and the cache's storage drops the oldest; an importance policy sets ``importance = True`` and defines
``score(keys [B, H, n, D]) -> [B, n]`` and ``choose`` (which tokens to stop reading; see :class:`KeyNorm`).
"""
from kvquant.cache.eviction.base import EVICTIONS, Eviction, available_evictions, get_eviction, register_eviction
from kvquant.cache.eviction.key_norm import KeyNorm
from kvquant.cache.eviction.sink_window import SinkWindow
from kvquant.cache.eviction.window import SlidingWindow

__all__ = ["EVICTIONS", "Eviction", "KeyNorm", "SinkWindow", "SlidingWindow", "available_evictions", "get_eviction",
           "register_eviction"]
