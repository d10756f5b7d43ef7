"""Every command as a user runs it: each names itself ``kvquant`` in its one error line (exit 2), in-process and as a
real process; an unknown command is shown inert; a reader that leaves early is no internal error."""

import subprocess
import sys
from pathlib import Path

import pytest

from refusals import error_line, fill
from tiny_configs import MODEL

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("argv, needle", [
    ([sys.executable, "-m", "kvquant.run", "{files}/config.bin.yaml"], "binary file"),
    ([sys.executable, "-m", "kvquant.plan", "--model", "llama-3.1-8b", "--context", "1024", "--gpu-memory", "1.2.3GB"],
     "cannot read '1.2.3GB'"),
    ([sys.executable, "-m", "kvquant.lm_eval", "--model", "kvquant", "--model_args", f"pretrained={MODEL}",
      "--tasks", "tinystories_lastwrod"], "unknown task"),
], ids=["run", "plan", "lm_eval"])
def test_real_processes_print_one_line(refusal_env, argv, needle):
    proc = subprocess.run(fill(argv, refusal_env), capture_output=True, text=True, cwd=ROOT)
    error_line(proc.returncode, proc.stderr, needle, out=proc.stdout)


@pytest.mark.parametrize("command, argv", [
    ("plan", ["--model", "llama-3.1-8b", "--context", "0"]),
    ("export", ["/nonexistent/report"]),
    ("adopt", ["/nonexistent/config.yaml", "/nonexistent/partial"]),
    ("run", ["/nonexistent/config.yaml"]),
    ("packaged", ["no-such-package"]),
])
def test_every_command_names_itself_kvquant_in_its_one_line(capsys, command, argv):
    """One-line errors began ``kvquant.plan:``, ``kvquant.packaged:`` or ``kvquant:`` by command; every command is
    ``kvquant COMMAND`` (the console script docs/trust.md recommends), so each line begins ``kvquant:``."""
    from kvquant import cli

    error_line(cli.main([command, *argv]), capsys.readouterr().err)


def test_an_unknown_command_with_escape_sequences_is_shown_inert_once(capsys):
    """The console script's unknown command was escaped, then quoted with ``repr``, which doubled every backslash
    (``'\\\\u001b[2J'``): what the user typed is shown as ``\\u001b`` once, never sent raw."""
    from kvquant import cli

    assert cli.main(["\x1b[2J\x07x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvquant: error: unknown command '\\u001b[2J\\u0007x'; usage: kvquant") and "\x1b" not in err


# `python -m kvquant.plan ... --json | head`: the reader left before the plan was written; that was "internal error
# (BrokenPipeError ...); please report it", exit 3. Now silent, exit 141 as a shell reports SIGPIPE's writer.
def test_a_reader_that_leaves_early_is_no_internal_error():
    proc = subprocess.Popen([sys.executable, "-m", "kvquant.plan", "--model", "llama-2-7b", "--context", "4096",
                             "--cache", "fp16", "--cache", "int8", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the plan is written: its first write meets a closed pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, err
    assert err == ""
