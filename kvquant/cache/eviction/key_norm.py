"""``key_norm``: importance by key norm (KnormPress)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvquant.cache.eviction.base import Eviction, register_eviction


@register_eviction("key_norm")
@dataclass(frozen=True)
class KeyNorm(Eviction):
    """Importance by key norm (KnormPress, Devoto et al. 2024: keys of small L2 norm draw the most attention):
    keeps the sinks, the last ``window`` tokens and, of the tokens before them, the ``budget`` whose keys have the
    smallest norm (averaged over KV heads), dropping the others block by block (see :meth:`choose`: with blocks of
    one token, as for fp16 or per-token quantizers, exactly those)."""

    importance: ClassVar[bool] = True
    #: Tokens kept from before the window, chosen by score.
    budget: int

    def capacity(self, sink_tokens: int) -> int:
        return sink_tokens + self.window + self.budget

    @staticmethod
    def score(keys):
        """``[B, H, n, D]`` keys -> ``[B, n]``, higher = more important."""
        return -keys.float().norm(dim=-1).mean(dim=1)

    def choose(self, visible: list[int], sinks: int, block: int, excess: int, scores: dict[int, float]) -> list[int]:
        """Which ``excess`` of a row's ``visible`` tokens (ordinals, in order) to stop reading: never a sink or one
        of the last ``window``, and block by block (a block: ``block`` tokens, whole units of both streams), the
        block of lowest mean ``scores`` first, finishing a block it began first; within a block, oldest first. So
        at most one block is ever partly read, and the units freed, hence the bytes stored, do not depend on the
        scores (a block may hold several units of a stream)."""
        middle = visible[sinks : len(visible) - self.window]
        blocks: dict[int, list[int]] = {}
        for o in middle:
            blocks.setdefault((o - sinks) // block, []).append(o)
        # a block is evictable when all its tokens are written and none is in the window: the ones not in the
        # middle are no longer read (hidden, or freed by a stream whose units are smaller than a block)
        window, last = set(visible[len(visible) - self.window:]), visible[-1]
        whole = {b for b in blocks if all(o <= last and o not in window
                                          for o in range(sinks + b * block, sinks + (b + 1) * block))}
        started = sorted(b for b in whole if len(blocks[b]) < block)
        rank = lambda b: (sum(scores.get(o, 0.0) for o in blocks[b]) / len(blocks[b]), b)  # noqa: E731
        chosen: list[int] = []
        for b in started + sorted((b for b in whole if b not in started), key=rank):
            chosen += blocks[b][: excess - len(chosen)]
            if len(chosen) == excess:
                break
        return chosen
