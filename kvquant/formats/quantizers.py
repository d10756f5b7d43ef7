"""Cache quantizers, found by name in a registry.

A *quantizer* is a small frozen dataclass whose fields are its options (``Int4(group_size=32)``). For a
given head dimension it builds two *codecs*, one for the key stream and one for the value stream. A codec
turns a block of states ``[B, H, T, D]`` into a dict of stored tensors whose dim 2 counts *units*
(``tokens_per_unit`` tokens each) and writes the dequantized block back into a preallocated view.
Appending units never touches those already stored.

Adding a quantizer is one class (its codecs in ``_codecs``) plus ``@register_quantizer("name")``; every
quantizer takes ``rotation="hadamard"`` (:class:`RotatedCodec` around its codecs) without code of its own.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from collections.abc import Mapping
from typing import ClassVar, Literal

import torch

from kvquant.cache import kernels

from kvquant.formats import ops
from kvquant.cache.roles import StorageRole
from kvquant.errors import KVQuantError, check_int, is_python_int
from kvquant.registry import Registry

Encoded = dict[str, torch.Tensor]
ROTATIONS = ("hadamard",)
MAX_ROTATION_SEED = 2**63 - 1  # what torch.Generator.manual_seed takes (an experiment seed is numpy's: config.MAX_SEED)
#: The most tokens any size option of a cache may name (sinks, residual window, a group of tokens, an eviction window
#: or budget): 2**24, beyond any model's context today. Sinks are also bounded by the model's context.
MAX_TOKENS = 1 << 24
#: Largest finite float32: engine formats and rotations compute in float32 at least.
F32_MAX = torch.finfo(torch.float32).max
Axis = Literal["token", "channel"]


def check_tokens(name: str, value, minimum: int = 0) -> int:
    """``value`` when it is a Python integer in ``[minimum, MAX_TOKENS]`` (a size option counted in tokens); else one
    :class:`KVQuantError` line naming ``name``, the range and the value."""
    if is_python_int(value):
        if minimum <= value <= MAX_TOKENS:
            return value
        if value > MAX_TOKENS or value.bit_length() > 190:
            raise KVQuantError(f"{name} must be an integer in {minimum}-{MAX_TOKENS} (tokens; kvquant's maximum for a "
                               f"size option), got {type(value).__name__} {short_repr(value)}")
    return check_int(name, value, minimum)  # not an integer, or below the minimum


def short_repr(value) -> str:
    """``repr(value)`` on one short line: a very long one cut, an integer too long to print (Python refuses more
    than 4,300 digits) by its size."""
    if isinstance(value, int) and value.bit_length() > 190:
        return f"of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    try:
        text = re.sub(r"\s+", " ", repr(value))
    except ValueError:  # an integer too long to print inside a list
        return f"{type(value).__name__} too long to print"
    return text if len(text) <= 60 else text[:57] + "..."


class Codec:
    """Stores one stream (keys or values) of one layer. Shapes: states ``[B, H, T, D]``."""

    #: Tokens covered by one stored unit; ``encode`` only receives whole units.
    tokens_per_unit: int = 1
    #: Largest |state| the stored form can hold; larger values raise instead of overflowing.
    max_abs: float = float("inf")
    #: What sets ``max_abs``, as a refusal says it ("keys reach |x| = 1e+06, beyond the ±65504 <held>").
    held: str = "its scales and zero points can hold (scale_dtype='float32' holds more)"
    #: head_dim must be a multiple of this, and why (codes packed several per byte, channels in blocks).
    channel_multiple: tuple[int, str] = (1, "")
    #: The storage role of every tensor :meth:`encode` may return (its key -> :class:`StorageRole`): which
    #: ``memory_report()`` category its bytes go to. A key not declared here is refused at the first write.
    roles: ClassVar[Mapping[str, StorageRole]] = {}

    def check(self, x: torch.Tensor, name: str) -> None:
        """Raise, before anything is stored, for states ``x`` within ``max_abs`` that still cannot be encoded
        (``name``: keys or values). Most codecs: nothing more to check."""

    def check_heads(self, heads: int, name: str) -> None:
        """Raise if this codec cannot store a layer of ``heads`` KV heads (``name``: keys or values), e.g. per-head
        scales of another count; checked by make_cache where the model's heads are known. Most codecs: any count."""

    def checked_above(self, head_dim: int, dtype: torch.dtype) -> float:
        """States ``[..., head_dim]`` of ``dtype`` within ``±`` this pass :meth:`check` without being looked at (a
        rotation around this codec rotates only states beyond it to check them)."""
        return float("inf")

    def encode(self, x: torch.Tensor) -> Encoded:  # pragma: no cover - interface
        raise NotImplementedError

    def decode_into(self, enc: Encoded, out: torch.Tensor) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def decode_slots_into(self, pool: Encoded, table: torch.Tensor, out: torch.Tensor) -> None:
        """Decode units held in a pool of slots (``pool[role]`` ``[N, H, *u]``: what :meth:`encode` returns per
        unit, the unit dimension removed) through ``table`` ``[B, U]`` (slot numbers; -1 reads slot 0) into ``out``
        ``[B, H, U * tokens_per_unit, D]``: the units gathered, then :meth:`decode_into`."""
        batch, width = table.shape
        index = table.clamp(min=0).flatten()
        enc = {}
        for role, p in pool.items():
            picked = p.index_select(0, index.to(p.device))
            enc[role] = picked.view(batch, width, *p.shape[1:]).transpose(1, 2).contiguous()
        self.decode_into(enc, out)


