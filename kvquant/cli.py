"""``kvquant COMMAND ...``: every command as one console script, for folders other users can write.

``python -m kvquant.run`` puts the working directory first on Python's import path before any kvquant code runs,
so a ``kvquant.py`` (or ``kvquant/``) another user planted in the folder you run it from is what Python imports
and runs. The ``kvquant`` script pip installs starts from its own folder instead (``.venv/bin``), never the
working directory: ``kvquant run configs/int4.yaml`` is ``python -m kvquant.run configs/int4.yaml`` without that
risk (docs/trust.md).

This module imports nothing from kvquant until a command is chosen (``import kvquant.cli`` is cheap).
"""

from __future__ import annotations

import importlib
import sys

#: command -> the module whose ``main(argv) -> int`` runs it
COMMANDS = {"run": "kvquant.run", "plan": "kvquant.plan", "export": "kvquant.export", "adopt": "kvquant.adopt",
            "lm_eval": "kvquant.lm_eval", "packaged": "kvquant.packaged"}
USAGE = f"usage: kvquant {{{','.join(COMMANDS)}}} [ARGS ...] (kvquant COMMAND --help for a command's options)"


def main(argv: list[str] | None = None) -> int:
    """Exit code of the chosen command's ``main``; 2 with one line for no command or an unknown one."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv:
        print(f"kvquant: error: no command; {USAGE}", file=sys.stderr)
        return 2
    module = COMMANDS.get(argv[0].replace("-", "_"))
    if module is None:
        from kvquant.errors import visible

        print(f"kvquant: error: unknown command '{visible(argv[0], 80)}'; {USAGE}", file=sys.stderr)
        return 2
    return importlib.import_module(module).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
