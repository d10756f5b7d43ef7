"""The Triton flash-decoding kernel (kvquant/cache/triton_attend.py) on the CPU under Triton's interpreter,
against attention computed here in float64 over K/V dequantized token by token.

The streams are built here, independently of kvquant's codecs: min-max codes computed and packed by loops in this
file (block layout: the code of channel ``j * Dp + i`` in byte ``i`` at bit ``j * bits``), fp8 through torch's own
casts, pool slots handed out in a shuffled order with spare slots, every byte nobody should read (spare slots, sinks
and tail past each row's count, table entries past each row's units) poisoned with NaN or garbage. One test goes
through kvquant's own Store instead.

Tolerance: the kernel accumulates in fp32 (scores, online softmax, P @ V), the reference in float64 over the same
model-dtype K/V; with |q.k| * scaling of order 1 and O(1) values that leaves errors of a few fp32 ulps, so float32
outputs are held to atol = rtol = 1e-5 (the largest error seen over the matrix is 4.3e-6, a quarter of the bound).
bf16/fp16 outputs are rounded once to their dtype at the end: rtol of one ulp (2**-8, 2**-10) plus the same atol.
A query that sees a single token must return its decoded value bit for bit (check_first).
"""

import dataclasses
import os

import torch

#: Where the kernels run: the CPU under Triton's interpreter (the default), or ``KVQUANT_TEST_DEVICE=cuda``: the same
#: tests compiled on a GPU (experiments/gpu_check.py runs them so). Streams and queries are built on the CPU either
#: way and moved by :func:`attend`.
DEVICE = torch.device(os.environ.get("KVQUANT_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    # Before triton_attend is imported: triton.jit picks the interpreter from this variable when it wraps a
    # function. Under pytest triton is imported earlier anyway (conftest -> transformers imports it), so its
    # standard library's @jit helpers are already compiled-mode functions; triton_attend uses none of them and wraps
    # its own kernels on first use, once per value of this variable, so the interpreter runs them whatever imported
    # triton (or triton_attend) first.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

import kvquant  # noqa: E402
from kvquant.cache import Store  # noqa: E402
from kvquant.cache import triton_attend  # noqa: E402
from kvquant.cache.streams import Stream, stream  # noqa: E402
from slow_cases import slow_where  # noqa: E402

torch.utils.deterministic.fill_uninitialized_memory = True  # as conftest: torch.empty is NaN (255 for uint8)

NAN = float("nan")
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 2.0**-8), torch.float16: (1e-5, 2.0**-10)}


def attend(query: torch.Tensor, key: Stream, value: Stream, hi: torch.Tensor, scaling: float, **kwargs):
    """``triton_attend.attend`` on :data:`DEVICE` (query and stream tensors moved there; the table, per-row counts,
    ``hi`` and ``lo`` stay on the CPU, as a Store keeps them), the output back on the CPU."""
    moved = [dataclasses.replace(s, **{f: getattr(s, f).to(DEVICE) for f in STREAM_TENSORS
                                       if getattr(s, f) is not None}) for s in (key, value)]
    return triton_attend.attend(query.to(DEVICE), *moved, hi, scaling, **kwargs).cpu()


STREAM_TENSORS = ("payload", "scale", "zero", "sinks", "tail")


