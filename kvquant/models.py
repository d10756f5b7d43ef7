"""Loading a model and tokenizer from a :class:`ModelConfig` (local directory, hub id or GGUF file)."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .errors import KVQuantError
from .paths import resolve

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(spec: ModelConfig) -> str:
    try:
        return resolve(spec.path)
    except KVQuantError:
        if spec.fallback:
            return spec.fallback
        raise


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(spec: ModelConfig):
    """``(model, tokenizer)``, the model in eval mode on its device(s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(spec)
    device = pick_device(spec.device)
    if spec.dtype == "auto":
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    else:
        dtype = DTYPES[spec.dtype]
    kwargs = {"dtype": dtype}
    if spec.gguf_file:
        kwargs.update(gguf_file=spec.gguf_file, pad_token_id=None)
    if spec.device_map:
        kwargs["device_map"] = spec.device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
        tokenizer = AutoTokenizer.from_pretrained(resolve(spec.tokenizer) if spec.tokenizer else path)
    except (OSError, ValueError) as err:
        raise KVQuantError(f"cannot load model {spec.path!r} ({path}): {str(err).splitlines()[0]}") from err
    if not spec.device_map:
        model = model.to(device)
    return model, tokenizer


def max_length(model, spec: ModelConfig) -> int:
    """Longest sequence to feed: the config's ``max_length``, else the model's trained context."""
    return spec.max_length or getattr(model.config, "max_position_embeddings", None) or 2048
