"""The one module that touches transformers' cache internals (``transformers.cache_utils``).

``make_cache(model, "int4")`` returns a :class:`KVQuantCache`, a ``transformers.Cache`` whose layers store
keys and values quantized *on write*: every ``update`` quantizes what it can of the new states (all but the
sink tokens, the residual window and an incomplete key group) and returns the dequantized view of the whole
layer, the current call's tokens included. A single forward pass (simulated mode) and chunked or
token-by-token feeding (streaming mode) therefore both attend to quantized K/V.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, get_layer_types_and_kwargs

from .errors import KVQuantError, NonFiniteKVError
from .quantizers import Codec, Quantizer, get_quantizer

FP16_BYTES = 2
SLIDING_TYPES = ("sliding_attention", "chunked_attention")
_ROLE = {"payload": "payload_bytes", "scale": "scale_bytes", "zero": "scale_bytes", "full": "full_precision_bytes"}


class _Stream:
    """One stream (keys or values) of one layer, in token order:

    ``sinks`` ``[B, H, s, D]`` full precision | ``enc`` quantized units (dim 2 counts units) | ``tail``
    ``[B, H, t, D]`` full precision (the residual window plus tokens short of a whole unit).
    """

    def __init__(self, codec: Codec, sink_tokens: int, residual_length: int, x: torch.Tensor):
        self.codec, self.sink_tokens, self.residual_length = codec, sink_tokens, residual_length
        empty = x.new_empty(*x.shape[:2], 0, x.shape[3])
        self.sinks, self.tail = empty, empty
        self.enc: dict[str, torch.Tensor] = {}
        self.n_enc = 0

    def __len__(self) -> int:
        return self.sinks.shape[2] + self.n_enc + self.tail.shape[2]

    def append(self, x: torch.Tensor, name: str) -> None:
        """Store ``x`` ``[B, H, n, D]``: fill the sinks, then quantize every whole unit beyond the residual window."""
        _check_states(x, self.codec.max_abs, name)
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
            self.n_enc += flush
            self.tail = self.tail[:, :, flush:].clone()  # a slice would keep the whole block alive

    def materialize(self, last: int | None = None) -> torch.Tensor:
        """The dequantized stream ``[B, H, N, D]``, or only its ``last`` tokens."""
        s, q = self.sinks.shape[2], self.n_enc
        out = self.tail.new_empty(*self.tail.shape[:2], len(self), self.tail.shape[3])
        out[:, :, :s] = self.sinks
        if q:
            self.codec.decode_into(self.enc, out[:, :, s : s + q])
        out[:, :, s + q :] = self.tail
        return out if last is None else out[:, :, len(self) - last :]

    def drop_front(self, keep: int) -> None:
        """Forget all but the last ``keep`` tokens, in whole units (a sliding window never reads them again).
        Only sliding-window layers call it, and they keep no sinks."""
        excess = len(self) - keep
        unit = self.codec.tokens_per_unit
        units = min(excess, self.n_enc) // unit
        if units:
            self.enc = {k: v[:, :, units:].clone() for k, v in self.enc.items()}
            self.n_enc -= units * unit
            excess -= units * unit
        if excess > 0 and self.n_enc == 0:
            self.tail = self.tail[:, :, excess:].clone()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"sinks": self.sinks, "tail": self.tail, **self.enc}

    def map_batch(self, fn) -> None:
        """Apply ``fn`` to the batch dimension of every stored tensor (beam reorder, repeat, select)."""
        self.sinks, self.tail = fn(self.sinks), fn(self.tail)
        self.enc = {k: fn(v) for k, v in self.enc.items()}

    def nbytes(self) -> dict[str, int]:
        out = {"payload_bytes": 0, "scale_bytes": 0, "full_precision_bytes": 0}
        for key, t in self.tensors().items():
            out[_ROLE.get(key, "full_precision_bytes")] += t.numel() * t.element_size()
        return out


def _check_states(x: torch.Tensor, max_abs: float, name: str) -> None:
    if x.device.type == "meta":  # shapes only (capacity planning): nothing to check
        return
    amax = float(x.abs().amax()) if x.numel() else 0.0
    if math.isfinite(amax) and amax <= max_abs:
        return
    if not torch.isfinite(x).all():
        raise NonFiniteKVError(
            f"{name} hold NaN or Inf; kvquant does not store non-finite states, since one of them would corrupt the "
            "scale of its whole group. Check the model's dtype (fp16 overflow) and inputs."
        )
    raise KVQuantError(f"{name} reach |x| = {amax:.4g}, beyond the ±{max_abs:g} its scales and zero points "
                       "can hold (scale_dtype='float32' holds more)")


class QuantizedLayer(CacheLayerMixin):
    """One attention layer's quantized cache; with ``sliding_window`` it keeps what that window needs."""

    is_croppable = False

    def __init__(self, quantizer: Quantizer, residual_length: int, sink_tokens: int, sliding_window: int | None = None):
        super().__init__()
        self.quantizer, self.residual_length = quantizer, residual_length
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        # Sinks would fall out of a sliding window: such layers keep none.
        self.sink_tokens = 0 if self.is_sliding else sink_tokens
        self.cumulative_length = 0
        self.k: _Stream | None = None
        self.v: _Stream | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        key_codec, value_codec = self.quantizer.codecs(key_states.shape[-1])
        self.k = _Stream(key_codec, self.sink_tokens, self.residual_length, key_states)
        self.v = _Stream(value_codec, self.sink_tokens, self.residual_length, value_states)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Store ``[B, H, n, D]`` keys and values, return the dequantized ``[B, H, kv_len, D]`` views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        past_visible = self.cumulative_length if not self.is_sliding else min(self.cumulative_length, self.sliding_window - 1)
        self.cumulative_length += n
        self.k.append(key_states, "keys")
        self.v.append(value_states, "values")
        keys, values = self.k.materialize(past_visible + n), self.v.materialize(past_visible + n)
        if self.is_sliding:
            self.k.drop_front(self.sliding_window - 1)
            self.v.drop_front(self.sliding_window - 1)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.is_sliding:
            return self.cumulative_length + query_length, 0
        window = self.sliding_window
        kv_offset = max(self.cumulative_length - window + 1, 0)
        if self.cumulative_length >= window:
            return window - 1 + query_length, kv_offset
        return self.cumulative_length + query_length, kv_offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        self.k = self.v = None
        self.cumulative_length = 0
        self.is_initialized = False

    def _map_batch(self, fn) -> None:
        if self.is_initialized:
            self.k.map_batch(fn)
            self.v.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: quantized codes are per sequence, so they reorder exactly."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        raise KVQuantError("a quantized cache cannot be cropped (quantized groups cannot be split); use a fresh cache")

    def offload(self):
        raise KVQuantError("kvquant caches do not support offloading")

    prefetch = offload

    def memory(self) -> dict[str, int]:
        """Bytes really stored, by role, and what an fp16 ``DynamicCache`` layer would hold for the same tokens."""
        out = {"payload_bytes": 0, "scale_bytes": 0, "full_precision_bytes": 0, "fp16_bytes": 0}
        if not self.is_initialized:
            return out
        for stream in (self.k, self.v):
            for key, nbytes in stream.nbytes().items():
                out[key] += nbytes
        held = self.cumulative_length if not self.is_sliding else min(self.cumulative_length, self.sliding_window - 1)
        batch, heads, _, head_dim = self.k.tail.shape
        out["fp16_bytes"] = 2 * batch * heads * head_dim * held * FP16_BYTES
        return out


