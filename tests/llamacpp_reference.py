"""References for tests/test_llamacpp.py, written from the C code of the llama.cpp that llama-cpp-python 0.3.36
vendors, one block at a time with numpy float32 scalars, sharing no code with ``kvquant/formats/llamacpp.py``:

- ``quantize_row_q4_0_ref`` ... ``quantize_row_q5_1_ref``, ``quantize_row_q8_0_ref`` and ``dequantize_row_*``
  (ggml/src/ggml-quants.c); x86's and ARM's ``quantize_row_q8_0`` (ggml/src/ggml-cpu/arch/{x86,arm}/quants.c);
- iq4_nl's ``quantize_row_iq4_nl_impl`` with ``ntry = -1`` and ``best_index_int8`` (ggml-quants.c);
- ggml-cpu's fast Walsh-Hadamard transform (ggml-cpu/ops.cpp ``ggml_compute_forward_fwht_impl``) and
  ``ggml_gen_hadamard`` (src/llama-kv-cache.cpp);
- the query as flash attention's K dot product reads it (ggml-cpu/ops.cpp, flash_attn_ext one_chunk / tiled).

Blocks come out as ggml's block structs, byte for byte.
"""

import math

import numpy as np
import torch

from reference import Spec

F32 = np.float32
KVALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


# --- references: one block of 32 float32 values -> ggml's block bytes (and back) ---------------------------


def half(v) -> bytes:
    return np.array([v], dtype=F32).astype("<f2").tobytes()


def unhalf(b: bytes) -> F32:
    return F32(np.frombuffer(b, dtype="<f2")[0])


def first_absmax(x):
    """``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }``"""
    amax, top = F32(0), F32(0)
    for v in x:
        if amax < abs(v):
            amax, top = F32(abs(v)), v
    return amax, top


def recip(d):
    return F32(F32(1) / d) if d != 0 else F32(0)


def ref_q8_0(x, cpu):
    amax = F32(0)
    for v in x:
        amax = max(amax, F32(abs(v)))
    d = F32(amax / F32(127))
    if cpu == "x86":  # arch/x86/quants.c: id = 127/amax, _mm256_round_ps(_MM_ROUND_NEAREST)
        inverse = F32(F32(127) / amax) if amax != 0 else F32(0)
    else:
        inverse = recip(d)
    codes = []
    for v in x:
        t = F32(v * inverse)
        codes.append(int(np.rint(t)) if cpu in ("x86", "arm") else int(math.copysign(math.floor(abs(t) + 0.5), t)))
    return half(d) + np.array(codes, dtype=np.int8).tobytes(), codes


def ref_symmetric(x, half_range):
    """quantize_row_q4_0_ref (half_range 8) / quantize_row_q5_0_ref (16)."""
    _, top = first_absmax(x)
    d = F32(top / F32(-half_range))
    inverse = recip(d)
    codes = [min(2 * half_range - 1, int(F32(F32(v * inverse) + F32(half_range + 0.5)))) for v in x]
    return d, None, codes


def ref_asymmetric(x, levels):
    """quantize_row_q4_1_ref (15) / quantize_row_q5_1_ref (31, no MIN: a (uint8_t) cast)."""
    low, high = F32(np.finfo(F32).max), F32(-np.finfo(F32).max)
    for v in x:
        low = v if v < low else low
        high = v if v > high else high
    d = F32(F32(high - low) / F32(levels))
    inverse = recip(d)
    codes = [int(F32(F32(F32(v - low) * inverse) + F32(0.5))) for v in x]
    codes = [min(15, c) for c in codes] if levels == 15 else [c & 0xFF for c in codes]
    return d, low, codes


def best_index(x):
    """best_index_int8(16, kvalues_iq4nl, x), its binary search as written."""
    if x <= KVALUES[0]:
        return 0
    if x >= KVALUES[15]:
        return 15
    lo, hi = 0, 15
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < KVALUES[mid]:
            hi = mid
        else:
            lo = mid
    return hi - 1 if F32(x - F32(KVALUES[hi - 1])) < F32(F32(KVALUES[hi]) - x) else hi


def ref_iq4_nl(x):
    """quantize_row_iq4_nl_impl(32, 32, ..., quant_weights NULL, ntry -1); codes None where ggml leaves stale ones."""
    amax, top = F32(0), F32(0)
    for v in x:
        if F32(abs(v)) > amax:
            amax, top = F32(abs(v)), v
    if amax < F32(1e-15):
        return F32(0), None, None
    d = F32(top / F32(-127))
    inverse = F32(F32(1) / d)
    sum_qx, sum_q2, codes = F32(0), F32(0), []
    for v in x:
        code = best_index(F32(inverse * v))
        codes.append(code)
        q, w = F32(KVALUES[code]), F32(v * v)
        sum_qx = F32(sum_qx + F32(F32(w * q) * v))
        sum_q2 = F32(sum_q2 + F32(F32(w * q) * q))
    return (F32(sum_qx / sum_q2) if sum_q2 > 0 else F32(0)), None, codes


def nibbles(codes) -> bytes:
    return bytes((codes[j] & 0xF) | ((codes[j + 16] & 0xF) << 4) for j in range(16))


