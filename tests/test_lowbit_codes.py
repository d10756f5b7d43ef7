"""The low-bit codebook codec's fast arithmetic (kvquant/formats/lowbit.py, ops.pack_codes): the same codes, scales
and read values, bit for bit, as the formulas it replaced (written out here: codes unpacked one bit at a time, a
bucketize over midpoints computed on each call, the levels indexed code by code), and as a definition that shares
nothing with either (a code counts the midpoints at or below ``x / s``), ties on the midpoints included."""

import math

import pytest
import torch

from transformers import LlamaConfig

import kvquant
from kvquant.errors import KVQuantError
from kvquant.formats import ops
from kvquant.formats.lowbit import CodebookCodec, lloyd_max_gaussian, normal_float
from kvquant.formats.quantizers import RotatedCodec

LEVELS = {"rms": lloyd_max_gaussian, "absmax": normal_float}
HEAD_DIMS = [8, 64, 80, 96, 128]


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor (so -0.0 and 0.0 differ)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def stream_pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The bit stream one bit at a time (the formula before): bit j of code i is bit (i bits + j) % 8 of byte
    (i bits + j) // 8; only each code's low ``bits`` bits are taken."""
    stream = ((q.unsqueeze(-1) >> torch.arange(bits, dtype=torch.uint8)) & 1).flatten(-2).unflatten(-1, (-1, 8))
    return (stream << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def stream_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    stream = (packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return (stream.flatten(-2).unflatten(-1, (-1, bits)) << torch.arange(bits, dtype=torch.uint8)).sum(
        -1, dtype=torch.uint8)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("bits", [3, 5, 6, 7])
def test_stream_packing_is_the_bit_by_bit_layout(bits, head_dim):
    if head_dim * bits % 8:
        pytest.skip("not whole bytes")
    q = torch.randint(0, 256, (3, 2, 5, head_dim), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = ops.pack_codes(q, bits)  # codes of 8 bits: only the low ones are packed
    assert torch.equal(packed, stream_pack(q, bits))
    assert torch.equal(ops.unpack_codes(packed, bits), q & (2**bits - 1))
    assert torch.equal(ops.unpack_codes(packed, bits), stream_unpack(packed, bits))
    with pytest.raises(ValueError, match="whole bytes"):
        ops.pack_codes(q[..., :1], bits)


def old_encode(codec: CodebookCodec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [..., D] uint8, scale [..., 1])`` by the formula before (abs then amax; midpoints on each call)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    if codec.statistic == "rms":
        s = amax * (x / amax.clamp(min=torch.finfo(torch.float32).tiny)).square().mean(-1, keepdim=True).sqrt()
    else:
        s = amax
    scale = s.to(codec.scale_dtype)
    stored = scale.float()
    u = x / torch.where(stored > 0, stored, torch.ones_like(stored))
    levels = codec.levels
    return torch.bucketize(u, (levels[:-1] + levels[1:]) / 2, right=True).to(torch.uint8), scale


def old_decode(codec: CodebookCodec, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The read by the formula before: each code's level times the scale in float32, rounded once to ``dtype``."""
    out = torch.empty(codes.shape, dtype=dtype)
    ops.store_clamped(out, codec.levels[codes.long()] * scale.float())
    return out


def counted_codes(codec: CodebookCodec, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The definition: ``x / s`` (``s`` as stored, 1 where 0) in float32 goes to the cell whose lower end (the
    midpoint below it) is the last at or below it, so a value on a midpoint goes up."""
    s = scale.float()
    u = x.float() / torch.where(s > 0, s, torch.ones_like(s))
    mids = [(float(a) + float(b)) / 2 for a, b in zip(codec.levels[:-1].tolist(), codec.levels[1:].tolist())]
    mids = torch.tensor(mids, dtype=torch.float32)  # float64 sums of float32 neighbours, rounded once: exact
    return (u.unsqueeze(-1) >= mids).sum(-1).to(torch.uint8)


def codecs():
    return [CodebookCodec(LEVELS[statistic](bits).float(), bits, statistic, scale_dtype)
            for statistic in LEVELS for bits in (2, 3, 4) for scale_dtype in (torch.float16, torch.float32)]


def with_ties(codec: CodebookCodec, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random states ``[2, 3, 7, head_dim]`` whose first vector holds midpoints exactly as ``x / s`` (its stored
    scale is 1: a largest |x| of 1 for ``absmax``, an RMS within fp16's rounding of 1 for ``rms``, with the
    midpoints of least |x| that leave room for the rest; a float32 RMS scale is a rounding off 1, so no ties there),
    and a zero vector; and the codes of those midpoints (the level above each)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 7, head_dim, generator=gen) * 4
    mids = (codec.levels[:-1] + codec.levels[1:]) / 2
    order = mids.abs().argsort()
    if codec.statistic == "absmax":
        chosen = order[: head_dim - 1]
        x[0, 0, 0] = torch.cat([mids[chosen], torch.ones(head_dim - len(chosen))])
    else:
        room = (mids[order].double().square().cumsum(0) < head_dim / 2).sum()
        chosen = order[: min(int(room), head_dim - 1)]
        fill = math.sqrt((head_dim - float(mids[chosen].double().square().sum())) / (head_dim - len(chosen)))
        x[0, 0, 0] = torch.cat([mids[chosen], torch.full((head_dim - len(chosen),), fill)])
    x[1, 2, 3] = 0.0
    return x, chosen + 1


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("codec", codecs(), ids=lambda c: f"{c.statistic}{c.bits}-{str(c.scale_dtype)[6:]}")
def test_codebook_codes_scales_and_reads_are_the_old_formula_s_bit_for_bit(codec, head_dim):
    if head_dim % codec.channel_multiple[0]:
        pytest.skip("not whole bytes")
    x, tied = with_ties(codec, head_dim, seed=head_dim + codec.bits)
    enc = codec.encode(x)
    codes, scale = old_encode(codec, x)
    assert bits_of(enc["scale"]).equal(bits_of(scale))
    assert torch.equal(enc["payload"], ops.pack_codes(codes, codec.bits))
    assert torch.equal(ops.unpack_codes(enc["payload"], codec.bits), codes)
    assert torch.equal(codes, counted_codes(codec, x, scale))
    if codec.statistic == "absmax" or codec.scale_dtype == torch.float16:  # a float32 RMS is not exactly 1
        assert scale[0, 0, 0].item() == 1.0 and len(tied) >= min(head_dim - 1, len(codec.levels) - 1) // 2
        assert torch.equal(codes[0, 0, 0, : len(tied)].long(), tied)  # the ties: each midpoint went up
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = torch.full(x.shape, math.nan, dtype=dtype)
        codec.decode_into(enc, out)
        assert bits_of(out).equal(bits_of(old_decode(codec, codes, scale, dtype)))
        assert torch.equal(out[1, 2, 3], torch.zeros(head_dim, dtype=dtype))


def test_reads_into_strided_views_and_through_the_rotation_are_the_old_formula_s():
    """A read into a slice of a larger buffer (the cache's sinks sit before it) and the rotated codec's read."""
    for bits in (2, 3, 4):
        codec = CodebookCodec(lloyd_max_gaussian(bits).float(), bits, "rms")
        x = torch.randn(3, 2, 9, 64, generator=torch.Generator().manual_seed(bits))
        buffer = torch.full((3, 2, 12, 64), math.nan)
        codec.decode_into(codec.encode(x), buffer[:, :, 2:11])
        assert bits_of(buffer[:, :, 2:11]).equal(bits_of(old_decode(codec, *old_encode(codec, x), torch.float32)))
        assert buffer[:, :, :2].isnan().all() and buffer[:, :, 11:].isnan().all()
        rotated = RotatedCodec(codec, ops.hadamard_rotation(64, seed=3))
        out = torch.empty_like(x)
        rotated.decode_into(rotated.encode(x), out)
        y = ops.rotate(x, rotated.matrix)
        assert bits_of(out).equal(bits_of(ops.rotate(old_decode(codec, *old_encode(codec, y), torch.float32),
                                                     rotated.matrix.T)))


def config():
    """One layer of SmolLM2-135M's attention shape: 3 KV heads of head_dim 64."""
    return LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, num_hidden_layers=1,
                       vocab_size=32, intermediate_size=64)


def test_non_finite_states_meet_the_old_formula_and_the_cache_refuses_them():
    """The codec given NaN and Inf directly stores what the formula before stored (the layer refuses them first);
    the cache refuses them and stores nothing."""
    codec = CodebookCodec(lloyd_max_gaussian(4).float(), 4, "rms")
    x = torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(0))
    x[0, 0, 1, 5], x[0, 1, 2, 7], x[0, 1, 3, 0] = math.nan, math.inf, -math.inf
    enc = codec.encode(x)
    codes, scale = old_encode(codec, x)
    assert bits_of(enc["scale"]).equal(bits_of(scale)) and torch.equal(enc["payload"], ops.pack_codes(codes, 4))
    cache = kvquant.make_cache(config(), "lloyd_max", key_bits=3, outliers=1, residual_length=0)
    for bad in (math.nan, math.inf):
        states = torch.randn(1, 3, 8, 64)
        states[0, 1, 4, 9] = bad
        with pytest.raises(KVQuantError, match="NaN or Inf"):
            cache.update(states, torch.randn(1, 3, 8, 64), 0)
        assert cache.get_seq_length() == 0


@pytest.mark.parametrize("name, options", [("lloyd_max", {"key_bits": 4, "value_bits": 3}),
                                           ("normal_float", {"key_bits": 2}),
                                           ("lloyd_max", {"key_bits": 3, "value_bits": 3, "outliers": 1}),
                                           ("lloyd_max", {"key_bits": 3, "value_bits": 2, "sink_tokens": 4})])
def test_a_cache_reads_what_the_old_formula_reads(name, options):
    """Chunked prefill through the cache (rotation, outliers, sinks) against the codecs' read, composed here with
    the formula before for the codebook: equal bit for bit."""
    options = dict(options)
    sinks = options.pop("sink_tokens", 0)
    cache = kvquant.make_cache(config(), name, residual_length=0, sink_tokens=sinks, **options)
    gen = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(2, 3, 48, 64, generator=gen) for _ in range(2))
    for start in range(0, 48, 16):
        got = cache.update(keys[:, :, start : start + 16], values[:, :, start : start + 16], 0)
    for codec, x, read in zip(kvquant.get_quantizer(name, **options).codecs(64), (keys, values), got):
        want = x.clone()
        want[:, :, sinks:] = old_read(codec, x[:, :, sinks:])
        assert bits_of(read).equal(bits_of(want))


def old_read(codec, x: torch.Tensor) -> torch.Tensor:
    """What ``codec`` (a codebook, maybe inside a rotation and outliers) reads for ``x``, with the codebook's
    encode and decode by the formulas before."""
    if isinstance(codec, CodebookCodec):
        return old_decode(codec, *old_encode(codec, x), x.dtype)
    if isinstance(codec, RotatedCodec):
        return ops.rotate(old_read(codec.inner, ops.rotate(x, codec.matrix)), codec.matrix.T)
    index, value, rest = codec._split(x)  # OutlierCodec
    return old_read(codec.inner, rest).scatter(-1, index, value)