class IdentityCodec(Codec):
    """Keeps the states as they are: the baseline through the same code path as every quantizer."""

    roles = {"full": StorageRole.FULL}

    def encode(self, x):
        return {"full": x.clone()}

    def decode_into(self, enc, out):
        out.copy_(enc["full"])


@dataclass(frozen=True)
class IntCodec(Codec):
    """Asymmetric min-max integer codes, bit-packed along head_dim.

    axis="token": one (scale, zero) per token and per ``group`` channels; unit = 1 token.
        payload ``[B, H, T, D*bits/8]``, scale/zero ``[B, H, T, D/group, 1]``.
    axis="channel": one (scale, zero) per channel and per ``group`` tokens; unit = ``group`` tokens.
        payload ``[B, H, T/group, group, D*bits/8]``, scale/zero ``[B, H, T/group, 1, D]``.
    """

    bits: int
    axis: Axis
    group: int
    scale_dtype: torch.dtype = torch.float16
    roles = {"payload": StorageRole.PAYLOAD, "scale": StorageRole.SCALE, "zero": StorageRole.SCALE}

    @property
    def max_abs(self) -> float:
        """The largest |state| a group can hold: its zero point must fit the scale dtype, and the range max - min
        (computed in float32) must stay finite."""
        return min(ops.scale_limits(self.scale_dtype)[1], torch.finfo(torch.float32).max / 2)

    @property
    def tokens_per_unit(self) -> int:
        return self.group if self.axis == "channel" else 1

    @property
    def held(self) -> str:
        return _held(self.scale_dtype)

    def encode(self, x):
        if self.axis == "token":
            codes, scale, zero = ops.minmax_quantize(x.unflatten(-1, (-1, self.group)), self.bits, -1, self.scale_dtype)
            codes = codes.flatten(-2)
        else:
            codes, scale, zero = ops.minmax_quantize(x.unflatten(2, (-1, self.group)), self.bits, 3, self.scale_dtype)
        return {"payload": ops.pack_bits(codes, self.bits), "scale": scale, "zero": zero}

    def decode_into(self, enc, out):
        if kernels.usable(out):
            # the kernel's layout: batch and heads merged; scales [BH, T, groups] or [BH, T / group, D]
            token = self.axis == "token"
            scale, zero = (t.flatten(0, 1) for t in (enc["scale"], enc["zero"]))
            scale, zero = (scale.flatten(-2), zero.flatten(-2)) if token else (scale.squeeze(2), zero.squeeze(2))
            payload = enc["payload"].flatten(0, 1)
            payload = payload if token else payload.flatten(1, 2)
            kernels.dequantize_into(payload, scale, zero, self.bits, self.group, token, out)
            return
        # Eager path (GPU, or no kernel): arithmetic in fp32, rounded once to the output dtype.
        self._decode_eager(enc, out)

    def decode_slots_into(self, pool, table, out):
        if not kernels.usable(out):
            return super().decode_slots_into(pool, table, out)
        n = pool["payload"].shape[0]
        token = self.axis == "token"
        payload = pool["payload"].view(n, out.shape[1], 1 if token else self.group, -1)
        scale, zero = (pool[role].reshape(n, out.shape[1], -1) for role in ("scale", "zero"))
        kernels.dequantize_slots_into(payload, scale, zero, table, self.bits, self.group, token, out)

    def _decode_eager(self, enc, out):
        work = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        codes = ops.unpack_bits(enc["payload"], self.bits)
        if self.axis == "token":
            work.copy_(codes)
            grouped = work.unflatten(-1, (-1, self.group))
        else:
            grouped = work.unflatten(2, (-1, self.group))
            grouped.copy_(codes)
        ops.minmax_dequantize_(grouped, enc["scale"], enc["zero"])
        if work is not out:
            ops.store_clamped(out, work)


