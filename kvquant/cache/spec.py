"""One cache setting, typed: everything a quantized cache is built from except the model.

A candidate's ``quantizer`` and ``options`` (as a config writes them, or ``make_cache(model, "int4",
group_size=32, residual_length=0)``) become one :class:`CacheSpec` when they are read: the quantizer instance
with its own options, and the cache's options as fields (residual window, sinks, eviction policy, per-layer
overrides). It is validated once, on construction, and it is what builds the cache (``make_cache(model, spec)``),
sizes it (:func:`kvquant.cache.build.spec_memory`) and names it (``options``, the resume keys and labels) for the
measuring session, search, calibration and stages alike.

>>> spec = CacheSpec.of("int4", {"group_size": 32, "residual_length": 0})
>>> spec.quantizer.group_size, spec.residual_length
(32, 0)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from kvquant.cache.eviction import Eviction, get_eviction
from kvquant.errors import KVQuantError
from kvquant.formats.quantizers import (CACHE_OPTIONS, QUANTIZERS, Quantizer, available_quantizers, check_tokens,
    get_quantizer, short_repr)



@dataclass(frozen=True)
class CacheSpec:
    """A validated cache setting. ``options`` are the make_cache options as given (the quantizer's and the cache's
    in one flat mapping, as a config spells them): they name the setting in labels and resume keys, and rebuild it
    (:meth:`of`). The other fields are what they mean, typed."""

    #: The quantizer, with its own options.
    quantizer: Quantizer
    #: Most recent tokens kept in full precision (the quantizer's default where not given).
    residual_length: int
    #: First tokens kept in full precision (full-attention layers only).
    sink_tokens: int = 0
    #: Which past tokens full-attention layers keep (None: all of them).
    eviction: Eviction | None = None
    #: Per-layer overrides as given (a layer or ``"a-b"`` range -> options), resolved on a model's layout when built.
    layers: dict | None = None
    #: The options as given.
    options: dict[str, Any] = field(default_factory=dict)
    #: The registered name the setting was given by (None: a :class:`Quantizer` instance was given).
    name: str | None = None
    #: Keys stored without the model's RoPE and rotated back on read (every layer; :mod:`kvquant.cache.prerope`).
    pre_rope: bool = False

    @classmethod
    def of(cls, quantizer: str | Quantizer | CacheSpec = "int4", options: dict | None = None) -> CacheSpec:
        """The setting of ``quantizer`` (a registered name, a :class:`Quantizer` or a spec) with ``options``;
        one :class:`KVQuantError` line for an unknown name or option, or a value out of range."""
        options = dict(options or {})
        check_not_options("make_cache", options)
        if isinstance(quantizer, CacheSpec):
            if options:
                raise KVQuantError(f"options {sorted(options)} given with a CacheSpec; use spec.replace(...)")
            return quantizer
        own = {k: options.pop(k) for k in CACHE_OPTIONS if k in options}
        if isinstance(quantizer, str):
            QUANTIZERS.check_options(quantizer, options, also=CACHE_OPTIONS)
            built, name = get_quantizer(quantizer, **options), quantizer
        elif not isinstance(quantizer, Quantizer):
            raise KVQuantError(f"quantizer must be a name ({', '.join(available_quantizers())}) or a Quantizer, "
                               f"got {type(quantizer).__name__} {quantizer!r}")
        elif options:
            raise KVQuantError(f"options {sorted(options)} given with a Quantizer instance; set them on the instance")
        else:
            built, name = quantizer, None
        residual = own.get("residual_length")
        residual = built.default_residual_length if residual is None else residual
        check_tokens("residual_length", residual)
        sinks = own.get("sink_tokens", 0)
        check_tokens("sink_tokens", sinks)
        policy, pre_rope = _policy(own, sinks), own.get("pre_rope", False)
        if not isinstance(pre_rope, bool):
            raise KVQuantError(f"pre_rope must be true or false, got {type(pre_rope).__name__} {short_repr(pre_rope)}")
        if pre_rope and policy is not None:
            raise KVQuantError(f"pre_rope is not supported with an eviction policy ({policy.name!r}): kvquant has not "
                               "built or tested pre-RoPE keys with eviction; use one or the other")
        return cls(built, residual, sinks, policy, copy.deepcopy(own.get("layers")), {**options, **own}, name,
                   pre_rope)

    def stored_bytes_spec(self) -> CacheSpec:
        """This setting as a count of stored bytes sees it: keys stored before RoPE take the bytes they take after it
        (their positions are host bookkeeping), and rotating them needs a loaded model, which a count has not."""
        return self.replace(pre_rope=None) if self.pre_rope else self

    def replace(self, **changes) -> CacheSpec:
        """This setting with some options changed (``None`` removes one), validated as a new one."""
        options = {**self.options, **changes}
        return CacheSpec.of(self.name or self.quantizer, {k: v for k, v in options.items() if v is not None})


def check_not_options(where: str, options: dict) -> None:
    """What make_cache reads from the model is no option of a cache."""
    for name in ("layout", "head_dim", "context"):
        if name in options:
            raise KVQuantError(f"{where}: {name} is not an option, it is read from model_or_config; the options: "
                               f"{', '.join(CACHE_OPTIONS)} and the quantizer's (kvquant.quantizer_options(name))")


def _policy(own: dict, sinks: int) -> Eviction | None:
    """The eviction policy the cache options name (its window and budget); window or budget alone are refused."""
    window, budget = own.get("window"), own.get("budget")
    if own.get("eviction") is not None:
        return get_eviction(own["eviction"], sinks, window=window, **({} if budget is None else {"budget": budget}))
    if window is not None or budget is not None:
        raise KVQuantError("window and budget are options of an eviction policy; set eviction= (e.g. 'sink_window')")
    return None
