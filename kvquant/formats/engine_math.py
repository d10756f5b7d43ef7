"""The arithmetic the serving engines' KV formats share (:mod:`kvquant.formats.vllm`, :mod:`kvquant.formats.sglang`):
pure tensor functions, testable without a model, written from the engines' sources: vLLM 0.33.0 and SGLang 0.5.23
as published on PyPI (``file:line`` below are lines of those wheels).

Exact to the engine: codes, scales and their rounding (round-half-away where a Triton kernel adds ±0.5 and
truncates, round-half-even where a hardware cast rounds, saturation), packing and stored bytes. Not exact: the
engines' GPU kernels divide with Triton's approximate ``div.full.f32`` and NVIDIA's ``rcp.approx``, which can differ
from IEEE division (used here) in the last bit of a scale and so move a code that sits on a rounding tie; and the
engines fold scales into attention scores where kvquant returns dequantized states rounded to the model's dtype.
"""

from __future__ import annotations

import functools
import math

import torch

from kvquant.formats.quantizers import F32_MAX

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
FP16_MAX = torch.finfo(torch.float16).max  # 65504
#: The largest |state| of a format that computes in float32: a code rounded up (e4m3 by up to 1/16, an integer by
#: half a step) must still dequantize to a finite float32.
F32_HALF = F32_MAX / 2
F32_MAX_ABS_REASON = ("this format holds (it computes in float32, and a code rounded up must dequantize to a finite "
                      "number)")
#: e2m1 (fp4) magnitudes in code order: a code's low 3 bits index this table, bit 3 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: where |x| rounds to the next e2m1 magnitude, and whether a tie there goes up (to the even mantissa)
E2M1_TIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, ties away from zero (a Triton kernel's ``x ± 0.5`` then truncation)."""
    return torch.where(x >= 0, x + 0.5, x - 0.5).trunc()


def e4m3_saturated(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) cast to e4m3 as CUDA's ``cvt.rn.satfinite`` does: round half to even, saturating at ±448."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp4 e2m1 codes (uint8, 0-15: sign bit 3, magnitude index bits 0-2) of fp32 ``x``: round half to even,
    saturating at ±6 (``cvt.rn.satfinite.e2m1x2.f32``)."""
    magnitude = x.abs()
    index = torch.zeros_like(magnitude, dtype=torch.uint8)
    for edge, up in E2M1_TIES:
        index += (magnitude >= edge if up else magnitude > edge).to(torch.uint8)
    return index | ((x < 0).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """The fp32 values of e2m1 ``codes``."""
    table = torch.tensor(E2M1_VALUES, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim: element ``2i`` in the low nibble, ``2i + 1`` in the high."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized Sylvester-Hadamard transform ``H x`` along the last dim (a power of two), by the
    butterfly vLLM runs on the CPU (``int4_per_token_head.py:1112-1120``): the same additions in the same order."""
    d, h = x.shape[-1], 1
    while h < d:
        halves = x.unflatten(-1, (d // (2 * h), 2, h))
        x = torch.stack([halves[..., 0, :] + halves[..., 1, :], halves[..., 0, :] - halves[..., 1, :]], -2)
        x = x.flatten(-3)
        h *= 2
    return x


def largest_power_of_two_divisor(n: int) -> int:
    return n & -n


@functools.lru_cache(maxsize=16)
def rht_signs(block: int) -> torch.Tensor:
    """vLLM's ±1 signs for the randomized Hadamard transform of ``block`` channels
    (``int4_per_token_head.py:1132-1143``: a CPU generator seeded 0x9E3779B9, Bernoulli(1/2) draws)."""
    generator = torch.Generator(device="cpu").manual_seed(0x9E3779B9)
    return 2.0 * torch.bernoulli(torch.full((block,), 0.5), generator=generator) - 1.0


def rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """vLLM's randomized Hadamard transform over blocks of the largest power-of-two divisor ``b`` of head_dim
    (``int4_per_token_head.py:1146-1167``): ``H (s * x)``, or ``s * (H y)`` for ``inverse`` (unnormalized: the
    inverse of the forward transform is ``inverse / b``)."""
    d = x.shape[-1]
    block = largest_power_of_two_divisor(d)
    signs = rht_signs(block).to(x.device)
    blocks = x.unflatten(-1, (d // block, block))
    out = hadamard_transform(blocks) * signs if inverse else hadamard_transform(blocks * signs)
    return out.flatten(-2)


@functools.lru_cache(maxsize=16)
def lloyd_max_centroids(d: int, bits: int) -> torch.Tensor:
    """The ``2**bits`` centroids vLLM's TurboQuant uses for head_dim ``d`` (``turboquant/centroids.py:31-87``):
    Lloyd-Max iterations for N(0, 1/d) from a uniform start on ±3.5 sigma, each region's moments integrated by
    the trapezoid rule over 200 intervals (the outer regions end at ±10.5 sigma), at most 200 iterations or until
    no centroid moves by 1e-10 (the centroids before that last update are kept); float64, then float32."""
    levels, variance = 2**bits, 1.0 / d
    sigma = math.sqrt(variance)

    def density(x: float) -> float:
        return math.exp(-x * x / (2 * variance)) / math.sqrt(2 * math.pi * variance)

    def integral(f, a: float, b: float, n: int = 200) -> float:
        step = (b - a) / n
        total = 0.5 * (f(a) + f(b))
        for i in range(1, n):
            total += f(a + i * step)
        return total * step

    low, high = -3.5 * sigma, 3.5 * sigma
    centroids = [low + (high - low) * (i + 0.5) / levels for i in range(levels)]
    for _ in range(200):
        edges = [3 * low, *[(centroids[i] + centroids[i + 1]) / 2.0 for i in range(levels - 1)], 3 * high]
        moved = []
        for i in range(levels):
            mass = integral(density, edges[i], edges[i + 1])
            mean = integral(lambda x: x * density(x), edges[i], edges[i + 1])
            moved.append(mean / mass if mass > 1e-15 else centroids[i])
        if max(abs(a - b) for a, b in zip(moved, centroids)) < 1e-10:
            break
        centroids = moved
    return torch.tensor(centroids, dtype=torch.float32)
