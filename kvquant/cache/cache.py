"""``KVQuantCache``: a ``transformers.Cache`` of :class:`~kvquant.cache.layer.KVQuantLayer`, and
:func:`stack_rows`, which continues rows of several caches in one batch."""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers.cache_utils import Cache

from kvquant.errors import KVQuantError, one_line
from kvquant.cache.eviction import Eviction
from kvquant.formats.quantizers import Quantizer
from kvquant.cache.reads import Reads
from kvquant.errors import is_int
from kvquant.cache.checks import check_layer_index, describe_value, row_list
from kvquant.cache.layer import KVQuantLayer
from kvquant.cache.memory import summarize
from kvquant.cache.padding import Padding
from kvquant.cache.storage import Store


class KVQuantCache(Cache):
    """A ``transformers.Cache`` of :class:`KVQuantLayer` (plus transformers' ``DummyLayer`` for layers that
    reuse another layer's KV). Pass it as ``model(..., cache=cache)`` or ``model.generate(..., cache=cache)``."""

    def __init__(self, layers: list, quantizer: Quantizer, residual_length: int, sink_tokens: int,
                 head_dim: int | None = None, layer_options: dict[str, dict] | None = None,
                 eviction: Eviction | None = None, pre_rope: bool = False):
        super().__init__(layers=layers)
        self.quantizer, self.residual_length, self.sink_tokens = quantizer, residual_length, sink_tokens
        self.head_dim = head_dim
        self.layer_options = layer_options or {}  # normalized ``layers=`` of make_cache
        self.eviction = eviction
        self.pre_rope = pre_rope  # keys stored without RoPE (kvquant/cache/prerope.py): each layer has its ``rope``
        self.padding = next((layer.padding for layer in layers if isinstance(layer, KVQuantLayer)), Padding())
        self._reads: Reads | None = None
        for index, layer in enumerate(layers):
            if isinstance(layer, KVQuantLayer):
                layer.index = index

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Store the keys and values of layer ``layer_idx`` (see :meth:`KVQuantLayer.update`)."""
        check_layer_index("update", layer_idx, len(self.layers))
        if not isinstance(self.layers[layer_idx], KVQuantLayer) and (key_states is not None or
                                                                      value_states is not None):
            raise KVQuantError(f"update: layer_idx {layer_idx} is a layer that reuses another layer's KV (it stores "
                               "nothing); update the layer that computes them")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def reads(self) -> Reads | None:
        """The counter of what attention read from this cache (:mod:`kvquant.cache.reads`), if one was given."""
        return self._reads

    @reads.setter
    def reads(self, counter: Reads | None) -> None:
        self._reads = counter
        for layer in self.layers:
            if isinstance(layer, KVQuantLayer):
                layer.reads = counter

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions written (padding included) to layer ``layer_idx``."""
        check_layer_index("get_seq_length", layer_idx, len(self.layers))
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
        rows = row_list("reorder_cache", "beam_idx", beam_idx, self._row_count())  # one device sync for all layers
        for layer in self.layers:
            if isinstance(layer, KVQuantLayer):
                layer.select_rows(rows)
            else:
                layer.reorder_cache(beam_idx)
        self.padding.select(rows)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not is_int(repeats) or repeats < 1:
            raise KVQuantError("batch_repeat_interleave: repeats must be an integer >= 1, got "
                               f"{describe_value(repeats)}")
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
                raise KVQuantError(f"batch_select_indices: indices {describe_value(indices)} do not index a cache of "
                                   f"{count} rows: {one_line(err)}") from None
            if chosen.dim() != 1 or not len(chosen):
                raise KVQuantError(f"batch_select_indices: indices {describe_value(indices)} select "
                                   f"{tuple(chosen.shape)} of a cache of {count} rows; they must select at least one "
                                   "row, along one dimension")
        super().batch_select_indices(indices)
        if self.padding.mask is not None:
            self.padding.select(torch.arange(self.padding.mask.shape[0])[indices].tolist())

    def fork(self, rows: list[int]) -> None:
        """Keep these rows in this order; a row listed several times becomes independent copies that share the
        stored prefix until they write (prefix sharing: prefill a context once, then extend each copy)."""
        rows = row_list("fork", "rows", rows, self._row_count())
        self.batch_select_indices(torch.tensor(rows, dtype=torch.long))

    def rows(self) -> int | None:
        """Batch rows this cache holds (None before its first write)."""
        written = (layer.batch for layer in self.layers if isinstance(layer, KVQuantLayer) and layer.is_initialized)
        return next(written, None)


    def settings(self) -> dict[str, object]:
        """The make_cache options of this cache, defaults filled in: ``make_cache(model, **cache.settings())``
        rebuilds it."""
        layers = {"layers": copy.deepcopy(self.layer_options)} if self.layer_options else {}
        eviction = {"eviction": self.eviction.name, **dataclasses.asdict(self.eviction)} if self.eviction else {}
        rope = {"pre_rope": True} if self.pre_rope else {}  # said only when on: settings from before it stay the same
        return {**self.quantizer.describe(), "residual_length": self.residual_length, "sink_tokens": self.sink_tokens,
                **eviction, **rope, **layers}

    def derived_settings(self) -> dict[str, object]:
        """What the quantizer derived from the model's head_dim: the groups actually used (``key_group``,
        ``value_group``), ``rotation_block``. Not options: reports show them beside :meth:`settings`."""
        return self.quantizer.derived_settings(self.head_dim) if self.head_dim else {}

    def memory_report(self) -> dict[str, float]:
        """What the cache holds, in bytes.

        - ``stored_bytes``: what holds tokens (payload, scales, zero points, full-precision sinks and tails; a unit
          rows share after a fork counted once, whole). ``total_bytes`` is the same number under the name every
          earlier reader uses, and ``ratio``, ``bits_per_element``, the planner's ``kv_bytes`` and the reports'
          memory figures are all of stored bytes.
        - ``reserved_bytes``: the rest of the cache's tensors, capacity held for growth (pool slots not yet written
          or freed by eviction, sinks not yet filled, tail positions past a shorter row's own tail). A pool grows
          by a quarter while small and by at most ``Store.CHUNK_TOKENS`` tokens per row once large, so at long
          contexts this is a few percent at most.
        - ``tensor_bytes`` = stored + reserved: every byte of the tensors the cache holds on its devices, what the
          device's allocator holds for it (plan a deployment with this one); ``per_device_tensor_bytes`` per
          device.
        - ``host_bytes``: bookkeeping kept on the CPU whatever the device (block tables, importance scores, a
          rotation's matrices), each tensor once.
        - ``fp16_bytes`` (fp16 for the tokens attention can read, per row; with eviction, for every token
          written), the breakdown of stored bytes by role (``payload_bytes``, ``scale_bytes``,
          ``full_precision_bytes``), ``shared_bytes`` (stored once for several rows), ``shared_saved_bytes`` (what
          storing those once saves over storing them per row), ``shareable_bytes`` (what a fork of row 0 would
          share now), ``tokens`` (sequence length), ``per_layer``: per decoder layer that stores KV, ``{"layer",
          "total_bytes", "reserved_bytes", "fp16_bytes", "bits_per_element", "device"}``, and ``per_device``:
          stored bytes on each device (a model split over devices keeps each layer's cache on that layer's
          device)."""
        parts = {i: layer.memory() for i, layer in enumerate(self.layers) if isinstance(layer, KVQuantLayer)}
        devices = {i: str(layer.device) for i, layer in enumerate(self.layers)
                   if isinstance(layer, KVQuantLayer) and layer.is_initialized}
        host = [t for layer in self.layers if isinstance(layer, KVQuantLayer) for t in layer.host_tensors()]
        return summarize(parts, self.get_seq_length(), devices, [*host, *self.padding.tensors()])


