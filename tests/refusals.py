"""What the tests of refused input share: the one check of a one-line error (raised in-process, or a command's exit
code and stderr), and the finished report and bad files that runner, planner, lm-eval and API refusals are checked
against (a refusal leaves a finished report byte-for-byte unchanged)."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

import kvquant.run
from tiny_configs import set_args, tiny_run

ROOT = Path(__file__).parents[1]


def one_line(error) -> str:
    """The message of an error raised in-process (the error, or pytest's ``ExceptionInfo`` of it): one non-empty
    line."""
    text = str(error.value if isinstance(error, pytest.ExceptionInfo) else error)
    assert text and "\n" not in text, text
    return text


def error_line(code: int, err: str, *needles: str, prog: str = "kvquant", out: str = "",
               besides: tuple[str, ...] = ()) -> str:
    """The one line a refused command wrote to stderr ``err``: exit ``code`` 2, a single non-blank line that begins
    ``prog: error: `` and holds every needle, and no traceback in ``err`` or ``out`` (its stdout). ``besides``: what
    lines printed before the refusal hold (progress bars, the config's warnings), passed over; each line is then read
    as a terminal shows it (after its last carriage return)."""
    assert code == 2, (code, err[-3000:])
    lines = [line.rsplit("\r", 1)[-1] if besides else line for line in err.splitlines()]
    lines = [line for line in lines if line.strip() and not any(b in line for b in besides)]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in out + err
    return lines[0]


#: what a progress bar's line holds (lm-eval's and the datasets library's), for ``error_line(..., besides=PROGRESS)``
PROGRESS = ("%|", "examples/s]")


def run_refused(capsys, argv: list, needle: str) -> str:
    """``kvquant.run`` on ``argv`` exits 2 with one line holding ``needle``; returns the line."""
    return error_line(kvquant.run.main([str(a) for a in argv]), capsys.readouterr().err, needle)


#: the finished run refusals must leave alone: one int4 candidate gated on tinystories and its last-word task
FINISHED = tiny_run("finished", "int4", tasks_limit=5, bootstrap=1000)

#: files of bad input (and of odd configs), by name; ``a_dir``, ``config.dir.yaml`` and ``empty_model`` are folders
BAD_FILES = {
    "bad.jsonl": b'{"text": "fine"}\n{"text": "cut\n', "binary.txt": bytes(range(256)) * 8,
    "blank.txt": b"  \n\n\t \n", "nofield.jsonl": b'{"story": "a"}\n', "empty.jsonl": b"",
    "latin1.txt": "caf\xe9 cr\xe8me".encode("latin-1"), "table.csv": b"text\nhello\n",
    "fake.parquet": b"not parquet at all", "numbers.jsonl": b'{"text": 5}\n',
    "config.bin.yaml": b"\x00\x01\x02name: x", "config.latin1.yaml": "name: caf\xe9\n".encode("latin-1"),
    "config.bad.yaml": b"candidates: [unclosed\n", "config.list.yaml": b"- a\n- b\n", "config.empty.yaml": b"",
    "a_file": b"x", "list_config.json": b"[1, 2]", "binary_config.json": bytes(range(256)),
    "no_heads.json": json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64}).encode(),
    "zero_heads.json": json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                                   "num_attention_heads": 0}).encode(),
}


def make_refusal_env(root: Path) -> dict:
    """Under ``root``: a finished report (the committed reports/int4, copied), the config of :data:`FINISHED` that
    targets it (``cfg``), and :data:`BAD_FILES` (``files``)."""
    finished = root / "reports" / "finished"
    shutil.copytree(ROOT / "reports" / "int4", finished, ignore=shutil.ignore_patterns(".lock", "partial"))
    cfg = root / "base.yaml"
    cfg.write_text(yaml.safe_dump({**FINISHED, "output_dir": str(root / "reports")}))
    files = root / "files"
    files.mkdir()
    for name, content in BAD_FILES.items():
        (files / name).write_bytes(content)
    for name in ("a_dir", "config.dir.yaml", "empty_model"):
        (files / name).mkdir()
    return {"root": root, "finished": finished, "cfg": cfg, "files": files}


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones too) with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def fill(argv: list[str], env: dict) -> list[str]:
    """Put the paths of ``env`` in for ``{cfg}`` and ``{files}``."""
    return [a.replace("{cfg}", str(env["cfg"])).replace("{files}", str(env["files"])) for a in argv]


def S(*overrides: str) -> list[str]:
    """The finished run's config with ``--set`` overrides."""
    return ["{cfg}", *set_args(*overrides)]


def only_task(name: str, *overrides: str) -> list[str]:
    """The finished run's config evaluating (and gating) ``name`` alone, with its own limits."""
    return S(f"eval.tasks.names=[{name}]", "gate.tasks=null", "eval.tasks.limits={}", *overrides)


def src(path: str) -> list[str]:
    """The finished run's config with its perplexity source replaced (and no hub to fall back on)."""
    return S(f"eval.perplexity.0.source={path}")
