"""Pre-RoPE keys (KVQuant, Hooper et al. 2024): a layer of a cache made with ``pre_rope=True`` quantizes its keys
with the model's RoPE taken off and puts RoPE back on the keys it returns.

transformers hands a cache keys already rotated by RoPE (:mod:`kvquant.compat.rope`). Per pair of channels
``(i, i + D/2)`` the model computes ``R_p (x1, x2)`` with ``R_p = [[c, -s], [s, c]]`` (``c``, ``s`` its cos and sin
at the token's position ``p``, the same for both channels of a pair). A write takes it off with
``R_p^-1 = [[c, s], [-s, c]] / (c^2 + s^2)`` (exact in exact arithmetic even where the model's float ``c^2 + s^2``
is not 1: bf16 tables, a scaled RoPE), in float32 at least, and the codecs store what is left: ``W x + b`` for a
projection with a bias ``b`` (Qwen2's ``k_proj``), which is why a ``key_offset`` of ``b`` removed before RoPE is
exact here. A read rotates what the codecs return by ``R_p`` again, at the position each returned key was written
at: a layer keeps, per row, the position of every key it stored (``int32``, counted in ``memory_report()``'s
``host_bytes`` with the cos/sin tables), taken from the ``position_ids`` transformers passes to ``cache.update``,
so padding, forks, stacked rows and sliding windows read each key at its own position, whatever the caller's
position convention. The cos and sin of a position are computed once (:class:`~kvquant.compat.rope.RotaryTables`),
so a key is rotated back with exactly the values it was rotated off with.
"""

from __future__ import annotations

import torch

from kvquant.compat.rope import RotaryTables
from kvquant.errors import KVQuantError
from kvquant.formats.quantizers import MAX_TOKENS
from kvquant.cache.storage import Store, next_capacity


