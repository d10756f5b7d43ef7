"""Every use of a private lm-eval symbol (see :mod:`kvquant.compat`), and of argparse's on lm-eval's parser. Checked
against lm-eval 0.4.13 on Python 3.11. lm-eval is imported only when a function here is called."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess


def yaml_base_loader() -> type:
    """The YAML loader class lm-eval derives its task-file loaders from (``yaml.CSafeLoader`` where PyYAML has libyaml,
    else ``yaml.FullLoader``); a subclass accepts ``add_constructor``. Wraps ``lm_eval.tasks._yaml_loader._Base``."""
    from lm_eval.tasks._yaml_loader import _Base

    return _Base


def run_parser() -> argparse.ArgumentParser:
    """A fresh copy of the parser of ``lm_eval run`` (what the ``lm_eval`` command parses its flags with). Wraps
    ``lm_eval._cli.harness.HarnessCLI()._subparsers`` (the sub-command parsers, ``run`` among its ``choices``)."""
    from lm_eval._cli.harness import HarnessCLI

    return HarnessCLI()._subparsers.choices["run"]


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions (one per flag, with its ``dest`` and ``type``) of an argparse parser such as :func:`run_parser`'s;
    changing one changes how the parser reads that flag. Wraps argparse's ``ArgumentParser._actions``."""
    return parser._actions


def int_or_none_list(min_len: int, max_len: int, defaults: str, value: str) -> list[int | None]:
    """lm-eval's reading of a comma-separated list of integers or ``None`` (``--seed``): one item stands for all
    ``max_len``, ``min_len``..``max_len`` items are filled up from ``defaults``, others raise ``ValueError``. Wraps
    ``lm_eval._cli.utils._int_or_none_list_arg_type``."""
    from lm_eval._cli.utils import _int_or_none_list_arg_type

    return _int_or_none_list_arg_type(min_len, max_len, defaults, value)


def set_rank(lm, rank: int, world_size: int) -> None:
    """Make the lm-eval model ``lm`` one of ``world_size`` processes, number ``rank``: lm-eval then hands it that
    share of each task's documents and gathers the results (its public ``lm.rank`` / ``lm.world_size`` read them).
    Wraps ``lm_eval.api.model.LM._rank`` / ``LM._world_size``."""
    lm._rank, lm._world_size = rank, world_size


@contextlib.contextmanager
def quiet_git():
    """While inside, lm-eval records the working folder's git commit (``results["git_hash"]``) as it does, but with
    git's own stderr silenced: outside a git checkout git printed ``fatal: not a git repository`` on the terminal.
    Same value: ``git describe --always``, else (git failed or is missing) the commit the folder's ``.git`` names.
    Wraps ``lm_eval.evaluator.get_git_commit_hash`` (lm-eval's ``simple_evaluate`` calls it by that name) and
    ``lm_eval.loggers.utils.get_commit_from_path``."""
    import lm_eval.evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def git_commit_hash() -> str | None:
        try:
            return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())

    original = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = git_commit_hash
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = original
