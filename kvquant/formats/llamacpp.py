"""llama.cpp's KV cache types (``-ctk``/``-ctv``, Ollama's ``OLLAMA_KV_CACHE_TYPE``, llama-cpp-python's
``type_k``/``type_v``) as quantizers, value for value.

Written from the llama.cpp that llama-cpp-python 0.3.36 vendors (PyPI source package; ``file:line`` below are lines
of ``vendor/llama.cpp``):

- Cache types: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1 (``common/arg.cpp:304-314``). A quantized type
  needs head sizes that are multiples of its block of 32 (``src/llama-context.cpp:3851-3870``) and a quantized V
  needs flash attention (``:3840-3849``).
- Blocks of 32 along the head dimension (``ggml/src/ggml-common.h:194-255, 445-451``): q8_0 = fp16 ``d`` + 32 int8
  (34 bytes), q4_0 = ``d`` + 16 bytes of nibbles (18), q4_1 = ``d``, ``m`` + nibbles (20), q5_0 = ``d`` + 4 bytes of
  fifth bits + nibbles (22), q5_1 = ``d``, ``m``, fifth bits, nibbles (24), iq4_nl = ``d`` + nibbles indexing
  ``kvalues_iq4nl`` (18, ``ggml-common.h:1120-1122``). Nibble ``j`` of a block's byte ``j`` is element ``j``, the high
  nibble element ``j + 16``; fifth bit ``k`` of the little-endian ``qh`` word is element ``k``'s.
- The store is ``ggml_set_rows`` with the CPU type's ``from_float`` (``ggml/src/ggml-cpu/ops.cpp:5446-5515``): for
  q4_0/q4_1/q5_0/q5_1 and iq4_nl the reference quantizers (``ggml-cpu/quants.c:33-47, 1331-1334`` ->
  ``ggml/src/ggml-quants.c:113-274, 5071-5084``), compiled into ggml-base without architecture flags (no FMA, no
  reassociation); for q8_0 the architecture's own: x86 AVX/AVX2 ``d = amax / 127``, ``id = 127 / amax``, ties to
  even (``ggml-cpu/arch/x86/quants.c:302-398``); ARM NEON ``id = 1 / d``, ties to even (``arch/arm/quants.c:41-83``);
  the scalar reference ``id = 1 / d``, ties away from zero (``ggml-quants.c:276-299``): option ``cpu``.
- iq4_nl's reference quantizer (``quantize_row_iq4_nl_impl`` with ``ntry = -1``, ``ggml-quants.c:4937-5046``): codes
  are the nearest table entries (``best_index_int8``, ``:28-37``) of ``x / d0`` with ``d0 = max / -127``; the stored
  scale is the weighted least-squares fit ``sum(w q x) / sum(w q^2)`` with ``w = x^2`` (float32 sums in element
  order). With ``ntry = -1`` the scale search loop (``for itry = 1; itry <= -1``) runs no iteration. A block with
  ``amax < 1e-15`` stores ``d = 0`` and whatever codes the previous block left in the buffer (here: 0): its values
  are 0 either way.
- Reads: the V row is dequantized to float32 (``ggml-quants.c:459-566, 2725-2741``) and accumulated in float32;
  a quantized K is dotted with the query converted to K's ``vec_dot_type`` (``ggml-cpu/ggml-cpu.c:216-285, 380-400``;
  flash attention ``ggml-cpu/ops.cpp:8843-9079``): q8_0 for q8_0, q4_0, q5_0 and iq4_nl, q8_1 for q4_1 and q5_1 (same
  codes and ``d`` as q8_0; its ``s = fp16(d * sum q)`` term enters q4_1/q5_1's dot product rounded to fp16, which
  :func:`convert_query` does not reproduce), f16 for f16, bf16 for bf16. f16 K and V with 64 or more query rows take
  the tiled path, which keeps the query in float32 (``ops.cpp:9545-9569``). An f32 K or V is cast to f16 before
  flash attention (``src/llama-graph.cpp:2650-2658``): an f32 cache reads as f16 (measured: llama.cpp's logits
  over an f32 cache equal those over an f16 cache bit for bit), though it stores 32 bits.
- Rotation (``src/llama-kv-cache.cpp:315-339``): a quantized K is rotated when the head size is a multiple of 64,
  by an orthonormal Walsh-Hadamard matrix of the largest power of two >= 64 dividing it (``build_input_k_rot``,
  ``:1447-1466``); a quantized V likewise, always by 64 (``build_input_v_rot``, ``:1468-1487``).
  ``LLAMA_ATTN_ROT_DISABLE=1`` turns both off (option ``attn_rot=False``). Q and K are rotated before K is stored,
  V before it is stored, and the attention output is rotated back (``src/llama-graph.cpp:2883-2890, 2928-2930``;
  sliding-window caches ``:3130-3141, 3191-3193``), each head's row in consecutive blocks of the matrix's size
  (``src/llama-impl.h:57-75``). On the CPU that product is a fast Walsh-Hadamard transform in float32: scaled by
  ``1 / sqrtf(n)`` first, then butterflies of span 1, 2, 4, ... (``ggml-cpu/ggml-cpu.c:1263-1266``,
  ``ggml-cpu/ops.cpp:12256-12328``): :func:`fwht`.

In kvquant the cache stores the rotated states and returns them rotated back (the same transform: it is its own
inverse), which equals llama.cpp's rotated query and rotated-back output up to float32 rounding. The K codec's
``query`` converts the query (:func:`convert_query`, rotated with K), and ``make_cache(model, ...)`` has the
model's attention read it (:mod:`kvquant.cache.query`). Not emulated: llama.cpp's order of float32 sums in dot
products and softmax, the fp16 accumulator of an f16 V with fewer than 64 query rows
(``ops.cpp:8941-8945, 8995-9008``), and a model whose layers differ in head size (llama.cpp then rotates no layer,
``llama-kv-cache.cpp:194-206``; kvquant decides per layer). What llama.cpp does with a GGUF model itself, beyond
its cache: K's channel order (:mod:`kvquant.formats.llamacpp_gguf`), quantized activations in its matmuls
(:mod:`kvquant.formats.llamacpp_matmuls`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvquant.formats import ops
from kvquant.formats.roles import StorageRole
from kvquant.formats.engine_math import hadamard_transform, round_half_away
from kvquant.formats.llamacpp_gguf import GgufOrderCodec, rope_layout_of
from kvquant.errors import KVQuantError
from kvquant.formats.quantizers import Codec, Quantizer, WrappingCodec, register_quantizer

BLOCK = 32
FP16_MAX = 65504.0
#: ``kvalues_iq4nl`` (``ggml-common.h:1120-1122``)
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
#: ``GROUP_MAX_EPS`` as float32 (``ggml-quants.c:20``)
GROUP_MAX_EPS = float(torch.tensor(1e-15, dtype=torch.float32))
#: Every type ``-ctk``/``-ctv`` accepts (``common/arg.cpp:304-314``), in its order.
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
FLOAT_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
#: bytes of one block of 32 (``ggml-common.h``)
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "iq4_nl": 18}
#: ``type_traits_cpu[type].vec_dot_type``: what the query is converted to before the K dot product
VEC_DOT_TYPE = {"f32": "f32", "f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0",
                "iq4_nl": "q8_0", "q4_1": "q8_1", "q5_1": "q8_1"}
#: what flash attention reads a float cache as: an f32 K or V is cast to f16 first (``src/llama-graph.cpp:2650-2658``)
READ_AS = {"f32": "f16", "f16": "f16", "bf16": "bf16"}
#: which build of ggml-cpu's ``quantize_row_q8_0``/``q8_1`` (q8_0 caches and converted queries)
CPU_PATHS = ("x86", "arm", "scalar")
#: query rows from which flash attention over f16 K and V takes the tiled path (``GGML_FA_TILE_Q``, ggml-cpu/common.h:9)
FA_TILE_Q = 64


# --------------------------------------------------------------------------------------------------
# ggml's block quantizers: blocks [..., nb, 32] float32 -> (d fp16 [..., nb, 1], m fp16 or None, codes [..., nb, 32])


def _signed_absmax(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax, max)`` per block as ggml's loops find them: the first element of largest magnitude, with its sign
    (``if (amax < fabsf(v))``); ``max`` stays +0 for an all-zero block."""
    a = b.abs()
    amax = a.amax(-1, keepdim=True)
    index = torch.arange(b.shape[-1], device=b.device).expand_as(b)
    first = torch.where(a == amax, index, b.shape[-1]).amin(-1, keepdim=True)
    signed = torch.gather(b, -1, first.clamp(max=b.shape[-1] - 1))
    return amax, torch.where(amax > 0, signed, torch.zeros_like(signed))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """``d ? 1.0f/d : 0.0f``"""
    return torch.where(d != 0, 1.0 / d, torch.zeros_like(d))