# -- streams built by hand --------------------------------------------------------------------------------------
def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` codes -> ``[..., D * bits / 8]`` bytes, one channel at a time."""
    d = codes.shape[-1]
    dp = d * bits // 8
    out = torch.zeros(*codes.shape[:-1], dp, dtype=torch.int32)
    for c in range(d):
        j, i = divmod(c, dp)
        out[..., i] |= codes[..., c].to(torch.int32) << (j * bits)
    assert int(out.max()) < 256
    return out.to(torch.uint8)


def fake_int(x: torch.Tensor, bits: int, group: int, token_axis: bool, scale_dtype: torch.dtype):
    """Min-max codes of one unit ``x`` ``[H, R, D]``: (codes ``[H, R, D]``, scale, zero ``[H, C]``, the dequantized
    unit in fp32 ``[H, R, D]``)."""
    heads, unit, d = x.shape
    levels = 2**bits - 1
    if token_axis:  # R == 1, a pair per `group` channels
        grouped = x[:, 0].reshape(heads, d // group, group)
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    else:  # a pair per channel over the unit's R tokens
        lo, hi = x.amin(1), x.amax(1)
    scale = ((hi - lo) / levels).clamp(min=1e-3).to(scale_dtype)
    zero = lo.to(scale_dtype)
    wide = (lambda t: t.float().repeat_interleave(group, -1)[:, None, :]) if token_axis else \
        (lambda t: t.float()[:, None, :])
    codes = ((x - wide(zero)) / wide(scale)).round().clamp(0, levels).to(torch.uint8)
    deq = wide(zero) + codes.float() * wide(scale)
    return codes, scale, zero, deq


class Layout:
    def __init__(self, kind, bits=8, axis="token", group=1, fp8=None, scale_dtype=torch.float16):
        self.kind, self.bits, self.axis, self.group, self.fp8, self.scale_dtype = kind, bits, axis, group, fp8, \
            scale_dtype

    @property
    def unit(self) -> int:
        return self.group if self.kind == "int" and self.axis == "channel" else 1

    def __repr__(self):
        if self.kind == "int":
            return f"int{self.bits}-{self.axis}{self.group}"
        return "full" if self.kind == "full" else str(self.fp8).split("_")[1]


def build(layout: Layout, rows, heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    """A stream of ``rows`` ``(n_sinks, stored after the sinks, skip)``; returns (stream, per row the read tokens
    as the model sees them ``[H, count, D]`` float64, per row the same tokens before quantization)."""
    unit = layout.unit
    split = []  # (units, n_tail) per row
    for b, (_, after, _) in enumerate(rows):
        units = after // unit
        if unit == 1:
            units = max(after - (2 + b), 0)  # a residual window in the tail
        elif b == 0 and units:
            units -= 1  # a tail longer than a unit
        split.append((units, after - units * unit))
    total, spare = sum(u for u, _ in split), 3
    n = total + spare
    order = torch.randperm(n, generator=gen)
    used, unused = order[:total].tolist(), order[total:].tolist()

    if layout.kind == "int":
        dp = head_dim * layout.bits // 8
        channels = head_dim // layout.group if layout.axis == "token" else head_dim
        payload = torch.randint(0, 256, (n, heads, unit, dp), dtype=torch.uint8, generator=gen)
        scale = torch.full((n, heads, channels), NAN, dtype=layout.scale_dtype)
        zero = torch.full((n, heads, channels), NAN, dtype=layout.scale_dtype)
    elif layout.kind == "fp8":
        payload = torch.full((n, heads, 1, head_dim), NAN).to(layout.fp8)
        scale, zero = torch.full((n, heads, 1), NAN, dtype=layout.scale_dtype), None
    else:
        payload, scale, zero = torch.full((n, heads, 1, head_dim), NAN, dtype=dtype), None, None
    batch = len(rows)
    table = torch.full((batch, max(u for u, _ in split) + 2), -1, dtype=torch.long)
    table[0, split[0][0]:] = unused[0]  # past its units a row's table may name any slot (here a poisoned one)
    sinks = torch.full((batch, heads, max(r[0] for r in rows) + 1, head_dim), NAN, dtype=dtype)
    tail = torch.full((batch, heads, max(t for _, t in split) + 1, head_dim), NAN, dtype=dtype)

    seen, raw = [], []
    for b, ((n_sinks, _, skip), (units, n_tail)) in enumerate(zip(rows, split)):
        x_sinks = torch.randn(heads, n_sinks, head_dim, generator=gen)
        sinks[b, :, :n_sinks] = x_sinks.to(dtype)
        after_deq, after_raw = [], []
        for u in range(units):
            slot = used.pop()
            table[b, u] = slot
            x = torch.randn(heads, unit, head_dim, generator=gen) * 2 + 0.5
            if layout.kind == "int":
                codes, s, z, deq = fake_int(x, layout.bits, layout.group, layout.axis == "token", layout.scale_dtype)
                payload[slot], scale[slot], zero[slot] = pack(codes, layout.bits), s, z
            elif layout.kind == "fp8":
                fmax = torch.finfo(layout.fp8).max
                s = (x.abs().amax(-1).amax(-1) / fmax).to(layout.scale_dtype)  # [H], a scale per token and head
                p = (x / s.float()[:, None, None]).clamp(-fmax, fmax).to(layout.fp8)
                payload[slot], scale[slot] = p, s[:, None]
                deq = p.float() * s.float()[:, None, None]
            else:
                payload[slot] = x.to(dtype)
                deq = x
            after_deq.append(deq.to(dtype))
            after_raw.append(x)
        x_tail = torch.randn(heads, n_tail, head_dim, generator=gen)
        tail[b, :, :n_tail] = x_tail.to(dtype)
        after_deq.append(x_tail.to(dtype))
        after_raw.append(x_tail)
        seen.append(torch.cat([sinks[b, :, :n_sinks].double(), torch.cat(after_deq, 1).double()[:, skip:]], 1))
        raw.append(torch.cat([x_sinks.double(), torch.cat(after_raw, 1).double()[:, skip:]], 1))

    long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    st = Stream(kind=layout.kind, payload=payload, scale=scale, zero=zero,
                bits=layout.bits if layout.kind == "int" else (0 if layout.kind == "full" else 8),
                group=layout.group, token_axis=layout.axis == "token", table=table, sinks=sinks, tail=tail,
                n_sinks=long([r[0] for r in rows]), skip=long([r[2] for r in rows]),
                units=long([u for u, _ in split]), n_tail=long([t for _, t in split]))
    assert st.counts().tolist() == [s.shape[1] for s in seen]
    return st, seen, raw


def reference(query: torch.Tensor, keys, values, hi: torch.Tensor, scaling: float, lo=None) -> torch.Tensor:
    """float64 attention of each query over its row's tokens ``[lo, hi)`` (zeros for none)."""
    batch, q_heads, n, d = query.shape
    group = q_heads // keys[0].shape[0]
    out = torch.zeros(batch, q_heads, n, d, dtype=torch.float64)
    for b in range(batch):
        for i in range(n):
            begin, end = 0 if lo is None else int(lo[b, i]), int(hi[b, i])
            if begin >= end:
                continue
            k = keys[b].repeat_interleave(group, 0)[:, begin:end]  # [Hq, end - begin, D]
            v = values[b].repeat_interleave(group, 0)[:, begin:end]
            w = torch.softmax(scaling * torch.einsum("hd,htd->ht", query[b, :, i].double(), k), -1)
            out[b, :, i] = torch.einsum("ht,htd->hd", w, v)
    return out


def queries(counts: list[int], n: int, gen: torch.Generator) -> torch.Tensor:
    """``hi`` ``[B, n]``: per query a random end in [1, count]; the last query of row 0 sees everything, its first
    (with n > 1) only the first token, and the first query of the last row nothing."""
    hi = torch.stack([torch.randint(1, c + 1, (n,), generator=gen) for c in counts])
    hi[0, 0] = 1
    hi[0, -1] = counts[0]
    hi[-1, 0] = 0
    return hi


def check_first(out: torch.Tensor, values, group: int):
    """A query that sees one token gets that token's value exactly (weight exp(0) / 1): the stored form decoded and
    rounded to the model's dtype bit for bit. Row 0 of ROWS starts with a pool token for every layout here."""
    want = values[0][:, 0].repeat_interleave(group, 0).to(out.dtype)
    assert torch.equal(out[0, :, 0], want)


def check(out: torch.Tensor, ref: torch.Tensor):
    atol, rtol = TOL[out.dtype]
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


INT4_K = Layout("int", 4, "channel", 16)
INT4_V = Layout("int", 4, "token", 16, scale_dtype=torch.float32)
LAYOUTS = [
    (INT4_K, INT4_V),  # KIVI
    (Layout("int", 2, "channel", 8, scale_dtype=torch.float32), Layout("int", 2, "token", 16)),
    (Layout("int", 8, "token", 16), Layout("int", 8, "channel", 16)),
    (Layout("int", 2, "token", 8), Layout("int", 4, "channel", 4)),
    (Layout("fp8", fp8=torch.float8_e4m3fn), Layout("fp8", fp8=torch.float8_e5m2, scale_dtype=torch.float32)),
    (Layout("full"), Layout("int", 2, "token", 16)),
    (Layout("int", 4, "channel", 16), Layout("fp8", fp8=torch.float8_e4m3fn)),
]
HEAD_DIMS = [64, 80, 128, 256]
# rows: (n_sinks, tokens stored after the sinks, skip): a plain row, one with sinks and a partly evicted unit, a
# short one that holds no whole channel-axis unit
ROWS = [(0, 37, 0), (2, 70, 5), (1, 9, 0)]
# every layout pair at every head_dim with and without GQA; queries per row and split-K vary along (16 queries of 4
# heads, the interpreter's slowest, only at head_dim 64: one tile of 64 rows; 8 elsewhere: 2 tiles at head_dim 256)
CASES = [(k, v, d, g, (1, 3, 5, 8 if g * d > 256 else 16)[(li + di + gi) % 4], 1 + (li + gi) % 2)
         for li, (k, v) in enumerate(LAYOUTS) for di, d in enumerate(HEAD_DIMS) for gi, g in enumerate((1, 4))]


@pytest.mark.parametrize("key_layout, value_layout, head_dim, group, n, splits",
                         slow_where(CASES, lambda case: case[-1] == 2),
                         ids=[f"{k}-{v}-d{d}-g{g}-n{n}-s{s}" for k, v, d, g, n, s in CASES])
def test_matches_float64_attention_over_the_dequantized_tokens(key_layout, value_layout, head_dim, group, n, splits):
    gen = torch.Generator().manual_seed(head_dim * 7 + group + n)
    heads, dtype = 2, torch.float32
    key, keys, _ = build(key_layout, ROWS, heads, head_dim, dtype, gen)
    value, values, _ = build(value_layout, ROWS, heads, head_dim, dtype, gen)
    query = torch.randn(len(ROWS), heads * group, n, head_dim, generator=gen).to(dtype)
    hi = queries(key.counts().tolist(), n, gen)
    scaling = head_dim**-0.5
    out = attend(query, key, value, hi, scaling, splits=splits)
    assert out.shape == query.shape and out.dtype == dtype
    check(out, reference(query, keys, values, hi, scaling))
    assert torch.equal(out[-1, :, 0], torch.zeros_like(out[-1, :, 0]))  # hi == 0
    if n > 1:
        check_first(out, values, group)


@pytest.mark.parametrize("dtype, key_layout, value_layout, head_dim", [
    (torch.bfloat16, INT4_K, INT4_V, 128),
    (torch.float16, Layout("fp8", fp8=torch.float8_e4m3fn), Layout("int", 2, "token", 16), 80),
    (torch.bfloat16, Layout("full"), Layout("fp8", fp8=torch.float8_e5m2), 64),
])
def test_half_dtypes_round_the_dequantized_tokens_to_the_model_dtype(dtype, key_layout, value_layout, head_dim):
    gen = torch.Generator().manual_seed(3)
    heads, group, n = 2, 2, 4
    key, keys, _ = build(key_layout, ROWS, heads, head_dim, dtype, gen)
    value, values, _ = build(value_layout, ROWS, heads, head_dim, dtype, gen)
    query = torch.randn(len(ROWS), heads * group, n, head_dim, generator=gen).to(dtype)
    hi = queries(key.counts().tolist(), n, gen)
    out = attend(query, key, value, hi, 0.1, splits=2)
    assert out.dtype == dtype
    check(out, reference(query, keys, values, hi, 0.1))
    check_first(out, values, group)


def test_split_k_merges_to_the_single_pass_result():
    gen = torch.Generator().manual_seed(5)
    rows = [(1, 150, 3), (0, 100, 0)]
    key, keys, _ = build(INT4_K, rows, 1, 64, torch.float32, gen)
    value, values, _ = build(INT4_V, rows, 1, 64, torch.float32, gen)
    query = torch.randn(2, 2, 2, 64, generator=gen)
    hi = torch.tensor([[148, 40], [0, 100]])
    outs = [attend(query, key, value, hi, 0.125, splits=s) for s in (1, 3, 5)]
    ref = reference(query, keys, values, hi, 0.125)
    for out in outs:
        check(out, ref)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("splits", [1, 3])
def test_sliding_windows_read_from_lo_to_hi(splits):
    gen = torch.Generator().manual_seed(17)
    rows = [(2, 90, 5), (0, 60, 0)]
    key, keys, _ = build(Layout("int", 2, "channel", 16), rows, 2, 64, torch.float32, gen)
    value, values, _ = build(Layout("fp8", fp8=torch.float8_e4m3fn), rows, 2, 64, torch.float32, gen)
    query = torch.randn(2, 4, 4, 64, generator=gen)
    hi = torch.tensor([[87, 80, 40, 3], [60, 60, 10, 60]])
    lo = torch.tensor([[80, 1, 39, 0], [0, 60, 2, 33]])  # a window inside one block, across blocks, empty, ...
    out = attend(query, key, value, hi, 0.125, lo=lo, splits=splits)
    check(out, reference(query, keys, values, hi, 0.125, lo))
    assert torch.equal(out[1, :, 1], torch.zeros_like(out[1, :, 1]))  # lo == hi


def test_the_codes_are_read_not_the_unquantized_states():
    """int2 keys and values: the kernel agrees with attention over the dequantized codes and is far from attention
    over the states before quantization (a kernel reading anything else would not be)."""
    gen = torch.Generator().manual_seed(11)
    rows = [(0, 48, 0), (1, 33, 2)]
    key, keys, raw_keys = build(Layout("int", 2, "channel", 16), rows, 2, 64, torch.float32, gen)
    value, values, raw_values = build(Layout("int", 2, "token", 16), rows, 2, 64, torch.float32, gen)
    query = torch.randn(2, 2, 3, 64, generator=gen) * 3
    hi = torch.tensor([[48, 30, 17], [35, 35, 9]])
    out = attend(query, key, value, hi, 0.125)
    check(out, reference(query, keys, values, hi, 0.125))
    unquantized = reference(query, raw_keys, raw_values, hi, 0.125)
    assert (out.double() - unquantized).abs().max() > 0.05
    # one code of one read slot flipped: the output moves
    slot = int(value.table[0, 10])
    payload = value.payload.clone()
    payload[slot, 0, 0, 0] ^= 0b11
    flipped = attend(query, key, dataclasses.replace(value, payload=payload), hi, 0.125)
    assert not torch.equal(flipped[0, 0], out[0, 0]) and torch.equal(flipped[:, 1], out[:, 1])


def test_streams_with_no_pool():
    """Nothing quantized yet (pool of 0 slots, table of 0 columns): sinks and tail only."""
    gen = torch.Generator().manual_seed(2)
    sinks, tail = torch.randn(2, 1, 2, 64, generator=gen), torch.randn(2, 1, 5, 64, generator=gen)
    st = Stream(kind="int", payload=torch.empty(0, 1, 16, 32, dtype=torch.uint8), scale=torch.empty(0, 1, 64),
                zero=torch.empty(0, 1, 64), bits=4, group=16, token_axis=False,
                table=torch.empty(2, 0, dtype=torch.long), sinks=sinks, tail=tail, n_sinks=torch.tensor([2, 0]),
                skip=torch.tensor([0, 1]), units=torch.tensor([0, 0]), n_tail=torch.tensor([5, 4]))
    seen = [torch.cat([sinks[0], tail[0]], 1).double(), tail[1, :, 1:4].double()]
    query = torch.randn(2, 1, 2, 64, generator=gen)
    hi = torch.tensor([[7, 1], [3, 0]])
    check(attend(query, st, st, hi, 0.125), reference(query, seen, seen, hi, 0.125))


def test_decoded_values_beyond_the_model_dtype_are_clamped_to_its_range():
    """fp16 model, fp32 scales: ``zero + code * scale`` past ±65504 comes back clamped (as the eager copy's
    ops.store_clamped does), not as inf."""
    codes = (torch.arange(64) % 16).to(torch.uint8)
    scale = torch.tensor([1000.0, 1000.0])
    zero = torch.tensor([60000.0, -80000.0])  # channels 0..31 reach +75000, 32..63 start at -80000
    deq = (zero.repeat_interleave(32) + codes.float() * scale.repeat_interleave(32)).clamp(-65504, 65504)
    none = torch.zeros(1, 1, 0, 64, dtype=torch.float16)
    value = Stream(kind="int", payload=pack(codes, 4)[None, None, None], scale=scale[None, None], zero=zero[None, None],
                   bits=4, group=32, token_axis=True, table=torch.tensor([[0]]), sinks=none, tail=none,
                   n_sinks=torch.tensor([0]), skip=torch.tensor([0]), units=torch.tensor([1]), n_tail=torch.tensor([0]))
    key = Stream(kind="full", payload=torch.empty(0, 1, 1, 64, dtype=torch.float16), scale=None, zero=None, bits=0,
                 group=1, token_axis=True, table=torch.empty(1, 0, dtype=torch.long), sinks=none,
                 tail=torch.randn(1, 1, 1, 64).half(), n_sinks=torch.tensor([0]), skip=torch.tensor([0]),
                 units=torch.tensor([0]), n_tail=torch.tensor([1]))
    out = attend(torch.randn(1, 1, 1, 64).half(), key, value, torch.tensor([[1]]), 0.125)
    assert torch.equal(out[0, 0, 0], deq.half()) and out.isfinite().all()


def test_rejects_streams_of_different_counts():
    gen = torch.Generator().manual_seed(0)
    key, _, _ = build(INT4_K, [(0, 20, 0)], 1, 64, torch.float32, gen)
    value, _, _ = build(INT4_V, [(0, 21, 0)], 1, 64, torch.float32, gen)
    with pytest.raises(ValueError, match="tokens per row"):
        attend(torch.randn(1, 1, 1, 64), key, value, torch.tensor([[5]]), 1.0)


# -- through kvquant's own Store ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, options, head_dim, dtype", [
    ("int4", {"group_size": 16}, 64, torch.float32),
    ("int2", {"group_size": 16, "key_axis": "token", "value_axis": "channel"}, 80, torch.float32),
    ("int8", {"group_size": 16, "scale_dtype": "float32"}, 128, torch.bfloat16),
    ("fp8_e4m3", {}, 64, torch.float32),
    ("fp8_e5m2", {}, 96, torch.float16),
    ("fp16", {}, 64, torch.float32),
])
def test_matches_store_read_then_eager_attention(name, options, head_dim, dtype):
    rows, heads, group, n = 3, 2, 2, 3
    gen = torch.Generator().manual_seed(head_dim)
    key_codec, value_codec = kvquant.get_quantizer(name, **options).codecs(head_dim)
    like = torch.zeros(rows, heads, 0, head_dim, dtype=dtype)
    stores = [Store(codec, 2, 4, like, rows) for codec in (key_codec, value_codec)]
    for steps in ([19, 40, 7], [1, 1, 1], [30, 0, 5], [1, 1, 1]):  # rows of different lengths, then decode steps
        width = max(steps)
        for s in stores:
            x = torch.randn(rows, heads, width, head_dim, generator=gen).to(dtype)
            for r, c in enumerate(steps):
                x[r, :, c:] = 0
            s.append(x, steps)
    stored = [stores[0].stored_tokens(r) for r in range(rows)]
    assert stored == [stores[1].stored_tokens(r) for r in range(rows)]
    counts = [stored[0], stored[1] - 5, stored[2] - 1]  # row 1 starts inside a key group, past its sinks
    key, value = stream(stores[0], counts), stream(stores[1], counts)
    assert key.counts().tolist() == counts == value.counts().tolist()
    seen = []
    for s in stores:
        out = torch.full((rows, heads, max(counts), head_dim), NAN, dtype=dtype)
        real = torch.arange(max(counts))[None, :] < torch.tensor(counts)[:, None]
        s.read(out, real, counts)
        seen.append([out[r, :, :c].double() for r, c in enumerate(counts)])
    query = torch.randn(rows, heads * group, n, head_dim, generator=gen).to(dtype)
    hi = queries(counts, n, gen)
    out = attend(query, key, value, hi, head_dim**-0.5, splits=2)
    check(out, reference(query, seen[0], seen[1], hi, head_dim**-0.5))