@dataclass(frozen=True)
class Fp8Codec(Codec):
    """fp8 payload with a dynamic fp16 scale computed from the states being written.

    granularity="token": one scale per token and head, ``[B, H, T, 1]``.
    granularity="tensor": one scale per sequence (batch row) for all heads and channels of one write,
    ``[B, 1, T, 1]`` (the value repeats over the tokens of that write).
    """

    dtype: torch.dtype
    granularity: Literal["token", "tensor"]
    scale_dtype: torch.dtype = torch.float16
    roles = {"payload": StorageRole.PAYLOAD, "scale": StorageRole.SCALE}

    @property
    def max_abs(self) -> float:
        """The largest |state| whose scale (amax / fp8 max) the scale dtype can hold."""
        return torch.finfo(self.dtype).max * ops.scale_limits(self.scale_dtype)[1]

    @property
    def held(self) -> str:
        return _held(self.scale_dtype)

    def encode(self, x):
        dims = (-1,) if self.granularity == "token" else (1, 2, 3)
        payload, scale = ops.fp8_quantize(x, self.dtype, dims, self.scale_dtype)
        if self.granularity == "tensor":
            scale = scale.expand(-1, -1, x.shape[2], -1).contiguous()
        return {"payload": payload, "scale": scale}

    def decode_into(self, enc, out):
        ops.fp8_dequantize_into(out, enc["payload"], enc["scale"])


def _held(scale_dtype: torch.dtype) -> str:
    """What bounds the states of a codec with scales and zero points stored in ``scale_dtype``."""
    return Codec.held if scale_dtype != torch.float32 else "its float32 scales and zero points can hold"


