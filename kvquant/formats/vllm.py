"""vLLM's own KV-cache formats as quantizers: what ``--kv-cache-dtype X`` stores, value for value (vLLM 0.33.0 as
published on PyPI; ``file:line`` below are lines of that wheel; what is exact to the engine and what is not:
:mod:`kvquant.formats.engine_math`). Every format stores each token's keys and values when they are written (one
unit = one token), so nothing is kept at full precision unless ``residual_length`` or ``sink_tokens`` ask for it.

Registered names (flag, stored bits per element at head_dim D): ``vllm_fp8`` (vLLM ``fp8`` with static per-tensor
or per-head scales, 8), ``vllm_fp8_per_token_head`` (8 + 32/D), ``vllm_int8_per_token_head`` (8 + 32/D),
``vllm_int4_per_token_head`` (4 + 32/D), ``vllm_nvfp4`` (4.5), ``vllm_turboquant_k8v4`` ((12 + 32/D) / 2),
``vllm_turboquant_4bit_nc`` ((8 + 48/D) / 2); SGLang's ``sglang_mxfp8`` is :mod:`kvquant.formats.sglang`; the table
in ``docs/quantizers.md``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvquant.formats import ops
from kvquant.formats.roles import StorageRole
from kvquant.errors import KVQuantError
from kvquant.formats.engine_math import (E4M3_MAX, F32_HALF, F32_MAX_ABS_REASON, FP16_MAX, e2m1_codes, e2m1_values,
    e4m3_saturated, hadamard_transform, largest_power_of_two_divisor, lloyd_max_centroids, pack_nibbles, rht,
    round_half_away, unpack_nibbles)
from kvquant.formats.quantizers import (F32_MAX, Alike, Codec, Quantizer, Serving, register_quantizer,
    short_repr)


# --------------------------------------------------------------------------------------------------
# Codecs: states [B, H, T, D]; one unit = one token


@dataclass(frozen=True, eq=False)
class StaticFp8Codec(Codec):
    """vLLM ``fp8``: ``e4m3_satfinite(x / scale)`` with a static fp32 scale for the whole tensor (``[]``) or per
    KV head (``[H]``); read as ``code * scale`` (``quant_utils.cuh`` scaled_vec_conversion; per head:
    ``cache_kernels.cu`` reshape_and_cache_flash_kernel with ``kv_scale_stride``)."""

    scale: torch.Tensor
    max_abs = F32_HALF
    max_abs_reason = F32_MAX_ABS_REASON
    roles = {"payload": StorageRole.PAYLOAD}  # the static scale is the layer's, not stored per token

    def check_heads(self, heads: int, name: str = "states") -> None:
        """Per-head scales: one per KV head of the layer (``name``: keys or values)."""
        if self.scale.dim() and self.scale.numel() != heads:
            field = {"keys": "k_scale", "values": "v_scale"}.get(name, "scale")
            raise KVQuantError(f"vllm_fp8: {field} has {self.scale.numel()} per-head scales for a layer of {heads} "
                               f"KV heads; give one per KV head, or one number for the whole layer")

    def check(self, x: torch.Tensor, name: str) -> None:
        self.check_heads(x.shape[1], name)

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        self.check_heads(x.shape[1])
        scale = self.scale.to(x.device)
        return scale.view(1, -1, 1, 1) if scale.dim() else scale

    def encode(self, x):
        return {"payload": e4m3_saturated(x.float() / self._scale(x))}

    def decode_into(self, enc, out):
        ops.store_clamped(out, enc["payload"].float() * self._scale(out))


@dataclass(frozen=True)
class PerTokenHeadCodec(Codec):
    """vLLM ``int8_per_token_head`` / ``fp8_per_token_head`` (``triton_reshape_and_cache_flash.py:168-283``): per
    token and head, ``scale = max(amax / qmax, 1e-6)`` (fp32, stored), ``q = x * (1 / scale)``; int8 rounds half
    away from zero and clamps to [-128, 127] (so [-127, 127]), fp8 clamps to ±448 and casts (round half to even)."""

    fp8: bool
    max_abs = F32_HALF
    max_abs_reason = F32_MAX_ABS_REASON
    roles = {"payload": StorageRole.PAYLOAD, "scale": StorageRole.SCALE}

    def encode(self, x):
        x = x.float()
        qmax = E4M3_MAX if self.fp8 else 127.0
        scale = (x.abs().amax(-1, keepdim=True) / qmax).clamp(min=1e-6)
        q = x * (1.0 / scale)
        if self.fp8:
            payload = e4m3_saturated(q)
        else:
            payload = round_half_away(q).clamp(-128, 127).to(torch.int8)
        return {"payload": payload, "scale": scale}

    def decode_into(self, enc, out):
        ops.store_clamped(out, enc["payload"].float() * enc["scale"])


@dataclass(frozen=True)
class Int4PerTokenHeadCodec(Codec):
    """vLLM ``int4_per_token_head`` (``int4_per_token_head.py``): states rotated (:func:`rht`, ``:856-880``) and
    rounded back to their dtype; per token and head, ``scale = max((max - min) / 15, 1e-6)``,
    ``zp = clamp(round_half_away(-min / scale), 0, 15)``, ``q = clamp(round_half_away(x * (1 / scale) + zp), 0, 15)``
    (``:120-160``), packed two per byte, low nibble first; the zero point replaces the 4 low mantissa bits of the
    stored fp32 scale (``:158-170``), and reads use that scale with those bits cleared: ``(q - zp) * scale'``
    (``:547-560``), rotated back (``/ b``, ``:919-920``)."""

    channel_multiple = (2, "two codes per byte")
    max_abs = F32_HALF
    max_abs_reason = F32_MAX_ABS_REASON
    roles = {"payload": StorageRole.PAYLOAD, "scale": StorageRole.SCALE}  # the zero point in the scale's low bits

    @staticmethod
    def _rotated_limit(head_dim: int, dtype: torch.dtype) -> tuple[float, str]:
        """The largest |y| the rotated states may reach, and what sets it: they are rounded to the states' dtype, and
        the read sums ``b`` dequantized values of up to the group's range (``2 max|y|``) in float32."""
        block = largest_power_of_two_divisor(head_dim)
        back = F32_MAX / (2 * block)
        if torch.finfo(dtype).max <= back:
            return torch.finfo(dtype).max, f"of the states' dtype {dtype}"
        return back, "whose range and rotation back stay within float32"

    def checked_above(self, head_dim, dtype):
        return self._rotated_limit(head_dim, dtype)[0] / largest_power_of_two_divisor(head_dim)  # |H(s x)| <= b max|x|

    def check(self, x, name):
        """States whose rotation (:func:`rht`, unnormalized: up to ``b`` times their largest |x|) overflows their dtype
        or float32's room for the read are refused (vLLM would store inf or NaN)."""
        if x.device.type == "meta" or not x.numel() or \
                float(x.abs().amax()) <= self.checked_above(x.shape[-1], x.dtype):
            return
        limit, reason = self._rotated_limit(x.shape[-1], x.dtype)
        amax = float(rht(x.float()).to(x.dtype).abs().amax())
        if not amax <= limit:
            block = largest_power_of_two_divisor(x.shape[-1])
            raise KVQuantError(f"{name} reach |y| = {amax:.4g} once rotated by vLLM's Hadamard transform "
                               f"(unnormalized, blocks of {block}), beyond the ±{limit:.4g} {reason}")

    def encode(self, x):
        rotated = rht(x.float()).to(x.dtype).float()
        low, high = rotated.amin(-1, keepdim=True), rotated.amax(-1, keepdim=True)
        scale = ((high - low) / 15.0).clamp(min=1e-6)
        zero = round_half_away(-low / scale).clamp(0, 15)
        q = round_half_away(rotated * (1.0 / scale) + zero).clamp(0, 15)
        bits = (scale.view(torch.int32) & -16) | zero.to(torch.int32)
        return {"payload": pack_nibbles(q), "scale": bits.view(torch.float32)}

    def decode_into(self, enc, out):
        bits = enc["scale"].view(torch.int32)
        zero, scale = (bits & 0xF).float(), (bits & -16).view(torch.float32)
        rotated = (unpack_nibbles(enc["payload"]).float() - zero) * scale
        ops.store_clamped(out, rht(rotated, inverse=True) / largest_power_of_two_divisor(out.shape[-1]))


