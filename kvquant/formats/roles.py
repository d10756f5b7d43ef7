"""What the tensors a cache stores are: the storage role of each tensor a codec's ``encode()`` returns (declared by
the codec, :attr:`kvquant.formats.quantizers.Codec.roles`), which decides the ``memory_report()`` category its bytes
go to,
and the numbering of the stored forms the fused decode kernels read (:class:`StreamKind`, shared by Python, the C++
kernel ``kvquant/formats/csrc/dequant.cpp`` and the Triton kernel ``kvquant/cache/triton_attend.py``)."""

from __future__ import annotations

import enum
from collections.abc import Mapping

import torch

from kvquant.errors import KVQuantError


class StorageRole(enum.Enum):
    """What one stored tensor of a quantized unit holds; its value is the ``memory_report()`` key its bytes go to.

    - ``PAYLOAD``: the codes (packed integers, fp8/fp4 bytes, ggml blocks' quants, a float format's elements).
    - ``SCALE``: per-group, per-token or per-block metadata the dequantization needs: scales, zero points, minimums,
      shared exponents, norms (``scale_bytes`` covers all of them).
    - ``FULL``: states kept at the model's precision (the ``fp16`` baseline's units; a cache's sinks and its
      full-precision tail are counted as ``FULL`` by the store itself).
    """

    PAYLOAD = "payload_bytes"
    SCALE = "scale_bytes"
    FULL = "full_precision_bytes"


def role_of(codec, key: str) -> StorageRole:
    """The role ``codec`` declares for the stored tensor ``key``; a key it does not declare raises (naming both)."""
    roles: Mapping[str, StorageRole] = getattr(codec, "roles", {})
    role = roles.get(key)
    if not isinstance(role, StorageRole):
        declared = ", ".join(f"{k!r}" for k in roles) or "none"
        raise KVQuantError(f"codec {type(codec).__name__} stores a tensor {key!r} whose storage role it does not "
                           f"declare (declared: {declared}); add {key!r} to its roles (a StorageRole: PAYLOAD, "
                           "SCALE or FULL) so memory_report() and the planner can count it")
    return role


def check_roles(codec, encoded: Mapping[str, torch.Tensor]) -> None:
    """Raise unless ``codec`` declares a role for every tensor of ``encoded`` (what its ``encode()`` returned)."""
    for key in encoded:
        role_of(codec, key)


def by_category(codec, slot_bytes: Mapping[str, int]) -> dict[str, int]:
    """``slot_bytes`` (bytes by stored tensor, e.g. :meth:`~kvquant.cache.storage.Store.slot_bytes`) summed by
    ``memory_report()`` category, in :class:`StorageRole` order (categories ``codec`` does not store left out)."""
    out: dict[str, int] = {}
    roles = {key: role_of(codec, key) for key in slot_bytes}
    for role in StorageRole:
        if role in roles.values():
            out[role.value] = sum(nbytes for key, nbytes in slot_bytes.items() if roles[key] is role)
    return out


class StreamKind(enum.IntEnum):
    """The stored forms a fused decode kernel reads (:mod:`kvquant.cache.streams`), numbered once for every
    kernel: passed as these integers to the C++ kernel (whose ``enum Kind`` in ``kvquant/formats/csrc/dequant.cpp`` must
    carry the same numbers: tests/test_storage_roles.py checks it) and to the Triton kernel (which compares with
    them as constexpr globals)."""

    INT = 0  # min-max integer codes with scales and zero points
    FP8_E4M3 = 1  # float8_e4m3fn bytes times a scale
    FP8_E5M2 = 2  # float8_e5m2 bytes times a scale
    FULL = 3  # the model's dtype (the fp16 baseline)

    @classmethod
    def of(cls, kind: str, payload: torch.Tensor) -> StreamKind:
        """The number of a :class:`~kvquant.cache.streams.Stream`'s ``kind`` (``"int"``, ``"fp8"``, ``"full"``) with
        its ``payload`` (which fp8 format); ValueError for any other."""
        if kind == "fp8" and payload.dtype in _FP8:
            return _FP8[payload.dtype]
        if kind in ("int", "full"):
            return cls.INT if kind == "int" else cls.FULL
        raise ValueError(f"unknown stream kind {kind!r} (payload {payload.dtype})")


_FP8 = {torch.float8_e4m3fn: StreamKind.FP8_E4M3, torch.float8_e5m2: StreamKind.FP8_E5M2}
