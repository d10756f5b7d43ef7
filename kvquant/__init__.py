"""kvquant: KV-cache quantization you can measure honestly.

>>> import kvquant
>>> kvquant.available_quantizers()
['fp16', 'fp8_e4m3', 'fp8_e5m2', 'int2', 'int4', 'int8']
>>> cache = kvquant.make_cache(model, "int4", group_size=32, residual_length=128)
>>> model.generate(ids, cache=cache, max_new_tokens=64)
"""

from .cache import KVQuantCache, make_cache
from .errors import KVQuantError, NonFiniteKVError
from .quantizers import Quantizer, available_quantizers, get_quantizer, quantizer_options, register_quantizer



def _register_with_lm_eval() -> None:
    """Make ``model="kvquant"`` known to lm-eval without importing the model class (lazy placeholder)."""
    try:
        import lm_eval.models  # noqa: F401  (lm-eval fills its built-in names only into an empty registry)
        from lm_eval.api.registry import model_registry
    except ImportError:
        return
    if "kvquant" not in model_registry:
        model_registry.register("kvquant", target="kvquant.lm_eval_model:KVQuantLM")


_register_with_lm_eval()

__all__ = [
    "KVQuantCache",
    "KVQuantError",
    "NonFiniteKVError",
    "Quantizer",
    "available_quantizers",
    "get_quantizer",
    "make_cache",
    "quantizer_options",
    "register_quantizer",
]
