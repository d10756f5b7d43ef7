"""The ``model:`` section of an experiment config: which model, in which dtype, on which devices (checked when the
config is read; whether a device is present here is :func:`kvquant.scoring.models.check_device_present`'s question).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvquant.errors import ConfigError, is_python_int
from kvquant.experiment.binding import check_at_least, require

DEVICE_TYPES = ("cpu", "cuda", "mps")
#: accelerate's device map strategies (``model.device_map``).
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def check_device(key: str, device: str) -> None:
    """``auto`` or a device torch can address: ``cpu``, ``cuda``, ``cuda:N``, ``mps`` (whether it is present is
    :func:`kvquant.scoring.models.check_device_present`'s question)."""
    if device == "auto":
        return
    valid = "use auto, cpu, cuda, cuda:N or mps"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{key} {device!r} is not a device; {valid}") from None
    require(parsed.type in DEVICE_TYPES, f"{key} {device!r} is not a device to run a model on; {valid}")


def map_device(device: str | int) -> str:
    """A device map's entry as a device name (a GPU index ``N`` is ``cuda:N``)."""
    if is_python_int(device):
        require(device >= 0, f"a GPU index must be >= 0, got {device}")
        return f"cuda:{device}"
    return device


def mapped_devices(device_map: str | dict | None) -> list[str]:
    """The devices a device map names (none for a strategy such as ``auto``)."""
    if isinstance(device_map, dict):
        return [map_device(d) for d in device_map.values()]
    return [] if device_map is None or device_map in DEVICE_MAPS else [device_map]


@dataclass(frozen=True)
class ModelConfig:
    #: ``local:REL`` (under the data directory), a local directory, or a Hugging Face hub id.
    path: str = "local:models/stories260K/hf"
    #: Used when ``path`` is ``local:...`` and no data directory holds it (e.g. a hub id).
    fallback: str | None = None
    #: A GGUF file inside ``path`` (transformers converts it on load).
    gguf_file: str | None = None
    #: Tokenizer reference when it differs from ``path`` (a GGUF's tokenizer may not load).
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    #: ``auto``: the GPU when there is one, else the CPU.
    device: str = "auto"
    #: accelerate's device map for a model larger than one GPU, in one process: a strategy (``auto``, ...), one
    #: device, or an explicit map of module names to devices (``{model.layers.0: 0, lm_head: cuda:1}``, a GPU
    #: index or a device name); overrides ``device``.
    device_map: str | dict[str, str | int] | None = None
    #: Longest sequence fed to the model (defaults to the model's ``max_position_embeddings``).
    max_length: int | None = None

    def __post_init__(self):
        require(bool(self.path), "path must name a model (local:REL, a directory or a hub id)")
        require(self.gguf_file is None or bool(self.gguf_file), "gguf_file must be a file name or null")
        from kvquant.packaged import gguf_file_problem  # imported here: packaged's command line imports little

        problem = gguf_file_problem(self.path, self.gguf_file)
        require(problem is None, problem or "")
        check_at_least("max_length", self.max_length, 2, nullable=True)
        check_device("device", self.device)
        if isinstance(self.device_map, dict):
            require(bool(self.device_map), "device_map: an explicit map names at least one module")
            for name, device in self.device_map.items():
                check_device(f"device_map.{name}", map_device(device))
        elif self.device_map is not None and self.device_map not in DEVICE_MAPS:
            check_device(f"device_map (one of {', '.join(DEVICE_MAPS)} or a device)", self.device_map)