@dataclass(frozen=True, eq=False)
class Nvfp4Codec(Codec):
    """vLLM ``nvfp4`` (``csrc/nvfp4_kv_cache_kernels.cu``, ``nvfp4_utils.cuh`` cvt_warp_fp16_to_fp4): per block of
    16 channels, ``sf = e4m3_satfinite((1 / k_scale) * (amax * (1 / 6)))`` (stored), ``out_scale = 1 / (sf *
    k_scale)`` (0 when sf is 0), ``code = e2m1(x * out_scale)``; read as ``e2m1 * sf * k_scale``. ``k_scale`` is
    the layer's static global scale (1.0 when the checkpoint has none)."""

    channel_multiple = (16, "blocks of 16 channels")
    max_abs = F32_HALF
    max_abs_reason = F32_MAX_ABS_REASON
    roles = {"payload": StorageRole.PAYLOAD, "scale": StorageRole.SCALE}  # one e4m3 block scale per 16 channels

    global_scale: float

    def encode(self, x):
        blocks = x.float().unflatten(-1, (-1, 16))
        amax = blocks.abs().amax(-1, keepdim=True)
        sf = e4m3_saturated((1.0 / self.global_scale) * (amax * (1.0 / 6.0)))
        factor = sf.float() * (1.0 / (1.0 / self.global_scale))
        out_scale = torch.where(factor != 0, 1.0 / factor, torch.zeros_like(factor))
        codes = e2m1_codes(blocks * out_scale).flatten(-2)
        return {"payload": pack_nibbles(codes), "scale": sf.squeeze(-1)}

    def decode_into(self, enc, out):
        values = e2m1_values(unpack_nibbles(enc["payload"])).unflatten(-1, (-1, 16))
        ops.store_clamped(out, (values * enc["scale"].float().unsqueeze(-1) * self.global_scale).flatten(-2))


