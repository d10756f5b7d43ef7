"""The fused CPU dequantization kernel gives the eager path's values."""

import os
import subprocess
import sys

import pytest
import torch

import kvquant
from kvquant import kernels


def test_kernel_builds_here():
    if os.environ.get("KVQUANT_KERNELS") == "0":
        pytest.skip("disabled by KVQUANT_KERNELS=0")
    assert kernels.available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, options", [("int8", {"group_size": 32}), ("int4", {}), ("int2", {}),
                                           ("int4", {"key_axis": "token", "value_axis": "channel", "group_size": 16})])
def test_kernel_matches_eager(monkeypatch, dtype, name, options):
    if not kernels.available():
        pytest.skip("no fused kernel on this machine")
    x = (torch.randn(2, 3, 64, 128) * torch.linspace(0.1, 4, 128) + torch.randn(128)).to(dtype)
    for codec in kvquant.get_quantizer(name, **options).codecs(128):
        enc = codec.encode(x)
        fused = torch.full((2, 3, 70, 128), 7.0, dtype=dtype)
        codec.decode_into(enc, fused[:, :, 3:67])  # a strided view inside a larger buffer, as the cache uses
        monkeypatch.setattr(kernels, "usable", lambda out: False)
        eager = torch.empty_like(x)
        codec.decode_into(enc, eager)
        monkeypatch.undo()
        assert (fused[:, :, :3] == 7).all() and (fused[:, :, 67:] == 7).all()  # nothing written outside the view
        if dtype == torch.float32:
            assert torch.allclose(fused[:, :, 3:67], eager, rtol=1e-6, atol=1e-5)
        else:  # both compute in fp32 and round once to bf16; FMA contraction may flip a rounding
            diff = (fused[:, :, 3:67].float() - eager.float()).abs()
            assert (diff <= eager.float().abs() * 2**-7 + 1e-6).all()


def test_a_left_over_build_lock_never_blocks_loading():
    """A run killed while torch held its build lock must not make later runs wait forever."""
    if not kernels.available():
        pytest.skip("no fused kernel on this machine")
    lock = kernels.build_dir() / "lock"
    lock.touch()
    try:
        code = "import kvquant.kernels as k; assert k.available()"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    finally:
        lock.unlink(missing_ok=True)
