"""The registry and the codecs, on real K/V from stories260K."""

from dataclasses import dataclass

import pytest
import torch

import kvquant
from kvquant.formats.ops import sqnr_db
from kvquant.formats.quantizers import QUANTIZERS, Quantizer, RotatedCodec, register_quantizer
from kvquant.formats.research import IdentityCodec

#: SQNR floors in dB on the real keys and values of stories260K (measured minima: int8 54/50, int4 29/26,
#: int2 15/12, fp8_e4m3 36/34, fp8_e5m2 30/25 for keys/values).
SQNR_FLOOR = {"int8": 45, "int4": 22, "int2": 10, "fp8_e4m3": 30, "fp8_e5m2": 22}


def test_registry_lists_the_quantizers():
    assert set(kvquant.available_quantizers()) >= {"fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2"}


def test_unknown_quantizer_lists_valid_names():
    with pytest.raises(kvquant.KVQuantError, match="unknown quantizer 'int3'.*fp16.*int4"):
        kvquant.get_quantizer("int3")


def test_unsupported_option_is_named():
    with pytest.raises(kvquant.KVQuantError, match="'fp8_e4m3' has no option 'group_size'"):
        kvquant.get_quantizer("fp8_e4m3", group_size=32)
    with pytest.raises(kvquant.KVQuantError, match="key_bits must be 2, 4 or 8"):
        kvquant.get_quantizer("int4", key_bits=3)
    with pytest.raises(kvquant.KVQuantError, match="group_size"):
        kvquant.get_quantizer("int4", group_size=0)
    with pytest.raises(kvquant.KVQuantError, match="scale_dtype"):
        kvquant.get_quantizer("int8", scale_dtype="bfloat16")


def test_group_size_must_fit_head_dim():
    with pytest.raises(kvquant.KVQuantError, match="group_size 3 does not divide head_dim 8"):
        kvquant.get_quantizer("int4", group_size=3).codecs(8)
    with pytest.raises(kvquant.KVQuantError, match="head_dim 6 cannot be packed 4"):
        kvquant.get_quantizer("int2").codecs(6)


def test_mixed_key_value_bits():
    key_codec, value_codec = kvquant.get_quantizer("int4", key_bits=8).codecs(8)
    assert (key_codec.bits, value_codec.bits) == (8, 4)
    assert (key_codec.axis, value_codec.axis) == ("channel", "token")
    swapped = kvquant.get_quantizer("int4", key_axis="token", value_axis="channel").codecs(8)
    assert (swapped[0].axis, swapped[1].axis) == ("token", "channel")


def test_a_new_quantizer_is_one_class_and_one_decorator():
    @register_quantizer("test_identity")
    @dataclass(frozen=True)
    class TestIdentity(Quantizer):
        def _codecs(self, head_dim):
            return IdentityCodec(), IdentityCodec()

    try:
        assert "test_identity" in kvquant.available_quantizers()
        assert isinstance(kvquant.get_quantizer("test_identity"), TestIdentity)
        rotated = kvquant.get_quantizer("test_identity", rotation="hadamard").codecs(16)  # rotation comes free
        assert all(isinstance(c, RotatedCodec) and isinstance(c.inner, IdentityCodec) for c in rotated)
        with pytest.raises(kvquant.KVQuantError, match="already registered"):
            register_quantizer("test_identity")(TestIdentity)
    finally:
        del QUANTIZERS.classes["test_identity"]


def _read(codec, x):
    out = torch.empty_like(x)
    codec.decode_into(codec.encode(x), out)
    assert out.shape == x.shape and out.dtype == x.dtype
    return out


def _sqnr(codec, x):
    return sqnr_db(x, _read(codec, x))


@pytest.mark.parametrize("name", sorted(SQNR_FLOOR))
def test_sqnr_floor_on_real_kv(name, real_kv):
    options = {"group_size": 32} if name.startswith("int") else {}  # 320 tokens: whole key groups
    key_codec, value_codec = kvquant.get_quantizer(name, **options).codecs(8)
    for keys, values in real_kv:
        assert _sqnr(key_codec, keys) >= SQNR_FLOOR[name]
        assert _sqnr(value_codec, values) >= SQNR_FLOOR[name]


def test_identity_is_lossless(real_kv):
    key_codec, _ = kvquant.get_quantizer("fp16").codecs(8)
    assert _sqnr(key_codec, real_kv[0][0]) == float("inf")


@pytest.mark.parametrize("stream", [0, 1])
def test_error_grows_as_bits_shrink_for_keys_and_values(stream, real_kv):
    sqnr = {}
    for name in ("int8", "int4", "int2"):
        codec = kvquant.get_quantizer(name, group_size=32).codecs(8)[stream]
        sqnr[name] = min(_sqnr(codec, kv[stream]) for kv in real_kv)
    assert sqnr["int8"] > sqnr["int4"] + 15 > sqnr["int2"] + 25


