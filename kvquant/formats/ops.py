"""Pure tensor arithmetic of KV quantization: min-max integer codes, bit packing, fp8 casts, SQNR.

Nothing here knows about models or caches, so every function can be tested on its own. Scales and
zero points are stored in fp16 by default (two bytes each), fp32 on request; arithmetic runs in fp32.
"""

from __future__ import annotations

import functools
import math

import torch

SCALE_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def scale_limits(scale_dtype: torch.dtype) -> tuple[float, float]:
    """``(smallest scale, largest |x|)`` for scales stored in ``scale_dtype``.

    Scales are clamped to the smallest normal number, so an all-zero group never divides by zero; a
    zero point must fit the format, so states beyond its maximum are refused.
    """
    info = torch.finfo(scale_dtype)
    return info.tiny, info.max


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes along the last dimension, ``k = 8 // bits`` codes per byte, in blocks.

    q: ``[..., D]`` uint8 with every code ``< 2**bits``; ``D`` divisible by ``k``.
    Returns ``[..., D // k]`` uint8. Block layout: the code of channel ``j * (D // k) + i`` sits in byte ``i``
    at bit ``j * bits``, so unpacking writes ``k`` contiguous blocks (fast vectorized ops, no interleave).
    """
    if bits == 8:
        return q
    k = 8 // bits
    if q.shape[-1] % k:
        raise ValueError(f"cannot pack {q.shape[-1]} codes of {bits} bits into whole bytes ({k} per byte)")
    blocks = q.chunk(k, dim=-1)
    packed = blocks[0].clone()
    for j in range(1, k):
        packed |= blocks[j] << (j * bits)
    return packed


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``[..., Dp]`` uint8 -> ``[..., Dp * 8 // bits]`` uint8 codes."""
    if bits == 8:
        return packed
    k, width = 8 // bits, packed.shape[-1]
    codes = packed.new_empty(*packed.shape[:-1], width * k)
    mask = 2**bits - 1
    torch.bitwise_and(packed, mask, out=codes[..., :width])
    for j in range(1, k):
        block = codes[..., j * width : (j + 1) * width]
        torch.bitwise_right_shift(packed, j * bits, out=block)
        if j < k - 1:
            block &= mask
    return codes


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``bits``-bit codes densely along the last dimension, for any ``bits`` in 1-8 (3 bits: 8 codes in 3
    bytes). Widths that divide 8 use :func:`pack_bits`'s block layout; the others (3, 5, 6, 7) a bit stream: bit
    ``j`` of channel ``i``'s code is bit ``(i * bits + j) % 8`` of byte ``(i * bits + j) // 8`` (little-endian),
    built a word of :func:`stream_word` codes at a time.

    q: ``[..., D]`` uint8 codes ``< 2**bits``, ``D * bits`` a multiple of 8. Returns ``[..., D * bits // 8]`` uint8.
    """
    if 8 % bits == 0:
        return pack_bits(q, bits)
    if q.shape[-1] * bits % 8:
        raise ValueError(f"cannot pack {q.shape[-1]} codes of {bits} bits into whole bytes")
    codes, size, wide = stream_word(bits)
    grouped = q.unflatten(-1, (-1, codes))  # [..., D / codes, codes]: a loop over the few codes of a word
    word = (grouped[..., 0] & (2**bits - 1)).to(wide)
    for j in range(1, codes):
        word |= (grouped[..., j] & (2**bits - 1)).to(wide) << (j * bits)
    packed = q.new_empty(*word.shape, size)
    for i in range(size):
        packed[..., i] = (word >> (8 * i)) & 255
    return packed.flatten(-2)


def stream_word(bits: int) -> tuple[int, int, torch.dtype]:
    """``(codes, bytes, dtype)`` of one word of the bit stream of :func:`pack_codes` for a width that does not divide
    8: the fewest codes that fill whole bytes (3 bits: 8 codes in 3 bytes), and an integer dtype that holds them."""
    codes = 8 // math.gcd(8, bits)
    return codes, codes * bits // 8, torch.int32 if codes * bits < 32 else torch.int64


def stream_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The words of a bit stream of :func:`pack_codes` (``bits`` not dividing 8): ``[..., Dp]`` uint8 ->
    ``[..., D / codes]`` integers, code ``j`` of a word at its bit ``j * bits``."""
    _, size, wide = stream_word(bits)
    grouped = packed.unflatten(-1, (-1, size))
    word = grouped[..., 0].to(wide)
    for i in range(1, size):
        word |= grouped[..., i].to(wide) << (8 * i)
    return word


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``[..., Dp]`` uint8 -> ``[..., Dp * 8 // bits]`` uint8 codes."""
    if 8 % bits == 0:
        return unpack_bits(packed, bits)
    return split_words(stream_words(packed, bits), bits, stream_word(bits)[0], torch.uint8).flatten(-2)


def split_words(words: torch.Tensor, width: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``count`` fields of ``width`` bits of each word, the lowest first: ``[...]`` integers -> ``[..., count]``
    of ``dtype`` (a loop over the few fields: one pass over the words each)."""
    fields = torch.empty(*words.shape, count, dtype=dtype, device=words.device)
    for j in range(count):
        fields[..., j] = (words >> (j * width)) & (2**width - 1)
    return fields


def minmax_quantize(
    x: torch.Tensor, bits: int, dim: int, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization of ``x`` with one (scale, zero) pair per slice along ``dim``.

    x: any shape, finite, within the range of ``scale_dtype``. Returns ``(codes, scale, zero)``: codes uint8
    of x's shape in ``[0, 2**bits - 1]``; scale and zero in ``scale_dtype`` with ``dim`` kept at size 1, so
    ``x ~ zero + codes * scale``. The codes are rounded against the stored (rounded) scale and zero, so fp16
    storage adds no bias. A constant slice gets the smallest scale and is reproduced exactly.
    """
    levels = 2**bits - 1
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / levels).clamp(min=scale_limits(scale_dtype)[0]).to(scale_dtype)
    zero = lo.to(scale_dtype)
    codes = torch.round((x - zero.float()) / scale.float()).clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero


def minmax_dequantize_(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """In place: ``x`` holds codes (as floats of the output dtype); make it ``zero + x * scale``.

    Runs in x's dtype. ``addcmul`` is one pass when scale and zero broadcast along an outer dimension; when
    they broadcast along the innermost one, separate in-place ``mul_`` and ``add_`` are faster on CPU.
    """
    scale, zero = scale.to(x.dtype), zero.to(x.dtype)
    if scale.shape[-1] == 1 and x.shape[-1] > 1:
        return x.mul_(scale).add_(zero)
    return torch.addcmul(zero, x, scale, out=x)


def fp8_quantize(
    x: torch.Tensor, dtype: torch.dtype, dims: tuple[int, ...], scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale ``x`` so its absolute maximum over ``dims`` lands on the fp8 format's maximum, then cast.

    Returns ``(payload, scale)``: payload in ``dtype`` (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``)
    with x's shape, scale in ``scale_dtype`` with ``dims`` kept at size 1. The scale is computed from the very tensor
    being stored, so nothing saturates (beyond the clamp that absorbs fp16 rounding of the scale).
    """
    fmax = torch.finfo(dtype).max
    amax = x.float().abs().amax(dim=dims, keepdim=True)
    scale = (amax / fmax).clamp(min=scale_limits(scale_dtype)[0]).to(scale_dtype)
    payload = (x.float() / scale.float()).clamp_(-fmax, fmax).to(dtype)
    return payload, scale


def fp8_dequantize_into(out: torch.Tensor, payload: torch.Tensor, scale: torch.Tensor) -> None:
    """Write ``payload * scale`` into ``out``, computed in fp32 and rounded once (clamped to out's range)."""
    store_clamped(out, payload.float() * scale.float())


def store_clamped(out: torch.Tensor, x: torch.Tensor) -> None:
    """Copy fp32 ``x`` into ``out``, clamping to the finite range of out's dtype.

    Dequantized values can land a rounding step beyond the largest state written (a group spanning ±65504 in fp16
    rounds its top level to 65520 -> inf in fp16); the clamp keeps finite states finite.
    """
    limit = torch.finfo(out.dtype).max
    out.copy_(x.clamp_(-limit, limit) if limit < torch.finfo(x.dtype).max else x)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(sum x^2 / sum (x - x_hat)^2)``."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / noise))


def hadamard_rotation(head_dim: int, seed: int) -> torch.Tensor:
    """An orthonormal ``[head_dim, head_dim]`` float64 matrix ``R = diag(s) @ blockdiag(H, ..., H)``: random signs
    ``s`` (from ``seed``) times normalized Hadamard blocks of the largest power of two dividing ``head_dim`` (the
    whole head_dim where it is a power of two; 80 -> blocks of 16). States ``x [..., D]`` are rotated as
    ``x @ R`` and restored as ``y @ R.T``."""
    block = head_dim & -head_dim
    h = _hadamard_block(block)
    signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1
    return signs[:, None] * (h if block == head_dim else torch.block_diag(*[h] * (head_dim // block)))


@functools.lru_cache(maxsize=4)
def _hadamard_block(block: int) -> torch.Tensor:
    """The normalized ``[block, block]`` Hadamard matrix (Sylvester's), float64; built once per size (every codec
    builds its rotation, and the planner one per layers entry). Shared: never modify it in place."""
    from scipy.linalg import hadamard

    return torch.from_numpy(hadamard(block)).double() / block**0.5


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x @ matrix`` along the last dimension, computed in at least fp32 and returned in ``x``'s dtype."""
    work = torch.promote_types(x.dtype, torch.float32)
    return (x.to(work) @ matrix.to(device=x.device, dtype=work)).to(x.dtype)
