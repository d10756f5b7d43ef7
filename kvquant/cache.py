"""The one module that touches transformers' cache internals (``transformers.cache_utils``).

``make_cache(model, "int4")`` returns a :class:`KVQuantCache`, a ``transformers.Cache`` whose layers store
keys and values quantized *on write*: every ``update`` quantizes what it can of the new states (all but the
sink tokens, the residual window and an incomplete key group) and returns the dequantized view of the whole
layer, the current call's tokens included. A single forward pass (simulated mode) and chunked or
token-by-token feeding (streaming mode) therefore both attend to quantized K/V.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import numbers
import re

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, get_layer_types_and_kwargs

from .errors import InternalError, KVQuantError, NonFiniteKVError, one_line
from .eviction import Eviction, get_eviction
from .quantizers import QUANTIZERS, Codec, Quantizer, available_quantizers, get_quantizer
from .reads import Reads, Run, last_runs

FP16_BYTES = 2
SLIDING_TYPES = ("sliding_attention", "chunked_attention")
_ROLE = {"payload": "payload_bytes", "scale": "scale_bytes", "zero": "scale_bytes", "full": "full_precision_bytes"}
#: make_cache's own options (the others are the quantizer's)
CACHE_OPTIONS = ("budget", "eviction", "layers", "residual_length", "sink_tokens", "window")
STATES = "[batch, heads, tokens, head_dim]"


def _shown(value) -> str:
    """``value`` as an error message shows it, on one short line: its type and repr (a tensor's or array's shape)."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D tensor {tuple(value.shape)} of {value.dtype}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # numpy and the like
        return f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = re.sub(r"\s+", " ", repr(value))
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _is_int(value) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_layer_index(where: str, layer_idx, count: int) -> None:
    if type(layer_idx) is not int or not 0 <= layer_idx < count:  # bools, floats and tensors are no layer index
        raise KVQuantError(f"{where}: layer_idx must be an integer in 0-{count - 1} (the model's layers), got "
                           f"{_shown(layer_idx)}")


def _row_list(where: str, name: str, rows, count: int | None) -> list[int]:
    """``rows`` (a list or tuple of row numbers or a 1-D integer tensor) as a list of ints, each in ``[0, count)``
    (``count`` None: the cache's rows are not known yet, only negative rows are refused)."""
    valid = "a list of row numbers or a 1-D integer tensor"
    if isinstance(rows, torch.Tensor):
        if rows.dim() != 1 or rows.dtype == torch.bool or rows.is_floating_point() or rows.is_complex():
            raise KVQuantError(f"{where}: {name} must be {valid}, got {_shown(rows)}")
        if rows.device.type == "meta":
            raise KVQuantError(f"{where}: {name} is a meta tensor, which holds no row numbers")
        rows = rows.tolist()
    elif isinstance(rows, (list, tuple, range)):
        bad = next((r for r in rows if not _is_int(r)), rows)
        if bad is not rows:
            raise KVQuantError(f"{where}: {name} must be {valid}, got {_shown(bad)} in {_shown(rows)}")
        rows = [int(r) for r in rows]
    else:
        raise KVQuantError(f"{where}: {name} must be {valid}, got {_shown(rows)}")
    if not rows:
        raise KVQuantError(f"{where}: {name} lists no rows; give at least one row number")
    bad = next((r for r in rows if r < 0 or (count is not None and r >= count)), None)
    if bad is not None:
        held = f"the cache holds rows 0-{count - 1}" if count else "rows are numbered from 0"
        raise KVQuantError(f"{where}: {name} names row {bad}; {held}")
    return rows


