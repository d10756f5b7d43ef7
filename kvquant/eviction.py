"""Eviction policies: which past tokens a full-attention layer keeps, found by name in a registry.

A policy is a small frozen dataclass whose fields are its options. It composes with any quantizer in the same
cache (``make_cache(model, "fp8_e4m3", eviction="sink_window", sink_tokens=4, window=1024)``): the cache keeps
what the policy says and frees the rest, in whole quantized units (see :mod:`kvquant.cache.storage`).

Semantics (what attention reads): a forward over positions ``[c, c + n)`` reads the tokens the policy kept of
``[0, c)`` plus the chunk itself, causally. Decoding one token at a time that is exactly the policy's window;
a prefill chunk of ``n`` tokens reads up to ``n - 1`` more recent tokens, as eviction between steps does in
serving. Adding a policy is one class plus ``@register_eviction("name")``: a position policy says how many tokens
it keeps (:meth:`Eviction.capacity`) and the cache's storage drops the oldest; an importance policy sets
``importance = True`` and defines ``score(keys [B, H, n, D]) -> [B, n]`` and ``choose`` (which tokens to stop
reading; see :class:`KeyNorm`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from .errors import KVQuantError
from .registry import Registry

EVICTIONS = Registry("eviction policy")
#: Class decorator: make an :class:`Eviction` subclass available under a name.
register_eviction = EVICTIONS.register
available_evictions = EVICTIONS.names


def get_eviction(name: str, sink_tokens: int, **options) -> Eviction:
    """Policy ``name`` with ``options`` for a cache keeping ``sink_tokens`` sinks; errors name the valid choices."""
    policy = EVICTIONS.build(name, **options)
    policy.check(sink_tokens)
    return policy


@dataclass(frozen=True)
class Eviction:
    """Keeps, before each forward, the first ``sink_tokens`` tokens and the most recent ``window`` tokens."""

    name: ClassVar[str]
    #: Whether the policy ranks tokens by :meth:`score` (else it keeps positions).
    importance: ClassVar[bool] = False
    #: Most recent tokens kept (before the current forward's own tokens).
    window: int

    def __post_init__(self):
        for key in [f.name for f in dataclasses.fields(self)]:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KVQuantError(f"eviction {self.name!r}: {key} must be an integer >= 1, got {value!r}")

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


@register_eviction("key_norm")
@dataclass(frozen=True)
class KeyNorm(Eviction):
    """Importance by key norm (KnormPress, Devoto et al. 2024: keys of small L2 norm draw the most attention):
    keeps the sinks, the last ``window`` tokens and, of the tokens before them, the ``budget`` whose keys have the
    smallest norm (averaged over KV heads), dropping the others block by block (see :mod:`kvquant.cache`)."""

    importance: ClassVar[bool] = True
    #: Tokens kept from before the window, chosen by score.
    budget: int

    def capacity(self, sink_tokens: int) -> int:
        return sink_tokens + self.window + self.budget

    @staticmethod
    def score(keys):
        """``[B, H, n, D]`` keys -> ``[B, n]``, higher = more important."""
        return -keys.float().norm(dim=-1).mean(dim=1)

    def choose(self, visible: list[int], hidden: set[int], sinks: int, block: int, excess: int,
               scores: dict[int, float]) -> list[int]:
        """Which ``excess`` of a row's ``visible`` tokens (ordinals, in order; ``hidden``: those stored but no longer
        read) to stop reading: never a sink or one of the last ``window``, and block by block (a block: ``block``
        tokens, whole units of both streams), finishing a block it began first, so at most one block is ever partly
        read and the bytes stored do not depend on the scores. Lowest mean ``scores`` first."""
        middle = visible[sinks : len(visible) - self.window]
        blocks: dict[int, list[int]] = {}
        for o in middle:
            blocks.setdefault((o - sinks) // block, []).append(o)
        # a block is evictable when none of its tokens is in the window (its others are already unread)
        middle_or_hidden = set(middle) | hidden
        whole = {b for b in blocks if all(sinks + b * block + i in middle_or_hidden for i in range(block))}
        started = sorted(b for b in whole if len(blocks[b]) < block)
        rank = lambda b: (sum(scores.get(o, 0.0) for o in blocks[b]) / len(blocks[b]), b)  # noqa: E731
        chosen: list[int] = []
        for b in started + sorted((b for b in whole if b not in started), key=rank):
            chosen += sorted(blocks[b], key=lambda o: (scores.get(o, 0.0), o))[: excess - len(chosen)]
            if len(chosen) == excess:
                break
        return chosen
