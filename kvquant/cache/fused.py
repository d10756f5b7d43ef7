"""Fused decode: for single-token and short-chunk steps, attention reads the stored codes directly instead of a
dequantized copy of the whole history.

``enable_fused_decode(model)`` switches the model's attention to :func:`attention`, registered with transformers'
``AttentionInterface`` as ``"kvquant_fused_<previous>"`` with the previous implementation's masks. A
:class:`~kvquant.cache.KVQuantCache` made for such a model then answers a step of at most :data:`MAX_QUERY` tokens
with placeholders (a NaN broadcast to ``[B, H, kv_len, D]``, holding no memory, keys and values carrying one
:class:`Pending` read) instead of dequantized keys and values, and :func:`attention` runs a kernel over the
stores: the C++ one (``kvquant/formats/csrc/dequant.cpp`` ``attend_into``) on the CPU, the Triton one
(:mod:`.triton_attend`) on a GPU. Every other call (prefill, other caches, a layout or attention option no kernel
reads: soft-capping, attention sinks, dropout, autograd, ``output_attentions``) goes to the attention the model
had before, with the dequantized copy, as without fused decode.

What a query attends to comes from the model's own mask, translated to the row's read order (padding declared
with ``set_padding`` is not stored, so read positions skip it): each query reads a contiguous range ``[lo, hi)``
of its row's read tokens (causal, sliding windows, padding). A mask with holes in it goes through the dequantized
copy. Kernel and copy agree within float rounding (tests/test_fused.py).

Placeholders go only to :func:`attention`: each attention module of a model given to :func:`enable_fused_decode`
says, while it runs (forward hooks), whether it calls it (:func:`reads_codes`). A cache read by any other attention
(another model, or the same one after fused decode was undone) returns the dequantized copy, as a cache made
without fused decode does (before: a broadcast NaN, which a one-layer model turned into NaN logits).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import sys
from dataclasses import dataclass

import torch

from kvquant.formats import kernels
from kvquant.compat.transformers import attn_implementation, recording_attentions
from kvquant.errors import KVQuantError
from kvquant.formats.roles import StreamKind
from kvquant.cache.storage import Store, _rank
from kvquant.cache.streams import Stream, stream

NAME = "kvquant_fused"
#: Longest step (query tokens) answered by the kernel; longer ones (prefill) read the dequantized copy.
MAX_QUERY = 16
#: Attention arguments the kernel does not implement: a call that sets one reads the dequantized copy.
UNSUPPORTED = ("softcap", "s_aux", "sinks")
#: Model types whose attention passes the cache's keys and values to the attention function unchanged (tested in
#: tests/test_architectures.py); :func:`enable_fused_decode` refuses others.
VERIFIED = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gpt_neox", "cohere2",
                      "olmo2"})


#: Whether the attention module now running hands the cache's keys and values to :func:`attention` (set by the hooks
#: :func:`enable_fused_decode` adds to each attention module, and by :func:`reading_codes`).
_READS_CODES = contextvars.ContextVar("kvquant_reads_codes", default=False)


def reads_codes() -> bool:
    """Whether the attention that reads what a cache returns now is :func:`attention` (so placeholders may go to it)."""
    return _READS_CODES.get()


@contextlib.contextmanager
def reading_codes(on: bool = True):
    """Within this block a fused layer's short steps return placeholders (``on``) or the dequantized copy: for code
    that calls ``update`` itself and hands its output to :func:`attention` (tests, a custom attention module)."""
    token = _READS_CODES.set(on)
    try:
        yield
    finally:
        _READS_CODES.reset(token)


def _enter(module, args) -> None:
    """Forward pre-hook of an attention module: it is about to update the cache, then call the attention its config
    names (``module.config``, else the model's)."""
    config = getattr(module, "config", None) or module._kvquant_config
    module.__dict__.setdefault("_kvquant_tokens", []).append(_READS_CODES.set(is_fused(config)))


def _leave(module, args, output) -> None:
    """Forward hook (always called, errors too): back to what held before :func:`_enter`."""
    tokens = module.__dict__.get("_kvquant_tokens")
    if tokens:
        _READS_CODES.reset(tokens.pop())


def _hook(module, config) -> None:
    """Let ``module`` (an attention module, once) say while it runs whether it reads the codes."""
    if not getattr(module, "_kvquant_hooked", False):
        module._kvquant_config = config
        module.register_forward_pre_hook(_enter)
        module.register_forward_hook(_leave, always_call=True)
        module._kvquant_hooked = True


@dataclass
class Pending:
    """A layer's step, read later by :func:`attention`: snapshots of its stores taken before eviction (a shallow
    copy is enough: eviction and the next write replace a store's tensors and lists, they do not modify them, and
    the pool's slots are only rewritten by the next write), the padding of the returned window (``real``
    ``[B, kv_len]`` bool, None: none declared) and how many tokens each row reads."""

    keys: Store
    values: Store
    real: torch.Tensor | None
    counts: list[int]
    kv_len: int

    def materialize(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized ``[B, H, kv_len, D]`` keys and values the layer would have returned."""
        out = []
        for store in (self.keys, self.values):
            read = like.new_empty(store.rows, store.heads, self.kv_len, store.head_dim)
            store.read(read, self.real, self.counts)
            out.append(read)
        return out[0], out[1]

    def ranges(self, mask: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(lo, hi)`` ``[B, n]`` long: query ``i`` of row ``b`` reads read tokens ``[lo, hi)``, from the model's
        mask (``[B, 1, n, kv_len]`` bool or additive, None: causal); None where that is not a contiguous range, where
        a query reads nothing (eager attention then averages every value, which the kernels do not) or where the
        mask is not a tensor (flex attention's block masks)."""
        if mask is not None and not isinstance(mask, torch.Tensor):
            return None
        if mask is None:
            return self._ranges(mask, n)
        # every layer of a forward reads the same mask: worked out once (on a GPU, one copy to the host per step);
        # within one forward, one window (kv_len) has one padding tensor, so its id and the counts name it
        key = (id(self.real), tuple(self.counts), self.kv_len, n)
        memo = mask.__dict__.setdefault("_kvquant_ranges", {})
        if key not in memo:
            memo[key] = self._ranges(mask, n)
        return memo[key]

    def _ranges(self, mask: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        batch = len(self.counts)
        counts = torch.tensor(self.counts)
        if mask is None:
            if self.real is not None and not bool(self.real.all()):
                return None
            hi = counts[:, None] - (n - 1 - torch.arange(n))[None, :]
            return (torch.zeros_like(hi), hi) if bool((hi > 0).all()) else None
        allowed = mask if mask.dtype == torch.bool else mask == 0
        allowed = allowed.to("cpu")
        if allowed.shape[-1] != self.kv_len or allowed.shape[-2] != n:
            return None
        allowed = allowed.expand(batch, -1, -1, -1)[:, 0]  # [B, n, kv_len]
        if self.real is not None:  # read order: each row's real positions, in order
            order = _rank(self.real)[:, : max(self.counts, default=0)]
            allowed = torch.gather(allowed, 2, order[:, None, :].expand(-1, n, -1))
            allowed &= (torch.arange(order.shape[1])[None, :] < counts[:, None])[:, None, :]
        width = allowed.shape[2]
        index = torch.arange(width)
        any_ = allowed.any(2)
        lo = torch.where(any_, torch.where(allowed, index, width).amin(2), 0)
        hi = torch.where(any_, torch.where(allowed, index + 1, 0).amax(2), 0)
        if not torch.equal(allowed.sum(2), hi - lo) or not bool(any_.all()):
            return None
        return lo, hi


def _args(s: Stream) -> tuple[list[torch.Tensor], list[int]]:
    kind = int(StreamKind.of(s.kind, s.payload))  # the C++ kernel's enum Kind carries the same numbers
    empty = torch.empty(0)
    return ([s.payload, s.scale if s.scale is not None else empty, s.zero if s.zero is not None else empty, s.table,
             s.sinks, s.tail, s.n_sinks, s.skip, s.units, s.n_tail], [kind, s.bits, s.group, int(s.token_axis)])


def attend_codes(query: torch.Tensor, keys: Stream, values: Stream, lo: torch.Tensor, hi: torch.Tensor,
                 scaling: float) -> torch.Tensor | None:
    """``softmax(scaling * q k^T) v`` for ``query`` ``[B, Hq, n, D]`` over each query's read tokens ``[lo, hi)``,
    read from the stored codes; ``[B, Hq, n, D]``, or None where no kernel can run it here."""
    if query.device.type == "cpu":
        if not kernels.available() or query.dtype not in kernels.OUT_DTYPES or query.shape[-1] > 1024:
            return None
        query = query.contiguous()
        out = torch.empty_like(query)
        (kt, ko), (vt, vo) = _args(keys), _args(values)
        kernels.attend_into(query, kt, ko, vt, vo, lo.contiguous(), hi.contiguous(), scaling, out)
        return out
    if query.device.type == "cuda":
        from kvquant.cache import triton_attend

        if triton_attend.triton_importable():
            return triton_attend.attend(query, keys, values, hi.to(query.device), scaling, lo=lo.to(query.device))
    return None


def _fallback(module):
    """The attention the model had before :func:`enable_fused_decode`."""
    return attention_before(module, "_kvquant_fallback")


def attention_before(module, attribute: str):
    """The attention function whose name ``module.<attribute>`` remembers (``sdpa`` where unset; ``eager`` is each
    model's own function), for an attention kvquant put in front of it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    previous = getattr(module, attribute, "sdpa")
    if previous in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[previous]
    return sys.modules[type(module).__module__].eager_attention_forward


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract (``AttentionInterface``): ``query`` ``[B, Hq, n, D]``, ``key`` /
    ``value`` ``[B, H, kv_len, D]`` (or a kvquant placeholder); returns ``([B, n, Hq, D], None)``."""
    pending: Pending | None = getattr(key, "_kvquant_pending", None)
    if pending is None and getattr(value, "_kvquant_pending", None) is None:
        return _fallback(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                 **kwargs)
    if pending is None or getattr(value, "_kvquant_pending", None) is not pending:
        raise KVQuantError(f"{type(module).__name__} changes the keys or values between the cache and attention; "
                           "fused decode cannot serve it (make the cache without kvquant.enable_fused_decode)")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = None
    # the kernels compute no gradients, soft-capping, sinks, dropout or attention weights: those calls read the copy
    if not dropout and not query.requires_grad and not any(kwargs.get(n) is not None for n in UNSUPPORTED) \
            and not recording_attentions():
        ranges = pending.ranges(attention_mask, query.shape[2])
        if ranges is not None:
            out = attend_codes(query, stream(pending.keys, pending.counts), stream(pending.values, pending.counts),
                               *ranges, scaling)
    if out is None:
        key, value = pending.materialize(query)
        return _fallback(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                 **kwargs)
    return out.transpose(1, 2).contiguous(), None


def placeholders(layer, keys: torch.Tensor, real, counts: list[int], kv_len: int):
    """What a fused layer's ``update`` returns for a short step: keys and values of the real ``[B, H, kv_len, D]``
    shape that hold no memory (one NaN, expanded: should any attention but :func:`attention` read them after all, it
    computes NaN, never a silent wrong number), both carrying the :class:`Pending` read (snapshots of the stores,
    taken now, before eviction). Only while :func:`reads_codes` (see the layer's ``_fuses``)."""
    pending = Pending(copy.copy(layer.k), copy.copy(layer.v), real, counts, kv_len)
    out = []
    for store in (layer.k, layer.v):
        x = torch.full((), float("nan"), dtype=keys.dtype, device=keys.device).expand(
            keys.shape[0], store.heads, kv_len, store.head_dim)
        x._kvquant_pending = pending
        out.append(x)
    return out[0], out[1]


def register(previous: str) -> str:
    """Register :func:`attention` with transformers in front of the ``previous`` implementation, with that
    implementation's masks (``sdpa``'s are boolean, ``eager``'s additive); returns the name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import AttentionInterface

    name = f"{NAME}_{previous}"
    AttentionInterface.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    return name


def enable_fused_decode(model) -> None:
    """Let kvquant caches made for ``model`` from now on answer decode steps from the stored codes (see the module
    docstring). The attention the model used before serves every other call. Undo with
    ``model.set_attn_implementation(previous)``; a cache made while fused decode was on then returns the dequantized
    copy, as does one read by another model (each attention module says, while it runs, whether it calls
    :func:`attention`: forward hooks added here).

    Only model families whose attention hands the cache's keys and values to the attention function unchanged
    (:data:`VERIFIED`, each tested in tests/test_architectures.py) are accepted: others (multi-head latent
    attention, which expands the cached latent; DiffLlama, which splits the values; Gemma4, whose KV sharing checks
    the attention's name) would need code of their own."""
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    kind = getattr(text, "model_type", None)
    if kind not in VERIFIED:
        raise KVQuantError(f"fused decode is verified for model types {', '.join(sorted(VERIFIED))}; this model is "
                           f"{kind!r}, whose attention may change keys and values after the cache")
    current = attn_implementation(model.config) or "eager"
    # a config already switched (another model built from the same config object, or this one again): its
    # attention is kvquant's; this model's modules still need the hooks, or its decode steps never read the codes
    previous = current.removeprefix(f"{NAME}_") if is_fused(model.config) else current
    for module in model.modules():
        if hasattr(module, "layer_idx"):
            module._kvquant_fallback = previous
            _hook(module, model.config)
    if is_fused(model.config):
        return
    model.set_attn_implementation(register(previous))
    if not is_fused(model.config):
        raise KVQuantError(f"{type(model).__name__} did not accept kvquant's attention function (transformers kept "
                           f"{attn_implementation(model.config)!r}); fused decode is not available for it")


def is_fused(config) -> bool:
    """Whether a model of this config has fused decode enabled."""
    return str(attn_implementation(config)).startswith(NAME)
