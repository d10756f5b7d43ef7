"""``--set a.b=value``: one override applied to a raw config mapping before it is validated (``value`` is parsed
as YAML; list items are addressed by index: ``candidates.0.quantizer``)."""

from __future__ import annotations

from typing import Any

from kvquant.errors import ConfigError
from kvquant.yaml_reader import MAX_YAML_DEPTH, load_yaml


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