def test_fp32_scales_are_more_precise_and_twice_the_bytes(real_kv):
    keys = real_kv[0][0]
    f16, f32 = (kvquant.get_quantizer("int8", group_size=32, scale_dtype=d).codecs(8)[0]
                for d in ("float16", "float32"))
    assert f32.encode(keys)["scale"].element_size() == 2 * f16.encode(keys)["scale"].element_size()
    assert _sqnr(f32, keys) >= _sqnr(f16, keys) - 0.5


@pytest.mark.parametrize("options, message", [
    ({"group_size": True}, "group_size must be an integer >= 1, got bool"),
    ({"group_size": 32.0}, "group_size must be an integer >= 1, got float"),
    ({"key_bits": 4.0}, "key_bits must be an integer, got float"),
    ({"value_bits": "4"}, "value_bits must be an integer, got str"),
    ({"key_axis": "row"}, "key_axis must be one of 'token', 'channel'"),
    ({"scale_dtype": None}, "scale_dtype must be one of"),
])
def test_option_types_are_checked(options, message):
    with pytest.raises(kvquant.KVQuantError, match=message):
        kvquant.get_quantizer("int4", **options)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 112, 128, 256])
def test_default_groups_fit_every_common_head_dim(name, head_dim):
    quantizer = kvquant.get_quantizer(name)
    default = 128 if name == "int8" else 32
    expected = max(d for d in range(1, default + 1) if head_dim % d == 0)
    key_codec, value_codec = quantizer.codecs(head_dim)
    assert (key_codec.group, value_codec.group) == (default, expected)
    assert quantizer.derived_settings(head_dim) == {"key_group": default, "value_group": expected}


def test_an_explicit_group_that_does_not_fit_is_an_error():
    with pytest.raises(kvquant.KVQuantError, match="group_size 32 does not divide head_dim 80.*e.g. 20"):
        kvquant.get_quantizer("int4", group_size=32).codecs(80)
    assert kvquant.get_quantizer("int4", group_size=256).codecs(80)[1].group == 80  # capped at head_dim


def test_per_stream_group_sizes_replace_group_size_for_their_stream(real_kv):
    keys, values = real_kv[0]
    split = kvquant.get_quantizer("int4", value_bits=2, key_group_size=64, value_group_size=4)
    key_codec, value_codec = split.codecs(8)
    assert (key_codec.group, value_codec.group) == (64, 4)
    assert split.derived_settings(8) == {"key_group": 64, "value_group": 4}
    # each stream reads exactly what a quantizer with that one group_size reads
    for codec, x, alone in ((key_codec, keys, kvquant.get_quantizer("int4", group_size=64).codecs(8)[0]),
                            (value_codec, values, kvquant.get_quantizer("int2", group_size=4).codecs(8)[1])):
        assert torch.equal(_read(codec, x), _read(alone, x))
    # bytes: 4-bit keys with a scale and zero (2 bytes each) per 64 tokens and channel, 2-bit values with one per
    # 4 channels and token
    tokens = keys.shape[2]
    b, h, d = keys.shape[0], keys.shape[1], keys.shape[3]
    key_bytes = sum(t.numel() * t.element_size() for t in key_codec.encode(keys).values())
    value_bytes = sum(t.numel() * t.element_size() for t in value_codec.encode(values).values())
    assert key_bytes == b * h * tokens * d * 4 // 8 + b * h * (tokens // 64) * d * 4
    assert value_bytes == b * h * tokens * d * 2 // 8 + b * h * tokens * (d // 4) * 4
    # unset, a stream keeps group_size
    assert kvquant.get_quantizer("int4", group_size=16, value_group_size=4).derived_settings(8) == {
        "key_group": 16, "value_group": 4}


def test_per_stream_group_sizes_follow_the_stream_when_the_axes_are_swapped():
    swapped = kvquant.get_quantizer("int4", key_axis="token", value_axis="channel", key_group_size=16,
                                    value_group_size=64)
    key_codec, value_codec = swapped.codecs(64)
    assert (key_codec.axis, key_codec.group) == ("token", 16)
    assert (value_codec.axis, value_codec.group) == ("channel", 64)


def test_a_per_stream_group_that_does_not_fit_is_named():
    with pytest.raises(kvquant.KVQuantError, match="value_group_size 48 does not divide head_dim 64.*leave "
                                                   "value_group_size unset for the default rule"):
        kvquant.get_quantizer("int4", value_group_size=48).codecs(64)
    with pytest.raises(kvquant.KVQuantError, match="unset for group_size \\(16\\)"):
        kvquant.get_quantizer("int4", group_size=16, value_group_size=48).codecs(64)
    with pytest.raises(kvquant.KVQuantError, match="key_group_size must be an integer >= 1"):
        kvquant.get_quantizer("int4", key_group_size=0)