def quantize_q8(b: torch.Tensor, cpu: str = "x86"):
    """q8_0 (and q8_1's codes and ``d``): ``d = amax / 127``; codes ``x * id`` rounded (see the module docstring)."""
    amax = b.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inverse = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax)) if cpu == "x86" else _inverse(d)
    scaled = b * inverse
    codes = round_half_away(scaled) if cpu == "scalar" else torch.round(scaled)
    return d.half(), None, codes.clamp(-128, 127).to(torch.int8)


def _symmetric(b: torch.Tensor, half_range: int):
    """q4_0 / q5_0: ``d = max / -half_range``, code ``MIN(2 half_range - 1, (int8_t)(x * id + half_range + 0.5))``."""
    _, signed = _signed_absmax(b)
    d = signed / -float(half_range)
    codes = (b * _inverse(d) + (half_range + 0.5)).trunc().clamp(max=2 * half_range - 1)
    return d.half(), None, codes.to(torch.uint8)


def _asymmetric(b: torch.Tensor, levels: int):
    """q4_1 / q5_1: ``d = (max - min) / levels``, ``m = min``, code ``(int)((x - min) * id + 0.5)``."""
    low, high = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (high - low) / float(levels)
    codes = ((b - low) * _inverse(d) + 0.5).trunc().clamp(max=levels)
    return d.half(), low.half(), codes.to(torch.uint8)


