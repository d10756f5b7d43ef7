"""Every use of a private transformers symbol (see :mod:`kvquant.compat`). Checked against transformers 5.25.0."""

from __future__ import annotations


def attn_implementation(config) -> str | None:
    """The attention implementation a model of ``config`` runs (``"eager"``, ``"sdpa"``, a registered name), or
    None where unset or for an object that is no transformers config. Wraps ``PretrainedConfig._attn_implementation``
    (a property, set by ``PreTrainedModel.set_attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


def recording_attentions() -> bool:
    """Whether transformers collects attention weights in the forward now running (``output_attentions=True``).
    Wraps ``transformers.utils.output_capturing._active_collector`` (a context variable holding a dict keyed by what
    is collected, ``"attentions"`` among them, or None outside a collecting forward); a transformers without that
    module collects none this way (False)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return False
    return "attentions" in (_active_collector.get() or {})


def tensor_parallel_size(model) -> int:
    """How many tensor-parallel shards ``model`` is split into (1 unsplit, or where unknown). Wraps
    ``PreTrainedModel._tp_size`` (None until the model is sharded)."""
    return getattr(model, "_tp_size", None) or 1


def quantized_tensors(layer) -> tuple[object, object]:
    """The quantized keys and values a layer of transformers' ``QuantizedCache`` holds, each None where it holds none
    (or ``layer`` is another kind of layer). Their layout is the backend's: a tensor subclass (quanto), a tuple
    (``fp8``: codes ``[B, H, T, D]`` float8 and a scalar scale). Wraps ``BaseQuantizedLayer._quantized_keys`` /
    ``_quantized_values``."""
    return getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)