@dataclass(frozen=True, eq=False)
class RotatedCodec(Codec):
    """Another codec applied to the states rotated along head_dim (``x @ R``, R orthonormal: see
    :func:`kvquant.formats.ops.hadamard_rotation`); reads rotate back (``y @ R.T``). Same stored tensors and bytes as
    the
    inner codec. Shapes as :class:`Codec`; ``matrix`` ``[D, D]``."""

    inner: Codec
    matrix: torch.Tensor

    @property
    def tokens_per_unit(self) -> int:
        return self.inner.tokens_per_unit

    @property
    def roles(self) -> Mapping[str, StorageRole]:
        return self.inner.roles

    @property
    def max_abs(self) -> float:
        """States beyond this cannot fit once rotated (a rotated block keeps its norm, so its largest |y| is at
        least |x| / sqrt(block)); states below it are checked after the rotation, in :meth:`encode`."""
        return self.inner.max_abs / float(self.matrix.abs().max())  # max entry = 1 / sqrt(block)

    def check(self, x, name):
        """States within ``limit / sqrt(block)`` fit once rotated (``|y| <= sqrt(block) max|x|``), and pass the inner
        codec's own check unexamined within its bound over ``sqrt(block)``; the others are rotated to see. The limit:
        what the inner codec holds, the states' own dtype's range (the rotation is computed in it), or what rotates
        back within float32, the smallest."""
        if x.device.type == "meta" or not x.numel():
            return
        amax, shrink = float(x.abs().amax()), float(self.matrix.abs().max())  # max entry = 1 / sqrt(block)
        if amax > min(self._limit(x.dtype)[0], self.inner.checked_above(x.shape[-1], x.dtype)) * shrink:
            y = ops.rotate(x, self.matrix)
            self._check_rotated(y, name)
            self.inner.check(y, name)

    def _limit(self, dtype: torch.dtype) -> tuple[float, str]:
        """The largest |y| rotated states may reach, and what sets it (as a refusal says it)."""
        back = F32_MAX * float(self.matrix.abs().max()) / 2  # |y @ R.T| <= sqrt(block) max|y|, with room to round up
        return min((self.inner.max_abs, self.inner.held.replace("its ", "their ", 1)),
                   (torch.finfo(dtype).max, f"of the states' dtype {dtype}"),
                   (back, "that rotate back within float32"), key=lambda pair: pair[0])

    def _check_rotated(self, y, name):
        if y.device.type == "meta" or not y.numel():
            return
        amax, (limit, held) = float(y.abs().amax()), self._limit(y.dtype)
        if not amax <= limit:  # inf too: the rotation overflowed the states' dtype
            raise KVQuantError(f"rotated {name} reach |y| = {amax:.4g}, beyond the ±{limit:.4g} {held}")

    def encode(self, x):
        y = ops.rotate(x, self.matrix)
        self._check_rotated(y, "states")
        return self.inner.encode(y)

    def decode_into(self, enc, out):
        """Dequantized in fp32 at least, rotated back, then rounded once to ``out``'s dtype."""
        if out.dtype in (torch.float16, torch.bfloat16):
            work = torch.empty(out.shape, dtype=torch.float32, device=out.device)
            self.inner.decode_into(enc, work)
            ops.store_clamped(out, ops.rotate(work, self.matrix.T))
        else:
            self.inner.decode_into(enc, out)
            out.copy_(ops.rotate(out, self.matrix.T))


# --------------------------------------------------------------------------------------------------
# Registry


def _check_class(name: str, cls: type) -> None:
    if "codecs" in cls.__dict__:  # Quantizer.codecs adds the rotation around _codecs
        raise KVQuantError(f"quantizer {name!r}: define _codecs(head_dim), not codecs")


QUANTIZERS = Registry("quantizer", _check_class)
#: Class decorator: make a :class:`Quantizer` subclass available under a name.
register_quantizer = QUANTIZERS.register
#: Names accepted by :func:`get_quantizer` and ``make_cache(quantizer=...)``.
available_quantizers = QUANTIZERS.names
#: The options of a quantizer with their defaults.
quantizer_options = QUANTIZERS.options
#: Build a quantizer by name with options; an option it does not have is an error naming the valid ones.
get_quantizer = QUANTIZERS.build


