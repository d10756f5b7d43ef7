"""The one package that touches transformers' cache internals (``transformers.cache_utils``).

``make_cache(model, "int4")`` returns a :class:`KVQuantCache`, a ``transformers.Cache`` whose layers store
keys and values quantized *on write*: every ``update`` quantizes what it can of the new states (all but the
sink tokens, the residual window and an incomplete key group) and returns the dequantized view of the whole
layer, the current call's tokens included. A single forward pass (simulated mode) and chunked or
token-by-token feeding (streaming mode) therefore both attend to quantized K/V.

- :mod:`.storage` one layer's keys (or values) for all rows: a pool of quantized units and a table per row
- :mod:`.layer` :class:`KVQuantLayer`, the transformers layer contract over two stores; eviction executed
- :mod:`.cache` :class:`KVQuantCache` and :func:`stack_rows`
- :mod:`.spec` :class:`CacheSpec`, one cache setting, typed and validated once
- :mod:`.build` :func:`make_cache`, :func:`build_cache`, per-layer settings, :func:`simulate_memory`,
  :func:`spec_memory`
- :mod:`.memory` ``memory_report()`` sums (by the roles of :mod:`kvquant.formats.roles`) and :func:`stored_bytes`;
  :mod:`.padding`, :mod:`.checks`
- :mod:`.observe` :class:`ObservingCache`, which hands every layer's new states to a callback (calibration)
"""

from transformers.cache_utils import DummyLayer

from kvquant.cache.spec import CACHE_OPTIONS, CacheSpec
from kvquant.cache.build import (SLIDING_TYPES, attention_layout, build_cache, head_dim_of, layer_range,
    layer_settings, make_cache, simulate_memory, spec_memory)
from kvquant.cache.cache import KVQuantCache, stack_rows
from kvquant.cache.layer import FP16_BYTES, KVQuantLayer, check_importance
from kvquant.cache.memory import stored_bytes
from kvquant.cache.observe import ObservingCache
from kvquant.cache.padding import Padding
from kvquant.cache.storage import Store

__all__ = ["CACHE_OPTIONS", "FP16_BYTES", "SLIDING_TYPES", "CacheSpec", "DummyLayer", "KVQuantCache",
           "KVQuantLayer", "ObservingCache", "Padding", "Store", "attention_layout", "build_cache", "check_importance",
           "head_dim_of", "layer_range", "layer_settings", "make_cache", "simulate_memory", "spec_memory",
           "stack_rows", "stored_bytes"]
