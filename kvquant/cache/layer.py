"""One attention layer of a :class:`~kvquant.cache.KVQuantCache`: the transformers ``CacheLayerMixin`` contract on
top of two batched :class:`~kvquant.cache.storage.Store` (keys, values)."""

from __future__ import annotations

import dataclasses
import math

import torch
from transformers.cache_utils import CacheLayerMixin

from kvquant.errors import InternalError, KVQuantError
from kvquant.cache.eviction import Eviction
from kvquant.formats.quantizers import Codec, Quantizer
from kvquant.cache.reads import Reads
from kvquant.cache import fused, query
from kvquant.cache.checks import STATES, check_states, describe_value, fits
from kvquant.cache.padding import Padding
from kvquant.cache.prerope import PreRope, given_positions
from kvquant.formats.roles import by_category
from kvquant.cache.storage import Store, left_align
from kvquant.cache.streams import fusable

FP16_BYTES = 2


def codec_tensors(codec) -> list[torch.Tensor]:
    """The tensors a codec keeps as fields (a rotation's matrix, a static scale, centroids), its inner codec's
    included."""
    found = []
    for field in dataclasses.fields(codec) if dataclasses.is_dataclass(codec) else ():
        value = getattr(codec, field.name, None)
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            found += codec_tensors(value)
    return found


def block_tokens(key_codec: Codec, value_codec: Codec) -> int:
    """Tokens of the smallest block made of whole units of both streams."""
    return math.lcm(key_codec.tokens_per_unit, value_codec.tokens_per_unit)


def check_importance(policy: Eviction, key_codec: Codec, value_codec: Codec, residual_length: int) -> None:
    """An importance policy evicts whole blocks (:func:`block_tokens`) from before its window: the window must
    cover the full-precision tail and the budget hold a block's worth of tokens."""
    block = block_tokens(key_codec, value_codec)
    if policy.window < residual_length + block - 1:
        raise KVQuantError(f"eviction {policy.name!r}: window {policy.window} must cover residual_length "
                           f"{residual_length} plus a quantized unit ({block} tokens) - 1 = "
                           f"{residual_length + block - 1}")
    if policy.budget < block - 1:
        raise KVQuantError(f"eviction {policy.name!r}: budget {policy.budget} must be at least a quantized unit "
                           f"({block} tokens) - 1")


