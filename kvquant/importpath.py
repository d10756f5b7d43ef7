"""The import path of kvquant's commands.

``python -m kvquant.run`` (so also ``torchrun``/``accelerate launch -m kvquant.run``, which start workers that way)
puts the working directory first on ``sys.path``: a ``numpy.py``, ``yaml.py`` or ``flash_attn.py`` that another user
left in a shared folder one runs kvquant from would be imported in place of the real module, and run.
:func:`drop_working_dir` takes that entry off again. Importing this module calls it, and ``kvquant/__init__.py``
imports it before anything else (``python -m kvquant.<command>`` imports the package first, before ``torch`` or
``yaml``); every command's ``main`` calls it again first thing (a no-op by then).

This module imports only what the interpreter has loaded before any ``sys.path`` lookup (``os``, ``sys``).
"""

from __future__ import annotations

import os
import sys

#: the interpreter's short options that take a value (``-W error``, ``-Xdev``), besides ``-c`` and ``-m``
_VALUED = "WX"
_dropped = False


def module_run(argv: list[str] | None = None) -> str | None:
    """The module this interpreter was started to run with ``-m`` (read from ``sys.orig_argv``: ``python -u -m
    kvquant.run``, ``python -mkvquant.run``), else None (a script, ``-c``, the interactive prompt)."""
    args = list(sys.orig_argv if argv is None else argv)[1:]
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg.startswith("--"):
            i += arg == "--check-hash-based-pycs"  # the only long option with a value
            continue
        if not arg.startswith("-") or arg == "-":
            return None  # a script (or stdin): the options have ended
        for k, letter in enumerate(arg[1:]):  # a cluster of short options: -u, -um, -mkvquant.run, -Wignore
            value = arg[2 + k :]
            if letter in "cm":
                module = value or (args[i] if i < len(args) else None)
                return module if letter == "m" else None
            if letter in _VALUED:
                i += not value
                break
    return None


def drop_working_dir(argv: list[str] | None = None) -> bool:
    """Take the working directory that ``python -m kvquant.<command>`` put first on ``sys.path`` off it (once per
    process); a no-op in any other process (``import kvquant`` from a script, pytest). True where it dropped it."""
    global _dropped
    module = module_run(argv)
    if _dropped or module is None or module.split(".")[0] != "kvquant" or not sys.path:
        return False
    first = sys.path[0]
    try:
        here = os.path.realpath(os.getcwd())
    except OSError:  # the working directory was removed: nothing can be imported from it either
        here = None
    if first == "" or (here is not None and os.path.realpath(first) == here):
        del sys.path[0]
        _dropped = True
    return _dropped


drop_working_dir()