@dataclass(frozen=True)
class MinMaxUint4Codec(Codec):
    """TurboQuant's values (``triton_turboquant_store.py:97-136``): per token and head, ``scale = (max - min) / 15``
    (at least 1e-8), ``q = clamp(trunc((x - min) / scale + 0.5), 0, 15)``, packed low nibble first; scale and
    minimum stored as fp16 and read as ``q * fp16(scale) + fp16(min)`` (``triton_turboquant_decode.py:410-425``)."""

    channel_multiple = (2, "two value codes per byte")
    max_abs = FP16_MAX
    roles = {"payload": StorageRole.PAYLOAD, "scale": StorageRole.SCALE, "minimum": StorageRole.SCALE}
    max_abs_reason = "TurboQuant's fp16 scale and minimum per token and head can hold"

    def encode(self, x):
        x = x.float()
        low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        scale = (high - low) / 15.0
        scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
        q = ((x - low) / scale + 0.5).trunc().clamp(0, 15)
        return {"payload": pack_nibbles(q), "scale": scale.half(), "minimum": low.half()}

    def decode_into(self, enc, out):
        q = unpack_nibbles(enc["payload"]).float()
        ops.store_clamped(out, q * enc["scale"].float() + enc["minimum"].float())


@dataclass(frozen=True)
class UnscaledFp8Codec(Codec):
    """TurboQuant k8v4's keys (``triton_turboquant_store.py:144-211``): cast to e4m3 with no scale (saturating)."""

    roles = {"payload": StorageRole.PAYLOAD}

    def encode(self, x):
        return {"payload": e4m3_saturated(x.float())}

    def decode_into(self, enc, out):
        ops.store_clamped(out, enc["payload"].float())


@dataclass(frozen=True, eq=False)
class LloydMaxCodec(Codec):
    """TurboQuant's MSE keys with norm correction (``triton_turboquant_store.py:412-447``, ``_tq_fused_store_mse``):
    ``norm = ||k||`` (stored fp16), ``y = (k / (norm + 1e-8)) @ H/sqrt(D)``, code = how many fp32 midpoints of the
    sorted centroids ``y`` reaches (ties go up), packed two per byte low nibble first. Read
    (``triton_turboquant_decode.py:380-400``): centroids of the codes divided by their vector's norm
    ``sqrt(sum c^2 + 1e-16)``, times fp16 norm, rotated back with ``H/sqrt(D)``."""

    centroids: torch.Tensor
    max_abs = FP16_MAX  # a norm is at least every |x| of its vector
    roles = {"payload": StorageRole.PAYLOAD, "norm": StorageRole.SCALE}
    max_abs_reason = "TurboQuant's fp16 key norm can hold"

    def checked_above(self, head_dim, dtype):
        return FP16_MAX / math.sqrt(head_dim)  # ||k|| <= sqrt(D) max|k|

    def check(self, x, name):
        """A vector's norm beyond fp16 (stored as inf: its keys read back NaN) is refused."""
        if x.device.type == "meta" or not x.numel() or \
                float(x.abs().amax()) <= self.checked_above(x.shape[-1], x.dtype):
            return
        norm = float(x.float().norm(dim=-1).amax())
        if not norm <= FP16_MAX:
            raise KVQuantError(f"{name} reach a norm of {norm:.4g} per token and head, beyond the ±{FP16_MAX:.0f} "
                               f"{self.max_abs_reason}")

    def _rotation(self, d: int, device) -> torch.Tensor:
        return hadamard_transform(torch.eye(d)).to(device) / math.sqrt(d)

    def encode(self, x):
        k = x.float()
        norm = k.norm(dim=-1, keepdim=True)
        y = (k / (norm + 1e-8)) @ self._rotation(k.shape[-1], k.device)
        c = self.centroids.to(k.device)
        midpoints = (c[:-1] + c[1:]) / 2
        codes = (y.unsqueeze(-1) >= midpoints).sum(-1)
        return {"payload": pack_nibbles(codes), "norm": norm.half()}

    def decode_into(self, enc, out):
        c = self.centroids.to(out.device)[unpack_nibbles(enc["payload"]).long()]
        c = c * (1.0 / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16))
        rotated = enc["norm"].float() * c
        ops.store_clamped(out, rotated @ self._rotation(out.shape[-1], out.device))


