"""Batched storage of one layer's keys (or values) for every batch row, written and read with batched tensor ops.

Positions of a row count from its first real token (padding is never stored):

    ``[0, s)`` sinks, full precision | ``evicted`` tokens no longer stored | quantized units, each of
    ``codec.tokens_per_unit`` tokens | the tail, full precision (the residual window plus tokens short of a unit)

Shapes (``B`` rows, ``H`` heads, ``D`` head_dim; ``[*u]`` what a codec stores per unit and head, e.g. int4
per-channel keys' payload ``[group, D/2]``):

- ``pool[role]`` ``[N, H, *u]``: one slot per quantized unit, of any row. A unit is encoded once from all of its tokens
  and never modified, so rows share slots freely: a fork (prefix sharing, beam search, ``stack_rows``) copies a row's
  table, not its units. A slot no table holds any more is reused by the next write; a full pool grows
  (:func:`next_capacity`) by a quarter while it is small and by at most :attr:`Store.CHUNK_TOKENS` tokens' units per row
  once it is large, so the slots it reserves for later writes stay below both.
- ``table`` ``[B, U]`` long (CPU): row ``b``'s slots in token order in its first ``units[b]`` columns (-1 after).
- ``sinks`` ``[B, H, S, D]`` and ``tail`` ``[B, H, T, D]``: row ``b`` holds the first ``n_sinks[b]`` /
  ``n_tail[b]`` of them (copied, not shared, by a fork: at most ``S`` and residual + unit tokens).

Units are aligned at position ``s`` of their row and only whole units are evicted, so every stored unit was
encoded from all of its tokens and no unit is ever split: a key group that a sliding window has partly left stays
stored whole, unread, until all of it has left (at most ``tokens_per_unit - 1`` tokens more than the window).
Importance eviction (:mod:`kvquant.cache.eviction`) also keeps, per row, the ordinal of every stored token, those no
longer read (``hidden``) and a score per token; a unit none of whose tokens is read is freed.
"""

from __future__ import annotations

import itertools

import torch

from kvquant.errors import InternalError
from kvquant.formats.quantizers import Codec
from kvquant.cache.reads import Run, last_runs
from kvquant.formats.roles import check_roles