def iq4nl_index(scaled: torch.Tensor) -> torch.Tensor:
    """``best_index_int8(16, kvalues_iq4nl, x)``: the nearest table entry, a tie to the upper one."""
    values = torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=scaled.device)
    upper = (scaled.unsqueeze(-1) >= values).sum(-1).clamp(1, 15)
    below = values[upper - 1]
    index = torch.where(scaled - below < values[upper] - scaled, upper - 1, upper)
    index = torch.where(scaled <= values[0], torch.zeros_like(index), index)
    return torch.where(scaled >= values[-1], torch.full_like(index, 15), index)


def quantize_iq4_nl(b: torch.Tensor):
    """iq4_nl's reference quantizer (``ntry = -1``): codes from ``d0 = max / -127``, scale the weighted least-squares
    fit with weights ``x^2``, summed in float32 in element order."""
    amax, signed = _signed_absmax(b)
    live = amax >= GROUP_MAX_EPS
    inverse = torch.where(live, 1.0 / (signed / -127.0), torch.zeros_like(amax))
    codes = iq4nl_index(b * inverse)
    q = torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=b.device)[codes]
    sum_qx = torch.zeros_like(amax)
    sum_q2 = torch.zeros_like(amax)
    if b.device.type == "meta":  # shapes only (the capacity planner): no order to keep, and 160 ops cost it seconds
        sum_qx, sum_q2 = (b * b * q * b).sum(-1, keepdim=True), (b * b * q * q).sum(-1, keepdim=True)
    else:
        for j in range(b.shape[-1]):  # ggml's order: sumqx += w*q*x, one element after the other
            wq = (b[..., j : j + 1] * b[..., j : j + 1]) * q[..., j : j + 1]
            sum_qx = sum_qx + wq * b[..., j : j + 1]
            sum_q2 = sum_q2 + wq * q[..., j : j + 1]
    d = torch.where(sum_q2 > 0, sum_qx / sum_q2, torch.zeros_like(sum_q2))
    d = torch.where(live, d, torch.zeros_like(d))
    return d.half(), None, torch.where(live, codes, torch.zeros_like(codes)).to(torch.uint8)


