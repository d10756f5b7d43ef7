"""Errors kvquant raises for bad settings and bad inputs (never a silent wrong result), and how its commands
report them (one line; a command's body runs under :func:`kvquant.exits.run_guarded`).

Exit codes of ``python -m kvquant.run``, ``kvquant.plan`` and ``kvquant.lm_eval``: 0 pass (or done), 1 the
gate failed, 4 inconclusive (no candidate shown to pass, not all shown to fail), 2 bad input (config, data,
model, device, options: one line naming the key, file or value), 3 an internal error (one line on the screen,
the traceback in a log file), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM: handled like Ctrl-C, so locks
are released and finished results kept).
"""

from __future__ import annotations

import argparse
import numbers
import re
import unicodedata
from collections.abc import Callable

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 3, 130, 143
EXIT_INCONCLUSIVE = 4
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left (``... | head``)
ERROR_LOG = "error.log"


class KVQuantError(ValueError):
    """A setting or an input kvquant cannot honour; the message says what to change."""


class ConfigError(KVQuantError):
    """A config file or override that does not validate."""


def is_int(value) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_python_int(value) -> bool:
    """A Python integer: not a bool, nor a numpy integer (which would travel on into settings, JSON and YAML)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` when it is a Python integer (:func:`is_python_int`) within ``[minimum, maximum]``; else one
    :class:`KVQuantError` line naming ``name``, the bound broken and the value."""
    whole = is_python_int(value)
    if whole and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value
    if maximum is not None and (minimum is None or whole and value > maximum):
        bound = f" <= {maximum}"
    else:
        bound = f" >= {minimum}" if minimum is not None else ""
    raise KVQuantError(f"{name} must be an integer{bound}, got {type(value).__name__} {value!r}")


class InternalError(RuntimeError):
    """A broken invariant inside kvquant: a bug, never the user's input (exit 3 with a traceback log, not 2)."""


class NonFiniteKVError(KVQuantError):
    """A key or value state holds NaN or Inf.

    kvquant refuses to store it: a min-max or amax scale computed over a group holding NaN/Inf would
    silently corrupt every other element of that group, so the update raises instead.
    """


def one_line(err: BaseException | str) -> str:
    """An error message on one line (line breaks inside it become spaces), inert on a terminal: any other
    control or invisible character a message carries from an input (an escape sequence in a report's text, a
    bidirectional override in a name) is shown as ``\\uXXXX`` (:func:`visible`), never sent to the terminal."""
    return visible(re.sub(r"\s*\n\s*", " ", str(err).strip()), limit=MESSAGE_LIMIT)


#: Unicode categories shown as ``\uXXXX`` in DEPLOY.md and on the terminal: controls (line breaks, escapes),
#: format characters (bidirectional overrides, zero widths), private, surrogate and unassigned code points
INVISIBLE = frozenset({"Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp"})


#: the longest error message shown whole (every message kvquant writes is far shorter; a longer one quotes an input)
MESSAGE_LIMIT = 4000


def visible(text, limit: int = 300) -> str:
    """``text`` on one line, every invisible character (:data:`INVISIBLE`) as ``\\uXXXX``, cut at ``limit``."""
    text = str(text)
    shown = "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) in INVISIBLE else c for c in text[:limit])
    return shown + (f"... ({len(text) - limit:,} more characters)" if len(text) > limit else "")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (exit 2) starting ``<name>: error:``, like every other bad input."""

    def __init__(self, name: str, **kwargs):
        super().__init__(**kwargs)
        self.name = name

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.name}: error: {one_line(message)} (see --help)\n")


def script_parser(name: str, description: str | None) -> OneLineParser:
    """The argument parser of a script under ``experiments/`` (a user-facing command like the package's):
    ``description`` shown as written, usage errors one line and exit 2."""
    return OneLineParser(name, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)


def at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at most 18 digits that is at least ``minimum`` and, where given, at most
    ``maximum`` (a usage error else: a size past what the machine can hold fails at once, not after a long wait)."""
    wanted = f"an integer >= {minimum}" if maximum is None else f"an integer in {minimum}..{maximum:,}"

    def parse(text: str) -> int:
        value = int(text) if re.fullmatch(r"[+-]?[0-9]{1,18}", text.strip()) else None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text[:40]!r}")
        return value

    parse.__name__ = wanted
    return parse


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace | int:
    """``parser.parse_args(argv)``, or the exit code where argparse would exit (a usage error, ``--help``)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else EXIT_BAD_INPUT
