"""The eviction policies' base class and registry: a policy is a small frozen dataclass whose fields are its
options, found by name (see :mod:`kvquant.cache.eviction`)."""


from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from kvquant.formats.quantizers import check_tokens
from kvquant.registry import Registry

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
        for key in [f.name for f in dataclasses.fields(self)]:  # sizes in tokens
            check_tokens(f"eviction {self.name!r}: {key}", getattr(self, key), minimum=1)

    def check(self, sink_tokens: int) -> None:
        """Reject a cache setting the policy does not fit."""

    def capacity(self, sink_tokens: int) -> int:
        """Tokens of the past a forward reads at most (sinks + window)."""
        return sink_tokens + self.window
