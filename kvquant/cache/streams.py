"""What a fused decode kernel reads: one :class:`~kvquant.cache.storage.Store` described as plain tensors (no
copies), so attention can walk the stored codes instead of a dequantized copy of the whole history.

Read order of row ``b`` (the same tokens, in the same order, as :meth:`Store.read` returns for it): for
``j < n_sinks[b]`` the sink ``sinks[b, :, j]``; after the sinks, the row's stored positions
``p = j - n_sinks[b] + skip[b]`` (``skip[b]`` tokens of a partly evicted unit stay stored, unread): ``p <
units[b] * R`` is row ``p % R`` of slot ``table[b, p // R]`` of the pool, else ``tail[b, :, p - units[b] * R]``.
A row reads ``count(b) = n_sinks[b] + units[b] * R + n_tail[b] - skip[b]`` tokens.

Stored forms (``N`` pool slots, ``H`` KV heads, ``R`` tokens per unit, ``D`` head_dim):

- ``kind="int"``: min-max integer codes, ``x = zero + code * scale`` in fp32. ``payload`` ``[N, H, R, D*bits/8]``
  uint8, packed in blocks (the code of channel ``j * Dp + i`` sits in byte ``i`` at bit ``j * bits``, ``Dp =
  D*bits/8``); ``token_axis`` (``R == 1``): ``scale``/``zero`` ``[N, H, D/group]``, channel ``c`` uses pair
  ``c // group``; channel axis (``R == group``): ``scale``/``zero`` ``[N, H, D]``, one pair per channel for the
  unit's ``R`` tokens. Scales in float16 or float32.
- ``kind="fp8"``: ``payload`` ``[N, H, 1, D]`` float8 (e4m3fn or e5m2), ``scale`` ``[N, H, 1]`` (or ``[N, 1, 1]``:
  one scale for all heads, fp8's ``granularity="tensor"``): ``x = payload * scale`` in fp32.
- ``kind="full"``: ``payload`` ``[N, H, 1, D]`` in the model's dtype (the fp16 baseline), no scale.

Decoded values are rounded to the model's dtype (``sinks.dtype``) before attention uses them, as the dequantized
copy is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvquant.formats.research import Fp8Codec, IdentityCodec, IntCodec
from kvquant.cache.storage import Store


@dataclass(frozen=True)
class Stream:
    """One store as a kernel reads it; shapes in the module docstring. Per-row counts are ``[B]`` int64 on the CPU."""

    kind: str
    payload: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    bits: int
    group: int
    token_axis: bool
    table: torch.Tensor
    sinks: torch.Tensor
    tail: torch.Tensor
    n_sinks: torch.Tensor
    skip: torch.Tensor
    units: torch.Tensor
    n_tail: torch.Tensor

    @property
    def unit(self) -> int:
        """``R``: tokens per unit."""
        return self.payload.shape[2]

    def counts(self) -> torch.Tensor:
        """``[B]``: tokens each row reads."""
        return self.n_sinks + self.units * self.unit + self.n_tail - self.skip


def fusable(codec) -> bool:
    """Whether a kernel reads this codec's stored form directly (rotated codecs, for one, are not)."""
    return type(codec) in (IntCodec, Fp8Codec, IdentityCodec)


def stream(store: Store, counts: list[int]) -> Stream:
    """``store`` as a :class:`Stream` whose row ``b`` reads its last ``counts[b]`` stored tokens after its sinks
    (all of its sinks are read: :meth:`Store.read` without hidden tokens)."""
    codec, rows = store.codec, store.rows
    heads, head_dim, unit = store.heads, store.head_dim, store.unit
    stored = [store.stored_tokens(b) for b in range(rows)]
    skip = [s - c for s, c in zip(stored, counts)]
    if any(k < 0 for k in skip):
        raise ValueError(f"rows read more tokens than they store: {counts} of {stored}")
    pool = store.pool
    like = store.tail
    if isinstance(codec, IntCodec):
        kind, bits, group, token = "int", codec.bits, codec.group, codec.axis == "token"
        if pool:
            payload = pool["payload"].view(pool["payload"].shape[0], heads, unit, -1)
            scale, zero = (pool[r].reshape(pool[r].shape[0], heads, -1) for r in ("scale", "zero"))
        else:
            payload = torch.empty(0, heads, unit, head_dim * bits // 8, dtype=torch.uint8, device=like.device)
            scale = zero = torch.empty(0, heads, head_dim // group if token else head_dim, device=like.device)
    elif isinstance(codec, Fp8Codec):
        kind, bits, group, token = "fp8", 8, 1, True
        if pool:
            payload = pool["payload"].view(pool["payload"].shape[0], heads, 1, head_dim)
            scale = pool["scale"].reshape(pool["scale"].shape[0], -1, 1)
        else:
            payload = torch.empty(0, heads, 1, head_dim, dtype=codec.dtype, device=like.device)
            scale = torch.empty(0, heads, 1, device=like.device)
        zero = None
    elif isinstance(codec, IdentityCodec):
        kind, bits, group, token, scale, zero = "full", 0, 1, True, None, None
        full = pool.get("full") if pool else None
        payload = full.view(full.shape[0], heads, 1, head_dim) if full is not None else \
            like.new_empty(0, heads, 1, head_dim)
    else:
        raise ValueError(f"no fused read of {type(codec).__name__}")
    width = max(store.units, default=0)
    return Stream(kind=kind, payload=payload, scale=scale, zero=zero, bits=bits, group=group, token_axis=token,
                  table=store.table[:, :width].contiguous(), sinks=store.sinks, tail=store.tail,
                  n_sinks=torch.tensor(store.n_sinks, dtype=torch.long), skip=torch.tensor(skip, dtype=torch.long),
                  units=torch.tensor(store.units, dtype=torch.long),
                  n_tail=torch.tensor(store.n_tail, dtype=torch.long))
