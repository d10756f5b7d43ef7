"""The hardened readers of every config kvquant takes (experiment configs, ``--set`` values, lm-eval's
``--model_args`` and ``--config``, the planner's cache settings, text files of a perplexity set): a text file read
whole as UTF-8, and YAML parsed with safe types only, refusing duplicate keys, deep nesting and alias bombs. Each
refusal is one :class:`~kvquant.errors.ConfigError` line naming the file or setting.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import yaml

from kvquant.errors import ConfigError

#: Bounds of any YAML kvquant reads: nesting depth, nodes after aliases expand (an alias "bomb" of a few hundred
#: bytes expands to billions), and text size.
MAX_YAML_DEPTH, MAX_YAML_NODES, MAX_TEXT_BYTES = 64, 1_000_000, 16 << 20


def _first_line(err: Exception) -> str:
    return " ".join(str(err).split())


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (last-wins would drop, e.g., a whole ``candidates:`` list) and YAML
    nested deeper than :data:`MAX_YAML_DEPTH`."""

    def compose_node(self, parent, index):
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise ConfigError(f"nested deeper than {MAX_YAML_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node, deep=False):
        """A scalar Python cannot hold (an integer past its digit limit, a date that does not exist) is an error
        naming its line, not an internal error."""
        try:
            return super().construct_object(node, deep)
        except ConfigError:
            raise
        except (ValueError, OverflowError) as err:
            line, text = node.start_mark.line + 1, str(node.value)
            if node.tag.endswith(":int") and len(text) > sys.get_int_max_str_digits():
                raise ConfigError(f"line {line}: an integer of {len(text):,} digits, beyond the "
                                  f"{sys.get_int_max_str_digits():,} Python reads; no setting takes one") from None
            raise ConfigError(f"line {line}: {text[:40]!r} cannot be read as {node.tag.rpartition(':')[2]} "
                              f"({_first_line(err)[:80]})") from None

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise ConfigError(f"key {key!r} appears twice in one mapping (line {key_node.start_mark.line + 1})")
                seen.add(key)
        return super().construct_mapping(node, deep)


def _expanded_nodes(value, memo: dict) -> int:
    """Nodes of ``value`` with every shared (aliased) part counted each time it appears, without expanding it."""
    if id(value) in memo:
        return memo[id(value)]
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    memo[id(value)] = count = 1 + sum(_expanded_nodes(child, memo) for child in children)
    return count


def load_yaml(text: str, what: str, invalid: str = "not valid YAML"):
    """``text`` parsed as YAML (safe types only), refusing duplicate keys, deep nesting and alias bombs with one
    line naming ``what`` (``invalid``: what to call text that does not parse)."""
    try:
        value = yaml.load(text, Loader=_StrictLoader)  # noqa: S506  (a SafeLoader subclass)
    except ConfigError as err:
        raise ConfigError(f"{what}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{what}: {invalid}: {_first_line(err)}") from None
    except RecursionError:
        raise ConfigError(f"{what}: nested too deeply") from None
    if _expanded_nodes(value, {}) > MAX_YAML_NODES:
        raise ConfigError(f"{what}: expands to more than {MAX_YAML_NODES:,} values (YAML aliases); write it out")
    return value


def read_text_file(path: Path, what: str) -> str:
    """The UTF-8 text of ``path``; a missing, unreadable, binary or non-UTF-8 file is an error naming it, and so is a
    file whose name is not UTF-8 (a report that names it could not be written)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{ascii(str(path))[:200]}: a {what} whose name is not UTF-8; rename it") from None
    if not path.exists():
        raise ConfigError(f"{path}: no such {what}")
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a {what}")
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO or a device would block or never end
            raise ConfigError(f"{path}: not a regular file, so not a {what}")
        if path.stat().st_size > MAX_TEXT_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_TEXT_BYTES >> 20} MiB, too large for a {what}")
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the {what} ({err.strerror or err})") from None
    if b"\0" in raw:
        raise ConfigError(f"{path}: a binary file (holds NUL bytes), not a {what}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); save the {what} as UTF-8") from None