QUANTIZE = {
    "q8_0": quantize_q8,
    "q4_0": lambda b, cpu: _symmetric(b, 8),
    "q5_0": lambda b, cpu: _symmetric(b, 16),
    "q4_1": lambda b, cpu: _asymmetric(b, 15),
    "q5_1": lambda b, cpu: _asymmetric(b, 31),
    "iq4_nl": lambda b, cpu: quantize_iq4_nl(b),
}


def code_values(kind: str, codes: torch.Tensor) -> torch.Tensor:
    """A code's value in units of ``d`` (before ``+ m`` for q4_1/q5_1), float32 (``dequantize_row_*``)."""
    if kind == "iq4_nl":
        return torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]
    offset = {"q4_0": 8, "q5_0": 16}.get(kind, 0)
    return codes.float() - offset


def dequantize(kind: str, d: torch.Tensor, m: torch.Tensor | None, codes: torch.Tensor) -> torch.Tensor:
    """``code * d`` (``+ m``), float32, blocks ``[..., nb, 32]``."""
    values = code_values(kind, codes) * d.float()
    return values + m.float() if m is not None else values


# --------------------------------------------------------------------------------------------------
# ggml's byte layout


def pack_ggml_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``qs``: byte ``j`` = low 4 bits of element ``j`` | those of element ``j + 16`` << 4; ``[..., 32]`` ->
    ``[..., 16]``."""
    low = codes & 0xF
    return low[..., :16] | (low[..., 16:] << 4)


def unpack_ggml_nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 0xF, qs >> 4], -1)


def pack_high_bits(codes: torch.Tensor) -> torch.Tensor:
    """``qh``: bit ``k`` of the little-endian 32-bit word is bit 4 of element ``k``; ``[..., 32]`` -> ``[..., 4]``."""
    bits = ((codes >> 4) & 1).unflatten(-1, (4, 8))
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=codes.device)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def unpack_high_bits(qh: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def block_bytes(kind: str, enc: dict[str, torch.Tensor]) -> torch.Tensor:
    """The stored blocks as ggml's structs, ``[..., nb, BLOCK_BYTES[kind]]`` uint8: ``d`` (little-endian fp16), ``m``,
    ``qh``, ``qs`` in ``block_*``'s field order (``ggml-common.h``)."""
    halves = [enc[role].unsqueeze(-1).contiguous().view(torch.uint8) for role in ("scale", "zero") if role in enc]
    payload = enc["payload"]
    nb = enc["scale"].shape[-1]
    body = payload.view(torch.uint8).unflatten(-1, (nb, -1))
    return torch.cat([*halves, body], -1)


# --------------------------------------------------------------------------------------------------
# Rotation


def fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """ggml-cpu's fast Walsh-Hadamard transform (``ops.cpp:12256-12328``) of ``x`` ``[..., D]`` in consecutive
    blocks of ``block``, float32: each block times ``1.0f / sqrtf(block)``, then butterflies ``(u + v, u - v)`` of
    span 1, 2, 4, ...; that is ``x @ H / sqrt(block)`` with Sylvester's ``H``, its own inverse."""
    n = torch.tensor(float(block), dtype=torch.float32, device=x.device)
    scaled = x.float().unflatten(-1, (-1, block)) * (1.0 / n.sqrt())
    return hadamard_transform(scaled).flatten(-2)


def key_rotation(head_dim: int) -> int | None:
    """``build_input_k_rot``: the largest power of two >= 64 dividing the head size, None unless it is a multiple of
    64 (``attn_rot_k``)."""
    return head_dim & -head_dim if head_dim % 64 == 0 else None


def value_rotation(head_dim: int) -> int | None:
    """``build_input_v_rot``: 64 for a head size that is a multiple of 64 (``attn_rot_v``), else None."""
    return 64 if head_dim % 64 == 0 else None