@dataclass(frozen=True)
class Quantizer:
    """Options of one cache quantizer; builds the key and value codecs for a head dimension."""

    name: ClassVar[str]
    #: Most recent tokens kept in full precision unless ``make_cache(residual_length=...)`` says otherwise.
    default_residual_length: ClassVar[int] = 0
    #: The serving engine that runs this exact format: (engine, its ``--kv-cache-dtype`` value, what else it
    #: needs); None: a research format no engine runs (:mod:`kvquant.integrations.deploy`).
    serving: ClassVar[tuple[str, str, str] | None] = None
    #: ``"hadamard"``: quantize K and V rotated along head_dim by a seeded random-sign (block) Hadamard matrix
    #: and rotate back on read (QuaRot-style; spreads outlier channels over the block). None: no rotation.
    rotation: str | None = dataclasses.field(default=None, kw_only=True)
    rotation_seed: int = dataclasses.field(default=0, kw_only=True)

    def __post_init__(self):
        self._check_rotation()

    def _check_rotation(self) -> None:
        if self.rotation is not None:
            _check_choice(self.name, "rotation", self.rotation, ROTATIONS)
        _check_int(self.name, "rotation_seed", self.rotation_seed, minimum=0, maximum=MAX_ROTATION_SEED)

    def _scale_dtype(self) -> torch.dtype:
        if not isinstance(self.scale_dtype, str) or self.scale_dtype not in ops.SCALE_DTYPES:
            raise KVQuantError(f"{self.name}: scale_dtype must be one of {sorted(ops.SCALE_DTYPES)}, "
                               f"got {self.scale_dtype!r}")
        return ops.SCALE_DTYPES[self.scale_dtype]

    def codecs(self, head_dim: int) -> tuple[Codec, Codec]:
        """The key and value codecs at ``head_dim``, rotated where ``rotation`` asks for it."""
        self._check_rotation()  # also where a subclass's __post_init__ forgot to
        key, value = self._codecs(head_dim)
        for codec in (key, value):
            multiple, why = codec.channel_multiple
            if head_dim % multiple:
                raise KVQuantError(f"{self.name}: head_dim {head_dim} is not a multiple of {multiple} ({why})")
        if self.rotation is None:
            return key, value
        matrix = ops.hadamard_rotation(head_dim, self.rotation_seed)
        return RotatedCodec(key, matrix), RotatedCodec(value, matrix)

    def _codecs(self, head_dim: int) -> tuple[Codec, Codec]:  # pragma: no cover - interface
        raise NotImplementedError

    def describe(self) -> dict[str, object]:
        """Name and options, enough to rebuild it with :func:`get_quantizer`."""
        return {"quantizer": self.name, **dataclasses.asdict(self)}

    def resolved(self, head_dim: int) -> dict[str, object]:
        """Settings this quantizer derives for a head dimension (e.g. the groups actually used)."""
        return {"rotation_block": head_dim & -head_dim} if self.rotation else {}