class KVQuantLayer(CacheLayerMixin):
    """One attention layer's quantized cache; with ``sliding_window`` it keeps what that window needs, with an
    ``eviction`` policy (full-attention layers) what the policy keeps.

    Evicting: a forward over positions ``[c, c + n)`` gets the kept tokens of ``[0, c)`` then its own, and
    ``get_mask_sizes`` places them at the virtual positions ``[c - kept, c)`` so the model's causal mask shows
    every kept token to every query and the chunk causally (keys were stored after RoPE, so their positions are
    already in them). Tokens leave in whole quantized units: a key group partly out of the window stays stored
    whole, unread, until all of it has left (at most ``tokens_per_unit - 1`` tokens more than the window).

    Each batch row holds only its real tokens: padding declared with :meth:`KVQuantCache.set_padding` is neither
    stored nor allowed into any scale, and groups start at the row's first real token, so a row computes what it
    computes alone. All rows are written and read together (:class:`~kvquant.cache.storage.Store`); attention gets
    the padded ``[B, H, kv_len, D]`` layout back, zeros at padding positions (which its mask hides).
    """

    is_croppable = False

    def __init__(self, quantizer: Quantizer, residual_length: int, sink_tokens: int, sliding_window: int | None = None,
                 padding: Padding | None = None, eviction: Eviction | None = None, rope: PreRope | None = None):
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
        self.k: Store | None = None
        self.v: Store | None = None
        self.index: int | None = None  # the layer's index in its cache (for error messages)
        self.reads: Reads | None = None  # counts what attention reads, when given a counter
        self.fused = False  # short steps return placeholders read by fused.attention (set by make_cache)
        #: pre-RoPE keys (:mod:`kvquant.cache.prerope`): RoPE taken off before storing, put back on read
        self.rope = rope
        #: ``(KV heads, head_dim)`` the model writes, for keys and for values (None: not known), checked at the
        #: first update (set by make_cache from the model: :func:`~kvquant.cache.build.written_shapes`)
        self.expected: tuple[tuple[int, int] | None, tuple[int, int] | None] = (None, None)

    @property
    def batch(self) -> int:
        return self.k.rows if self.k is not None else 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch = key_states.shape[0]
        key_codec, _ = self.quantizer.codecs(key_states.shape[-1])
        _, value_codec = self.quantizer.codecs(value_states.shape[-1])
        self.k = Store(key_codec, self.sink_tokens, self.residual_length, key_states, batch)
        self.v = Store(value_codec, self.sink_tokens, self.residual_length, value_states, batch)
        if self.eviction_by_importance:
            check_importance(self.eviction, key_codec, value_codec, self.residual_length)
            self.k.track(self.eviction.score)
            self.v.track()
        self.device = key_states.device
        self.is_initialized = True

    def _window(self) -> int:
        """First (virtual) position still held: all but the last ``capacity`` positions are gone."""
        return max(self.cumulative_length - self.capacity, 0) if self.capacity is not None else 0

    def readable_tokens(self) -> list[int]:
        """Per row: real tokens attention may still read."""
        return self.padding.count(self._window(), self.cumulative_length, self.batch)

    def _check_update(self, keys, values) -> None:
        """Refuse states this layer cannot store, before anything is stored: types, shapes, dtypes and devices only
        (no tensor data is read), and they must match what the layer already holds."""
        where = "update" if self.index is None else f"update(layer_idx={self.index})"
        for name, x in (("keys", keys), ("values", values)):
            if not isinstance(x, torch.Tensor):
                raise KVQuantError(f"{where}: {name} must be a torch.Tensor {STATES}, got {describe_value(x)}")
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
        if not self.is_initialized:
            self._check_expected(where, keys, values)
        if self.is_initialized and self.k is not None:
            for name, x, like in (("keys", keys, self.k.tail), ("values", values, self.v.tail)):
                for what, dim in (("heads", 1), ("head_dim", 3)):
                    if x.shape[dim] != like.shape[dim]:
                        got = f"{x.shape[dim]} {what}" if what == "heads" else f"head_dim {x.shape[dim]}"
                        raise KVQuantError(f"{where}: {name} have {got}, this layer stores {like.shape[dim]}; "
                                           f"{STATES} must keep heads and head_dim across updates (a cache serves "
                                           "one model)")
                if x.dtype != like.dtype:
                    raise KVQuantError(f"{where}: {name} are {x.dtype}, this layer stores {like.dtype}; every update "
                                       "of a cache must have the same dtype (use a new cache)")
                if x.device != like.device:
                    raise KVQuantError(f"{where}: {name} are on {x.device}, this layer stores them on {like.device}; "
                                       "every update of a cache must be on the same device (use a new cache)")

    def _check_expected(self, where: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A first update writes the ``(KV heads, head_dim)`` of the model the cache was made for (once a layer)."""
        for name, x, shape in (("keys", keys, self.expected[0]), ("values", values, self.expected[1])):
            if shape is not None and (x.shape[1], x.shape[3]) != shape:
                heads, head_dim = shape
                raise KVQuantError(f"{where}: {name} have shape {tuple(x.shape)} ({x.shape[1]} heads, head_dim "
                                   f"{x.shape[3]}), but layer {self.index} of the model this cache was made for "
                                   f"writes [batch, {heads}, tokens, {head_dim}] ({heads} KV heads, head_dim "
                                   f"{head_dim}); use a cache made by make_cache for the model that writes them")

    def _check_positions(self, past: int, n: int, batch: int, kwargs: dict) -> None:
        if self.eviction and self.padding.mask is not None:
            self._check_front_padding(past + n, batch)
        elif self.eviction and batch > 1:
            positions = kwargs.get("kwargs", {}).get("position_ids") if isinstance(kwargs.get("kwargs"), dict) else None
            if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[0] == batch and \
                    not bool((positions == positions[:1]).all()):
                raise KVQuantError("rows are at different positions (a padded batch?), but no padding was declared: "
                                   "with eviction, call cache.set_padding(attention_mask) first, or padding would "
                                   "be kept and read as sink tokens")

    def update(self, key_states, value_states, *args, **kwargs):
        """Store ``[B, H, n, D]`` keys and values, return the dequantized ``[B, H, kv_len, D]`` views."""
        self._check_update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch = key_states.shape[0]
        if batch != self.batch:
            raise KVQuantError(f"this cache holds {self.batch} rows, the model wrote {batch}")
        key_states, value_states = key_states.detach(), value_states.detach()  # a cache stores data, not graphs
        n, past = key_states.shape[2], self.cumulative_length
        self._check_positions(past, n, batch, kwargs)
        first = self._window()  # DynamicCache returns positions [first, past + n): min(past, W - 1) + n of them
        declared = self.padding.mask is not None
        real = self.padding.real(first, past + n, batch) if declared else None  # [B, kv_len]
        mask = real[:, real.shape[1] - n :] if declared else None
        new = [left_align(x, mask) for x in (key_states, value_states)]
        raws = [key_states, value_states]
        if self.rope is not None:  # keys stored as they were before RoPE, at their real tokens' positions
            positions = left_align(given_positions(kwargs, n, batch)[:, None, :, None], mask)[0][:, 0, :, 0]
            self.rope.check(positions)
            unrotated = self.rope.take_off(new[0][0], positions)
            new[0], raws[0] = (unrotated, new[0][1]), unrotated
        for (states, _), raw, store, name in zip(new, raws, (self.k, self.v), ("keys", "values")):
            if not fits(raw, store.codec.max_abs):  # one reduction; then only the real tokens (padding may hold any)
                check_states(states, store.codec.max_abs, name, store.codec.max_abs_reason)
            store.codec.check(states, name)  # e.g. a rotation's overflow: refused before anything is stored
        self.cumulative_length += n
        keep = self.readable_tokens()  # per row, what the window still needs after this update
        visible = real.sum(1).tolist() if declared else [past + n - first] * batch
        if self.rope is not None:
            self.rope.append(positions, new[0][1], [self.k.length(row) for row in range(batch)])
        for (states, counts), store in zip(new, (self.k, self.v)):
            store.append(states, counts)
        if self._fuses(n):  # attention reads the stores' codes (fused.attention), before the eviction below
            out = fused.placeholders(self, key_states, real, visible, past + n - first)
        else:
            out = []
            for (states, _), store in zip(new, (self.k, self.v)):
                read = states.new_empty(batch, states.shape[1], past + n - first, states.shape[3])
                store.read(read, real, visible)
                out.append(read)
            if self.rope is not None:
                self.rope.put_on(out[0], self.k.ordinals(real, visible, out[0].shape[2]))
        for (_, counts), store, name in zip(new, (self.k, self.v), ("keys", "values")):
            if self.reads is not None:
                for row in range(batch):
                    self.reads.count(name, store.read_runs(row, visible[row]), counts[row])
            if self.capacity is not None and not self.eviction_by_importance:
                store.evict(keep)
        if self.eviction_by_importance:
            for row in range(batch):  # the policy ranks each row's own tokens
                self._evict_least_important(row, keep[row])
        self._check()
        return query.tag(out[0], self.k.codec), out[1]

    def _fuses(self, n: int) -> bool:
        """Whether this step's attention reads the stored codes (:mod:`kvquant.cache.fused`): fused decode is on, the
        attention module now running calls kvquant's attention (any other would read the placeholders as NaN), the
        step is short, and a kernel reads both stores as they are (no importance eviction, whose hidden tokens change
        between steps; no pre-RoPE keys, whose codes hold keys without RoPE)."""
        return self.fused and self.rope is None and fused.reads_codes() and n <= fused.MAX_QUERY and \
            not self.eviction_by_importance and fusable(self.k.codec) and fusable(self.v.codec) and \
            self.k.tail.device.type != "meta"

    @property
    def eviction_by_importance(self) -> bool:
        return bool(self.eviction and self.eviction.importance)

    def _evict_least_important(self, row: int, keep: int) -> None:
        """Stop reading the tokens of row ``row`` the policy drops to keep ``keep`` (see
        :meth:`kvquant.cache.eviction.KeyNorm.choose`)."""
        k, v = self.k, self.v
        visible = k.read_ordinals(row)
        excess = len(visible) - keep
        if excess <= 0:
            return
        scores = dict(zip(k.ords[row], k.scores[row].tolist())) if k.scores is not None else {}
        chosen = self.eviction.choose(visible, k.n_sinks[row], block_tokens(k.codec, v.codec), excess, scores)
        if len(chosen) < excess:
            raise InternalError(f"row {row} has {len(chosen)} of {excess} tokens to evict; please report this")
        k.hide(row, chosen)
        v.hide(row, chosen)

    def _check_front_padding(self, stop: int, batch: int) -> None:
        """An evicting layer's virtual positions hold each row's kept tokens right-aligned, which the model's mask
        reads right only when every row's padding is in front of all its tokens (left padding)."""
        for count, first, last in self.padding.spans(0, stop, batch):
            if count and (count != last - first or last != stop):
                raise KVQuantError("eviction needs padding in front of every row's tokens (left padding); this "
                                   "batch has padding between or after real tokens")

    def _check(self) -> None:
        """Stored tokens agree with what was written (cheap; a disagreement is a bug, never a silent result)."""
        written = self.padding.count(0, self.cumulative_length, self.batch)
        for row, held in enumerate(self.readable_tokens()):
            for store in (self.k, self.v):
                unit = block_tokens(self.k.codec, self.v.codec) if self.eviction_by_importance else store.unit
                slack = unit - 1 if self.capacity is not None else 0
                stored = store.stored_tokens(row)
                if store.length(row) != written[row] or not held <= stored <= held + slack:
                    raise InternalError(
                        f"row {row} stores {stored} of {store.length(row)} tokens, expected "
                        f"{held} (+{slack}) of {written[row]}; please report this")
            if self.rope is not None and self.rope.positions.shape[1] < written[row]:
                raise InternalError(f"row {row} keeps the positions of {self.rope.positions.shape[1]} of its "
                                    f"{written[row]} keys; please report this")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the kept past and the query's own tokens, from position ``kv_offset``."""
        first = self._window()
        return self.cumulative_length - first + query_length, first

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        self.k = self.v = None
        if self.rope is not None:
            self.rope = PreRope(self.rope.tables, self.rope.layer)
        self.cumulative_length = 0
        self.is_initialized = False

    def select_rows(self, rows: list[int]) -> None:
        """Keep these rows, in this order (repeats allowed: each becomes a copy that shares the stored units). The
        cache selects the padding rows once."""
        if self.is_initialized:
            self.k.select(rows)
            self.v.select(rows)
            if self.rope is not None:
                self.rope.select(rows)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: each row keeps its own table, so rows reorder exactly."""
        self.select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows([r for r in range(self.batch) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.select_rows(torch.arange(self.batch)[indices].tolist())

    def crop(self, tokens_to_remove: int) -> None:
        raise KVQuantError("a quantized cache cannot be cropped (quantized groups cannot be split); use a fresh cache")

    def offload(self):
        raise KVQuantError("kvquant caches do not support offloading yet (see docs/staged.md, 'Offloading')")

    prefetch = offload

    def memory(self) -> dict[str, int]:
        """Bytes stored, by the role each codec declares for its stored tensors (:class:`~.roles.StorageRole`:
        payload, scale for every per-group metadata, full precision; sinks and the tail are full precision), a unit
        several rows hold counted once (``shared_saved_bytes`` what counting it per row would add, ``shared_bytes``
        the units several rows hold), ``shareable_bytes`` (what a fork of row 0 would share with it: its units) and
        what fp16 would take for the tokens attention can read. ``reserved_bytes``: the rest of the stores' tensors,
        which hold no token (pool slots kept for later writes or freed, sinks not yet filled, tail positions past a
        row's own tail; see :meth:`Store.reserved_bytes`): stored and reserved bytes together are every byte of the
        tensors this layer holds on its device (:meth:`host_tensors`: the bookkeeping it keeps on the CPU)."""
        out = {"payload_bytes": 0, "scale_bytes": 0, "full_precision_bytes": 0, "fp16_bytes": 0,
               "shared_saved_bytes": 0, "shareable_bytes": 0, "shared_bytes": 0, "reserved_bytes": 0}
        if not self.is_initialized:
            return out
        # an evicting layer's fp16 reference is every token written (what it saves is the point); a sliding
        # window's is what the model's own cache holds
        tokens = self.padding.count(0, self.cumulative_length, self.batch) if self.eviction else self.readable_tokens()
        for store in (self.k, self.v):
            holders = store.holders()
            live, shared = int((holders > 0).sum()), int((holders > 1).sum())
            slot = sum(store.slot_bytes().values())
            for category, nbytes in by_category(store.codec, store.slot_bytes()).items():
                out[category] += live * nbytes
            out["full_precision_bytes"] += store.full_precision_bytes()
            out["shared_saved_bytes"] += (int(holders.sum()) - live) * slot
            out["shared_bytes"] += shared * slot
            out["shareable_bytes"] += store.units[0] * slot
            out["fp16_bytes"] += store.heads * store.head_dim * sum(tokens) * FP16_BYTES
            out["reserved_bytes"] += store.reserved_bytes()
        return out

    def host_tensors(self) -> list[torch.Tensor]:
        """The bookkeeping tensors this layer keeps on the CPU whatever its device: block tables, free-slot lists,
        importance scores (:meth:`Store.host_tensors`) and the codecs' constants (a rotation's matrix); the cache
        counts each storage once."""
        if not self.is_initialized:
            return []
        rope = self.rope.tensors() if self.rope is not None else []
        return [t for store in (self.k, self.v) for t in (*store.host_tensors(), *codec_tensors(store.codec))] + rope
