"""The query as an engine's attention reads it: a format whose engine converts the query before its dot product with
the stored keys (llama.cpp's CPU flash attention: to K's ``vec_dot_type``, q8_0 for a q4_0 cache) says so with its
key codec's ``query(q)`` (``[B, Hq, n, D]`` -> float32, the same shape).

A :class:`~kvquant.cache.KVQuantLayer` tags the keys it returns with that conversion (:func:`tag`);
:func:`converting_attention`, registered with transformers' ``AttentionInterface`` in front of the model's own attention
by :func:`enable_query_conversion`, hands the model's attention the converted query, rounded to the query's dtype, when
the keys carry a tag, and the query untouched otherwise. ``make_cache(model, ...)`` enables it for a model whose cache
converts the query (a quantizer with ``converts_query``); on a model with fused decode the conversion
goes in front of the attention fused decode falls back to, so fused decode stays on for other caches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvquant.compat.transformers import attn_implementation
from kvquant.formats import ops
from kvquant.formats.quantizers import Codec, RotatedCodec
from kvquant.cache.fused import attention_before, is_fused

NAME = "kvquant_query"
TAG = "_kvquant_query"
#: where fused decode keeps the attention it falls back to (:mod:`kvquant.cache.fused`)
FUSED_FALLBACK = "_kvquant_fallback"


def query_of(codec: Codec) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The codec's query conversion (through kvquant's own rotation: rotated, converted, rotated back), or None."""
    own = getattr(codec, "query", None)
    if own is not None or not isinstance(codec, RotatedCodec):
        return own
    inner = query_of(codec.inner)
    if inner is None:
        return None
    return lambda q: ops.rotate(inner(ops.rotate(q.float(), codec.matrix)), codec.matrix.T)


def tag(keys: torch.Tensor, codec: Codec) -> torch.Tensor:
    """``keys`` (what a layer returns) carrying ``codec``'s query conversion, if it has one."""
    convert = query_of(codec)
    if convert is not None:
        setattr(keys, TAG, convert)
    return keys


def _previous(module):
    """The attention :func:`enable_query_conversion` put this in front of."""
    return attention_before(module, "_kvquant_query_previous")


def converting_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function contract: the previous attention, with ``query`` ``[B, Hq, n, D]`` converted
    as ``key``'s tag says."""
    convert = getattr(key, TAG, None)
    if convert is not None:
        query = convert(query).to(query.dtype)
    return _previous(module)(module, query, key, value, attention_mask, **kwargs)


def _register(previous: str) -> str:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import AttentionInterface

    name = f"{NAME}_{previous}"
    AttentionInterface.register(name, converting_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    return name


def enable_query_conversion(model) -> None:
    """Let the query conversion of the caches made for ``model`` reach its attention (idempotent)."""
    modules = [m for m in model.modules() if hasattr(m, "layer_idx")]
    if is_fused(model.config):  # fused decode: convert in front of the attention it falls back to
        previous = getattr(modules[0], FUSED_FALLBACK, "sdpa") if modules else "sdpa"
        if not previous.startswith(NAME):
            _register(previous)
            for m in modules:
                m._kvquant_query_previous, m._kvquant_fallback = previous, f"{NAME}_{previous}"
        return
    previous = attn_implementation(model.config) or "eager"
    if previous.startswith(NAME):
        return
    for m in modules:
        m._kvquant_query_previous = previous
    model.set_attn_implementation(_register(previous))