def convert_query(q: torch.Tensor, query_type: str, cpu: str = "x86") -> torch.Tensor:
    """The query ``[B, Hq, n, D]`` as flash attention's K dot product reads it, float32: quantized to q8_0/q8_1
    and dequantized (``code * d``), rounded to f16/bf16, or kept (f32; f16 K and V with ``n >= 64``: the tiled
    path). ``query_type``: :data:`VEC_DOT_TYPE` of K's type, or ``"f16_tiled"`` where V is f16 too."""
    q = q.float()
    if query_type in ("q8_0", "q8_1"):
        d, _, codes = quantize_q8(q.unflatten(-1, (-1, BLOCK)), cpu)
        return (codes.float() * d.float()).flatten(-2)
    if query_type == "f16_tiled":
        return q if q.shape[-2] >= FA_TILE_Q else q.half().float()
    return q.to(FLOAT_TYPES[query_type]).float()


# --------------------------------------------------------------------------------------------------
# Codecs


#: The largest |state| each type stores: its fp16 ``d`` (``amax / 127``, ``max / 8``, ...) or ``m`` must stay finite;
#: iq4_nl's fitted ``d`` is at most ``sqrt(32) amax / 127`` (Cauchy-Schwarz with weights x^2).
MAX_ABS = {"q8_0": FP16_MAX * 127, "q4_0": FP16_MAX * 8, "q5_0": FP16_MAX * 16, "q4_1": FP16_MAX,
           "q5_1": FP16_MAX, "iq4_nl": FP16_MAX * 127 / math.sqrt(32), "f16": FP16_MAX,
           "bf16": torch.finfo(torch.bfloat16).max, "f32": FP16_MAX}  # f32: read cast to f16


@dataclass(frozen=True)
class GgmlCodec(Codec):
    """One llama.cpp cache type, rows ``[B, H, T, D]`` stored per token (unit = 1 token). Quantized types:
    ``scale`` ``[B, H, T, D/32]`` fp16 (``d``), ``zero`` the same (``m``, q4_1/q5_1 only), ``payload``
    ``[B, H, T, D/32 * k]`` the rest of each ggml block in its byte order (q8_0: 32 int8 codes; q4_0, q4_1, iq4_nl:
    16 bytes of nibbles; q5_0, q5_1: 4 bytes ``qh`` then 16 of nibbles); :func:`block_bytes` joins them into ggml's
    structs. f32/f16/bf16: ``payload`` the states in that dtype. ``query_type``: how the query meets these keys
    (:func:`convert_query`)."""

    kind: str
    cpu: str = "x86"
    query_type: str = "f32"
    #: ``d`` and ``m`` are the blocks' scale and minimum; f32/f16/bf16 store the format's elements as the payload
    roles = {"payload": StorageRole.PAYLOAD, "scale": StorageRole.SCALE, "zero": StorageRole.SCALE}

    @property
    def max_abs(self) -> float:
        return MAX_ABS[self.kind]

    @property
    def max_abs_reason(self) -> str:
        if self.kind == "f32":
            return "llama.cpp's f32 cache, read by flash attention cast to f16, holds"
        return f"llama.cpp's {self.kind} {'holds' if self.kind in FLOAT_TYPES else 'fp16 block scales can hold'}"

    @property
    def channel_multiple(self) -> tuple[int, str]:
        return (1, "") if self.kind in FLOAT_TYPES else (BLOCK, f"llama.cpp's {self.kind} blocks of 32")

    def encode(self, x):
        if self.kind in FLOAT_TYPES:
            return {"payload": x.float().to(FLOAT_TYPES[self.kind])}
        d, m, codes = QUANTIZE[self.kind](x.float().unflatten(-1, (-1, BLOCK)), self.cpu)
        if self.kind == "q8_0":
            payload = codes
        elif self.kind in ("q5_0", "q5_1"):
            payload = torch.cat([pack_high_bits(codes), pack_ggml_nibbles(codes)], -1)
        else:
            payload = pack_ggml_nibbles(codes)
        enc = {"scale": d.squeeze(-1), "payload": payload.flatten(-2)}
        return enc if m is None else {**enc, "zero": m.squeeze(-1)}

    def decode_into(self, enc, out):
        if self.kind in FLOAT_TYPES:  # f32: stored in 32 bits, read as f16 (READ_AS)
            ops.store_clamped(out, enc["payload"].to(FLOAT_TYPES[READ_AS[self.kind]]).float())
            return
        body = enc["payload"].unflatten(-1, (enc["scale"].shape[-1], -1))
        if self.kind == "q8_0":
            codes = body
        elif self.kind in ("q5_0", "q5_1"):
            codes = unpack_ggml_nibbles(body[..., 4:]) | (unpack_high_bits(body[..., :4]) << 4)
        else:
            codes = unpack_ggml_nibbles(body)
        zero = enc["zero"].unsqueeze(-1) if "zero" in enc else None
        ops.store_clamped(out, dequantize(self.kind, enc["scale"].unsqueeze(-1), zero, codes).flatten(-2))

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """The query as these keys' dot product reads it (:func:`convert_query`), float32."""
        return convert_query(q, self.query_type, self.cpu)


