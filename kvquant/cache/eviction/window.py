"""``window``: a sliding window on a full-attention model."""

from __future__ import annotations

from dataclasses import dataclass

from kvquant.errors import KVQuantError
from kvquant.cache.eviction.base import Eviction, register_eviction


@register_eviction("window")
@dataclass(frozen=True)
class SlidingWindow(Eviction):
    """The most recent ``window`` tokens, nothing else (a sliding window on a full-attention model)."""

    def check(self, sink_tokens):
        if sink_tokens:
            raise KVQuantError(f"eviction 'window' keeps no sinks, but sink_tokens={sink_tokens}; use "
                               "eviction='sink_window' to keep the first tokens")
