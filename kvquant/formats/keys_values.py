"""``keys_values``: the keys through one registered quantizer and the values through another (issue 55's where-analysis:
is a format's error in K or in V?). Shapes as :mod:`kvquant.formats.quantizers`: states ``[B, H, T, D]``.

``make_cache(model, "keys_values", keys={"quantizer": "vllm_fp8"}, values={"quantizer": "fp16"})`` stores the keys
exactly as ``vllm_fp8`` stores its keys and the values exactly as ``fp16`` stores its values: the key codec is the
keys quantizer's key codec, the value codec the values quantizer's value codec, each with its own options (its own
rotation included), so ``memory_report()`` counts each stream's bytes by that codec's own roles. A config writes the
inner quantizers as a ``layers`` entry writes one, ``{quantizer: NAME, ...its options}``.

What belongs to the cache stays outside: ``residual_length``, ``sink_tokens``, eviction, ``layers`` and
``pre_rope`` are given beside ``quantizer: keys_values`` and apply to both streams; a rotation is an inner
quantizer's (``keys: {quantizer: int4, rotation: hadamard}``).

No engine is exported for a mix (:attr:`Quantizer.serving` None: a research setting to ``python -m kvquant.export``):
vLLM and SGLang take one ``--kv-cache-dtype`` for both. llama.cpp's ``-ctk``/``-ctv`` do differ, and a llama.cpp
quantizer already takes them as ``key_type``/``value_type`` (``llamacpp_q8_0`` with ``value_type: f16`` stores what
``keys_values`` of ``llamacpp_q8_0`` and ``llamacpp_f16`` stores, and exports as ``-ctk q8_0 -ctv f16``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from kvquant.errors import KVQuantError
from kvquant.formats.quantizers import (CACHE_OPTIONS, Codec, Quantizer, get_quantizer, register_quantizer,
    short_repr)

#: the stream each inner quantizer stores, by the field that holds it
STREAMS = {"keys": "key", "values": "value"}


@register_quantizer("keys_values")
@dataclass(frozen=True)
class KeysValues(Quantizer):
    """Keys stored by ``keys``, values by ``values``: each a :class:`Quantizer`, or its spec as a mapping
    ``{"quantizer": NAME, ...its options}`` (built with :func:`get_quantizer` and kept as the instance)."""

    keys: Quantizer
    values: Quantizer

    def __post_init__(self):
        super().__post_init__()
        for option, value in (("rotation", self.rotation), ("rotation_seed", self.rotation_seed)):
            if value not in (None, 0):
                raise KVQuantError(f"keys_values: {option} is an inner quantizer's option; put it on the one it "
                                   f"rotates (keys: {{quantizer: int4, {option}: {short_repr(value)}}}), not on "
                                   "keys_values")
        for field in STREAMS:
            object.__setattr__(self, field, _inner(field, getattr(self, field)))

    @property
    def default_residual_length(self) -> int:
        """The larger of the inner quantizers' (``int4`` keeps its 128 most recent tokens at full precision in a mix
        too; ``residual_length`` beside ``quantizer: keys_values`` says otherwise, for both streams)."""
        return max(self.keys.default_residual_length, self.values.default_residual_length)

    @property
    def converts_query(self) -> bool:
        """Whether the key codec converts the query (llama.cpp's keys: :mod:`kvquant.cache.query`)."""
        return getattr(self.keys, "converts_query", False)

    def _codecs(self, head_dim: int) -> tuple[Codec, Codec]:
        return self.keys.codecs(head_dim)[0], self.values.codecs(head_dim)[1]

    def for_model(self, model_or_config) -> KeysValues:
        """Both inner quantizers as they run on the model (llama.cpp's K channel order, for one)."""
        return dataclasses.replace(self, keys=self.keys.for_model(model_or_config),
                                   values=self.values.for_model(model_or_config))

    def describe(self) -> dict[str, object]:
        """Name and options, each inner quantizer as its own :meth:`describe` (its spec)."""
        return {**super().describe(), "keys": self.keys.describe(), "values": self.values.describe()}

    def derived_settings(self, head_dim: int) -> dict[str, object]:
        """What each inner quantizer derived for the stream it stores here: the keys quantizer's ``key_*`` settings
        and the values quantizer's ``value_*`` ones; a setting of both streams (``rotation_block``) named for its
        stream (``key_rotation_block``)."""
        out = {}
        for field, stream in STREAMS.items():
            other = "value" if stream == "key" else "key"
            for name, value in getattr(self, field).derived_settings(head_dim).items():
                if not name.startswith(f"{other}_"):
                    out[name if name.startswith(f"{stream}_") else f"{stream}_{name}"] = value
        return out


def _inner(field: str, spec) -> Quantizer:
    """The quantizer ``keys_values`` stores ``field`` (``keys`` or ``values``) with: ``spec`` as given (a
    :class:`Quantizer`) or built from its mapping; one :class:`KVQuantError` line for anything else."""
    name = spec.get("quantizer") if isinstance(spec, Mapping) else spec
    if name == KeysValues.name or isinstance(name, KeysValues):
        raise KVQuantError(f"keys_values: {field} cannot be keys_values itself; name the quantizer that stores the "
                           f"{field}")
    if isinstance(spec, Quantizer):
        return spec
    if not isinstance(spec, Mapping):
        raise KVQuantError(f"keys_values: {field} must be a quantizer spec ({field}: {{quantizer: NAME, ...its "
                           f"options}}) or a Quantizer, got {type(spec).__name__} {short_repr(spec)}")
    options = dict(spec)
    name = options.pop("quantizer", None)
    if name is None:
        raise KVQuantError(f"keys_values: {field} needs a quantizer ({field}: {{quantizer: NAME, ...its options}}), "
                           f"got {short_repr(spec)}")
    cache = sorted(set(options) & set(CACHE_OPTIONS))
    if cache:
        raise KVQuantError(f"keys_values: {field}.{cache[0]} is the cache's option, not an inner quantizer's; give it "
                           "beside quantizer: keys_values (it applies to keys and values alike)")
    try:
        return get_quantizer(name, **options)
    except KVQuantError as err:
        raise KVQuantError(f"keys_values: {field}: {err}") from None