@register_quantizer("fp16")
@dataclass(frozen=True)
class Identity(Quantizer):
    """No quantization: the states are kept in the model's dtype (the baseline)."""

    def _codecs(self, head_dim):
        return IdentityCodec(), IdentityCodec()


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is ``<= at_most`` (1 at least)."""
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def _check_int(owner: str, field: str, value, allowed=None, minimum: int | None = None,
               maximum: int | None = None) -> None:
    """One-line errors for an option that must be an integer (never a bool or a float)."""
    check_int(f"{owner}: {field}", value, minimum, maximum)
    if allowed is not None and value not in allowed:
        choices = f"{', '.join(map(str, allowed[:-1]))} or {allowed[-1]}"
        raise KVQuantError(f"{owner}: {field} must be {choices}, got {value!r}")


def _check_choice(owner: str, field: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise KVQuantError(f"{owner}: {field} must be one of {', '.join(map(repr, choices))}, got {value!r}")


@dataclass(frozen=True)
class IntQuantizer(Quantizer):
    """KIVI-style integers: keys per-channel (groups of ``group_size`` tokens), values per-token (groups of
    channels). ``key_bits``/``value_bits`` may differ (e.g. K8/V4). ``scale_dtype`` is how scales and zero points
    are stored ("float16", or "float32" at twice the bytes).

    ``group_size=None`` (the default) means the quantizer's default group (``default_group_size``) where it fits:
    per-channel groups take it as is (tokens), per-token groups take the largest divisor of head_dim not above it
    (head_dim 80 with 32 -> 20), so every common head_dim works. An explicit ``group_size`` is used as given
    (per-token groups are capped at head_dim) and must divide head_dim for per-token groups.
    ``key_group_size``/``value_group_size`` replace ``group_size`` for one stream, with the same rules (e.g. keys in
    groups of 128 tokens and values in groups of 32 channels: K4V2 at 4.25 + 3.0 bits per element).
    """

    default_residual_length: ClassVar[int] = 128
    default_group_size: ClassVar[int] = 32
    key_bits: int = 8
    value_bits: int = 8
    group_size: int | None = None
    key_group_size: int | None = None
    value_group_size: int | None = None
    key_axis: Axis = "channel"
    value_axis: Axis = "token"
    scale_dtype: str = "float16"

    def __post_init__(self):
        super().__post_init__()
        self._scale_dtype()
        for field in ("key_bits", "value_bits"):
            _check_int(self.name, field, getattr(self, field), allowed=(2, 4, 8))
        for field in ("group_size", "key_group_size", "value_group_size"):
            if getattr(self, field) is not None:
                check_tokens(f"{self.name}: {field}", getattr(self, field), minimum=1)
        for field in ("key_axis", "value_axis"):
            _check_choice(self.name, field, getattr(self, field), ("token", "channel"))

    def group_for(self, stream: str, head_dim: int) -> int:
        """Tokens (channel axis) or channels (token axis) sharing one scale and zero point in ``stream`` ("key" or
        "value") at this head_dim."""
        axis = getattr(self, f"{stream}_axis")
        field = f"{stream}_group_size" if getattr(self, f"{stream}_group_size") is not None else "group_size"
        size = getattr(self, field)
        if axis == "channel":
            return size or self.default_group_size
        if size is None:
            return largest_divisor(head_dim, self.default_group_size)
        group = min(size, head_dim)
        if head_dim % group:
            unset = (f"group_size ({self.group_size})" if field != "group_size" and self.group_size is not None
                     else "the default rule")
            raise KVQuantError(
                f"{self.name}: {field} {size} does not divide head_dim {head_dim} for per-token groups; "
                f"use a divisor of {head_dim} (e.g. {largest_divisor(head_dim, size)}) or leave {field} unset for "
                f"{unset}"
            )
        return group

    def _codec(self, stream: str, head_dim: int) -> IntCodec:
        bits = getattr(self, f"{stream}_bits")
        per_byte = 8 // bits
        if head_dim % per_byte:
            raise KVQuantError(f"{self.name}: head_dim {head_dim} cannot be packed {per_byte} {stream} codes per byte")
        return IntCodec(bits=bits, axis=getattr(self, f"{stream}_axis"), group=self.group_for(stream, head_dim),
                        scale_dtype=self._scale_dtype())

    def _codecs(self, head_dim):
        return self._codec("key", head_dim), self._codec("value", head_dim)

    def resolved(self, head_dim: int) -> dict[str, object]:
        return {"key_group": self.group_for("key", head_dim),
                "value_group": self.group_for("value", head_dim), **super().resolved(head_dim)}


@register_quantizer("int8")
@dataclass(frozen=True)
class Int8(IntQuantizer):
    """8-bit integers. Groups of 128 by default: 8-bit codes keep plenty of resolution over a wide group, while
    fp16 scale and zero per 32 elements would add a whole bit per element (9 bits, 0.56x of fp16)."""

    default_group_size: ClassVar[int] = 128


@register_quantizer("int4")
@dataclass(frozen=True)
class Int4(IntQuantizer):
    """4-bit integers, two per byte."""

    key_bits: int = 4
    value_bits: int = 4


@register_quantizer("int2")
@dataclass(frozen=True)
class Int2(IntQuantizer):
    """2-bit integers, four per byte."""

    key_bits: int = 2
    value_bits: int = 2


@dataclass(frozen=True)
class Fp8Quantizer(Quantizer):
    """fp8 storage with dynamic scales: per token and head (``granularity="token"``) or one per sequence
    and write (``"tensor"``)."""

    dtype: ClassVar[torch.dtype]
    granularity: Literal["token", "tensor"] = "token"
    scale_dtype: str = "float16"

    def __post_init__(self):
        super().__post_init__()
        self._scale_dtype()
        _check_choice(self.name, "granularity", self.granularity, ("token", "tensor"))

    def _codecs(self, head_dim):
        codec = Fp8Codec(dtype=self.dtype, granularity=self.granularity, scale_dtype=self._scale_dtype())
        return codec, codec


@register_quantizer("fp8_e4m3")
@dataclass(frozen=True)
class Fp8E4M3(Fp8Quantizer):
    """fp8 e4m3 (``torch.float8_e4m3fn``): 3 mantissa bits, max 448."""

    dtype: ClassVar[torch.dtype] = torch.float8_e4m3fn


@register_quantizer("fp8_e5m2")
@dataclass(frozen=True)
class Fp8E5M2(Fp8Quantizer):
    """fp8 e5m2 (``torch.float8_e5m2``): 2 mantissa bits, max 57344."""

    dtype: ClassVar[torch.dtype] = torch.float8_e5m2