class _Stream:
    """Keys (or values) of one batch row in one layer. Positions count from the row's first real token:

    ``[0, s)`` sinks, full precision ``[1, H, s, D]`` | ``evicted`` tokens a window dropped | quantized units
    (dim 2 counts units of ``codec.tokens_per_unit`` tokens): ``shared`` segments, then the stream's own
    ``enc`` | ``tail`` full precision ``[1, H, t, D]`` (the residual window plus tokens short of a whole unit).

    Units are aligned at position ``s`` and only whole units are ever evicted, so every stored unit was encoded from
    all of its tokens and no unit is ever split: a key group that a sliding window has partly left stays stored
    whole (at most ``tokens_per_unit - 1`` tokens more than the window) until all of it has left. Stored counts are
    derived from the tensors; ``evicted`` is the one count of what is no longer stored. Tensors are never modified
    in place, so forks share them safely: :meth:`fork` turns the units stored so far into a ``shared`` segment that
    the stream and its copy both hold (the same tensors, stored once: prefix sharing, beam search), and each
    writes its own units after it. A ``paged`` stream (one that evicts) stores each shared segment as up to
    :attr:`PAGES` pages, each its own storage, so the pages every fork has evicted are freed (a fork that evicts
    only part of a page keeps a view of it, and the page stays whole until no fork holds it).
    """

    #: Shared segments kept before they are merged into one (a copy) so reads stay cheap (beam search forks often).
    MAX_SEGMENTS = 16
    #: Pages a paged stream cuts a shared segment into (eviction frees a shared prefix this finely).
    PAGES = 8

    def __init__(self, codec: Codec, sink_tokens: int, residual_length: int, like: torch.Tensor,
                 paged: bool = False):
        self.codec, self.sink_tokens, self.residual_length = codec, sink_tokens, residual_length
        self.paged = paged
        empty = like.new_empty(1, like.shape[1], 0, like.shape[3])
        self.sinks, self.tail = empty, empty
        self.shared: tuple[dict[str, torch.Tensor], ...] = ()
        self.enc: dict[str, torch.Tensor] = {}
        self.evicted = 0
        # importance eviction only: the ordinal (n-th token of the row) of every stored token, the ordinals stored
        # but no longer read, and a score per stored token (``score``: ``[1, H, n, D]`` states -> ``[n]``)
        self.ords: list[int] | None = None
        self.hidden: set[int] = set()
        self.scores: torch.Tensor | None = None
        self.score = None

    def track(self, score=None) -> None:
        """Keep ordinals (and scores with ``score``) for importance eviction; before anything is stored."""
        self.ords, self.score = [], score
        self.scores = torch.empty(0) if score else None

    def fork(self) -> _Stream:
        """A copy that shares every stored tensor with this stream; both write apart from here on."""
        if self.enc:
            self.shared, self.enc = self.shared + self._pages(self.enc), {}
            if len(self.shared) > self.MAX_SEGMENTS * (self.PAGES if self.paged else 1):
                self.shared = ({k: torch.cat([seg[k] for seg in self.shared], dim=2) for k in self.shared[0]},)
        twin = copy.copy(self)
        if self.ords is not None:  # the bookkeeping is mutable: each fork keeps its own
            twin.ords, twin.hidden = list(self.ords), set(self.hidden)
        return twin

    def _pages(self, segment: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], ...]:
        """``segment`` as it is shared: whole, or (paged) cut into up to :attr:`PAGES` pages of whole units, each
        copied into its own storage."""
        units = self._units(segment)
        if not self.paged or units < 2:
            return (segment,)
        size = -(-units // self.PAGES)
        return tuple({k: v[:, :, i : i + size].clone() for k, v in segment.items()} for i in range(0, units, size))

    def segments(self) -> list[dict[str, torch.Tensor]]:
        """The quantized units in order: the shared segments, then the stream's own."""
        return [*self.shared, self.enc] if self.enc else list(self.shared)

    def empty(self) -> _Stream:
        """A stream with the same settings and nothing stored."""
        new = _Stream(self.codec, self.sink_tokens, self.residual_length, self.tail, self.paged)
        if self.ords is not None:
            new.track(self.score)
        return new

    @staticmethod
    def _units(segment: dict[str, torch.Tensor]) -> int:
        return next(iter(segment.values())).shape[2]

    @property
    def n_enc(self) -> int:
        """Tokens held in quantized units."""
        return sum(self._units(seg) for seg in self.segments()) * self.codec.tokens_per_unit

    def __len__(self) -> int:
        """Tokens stored."""
        return self.sinks.shape[2] + self.n_enc + self.tail.shape[2]

    @property
    def length(self) -> int:
        """Tokens ever written to this row."""
        return len(self) + self.evicted

    def append(self, x: torch.Tensor, name: str, checked: bool = False) -> None:
        """Store ``x`` ``[1, H, n, D]``: fill the sinks, then quantize every whole unit beyond the residual window.
        ``checked``: the caller has already found ``x`` storable (:func:`_fits`)."""
        if not checked:
            _check_states(x, self.codec.max_abs, name)
        if self.ords is not None:
            self.ords += range(self.length, self.length + x.shape[2])
            if self.score:  # shapes only (the planner): no data, every token scores alike
                scores = torch.zeros(x.shape[2]) if x.device.type == "meta" else self.score(x).float().cpu()
                self.scores = torch.cat([self.scores, scores])
        take = min(self.sink_tokens - self.sinks.shape[2], x.shape[2])
        if take > 0:
            self.sinks = torch.cat([self.sinks, x[:, :, :take]], dim=2)
            x = x[:, :, take:]
        self.tail = torch.cat([self.tail, x], dim=2)
        unit = self.codec.tokens_per_unit
        flush = (self.tail.shape[2] - self.residual_length) // unit * unit
        if flush > 0:
            new = self.codec.encode(self.tail[:, :, :flush])
            self.enc = {k: torch.cat([self.enc[k], v], dim=2) for k, v in new.items()} if self.enc else new
            self.tail = self.tail[:, :, flush:].clone()  # a slice would keep the whole block alive

    def evict(self, keep: int) -> None:
        """Forget the oldest tokens after the sinks in whole units so that at least ``keep`` tokens stay (the
        sinks and the last ``keep - sinks``)."""
        unit = self.codec.tokens_per_unit
        drop = max(self.length - keep, 0) // unit * unit - self.evicted
        if drop <= 0:
            return
        from_enc = min(drop, self.n_enc)
        units = from_enc // unit  # the oldest units go: shared segments first, then the stream's own
        shared = []
        for seg in self.shared:
            n = self._units(seg)
            if units >= n:
                units -= n
                continue
            # a view: the segment stays one storage that every fork holding it shares (and it is freed only when
            # none holds it any more), where a copy per fork would undo the sharing
            shared.append({k: v[:, :, units:] for k, v in seg.items()} if units else seg)
            units = 0
        self.shared = tuple(shared)
        if units:
            kept = units < self._units(self.enc)
            self.enc = {k: v[:, :, units:].clone() for k, v in self.enc.items()} if kept else {}
        if drop > from_enc:
            self.tail = self.tail[:, :, drop - from_enc :].clone()
        self.evicted += drop

    def hide(self, ords: list[int]) -> None:
        """Stop reading these tokens (by ordinal); units none of whose tokens are read any more are freed."""
        self.hidden.update(ords)
        unit, s = self.codec.tokens_per_unit, self.sinks.shape[2]
        units = self.n_enc // unit
        gone = [j for j in range(units) if all(o in self.hidden for o in self.ords[s + j * unit : s + (j + 1) * unit])]
        if not gone:
            return
        keep = torch.tensor([j for j in range(units) if j not in set(gone)], dtype=torch.long)
        merged = {k: torch.cat([seg[k] for seg in self.segments()], dim=2) for k in self.segments()[0]}
        self.shared, self.enc = (), ({k: v.index_select(2, keep.to(v.device)) for k, v in merged.items()}
                                     if len(keep) else {})
        drop = {i for j in gone for i in range(s + j * unit, s + (j + 1) * unit)}
        stay = [i for i in range(len(self.ords)) if i not in drop]
        self.hidden -= {self.ords[i] for i in drop}
        self.ords = [self.ords[i] for i in stay]
        if self.scores is not None:
            self.scores = self.scores[stay]
        self.evicted += len(drop)

    def visible(self) -> list[int]:
        """Ordinals of the stored tokens still read, in order (importance eviction)."""
        return [o for o in self.ords if o not in self.hidden]

    def materialize_into(self, out: torch.Tensor) -> None:
        """Write the last ``m`` stored tokens, dequantized, into ``out`` ``[1, H, m, D]`` (``m <= len(self)``);
        with sinks, the sinks and the last ``m - sinks`` tokens (``m < len(self)`` only when an eviction window
        has left part of a unit, which stays stored, unread, right after the sinks); with hidden tokens
        (importance eviction), the last ``m`` of those still read."""
        s, q, m = self.sinks.shape[2], self.n_enc, out.shape[2]
        if self.hidden:
            whole = out.new_empty(1, out.shape[1], len(self), out.shape[3])
            hidden, self.hidden = self.hidden, set()
            try:
                self.materialize_into(whole)
            finally:
                self.hidden = hidden
            read = torch.tensor([i for i, o in enumerate(self.ords) if o not in hidden][len(self) - len(hidden) - m :])
            out.copy_(whole.index_select(2, read.to(whole.device)))
            return
        if s and m < len(self):
            out[:, :, :s] = self.sinks
            out = out[:, :, s:]
            m = out.shape[2]
        skip = len(self) - m  # stored tokens in front of what is asked for
        if skip < s:
            out[:, :, : s - skip] = self.sinks[:, :, skip:]
        first = max(skip - s, 0)  # first quantized token asked for
        unit, a = self.codec.tokens_per_unit, 0
        for seg in self.segments():  # segment tokens [a, b) of the quantized ones
            b = a + self._units(seg) * unit
            if first < b:
                local = max(first - a, 0)
                enc = {k: v[:, :, local // unit :] for k, v in seg.items()} if local >= unit else seg
                dst = out[:, :, s + a + local - skip : s + b - skip]
                if local % unit:  # starts inside a unit: decode the whole unit aside
                    whole = out.new_empty(1, out.shape[1], b - a - local // unit * unit, out.shape[3])
                    self.codec.decode_into(enc, whole)
                    dst.copy_(whole[:, :, local % unit :])
                else:
                    self.codec.decode_into(enc, dst)
            a = b
        first = max(skip - s - q, 0)
        out[:, :, s + q + first - skip :] = self.tail[:, :, first:]

    def read_runs(self, m: int) -> list[Run]:
        """Which of the ``m`` tokens :meth:`materialize_into` reads are stored quantized, as runs in read order
        (sinks and ``tail`` are full precision)."""
        s, q, t = self.sinks.shape[2], self.n_enc, self.tail.shape[2]
        if self.hidden:
            flags = [s <= i < s + q for i, o in enumerate(self.ords) if o not in self.hidden]
            return [(flag, len(list(run))) for flag, run in itertools.groupby(flags[len(flags) - m :])]
        if s and m < len(self):
            return [(False, s), *last_runs([(True, q), (False, t)], m - s)]
        return last_runs([(False, s), (True, q), (False, t)], m)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every stored tensor with its role key (shared ones included)."""
        return [("sinks", self.sinks), ("tail", self.tail), *(item for seg in self.segments() for item in seg.items())]

    def shareable(self) -> list[torch.Tensor]:
        """What a fork would share with this stream from here on: the quantized units, and the sinks once they
        are complete (until then the next write replaces them)."""
        full = self.sinks.shape[2] == self.sink_tokens and self.sink_tokens > 0
        return [*([self.sinks] if full else []), *(t for seg in self.segments() for t in seg.values())]


def _storage(t: torch.Tensor) -> tuple[object, int]:
    """What holds ``t``'s data and its size: views of one storage (forks that evicted part of a shared segment)
    are one storage, counted once and whole. Shape-only (meta) tensors have no storage: each is its own."""
    if t.device.type == "meta":
        return ("meta", id(t)), t.numel() * t.element_size()
    storage = t.untyped_storage()
    return (t.device, storage.data_ptr()), storage.nbytes()


def _block(key_codec: Codec, value_codec: Codec) -> int:
    """Tokens of the smallest block made of whole units of both streams."""
    return math.lcm(key_codec.tokens_per_unit, value_codec.tokens_per_unit)


def check_importance(policy: Eviction, key_codec: Codec, value_codec: Codec, residual_length: int) -> None:
    """An importance policy evicts whole blocks (:func:`_block`) from before its window: the window must cover the
    full-precision tail and the budget hold a block's worth of tokens."""
    block = _block(key_codec, value_codec)
    if policy.window < residual_length + block - 1:
        raise KVQuantError(f"eviction {policy.name!r}: window {policy.window} must cover residual_length "
                           f"{residual_length} plus a quantized unit ({block} tokens) - 1 = "
                           f"{residual_length + block - 1}")
    if policy.budget < block - 1:
        raise KVQuantError(f"eviction {policy.name!r}: budget {policy.budget} must be at least a quantized unit "
                           f"({block} tokens) - 1")


def _fits(x: torch.Tensor, max_abs: float) -> bool:
    """Every element of ``x`` is finite and within ``±max_abs`` (one reduction; true for shapes-only tensors)."""
    if x.device.type == "meta" or not x.numel():  # shapes only (capacity planning): nothing to check
        return True
    amax = float(x.abs().amax())
    return math.isfinite(amax) and amax <= max_abs


def _check_states(x: torch.Tensor, max_abs: float, name: str) -> None:
    if _fits(x, max_abs):
        return
    amax = float(x.abs().amax())
    if not torch.isfinite(x).all():
        raise NonFiniteKVError(
            f"{name} hold NaN or Inf; kvquant does not store non-finite states, since one of them would corrupt the "
            "scale of its whole group. Check the model's dtype (fp16 overflow) and inputs."
        )
    raise KVQuantError(f"{name} reach |x| = {amax:.4g}, beyond the ±{max_abs:.4g} its scales and zero points "
                       "can hold (scale_dtype='float32' holds more)")


def _write(stream: _Stream, states: torch.Tensor, span: tuple[int, int, int], real, name: str,
           checked: bool) -> None:
    """Append the real positions of one row's ``states`` ``[1, H, n, D]``: ``span`` as from :meth:`Padding.spans`;
    ``real()`` gives the ``[n]`` bool mask when they are not one block."""
    count, first, last = span
    if count == last - first:
        if count:
            stream.append(states if count == states.shape[2] else states[:, :, first:last], name, checked)
    else:
        stream.append(states[:, :, real().nonzero()[:, 0]], name, checked)


def _read(stream: _Stream, out: torch.Tensor, span: tuple[int, int, int], real) -> None:
    """Write one row's visible window into ``out`` ``[1, H, m, D]``: its last stored tokens at the real positions
    (``span`` and ``real()`` as for :func:`_write`), zeros at padding."""
    count, first, last = span
    if count == last - first:  # one block (left or right padding): write in place
        if count:
            stream.materialize_into(out[:, :, first:last])
        if first:
            out[:, :, :first] = 0
        if last < out.shape[2]:
            out[:, :, last:] = 0
        return
    out.zero_()
    block = out.new_empty(*out.shape[:2], count, out.shape[3])
    stream.materialize_into(block)
    out.index_copy_(2, real().nonzero()[:, 0].to(out.device), block)


class Padding:
    """Which positions of each batch row hold real tokens; the rest is padding, which a cache never stores.

    ``mask`` ``[B, T]`` bool covers the positions declared so far (:meth:`KVQuantCache.set_padding`); positions
    beyond it are real. One object is shared by all layers of a cache.
    """

    def __init__(self):
        self.mask: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor | None:
        return self._mask

    @mask.setter
    def mask(self, value: torch.Tensor | None) -> None:
        self._mask = value
        self._spans: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}  # every layer asks the same

    def spans(self, start: int, stop: int, batch: int) -> list[tuple[int, int, int]]:
        """Per row ``(count, first, last)``: real tokens among positions ``[start, stop)``, and the bounds (from
        ``start``) of the block they span; ``count == last - first`` when they are one block (padding only in
        front or behind). Worked out once per mask and range, since all layers of a forward ask the same."""
        key = (start, stop, batch)
        if self.mask is None or stop <= start:
            return [(max(stop - start, 0), 0, max(stop - start, 0))] * batch
        if key not in self._spans:
            real = self.real(start, stop, batch)
            counts = real.sum(1).tolist()
            ends = torch.where(real.any(1), real.int().argmax(1), 0).tolist()  # first real position
            lasts = torch.where(real.any(1), real.shape[1] - real.flip(1).int().argmax(1), 0).tolist()
            self._spans[key] = list(zip(counts, ends, lasts))
        return self._spans[key]

    def declare(self, attention_mask: torch.Tensor, written: int, rows: int | None) -> None:
        """Take the mask of ``rows`` rows (None: not yet known); it must cover the ``written`` positions and agree
        with what was declared for them."""
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise KVQuantError(f"set_padding needs the [batch, tokens] attention mask, got {shape}")
        if attention_mask.is_complex():
            raise KVQuantError(f"set_padding: attention_mask is {attention_mask.dtype}; it must hold 0 (padding) and 1 "
                               "(a real token), as bool, integers or floats")
        if not attention_mask.shape[0]:
            raise KVQuantError(f"set_padding: attention_mask has 0 rows {tuple(attention_mask.shape)}; it needs one "
                               "row per batch row")
        if attention_mask.device.type == "meta":
            raise KVQuantError("set_padding: attention_mask is a meta tensor, which holds no mask values")
        values = attention_mask.detach().to("cpu")
        if values.dtype != torch.bool:
            odd = values[(values != 0) & (values != 1)]
            if len(odd):
                raise KVQuantError(f"set_padding: attention_mask holds {odd[0].item()!r}; it must hold only 0 "
                                   "(padding) and 1 (a real token), not an additive mask (0 / -inf)")
        mask = values.bool()
        rows = rows if rows is not None else (self.mask.shape[0] if self.mask is not None else None)
        if rows is not None and mask.shape[0] != rows:
            raise KVQuantError(f"set_padding: the mask has {mask.shape[0]} rows, the cache {rows}")
        if mask.shape[1] < written:
            raise KVQuantError(f"set_padding: the mask covers {mask.shape[1]} positions, the cache has written "
                               f"{written}; pass the whole attention mask (past and new positions)")
        if not torch.equal(mask[:, :written], self.real(0, written, mask.shape[0])):
            raise KVQuantError("set_padding: the mask disagrees with positions this cache has already stored")
        self.mask = mask

    def real(self, start: int, stop: int, batch: int) -> torch.Tensor:
        """``[batch, stop - start]`` bool: which of these positions are real tokens. A mask of B rows read for
        ``k * B`` rows is first expanded as ``generate`` expands its inputs for beams or several returned
        sequences (each row repeated ``k`` times)."""
        if self.mask is not None and self.mask.shape[0] != batch:
            if batch % self.mask.shape[0]:
                raise KVQuantError(f"set_padding described {self.mask.shape[0]} rows, the model wrote {batch}")
            self.mask = self.mask.repeat_interleave(batch // self.mask.shape[0], dim=0)
        out = torch.ones(batch, stop - start, dtype=torch.bool)
        if self.mask is not None and start < self.mask.shape[1]:
            declared = self.mask[:, start:stop]
            out[:, : declared.shape[1]] = declared
        return out

    def count(self, start: int, stop: int, batch: int) -> list[int]:
        """Per row: real tokens among positions ``[start, stop)`` (no tensor work when nothing is declared)."""
        return [count for count, _, _ in self.spans(start, stop, batch)]

    def select(self, rows: list[int]) -> None:
        if self.mask is not None:
            self.mask = self.mask[rows]


class QuantizedLayer(CacheLayerMixin):
    """One attention layer's quantized cache; with ``sliding_window`` it keeps what that window needs, with an
    ``eviction`` policy (full-attention layers) what the policy keeps.

    Evicting: a forward over positions ``[c, c + n)`` gets the kept tokens of ``[0, c)`` then its own, and
    ``get_mask_sizes`` places them at the virtual positions ``[c - kept, c)`` so the model's causal mask shows
    every kept token to every query and the chunk causally (keys were stored after RoPE, so their positions are
    already in them). Tokens leave in whole quantized units: a key group partly out of the window stays stored
    whole, unread, until all of it has left (at most ``tokens_per_unit - 1`` tokens more than the window).

    Each batch row is stored on its own (a :class:`_Stream` per row and per K/V), holding only the row's real
    tokens: padding declared with :meth:`KVQuantCache.set_padding` is neither stored nor allowed into any scale,
    and groups start at the row's first real token, so a row computes what it computes alone. Attention gets
    the padded ``[B, H, kv_len, D]`` layout back, zeros at padding positions (which its mask hides).
    """

    is_croppable = False

    def __init__(self, quantizer: Quantizer, residual_length: int, sink_tokens: int, sliding_window: int | None = None,
                 padding: Padding | None = None, eviction: Eviction | None = None):
        super().__init__()
        self.quantizer, self.residual_length = quantizer, residual_length
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        # Sinks would fall out of a sliding window: such layers keep none (nor evict more than their window).
        self.sink_tokens = 0 if self.is_sliding else sink_tokens
        self.eviction = None if self.is_sliding else eviction
        #: Past tokens a forward reads at most (None: all of them).
        self.capacity = sliding_window - 1 if self.is_sliding else \
            (eviction.capacity(sink_tokens) if eviction else None)
        self.cumulative_length = 0  # positions written, padding included (transformers' sequence length)
        self.padding = padding or Padding()
        self.k: list[_Stream] = []
        self.v: list[_Stream] = []
        self.index: int | None = None  # the layer's index in its cache (for error messages)
        self.reads: Reads | None = None  # counts what attention reads, when given a counter

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch = key_states.shape[0]
        key_codec, _ = self.quantizer.codecs(key_states.shape[-1])
        _, value_codec = self.quantizer.codecs(value_states.shape[-1])
        paged = self.eviction is not None
        self.k = [_Stream(key_codec, self.sink_tokens, self.residual_length, key_states, paged) for _ in range(batch)]
        self.v = [_Stream(value_codec, self.sink_tokens, self.residual_length, value_states, paged)
                  for _ in range(batch)]
        if self.eviction and self.eviction.importance:
            check_importance(self.eviction, key_codec, value_codec, self.residual_length)
            for k, v in zip(self.k, self.v):
                k.track(self.eviction.score)
                v.track()
        self.device = key_states.device
        self.is_initialized = True

    def _window(self) -> int:
        """First (virtual) position still held: all but the last ``capacity`` positions are gone."""
        return max(self.cumulative_length - self.capacity, 0) if self.capacity is not None else 0

    def held(self) -> list[int]:
        """Per row: real tokens attention may still read."""
        batch = len(self.k)
        return self.padding.count(self._window(), self.cumulative_length, batch)

    def _check_update(self, keys, values) -> None:
        """Refuse states this layer cannot store, before anything is stored: types, shapes, dtypes and devices only
        (no tensor data is read), and they must match what the layer already holds."""
        where = "update" if self.index is None else f"update(layer_idx={self.index})"
        for name, x in (("keys", keys), ("values", values)):
            if not isinstance(x, torch.Tensor):
                raise KVQuantError(f"{where}: {name} must be a torch.Tensor {STATES}, got {_shown(x)}")
            if x.dim() != 4:
                raise KVQuantError(f"{where}: {name} have {x.dim()} dimensions {tuple(x.shape)}; states are {STATES}")
            if not x.is_floating_point():
                raise KVQuantError(f"{where}: {name} are {x.dtype}; kvquant stores floating-point states (float16, "
                                   "bfloat16, float32)")
        for what, k, v, unit, rule in (("are", keys.dtype, values.dtype, "", "have the same dtype"),
                                       ("are on", keys.device, values.device, "", "be on the same device"),
                                       ("have", keys.shape[0], values.shape[0], " rows", "hold the same rows"),
                                       ("have", keys.shape[2], values.shape[2], " tokens", "hold the same tokens")):
            if k != v or (unit == " rows" and not k):
                shown_v = f"on {v}" if what == "are on" else v
                raise KVQuantError(f"{where}: keys {what} {k}{unit}, values {shown_v}; keys and values must {rule}"
                                   + (" (at least one)" if unit == " rows" else ""))
        if self.is_initialized and self.k:
            for name, x, like in (("keys", keys, self.k[0].tail), ("values", values, self.v[0].tail)):
                for what, dim in (("heads", 1), ("head_dim", 3)):
                    if x.shape[dim] != like.shape[dim]:
                        shown = f"{x.shape[dim]} {what}" if what == "heads" else f"head_dim {x.shape[dim]}"
                        raise KVQuantError(f"{where}: {name} have {shown}, this layer stores {like.shape[dim]}; "
                                           f"{STATES} must keep heads and head_dim across updates (a cache serves "
                                           "one model)")
                if x.dtype != like.dtype:
                    raise KVQuantError(f"{where}: {name} are {x.dtype}, this layer stores {like.dtype}; every update "
                                       "of a cache must have the same dtype (use a new cache)")
                if x.device != like.device:
                    raise KVQuantError(f"{where}: {name} are on {x.device}, this layer stores them on {like.device}; "
                                       "every update of a cache must be on the same device (use a new cache)")

    def update(self, key_states, value_states, *args, **kwargs):
        """Store ``[B, H, n, D]`` keys and values, return the dequantized ``[B, H, kv_len, D]`` views."""
        self._check_update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch = key_states.shape[0]
        if batch != len(self.k):
            raise KVQuantError(f"this cache holds {len(self.k)} rows, the model wrote {batch}")
        key_states, value_states = key_states.detach(), value_states.detach()  # a cache stores data, not graphs
        n, past = key_states.shape[2], self.cumulative_length
        if self.eviction and self.padding.mask is not None:
            self._check_front_padding(past + n, batch)
        elif self.eviction and batch > 1:
            positions = kwargs.get("kwargs", {}).get("position_ids") if isinstance(kwargs.get("kwargs"), dict) else None
            if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[0] == batch and \
                    not bool((positions == positions[:1]).all()):
                raise KVQuantError("rows are at different positions (a padded batch?), but no padding was declared: "
                                   "with eviction, call cache.set_padding(attention_mask) first, or padding would "
                                   "be kept and read as sink tokens")
        first = self._window()  # DynamicCache returns positions [first, past + n): min(past, W - 1) + n of them
        kv_len = past + n - first
        new, visible = self.padding.spans(past, past + n, batch), self.padding.spans(first, past + n, batch)
        self.cumulative_length += n
        keep = self.held()  # per row, what the window still needs after this update
        keys = key_states.new_empty(*key_states.shape[:2], kv_len, key_states.shape[3])
        values = value_states.new_empty(*value_states.shape[:2], kv_len, value_states.shape[3])
        # one reduction for the whole batch; if it fails, each row's real tokens are checked (padding may hold any)
        checked = (_fits(key_states, self.k[0].codec.max_abs), _fits(value_states, self.v[0].codec.max_abs))
        for row in range(batch):
            real = lambda row=row: self.padding.real(first, past + n, batch)[row]  # noqa: E731 (only for scattered padding)
            for stream, states, out, name, ok in ((self.k[row], key_states, keys, "keys", checked[0]),
                                                  (self.v[row], value_states, values, "values", checked[1])):
                _write(stream, states[row : row + 1], new[row], lambda real=real: real()[kv_len - n :], name, ok)
                _read(stream, out[row : row + 1], visible[row], real)
                if self.reads is not None:
                    self.reads.count(name, stream.read_runs(visible[row][0]), new[row][0])
                if self.capacity is not None and not self.eviction_by_importance:
                    stream.evict(keep[row])
            if self.eviction_by_importance:
                self._evict_least_important(row, keep[row])
        self._check()
        return keys, values

    @property
    def eviction_by_importance(self) -> bool:
        return bool(self.eviction and self.eviction.importance)

    def _evict_least_important(self, row: int, keep: int) -> None:
        """Stop reading the least important tokens of row ``row`` beyond ``keep``: never a sink or one of the last
        ``window``, and block by block (a block: the tokens of one unit of both streams), finishing a block it
        began first, so at most one block is ever partly read and the bytes stored do not depend on the scores."""
        k, v = self.k[row], self.v[row]
        visible = k.visible()
        excess = len(visible) - keep
        if excess <= 0:
            return
        s, block = k.sinks.shape[2], _block(k.codec, v.codec)
        middle = visible[s : len(visible) - self.eviction.window]
        blocks: dict[int, list[int]] = {}
        for o in middle:
            blocks.setdefault((o - s) // block, []).append(o)
        # a block is evictable when none of its tokens is in the window (its others are already unread)
        middle_or_hidden = set(middle) | k.hidden
        whole = {b for b in blocks if all(s + b * block + i in middle_or_hidden for i in range(block))}
        started = sorted(b for b in whole if len(blocks[b]) < block)
        score = dict(zip(k.ords, k.scores.tolist())) if k.scores is not None else {}
        rank = lambda b: (sum(score.get(o, 0.0) for o in blocks[b]) / len(blocks[b]), b)  # noqa: E731
        chosen: list[int] = []
        for b in started + sorted((b for b in whole if b not in started), key=rank):
            chosen += sorted(blocks[b], key=lambda o: (score.get(o, 0.0), o))[: excess - len(chosen)]
            if len(chosen) == excess:
                break
        if len(chosen) < excess:
            raise InternalError(f"row {row} has {len(chosen)} of {excess} tokens to evict; please "
                               "report this")
        k.hide(chosen)
        v.hide(chosen)

    def _check_front_padding(self, stop: int, batch: int) -> None:
        """An evicting layer's virtual positions hold each row's kept tokens right-aligned, which the model's mask
        reads right only when every row's padding is in front of all its tokens (left padding)."""
        for count, first, last in self.padding.spans(0, stop, batch):
            if count and (count != last - first or last != stop):
                raise KVQuantError("eviction needs padding in front of every row's tokens (left padding); this "
                                   "batch has padding between or after real tokens")

    def _check(self) -> None:
        """Stored tokens agree with what was written (cheap; a disagreement is a bug, never a silent result)."""
        written = self.padding.count(0, self.cumulative_length, len(self.k))
        for row, held in enumerate(self.held()):
            for stream in (self.k[row], self.v[row]):
                unit = _block(self.k[row].codec, self.v[row].codec) if self.eviction_by_importance else \
                    stream.codec.tokens_per_unit
                slack = unit - 1 if self.capacity is not None else 0
                if stream.length != written[row] or not held <= len(stream) <= held + slack:
                    raise InternalError(
                        f"row {row} stores {len(stream)} of {stream.length} tokens, expected "
                        f"{held} (+{slack}) of {written[row]}; please report this")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the kept past and the query's own tokens, from position ``kv_offset``."""
        first = self._window()
        return self.cumulative_length - first + query_length, first

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        self.k, self.v = [], []
        self.cumulative_length = 0
        self.is_initialized = False

    def _select_rows(self, rows: list[int]) -> None:
        """Keep these rows, in this order (repeats allowed: each becomes an independent fork; stored tensors are
        never modified in place, so forks share them safely). The cache selects the padding rows once."""
        if self.is_initialized:
            self.k = [self.k[r].fork() for r in rows]
            self.v = [self.v[r].fork() for r in rows]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows are stored apart, so they reorder exactly."""
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([r for r in range(len(self.k)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(len(self.k))[indices].tolist())

    def crop(self, tokens_to_remove: int) -> None:
        raise KVQuantError("a quantized cache cannot be cropped (quantized groups cannot be split); use a fresh cache")

    def offload(self):
        raise KVQuantError("kvquant caches do not support offloading yet (see the README's 'Staged memory loop')")

    prefetch = offload

    def memory(self) -> dict[str, int]:
        """Bytes really stored, by role (a tensor several rows share counted once; ``shared_saved_bytes`` what
        counting it per row would add), ``shareable_bytes`` (what a fork of row 0 would share with it), and what
        fp16 would take for the tokens attention can read."""
        out = {"payload_bytes": 0, "scale_bytes": 0, "full_precision_bytes": 0, "fp16_bytes": 0,
               "shared_saved_bytes": 0, "shareable_bytes": 0, "shared_bytes": 0}
        if not self.is_initialized:
            return out
        holders: dict[object, set[int]] = {}
        # an evicting layer's fp16 reference is every token written (what it saves is the point); a sliding
        # window's is what the model's own cache holds
        tokens = self.padding.count(0, self.cumulative_length, len(self.k)) if self.eviction else self.held()
        for row, count in enumerate(tokens):
            for stream in (self.k[row], self.v[row]):
                for key, t in stream.tensors():
                    storage, nbytes = _storage(t)
                    if storage in holders:
                        out["shared_saved_bytes"] += nbytes
                    else:
                        out[_ROLE.get(key, "full_precision_bytes")] += nbytes
                    holders.setdefault(storage, set()).add(row)
                heads, head_dim = stream.tail.shape[1], stream.tail.shape[3]
                out["fp16_bytes"] += heads * head_dim * count * FP16_BYTES
        sizes = {storage: nbytes for stream in self.k + self.v for storage, nbytes in map(_storage, (
            t for _, t in stream.tensors()))}
        out["shared_bytes"] = sum(sizes[storage] for storage, rows in holders.items() if len(rows) > 1)
        out["shareable_bytes"] = sum(t.numel() * t.element_size() for stream in (self.k[0], self.v[0])
                                     for t in stream.shareable())
        return out


class KVQuantCache(Cache):
    """A ``transformers.Cache`` of :class:`QuantizedLayer` (plus transformers' ``DummyLayer`` for layers that
    reuse another layer's KV). Pass it as ``model(..., cache=cache)`` or ``model.generate(..., cache=cache)``."""

    def __init__(self, layers: list, quantizer: Quantizer, residual_length: int, sink_tokens: int,
                 head_dim: int | None = None, layer_options: dict[str, dict] | None = None,
                 eviction: Eviction | None = None):
        super().__init__(layers=layers)
        self.quantizer, self.residual_length, self.sink_tokens = quantizer, residual_length, sink_tokens
        self.head_dim = head_dim
        self.layer_options = layer_options or {}  # normalized ``layers=`` of make_cache
        self.eviction = eviction
        self.padding = next((layer.padding for layer in layers if isinstance(layer, QuantizedLayer)), Padding())
        self._reads: Reads | None = None
        for index, layer in enumerate(layers):
            if isinstance(layer, QuantizedLayer):
                layer.index = index

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Store the keys and values of layer ``layer_idx`` (see :meth:`QuantizedLayer.update`)."""
        _check_layer_index("update", layer_idx, len(self.layers))
        if not isinstance(self.layers[layer_idx], QuantizedLayer) and (key_states is not None or
                                                                      value_states is not None):
            raise KVQuantError(f"update: layer_idx {layer_idx} is a layer that reuses another layer's KV (it stores "
                               "nothing); update the layer that computes them")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def reads(self) -> Reads | None:
        """The counter of what attention read from this cache (:mod:`kvquant.reads`), if one was given."""
        return self._reads

    @reads.setter
    def reads(self, counter: Reads | None) -> None:
        self._reads = counter
        for layer in self.layers:
            if isinstance(layer, QuantizedLayer):
                layer.reads = counter

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions written (padding included) to layer ``layer_idx``."""
        _check_layer_index("get_seq_length", layer_idx, len(self.layers))
        return super().get_seq_length(layer_idx)

    def _row_count(self) -> int | None:
        """Rows the cache holds, or those its declared padding describes before the first write (None: unknown)."""
        rows = self.rows()
        return self.padding.mask.shape[0] if rows is None and self.padding.mask is not None else rows

    def set_padding(self, attention_mask: torch.Tensor) -> KVQuantCache:
        """Declare which positions are padding: the ``[B, T]`` attention mask given to the model (0 = padding),
        covering the positions written so far and those about to be written (later positions are real). Padding
        is then not stored and never enters a scale, and each row is grouped from its own first real token, as if
        it ran alone. Call it before the forward (or ``generate``) that writes the padded positions; without it,
        every position is stored as a real token. Returns the cache."""
        self.padding.declare(attention_mask, self.get_seq_length(), self.rows())
        return self

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep rows ``beam_idx`` (a 1-D integer tensor or a list), in this order."""
        rows = _row_list("reorder_cache", "beam_idx", beam_idx, self._row_count())  # one device sync for all layers
        for layer in self.layers:
            if isinstance(layer, QuantizedLayer):
                layer._select_rows(rows)
            else:
                layer.reorder_cache(beam_idx)
        self.padding.select(rows)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not _is_int(repeats) or repeats < 1:
            raise KVQuantError(f"batch_repeat_interleave: repeats must be an integer >= 1, got {_shown(repeats)}")
        rows = self.padding.mask.shape[0] if self.padding.mask is not None else None
        super().batch_repeat_interleave(repeats)
        if rows is not None:
            self.padding.select([r for r in range(rows) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        count = self._row_count()
        if count is not None:
            try:
                if isinstance(indices, (str, bytes, float)):  # torch would read a string as a sequence
                    raise TypeError("indices are integers, a bool mask or a slice")
                chosen = torch.arange(count)[indices]
            except (IndexError, TypeError, ValueError, RuntimeError) as err:
                raise KVQuantError(f"batch_select_indices: indices {_shown(indices)} do not index a cache of {count} "
                                   f"rows: {one_line(err)}") from None
            if chosen.dim() != 1 or not len(chosen):
                raise KVQuantError(f"batch_select_indices: indices {_shown(indices)} select {tuple(chosen.shape)} of "
                                   f"a cache of {count} rows; they must select at least one row, along one dimension")
        super().batch_select_indices(indices)
        if self.padding.mask is not None:
            self.padding.select(torch.arange(self.padding.mask.shape[0])[indices].tolist())

    def fork(self, rows: list[int]) -> None:
        """Keep these rows in this order; a row listed several times becomes independent copies that share the
        stored prefix until they write (prefix sharing: prefill a context once, then extend each copy)."""
        rows = _row_list("fork", "rows", rows, self._row_count())
        self.batch_select_indices(torch.tensor(rows, dtype=torch.long))

    def rows(self) -> int | None:
        """Batch rows this cache holds (None before its first write)."""
        written = (len(layer.k) for layer in self.layers if isinstance(layer, QuantizedLayer) and layer.is_initialized)
        return next(written, None)


    def settings(self) -> dict[str, object]:
        """The make_cache options of this cache, defaults filled in: ``make_cache(model, **cache.settings())``
        rebuilds it."""
        layers = {"layers": copy.deepcopy(self.layer_options)} if self.layer_options else {}
        eviction = {"eviction": self.eviction.name, **dataclasses.asdict(self.eviction)} if self.eviction else {}
        return {**self.quantizer.describe(), "residual_length": self.residual_length, "sink_tokens": self.sink_tokens,
                **eviction, **layers}

    def derived(self) -> dict[str, object]:
        """What the quantizer derived from the model's head_dim: the groups actually used (``key_group``,
        ``value_group``), ``rotation_block``. Not options: reports show them beside :meth:`settings`."""
        return self.quantizer.resolved(self.head_dim) if self.head_dim else {}

    def memory_report(self) -> dict[str, float]:
        """``total_bytes`` (every stored tensor: payload, scales, zero points, full-precision windows; a tensor
        rows share after a fork counted once, whole), ``fp16_bytes`` (fp16 for the tokens attention can read, per
        row; with eviction, for every token written), ``ratio``, ``bits_per_element``, the breakdown by role,
        ``shared_bytes`` (stored once for several rows), ``shared_saved_bytes`` (what storing those once saves
        over storing them per row), ``shareable_bytes`` (what a fork of row 0 would share now),
        ``tokens`` (sequence length) and ``per_layer``: per decoder layer that stores KV, ``{"layer",
        "total_bytes", "fp16_bytes", "bits_per_element"}``."""
        parts = {i: layer.memory() for i, layer in enumerate(self.layers) if isinstance(layer, QuantizedLayer)}
        return _summarize(parts, self.get_seq_length())


def stack_rows(sources: list[tuple[KVQuantCache, int]]) -> KVQuantCache:
    """A new cache whose row ``i`` continues row ``r`` of cache ``c`` for ``sources[i] = (c, r)`` (the sources stay
    as they are; a row listed several times forks, as in :meth:`KVQuantCache.fork`). A cache with nothing written
    yet gives an empty row. Rows that were written over fewer positions than the longest source are padded in
    front: padding before all of a row's tokens changes nothing it stores or computes, so each row continues as it
    would in its own cache. This lets rows prefilled in separate batches (contexts of similar lengths) continue in
    one batch (continuations of similar lengths)."""
    if not isinstance(sources, (list, tuple)):
        raise KVQuantError(f"stack_rows: sources must be a list of (cache, row) pairs, got {_shown(sources)}")
    if not sources:
        raise KVQuantError("stack_rows needs at least one (cache, row)")
    for i, source in enumerate(sources):
        if not isinstance(source, (list, tuple)) or len(source) != 2:
            got = f"{type(source).__name__} of {len(source)}" if isinstance(source, (list, tuple)) else _shown(source)
            raise KVQuantError(f"stack_rows: sources[{i}] must be a (cache, row) pair, got {got}")
        if not _is_int(source[1]) or source[1] < 0:
            raise KVQuantError(f"stack_rows: sources[{i}]: row must be an integer >= 0, got {_shown(source[1])}")
    sources = [(cache, int(row)) for cache, row in sources]
    first = sources[0][0]
    for cache, row in sources:
        if not isinstance(cache, KVQuantCache) or _kinds(cache) != _kinds(first):
            raise KVQuantError("stack_rows: every source must be a KVQuantCache built with the same settings for the "
                               "same model")
        rows = cache.rows()
        if rows is not None and not 0 <= row < rows:
            raise KVQuantError(f"stack_rows: row {row} of a cache with {rows} rows")
    width = max(cache.get_seq_length() for cache, _ in sources)
    mask = torch.zeros(len(sources), width, dtype=torch.bool)
    for i, (cache, row) in enumerate(sources):
        written = cache.get_seq_length()
        if written:
            mask[i, width - written :] = cache.padding.real(0, written, cache.rows())[row]
    padding = Padding()
    if not bool(mask.all()):
        padding.mask = mask
    layers = []
    for index, layer in enumerate(first.layers):
        if not isinstance(layer, QuantizedLayer):
            layers.append(copy.copy(layer))
            continue
        new = QuantizedLayer(layer.quantizer, layer.residual_length, layer.sink_tokens, layer.sliding_window, padding,
                             layer.eviction)
        template = next((c.layers[index] for c, _ in sources if c.layers[index].is_initialized), None)
        if template is not None:  # else nothing was written anywhere: the new layer initializes at its first write
            new.k = [c.layers[index].k[r].fork() if c.layers[index].is_initialized else template.k[0].empty()
                     for c, r in sources]
            new.v = [c.layers[index].v[r].fork() if c.layers[index].is_initialized else template.v[0].empty()
                     for c, r in sources]
            new.device, new.is_initialized = template.device, True
        new.cumulative_length = width
        if new.is_initialized:
            new._check()
        layers.append(new)
    stacked = KVQuantCache(layers, first.quantizer, first.residual_length, first.sink_tokens, first.head_dim,
                           first.layer_options, first.eviction)
    stacked.reads = first.reads  # the rows go on counting where they were counted
    return stacked


def _kinds(cache: KVQuantCache) -> list:
    """What each layer stores and how (two caches with equal kinds store alike)."""
    return [(type(layer), getattr(layer, "quantizer", None), getattr(layer, "residual_length", None),
             getattr(layer, "sink_tokens", None), getattr(layer, "sliding_window", None),
             getattr(layer, "eviction", None)) for layer in cache.layers]


def _summarize(parts: dict[int, dict[str, int]], tokens: int) -> dict[str, float]:
    """``parts``: per layer index, :meth:`QuantizedLayer.memory`."""
    report = {key: sum(p[key] for p in parts.values()) for key in (
        "payload_bytes", "scale_bytes", "full_precision_bytes", "fp16_bytes", "shared_saved_bytes", "shareable_bytes",
        "shared_bytes")}
    return {
        **_totals(report),
        **report,
        "tokens": tokens,
        "per_layer": [{"layer": i, **_totals(p), "fp16_bytes": p["fp16_bytes"]} for i, p in sorted(parts.items())],
    }


def _totals(part: dict[str, int]) -> dict[str, float]:
    total = part["payload_bytes"] + part["scale_bytes"] + part["full_precision_bytes"]
    fp16 = part["fp16_bytes"]
    return {"total_bytes": total, "ratio": total / fp16 if fp16 else float("nan"),
            "bits_per_element": 16 * total / fp16 if fp16 else float("nan")}


def attention_layout(model_or_config) -> list[int | None | str]:
    """Per decoder layer: ``None`` for full attention, the window for sliding-window attention, ``"shared"`` for a
    layer that reuses another layer's KV (it stores nothing). Errors name layers kvquant cannot cache."""
    if isinstance(model_or_config, type):
        raise KVQuantError(f"model_or_config must be a transformers model or config instance, got the class "
                           f"{model_or_config.__name__} (load one, e.g. with from_pretrained)")
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "get_text_config"):
        raise KVQuantError(f"model_or_config must be a transformers model or config instance, got "
                           f"{_shown(model_or_config)}")
    text_config = config.get_text_config(decoder=True)
    if getattr(text_config, "is_encoder_decoder", False):
        raise KVQuantError("kvquant quantizes decoder-only self-attention caches; this model is encoder-decoder")
    try:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    except (AttributeError, TypeError) as err:
        raise KVQuantError(f"cannot read the attention layers of {type(config).__name__}: {err}") from err
    layout = []
    for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        if kind == "full_attention":
            layout.append(None)
        elif kind in SLIDING_TYPES:
            layout.append(kwargs["sliding_window"])
        elif kind == "dummy":
            layout.append("shared")
        else:
            raise KVQuantError(
                f"layer {i} is {kind!r}, which keeps no attention KV cache kvquant can quantize "
                f"(supported: full_attention, {', '.join(SLIDING_TYPES)})"
            )
    if all(w == "shared" for w in layout):
        raise KVQuantError(f"{type(config).__name__} has no attention layers with a KV cache to quantize")
    return layout


def head_dim_of(model_or_config) -> int | None:
    """The attention head dimension of a model or config (``head_dim``, else hidden_size / heads)."""
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None and getattr(text, "hidden_size", None) and getattr(text, "num_attention_heads", None):
        head_dim = text.hidden_size // text.num_attention_heads
    return head_dim


def _with_options(quantizer: Quantizer, options: dict) -> Quantizer:
    """``quantizer`` with some of its options changed (validated as a new quantizer)."""
    QUANTIZERS.check_options(quantizer.name, options)
    return dataclasses.replace(quantizer, **options) if options else quantizer


def _check_count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise KVQuantError(f"{name} must be a non-negative integer, got {type(value).__name__} {value!r}")


def layer_range(selector, count: int) -> range:
    """Layers named by a ``layers=`` key: ``5``, ``"5"`` or the inclusive range ``"0-3"``, within ``count``."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", selector) if isinstance(selector, str) else None
    if isinstance(selector, int) and not isinstance(selector, bool):
        low = high = selector
    elif match:
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
    else:
        raise KVQuantError(f"layers: {selector!r} is not a layer or a layer range (write 5 or '0-3')")
    if not 0 <= low <= high < count:
        raise KVQuantError(f"layers: {selector!r} is outside the model's layers 0-{count - 1}" if low <= high else
                           f"layers: {selector!r} runs backwards (write low-high)")
    return range(low, high + 1)


def layer_settings(layout: list, quantizer: Quantizer, residual_length: int, sink_tokens: int,
                   layers: dict | None, head_dim: int | None = None
                   ) -> tuple[list[tuple[Quantizer, int, int] | None], dict[str, dict]]:
    """Per layer of ``layout``: ``(quantizer, residual_length, sink_tokens)`` (None for a shared layer), and the
    normalized ``layers`` mapping (keys ``"a-b"``, every option spelled out, so it rebuilds the same layers).
    Each ``layers`` entry maps a layer or inclusive range to options: without ``quantizer`` they change the
    cache's quantizer's options for those layers; naming a quantizer (even the cache's), that quantizer with its
    own defaults and these options. ``residual_length`` and ``sink_tokens`` default to the cache's. A layer named
    twice, an entry naming only shared layers and sinks on a sliding-window layer (which keeps none) are
    errors; with ``head_dim`` each entry's quantizer is checked against it."""
    plan = [None if w == "shared" else (quantizer, residual_length, sink_tokens) for w in layout]
    if layers is None:
        return plan, {}
    if not isinstance(layers, dict):
        raise KVQuantError(f"layers must map layers or ranges ('0-3') to options, got {type(layers).__name__}")
    owner: dict[int, object] = {}
    normalized = {}
    for selector, options in layers.items():
        span = layer_range(selector, len(layout))
        if not isinstance(options, dict):
            raise KVQuantError(f"layers[{selector!r}] must be a mapping of options, got {type(options).__name__} "
                               f"{options!r}")
        clash = next((i for i in span if i in owner), None)
        if clash is not None:
            raise KVQuantError(f"layers: layer {clash} is named by both {owner[clash]!r} and {selector!r}")
        owner.update(dict.fromkeys(span, selector))
        options = dict(options)
        name = options.pop("quantizer", None)
        residual, sinks = options.pop("residual_length", residual_length), options.pop("sink_tokens", sink_tokens)
        _check_count(f"layers[{selector!r}].residual_length", residual)
        _check_count(f"layers[{selector!r}].sink_tokens", sinks)
        if all(layout[i] == "shared" for i in span):
            raise KVQuantError(f"layers[{selector!r}]: names only layers that reuse another layer's KV (they store "
                               "nothing)")
        sliding = next((i for i in span if isinstance(layout[i], int) and not isinstance(layout[i], bool)), None)
        if sinks and sliding is not None:
            raise KVQuantError(f"layers[{selector!r}]: layer {sliding} is a sliding-window layer, which keeps no "
                               "sink tokens")
        try:
            chosen = _with_options(quantizer, options) if name is None else get_quantizer(name, **options)
            if head_dim is not None:
                chosen.codecs(head_dim)
        except KVQuantError as err:
            raise KVQuantError(f"layers[{selector!r}]: {err}") from None
        for i in span:
            if plan[i] is not None:
                plan[i] = (chosen, residual, sinks)
        key = f"{span.start}-{span.stop - 1}" if len(span) > 1 else str(span.start)
        normalized[key] = {**chosen.describe(), "residual_length": residual, "sink_tokens": sinks}
    return plan, dict(sorted(normalized.items(), key=lambda item: int(item[0].split("-")[0])))


def build_cache(
    layout: list[int | None | str], quantizer: str | Quantizer = "int4", *, residual_length: int | None = None,
    sink_tokens: int = 0, head_dim: int | None = None, layers: dict | None = None, eviction: str | None = None,
    window: int | None = None, budget: int | None = None, **options
) -> KVQuantCache:
    """A :class:`KVQuantCache` for an :func:`attention_layout`; see :func:`make_cache` for the arguments. With
    ``head_dim`` the quantizer's settings are checked against it now rather than at the first forward."""
    if isinstance(quantizer, str):
        QUANTIZERS.check_options(quantizer, options, also=CACHE_OPTIONS)
        quantizer = get_quantizer(quantizer, **options)
    elif not isinstance(quantizer, Quantizer):
        raise KVQuantError(f"quantizer must be a name ({', '.join(available_quantizers())}) or a Quantizer, "
                           f"got {type(quantizer).__name__} {quantizer!r}")
    elif options:
        raise KVQuantError(f"options {sorted(options)} given with a Quantizer instance; set them on the instance")
    if residual_length is None:
        residual_length = quantizer.default_residual_length
    _check_count("residual_length", residual_length)
    _check_count("sink_tokens", sink_tokens)
    policy = None
    if eviction is not None:
        policy = get_eviction(eviction, sink_tokens, window=window, **({} if budget is None else {"budget": budget}))
    elif window is not None or budget is not None:
        raise KVQuantError("window and budget are options of an eviction policy; set eviction= (e.g. 'sink_window')")
    plan, normalized = layer_settings(layout, quantizer, residual_length, sink_tokens, layers, head_dim)
    if policy:
        longest = max(spec[1] for spec in plan if spec is not None)
        if longest >= policy.window and not all(spec[0].name == "fp16" for spec in plan if spec is not None):
            raise KVQuantError(f"residual_length {longest} is not below the eviction window {policy.window}: tokens "
                               "would leave the full-precision window before ever being quantized (set "
                               "residual_length=0 or a smaller one)")
    if policy and any(spec[2] != sink_tokens for spec in plan if spec is not None):
        raise KVQuantError("layers: with eviction every full-attention layer keeps the cache's sink_tokens (the "
                           "model's one causal mask is sized for all of them)")
    if head_dim is not None:
        quantizer.codecs(head_dim)
        if policy and policy.importance:
            for chosen, residual, _ in {spec for spec in plan if spec is not None}:
                check_importance(policy, *chosen.codecs(head_dim), residual)
    padding = Padding()
    built = [DummyLayer() if spec is None else QuantizedLayer(*spec, sliding, padding, policy) for spec, sliding in
             zip(plan, layout)]
    return KVQuantCache(built, quantizer, residual_length, sink_tokens, head_dim, normalized, policy)


def make_cache(model_or_config, quantizer: str | Quantizer = "int4", **options) -> KVQuantCache:
    """Build a quantized cache for a decoder model (or its config).

    quantizer: a registered name (see ``kvquant.available_quantizers()``) or a :class:`Quantizer`.
    residual_length: most recent tokens kept in full precision (default: the quantizer's, 128 for integers).
    sink_tokens: first tokens kept in full precision (full-attention layers only).
    eviction, window: an eviction policy for the full-attention layers (``"window"``, ``"sink_window"``: see
    :mod:`kvquant.eviction`) and its window, e.g. ``eviction="sink_window", sink_tokens=4, window=1024``.
    layers: per-layer settings, e.g. ``{"0-3": {"quantizer": "int8"}, 5: {"key_bits": 8}}``: a layer or inclusive
    range of layers and its options (see :func:`layer_settings`); the other layers use the arguments above.
    Other options are the quantizer's own, e.g. ``group_size=32``, ``key_bits=8``.
    For a left-padded batch, call ``cache.set_padding(attention_mask)`` before the first forward.
    """
    for name in ("layout", "head_dim"):
        if name in options:
            raise KVQuantError(f"make_cache: {name} is not an option, it is read from model_or_config; the options: "
                               f"{', '.join(CACHE_OPTIONS)} and the quantizer's (kvquant.quantizer_options(name))")
    return build_cache(attention_layout(model_or_config), quantizer, head_dim=head_dim_of(model_or_config), **options)


def simulate_memory(
    layout: list[int | None | str], settings: dict, *, batch: int, kv_heads: int, head_dim: int, tokens: int,
    dtype: torch.dtype = torch.float16,
) -> dict[str, float]:
    """``memory_report()`` of a cache after ``tokens`` tokens were written in one call, computed by running the
    cache's own code on meta tensors (shapes only, no data, no compute) for one row; rows are stored apart and
    alike, so ``batch`` rows take ``batch`` times its bytes. ``settings``: make_cache arguments,
    ``{"quantizer": "int4", "group_size": 32, ...}`` (``layers`` included)."""
    settings = dict(settings)
    quantizer = settings.pop("quantizer")
    states = torch.empty(1, kv_heads, tokens, head_dim, dtype=dtype, device="meta")
    cache = build_cache(layout, quantizer, head_dim=head_dim, **settings)
    parts, seen = {}, {}
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, QuantizedLayer):
            continue
        kind = (layer.quantizer, layer.residual_length, layer.sink_tokens, layer.sliding_window, layer.eviction)
        if kind not in seen:  # layers of one kind store the same: simulate one each
            layer.update(states, states)
            seen[kind] = {key: nbytes * batch for key, nbytes in layer.memory().items()}
        parts[i] = seen[kind]
    return _summarize(parts, tokens)


def stored_bytes(cache: Cache) -> int:
    """Bytes held by any transformers cache's layers (``DynamicCache``, ``QuantizedCache``, ours), found by
    walking each layer's tensors, tuples and tensor subclasses (e.g. optimum-quanto's packed tensors)."""
    if isinstance(cache, KVQuantCache):
        return cache.memory_report()["total_bytes"]

    def walk(obj) -> int:
        if isinstance(obj, (tuple, list)):
            return sum(walk(item) for item in obj)
        if not isinstance(obj, torch.Tensor):
            return 0
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(walk(getattr(obj, name)) for name in names)
        return obj.numel() * obj.element_size()

    names = ("keys", "values", "_quantized_keys", "_quantized_values")
    return sum(walk(getattr(layer, name, None)) for layer in cache.layers for name in names)
