"""``sink_window``: attention sinks plus a window (StreamingLLM)."""

from __future__ import annotations

from dataclasses import dataclass

from kvquant.errors import KVQuantError
from kvquant.cache.eviction.base import Eviction, register_eviction


@register_eviction("sink_window")
@dataclass(frozen=True)
class SinkWindow(Eviction):
    """The first ``sink_tokens`` tokens (attention sinks, StreamingLLM) and the most recent ``window`` tokens."""

    def check(self, sink_tokens):
        if sink_tokens < 1:
            raise KVQuantError("eviction 'sink_window' needs sink_tokens >= 1 (e.g. 4); for no sinks use "
                               "eviction='window'")
