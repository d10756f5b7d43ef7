"""Memory accounting: a cache's per-layer byte counts summed into ``memory_report()``, and the bytes any
transformers cache holds (for benchmarks against transformers' own caches).

The breakdown's categories are the storage roles codecs declare (:class:`~kvquant.cache.roles.StorageRole`):
``payload_bytes`` the codes, ``scale_bytes`` every per-group metadata (scales, zero points, minimums, shared
exponents, norms), ``full_precision_bytes`` states at the model's precision (sinks, the tail, the fp16 baseline)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from kvquant.compat.transformers import quantized_tensors


def summarize(parts: dict[int, dict[str, int]], tokens: int, devices: dict[int, str] | None = None
              ) -> dict[str, float]:
    """``parts``: per layer index, :meth:`KVQuantLayer.memory`; ``devices``: per layer index that stores anything
    yet, its device (None: not reported)."""
    report = {key: sum(p[key] for p in parts.values()) for key in (
        "payload_bytes", "scale_bytes", "full_precision_bytes", "fp16_bytes", "shared_saved_bytes", "shareable_bytes",
        "shared_bytes")}
    out = {
        **totals(report),
        **report,
        "tokens": tokens,
        "per_layer": [{"layer": i, **totals(p), "fp16_bytes": p["fp16_bytes"]} for i, p in sorted(parts.items())],
    }
    if devices is not None:
        per_device: dict[str, int] = {}
        for entry in out["per_layer"]:
            entry["device"] = devices.get(entry["layer"])
            if entry["device"] is not None:
                per_device[entry["device"]] = per_device.get(entry["device"], 0) + entry["total_bytes"]
        out["per_device"] = per_device
    return out


def totals(part: dict[str, int]) -> dict[str, float]:
    total = part["payload_bytes"] + part["scale_bytes"] + part["full_precision_bytes"]
    fp16 = part["fp16_bytes"]
    return {"total_bytes": total, "ratio": total / fp16 if fp16 else float("nan"),
            "bits_per_element": 16 * total / fp16 if fp16 else float("nan")}


def stored_bytes(cache: Cache) -> int:
    """Bytes held by any transformers cache's layers (``DynamicCache``, ``QuantizedCache``, ours), found by
    walking each layer's tensors, tuples and tensor subclasses (e.g. optimum-quanto's packed tensors)."""
    if hasattr(cache, "memory_report"):  # a KVQuantCache
        return cache.memory_report()["total_bytes"]

    def walk(obj) -> int:
        if isinstance(obj, (tuple, list)):
            return sum(walk(item) for item in obj)
        if not isinstance(obj, torch.Tensor):
            return 0
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(walk(getattr(obj, name)) for name in names)
        return obj.numel() * obj.element_size()

    return sum(walk((getattr(layer, "keys", None), getattr(layer, "values", None), *quantized_tensors(layer)))
               for layer in cache.layers)
