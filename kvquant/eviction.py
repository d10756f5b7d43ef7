"""Eviction policies: which past tokens a full-attention layer keeps, found by name in a registry.

A policy is a small frozen dataclass whose fields are its options. It composes with any quantizer in the same
cache (``make_cache(model, "fp8_e4m3", eviction="sink_window", sink_tokens=4, window=1024)``): the cache keeps
what the policy says and frees the rest, in whole quantized units (see :mod:`kvquant.cache`).

Semantics (what attention reads): a forward over positions ``[c, c + n)`` reads the tokens the policy kept of
``[0, c)`` plus the chunk itself, causally. Decoding one token at a time that is exactly the policy's window;
a prefill chunk of ``n`` tokens reads up to ``n - 1`` more recent tokens, as eviction between steps does in
serving. Adding a policy is one class plus ``@register_eviction("name")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .errors import KVQuantError

_REGISTRY: dict[str, type[Eviction]] = {}


def register_eviction(name: str):
    """Class decorator: make an :class:`Eviction` subclass available under ``name``."""

    def wrap(cls):
        if name in _REGISTRY:
            raise KVQuantError(f"eviction policy {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_evictions() -> list[str]:
    return sorted(_REGISTRY)


def get_eviction(name: str, sink_tokens: int, **options) -> Eviction:
    """Policy ``name`` with ``options`` for a cache keeping ``sink_tokens`` sinks; errors name the valid choices."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise KVQuantError(f"unknown eviction policy {name!r}; available: {', '.join(available_evictions())}")
    policy = _REGISTRY[name](**options)
    policy.check(sink_tokens)
    return policy


@dataclass(frozen=True)
class Eviction:
    """Keeps, before each forward, the first ``sink_tokens`` tokens and the most recent ``window`` tokens."""

    name: ClassVar[str]
    #: Most recent tokens kept (before the current forward's own tokens).
    window: int

    def __post_init__(self):
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise KVQuantError(f"eviction {self.name!r}: window must be an integer >= 1, got {self.window!r}")

    def check(self, sink_tokens: int) -> None:
        """Reject a cache setting the policy does not fit."""

    def capacity(self, sink_tokens: int) -> int:
        """Tokens of the past a forward reads at most (sinks + window)."""
        return sink_tokens + self.window


@register_eviction("window")
@dataclass(frozen=True)
class Window(Eviction):
    """The most recent ``window`` tokens, nothing else (a sliding window on a full-attention model)."""

    def check(self, sink_tokens):
        if sink_tokens:
            raise KVQuantError(f"eviction 'window' keeps no sinks, but sink_tokens={sink_tokens}; use "
                               "eviction='sink_window' to keep the first tokens")


@register_eviction("sink_window")
@dataclass(frozen=True)
class SinkWindow(Eviction):
    """The first ``sink_tokens`` tokens (attention sinks, StreamingLLM) and the most recent ``window`` tokens."""

    def check(self, sink_tokens):
        if sink_tokens < 1:
            raise KVQuantError("eviction 'sink_window' needs sink_tokens >= 1 (e.g. 4); for no sinks use "
                               "eviction='window'")