@dataclass(frozen=True)
class AttnRotCodec(WrappingCodec):
    """llama.cpp's automatic rotation around a quantized type: states stored as ``fwht(x, block)`` and read back
    through the same transform (its own inverse), float32 then rounded once to the output's dtype."""

    inner: GgmlCodec
    block: int

    @property
    def max_abs(self) -> float:
        """Beyond this no state fits once rotated (a rotated block keeps its norm: some |y| >= |x| / sqrt(block));
        states below it are rotated and checked in :meth:`check`."""
        return self.inner.max_abs * math.sqrt(self.block)

    def check(self, x, name):
        """States within ``inner.max_abs / sqrt(block)`` fit once rotated (``|y| <= sqrt(block) max|x|``); others
        are rotated to see."""
        limit = self.inner.max_abs / math.sqrt(self.block)
        if x.device.type == "meta" or not x.numel() or float(x.abs().amax()) <= limit:
            return
        reach = float(fwht(x, self.block).abs().amax())
        if not reach <= self.inner.max_abs:
            raise KVQuantError(f"{name} rotated as llama.cpp rotates them (blocks of {self.block}) reach |y| = "
                               f"{reach:.4g}, beyond the ±{self.inner.max_abs:.4g} {self.max_abs_reason}")

    def encode(self, x):
        return self.inner.encode(fwht(x, self.block))

    def decode_into(self, enc, out):
        work = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        self.inner.decode_into(enc, work)
        ops.store_clamped(out, fwht(work, self.block))

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """The query rotated as llama.cpp rotates Q with K, converted, rotated back: float32 ``[B, Hq, n, D]``."""
        return fwht(self.inner.query(fwht(q, self.block)), self.block)


#: K's channel order: ``norm``, llama.cpp's for a Llama-family GGUF; ``neox``, the model's
#: (kvquant.formats.llamacpp_gguf)
ROPE_LAYOUTS = ("norm", "neox")


# --------------------------------------------------------------------------------------------------
# Quantizers: one registered name per cache type, keys and values alike unless key_type/value_type say otherwise