def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, back: bool = False) -> None:
    """Rotate ``x`` ``[B, H, n, D]`` (float32 or float64) in place by ``R_p`` (``back``: by ``R_p^-1``), ``cos`` and
    ``sin`` ``[B, n, D/2]`` the angle of each pair of channels ``(i, i + D/2)``, in one pass over each half."""
    half = x.shape[-1] // 2
    c, s = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    first = x1.clone()
    sign = -1 if back else 1
    x1.mul_(c).addcmul_(x2, s, value=-sign)  # R_p: (x1 c - x2 s, x2 c + x1 s); R_p^-1 = R_p^T / (c^2 + s^2)
    x2.mul_(c).addcmul_(first, s, value=sign)
    if back:
        norm = c * c + s * s
        x1.div_(norm)
        x2.div_(norm)


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``R_p^-1 x`` for ``x`` ``[B, H, n, D]``, in float32 at least (the result in ``x``'s dtype)."""
    work = x.to(torch.promote_types(x.dtype, torch.float32), copy=True)
    turn(work, cos, sin, back=True)
    return work.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``x`` ``[B, H, n, D]`` rotated by ``R_p`` (the model's RoPE) in place, computed in float32 at least."""
    work = torch.promote_types(x.dtype, torch.float32)
    if x.dtype == work:
        turn(x, cos, sin)
    else:
        y = x.to(work)
        turn(y, cos, sin)
        x.copy_(y)


def given_positions(kwargs: dict, n: int, batch: int) -> torch.Tensor:
    """The ``[B, n]`` positions an update's keys were rotated by: the ``position_ids`` transformers' attention passes
    to ``cache.update`` (``kwargs={"position_ids": ...}``), one row for all or one per row."""
    inner = kwargs.get("kwargs")
    given = inner.get("position_ids") if isinstance(inner, dict) else kwargs.get("position_ids")
    if not isinstance(given, torch.Tensor) or given.dim() != 2 or given.shape[1] != n or \
            given.shape[0] not in (1, batch) or given.is_floating_point() or given.is_complex():
        got = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
        raise KVQuantError(f"pre_rope: the update must carry the integer position_ids [batch, {n}] the model rotated "
                           f"its keys by (transformers' attention passes them in cache.update's kwargs), got {got}")
    return given.long().expand(batch, n)


class PreRope:
    """One layer's RoPE on and off, and the position of each key it stores: ``positions`` ``[B, W]`` int32 (CPU), row
    ``b``'s ``j``-th real token ever written (its ordinal, as the stores count them) at column ``j``; columns past
    the row's own count are unused."""

    def __init__(self, tables: RotaryTables, layer: int):
        self.tables, self.layer = tables, layer
        self.positions = torch.zeros(0, 0, dtype=torch.int32)

    def check(self, positions: torch.Tensor) -> None:
        """Real tokens' positions are in ``[0, MAX_TOKENS]`` (the cos/sin tables hold every position up to the
        largest)."""
        if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) <= MAX_TOKENS:
            raise KVQuantError(f"pre_rope: position_ids of real tokens must be in 0-{MAX_TOKENS}, got "
                               f"{int(positions.min())}-{int(positions.max())}")

    def take_off(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``keys`` ``[B, H, n, D]`` as they were before RoPE at ``positions`` ``[B, n]``."""
        return unrotate(keys, *self.tables.cos_sin(self.layer, positions.to(keys.device), keys.dtype))

    def put_on(self, keys: torch.Tensor, ordinals: torch.Tensor) -> None:
        """Rotate ``keys`` ``[B, H, m, D]`` (in place) by the positions of the stored keys ``ordinals`` ``[B, m]``
        (-1: padding, which holds zeros)."""
        index = ordinals.clamp(min=0)
        positions = torch.where(ordinals >= 0, torch.gather(self.positions, 1, index.to(torch.long)), 0) \
            if ordinals.numel() else ordinals
        apply_rope(keys, *self.tables.cos_sin(self.layer, positions.long().to(keys.device), keys.dtype))

    def append(self, positions: torch.Tensor, counts: list[int], lengths: list[int]) -> None:
        """Keep the first ``counts[b]`` of ``positions`` ``[B, n]`` as row ``b``'s ordinals from ``lengths[b]``."""
        need = max((length + count for length, count in zip(lengths, counts)), default=0)
        rows, width = len(counts), self.positions.shape[1]
        if self.positions.shape[0] != rows:  # the first write
            self.positions = torch.zeros(rows, 0, dtype=torch.int32)
        if need > width:  # grown like a store's table (by a quarter, at most a chunk of tokens at a time)
            size = next_capacity(width, need, Store.CHUNK_TOKENS, Store.GROWTH)
            self.positions = torch.cat([self.positions, torch.zeros(rows, size - width, dtype=torch.int32)], dim=1)
        new = positions.to("cpu", torch.int32)
        for row, (length, count) in enumerate(zip(lengths, counts)):
            self.positions[row, length : length + count] = new[row, :count]

    def select(self, rows: list[int]) -> None:
        """Keep these rows, in this order (repeats: copies)."""
        if self.positions.shape[0]:
            self.positions = self.positions[torch.tensor(rows, dtype=torch.long)]

    def stacked(self, parts: list[tuple[object, int]]) -> PreRope:
        """A new one whose row ``i`` holds the positions of row ``r`` of the layer ``part`` for ``parts[i] = (part,
        r)`` (a :class:`~kvquant.cache.layer.KVQuantLayer` of a cache of the same model; nothing written: an empty
        row), as :func:`~kvquant.cache.cache.stack_rows` stacks their stores."""
        new = PreRope(self.tables, self.layer)
        counts = [part.k.length(row) if part.is_initialized else 0 for part, row in parts]
        new.positions = torch.zeros(len(parts), max(counts, default=0), dtype=torch.int32)
        for i, ((part, row), count) in enumerate(zip(parts, counts)):
            if count:
                new.positions[i, :count] = part.rope.positions[row, :count]
        return new

    def tensors(self) -> list[torch.Tensor]:
        """What it keeps on the host: the positions and the model's cos/sin tables."""
        return [self.positions, *self.tables.tensors()]