# --------------------------------------------------------------------------------------------------
# Quantizers (registered names say the engine and its flag)


def _positive_scales(name: str, field: str, value, reciprocal: bool = False) -> torch.Tensor:
    """A static scale option: a positive number, or a list of them (one per KV head), finite and positive once in
    float32, where the engine keeps and applies it (with ``reciprocal``, for a format that divides by it, its
    reciprocal too)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    ok = values and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and v != math.inf
                        for v in values)  # (an int is finite, however long; NaN fails v > 0)
    if not ok:
        raise KVQuantError(f"{name}: {field} must be a positive number or a list of them (one per KV head), "
                           f"got {short_repr(value)}")
    scale = torch.tensor([_to_float(v) for v in values], dtype=torch.float32)
    inverse = 1.0 / scale
    for v, s, inv in zip(values, scale.tolist(), inverse.tolist()):
        if s in (0.0, math.inf) or (reciprocal and inv == math.inf):
            said = f"is {s:g} in float32" if s in (0.0, math.inf) else f"has 1 / {field} = inf in float32"
            lowest = 1.0 / F32_MAX if reciprocal else float(torch.finfo(torch.float32).smallest_normal) * 2**-23
            raise KVQuantError(f"{name}: {field} {short_repr(v)} {said}, the precision the engine applies it in; "
                               f"give a scale in [{lowest:.4g}, {F32_MAX:.4g}]")
    return scale if isinstance(value, (list, tuple)) else scale[0]


def _to_float(v: int | float) -> float:
    """``float(v)``; an integer beyond any float: inf."""
    try:
        return float(v)
    except OverflowError:
        return math.inf


#: What vLLM's turboquant formats need: it keeps boundary layers at model precision itself.
TURBOQUANT_BOUNDARY = "vLLM keeps the first and last 2 layers of a dense model at full precision on its own"


@register_quantizer("vllm_fp8")
@dataclass(frozen=True)
class VllmFp8(Quantizer):
    """vLLM ``--kv-cache-dtype fp8`` with the checkpoint's static ``k_scale``/``v_scale``: one per layer, or one per
    KV head (compressed-tensors ``strategy: attn_head``, FlashAttention 3). A checkpoint without scales runs at 1.0
    (``kv_cache.py:117-169``), the default here; calibrated scales are ``amax / 448``."""

    serving: ClassVar[Serving] = Serving(
        "vLLM", "fp8", "static scales from the checkpoint (compressed-tensors k_scale/v_scale; per-head scales need "
        "FlashAttention 3); none: 1.0", layer_scales=True,
        unshipped_scales="one k_scale/v_scale for all layers is not exported (calibrate: tensor gives per-layer "
                         "scales, which are)")

    #: calibrated scales are amax / 448 (``kvquant.scoring.calibrate``)
    calibration_divisor: ClassVar[float] = E4M3_MAX
    k_scale: float | tuple[float, ...] = 1.0
    v_scale: float | tuple[float, ...] = 1.0

    def __post_init__(self):
        super().__post_init__()
        for field in ("k_scale", "v_scale"):
            _positive_scales(self.name, field, getattr(self, field))
            if isinstance(getattr(self, field), list):  # per-head scales, kept hashable
                object.__setattr__(self, field, tuple(getattr(self, field)))

    def _codecs(self, head_dim):
        return (StaticFp8Codec(_positive_scales(self.name, "k_scale", self.k_scale)),
                StaticFp8Codec(_positive_scales(self.name, "v_scale", self.v_scale)))


#: What vLLM's per-token-head formats need.
TRITON_BACKEND = "vLLM's Triton attention backend"


@register_quantizer("vllm_fp8_per_token_head")
@dataclass(frozen=True)
class VllmFp8PerTokenHead(Alike):
    """vLLM ``--kv-cache-dtype fp8_per_token_head``: e4m3 with a dynamic fp32 scale per token and head."""

    serving = Serving("vLLM", "fp8_per_token_head", TRITON_BACKEND)
    codec = functools.partial(PerTokenHeadCodec, fp8=True)


@register_quantizer("vllm_int8_per_token_head")
@dataclass(frozen=True)
class VllmInt8PerTokenHead(Alike):
    """vLLM ``--kv-cache-dtype int8_per_token_head``: symmetric int8 with a dynamic fp32 scale per token and head."""

    serving = Serving("vLLM", "int8_per_token_head", TRITON_BACKEND)
    codec = functools.partial(PerTokenHeadCodec, fp8=False)


@register_quantizer("vllm_int4_per_token_head")
@dataclass(frozen=True)
class VllmInt4PerTokenHead(Alike):
    """vLLM ``--kv-cache-dtype int4_per_token_head``: rotated, asymmetric uint4 per token and head."""

    serving = Serving("vLLM", "int4_per_token_head", TRITON_BACKEND)
    codec = Int4PerTokenHeadCodec


@register_quantizer("vllm_nvfp4")
@dataclass(frozen=True)
class VllmNvfp4(Quantizer):
    """vLLM ``--kv-cache-dtype nvfp4``: e2m1 in blocks of 16 with e4m3 block scales under a static global scale
    per layer (``k_scale``/``v_scale``: 1.0 without checkpoint scales; ModelOpt's are ``amax / (6 * 448)``)."""

    serving: ClassVar[Serving] = Serving(
        "vLLM", "nvfp4", "a Blackwell GPU (FlashInfer); the global scale from the checkpoint, else 1.0",
        unshipped_scales="exporting vllm_nvfp4's global scales (ModelOpt's hf_quant_config.json) is not built yet")

    #: calibrated global scales are amax / (6 x 448), as ModelOpt's (``kvquant.scoring.calibrate``)
    calibration_divisor: ClassVar[float] = 6 * E4M3_MAX
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        for field in ("k_scale", "v_scale"):
            if isinstance(getattr(self, field), (list, tuple)):
                raise KVQuantError(f"{self.name}: {field} is one global scale per layer, not a list")
            _positive_scales(self.name, field, getattr(self, field), reciprocal=True)

    def _codecs(self, head_dim):
        return Nvfp4Codec(float(self.k_scale)), Nvfp4Codec(float(self.v_scale))


@register_quantizer("vllm_turboquant_k8v4")
@dataclass(frozen=True)
class VllmTurboquantK8V4(Quantizer):
    """vLLM ``--kv-cache-dtype turboquant_k8v4``: keys e4m3 without a scale, values uint4 min/max per token and
    head. vLLM keeps the first and last 2 layers of a dense model at full precision (``turboquant/config.py:177-213``):
    give those layers ``fp16`` through ``layers`` to match it."""

    serving: ClassVar[Serving] = Serving("vLLM", "turboquant_k8v4", TURBOQUANT_BOUNDARY, boundary_layers=2)

    def _codecs(self, head_dim):
        return UnscaledFp8Codec(), MinMaxUint4Codec()


@register_quantizer("vllm_turboquant_4bit_nc")
@dataclass(frozen=True)
class VllmTurboquant4BitNc(Quantizer):
    """vLLM ``--kv-cache-dtype turboquant_4bit_nc``: keys Hadamard-rotated onto 4-bit Lloyd-Max centroids with an
    fp16 norm and norm correction, values uint4 min/max per token and head."""

    serving: ClassVar[Serving] = Serving("vLLM", "turboquant_4bit_nc", TURBOQUANT_BOUNDARY, boundary_layers=2)

    def _codecs(self, head_dim):
        if head_dim & (head_dim - 1):
            raise KVQuantError(f"{self.name}: head_dim {head_dim} is not a power of two (the Hadamard rotation)")
        return LloydMaxCodec(lloyd_max_centroids(head_dim, 4)), MinMaxUint4Codec()
