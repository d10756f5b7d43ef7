"""Flash-decoding attention over the stored form of a layer's keys and values, in Triton.

:func:`attend` computes ``softmax(scaling * q . k_j) @ v_j`` for a few query tokens per row straight from two
:class:`~kvquant.cache.streams.Stream` s (keys, values): a program per (batch row, KV head, block of query rows,
split of the sequence) walks the row's tokens in blocks, reads each token where the stream keeps it (a sink, row
``p % R`` of a pool slot through the row's table, or the tail), dequantizes the packed codes in registers (int:
``zero + code * scale``; fp8: the byte decoded bit by bit times the scale; both in fp32, clamped and rounded to the
model's dtype as the eager dequantized copy is) and folds the block into an online softmax in fp32. The dequantized
history is never written anywhere. With several splits a second kernel merges the partial (max, sum, output) of
each split. GQA: the ``G = Hq / H`` query heads of one KV head (times the ``n`` queries) are the rows of one tile,
so each key and value is read once per KV head (per block of up to 4096 / head_dim such rows).

Triton is optional: nothing here imports it until :func:`attend` (or :func:`triton_importable`) is called. The kernels
are written below as plain functions and wrapped by ``triton.jit`` on first use, once per value of
``TRITON_INTERPRET``, so the interpreter (CPU tests) works whatever imported this module or triton first.
"""

from __future__ import annotations

import math
import os
import types

import torch

from kvquant.formats.roles import StreamKind
from kvquant.cache.streams import Stream

tl = None  # triton.language, bound in the kernels' own namespace by _kernels()
# The stream kinds the kernels compare KIND with (StreamKind's numbers), bound as tl.constexpr in their namespace
KIND_INT, KIND_FULL = int(StreamKind.INT), int(StreamKind.FULL)

_KINDS = ("int", "fp8", "full")
# fp8 formats decoded in the kernel from their bits: exponent bits, mantissa bits, bias
_FP8 = {torch.float8_e4m3fn: (4, 3, 7), torch.float8_e5m2: (5, 2, 15)}


