"""Optional fused CPU kernel for integer dequantization, built on first use with PyTorch's C++ extension
tooling (needs a C++ compiler; ~30 s once, then cached by torch in ``~/.cache/torch_extensions``).

It turns packed codes into the model's dtype in one pass where eager PyTorch needs four (unpack, convert,
scale, shift), which is most of a quantized cache's decode overhead on the CPU. Where it cannot be built, or
with ``KVQUANT_KERNELS=0``, the eager path in :mod:`kvquant.quantizers` is used: same codes, same results up
to float rounding.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "dequant.cpp"
OUT_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _extension():
    if os.environ.get("KVQUANT_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        print("kvquant: loading the fused CPU dequantization kernel (compiled on first use, about 30 s)", file=sys.stderr)
        return load(name="kvquant_dequant", sources=[str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # no compiler, no headers, ...: the eager path still works
        print(f"kvquant: fused CPU kernel unavailable, using eager PyTorch ({type(err).__name__}: "
              f"{str(err).splitlines()[0] if str(err) else ''})", file=sys.stderr)
        return None


def available() -> bool:
    return _extension() is not None


def usable(out: torch.Tensor, head_dim: int) -> bool:
    """Whether the fused kernel can write ``out`` (CPU, float32 or bfloat16, head_dim up to 1024)."""
    return out.device.type == "cpu" and out.dtype in OUT_DTYPES and head_dim <= 1024 and available()


def dequantize_into(payload, scale, zero, bits: int, group: int, token_axis: bool, out: torch.Tensor) -> None:
    """payload ``[BH, T, Dp]`` uint8; scale/zero ``[BH, T, ng]`` (token axis) or ``[BH, T/group, D]`` (channel
    axis); out ``[BH, T, D]`` with a contiguous last dimension."""
    _extension().dequantize_into(payload, scale.float(), zero.float(), bits, group, token_axis, out)
