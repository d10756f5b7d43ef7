"""An independent fake-quant reference of kvquant's caches, written for the tests in plain PyTorch.

It keeps every key and value ever written in full precision (a ``DynamicCache`` does the bookkeeping of what
attention may see) and, at every update, recomputes what the method says attention should read from scratch:

- positions count from the row's first token; the first ``sink_tokens`` stay exact (full-attention layers only);
- after them, keys are cut into groups of ``key_group`` tokens (per-channel scales) and values into single tokens
  (scales per ``value_group`` channels, or one per token and head for fp8); a group is quantized once it is
  complete and wholly older than the ``residual_length`` most recent tokens, the rest stays exact;
- integers: asymmetric min-max, scale and zero point rounded to fp16, codes rounded against the rounded pair;
  fp8: scale = amax / (format max) rounded to fp16, payload cast to the format.

Nothing here imports kvquant's arithmetic, so agreement means kvquant computed what the method says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

FP16_TINY = torch.finfo(torch.float16).tiny


@dataclass(frozen=True)
class Spec:
    """What one stream stores: ``kind`` is "exact", "int", "fp8" or "fn" (``fn`` fake-quantizes each token's
    ``[B, H, T, D]`` block, every token on its own)."""

    kind: str
    bits: int = 0
    axis: str = "token"  # int: "channel" = groups of `group` tokens per channel; "token" = `group` channels
    group: int = 1
    fp8: torch.dtype | None = None
    fn: object = None

    @property
    def unit(self) -> int:
        return self.group if self.kind == "int" and self.axis == "channel" else 1


def int_fake_quant(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Min-max quantize-dequantize ``x`` (fp32) with one pair per slice along ``dim``."""
    levels = 2**bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / levels).clamp(min=FP16_TINY).half().float()
    zero = lo.half().float()
    codes = torch.round((x - zero) / scale).clamp(0, levels)
    return zero + codes * scale


def fp8_fake_quant(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per token and head: scale the absolute maximum onto the format's maximum, cast, scale back."""
    fmax = torch.finfo(dtype).max
    scale = (x.abs().amax(-1, keepdim=True) / fmax).clamp(min=FP16_TINY).half().float()
    return (x / scale).clamp(-fmax, fmax).to(dtype).float() * scale


def fake_quant_history(x: torch.Tensor, spec: Spec, sinks: int, residual: int) -> torch.Tensor:
    """What attention should read for a whole history ``x`` ``[B, H, L, D]`` of one row-aligned stream."""
    out = x.float().clone()
    if spec.kind == "exact":
        return out.to(x.dtype)
    length = x.shape[2]
    quantized = max(length - sinks - residual, 0) // spec.unit * spec.unit
    body = out[:, :, sinks : sinks + quantized]
    if spec.kind == "fp8":
        body.copy_(fp8_fake_quant(body, spec.fp8))
    elif spec.kind == "fn":
        body.copy_(spec.fn(body))
    elif spec.axis == "channel":
        grouped = body.unflatten(2, (-1, spec.group))
        grouped.copy_(int_fake_quant(grouped, spec.bits, 3))
    else:
        grouped = body.unflatten(-1, (-1, spec.group))
        grouped.copy_(int_fake_quant(grouped, spec.bits, -1))
    return out.to(x.dtype)


class FakeQuantReference(DynamicCache):
    """A ``DynamicCache`` whose updates return the fake-quantized history (see the module docstring)."""

    def __init__(self, model, key: Spec, value: Spec, sink_tokens: int = 0, residual_length: int = 0):
        super().__init__(config=model.config)
        self.specs, self.sink_tokens, self.residual_length = (key, value), sink_tokens, residual_length
        self.history: dict[int, list[torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, _ = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        visible = keys.shape[2]  # what DynamicCache lets attention see (sliding windows included)
        past = self.history.get(layer_idx)
        states = [key_states, value_states] if past is None else [torch.cat([p, s], 2) for p, s in
                                                                   zip(past, (key_states, value_states))]
        self.history[layer_idx] = states
        sinks = 0 if self.layers[layer_idx].is_sliding else self.sink_tokens
        return tuple(fake_quant_history(s, spec, sinks, self.residual_length)[:, :, -visible:]
                     for s, spec in zip(states, self.specs))

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self.history = {i: [s.index_select(0, beam_idx) for s in states] for i, states in self.history.items()}


# Closed-form bytes, written from the storage rules alone (memory_report() and the planner must equal them).


def stream_bytes(tokens, window, unit, bits, scale_pairs_per_unit, sinks, residual, heads, head_dim, elt):
    """Bytes of one stream of one layer and one row after ``tokens`` tokens.

    unit: tokens per quantized unit; scale_pairs_per_unit: fp16 (scale, zero) pairs per unit and head;
    bits 16 means the identity (everything in the model's dtype)."""
    if bits == 16:
        held = min(tokens, window - 1) if window else tokens
        return heads * head_dim * held * elt
    if window:  # sliding: no sinks; whole units leave once the window no longer needs any of their tokens
        sinks = 0
        evicted = max(tokens - (window - 1), 0) // unit * unit
    else:
        evicted = 0
    quantized_ever = max(tokens - sinks - residual, 0) // unit * unit
    quantized = max(quantized_ever - evicted, 0)
    stored = tokens - evicted
    full = stored - quantized
    payload = heads * quantized * head_dim * bits // 8
    scales = 2 * heads * (quantized // unit) * scale_pairs_per_unit * 2
    return payload + scales + full * heads * head_dim * elt


def layer_bytes(tokens, window, setting, heads, head_dim, elt):
    name, group, sinks, residual = setting
    if name == "fp16":
        return 2 * stream_bytes(tokens, window, 1, 16, 0, 0, 0, heads, head_dim, elt)
    bits = {"int8": 8, "int4": 4, "int2": 2}[name]
    value_group = max(d for d in range(1, min(group, head_dim) + 1) if head_dim % d == 0)
    keys = stream_bytes(tokens, window, group, bits, head_dim, sinks, residual, heads, head_dim, elt)
    values = stream_bytes(tokens, window, 1, bits, head_dim // value_group, sinks, residual, heads, head_dim, elt)
    return keys + values


def codebook_fake_quant(x: torch.Tensor, levels: torch.Tensor, statistic: str,
                        scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Non-uniform codes per token and head, in float64: ``s`` = the vector's norm / sqrt(D) (``"rms"``) or its
    largest |x| (``"absmax"``), rounded to ``scale_dtype``; each ``x / s`` replaced by the nearest of ``levels``
    (by distance: no midpoints); read ``s * level`` (0 where ``s`` is 0)."""
    x64 = x.double()
    if statistic == "rms":
        s = x64.norm(dim=-1, keepdim=True) / x.shape[-1] ** 0.5
    else:
        s = x64.abs().amax(-1, keepdim=True)
    s = s.to(scale_dtype).double()
    u = x64 / torch.where(s > 0, s, torch.ones_like(s))
    nearest = (u.unsqueeze(-1) - levels.double()).abs().argmin(-1)
    return (levels.double()[nearest] * s).to(x.dtype)
