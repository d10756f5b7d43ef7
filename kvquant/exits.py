"""How kvquant's commands end: every failure an exit code (:mod:`kvquant.errors`' ``EXIT_*``) and at most one line
on the screen. Bad input is one line and exit 2; Ctrl-C and SIGTERM unwind (locks released, finished results kept)
and exit 130 / 143; anything else is one line naming a log file that holds the traceback, and exit 3. The log is
written through :mod:`kvquant.fs`, which raises :mod:`kvquant.errors`' errors: so this sits above both.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

from kvquant.errors import (ERROR_LOG, EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_PASS,
    EXIT_TERMINATED, KVQuantError, is_python_int, one_line)
from kvquant.fs import write_file


def write_error_log(directory: Path | None) -> Path:
    """The current exception's traceback in ``directory/error.log`` (or a temp file where that cannot be); a
    symlink at either is replaced, never written through."""
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


def run_guarded(prog: str, body: Callable[[], int], log_dir: Callable[[], Path | None] = lambda: None,
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
    code) run under :func:`run_guarded`: bad input one line and exit 2, anything else one line, a log and exit 3."""

    def body() -> int:
        code = main()
        return code if is_python_int(code) else EXIT_PASS

    return run_guarded(prog, body)
