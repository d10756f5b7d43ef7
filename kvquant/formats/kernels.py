"""Optional fused CPU kernel for integer dequantization, compiled on first use with PyTorch's C++ extension
tooling (needs a C++ compiler; about 30 s once).

It turns packed codes into the model's dtype in one pass where eager PyTorch needs four (unpack, convert,
scale, shift), which is most of a quantized cache's decode overhead on the CPU. Where it cannot be built, or
with ``KVQUANT_KERNELS=0``, the eager path in :mod:`kvquant.formats.research` is used: same codes, same results up
to float rounding.

The build lands in ``$KVQUANT_KERNEL_DIR`` (default ``~/.cache/kvquant/kernels``; it must be a folder only this
user can write, else the eager path is used) under a key of the source, flags, versions and the CPU's features
(``-march=native`` code must not load on another CPU). A built kernel is imported directly, without torch's build
lock, so a run killed while loading it can never leave later runs waiting on that lock; a lock left by a build
killed midway is removed once it is older than any build.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib.util
import os
import platform
import sys
import time
from pathlib import Path

import torch

from kvquant.fs import cache_dir

SOURCE = Path(__file__).parent / "csrc" / "dequant.cpp"
NAME = "kvquant_dequant"
FLAGS = ["-O3", "-march=native", "-fopenmp"]
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STALE_LOCK_S = 600
#: True inside :func:`eager`: the fused kernel is neither used nor built
_EAGER = contextvars.ContextVar("kvquant_kernels_eager", default=False)


def cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags (Linux), else the platform's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "|".join(sorted({line for line in lines if line.startswith(("flags", "model name", "Features"))}))
    except OSError:
        return f"{platform.machine()}|{platform.processor()}"


def build_dir() -> Path:
    """``$KVQUANT_KERNEL_DIR`` (default ``~/.cache/kvquant/kernels``; a folder only this user can write, since the
    library built there is loaded and run) / a key of the source, flags, versions and the CPU."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([*FLAGS, torch.__version__, sys.version, cpu_identity()])
                         .encode())
    return cache_dir("kernels", env="KVQUANT_KERNEL_DIR") / key.hexdigest()[:16]


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def _extension():
    if os.environ.get("KVQUANT_KERNELS", "1") == "0":
        return None
    try:
        directory = build_dir()
        built = directory / f"{NAME}.so"
        if built.exists():
            return _import(built)
        from torch.utils.cpp_extension import load

        directory.mkdir(parents=True, exist_ok=True)
        lock = directory / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
        print("kvquant: compiling the fused CPU dequantization kernel (once, about 30 s)", file=sys.stderr)
        return load(name=NAME, sources=[str(SOURCE)], build_directory=str(directory), extra_cflags=FLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # no compiler, no headers, ...: the eager path still works
        message = str(err).splitlines()[0] if str(err) else ""
        print(f"kvquant: fused CPU kernel unavailable, using eager PyTorch ({type(err).__name__}: {message})",
              file=sys.stderr)
        return None


@contextlib.contextmanager
def eager():
    """Inside, :func:`usable` is False: the eager path runs and the kernel is never compiled, for callers that only
    read what a cache stores (the planner's writes on zeros, which must not wait ~30 s for a compile)."""
    token = _EAGER.set(True)
    try:
        yield
    finally:
        _EAGER.reset(token)


def available() -> bool:
    return _extension() is not None


def usable(out: torch.Tensor) -> bool:
    """Whether the fused kernel can write ``out`` (CPU, float32/bfloat16/float16, head_dim up to 1024, no autograd)."""
    return (not _EAGER.get() and out.device.type == "cpu" and out.dtype in OUT_DTYPES and out.shape[-1] <= 1024
            and not out.requires_grad and available())


def dequantize_into(payload, scale, zero, bits: int, group: int, token_axis: bool, out: torch.Tensor) -> None:
    """payload ``[BH, T, Dp]`` uint8; scale/zero ``[BH, T, D/group]`` (token axis) or ``[BH, T/group, D]`` (channel
    axis); out ``[B, H, T, D]`` (a view is fine: it is written in place, never through a copy). The kernel checks
    every size and raises on a mismatch."""
    target = out.view(-1, *out.shape[2:])  # a view of out, or an error: never a silent copy
    _extension().dequantize_into(payload.contiguous(), scale.float(), zero.float(), bits, group, token_axis, target)


def dequantize_slots_into(payload, scale, zero, table, bits: int, group: int, token_axis: bool,
                          out: torch.Tensor) -> None:
    """Units read through a table of pool slots, dequantized in one pass (no gathered copy of the codes, scales
    in their stored dtype): payload ``[N, H, R, Dp]`` uint8 (``R``: 1 on the token axis, ``group`` on the channel
    axis), scale/zero ``[N, H, n]``, table ``[B, U]`` int64 (an entry < 0 reads slot 0), out ``[B, H, U * R, D]``
    written in place. The kernel checks every size and every slot."""
    _extension().dequantize_slots_into(payload, scale, zero, table.contiguous(), bits, group, token_axis, out)


def attend_into(query, key: list, key_opts: list[int], value: list, value_opts: list[int], lo, hi, scaling: float,
                out: torch.Tensor) -> None:
    """Fused decode attention over stored codes (:mod:`kvquant.cache.fused`): query ``[B, Hq, n, D]``, each stream
    as its tensors and options (:func:`kvquant.cache.fused._args`), ``lo``/``hi`` ``[B, n]`` int64, ``out`` like
    query. The kernel checks every size, slot and range and raises on a mismatch."""
    _extension().attend_into(query, key, key_opts, value, value_opts, lo, hi, scaling, out)