def ref_block(kind, x, cpu="x86"):
    """ggml's block bytes for 32 float32 values, and the codes (None where unspecified)."""
    if kind == "q8_0":
        return ref_q8_0(x, cpu)
    d, m, codes = {"q4_0": lambda: ref_symmetric(x, 8), "q5_0": lambda: ref_symmetric(x, 16),
                   "q4_1": lambda: ref_asymmetric(x, 15), "q5_1": lambda: ref_asymmetric(x, 31),
                   "iq4_nl": lambda: ref_iq4_nl(x)}[kind]()
    head = half(d) + (half(m) if m is not None else b"")
    if codes is None:
        return head, None
    qh = b""
    if kind in ("q5_0", "q5_1"):
        word = 0
        for j in range(16):
            word |= ((codes[j] & 0x10) >> 4) << j
            word |= ((codes[j + 16] & 0x10) >> 4) << (j + 16)
        qh = word.to_bytes(4, "little")
    return head + qh + nibbles(codes), codes


def ref_dequantize(kind, block: bytes):
    """dequantize_row_* for one block's bytes."""
    d = unhalf(block[:2])
    if kind == "q8_0":
        return [F32(F32(int(c)) * d) for c in np.frombuffer(block[2:], dtype=np.int8)]
    m = unhalf(block[2:4]) if kind in ("q4_1", "q5_1") else None
    rest = block[4:] if m is not None else block[2:]
    qh = int.from_bytes(rest[:4], "little") if kind in ("q5_0", "q5_1") else 0
    qs = rest[4:] if kind in ("q5_0", "q5_1") else rest
    out = [None] * 32
    for j in range(16):
        for pos, nibble, high in ((j, qs[j] & 0xF, ((qh >> j) << 4) & 0x10),
                                  (j + 16, qs[j] >> 4, (qh >> (j + 12)) & 0x10)):
            if kind == "iq4_nl":
                out[pos] = F32(d * F32(KVALUES[nibble]))
            elif m is None:
                out[pos] = F32(F32((nibble | high) - (8 if kind == "q4_0" else 16)) * d)
            else:
                out[pos] = F32(F32(F32(nibble | high) * d) + m)
    return out


def ref_fwht(row, n):
    """ggml_compute_forward_fwht_impl on one row of n: scale by 1.0f/sqrtf(n), then butterflies of span 1, 2, ..."""
    scale = F32(F32(1) / np.sqrt(F32(n)))
    y = [F32(v * scale) for v in row]
    span = 1
    while span < n:
        for i in range(0, n, 2 * span):
            for j in range(span):
                u, v = y[i + j], y[i + span + j]
                y[i + j], y[i + span + j] = F32(u + v), F32(u - v)
        span *= 2
    return y


def rotated(row, block):
    if block is None:
        return list(row)
    return [v for start in range(0, len(row), block) for v in ref_fwht(row[start : start + block], block)]


def gen_hadamard(n):
    """ggml_gen_hadamard (src/llama-kv-cache.cpp), as a float32 matrix."""
    h = np.zeros((n, n), dtype=F32)
    h[0, 0] = F32(1.0 / float(np.sqrt(F32(n))))
    s = 1
    while s < n:
        h[s : 2 * s, :s], h[:s, s : 2 * s], h[s : 2 * s, s : 2 * s] = h[:s, :s], h[:s, :s], -h[:s, :s]
        s *= 2
    return h


def ref_query_row(row, query_type, block, n_rows, cpu="x86"):
    y = rotated(row, block)
    if query_type in ("q8_0", "q8_1"):  # q8_1's codes and d are q8_0's (quantize_row_q8_1, arch/x86/quants.c)
        values = []
        for b in range(len(y) // 32):
            values += ref_dequantize("q8_0", ref_q8_0(y[b * 32 : b * 32 + 32], cpu)[0])
    elif query_type == "f16" and n_rows < 64:
        values = [F32(np.float16(v)) for v in y]
    else:
        values = y
    return rotated(values, block)


def reference_spec(kind: str, block, cpu="x86") -> Spec:
    """Fake-quant reference of one stream: rotate, ggml blocks, dequantize, rotate back (this file's references)."""
    def apply(body: torch.Tensor) -> torch.Tensor:
        flat = body.reshape(-1, body.shape[-1]).float().numpy().astype(F32)
        out = []
        for row in flat:
            y = rotated(row, block)
            values = []
            for b in range(len(y) // 32):
                values += ref_dequantize(kind, ref_block(kind, y[b * 32 : b * 32 + 32], cpu)[0])
            out.append(rotated(values, block))
        return torch.tensor(np.array(out, dtype=F32)).reshape(body.shape) if len(flat) else body
    return Spec("fn", fn=apply)


def reference_attention(kind_query: str, block):
    """An attention implementation (registered under a test name) converting the query with this file's reference
    before sdpa."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    def attend(module, query, key, value, attention_mask, **kwargs):
        flat = query.reshape(-1, query.shape[-1]).numpy().astype(F32)
        converted = np.array([ref_query_row(r, kind_query, block, query.shape[2]) for r in flat], dtype=F32)
        query = torch.tensor(converted).reshape(query.shape)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    name = f"test_llamacpp_{kind_query}_{block}"
    AttentionInterface.register(name, attend)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name


def nearest_int(fval) -> int:
    """ggml-quants.c ``nearest_int``: ``fval + 12582912.f``, the float's low 23 bits minus 0x400000."""
    val = np.array([F32(fval) + F32(12582912.0)], dtype=F32)
    return int((int(val.view(np.int32)[0]) & 0x007FFFFF) - 0x00400000)


def ref_q8_k(x):
    """quantize_row_q8_K_ref on one block of 256, then ``code * d``: the values a K-quant matmul reads."""
    amax, top = first_absmax(x)
    if not amax:
        return [F32(0)] * len(x)
    iscale = F32(F32(-127) / top)
    d = F32(F32(1) / iscale)
    return [F32(F32(min(127, nearest_int(F32(iscale * v)))) * d) for v in x]
