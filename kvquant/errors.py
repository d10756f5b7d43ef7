"""Errors kvquant raises for bad settings and bad inputs (never a silent wrong result), and how its commands
report them.

Exit codes of ``python -m kvquant.run``, ``kvquant.plan`` and ``kvquant.lm_eval``: 0 pass (or done), 1 the
gate failed, 4 inconclusive (no candidate shown to pass, not all shown to fail), 2 bad input (config, data,
model, device, options: one line naming the key, file or value), 3 an internal error (one line on the screen,
the traceback in a log file), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM: handled like Ctrl-C, so locks
are released and finished results kept).
"""

from __future__ import annotations

import argparse
import errno
import numbers
import os
import re
import signal
import sys
import tempfile
import threading
import traceback
import unicodedata
from collections.abc import Callable
from pathlib import Path

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


def write_error_log(directory: Path | None) -> Path:
    """The current exception's traceback in ``directory/error.log`` (or a temp file where that cannot be); a
    symlink at either is replaced, never written through."""
    from kvquant.fs import write_file

    text = traceback.format_exc()
    if directory is not None and directory.is_dir() and not directory.is_symlink():
        try:
            path = directory / ERROR_LOG
            write_file(path, text)
            return path
        except OSError:
            pass
    with tempfile.NamedTemporaryFile("w", prefix="kvquant-error-", suffix=".log", delete=False) as f:
        f.write(text)
        return Path(f.name)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that it unwinds as Ctrl-C does."""


def _terminate(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush at exit does not fail on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file (pytest's capture): nothing to flush at exit
        pass


def _outcome(prog: str, body: Callable[[], int], log_dir: Callable[[], Path | None],
             on_interrupt: Callable[[], str]) -> int:
    try:
        return body()
    except KVQuantError as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # the reader of stdout left (``--json | head``): not an error, and nothing more to say
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt as stop:
        how = "terminated (SIGTERM)" if isinstance(stop, Terminated) else " ".join(["interrupted", *(
            [f"({stop})"] if str(stop) else [])])  # e.g. another process of a data-parallel run ended
        print(f"\n{prog}: {how}{on_interrupt()}", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(stop, Terminated) else EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001 - the point: every other failure becomes one line and a log
        if isinstance(err, OSError) and err.errno == errno.ENAMETOOLONG:  # only ever a name the user gave
            name = str(err.filename or "?")
            print(f"{prog}: error: {one_line(name[:80])}... ({len(name):,} characters) is a name too long for this "
                  "file system; name a shorter file or folder", file=sys.stderr)
            return EXIT_BAD_INPUT
        log = write_error_log(log_dir())
        print(f"{prog}: internal error ({type(err).__name__}: {one_line(err)[:300]}); the traceback is in {log}; "
              "please report it", file=sys.stderr)
        return EXIT_INTERNAL


def guarded(prog: str, body: Callable[[], int], log_dir: Callable[[], Path | None] = lambda: None,
            on_interrupt: Callable[[], str] = lambda: "") -> int:
    """Run a command's ``body`` so that no input reaches a raw traceback: :class:`KVQuantError` is one line and
    exit 2, Ctrl-C exit 130 and SIGTERM exit 143 (each with ``on_interrupt()``'s hint, after the body's cleanup
    ran), anything else one line naming a log file with the traceback and exit 3."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return _outcome(prog, body, log_dir, on_interrupt)
    except KeyboardInterrupt as stop:  # a signal that arrived while the outcome was being reported
        return EXIT_TERMINATED if isinstance(stop, Terminated) else EXIT_INTERRUPTED
    finally:
        if main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def run_script(prog: str, main: Callable[[], object]) -> int:
    """The exit code of a script's ``main()`` (whatever it returns counts as done, exit 0; an ``int`` is its exit
    code) run under :func:`guarded`: bad input one line and exit 2, anything else one line, a log and exit 3."""

    def body() -> int:
        code = main()
        return code if is_python_int(code) else EXIT_PASS

    return guarded(prog, body)