def _rank(real: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` bool -> ``[B, n]`` long: the positions of each row's true entries first, in order."""
    return torch.argsort((~real).to(torch.int8), dim=1, stable=True)


def left_align(states: torch.Tensor, real: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
    """The real positions of each row of ``states`` ``[B, H, n, D]`` moved to its front, zeros after them, and the
    count per row; ``real`` ``[B, n]`` bool (None: every position is real)."""
    batch, n = states.shape[0], states.shape[2]
    if real is None or bool(real.all()):
        return states, [n] * batch
    counts = real.sum(1)
    width = int(counts.max())
    order = _rank(real)[:, :width]
    index = order.to(states.device)[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3])
    moved = torch.gather(states, 2, index)
    keep = (torch.arange(width)[None, :] < counts[:, None]).to(states.device)[:, None, :, None]
    return torch.where(keep, moved, torch.zeros((), dtype=states.dtype, device=states.device)), counts.tolist()


def _shift(x: torch.Tensor, start: list[int], width: int) -> torch.Tensor:
    """``x`` ``[B, H, T, D]`` with row ``b`` starting at its position ``start[b]``, ``width`` positions (a copy)."""
    if len(set(start)) == 1:
        return x[:, :, start[0] : start[0] + width].clone()
    pos = (torch.tensor(start)[:, None] + torch.arange(width)[None, :]).clamp(max=max(x.shape[2] - 1, 0))
    index = pos.to(x.device)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    return torch.gather(x, 2, index)


def spread_to_positions(values: torch.Tensor, real: torch.Tensor | None, m: int, fill: int) -> torch.Tensor:
    """``[B, m]``: row ``b``'s ``values`` ``[B, k]`` in order at the true positions of ``real`` ``[B, m]`` (None: all
    ``m``), ``fill`` elsewhere."""
    rows = values.shape[0]
    if real is None:
        rank, real = torch.arange(m).expand(rows, m), torch.ones(rows, m, dtype=torch.bool)
    else:
        rank = (real.long().cumsum(1) - 1).clamp(min=0)
    picked = torch.gather(values, 1, rank.clamp(max=max(values.shape[1] - 1, 0))) if values.shape[1] else \
        torch.zeros_like(rank)
    return torch.where(real, picked, fill)


def next_capacity(capacity: int, need: int, step: int, factor: float) -> int:
    """The capacity a full pool (or block table) of ``capacity`` grows to when it must hold ``need``: by ``factor``
    while that is less than ``step`` more, by ``step`` after that, and exactly ``need`` when a write needs more. So
    what it reserves beyond ``need`` is below ``capacity * (factor - 1)`` and below ``step``: a quarter at most of a
    small pool (few copies while it is small), at most ``step`` slots of a large one (a long context does not
    reserve a quarter more than it stores; each growth copies the pool, once every ``step`` slots)."""
    return max(need, min(int(capacity * factor) + 1, capacity + step))


class Store:
    """One layer's keys (or values) for all rows; see the module docstring for the layout."""

    #: Factor by which a small full pool grows (see :func:`next_capacity`).
    GROWTH = 1.25
    #: Most tokens per row a growth adds to a large pool (in whole units, at least one): the bound on what a store
    #: reserves for later writes at long contexts. A growth copies the pool once every this many tokens per row
    #: (``experiments/bench_growth.py``, appends alone on the CPU: 1.04-1.15x 1.25x growth's time at 16K tokens,
    #: 1.15-1.64x at 32K; a decode step's read of the whole history is not in that time).
    CHUNK_TOKENS = 256

    def __init__(self, codec: Codec, sink_tokens: int, residual_length: int, like: torch.Tensor, rows: int):
        self.codec, self.sink_tokens, self.residual_length = codec, sink_tokens, residual_length
        self.unit = codec.tokens_per_unit
        heads, head_dim = like.shape[1], like.shape[3]
        self.sinks = like.new_zeros(rows, heads, sink_tokens, head_dim)
        self.tail = like.new_zeros(rows, heads, 0, head_dim)
        self.n_sinks, self.n_tail, self.units, self.evicted = [0] * rows, [0] * rows, [0] * rows, [0] * rows
        self.table = torch.full((rows, 0), -1, dtype=torch.long)
        self.pool: dict[str, torch.Tensor] = {}
        self.top = 0  # slots [0, top) have been written at least once
        self.free = torch.empty(0, dtype=torch.long)  # slots below top that no row holds
        # importance eviction only (see track)
        self.ords: list[list[int]] | None = None
        self.hidden: list[set[int]] = []
        self.scores: list[torch.Tensor] | None = None
        self.score = None

    # -- bookkeeping ------------------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return len(self.units)

    @property
    def heads(self) -> int:
        return self.tail.shape[1]

    @property
    def head_dim(self) -> int:
        return self.tail.shape[3]

    @property
    def step(self) -> int:
        """Units per row a growth adds at most (:attr:`CHUNK_TOKENS`, in whole units)."""
        return max(self.CHUNK_TOKENS // self.unit, 1)

    def stored_tokens(self, row: int) -> int:
        """Tokens stored for ``row``."""
        return self.n_sinks[row] + self.units[row] * self.unit + self.n_tail[row]

    def length(self, row: int) -> int:
        """Tokens ever written to ``row``."""
        return self.stored_tokens(row) + self.evicted[row]

    def track(self, score=None) -> None:
        """Keep ordinals (and scores with ``score``: ``[B, H, n, D]`` states -> ``[B, n]``) for importance eviction;
        before anything is stored."""
        self.ords, self.hidden, self.score = [[] for _ in range(self.rows)], [set() for _ in range(self.rows)], score
        self.scores = [torch.empty(0) for _ in range(self.rows)] if score else None

    # -- writing ----------------------------------------------------------------------------------------------
    def append(self, new: torch.Tensor, counts: list[int]) -> None:
        """Store the first ``counts[b]`` tokens of row ``b`` of ``new`` ``[B, H, n, D]`` (what follows them must be
        zeros): fill each row's sinks, then quantize every whole unit beyond its residual window."""
        if self.ords is not None:
            self._track_new(new, counts)
        if self.sink_tokens:
            taken = self._fill_sinks(new, counts)
        else:
            taken = [0] * self.rows
        tail, n_tail = self._extend_tail(new, counts, taken)
        flush = [max(t - self.residual_length, 0) // self.unit * self.unit for t in n_tail]
        if any(flush):
            self._encode(tail, flush)
        if any(flush):
            tail = _shift(tail, flush, max(t - f for t, f in zip(n_tail, flush)))
        self.tail, self.n_tail = tail, [t - f for t, f in zip(n_tail, flush)]

    def _track_new(self, new: torch.Tensor, counts: list[int]) -> None:
        if self.score:
            scores = torch.zeros(new.shape[0], new.shape[2]) if new.device.type == "meta" else \
                self.score(new).float().cpu()
        for row, count in enumerate(counts):
            self.ords[row] += range(self.length(row), self.length(row) + count)
            if self.score:
                self.scores[row] = torch.cat([self.scores[row], scores[row, :count]])

    def _fill_sinks(self, new: torch.Tensor, counts: list[int]) -> list[int]:
        """Move each row's first tokens into its sinks; returns how many each row took."""
        taken = [min(self.sink_tokens - s, c) for s, c in zip(self.n_sinks, counts)]
        if any(taken):
            rows = [r for r, t in enumerate(taken) for _ in range(t)]
            src = [j for t in taken for j in range(t)]
            dst = [self.n_sinks[r] + j for r, t in enumerate(taken) for j in range(t)]
            self.sinks[rows, :, dst] = new[rows, :, src]
            self.n_sinks = [s + t for s, t in zip(self.n_sinks, taken)]
        return taken

    def _extend_tail(self, new: torch.Tensor, counts: list[int], taken: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Each row's tail followed by its new tokens (after those its sinks took): ``[B, H, T', D]`` and the
        lengths."""
        lengths = [t + c - k for t, c, k in zip(self.n_tail, counts, taken)]
        uniform = len(set(self.n_tail)) == 1 and not any(taken) and len(set(counts)) == 1
        if uniform:
            return torch.cat([self.tail[:, :, : self.n_tail[0]], new[:, :, : counts[0]]], dim=2), lengths
        width = max(lengths)
        both = torch.cat([self.tail, new], dim=2)
        pos = torch.arange(width)[None, :]
        old = torch.tensor(self.n_tail)[:, None]
        index = torch.where(pos < old, pos, self.tail.shape[2] + torch.tensor(taken)[:, None] + pos - old)
        index = index.clamp(max=both.shape[2] - 1)
        gathered = torch.gather(both, 2, index.to(both.device)[:, None, :, None].expand(
            -1, both.shape[1], -1, both.shape[3]))
        keep = (pos < torch.tensor(lengths)[:, None]).to(both.device)[:, None, :, None]
        return torch.where(keep, gathered, torch.zeros((), dtype=both.dtype, device=both.device)), lengths

    def _encode(self, tail: torch.Tensor, flush: list[int]) -> None:
        """Quantize row ``b``'s first ``flush[b]`` tail tokens (whole units) into new slots of its table. All rows
        are encoded in one call; a row's tokens beyond its flush are zeroed first, so they cannot reach any scale
        (every codec's scale is a max over its unit or over the row's write, which zeros do not change)."""
        width = max(flush)
        x = tail[:, :, :width]
        if len(set(flush)) > 1:
            keep = (torch.arange(width)[None, :] < torch.tensor(flush)[:, None]).to(x.device)[:, None, :, None]
            x = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
        enc = self.codec.encode(x)  # role -> [B, H, width / unit, *u]
        new_units = [f // self.unit for f in flush]
        chosen = torch.arange(width // self.unit)[None, :] < torch.tensor(new_units)[:, None]  # [B, width / unit]
        picks = chosen.flatten().nonzero()[:, 0]  # row-major: rows, then units (on the CPU: meta tensors hold none)
        slots = self._allocate(len(picks), enc)
        for role, value in enc.items():
            picked = value.transpose(1, 2).flatten(0, 1).index_select(0, picks.to(value.device))  # [K, H, *u]
            self.pool[role][slots.to(value.device)] = picked
        need = max(u + n for u, n in zip(self.units, new_units))
        if need > self.table.shape[1]:  # grown like the pool, so a decode step does not copy the table
            more = next_capacity(self.table.shape[1], need, self.step, self.GROWTH) - self.table.shape[1]
            self.table = torch.cat([self.table, torch.full((self.rows, more), -1, dtype=torch.long)], dim=1)
        rows = picks // chosen.shape[1]  # picks run row by row, unit j of row r at r * width / unit + j
        cols = torch.tensor(self.units, dtype=torch.long)[rows] + picks % chosen.shape[1]
        self.table[rows, cols] = slots
        self.units = [u + n for u, n in zip(self.units, new_units)]

    def _allocate(self, count: int, like: dict[str, torch.Tensor]) -> torch.Tensor:
        """``count`` slots no row holds: freed ones first, then new ones (growing the pool)."""
        reuse = self.free[:count]
        self.free = self.free[count:]
        fresh = count - len(reuse)
        if not self.pool:
            check_roles(self.codec, like)  # a stored tensor of no declared role is refused before it is stored
            self.pool = {role: v.new_empty(0, v.shape[1], *v.shape[3:]) for role, v in like.items()}
        capacity = next(iter(self.pool.values())).shape[0]
        if self.top + fresh > capacity:
            size = next_capacity(capacity, self.top + fresh, self.rows * self.step, self.GROWTH)
            self.pool = {role: torch.cat([p, p.new_empty(size - capacity, *p.shape[1:])]) for role, p in
                         self.pool.items()}
        slots = torch.cat([reuse, torch.arange(self.top, self.top + fresh, dtype=torch.long)])
        self.top += fresh
        return slots

    def reclaim(self) -> None:
        """Find the slots no row holds any more (after an eviction or a selection of rows)."""
        held = torch.zeros(self.top, dtype=torch.bool)
        held[self.table[self.table >= 0]] = True
        self.free = (~held).nonzero()[:, 0]

    # -- reading ----------------------------------------------------------------------------------------------
    def decode_units(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every row's units dequantized, ``[B, H, U * unit, D]`` for ``U = max(units)`` (a row's units past its
        own count are another slot's, unread); into ``out`` when given."""
        width = max(self.units, default=0)
        if out is None:
            out = self.tail.new_empty(self.rows, self.heads, width * self.unit, self.head_dim)
        if width:
            self.codec.decode_slots_into(self.pool, self.table[:, :width], out)
        return out

    def read(self, out: torch.Tensor, real: torch.Tensor | None, counts: list[int]) -> None:
        """Write each row's last ``counts[b]`` stored tokens, dequantized, at its real positions of ``out``
        ``[B, H, m, D]`` (``real`` ``[B, m]`` bool, None: all), zeros at padding. With sinks, a row short of room
        gets its sinks and then its last ``counts[b] - sinks`` tokens (room is short only when an eviction window
        has left part of a unit, which stays stored, unread, right after the sinks); with hidden tokens
        (importance eviction), the last ``counts[b]`` of those still read."""
        m = out.shape[2]
        n_sinks, units, n_tail = self.n_sinks, self.units, self.n_tail
        simple = real is None and len(set(n_sinks)) == 1 and len(set(units)) == 1 and len(set(n_tail)) == 1 and \
            not any(self.hidden) and all(self.stored_tokens(r) == m for r in range(self.rows))
        if simple:
            s, q = n_sinks[0], units[0] * self.unit
            out[:, :, :s] = self.sinks[:, :, :s]
            if q:
                self.decode_units(out[:, :, s : s + q])
            out[:, :, s + q :] = self.tail[:, :, : n_tail[0]]
            return
        width = max(units, default=0) * self.unit
        S, T = self.sinks.shape[2], self.tail.shape[2]
        buf = out.new_empty(self.rows, self.heads, S + width + T + 1, self.head_dim)
        buf[:, :, :S] = self.sinks
        self.decode_units(buf[:, :, S : S + width])
        buf[:, :, S + width : S + width + T] = self.tail
        buf[:, :, -1] = 0
        index = spread_to_positions(self._sources(counts, S, width), real, m, buf.shape[2] - 1)
        torch.gather(buf, 2, index.to(buf.device)[:, None, :, None].expand(-1, self.heads, -1, self.head_dim),
                     out=out)

    def _order(self, row: int, count: int) -> list[int]:
        """Stored positions (``0..stored``) of the ``count`` tokens row ``row`` returns, in order."""
        stored, s = self.stored_tokens(row), self.n_sinks[row]
        if self.ords is not None and self.hidden[row]:
            hidden = self.hidden[row]
            visible = [i for i, o in enumerate(self.ords[row]) if o not in hidden]
            return visible[len(visible) - count :]
        if s and count < stored:
            return [*range(s), *range(stored - (count - s), stored)]
        return list(range(stored - count, stored))

    def _positions(self, counts: list[int]) -> torch.Tensor:
        """``[B, max(counts)]``: the stored positions (``0..stored``) of the tokens each row returns, in order."""
        most = max(counts, default=0)
        if self.ords is None or not any(self.hidden):
            r = torch.arange(most)[None, :]
            stored = torch.tensor([self.stored_tokens(b) for b in range(self.rows)])[:, None]
            sinks, count = torch.tensor(self.n_sinks)[:, None], torch.tensor(counts)[:, None]
            pinned = (sinks > 0) & (count < stored) & (r < sinks)
            return torch.where(pinned, r, stored - count + r).clamp(min=0)
        position = torch.zeros(self.rows, most, dtype=torch.long)
        for b, count in enumerate(counts):  # importance eviction: the rows' visible tokens differ
            if count:
                position[b, :count] = torch.tensor(self._order(b, count))
        return position

    def ordinals(self, real: torch.Tensor | None, counts: list[int], m: int) -> torch.Tensor:
        """``[B, m]``: which token ever written to its row (its ordinal, 0 = the row's first real token) :meth:`read`
        puts at each position of its ``out`` for the same ``real`` and ``counts``; -1 at padding. Not with importance
        eviction (whose hidden tokens break the sinks-then-last-tokens order)."""
        if self.ords is not None:
            raise InternalError("Store.ordinals with importance eviction; please report this")
        position, sinks = self._positions(counts), torch.tensor(self.n_sinks)[:, None]
        ordinal = torch.where(position < sinks, position, position + torch.tensor(self.evicted)[:, None])
        return spread_to_positions(ordinal, real, m, -1)

    def _sources(self, counts: list[int], S: int, width: int) -> torch.Tensor:
        """``[B, max(counts)]``: the buffer positions (sinks at 0, units at ``S``, tail at ``S + width``) of the
        tokens each row returns, in order."""
        position = self._positions(counts)
        sinks = torch.tensor(self.n_sinks)[:, None]
        quantized = (torch.tensor(self.units) * self.unit)[:, None]
        return torch.where(position < sinks, position,
                           torch.where(position < sinks + quantized, S + position - sinks,
                                       S + width + position - sinks - quantized))

    def read_runs(self, row: int, m: int) -> list[Run]:
        """Which of the ``m`` tokens row ``row`` returns are stored quantized, as runs in read order (sinks and
        tail are full precision)."""
        s, q, t = self.n_sinks[row], self.units[row] * self.unit, self.n_tail[row]
        if self.ords is not None and self.hidden[row]:
            flags = [s <= i < s + q for i in self._order(row, m)]
            return [(flag, len(list(run))) for flag, run in itertools.groupby(flags)]
        if s and m < self.stored_tokens(row):
            return [(False, s), *last_runs([(True, q), (False, t)], m - s)]
        return last_runs([(False, s), (True, q), (False, t)], m)

    # -- eviction ---------------------------------------------------------------------------------------------
    def evict(self, keep: list[int]) -> None:
        """Forget each row's oldest tokens after its sinks in whole units so that at least ``keep[b]`` tokens stay
        (the sinks and the last ``keep[b] - sinks``)."""
        drop = [max(self.length(b) - k, 0) // self.unit * self.unit - self.evicted[b] for b, k in enumerate(keep)]
        if not any(d > 0 for d in drop):
            return
        drop = [max(d, 0) for d in drop]
        from_units = [min(d, u * self.unit) // self.unit for d, u in zip(drop, self.units)]
        from_tail = [d - f * self.unit for d, f in zip(drop, from_units)]
        if any(from_units):
            width = max(u - f for u, f in zip(self.units, from_units))
            pos = torch.tensor(from_units)[:, None] + torch.arange(width)[None, :]
            left = torch.tensor([u - f for u, f in zip(self.units, from_units)])[:, None]
            table = torch.gather(self.table, 1, pos.clamp(max=max(self.table.shape[1] - 1, 0))) if width else \
                self.table[:, :0]
            self.table = torch.where(torch.arange(width)[None, :] < left, table, -1)
            self.units = [u - f for u, f in zip(self.units, from_units)]
            self.reclaim()
        if any(from_tail):
            width = max(t - f for t, f in zip(self.n_tail, from_tail))
            self.tail = _shift(self.tail, from_tail, width)
            self.n_tail = [t - f for t, f in zip(self.n_tail, from_tail)]
        self.evicted = [e + d for e, d in zip(self.evicted, drop)]

    def hide(self, row: int, ords: list[int]) -> None:
        """Stop reading these tokens of ``row`` (by ordinal); units none of whose tokens are read any more are
        freed."""
        hidden = self.hidden[row]
        hidden.update(ords)
        unit, s = self.unit, self.n_sinks[row]
        row_ords = self.ords[row]
        gone = [j for j in range(self.units[row])
                if all(o in hidden for o in row_ords[s + j * unit : s + (j + 1) * unit])]
        if not gone:
            return
        kept = [j for j in range(self.units[row]) if j not in set(gone)]
        slots = self.table[row, kept].clone()
        self.table[row] = -1
        self.table[row, : len(kept)] = slots
        self.units[row] = len(kept)
        drop = {i for j in gone for i in range(s + j * unit, s + (j + 1) * unit)}
        stay = [i for i in range(len(row_ords)) if i not in drop]
        hidden -= {row_ords[i] for i in drop}
        self.ords[row] = [row_ords[i] for i in stay]
        if self.scores is not None:
            self.scores[row] = self.scores[row][stay]
        self.evicted[row] += len(drop)
        self.reclaim()

    def read_ordinals(self, row: int) -> list[int]:
        """Ordinals of the stored tokens of ``row`` still read, in order (importance eviction)."""
        return [o for o in self.ords[row] if o not in self.hidden[row]]

    # -- rows -------------------------------------------------------------------------------------------------
    def select(self, rows: list[int]) -> None:
        """Keep these rows in this order; a row listed several times becomes copies that share its units."""
        index = torch.tensor(rows, dtype=torch.long)
        self.table = self.table[index]
        self.sinks, self.tail = self.sinks[index.to(self.sinks.device)], self.tail[index.to(self.tail.device)]
        for name in ("n_sinks", "n_tail", "units", "evicted"):
            setattr(self, name, [getattr(self, name)[r] for r in rows])
        if self.ords is not None:
            self.ords = [list(self.ords[r]) for r in rows]
            self.hidden = [set(self.hidden[r]) for r in rows]
            if self.scores is not None:
                self.scores = [self.scores[r] for r in rows]
        self.reclaim()

    def empty_like(self, rows: int) -> Store:
        """A store with the same settings and ``rows`` empty rows."""
        new = Store(self.codec, self.sink_tokens, self.residual_length, self.tail, rows)
        if self.ords is not None:
            new.track(self.score)
        return new

    @staticmethod
    def stack(parts: list[tuple[Store, int]]) -> Store:
        """A store whose row ``i`` is row ``r`` of store ``s`` for ``parts[i] = (s, r)`` (``s`` None: an empty
        row; at least one store given). The units the rows hold are copied into one pool (rows of the same store
        go on sharing theirs)."""
        template = next(s for s, _ in parts if s is not None)
        new = template.empty_like(len(parts))
        stores = list({id(s): s for s, _ in parts if s is not None}.values())
        pools, remap, base = {}, {}, 0
        for s in stores:  # the slots any chosen row holds, numbered anew
            rows = [r for t, r in parts if t is s]
            used = torch.unique(s.table[rows][s.table[rows] >= 0])
            lookup = torch.full((max(s.top, 1),), -1, dtype=torch.long)
            lookup[used] = torch.arange(base, base + len(used))
            remap[id(s)] = lookup
            for role, p in s.pool.items():
                pools.setdefault(role, []).append(p.index_select(0, used.to(p.device)))
            base += len(used)
        new.pool = {role: torch.cat(chunks) for role, chunks in pools.items()}
        new.top = base
        width = max((s.units[r] for s, r in parts if s is not None), default=0)
        new.table = torch.full((len(parts), width), -1, dtype=torch.long)
        for i, (s, r) in enumerate(parts):
            if s is None:
                continue
            held = s.table[r, : s.units[r]]
            new.table[i, : len(held)] = remap[id(s)][held]
            new.n_sinks[i], new.n_tail[i], new.units[i], new.evicted[i] = s.n_sinks[r], s.n_tail[r], s.units[r], \
                s.evicted[r]
            if s.ords is not None:
                new.ords[i], new.hidden[i] = list(s.ords[r]), set(s.hidden[r])
                if s.scores is not None:
                    new.scores[i] = s.scores[r]
        tails = max(new.n_tail, default=0)
        new.tail = template.tail.new_zeros(len(parts), template.heads, tails, template.head_dim)
        for i, (s, r) in enumerate(parts):
            if s is not None:
                new.sinks[i] = s.sinks[r]
                new.tail[i, :, : s.n_tail[r]] = s.tail[r, :, : s.n_tail[r]]
        return new

    # -- memory -----------------------------------------------------------------------------------------------
    def slot_bytes(self) -> dict[str, int]:
        """Bytes of one slot, by role."""
        return {role: p[0].numel() * p.element_size() if p.shape[0] else 0 for role, p in self.pool.items()}

    def holders(self) -> torch.Tensor:
        """``[top]``: how many rows hold each slot."""
        held = self.table[self.table >= 0]
        return torch.bincount(held, minlength=self.top) if held.numel() else torch.zeros(self.top, dtype=torch.long)

    def full_precision_bytes(self) -> int:
        """Bytes of the rows' sinks and tails."""
        token = self.heads * self.head_dim * self.tail.element_size()
        return (sum(self.n_sinks) + sum(self.n_tail)) * token

    def reserved_bytes(self) -> int:
        """Bytes of this store's tensors that hold no token: pool slots no row holds (never written yet, or freed),
        sink positions not yet filled, and tail positions past a row's own tail (rows of unequal tails). With the
        stored bytes (the held slots and :meth:`full_precision_bytes`) they make every byte of the pool, the sinks
        and the tail."""
        live = int((self.holders() > 0).sum())
        capacity = next(iter(self.pool.values())).shape[0] if self.pool else 0
        pool = (capacity - live) * sum(self.slot_bytes().values())
        windows = sum(t.numel() * t.element_size() for t in (self.sinks, self.tail))
        return pool + windows - self.full_precision_bytes()

    def host_tensors(self) -> list[torch.Tensor]:
        """The bookkeeping this store keeps on the CPU whatever its device: the block table (8 bytes per unit column
        and row, grown like the pool), the list of free slots and, with importance eviction, each row's token scores
        (rows a fork copied share theirs)."""
        return [self.table, self.free, *(self.scores or ())]
