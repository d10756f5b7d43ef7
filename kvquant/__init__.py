"""kvquant: KV-cache quantization you can measure honestly.

>>> import kvquant
>>> kvquant.available_quantizers()  # and the serving engines' formats: 'vllm_fp8', 'sglang_mxfp8', ...
['fp16', 'fp8_e4m3', 'fp8_e5m2', 'int2', 'int4', 'int8', 'sglang_mxfp8', 'vllm_fp8', ...]
>>> cache = kvquant.make_cache(model, "int4", group_size=32, residual_length=128)
>>> model.generate(ids, cache=cache, max_new_tokens=64)

``import kvquant`` does not import lm-eval; ``import kvquant.scoring.lm_eval_model`` registers the lm-eval model
``kvquant`` (``lm_eval.simple_evaluate(model="kvquant", ...)``).
"""

from kvquant import importpath  # noqa: F401  (first: drops the working directory `python -m kvquant.<command>` put on sys.path)
from kvquant.cache import CacheSpec, KVQuantCache, make_cache
from kvquant.cache.fused import enable_fused_decode
from kvquant.errors import KVQuantError, NonFiniteKVError
from kvquant.formats.quantizers import (Quantizer, available_quantizers, get_quantizer, quantizer_options,
    register_quantizer)
from kvquant.formats import research  # noqa: F401  (registers kvquant's own formats)
from kvquant.formats import sglang, vllm  # noqa: F401  (register the serving engines' formats)
from kvquant.formats import llamacpp  # noqa: F401  (registers llama.cpp's cache types)
from kvquant.formats import lowbit  # noqa: F401  (registers the low-bit research formats)
from kvquant.formats import fitted  # noqa: F401  (registers fitted_levels)
from kvquant.formats import keys_values  # noqa: F401  (registers keys_values: keys and values by two quantizers)



__all__ = [
    "CacheSpec",
    "KVQuantCache",
    "KVQuantError",
    "NonFiniteKVError",
    "Quantizer",
    "available_quantizers",
    "enable_fused_decode",
    "get_quantizer",
    "make_cache",
    "quantizer_options",
    "register_quantizer",
]