@dataclass(frozen=True)
class LlamaCppQuantizer(Quantizer):
    """llama.cpp's cache ``-ctk key_type -ctv value_type`` (both the registered name's type unless given), with flash
    attention, on the CPU backend. ``attn_rot``: None rotates as llama.cpp does by default (a quantized stream whose
    head size is a multiple of 64); False is ``LLAMA_ATTN_ROT_DISABLE=1``; True is the default behaviour, refused
    where llama.cpp would not rotate. ``cpu``: which build of ggml's q8_0/q8_1 quantizer rounds (x86 AVX, ARM NEON,
    scalar). ``rope_layout``: ``norm`` stores K in the channel order of a Llama-family GGUF (RoPE's pairs adjacent,
    :mod:`kvquant.formats.llamacpp_gguf`), ``neox`` in the model's; unset, ``make_cache(model, ...)`` takes it from the
    model (else ``neox``). Every token is stored when written (``residual_length`` 0), as llama.cpp does."""

    #: the type both streams have unless ``key_type``/``value_type`` say otherwise
    cache_type: ClassVar[str]
    #: its K codecs convert the query (``query``): ``make_cache(model, ...)`` lets the model's attention apply it
    converts_query: ClassVar[bool] = True
    key_type: str | None = None
    value_type: str | None = None
    attn_rot: bool | None = None
    cpu: str = "x86"
    rope_layout: str | None = None

    def __post_init__(self):
        super().__post_init__()
        for field in ("key_type", "value_type"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or value not in CACHE_TYPES):
                raise KVQuantError(f"{self.name}: {field} {value!r} is not a cache type llama.cpp allows "
                                   f"({', '.join(CACHE_TYPES)}; common/arg.cpp kv_cache_types)")
        if self.attn_rot is not None and not isinstance(self.attn_rot, bool):
            raise KVQuantError(f"{self.name}: attn_rot must be true, false or unset (llama.cpp's default), "
                               f"got {self.attn_rot!r}")
        if self.rope_layout is not None and self.rope_layout not in ROPE_LAYOUTS:
            raise KVQuantError(f"{self.name}: rope_layout must be norm (a Llama-family GGUF), neox or unset (the "
                               f"model's, via make_cache), got {self.rope_layout!r}")
        if not isinstance(self.cpu, str) or self.cpu not in CPU_PATHS:
            raise KVQuantError(f"{self.name}: cpu must be one of {', '.join(CPU_PATHS)}, got {self.cpu!r}")

    def for_model(self, model_or_config) -> LlamaCppQuantizer:
        """With ``rope_layout`` the model's (:func:`~kvquant.formats.llamacpp_gguf.rope_layout_of`) where not given."""
        if self.rope_layout is not None:
            return self
        return dataclasses.replace(self, rope_layout=rope_layout_of(model_or_config))

    def types(self) -> tuple[str, str]:
        """The (K, V) cache types."""
        return self.key_type or self.cache_type, self.value_type or self.cache_type

    def rotations(self, head_dim: int) -> tuple[int | None, int | None]:
        """The (K, V) Hadamard block sizes llama.cpp rotates with at this head size (None: not rotated)."""
        quantized = [kind not in FLOAT_TYPES for kind in self.types()]
        if self.attn_rot is False:
            return None, None
        if self.attn_rot and not any(quantized):
            raise KVQuantError(f"{self.name}: attn_rot=True, but llama.cpp rotates only quantized caches, not "
                               f"{'/'.join(self.types())}; leave attn_rot unset")
        if self.attn_rot and head_dim % 64:
            raise KVQuantError(f"{self.name}: attn_rot=True, but llama.cpp rotates only head sizes that are multiples "
                               f"of 64 (src/llama-kv-cache.cpp attn_rot_k/attn_rot_v), not head_dim {head_dim}; "
                               "leave attn_rot unset to store it unrotated, as llama.cpp does")
        return (key_rotation(head_dim) if quantized[0] else None, value_rotation(head_dim) if quantized[1] else None)

    def _codecs(self, head_dim):
        key_type, value_type = self.types()
        key_block, value_block = self.rotations(head_dim)
        read_key, read_value = READ_AS.get(key_type, key_type), READ_AS.get(value_type, value_type)
        query = "f16_tiled" if read_key == read_value == "f16" else VEC_DOT_TYPE[read_key]
        key = GgmlCodec(key_type, self.cpu, query)
        value = GgmlCodec(value_type, self.cpu, VEC_DOT_TYPE[value_type])
        key = AttnRotCodec(key, key_block) if key_block else key
        if self.rope_layout == "norm":
            key = GgufOrderCodec(key, head_dim)
        return (key,
                AttnRotCodec(value, value_block) if value_block else value)

    def derived_settings(self, head_dim: int) -> dict[str, object]:
        key_block, value_block = self.rotations(head_dim)
        key_type, value_type = self.types()
        return {"key_type": key_type, "value_type": value_type, "key_rotation_block": key_block,
                "value_rotation_block": value_block, **super().derived_settings(head_dim)}


def _register(kind: str) -> type:
    """Register ``llamacpp_<kind>``: a frozen dataclass of its own (the registry's rule for every quantizer)."""
    cls = dataclass(frozen=True)(type(f"LlamaCpp_{kind}", (LlamaCppQuantizer,), {
        "__doc__": f"llama.cpp ``-ctk {kind} -ctv {kind}`` (``type_k``/``type_v`` ``{kind}``).",
        "__module__": __name__, "__annotations__": {}, "cache_type": kind}))
    return register_quantizer(f"llamacpp_{kind}")(cls)


for _kind in CACHE_TYPES:
    _register(_kind)
