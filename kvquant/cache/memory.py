"""Memory accounting: a cache's per-layer byte counts summed into ``memory_report()``, and the bytes any
transformers cache holds (for benchmarks against transformers' own caches).

The breakdown's categories are the storage roles codecs declare (:class:`~kvquant.formats.roles.StorageRole`):
``payload_bytes`` the codes, ``scale_bytes`` every per-group metadata (scales, zero points, minimums, shared
exponents, norms), ``full_precision_bytes`` states at the model's precision (sinks, the tail, the fp16 baseline).
Their sum is ``stored_bytes`` (also ``total_bytes``, the name every earlier reader uses): what holds tokens.
``reserved_bytes`` is the rest of the cache's tensors on its devices (capacity held for later writes), so
``tensor_bytes = stored_bytes + reserved_bytes`` is what the device's allocator holds for the cache;
``host_bytes`` the bookkeeping kept on the CPU whatever the device (block tables, rotation matrices)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from kvquant.compat.transformers import quantized_tensors


#: The keys of :meth:`KVQuantLayer.memory` that count stored bytes (what one write's arithmetic gives: the planner's
#: and :func:`~kvquant.cache.build.simulate_memory`'s), in its order; ``reserved_bytes`` follows them.
STORED_KEYS = ("payload_bytes", "scale_bytes", "full_precision_bytes", "fp16_bytes", "shared_saved_bytes",
               "shareable_bytes", "shared_bytes")


def summarize(parts: dict[int, dict[str, int]], tokens: int, devices: dict[int, str] | None = None,
              host: list[torch.Tensor] | None = None) -> dict[str, float]:
    """``parts``: per layer index, :meth:`KVQuantLayer.memory` (the planner's arithmetic gives the stored keys only:
    then nothing is said of reserved or host bytes); ``devices``: per layer index that stores anything yet, its device
    (None: not reported); ``host``: the cache's bookkeeping tensors on the CPU (:meth:`KVQuantLayer.host_tensors`)."""
    report = {key: sum(p[key] for p in parts.values()) for key in STORED_KEYS}
    counted = all("reserved_bytes" in p for p in parts.values())
    out = {
        **totals(report),
        **report,
        "tokens": tokens,
        "per_layer": [{"layer": i, **totals(p), "fp16_bytes": p["fp16_bytes"],
                       **({"reserved_bytes": p["reserved_bytes"]} if counted else {})}
                      for i, p in sorted(parts.items())],
    }
    if counted:
        out["stored_bytes"] = out["total_bytes"]
        out["reserved_bytes"] = sum(p["reserved_bytes"] for p in parts.values())
        out["tensor_bytes"] = out["stored_bytes"] + out["reserved_bytes"]
        out["host_bytes"] = tensor_bytes(host or [])
    if devices is not None:
        per_device: dict[str, int] = {}
        held: dict[str, int] = {}
        for entry in out["per_layer"]:
            entry["device"] = devices.get(entry["layer"])
            if entry["device"] is not None:
                per_device[entry["device"]] = per_device.get(entry["device"], 0) + entry["total_bytes"]
                held[entry["device"]] = held.get(entry["device"], 0) + entry["total_bytes"] + \
                    entry.get("reserved_bytes", 0)
        out["per_device"] = per_device
        if counted:
            out["per_device_tensor_bytes"] = held
    return out


def tensor_bytes(tensors) -> int:
    """Bytes of the storages under ``tensors``, each storage counted once (tensors that share one: once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr() or id(t))
        seen[key] = storage.nbytes()
    return sum(seen.values())


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
