"""YAML mappings bound to frozen config dataclasses, generically: the binder refuses unknown and missing keys and
checks each value against its field's annotation (no bool where an int is wanted, no float for an int, no NaN or
infinity, no NUL in text), building nested dataclasses; each dataclass then checks its own values in
``__post_init__`` with :func:`require` and :func:`at_least`, and the binder puts where the key sits before the
message (``eval.tasks.limit must be >= 1``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal

from kvquant.errors import ConfigError, is_python_int


def require(ok: bool, message: str) -> None:
    """A config value's check: :class:`ConfigError` with ``message`` unless ``ok``."""
    if not ok:
        raise ConfigError(message)


def at_least(key: str, value, low: int, nullable: bool = False) -> None:
    """``value >= low`` (or None when ``nullable``)."""
    if value is None and nullable:
        return
    require(value is not None and value >= low,
            f"{key} must be >= {low}{' or null' if nullable else ''}, got {value!r}")


def check_string(where: str, value: str) -> None:
    """A config's text: no NUL and no lone surrogate, which no name, path or text holds (and a path with either
    cannot even be asked about)."""
    require("\0" not in value, f"{where} {value!r:.60} holds a NUL character, which no name, path or text may hold")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ConfigError(f"{where} {value!r:.60} holds a lone surrogate (character {err.start}), which is not "
                          "text") from None


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; build nested dataclasses."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where} must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {type(value).__name__} {value!r}")
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {type(value).__name__} {value!r}")
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{where}: keys must be names, got {bad[0]!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if tp is float and is_python_int(value):
        value = float(value)
    if not isinstance(value, tp) or (tp in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"{where} must be {tp.__name__}, got {type(value).__name__} {value!r}")
    if tp is float and not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, got {value!r}")
    if tp is str:
        check_string(where, value)
    return value


def build(cls, data: Any, where: str = ""):
    """Validate a mapping into config dataclass ``cls`` (types, ranges); errors name the key under ``where``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'the config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"unknown key {prefix}{unknown[0]} (valid keys: {', '.join(fields)})")
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"missing key {where + '.' if where else ''}{missing[0]}")
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as err:  # the dataclass names its own key; say where it sits
        raise ConfigError(f"{where}.{err}" if where else str(err)) from None