def triton_importable() -> bool:
    """Whether triton can be imported (the kernels still need a GPU, or ``TRITON_INTERPRET=1`` on the CPU)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


# -- kernels (wrapped by triton.jit in _kernels) ------------------------------------------------------------------
# Only builtins of triton.language and the functions below: the @jit helpers of triton's standard library (tl.max,
# tl.sum, tl.zeros...) are wrapped when triton is imported, so they would not run under an interpreter switched on
# after that import (under pytest, transformers imports triton long before a test module can set the variable).
def _max_combine(a, b):
    return tl.maximum(a, b)


def _min_combine(a, b):
    return tl.minimum(a, b)


def _add_combine(a, b):
    return a + b


def _round(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (to nearest, ties to even), kept in fp32. bf16 by its bits: the interpreter's
    own fp32 -> bf16 conversion truncates."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN stays NaN
    elif DTYPE == tl.float16:
        x = x.to(tl.float16).to(tl.float32)
    return x


def _fp8_decode(byte, EXP: tl.constexpr, MAN: tl.constexpr, BIAS: tl.constexpr, SUBNORMAL: tl.constexpr,
                E4M3FN: tl.constexpr):
    """fp8 bit patterns (int32 in [0, 256)) -> their exact fp32 values."""
    sign = byte >> 7
    e = (byte >> MAN) & ((1 << EXP) - 1)
    m = byte & ((1 << MAN) - 1)
    normal = (((e + (127 - BIAS)) << 23) | (m << (23 - MAN))).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * SUBNORMAL, normal)
    if E4M3FN:  # no infinities; S.1111.111 is NaN
        mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    else:  # IEEE-like: exponent all ones is inf (mantissa 0) or NaN
        mag = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), mag)
    return tl.where(sign == 1, -mag, mag)


def _load_tile(payload, pay_n, pay_h, pay_r, pay_d,
               scale, sc_n, sc_h, sc_c,
               zero, ze_n, ze_h, ze_c,
               table, tab_b, tab_u,
               sinks, sink_b, sink_h, sink_s, sink_d,
               tail, tail_b, tail_h, tail_t,
               meta, b, h, tok, tok_ok, d, d_ok,
               KIND: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, TOKEN_AXIS: tl.constexpr,
               R: tl.constexpr, DP: tl.constexpr, LIMIT: tl.constexpr, EXP: tl.constexpr, MAN: tl.constexpr,
               BIAS: tl.constexpr, SUBNORMAL: tl.constexpr, E4M3FN: tl.constexpr):
    """Tokens ``tok`` [BLOCK_N] of row ``b``, KV head ``h`` of one stream, read in the stream's order and
    dequantized: fp32 [BLOCK_N, BLOCK_D] holding values of the model's dtype, zeros where masked."""
    n_sinks = tl.load(meta + b * 4).to(tl.int32)
    skip = tl.load(meta + b * 4 + 1).to(tl.int32)
    units = tl.load(meta + b * 4 + 2).to(tl.int32)
    in_sink = tok < n_sinks
    p = tok - n_sinks + skip  # stored position after the sinks
    quantized = units * R
    in_pool = (p < quantized) & (tok >= n_sinks)
    in_tail = (p >= quantized) & (tok >= n_sinks)
    ok = tok_ok[:, None] & d_ok[None, :]

    # sinks and tail in one load (same dtype; the caller gives both the same head_dim stride)
    sink_row = sinks + b * sink_b + h * sink_h + tl.where(in_sink, tok, 0) * sink_s
    tail_row = tail + b * tail_b + h * tail_h + tl.where(in_tail, p - quantized, 0) * tail_t
    full_row = tl.where(in_sink, sink_row, tail_row)
    x_full = tl.load(full_row[:, None] + d[None, :] * sink_d, mask=ok & (in_sink | in_tail)[:, None], other=0.0)

    pool_ok = tok_ok & in_pool
    pc = tl.where(pool_ok, p, 0)
    slot = tl.load(table + b * tab_b + (pc // R) * tab_u, mask=pool_ok, other=0)  # int64
    slot = tl.where(pool_ok, slot, 0)
    row = pc % R
    base = payload + slot * pay_n + h * pay_h + row * pay_r  # [BLOCK_N] pointers
    m2 = ok & pool_ok[:, None]
    if KIND == KIND_INT:  # min-max integer codes, block-packed along head_dim
        byte = tl.load(base[:, None] + (d % DP)[None, :] * pay_d, mask=m2, other=0).to(tl.int32)
        code = (byte >> ((d // DP) * BITS)[None, :]) & ((1 << BITS) - 1)
        if TOKEN_AXIS:
            ch = d // GROUP
        else:
            ch = d
        s = tl.load(scale + slot[:, None] * sc_n + h * sc_h + ch[None, :] * sc_c, mask=m2, other=0.0)
        z = tl.load(zero + slot[:, None] * ze_n + h * ze_h + ch[None, :] * ze_c, mask=m2, other=0.0)
        x_pool = z.to(tl.float32) + code.to(tl.float32) * s.to(tl.float32)
    elif KIND != KIND_FULL:  # fp8 (e4m3fn or e5m2) bytes times a per-token scale
        byte = tl.load(base[:, None] + d[None, :] * pay_d, mask=m2, other=0).to(tl.int32)
        s = tl.load(scale + slot * sc_n + h * sc_h, mask=pool_ok, other=0.0).to(tl.float32)
        x_pool = _fp8_decode(byte, EXP, MAN, BIAS, SUBNORMAL, E4M3FN) * s[:, None]
    else:  # the model's dtype
        x_pool = tl.load(base[:, None] + d[None, :] * pay_d, mask=m2, other=0.0).to(tl.float32)
    if KIND != KIND_FULL:  # rounded to the model's dtype as the dequantized copy is (clamped to its finite range)
        if LIMIT > 0:
            x_pool = tl.minimum(tl.maximum(x_pool, -LIMIT), LIMIT)
        x_pool = _round(x_pool, sinks.dtype.element_ty)

    x = tl.where(in_pool[:, None], x_pool, x_full.to(tl.float32))
    return tl.where(ok, x, 0.0)


def _attend_kernel(query, q_b, q_h, q_n, q_d,
                   lo, lo_b, lo_n, hi, hi_b, hi_n,
                   out, o_b, o_h, o_n, o_d,
                   part_m, part_l, part_acc,
                   k_payload, k_pay_n, k_pay_h, k_pay_r, k_pay_d,
                   k_scale, k_sc_n, k_sc_h, k_sc_c,
                   k_zero, k_ze_n, k_ze_h, k_ze_c,
                   k_table, k_tab_b, k_tab_u,
                   k_sinks, k_sink_b, k_sink_h, k_sink_s, k_sink_d,
                   k_tail, k_tail_b, k_tail_h, k_tail_t,
                   k_meta,
                   v_payload, v_pay_n, v_pay_h, v_pay_r, v_pay_d,
                   v_scale, v_sc_n, v_sc_h, v_sc_c,
                   v_zero, v_ze_n, v_ze_h, v_ze_c,
                   v_table, v_tab_b, v_tab_u,
                   v_sinks, v_sink_b, v_sink_h, v_sink_s, v_sink_d,
                   v_tail, v_tail_b, v_tail_h, v_tail_t,
                   v_meta,
                   scaling, chunk, splits,
                   D: tl.constexpr, G: tl.constexpr, NQ: tl.constexpr, M_TILES: tl.constexpr, PARTIAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_TOKEN_AXIS: tl.constexpr,
                   K_R: tl.constexpr, K_DP: tl.constexpr, K_EXP: tl.constexpr, K_MAN: tl.constexpr,
                   K_BIAS: tl.constexpr, K_SUBNORMAL: tl.constexpr, K_E4M3FN: tl.constexpr,
                   V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_TOKEN_AXIS: tl.constexpr,
                   V_R: tl.constexpr, V_DP: tl.constexpr, V_EXP: tl.constexpr, V_MAN: tl.constexpr,
                   V_BIAS: tl.constexpr, V_SUBNORMAL: tl.constexpr, V_E4M3FN: tl.constexpr,
                   LIMIT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) // M_TILES
    tile = tl.program_id(1) % M_TILES
    split = tl.program_id(2)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows of this KV head: g * NQ + i
    row_ok = rows < G * NQ
    g = tl.where(row_ok, rows // NQ, 0)
    i = tl.where(row_ok, rows % NQ, 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_ptr = query + b * q_b + (h * G + g)[:, None] * q_h + i[:, None] * q_n + d[None, :] * q_d
    q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    # each query's end, clamped to the tokens the row reads (keys and values read as many)
    k_count = tl.load(k_meta + b * 4 + 2) * K_R + tl.load(k_meta + b * 4) + tl.load(k_meta + b * 4 + 3) \
        - tl.load(k_meta + b * 4 + 1)
    v_count = tl.load(v_meta + b * 4 + 2) * V_R + tl.load(v_meta + b * 4) + tl.load(v_meta + b * 4 + 3) \
        - tl.load(v_meta + b * 4 + 1)
    count = tl.minimum(k_count, v_count).to(tl.int32)
    end = tl.load(hi + b * hi_b + i * hi_n, mask=row_ok, other=0).to(tl.int32)
    end = tl.maximum(tl.minimum(end, count), 0)
    end = tl.where(row_ok, end, 0)
    begin = tl.load(lo + b * lo_b + i * lo_n, mask=row_ok, other=0).to(tl.int32)
    begin = tl.maximum(begin, 0)
    first = tl.reduce(tl.where(row_ok & (begin < end), begin, 2**30), 0, _min_combine)
    stop = tl.minimum((split + 1) * chunk, tl.reduce(end, 0, _max_combine))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for start in range(tl.maximum(split * chunk, first), stop, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        tok_ok = tok < stop
        k = _load_tile(k_payload, k_pay_n, k_pay_h, k_pay_r, k_pay_d, k_scale, k_sc_n, k_sc_h, k_sc_c,
                       k_zero, k_ze_n, k_ze_h, k_ze_c, k_table, k_tab_b, k_tab_u,
                       k_sinks, k_sink_b, k_sink_h, k_sink_s, k_sink_d, k_tail, k_tail_b, k_tail_h, k_tail_t,
                       k_meta, b, h, tok, tok_ok, d, d_ok,
                       K_KIND, K_BITS, K_GROUP, K_TOKEN_AXIS, K_R, K_DP, LIMIT, K_EXP, K_MAN, K_BIAS, K_SUBNORMAL,
                       K_E4M3FN)
        v = _load_tile(v_payload, v_pay_n, v_pay_h, v_pay_r, v_pay_d, v_scale, v_sc_n, v_sc_h, v_sc_c,
                       v_zero, v_ze_n, v_ze_h, v_ze_c, v_table, v_tab_b, v_tab_u,
                       v_sinks, v_sink_b, v_sink_h, v_sink_s, v_sink_d, v_tail, v_tail_b, v_tail_h, v_tail_t,
                       v_meta, b, h, tok, tok_ok, d, d_ok,
                       V_KIND, V_BITS, V_GROUP, V_TOKEN_AXIS, V_R, V_DP, LIMIT, V_EXP, V_MAN, V_BIAS, V_SUBNORMAL,
                       V_E4M3FN)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling
        s = tl.where((tok[None, :] < end[:, None]) & (tok[None, :] >= begin[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: exp(-inf) = 0, no NaN
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.reduce(p, 1, _add_combine)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    if not PARTIAL:
        o = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        o_ptr = out + b * o_b + (h * G + g)[:, None] * o_h + i[:, None] * o_n + d[None, :] * o_d
        tl.store(o_ptr, _round(o, out.dtype.element_ty).to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:  # partials [B, H * M_TILES, splits, BLOCK_M] and [..., BLOCK_D], contiguous
        part = (b * tl.num_programs(1) + tl.program_id(1)) * splits + split
        r = tl.arange(0, BLOCK_M)
        tl.store(part_m + part * BLOCK_M + r, m_i)
        tl.store(part_l + part * BLOCK_M + r, l_i)
        tl.store(part_acc + (part * BLOCK_M + r)[:, None] * BLOCK_D + d[None, :], acc)


def _combine_kernel(part_m, part_l, part_acc,
                    out, o_b, o_h, o_n, o_d, splits,
                    D: tl.constexpr, G: tl.constexpr, NQ: tl.constexpr, M_TILES: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) // M_TILES
    tile = tl.program_id(1) % M_TILES
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * NQ
    g = tl.where(row_ok, rows // NQ, 0)
    i = tl.where(row_ok, rows % NQ, 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    r = tl.arange(0, BLOCK_M)
    first = (b * tl.num_programs(1) + tl.program_id(1)) * splits

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(splits):
        m = tl.maximum(m, tl.load(part_m + (first + s) * BLOCK_M + r))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for s in range(splits):
        w = tl.exp(tl.load(part_m + (first + s) * BLOCK_M + r) - m_use)
        l_sum += w * tl.load(part_l + (first + s) * BLOCK_M + r)
        acc += w[:, None] * tl.load(part_acc + ((first + s) * BLOCK_M + r)[:, None] * BLOCK_D + d[None, :])
    o = tl.where(l_sum[:, None] > 0, acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None], 0.0)
    o_ptr = out + b * o_b + (h * G + g)[:, None] * o_h + i[:, None] * o_n + d[None, :] * o_d
    tl.store(o_ptr, _round(o, out.dtype.element_ty).to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


_JITTED = ("_max_combine", "_min_combine", "_add_combine", "_round", "_fp8_decode", "_load_tile", "_attend_kernel",
           "_combine_kernel")
_BUILT: dict[bool, types.SimpleNamespace] = {}


def _kernels() -> types.SimpleNamespace:
    """The kernels wrapped by ``triton.jit`` in a namespace of their own, once per ``TRITON_INTERPRET`` value
    (``triton.jit`` picks the interpreter when it wraps a function, not when it runs it)."""
    import triton
    import triton.language as language

    try:
        from triton import knobs  # triton >= 3.4

        interpret = bool(knobs.runtime.interpret)
    except ImportError:
        interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    if interpret not in _BUILT:
        scope = {**globals(), "tl": language, "KIND_INT": language.constexpr(KIND_INT),
                 "KIND_FULL": language.constexpr(KIND_FULL)}
        for name in _JITTED:
            raw = globals()[name]
            fn = types.FunctionType(raw.__code__, scope, name, raw.__defaults__, raw.__closure__)
            fn.__module__, fn.__qualname__, fn.__doc__ = raw.__module__, raw.__qualname__, raw.__doc__
            fn.__annotations__ = dict(raw.__annotations__)  # the constexpr markers
            scope[name] = triton.jit(fn)
        _BUILT[interpret] = types.SimpleNamespace(attend=scope["_attend_kernel"], combine=scope["_combine_kernel"])
    return _BUILT[interpret]


# -- launch ---------------------------------------------------------------------------------------------------------
def _meta(s: Stream, device) -> torch.Tensor:
    """``[B, 4]`` int64 on ``device``: n_sinks, skip, units, n_tail per row."""
    return torch.stack([s.n_sinks, s.skip, s.units, s.n_tail], dim=1).to(torch.long).contiguous().to(device)


def _some(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A tensor to hand the kernel as a pointer (never dereferenced when ``t`` is missing or empty)."""
    if t is None or t.numel() == 0:
        return like.new_zeros(1) if like.numel() == 0 else like
    return t


def _stream_args(s: Stream, dtype: torch.dtype, head_dim: int, heads: int, rows: int, device):
    """(pointer/stride arguments, constexpr arguments) for one stream, after checking its layout."""
    if s.kind not in _KINDS:
        raise ValueError(f"unknown stream kind {s.kind!r}")
    if s.sinks.dtype != dtype or s.tail.dtype != dtype:
        raise ValueError(f"sinks/tail are {s.sinks.dtype}/{s.tail.dtype}, the query {dtype}")
    for name in ("sinks", "tail"):
        t = getattr(s, name)
        if t.dim() != 4 or t.shape[0] != rows or t.shape[1] != heads or t.shape[3] != head_dim:
            raise ValueError(f"{name} is {tuple(t.shape)}, expected [{rows}, {heads}, *, {head_dim}]")
    for name in ("n_sinks", "skip", "units", "n_tail"):
        if getattr(s, name).shape != (rows,):
            raise ValueError(f"{name} is {tuple(getattr(s, name).shape)}, expected [{rows}]")
    n, unit = s.payload.shape[0], s.unit
    if s.payload.dim() != 4 or s.payload.shape[1] != heads:
        raise ValueError(f"payload is {tuple(s.payload.shape)}, expected [N, {heads}, R, Dp]")
    if s.table.dim() != 2 or s.table.shape[0] != rows:
        raise ValueError(f"table is {tuple(s.table.shape)}, expected [{rows}, U]")
    bits, group, dp = 8, 1, head_dim
    exp = man = bias = 0
    subnormal, e4m3fn = 0.0, False
    payload = s.payload
    if s.kind == "int":
        bits, group = s.bits, s.group
        if bits not in (2, 4, 8) or (head_dim * bits) % 8:
            raise ValueError(f"cannot read {bits}-bit codes of head_dim {head_dim}")
        dp = head_dim * bits // 8
        channels = head_dim // group if s.token_axis else head_dim
        if s.token_axis and (unit != 1 or head_dim % group):
            raise ValueError(f"token-axis codes need R == 1 and group | head_dim, got R={unit}, group={group}")
        if not s.token_axis and unit != group:
            raise ValueError(f"channel-axis codes need R == group, got R={unit}, group={group}")
        if payload.dtype != torch.uint8 or payload.shape[3] != dp:
            raise ValueError(f"payload is {payload.dtype} {tuple(payload.shape)}, expected uint8 [..., {dp}]")
        for name in ("scale", "zero"):
            t = getattr(s, name)
            if t is None or t.shape != (n, heads, channels):
                raise ValueError(f"{name} is {None if t is None else tuple(t.shape)}, expected [{n}, {heads}, "
                                 f"{channels}]")
    elif s.kind == "fp8":
        if payload.dtype not in _FP8 or payload.shape[2:] != (1, head_dim):
            raise ValueError(f"fp8 payload is {payload.dtype} {tuple(payload.shape)}")
        exp, man, bias = _FP8[payload.dtype]
        subnormal, e4m3fn = 2.0 ** (1 - bias - man), payload.dtype == torch.float8_e4m3fn
        payload = payload.view(torch.uint8)
        if s.scale is None or s.scale.dim() != 3 or s.scale.shape[0] != n or s.scale.shape[1] not in (1, heads):
            raise ValueError(f"fp8 scale is {None if s.scale is None else tuple(s.scale.shape)}, expected "
                             f"[{n}, {heads}, 1]")
    else:
        if payload.dtype != dtype or payload.shape[2:] != (1, head_dim):
            raise ValueError(f"full payload is {payload.dtype} {tuple(payload.shape)}, expected {dtype} "
                             f"[..., 1, {head_dim}]")
    for t in (payload, s.scale, s.zero, s.sinks, s.tail):  # the table may be on the CPU (a Store's is): moved below
        if t is not None and t.numel() and t.device != device:
            raise ValueError(f"stream tensors on {t.device}, the query on {device}")

    def strides(t, dims):
        if t is None or t.numel() == 0:
            return [0] * dims
        return [0 if size == 1 else x for size, x in zip(t.shape[:dims], t.stride()[:dims])]  # size 1: broadcast

    table = s.table.to(device=device, dtype=torch.long)
    sinks, tail = s.sinks, s.tail  # read through one head_dim stride
    if sinks.numel() and tail.numel() and sinks.stride(3) != tail.stride(3):
        sinks, tail = sinks.contiguous(), tail.contiguous()
    channel = (sinks if sinks.numel() else tail).stride(3)
    args = [_some(payload, payload), *strides(payload, 4),
            _some(s.scale, payload), *strides(s.scale, 3),
            _some(s.zero, payload), *strides(s.zero, 3),
            _some(table, table), *strides(table, 2),
            _some(sinks, sinks), *strides(sinks, 3), channel,
            _some(tail, tail), *strides(tail, 3),
            _meta(s, device)]
    kind = int(StreamKind.of(s.kind, s.payload))
    const = [kind, bits, group, bool(s.token_axis), unit, dp, exp, man, bias, subnormal, e4m3fn]
    return args, const


def attend(query: torch.Tensor, key: Stream, value: Stream, hi: torch.Tensor, scaling: float, *,
           lo: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """Attention of ``query`` ``[B, Hq, n, D]`` over the stored keys and values: query ``i`` of row ``b`` attends
    to the row's read tokens ``[0, hi[b, i])`` (``hi`` ``[B, n]``, clamped to the row's count; none: a zero
    output), or ``[lo[b, i], hi[b, i])`` with ``lo`` (sliding windows). Returns ``[B, Hq, n, D]`` in the query's
    dtype: ``softmax(scaling * q . k) @ v`` in fp32. ``Hq`` is a multiple of the streams' ``H`` (query head ``hq``
    uses KV head ``hq // (Hq / H)``). ``splits``: how many parts of the sequence run as separate programs (split-K;
    None: chosen from the GPU's size, 1 on the CPU)."""
    if query.dim() != 4:
        raise ValueError(f"query is {tuple(query.shape)}, expected [B, Hq, n, D]")
    rows, q_heads, n, head_dim = query.shape
    heads = key.sinks.shape[1]
    if heads == 0 or q_heads % heads or value.sinks.shape[1] != heads:
        raise ValueError(f"{q_heads} query heads over {heads} key / {value.sinks.shape[1]} value heads")
    if hi.shape != (rows, n) or (lo is not None and lo.shape != (rows, n)):
        raise ValueError(f"hi/lo are {tuple(hi.shape)}/{None if lo is None else tuple(lo.shape)}, expected "
                         f"[{rows}, {n}]")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"query dtype {query.dtype}")
    counts = key.counts()
    if not torch.equal(counts, value.counts()):
        raise ValueError(f"keys read {counts.tolist()} tokens per row, values {value.counts().tolist()}")
    device, dtype = query.device, query.dtype
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    k_args, k_const = _stream_args(key, dtype, head_dim, heads, rows, device)
    v_args, v_const = _stream_args(value, dtype, head_dim, heads, rows, device)

    group = q_heads // heads
    block_d = max(16, triton_next_power_of_2(head_dim))
    block_m = max(16, min(triton_next_power_of_2(group * n), 4096 // block_d))  # 64 at D 64, 16 at 256
    m_tiles = -(-group * n // block_m)
    block_n = 16  # tokens a step: the gathered K/V tiles' pointers and codes fill the registers (sm_90, cuobjdump)
    most = int(counts.max()) if counts.numel() else 0
    blocks = max(-(-most // block_n), 1)
    if splits is None:
        splits = 1
        if device.type == "cuda":
            programs = rows * heads * m_tiles
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            splits = max(1, min(-(-2 * sms // programs), -(-blocks // 4), 64))  # >= 4 blocks of tokens a split
    splits = max(1, min(int(splits), blocks))
    chunk = -(-blocks // splits) * block_n
    splits = -(-most // chunk) if most else 1

    if splits > 1:
        part_m = torch.empty(rows, heads * m_tiles, splits, block_m, dtype=torch.float32, device=device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(rows, heads * m_tiles, splits, block_m, block_d, dtype=torch.float32, device=device)
    else:
        part_m = part_l = part_acc = torch.empty(1, dtype=torch.float32, device=device)
    limit = 0.0 if dtype == torch.float32 else float(torch.finfo(dtype).max)
    hi_dev = hi.to(device=device, dtype=torch.long)
    lo_dev = hi_dev.new_zeros(1).expand(rows, n) if lo is None else lo.to(device=device, dtype=torch.long)
    # sizes from cuobjdump of sm_90 builds: bf16/fp16 models spill no registers up to head_dim 128
    warps = 4 if block_d <= 64 and block_m <= 32 else 8
    kernels = _kernels()
    kernels.attend[(rows, heads * m_tiles, splits)](
        query, *query.stride(), lo_dev, *lo_dev.stride(), hi_dev, *hi_dev.stride(), out, *out.stride(),
        part_m, part_l, part_acc, *k_args, *v_args, float(scaling), chunk, splits,
        head_dim, group, n, m_tiles, splits > 1, block_m, block_n, block_d, *k_const, *v_const, limit,
        num_warps=warps, enable_fp_fusion=False)  # no fused multiply-add: codes decode as the copy's mul then add
    if splits > 1:
        kernels.combine[(rows, heads * m_tiles)](
            part_m, part_l, part_acc, out, *out.stride(), splits, head_dim, group, n, m_tiles, block_m, block_d,
            num_warps=warps)
    return out


def triton_next_power_of_2(x: int) -> int:
    """The smallest power of two ``>= x`` (as ``triton.next_power_of_2``, without importing triton)."""
    return 1 if x <= 1 else 1 << math.ceil(math.log2(x))
