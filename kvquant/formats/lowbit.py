"""Low-bit research formats (issue 56). Shapes as :mod:`kvquant.formats.quantizers`: states ``[B, H, T, D]``.

- :class:`CodebookCodec`: non-uniform codes per token and head, ``x ~ s * level[code]``, with the levels of
  :func:`lloyd_max_gaussian` (TurboQuant's scalar quantizer without its QJL residual, ``s`` the vector's RMS) or of
  :func:`normal_float` (QLoRA's NF4 and its 2- and 3-bit kin, ``s`` the vector's largest |x|); registered as
  ``lloyd_max`` and ``normal_float``, rotated by default (the random Hadamard rotation makes the coordinates of a
  vector near Gaussian, which is what the levels are fitted to).
- :class:`OutlierCodec`: dense and sparse (KVQuant): the ``count`` states of largest |x| per token and head kept in
  the states' dtype with their channel index, the rest stored by any inner codec (option ``outliers``).
- :class:`OffsetCodec`: a static per-channel key offset subtracted before quantizing and added back on read (option
  ``key_offset``; where leaving it out would be exact: docs/quantizers.md, "Key offset").

The options ``outliers`` and ``key_offset`` are mixins (:class:`SparseOutliers`, :class:`KeyOffset`) that wrap a
quantizer's codecs outside its rotation: the offset is removed first, then the outliers in the model's basis, then
the rest is rotated and quantized.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvquant.formats.roles import StorageRole
from kvquant.errors import InternalError, KVQuantError
from kvquant.formats import ops
from kvquant.formats.quantizers import (F32_MAX, Codec, Quantizer, WrappingCodec, check_int_option,
    register_quantizer, short_repr)

Statistic = Literal["rms", "absmax"]


# --------------------------------------------------------------------------------------------------
# Codebooks (float64, increasing)


@functools.lru_cache(maxsize=8)
def lloyd_max_gaussian(bits: int) -> torch.Tensor:
    """The ``2**bits`` Lloyd-Max levels of N(0, 1) (Max 1960): from levels spread evenly over ±3, alternately the
    cells end at the midpoints between neighbouring levels (nearest-neighbour condition) and each level moves to the
    mean of N(0, 1) over its cell, ``(phi(a) - phi(b)) / (Phi(b) - Phi(a))`` in closed form (centroid condition),
    until no level moves by more than 1e-12."""
    levels = 2**bits

    def pdf(x: float) -> float:
        return 0.0 if math.isinf(x) else math.exp(-x * x / 2) / math.sqrt(2 * math.pi)

    def cdf(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2))

    centroids = [3.0 * (2 * i + 1 - levels) / levels for i in range(levels)]
    for _ in range(100_000):
        edges = [-math.inf, *[(a + b) / 2 for a, b in zip(centroids, centroids[1:])], math.inf]
        moved = [(pdf(a) - pdf(b)) / (cdf(b) - cdf(a)) for a, b in zip(edges, edges[1:])]
        if max(abs(a - b) for a, b in zip(moved, centroids)) <= 1e-12:
            return torch.tensor(moved, dtype=torch.float64)
        centroids = moved
    raise InternalError(f"the Lloyd-Max iteration for {bits} bits did not converge")


@functools.lru_cache(maxsize=8)
def normal_float(bits: int) -> torch.Tensor:
    """QLoRA's normal-float levels (Dettmers et al. 2023; bitsandbytes ``create_normal_map``) for ``bits``: the N(0, 1)
    quantiles at ``2**(bits-1)`` probabilities evenly spaced from ``offset`` down to 1/2 (1/2 left out), the
    negatives of those at ``2**(bits-1) - 1`` probabilities from ``offset`` to 1/2, and an exact zero, all divided by
    the largest (levels in [-1, 1]); ``offset = (1 - 1/(2 (2^b - 1)) + 1 - 1/(2^(b+1))) / 2``, bitsandbytes'
    0.9677083 at 4 bits."""
    half, levels = 2 ** (bits - 1), 2**bits
    offset = (1 - 1 / (2 * (levels - 1)) + 1 - 1 / (2 * levels)) / 2
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, half + 1, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, half, dtype=torch.float64)[:-1])
    values = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    return values / values.abs().max()


# --------------------------------------------------------------------------------------------------
# Codecs


def check_inner(inner: Codec, x: torch.Tensor, name: str) -> None:
    """What a layer checks before ``inner`` stores states ``x`` ``[B, H, T, D]`` (finite ones: the layer refuses NaN
    and Inf first): its bound, then its own :meth:`~Codec.check`. For a wrapping codec whose own bound is not
    ``inner``'s, since ``inner`` is given other states than the layer's."""
    if x.device.type != "meta" and x.numel():
        amax = float(x.abs().amax())
        if not amax <= inner.max_abs:
            raise KVQuantError(f"{name} reach |x| = {amax:.4g}, beyond the ±{inner.max_abs:.4g} {inner.max_abs_reason}")
    inner.check(x, name)


@dataclass(frozen=True, eq=False)
class CodebookCodec(Codec):
    """Per token and head, ``x ~ s * levels[code]``: ``s`` the vector's RMS (its norm / sqrt(D);
    ``statistic="rms"``, levels for N(0, 1)) or its largest |x| (``"absmax"``, levels in [-1, 1]), stored in
    ``scale_dtype``; the code is the nearest level to ``x / s`` (computed against the stored ``s``; a cell ends at
    the midpoint between neighbouring levels, a value on it goes to the upper level), bit-packed along head_dim
    (:func:`kvquant.formats.ops.pack_codes`). A zero vector stores ``s = 0`` and reads back zeros.
    payload ``[B, H, T, D*bits/8]`` uint8, scale ``[B, H, T, 1]``; ``levels`` ``[2**bits]`` float32, increasing."""

    levels: torch.Tensor
    bits: int
    statistic: Statistic
    scale_dtype: torch.dtype = torch.float16
    roles = {"payload": StorageRole.PAYLOAD, "scale": StorageRole.SCALE}

    @property
    def channel_multiple(self) -> tuple[int, str]:
        return 8 // math.gcd(8, self.bits), f"{self.bits}-bit codes packed into whole bytes"

    @property
    def max_abs(self) -> float:
        """``s`` is at most the largest |x|, so it fits the scale dtype; a level times ``s`` stays finite in float32
        (levels are within ±4)."""
        return min(ops.scale_limits(self.scale_dtype)[1], F32_MAX / 4)

    @property
    def max_abs_reason(self) -> str:
        return ("its float32 per-vector scales can hold" if self.scale_dtype == torch.float32 else
                "its per-vector scales can hold (scale_dtype='float32' holds more)")

    def normalized(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(u, scale)`` of states ``x`` ``[..., D]``: what is coded, ``x / s`` ``[..., D]`` float32 (against the
        stored ``s``; 0 where ``s`` is), and the scale as stored, ``[..., 1]`` in ``scale_dtype``."""
        x = x.float()
        amax = x.abs().amax(-1, keepdim=True)
        if self.statistic == "rms":  # amax * rms(x / amax): no overflow in the squares
            s = amax * (x / amax.clamp(min=torch.finfo(torch.float32).tiny)).square_().mean(-1, keepdim=True).sqrt_()
        else:
            s = amax
        scale = s.to(self.scale_dtype)
        stored = scale.float()
        return x / torch.where(stored > 0, stored, torch.ones_like(stored)), scale

    def encode(self, x):
        u, scale = self.normalized(x)
        return {"payload": ops.pack_codes(self._codes(u), self.bits), "scale": scale}

    def _codes(self, u: torch.Tensor) -> torch.Tensor:
        """The cell of each ``u``, uint8: the count of midpoints at or below it, as the count of those it is not
        below (NaN, below none, goes to the top cell): one comparison per midpoint, no search."""
        midpoints = self._midpoints.to(u.device)
        below = torch.zeros(u.shape, dtype=torch.uint8, device=u.device)
        compared = torch.empty(u.shape, dtype=torch.bool, device=u.device)
        for midpoint in midpoints:
            below += torch.lt(u, midpoint, out=compared)
        return torch.rsub(below, len(midpoints))

    @functools.cached_property
    def _midpoints(self) -> torch.Tensor:
        """``[2**bits - 1]`` float32: where each cell ends, between neighbouring levels."""
        return (self.levels[:-1] + self.levels[1:]) / 2

    @functools.cached_property
    def _table(self) -> torch.Tensor:
        """``[2**(per * bits), per]`` float32: the levels of the ``per`` codes one index holds (code ``j`` at its bit
        ``j * bits``): a byte of the block layout (``per = 8 // bits``), else a piece of at most 12 bits of a word of
        the bit stream (3 bits: 4 codes, half a word; :func:`kvquant.formats.ops.stream_word`)."""
        per = 8 // self.bits if 8 % self.bits == 0 else 12 // self.bits
        index = torch.arange(2 ** (per * self.bits))
        return self.levels[(index[:, None] >> (torch.arange(per) * self.bits)) & (2**self.bits - 1)]

    def decode_into(self, enc, out):
        """``levels[code] * scale`` in float32 (rounded once to ``out``'s dtype), the levels looked up by whole bytes
        or pieces of :attr:`_table` (one gather for several codes, no codes unpacked)."""
        payload, table = enc["payload"], self._table.to(out.device)
        per = table.shape[1]
        if 8 % self.bits == 0:  # block layout: byte i holds channels i, i + Dp, ... (ops.pack_bits)
            found = torch.nn.functional.embedding(payload.int(), table).transpose(-1, -2)  # [..., per, Dp]
            target = out.unflatten(-1, (per, -1))
            scale = enc["scale"].float().unsqueeze(-1)
        else:  # stream: each word's pieces of per codes, in channel order
            words = ops.stream_words(payload, self.bits)
            pieces = ops.split_words(words, per * self.bits, ops.stream_word(self.bits)[0] // per, words.dtype)
            found, target = torch.nn.functional.embedding(pieces, table).flatten(-3), out
            scale = enc["scale"].float()
        if out.dtype == torch.float32:
            torch.mul(found, scale, out=target)
        else:
            ops.store_clamped(target, found * scale)


@dataclass(frozen=True, eq=False)
class OutlierCodec(WrappingCodec):
    """Dense and sparse (KVQuant, Hooper et al. 2024): per token and head, the ``count`` states of largest |x| are
    kept in the states' dtype with their channel index (uint8 for head_dim <= 256, else int16); ``inner`` stores the
    states with those channels zeroed, and reads write the kept values over what ``inner`` reads there. Stored:
    ``inner``'s tensors plus ``outlier_index`` and ``outlier_value`` ``[B, H, units, *u, count]`` (``u`` =
    ``[tokens_per_unit]`` when a unit holds several tokens, else nothing)."""

    count: int
    #: the outliers are kept in the states' own dtype: only the rest must fit ``inner`` (:meth:`check`)
    max_abs = Codec.max_abs

    @property
    def roles(self):
        return {**self.inner.roles, "outlier_index": StorageRole.SCALE, "outlier_value": StorageRole.FULL}

    def check_heads(self, heads, name):
        self.inner.check_heads(heads, name)

    def check(self, x, name):
        """What ``inner`` is given is checked, its bound too: the states without their outliers."""
        if x.device.type != "meta" and x.numel():
            check_inner(self.inner, self._split(x)[2], f"{name} other than the {self.count} outliers")

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(index [..., count] int64, value [..., count], the rest [..., D])`` of states ``x`` ``[..., D]``."""
        index = x.abs().topk(self.count, dim=-1).indices
        return index, x.gather(-1, index), x.scatter(-1, index, 0)

    def encode(self, x):
        index, value, rest = self._split(x)
        enc = self.inner.encode(rest)
        unit = self.inner.tokens_per_unit
        index = index.to(torch.uint8 if x.shape[-1] <= 256 else torch.int16)
        if unit > 1:  # dim 2 counts units
            index, value = index.unflatten(2, (-1, unit)), value.unflatten(2, (-1, unit))
        return {**enc, "outlier_index": index, "outlier_value": value}

    def decode_into(self, enc, out):
        self.inner.decode_into({key: t for key, t in enc.items() if not key.startswith("outlier_")}, out)
        index, value = enc["outlier_index"], enc["outlier_value"]
        if self.inner.tokens_per_unit > 1:
            index, value = index.flatten(2, 3), value.flatten(2, 3)
        out.scatter_(-1, index.long(), value.to(out.dtype))


@dataclass(frozen=True, eq=False)
class OffsetCodec(WrappingCodec):
    """``inner`` applied to ``x - offset`` and read back as what ``inner`` reads ``+ offset``: a static per-channel
    offset, ``[H, D]`` (one per KV head) or ``[D]`` (every head alike), float32; the layer's constant, not stored
    per token. The subtraction is computed in float32 and rounded to the states' dtype; the read adds it in float32
    and rounds once."""

    offset: torch.Tensor

    @property
    def max_abs(self) -> float:
        """States beyond this cannot fit (``|x| <= |x - offset| + |offset|``); :meth:`check` holds ``x - offset`` to
        what ``inner`` holds."""
        return self.inner.max_abs + float(self.offset.abs().max())

    def check_heads(self, heads, name):
        if self.offset.dim() == 2 and self.offset.shape[0] != heads:
            raise KVQuantError(f"key_offset has {self.offset.shape[0]} rows (one per KV head) for a layer of {heads} "
                               "KV heads; give one row per KV head, or one row of head_dim numbers for every head")
        self.inner.check_heads(heads, name)

    def check(self, x, name):
        """Keys whose difference from the offset overflows their dtype (float16 near its maximum) are refused."""
        self.check_heads(x.shape[1], name)
        if x.device.type == "meta" or not x.numel():
            return
        shifted = self._shift(x)
        if not bool(torch.isfinite(shifted).all()):
            raise KVQuantError(f"{name} minus key_offset overflow their dtype {x.dtype}")
        check_inner(self.inner, shifted, f"{name} minus key_offset")

    def _offset(self, x: torch.Tensor) -> torch.Tensor:
        offset = self.offset.to(x.device)
        return offset[None, :, None, :] if offset.dim() == 2 else offset

    def _shift(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() - self._offset(x)).to(x.dtype)

    def encode(self, x):
        return self.inner.encode(self._shift(x))

    def decode_into(self, enc, out):
        work = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        self.inner.decode_into(enc, work)
        ops.store_clamped(out, work + self._offset(out))


# --------------------------------------------------------------------------------------------------
# Quantizer options that wrap any quantizer's codecs


@dataclass(frozen=True)
class SparseOutliers(Quantizer):
    """``outliers``: states per token and head kept in full precision with their index (:class:`OutlierCodec`),
    found in the model's basis (outside the rotation); 0: none."""

    outliers: int = dataclasses.field(default=0, kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        check_int_option(self.name, "outliers", self.outliers, minimum=0, maximum=255)

    def codecs(self, head_dim: int) -> tuple[Codec, Codec]:
        key, value = super().codecs(head_dim)
        if not self.outliers:
            return key, value
        if self.outliers >= head_dim:
            raise KVQuantError(f"{self.name}: outliers {self.outliers} must be fewer than head_dim {head_dim}")
        return OutlierCodec(key, self.outliers), OutlierCodec(value, self.outliers)


@dataclass(frozen=True)
class KeyOffset(Quantizer):
    """``key_offset``: a per-channel offset subtracted from every key before quantizing and added back on read
    (:class:`OffsetCodec`, outermost): ``head_dim`` numbers for every KV head, or one such list per KV head; per layer
    through ``layers``. None: no offset."""

    key_offset: tuple | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        if self.key_offset is not None:
            object.__setattr__(self, "key_offset", self._offset_rows())  # lists from YAML, kept hashable

    def _offset_rows(self) -> tuple:
        value = self.key_offset

        def number(v) -> bool:  # finite in float32, where the offset is applied
            return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) <= F32_MAX

        def numbers(row) -> bool:
            return isinstance(row, (list, tuple)) and bool(row) and all(number(v) for v in row)

        if numbers(value):
            return tuple(float(v) for v in value)
        if isinstance(value, (list, tuple)) and value and all(numbers(r) for r in value) and \
                len({len(r) for r in value}) == 1:
            return tuple(tuple(float(v) for v in row) for row in value)
        raise KVQuantError(f"{self.name}: key_offset must be a list of head_dim numbers finite in float32, or one such "
                           f"list per KV head, got {short_repr(value)}")

    def codecs(self, head_dim: int) -> tuple[Codec, Codec]:
        key, value = super().codecs(head_dim)
        if self.key_offset is None:
            return key, value
        offset = torch.tensor(self.key_offset, dtype=torch.float32)
        if offset.shape[-1] != head_dim:
            raise KVQuantError(f"{self.name}: key_offset has {offset.shape[-1]} numbers per head for head_dim "
                               f"{head_dim}")
        return OffsetCodec(key, offset), value


# --------------------------------------------------------------------------------------------------
# Registered quantizers


@dataclass(frozen=True)
class CodebookQuantizer(KeyOffset, SparseOutliers):
    """Keys and values each with :class:`CodebookCodec` at ``key_bits``/``value_bits`` (2, 3 or 4), the per-vector
    scale stored as ``scale_dtype``; rotated by default (``rotation=None`` quantizes the model's basis)."""

    statistic: ClassVar[Statistic]
    rotation: str | None = dataclasses.field(default="hadamard", kw_only=True)
    key_bits: int = 4
    value_bits: int = 4
    scale_dtype: str = "float16"

    def __post_init__(self):
        super().__post_init__()
        self._scale_dtype()
        for field in ("key_bits", "value_bits"):
            check_int_option(self.name, field, getattr(self, field), allowed=(2, 3, 4))

    def levels(self, bits: int) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def _codecs(self, head_dim):
        return tuple(CodebookCodec(self.levels(bits).float(), bits, self.statistic, self._scale_dtype())
                     for bits in (self.key_bits, self.value_bits))


@register_quantizer("lloyd_max")
@dataclass(frozen=True)
class LloydMax(CodebookQuantizer):
    """Lloyd-Max levels for N(0, 1) on ``x / rms(x)`` after the rotation: TurboQuant's MSE quantizer (Zandieh et
    al. 2025) without the QJL residual; bits per element ``bits + 16 / D`` (fp16 scale)."""

    statistic = "rms"

    def levels(self, bits):
        return lloyd_max_gaussian(bits)


@register_quantizer("normal_float")
@dataclass(frozen=True)
class NormalFloat(CodebookQuantizer):
    """Normal-float levels (QLoRA's NF4; NF3, NF2 built alike) on ``x / max|x|`` after the rotation; bits per
    element ``bits + 16 / D`` (fp16 scale)."""

    statistic = "absmax"

    def levels(self, bits):
        return normal_float(bits)
