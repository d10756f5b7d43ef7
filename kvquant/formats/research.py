"""kvquant's research formats as quantizers: the fp16 baseline (the states as they are, through the same code path
as every quantizer), KIVI-style integers (int8/int4/int2: keys per channel, values per token, bit-packed) and fp8
(e4m3, e5m2) with dynamic scales. Shapes as :mod:`kvquant.formats.quantizers`: states ``[B, H, T, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvquant.formats import kernels, ops
from kvquant.formats.roles import StorageRole
from kvquant.errors import KVQuantError, is_python_int
from kvquant.formats.quantizers import (Codec, Quantizer, check_choice, check_int_option, check_tokens,
    register_quantizer)

Axis = Literal["token", "channel"]


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
    def max_abs_reason(self) -> str:
        return _max_abs_reason(self.scale_dtype)

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
    def max_abs_reason(self) -> str:
        return _max_abs_reason(self.scale_dtype)

    def encode(self, x):
        dims = (-1,) if self.granularity == "token" else (1, 2, 3)
        payload, scale = ops.fp8_quantize(x, self.dtype, dims, self.scale_dtype)
        if self.granularity == "tensor":
            scale = scale.expand(-1, -1, x.shape[2], -1).contiguous()
        return {"payload": payload, "scale": scale}

    def decode_into(self, enc, out):
        ops.fp8_dequantize_into(out, enc["payload"], enc["scale"])


def _max_abs_reason(scale_dtype: torch.dtype) -> str:
    """What bounds the states of a codec with scales and zero points stored in ``scale_dtype``."""
    return Codec.max_abs_reason if scale_dtype != torch.float32 else "its float32 scales and zero points can hold"


@register_quantizer("fp16")
@dataclass(frozen=True)
class Identity(Quantizer):
    """No quantization: the states are kept in the model's dtype (the baseline)."""

    def _codecs(self, head_dim):
        return IdentityCodec(), IdentityCodec()


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is ``<= at_most`` (1 at least)."""
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


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
            check_int_option(self.name, field, getattr(self, field), allowed=(2, 4, 8))
        for field in ("group_size", "key_group_size", "value_group_size"):
            if getattr(self, field) is not None:
                check_tokens(f"{self.name}: {field}", getattr(self, field), minimum=1)
        for field in ("key_axis", "value_axis"):
            check_choice(self.name, field, getattr(self, field), ("token", "channel"))

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

    def derived_settings(self, head_dim: int) -> dict[str, object]:
        return {"key_group": self.group_for("key", head_dim),
                "value_group": self.group_for("value", head_dim), **super().derived_settings(head_dim)}

    @classmethod
    def kernel_layout(cls, settings):
        """Each stream's codes, axis and group, then what each group stores, e.g. "keys as 8-bit codes per channel in
        groups of 128 tokens (keys that do not fill a group yet, up to 127, in the model's dtype), values as ...; per
        group a float16 scale and a float16 minimum (x = minimum + code * scale)"; None where the settings lack the
        groups a report records."""
        scale = settings.get("scale_dtype")
        if not isinstance(scale, str):
            return None
        streams = []
        for stream in ("key", "value"):
            bits, axis, group = (settings.get(f"{stream}_{k}") for k in ("bits", "axis", "group"))
            if not (is_python_int(bits) and is_python_int(group) and group >= 1 and axis in ("channel", "token")):
                return None
            unit = "token" if axis == "channel" else "channel"
            text = f"{stream}s as {bits}-bit codes per {axis} in groups of {group} {unit}{'s' * (group > 1)}"
            if axis == "channel" and group > 1:
                text += f" ({stream}s that do not fill a group yet, up to {group - 1}, in the model's dtype)"
            streams.append(text)
        return (f"{streams[0]}, {streams[1]}; per group a {scale} scale and a {scale} minimum "
                "(x = minimum + code * scale)")


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
        check_choice(self.name, "granularity", self.granularity, ("token", "tensor"))

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
