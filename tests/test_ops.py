"""The pure arithmetic, without a model."""

import pytest
import torch

from kvquant.formats import ops


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip_is_exact(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 7, 16), dtype=torch.uint8)
    packed = ops.pack_bits(codes, bits)
    assert packed.shape == (3, 5, 7, 16 * bits // 8)
    assert packed.dtype == torch.uint8
    assert torch.equal(ops.unpack_bits(packed, bits), codes)


def test_pack_bit_layout():
    # block layout: the code of channel j * (D // k) + i sits in byte i at bit j * bits
    codes = torch.tensor([1, 2, 3, 0], dtype=torch.uint8)
    assert ops.pack_bits(codes, 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert ops.pack_bits(codes, 4).tolist() == [1 | 3 << 4, 2]


def test_pack_rejects_partial_bytes():
    with pytest.raises(ValueError, match="whole bytes"):
        ops.pack_bits(torch.zeros(6, dtype=torch.uint8), 2)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_minmax_error_within_half_step(bits):
    x = torch.randn(4, 64) * 3 + 1
    codes, scale, zero = ops.minmax_quantize(x, bits, dim=-1)
    assert codes.max() <= 2**bits - 1
    out = ops.minmax_dequantize_(codes.float(), scale, zero)
    step = scale.float()
    # rounding error is at most half a step; the clamp at the top edge adds at most fp16 rounding of the scale
    assert ((out - x).abs() <= step * 0.5 + step * 2**-10 * 2**bits + 1e-6).all()


@pytest.mark.parametrize("fill", [0.0, 5.0, -3.25])
def test_constant_and_all_zero_tensors_are_exact(fill):
    x = torch.full((2, 3, 32), fill)
    codes, scale, zero = ops.minmax_quantize(x, 4, dim=-1)
    out = torch.empty_like(x)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    out = ops.minmax_dequantize_(codes.float(), scale, zero)
    assert torch.equal(out, x)
    payload, fscale = ops.fp8_quantize(x, torch.float8_e4m3fn, (-1,))
    ops.fp8_dequantize_into(out, payload, fscale)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, x, rtol=2**-4, atol=0)  # exact for zeros; fp8 rounding otherwise


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_dynamic_scale_never_saturates(dtype):
    # a later, much larger write gets its own scale: nothing clips at the format's maximum
    small, large = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8) * 1e3
    for x in (small, large):
        payload, scale = ops.fp8_quantize(x, dtype, (-1,))
        assert payload.dtype == dtype
        out = torch.empty_like(x)
        ops.fp8_dequantize_into(out, payload, scale)
        assert ((out - x).abs() <= x.abs().amax(-1, keepdim=True) * 0.13).all()


def test_scale_limits():
    assert ops.scale_limits(torch.float16) == (torch.finfo(torch.float16).tiny, 65504.0)


def test_sqnr():
    x = torch.randn(1000)
    assert ops.sqnr_db(x, x) == float("inf")
    assert ops.sqnr_db(x, x * 0.9) == pytest.approx(20.0, abs=1e-4)
