"""The model's rotary position embedding (RoPE), read from transformers' modules: what a pre-RoPE cache
(``make_cache(model, ..., pre_rope=True)``, :mod:`kvquant.cache.prerope`) needs to take RoPE off the keys it is
given and put it back on the keys it returns. Checked against transformers 5.25.0.

transformers' attention rotates keys before ``cache.update`` (``modeling_llama.py``, ``LlamaAttention.forward``:
``apply_rotary_pos_emb(query_states, key_states, cos, sin)`` at line 249, then ``cache.update(key_states,
value_states, self.layer_idx, kwargs=kwargs)`` at line 252, the kwargs carrying ``position_ids``). The rotation is
``k * cos + rotate_half(k) * sin`` over the whole head (``rotate_half(x) = cat(-x2, x1)`` of the two halves), with
``cos, sin = model.model.rotary_emb(x, position_ids)`` (Gemma 3: ``rotary_emb(x, position_ids, layer_type)``, one
RoPE per layer type) in the states' dtype. Only the families listed in :data:`HALF_ROTATION_MODELS` are known to
rotate this way, and only the RoPE types in :data:`ROPE_TYPES` have frequencies that do not change with the
sequence length; anything else is refused by :func:`rope_refusal`.
"""

from __future__ import annotations

import inspect
import weakref

import torch

#: ``config.model_type`` of the families whose attention applies RoPE as above, to the whole head (transformers'
#: ``apply_rotary_pos_emb`` with ``rotate_half`` in their modeling files; Phi-3's rotates the first ``cos.shape[-1]``
#: channels, all of them at ``partial_rotary_factor`` 1, which :class:`RotaryTables` checks)
HALF_ROTATION_MODELS = ("gemma2", "gemma3_text", "llama", "mistral", "phi3", "qwen2")
#: RoPE types whose frequencies are fixed when the model is built (``dynamic``, ``longrope`` change them with the
#: sequence length, so a key stored before the change would be rotated back at other frequencies; ``yarn`` and the
#: multimodal ones are not checked here)
ROPE_TYPES = ("default", "linear", "llama3")


def _parameters(config) -> dict[str | None, dict]:
    """The RoPE parameters per layer type (None: one set for every layer)."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return dict(params)
    return {None: dict(params)}


def rope_refusal(model) -> str | None:
    """Why a pre-RoPE cache cannot run on ``model`` (one line), or None where it can."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        return "pre_rope needs the loaded model (its rotary embedding), not a config: make_cache(model, ...)"
    config = model.config.get_text_config(decoder=True)
    kind = getattr(config, "model_type", None)
    if kind not in HALF_ROTATION_MODELS:
        return (f"pre_rope: model type {kind!r} is not one kvquant knows the RoPE of (it knows "
                f"{', '.join(HALF_ROTATION_MODELS)})")
    for layer_type, params in _parameters(config).items():
        where = f" ({layer_type})" if layer_type else ""
        rope_type = params.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            return (f"pre_rope: RoPE type {rope_type!r}{where} is not supported (supported: {', '.join(ROPE_TYPES)}; "
                    "its frequencies or scaling are not fixed positions' rotations kvquant can undo)")
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if factor is not None and factor != 1.0:
            return f"pre_rope: partial rotary (partial_rotary_factor {factor}{where}) is not supported"
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
    if not isinstance(getattr(decoder, "rotary_emb", None), torch.nn.Module):
        return f"pre_rope: {type(model).__name__} has no rotary_emb module where transformers keeps it"
    return None


class RotaryTables:
    """``cos`` and ``sin`` of the model's RoPE per position, computed by the model's own ``rotary_emb`` and kept:
    a position's values are computed once and never again (a table grows by the new positions only), so a key
    rotated back on read uses exactly the values it was rotated off with on write. One per model and dtype."""

    def __init__(self, model):
        refusal = rope_refusal(model)
        if refusal:
            raise ValueError(refusal)
        config = model.config.get_text_config(decoder=True)
        decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
        self.rotary = decoder.rotary_emb
        per_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        types = getattr(config, "layer_types", None)
        #: per decoder layer, the ``layer_type`` argument of ``rotary_emb`` (None: it takes none)
        self.layer_types = [t if per_type else None for t in types] if per_type and types else None
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer_type in set(self.layer_types or [None]):  # what rotary_emb computes covers the whole head
            args = (torch.empty(0), torch.zeros(1, 1, dtype=torch.long))
            with torch.no_grad():
                rotated = self.rotary(*args, *([layer_type] if layer_type else []))[0].shape[-1]
            if rotated != self.head_dim:
                raise ValueError(f"pre_rope: the model's RoPE rotates {rotated} of head_dim {self.head_dim} channels "
                                 "(partial rotary is not supported)")

    def layer_type(self, layer: int) -> str | None:
        return self.layer_types[layer] if self.layer_types else None

    def cos_sin(self, layer: int, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[*positions.shape, head_dim / 2]`` in ``dtype`` for integer ``positions`` (>= 0) of
        layer ``layer``, on their device: those of the angle of each pair of channels ``(i, i + head_dim / 2)``
        (transformers' tables repeat them over both halves, which is checked as they are computed)."""
        key = (self.layer_type(layer), dtype, positions.device)
        cos, sin = self.tables.get(key, (None, None))
        have = 0 if cos is None else cos.shape[0]
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > have:
            grown = max(need, 2 * have, 64)
            fresh = torch.arange(have, grown, device=positions.device)[None]
            like = torch.empty(0, dtype=dtype, device=positions.device)
            args = (like, fresh) if key[0] is None else (like, fresh, key[0])
            with torch.no_grad():
                new_cos, new_sin = self.rotary(*args)
            half = self.head_dim // 2
            for table in (new_cos[0], new_sin[0]):
                if not torch.equal(table[:, :half], table[:, half:]):
                    raise ValueError("pre_rope: the model's RoPE tables differ between the two halves of the head, "
                                     "so its pairs of channels are not the halves transformers' rotate_half turns")
            cos = new_cos[0, :, :half] if cos is None else torch.cat([cos, new_cos[0, :, :half]])
            sin = new_sin[0, :, :half] if sin is None else torch.cat([sin, new_sin[0, :, :half]])
            self.tables[key] = cos, sin
        return cos[positions], sin[positions]

    def tensors(self) -> list[torch.Tensor]:
        """The tables kept (host bookkeeping of a cache that reads them)."""
        return [t for pair in self.tables.values() for t in pair]


#: :class:`RotaryTables` of each model (the caches made for one model share its tables)
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rotary_tables(model) -> RotaryTables:
    """The model's :class:`RotaryTables` (made once per model); ``ValueError`` with :func:`rope_refusal`'s line
    where a pre-RoPE cache cannot run on it."""
    if isinstance(model, torch.nn.Module) and model in _TABLES:
        return _TABLES[model]
    tables = RotaryTables(model)
    _TABLES[model] = tables
    return tables
