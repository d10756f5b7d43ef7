"""``rotation="hadamard"``: K and V quantized in a rotated basis along head_dim and rotated back on read."""

import copy

import pytest
import torch
from transformers import DynamicCache

import kvquant
from kvquant.cache import simulate_memory
from kvquant.errors import KVQuantError
from kvquant.formats.ops import hadamard_rotation, rotate, sqnr_db
from kvquant.formats.quantizers import get_quantizer


@pytest.mark.parametrize("head_dim,block", [(64, 64), (80, 16), (96, 32), (112, 16), (128, 128), (256, 256)])
def test_rotation_is_an_orthonormal_signed_block_hadamard(head_dim, block):
    r = hadamard_rotation(head_dim, seed=3)
    assert torch.allclose(r @ r.T, torch.eye(head_dim, dtype=torch.float64), atol=1e-12, rtol=0)
    mask = torch.block_diag(*[torch.ones(block, block)] * (head_dim // block)).bool()
    assert (r[~mask] == 0).all()  # block diagonal
    assert torch.allclose(r[mask].abs(), torch.full((int(mask.sum()),), block**-0.5, dtype=torch.float64))
    assert torch.equal(r, hadamard_rotation(head_dim, seed=3))
    assert not torch.equal(r, hadamard_rotation(head_dim, seed=4))


@pytest.mark.parametrize("head_dim", [64, 80, 96])
def test_identity_with_rotation_round_trips(head_dim):
    """float64 states: to 1e-13, and bit-exact for fp32-valued states at head_dim 64 (entries 1/8, so every
    product and sum is exact in float64); fp32 states: to a few fp32 ulps (the rotated states are rounded once
    to fp32 when stored)."""
    key_codec, _ = get_quantizer("fp16", rotation="hadamard").codecs(head_dim)
    x32 = torch.randn(2, 3, 17, head_dim) * 5
    for x in (torch.randn(2, 3, 17, head_dim, dtype=torch.float64) * 5, x32.double()):
        out = torch.empty_like(x)
        key_codec.decode_into(key_codec.encode(x), out)
        assert (out - x).abs().max() <= 1e-13 * x.abs().max()
    if head_dim == 64:
        assert torch.equal(out, x)
    out32 = torch.empty_like(x32)
    key_codec.decode_into(key_codec.encode(x32), out32)
    assert (out32 - x32).abs().max() <= 8 * torch.finfo(torch.float32).eps * x32.abs().max()


def test_identity_with_rotation_matches_dynamic_cache_through_a_model(model):
    """float64 model: the rotated identity cache gives the logits of DynamicCache (prefill, then decode)."""
    model64 = copy.deepcopy(model).double()
    torch.manual_seed(0)
    ids = torch.randint(3, 500, (2, 40))
    ref_cache, cache = DynamicCache(config=model64.config), kvquant.make_cache(model64, "fp16", rotation="hadamard")
    with torch.no_grad():
        for part in (ids[:, :33], ids[:, 33:34], ids[:, 34:]):
            ref = model64(part, cache=ref_cache, use_cache=True).logits
            got = model64(part, cache=cache, use_cache=True).logits
            assert (got - ref).abs().max() <= 1e-10


def outlier_states(seed=0):
    """``[1, 4, 256, 64]`` states with two outlier channels, as real keys and values have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, 256, 64, generator=g)
    x[..., 5] *= 20
    x[..., 17] += 15
    return x


def round_trip_sqnr(name: str, rotation, stream: int, x: torch.Tensor) -> float:
    """SQNR (dB) of ``x`` through the key (``stream=0``) or value (1) codec of ``name``, groups of 32."""
    codec = get_quantizer(name, group_size=32, rotation=rotation).codecs(64)[stream]
    out = torch.empty_like(x)
    codec.decode_into(codec.encode(x), out)
    return sqnr_db(x, out)


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_rotation_raises_the_sqnr_of_per_token_groups_with_outlier_channels(name):
    sqnr = {r: round_trip_sqnr(name, r, stream=1, x=outlier_states()) for r in (None, "hadamard")}
    assert sqnr["hadamard"] >= sqnr[None] + 3.0, sqnr


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_rotation_does_not_hurt_per_channel_key_groups(name):
    """Per-channel key groups already absorb outlier channels (as the issue's fake-quant measurement found):
    rotation leaves their SQNR about where it was (within 1 dB), never much worse."""
    sqnr = {r: round_trip_sqnr(name, r, stream=0, x=outlier_states(1)) for r in (None, "hadamard")}
    assert sqnr["hadamard"] >= sqnr[None] - 1.0, sqnr


def test_cache_stores_rotated_units_and_reads_them_back(model):
    """Through the cache: quantized units are ``dequant(quant(x @ R)) @ R.T`` (reference built here from the
    unrotated codec), the full-precision residual window is returned untouched, and the bytes are those of the
    unrotated quantizer."""
    x = outlier_states(2)[..., :8].contiguous()  # the tiny model's head_dim 8
    r = hadamard_rotation(8, seed=0)
    cache = kvquant.make_cache(model, "int4", group_size=8, residual_length=5, rotation="hadamard")
    plain = kvquant.make_cache(model, "int4", group_size=8, residual_length=5)
    keys, values = cache.layers[0].update(x, x)
    plain_keys, _ = plain.layers[0].update(x, x)
    key_codec, value_codec = get_quantizer("int4", group_size=8).codecs(8)
    # keys: whole groups of 8 tokens flushed (248), values: every token but the last 5 (251)
    for got, codec, stored in ((keys, key_codec, 248), (values, value_codec, 251)):
        expected = torch.empty_like(x[:, :, :stored])
        codec.decode_into(codec.encode(rotate(x[:, :, :stored], r)), expected)  # rotated as the cache rotates
        expected = (expected.double() @ r.T).float()
        assert torch.allclose(got[:, :, :stored], expected, atol=1e-5, rtol=0)
        assert torch.equal(got[:, :, stored:], x[:, :, stored:])
    assert not torch.allclose(keys[:, :, :248], plain_keys[:, :, :248])
    assert cache.memory_report()["total_bytes"] == plain.memory_report()["total_bytes"]


@pytest.mark.parametrize("name", ["fp16", "fp8_e4m3", "int8", "int4", "int2"])
def test_rotation_keeps_stored_bytes(name):
    settings = {"quantizer": name, "residual_length": 0}
    plain = simulate_memory([None, 16], settings, batch=1, kv_heads=3, head_dim=64, tokens=300)
    rotated = simulate_memory([None, 16], {**settings, "rotation": "hadamard"}, batch=1, kv_heads=3,
                                      head_dim=64, tokens=300)
    assert rotated == plain


@pytest.mark.parametrize("options,needle", [
    ({"rotation": "walsh"}, "rotation must be one of 'hadamard'"),
    ({"rotation": True}, "rotation must be one of 'hadamard'"),
    ({"rotation_seed": -1}, "rotation_seed must be an integer >= 0"),
    ({"rotation_seed": 1.5}, "rotation_seed must be an integer"),
])
def test_bad_rotation_options_are_one_clear_error(model, options, needle):
    with pytest.raises(KVQuantError, match=needle):
        kvquant.make_cache(model, "int4", **options)


def test_settings_name_the_rotation_block(model):
    cache = kvquant.make_cache(model, "int4", rotation="hadamard", rotation_seed=2)
    settings = cache.settings()
    assert settings["rotation"] == "hadamard" and settings["rotation_seed"] == 2
    assert cache.derived_settings()["rotation_block"] == 8


def test_a_single_outlier_channel_fits_once_rotated():
    """One channel at 9000 rotates to 9000/8 per channel (head_dim 64): storable with fp16 scales, although the
    worst case (a whole block's norm in one channel) would not be; beyond what any rotation can fit: refused."""
    key_codec, _ = get_quantizer("int8", rotation="hadamard").codecs(64)
    x = torch.zeros(1, 1, 128, 64)
    x[..., 3] = 9000.0
    out = torch.empty_like(x)
    key_codec.decode_into(key_codec.encode(x), out)
    assert (out - x).abs().max() <= 9000 * 2**-6
    with pytest.raises(KVQuantError, match="rotated states reach"):
        key_codec.encode(torch.full((1, 1, 128, 64), 60000.0))


@pytest.mark.parametrize("dtype,scale_dtype,beyond", [(torch.float32, "float16", "scales and zero points"),
                                                       (torch.float16, "float32", "states' dtype torch.float16")])
@pytest.mark.parametrize("residual_length", [0, 4])
def test_states_that_overflow_once_rotated_are_refused_before_anything_is_stored(residual_length, dtype,
                                                                                  scale_dtype, beyond):
    """60000 in every channel fits the cache's plain check but rotates to 60000 * 8 in one channel, beyond fp16
    scales (float32 states) or fp16 itself (float16 states, float32 scales): refused on arrival (residual 4:
    before it sits in the full-precision tail, whose flush would raise later), and the cache goes on as if the
    refused update had never been made."""
    opts = dict(rotation="hadamard", group_size=4, residual_length=residual_length, scale_dtype=scale_dtype)
    cache, fresh = (kvquant.cache.build_cache([None], "int8", head_dim=64, **opts).layers[0] for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    first, second = (torch.randn(1, 2, n, 64, generator=gen).to(dtype) for n in (8, 4))
    for layer in (cache, fresh):
        layer.update(first, first)
    with pytest.raises(KVQuantError, match=f"rotated keys reach .* beyond the .*{beyond}"):
        cache.update(torch.full((1, 2, 4, 64), 60000.0, dtype=dtype), second)
    assert cache.cumulative_length == 8
    got, want = cache.update(second, second), fresh.update(second, second)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotated_16_bit_states_are_rounded_once(dtype):
    """Read into a 16-bit view: dequantized and rotated back in fp32, rounded to the model's dtype once."""
    key_codec, _ = get_quantizer("int8", rotation="hadamard").codecs(64)
    x = outlier_states(3).to(dtype)
    enc = key_codec.encode(x)
    once = torch.empty(x.shape)
    key_codec.inner.decode_into(enc, once)
    expected = (once @ key_codec.matrix.T.float()).to(dtype)  # as ops.rotate: fp32
    out = torch.empty_like(x)
    key_codec.decode_into(enc, out)
    assert torch.equal(out, expected)


def test_seed_and_extension_point_are_guarded():
    with pytest.raises(KVQuantError, match="rotation_seed must be an integer <= 9223372036854775807"):
        get_quantizer("int4", rotation="hadamard", rotation_seed=2**64)
    from kvquant.formats.quantizers import Quantizer, register_quantizer
    from kvquant.formats.research import IdentityCodec
    from dataclasses import dataclass

    with pytest.raises(KVQuantError, match="define _codecs"):
        @register_quantizer("test_overrides_codecs")
        @dataclass(frozen=True)
        class Legacy(Quantizer):
            def codecs(self, head_dim):
                return IdentityCodec(), IdentityCodec()
