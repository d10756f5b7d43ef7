"""YAML mappings bound to frozen config dataclasses, generically: the binder refuses unknown and missing keys and
checks each value against its field's annotation (no bool where an int is wanted, no float for an int, no NaN or
infinity, no NUL in text), building nested dataclasses; each dataclass then checks its own values in
``__post_init__`` with :func:`require` and :func:`check_at_least`, and the binder puts where the key sits before the
message (``eval.tasks.limit must be >= 1``). Before binding, :func:`apply_override` applies a ``--set a.b=value`` to the
raw mapping (``value`` is parsed as YAML; list items are addressed by index: ``candidates.0.quantizer``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal

from kvquant.errors import ConfigError, is_python_int
from kvquant.yaml_reader import MAX_YAML_DEPTH, load_yaml


def require(ok: bool, message: str) -> None:
    """A config value's check: :class:`ConfigError` with ``message`` unless ``ok``."""
    if not ok:
        raise ConfigError(message)


def check_at_least(key: str, value, low: int, nullable: bool = False) -> None:
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


def _depth(value, memo: dict) -> int:
    """Levels of nesting of ``value`` (a scalar: 0), each shared (aliased) part counted once."""
    if not isinstance(value, (dict, list)):
        return 0
    if id(value) not in memo:
        children = value.values() if isinstance(value, dict) else value
        memo[id(value)] = 1 + max((_depth(child, memo) for child in children), default=0)
    return memo[id(value)]


def add_set_option(parser, help: str) -> None:
    """A command line's repeatable ``--set KEY=VALUE`` (into ``args.overrides``), applied by :func:`apply_override`."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def apply_override(data: dict, assignment: str) -> None:
    """Apply ``a.b.c=value`` to the raw config mapping (value parsed as YAML)."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {key[:60]!r}: not a key (write e.g. eval.tasks.limit=50)")
    if len(parts) > MAX_YAML_DEPTH:
        raise ConfigError(f"--set {key[:60]}...: {len(parts)} keys deep; a config is at most {MAX_YAML_DEPTH} levels "
                          "deep")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {key}: {'.'.join(parts[:i]) or 'list'} has no item {part}")
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            raise ConfigError(f"--set {key}: {'.'.join(parts[:i])} is {type(node).__name__} {node!r}, which has no "
                              f"key {part!r}")
    last = parts[-1]
    value = load_yaml(raw, f"--set {key}", f"{raw!r} is not a YAML value")
    if len(parts) - 1 + _depth(value, {}) > MAX_YAML_DEPTH:
        raise ConfigError(f"--set {key}: the value at this key is nested deeper than {MAX_YAML_DEPTH} levels")
    if not isinstance(node, (list, dict)):
        raise ConfigError(f"--set {key}: {'.'.join(parts[:-1])} is {type(node).__name__} {node!r}, which has no "
                          f"key {last!r}")
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"--set {key}: no list item {last}")
        node[int(last)] = value
    else:
        node[last] = value