class KVQuantCache(Cache):
    """A ``transformers.Cache`` of :class:`QuantizedLayer` (plus transformers' ``DummyLayer`` for layers that
    reuse another layer's KV). Pass it as ``model(..., cache=cache)`` or ``model.generate(..., cache=cache)``."""

    def __init__(self, layers: list, quantizer: Quantizer, residual_length: int, sink_tokens: int):
        super().__init__(layers=layers)
        self.quantizer, self.residual_length, self.sink_tokens = quantizer, residual_length, sink_tokens

    def settings(self) -> dict[str, object]:
        """Everything needed to rebuild this cache with :func:`make_cache`."""
        return {**self.quantizer.describe(), "residual_length": self.residual_length, "sink_tokens": self.sink_tokens}

    def memory_report(self) -> dict[str, float]:
        """``total_bytes`` (every stored tensor: payload, scales, zero points, full-precision windows),
        ``fp16_bytes`` (an fp16 ``DynamicCache`` for the same tokens), ``ratio``, ``bits_per_element``,
        the breakdown by role and ``tokens`` (sequence length)."""
        parts = [layer.memory() for layer in self.layers if isinstance(layer, QuantizedLayer)]
        return _summarize(parts, self.get_seq_length())


def _summarize(parts: list[dict[str, int]], tokens: int) -> dict[str, float]:
    report = {key: sum(p[key] for p in parts) for key in ("payload_bytes", "scale_bytes", "full_precision_bytes",
                                                           "fp16_bytes")}
    total = report["payload_bytes"] + report["scale_bytes"] + report["full_precision_bytes"]
    fp16 = report["fp16_bytes"]
    return {
        "total_bytes": total,
        **report,
        "ratio": total / fp16 if fp16 else float("nan"),
        "bits_per_element": 16 * total / fp16 if fp16 else float("nan"),
        "tokens": tokens,
    }


