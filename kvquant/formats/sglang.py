"""SGLang's own KV-cache format as a quantizer: what ``--kv-cache-dtype mxfp8`` stores, value for value (SGLang 0.5.23
as published on PyPI; ``file:line`` below are lines of that wheel; what is exact to the engine and what is not:
:mod:`kvquant.formats.engine_math`). Each token's keys and values are stored when they are written (one unit = one
token). Registered name: ``sglang_mxfp8`` (8.25 bits per element).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvquant.formats import ops
from kvquant.formats.roles import StorageRole
from kvquant.formats.engine_math import E4M3_MAX, F32_HALF, F32_MAX_ABS_REASON, e4m3_saturated
from kvquant.formats.quantizers import Alike, Codec, Serving, register_quantizer


@dataclass(frozen=True)
class Mxfp8Codec(Codec):
    """SGLang ``mxfp8`` (``sglang/kernels/ops/quantization/mxfp8_quant.py:19-60``): per block of 32 channels,
    ``e = clamp(ceil(log2(max(amax, 1e-30) / 448)) + 127, 0, 254)`` (stored as one byte, e8m0), codes
    ``e4m3(clamp(x / 2**(e - 127), ±448))``; read as ``code * 2**(e - 127)``."""

    channel_multiple = (32, "blocks of 32 channels")
    max_abs = F32_HALF
    max_abs_reason = F32_MAX_ABS_REASON
    roles = {"payload": StorageRole.PAYLOAD, "exponent": StorageRole.SCALE}  # one e8m0 shared exponent per 32 channels

    def encode(self, x):
        blocks = x.float().unflatten(-1, (-1, 32))
        amax = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-30)
        exponent = (torch.ceil(torch.log2(amax / E4M3_MAX)) + 127).clamp(0, 254)
        codes = e4m3_saturated(blocks / torch.exp2(exponent - 127))
        return {"payload": codes.flatten(-2), "exponent": exponent.squeeze(-1).to(torch.uint8)}

    def decode_into(self, enc, out):
        scale = torch.exp2(enc["exponent"].float() - 127).unsqueeze(-1)
        ops.store_clamped(out, (enc["payload"].float().unflatten(-1, (-1, 32)) * scale).flatten(-2))


@register_quantizer("sglang_mxfp8")
@dataclass(frozen=True)
class SglangMxfp8(Alike):
    """SGLang ``--kv-cache-dtype mxfp8``: e4m3 in blocks of 32 channels with an e8m0 (power-of-two) scale."""

    serving = Serving("SGLang", "mxfp8", "SGLang's FA4 attention backend")
    codec = Mxfp8Codec