def stack_rows(sources: list[tuple[KVQuantCache, int]]) -> KVQuantCache:
    """A new cache whose row ``i`` continues row ``r`` of cache ``c`` for ``sources[i] = (c, r)`` (the sources stay
    as they are; a row listed several times forks, as in :meth:`KVQuantCache.fork`). A cache with nothing written
    yet gives an empty row. Rows that were written over fewer positions than the longest source are padded in
    front: padding before all of a row's tokens changes nothing it stores or computes, so each row continues as it
    would in its own cache. This lets rows prefilled in separate batches (contexts of similar lengths) continue in
    one batch (continuations of similar lengths)."""
    if not isinstance(sources, (list, tuple)):
        raise KVQuantError(f"stack_rows: sources must be a list of (cache, row) pairs, got {describe_value(sources)}")
    if not sources:
        raise KVQuantError("stack_rows needs at least one (cache, row)")
    for i, source in enumerate(sources):
        if not isinstance(source, (list, tuple)) or len(source) != 2:
            got = (f"{type(source).__name__} of {len(source)}" if isinstance(source, (list, tuple))
                   else describe_value(source))
            raise KVQuantError(f"stack_rows: sources[{i}] must be a (cache, row) pair, got {got}")
        if not is_int(source[1]) or source[1] < 0:
            raise KVQuantError(f"stack_rows: sources[{i}]: row must be an integer >= 0, got "
                               f"{describe_value(source[1])}")
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
        if not isinstance(layer, KVQuantLayer):
            layers.append(copy.copy(layer))
            continue
        held = [(c.layers[index], r) for c, r in sources]
        new = KVQuantLayer(layer.quantizer, layer.residual_length, layer.sink_tokens, layer.sliding_window, padding,
                           layer.eviction, layer.rope and layer.rope.stacked(held))
        if any(part.is_initialized for part, _ in held):  # else nothing was written anywhere: it initializes later
            template = next(part for part, _ in held if part.is_initialized)
            for name in ("k", "v"):
                setattr(new, name, Store.stack([(getattr(part, name), r) if part.is_initialized else (None, 0)
                                                for part, r in held]))
            new.device, new.is_initialized = template.device, True
        new.cumulative_length, new.fused = width, layer.fused
        if new.is_initialized:
            new._check()
        layers.append(new)
    stacked = KVQuantCache(layers, first.quantizer, first.residual_length, first.sink_tokens, first.head_dim,
                           first.layer_options, first.eviction, first.pre_rope)
    stacked.reads = first.reads  # the rows go on counting where they were counted
    return stacked


def _kinds(cache: KVQuantCache) -> list:
    """What each layer stores and how (two caches with equal kinds store alike)."""
    return [(type(layer), getattr(layer, "quantizer", None), getattr(layer, "residual_length", None),
             getattr(layer, "sink_tokens", None), getattr(layer, "sliding_window", None),
             getattr(layer, "eviction", None), getattr(getattr(layer, "rope", None), "tables", None))
            for layer in cache.layers]