def attention_layout(model_or_config) -> list[int | None | str]:
    """Per decoder layer: ``None`` for full attention, the window for sliding-window attention, ``"shared"`` for a
    layer that reuses another layer's KV (it stores nothing). Errors name layers kvquant cannot cache."""
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "get_text_config"):
        raise KVQuantError(f"need a transformers model or config, got {type(model_or_config).__name__}")
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


def build_cache(
    layout: list[int | None | str], quantizer: str | Quantizer = "int4", *, residual_length: int | None = None,
    sink_tokens: int = 0, **options
) -> KVQuantCache:
    """A :class:`KVQuantCache` for an :func:`attention_layout`; see :func:`make_cache` for the arguments."""
    if isinstance(quantizer, str):
        quantizer = get_quantizer(quantizer, **options)
    elif options:
        raise KVQuantError(f"options {sorted(options)} given with a Quantizer instance; set them on the instance")
    if residual_length is None:
        residual_length = quantizer.default_residual_length
    for name, value in (("residual_length", residual_length), ("sink_tokens", sink_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise KVQuantError(f"{name} must be a non-negative integer, got {value!r}")
    layers = [DummyLayer() if w == "shared" else QuantizedLayer(quantizer, residual_length, sink_tokens, w)
              for w in layout]
    return KVQuantCache(layers, quantizer, residual_length, sink_tokens)


def make_cache(model_or_config, quantizer: str | Quantizer = "int4", **options) -> KVQuantCache:
    """Build a quantized cache for a decoder model (or its config).

    quantizer: a registered name (see ``kvquant.available_quantizers()``) or a :class:`Quantizer`.
    residual_length: most recent tokens kept in full precision (default: the quantizer's, 128 for integers).
    sink_tokens: first tokens kept in full precision (full-attention layers only).
    Other options are the quantizer's own, e.g. ``group_size=32``, ``key_bits=8``.
    """
    return build_cache(attention_layout(model_or_config), quantizer, **options)


def simulate_memory(
    layout: list[int | None | str], settings: dict, *, batch: int, kv_heads: int, head_dim: int, tokens: int,
    dtype: torch.dtype = torch.float16,
) -> dict[str, float]:
    """``memory_report()`` of a cache after ``tokens`` tokens were written in one call, computed by running the
    cache's own code on meta tensors (shapes only, no data, no compute). ``settings``: make_cache arguments,
    ``{"quantizer": "int4", "group_size": 32, ...}``."""
    settings = dict(settings)
    quantizer = settings.pop("quantizer")
    states = torch.empty(batch, kv_heads, tokens, head_dim, dtype=dtype, device="meta")
    parts = []
    for window in {w for w in layout if w != "shared"}:  # layers of one kind store the same: simulate one each
        layer = build_cache([window], quantizer, **settings).layers[0]
        layer.update(states, states)
        parts += [layer.memory()] * layout.count(window)
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
