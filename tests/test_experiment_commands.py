"""The scripts under ``experiments/`` are user-facing commands: they write through :mod:`kvquant.fs` (a symlink at
an output is replaced, never followed; another user's file or folder is refused, never replaced), refuse bad
arguments at once with one line and exit 2, and exit as the package's commands do (docs/trust.md)."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import experiment
from kvquant.errors import KVQuantError
from kvquant.exits import run_script
from kvquant.runner.report import write_benchmark

ROOT = Path(__file__).parents[1]
AS_ROOT = pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user")


def render(doc: dict) -> str:
    return f"# report of {doc['x']}\n"


def test_a_benchmark_replaces_a_symlink_at_its_outputs_never_writing_through_it(tmp_path):
    """Before: ``write_benchmark`` wrote ``results.json`` and ``report.md`` with ``Path.write_text``, through a
    planted link into the link's target."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("results.json", "report.md"):
        (out / name).symlink_to(victim)
    write_benchmark(out, {"x": 1}, render)
    assert victim.read_text() == "keep me"
    assert not (out / "results.json").is_symlink() and json.loads((out / "results.json").read_text())["x"] == 1
    assert (out / "report.md").read_text() == "# report of 1\n"


@AS_ROOT
def test_a_benchmark_refuses_to_replace_another_users_report(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("theirs")
    os.chown(out / "report.md", 4242, 4242)
    with pytest.raises(KVQuantError, match="belongs to another user"):
        write_benchmark(out, {"x": 1}, render)
    assert (out / "report.md").read_text() == "theirs" and not (out / "results.json").exists()


@AS_ROOT
def test_a_benchmark_refuses_an_output_folder_another_user_owns(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, 4242, 4242)
    with pytest.raises(KVQuantError, match="belongs to another user"):
        write_benchmark(out, {"x": 1}, render)
    assert not any(out.iterdir())


def test_a_benchmark_refuses_a_symlinked_output_folder(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "out").symlink_to(victim)
    with pytest.raises(KVQuantError, match="is a symlink"):
        write_benchmark(tmp_path / "out", {"x": 1}, render)
    assert not any(victim.iterdir())


LONG_DOC = {"command": "c", "environment": {"date": "d", "git_commit": "g", "kvquant_source_sha256": "s",
                                            "machine": "m", "torch": "t", "transformers": "tf"},
            "documents": 1, "max_length": 512, "source": "x", "chunk_size": 64, "seconds": 1.0, "edges": [512],
            "candidates": {"int4": {"kl": [{"start": 0, "stop": 512, "documents": 1, "mean": 0.02, "low": 0.01,
                                            "high": 0.03}],
                                    "top1": [{"start": 0, "stop": 512, "documents": 1, "mean": 0.9, "low": 0.8,
                                              "high": 1.0}],
                                    "trend": {"factor": 1.0, "low": 0.9, "high": 1.1, "verdict": "flat"},
                                    "quantized_key_share": 1.0}},
            "max_kl_divergence": None}


def test_long_divergence_render_only_replaces_a_symlinked_report(tmp_path):
    """Before: ``--render-only`` wrote ``report.md`` (and ``results.json``, ``kl.png``) through planted links."""
    long_divergence = experiment("long_divergence")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(LONG_DOC))
    for name in ("report.md", "kl.png"):
        (out / name).symlink_to(victim)
    long_divergence.main(["unused.yaml", "--out", str(out), "--render-only"])
    assert victim.read_text() == "keep me"
    assert not (out / "report.md").is_symlink() and "# KL divergence by position" in (out / "report.md").read_text()
    assert (out / "kl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_long_divergence_never_reads_a_document_through_a_symlink(tmp_path):
    """A ``documents/doc-N.json`` planted as a link (to another run's numbers, or a FIFO) is refused with one
    line, never read or renamed into place. Before: read through the link, and the next write (to ``doc-N.tmp``,
    itself a planted link) went through to its target."""
    long_divergence = experiment("long_divergence")
    (tmp_path / "theirs.json").write_text(json.dumps({"inputs": {}, "result": {}}))
    (tmp_path / "doc-0.json").symlink_to(tmp_path / "theirs.json")
    with pytest.raises(KVQuantError, match="not a document file this script writes"):
        long_divergence.kept_document(tmp_path / "doc-0.json")
    assert long_divergence.kept_document(tmp_path / "doc-1.json") is None


@pytest.mark.parametrize("script, args", [
    ("bench_fewshot", ["--rounds", "0"]),
    ("bench_fewshot", ["--limit", "-3"]),
    ("bench_throughput", ["--rounds", "1e9"]),
    ("bench_prefill", ["--lengths", "0"]),
    ("bench_decode", ["--steps", "0"]),
    # probe 58: a negative seed was exit 3 after the argument check (e04, e14); no bound on sizes hung or ran out
    # of memory (e07, e16, b02)
    ("simulate_gate", ["--seed", "-1", "--section", "power"]),
    ("simulate_gate", ["--reps", "99999999999999", "--section", "one-look"]),
    ("simulate_counts", ["--seed", "-1"]),
    ("simulate_counts", ["--reps", "999999999999999999"]),
    ("simulate_trend", ["--seed", "-1"]),
    ("simulate_trend", ["--iters", "99999999999"]),
    ("bench_growth", ["--contexts", "99999999999"]),
])
def test_bad_arguments_are_refused_at_once_with_one_line(script, args, capsys):
    """Before: ``bench_fewshot.py --rounds 0`` measured everything, then died in a traceback."""
    module = experiment(script)
    parse = getattr(module, "parse", None) or module.main
    with pytest.raises(SystemExit) as stop:
        parse(args)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(f"{script}: error:")


def test_a_script_exits_as_the_package_commands_do(capsys, tmp_path, monkeypatch):
    def bad():
        raise KVQuantError("bad input\n\x1b[2Jforged line")

    def broken():
        raise RuntimeError("a bug")

    assert run_script("bench_x", bad) == 2
    err = capsys.readouterr().err
    assert err == "bench_x: error: bad input \\u001b[2Jforged line\n"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the traceback goes (was left in /tmp each run)
    assert run_script("bench_x", broken) == 3 and "internal error" in capsys.readouterr().err
    [log] = tmp_path.glob("kvquant-error-*.log")
    assert log.read_text().rstrip().endswith("RuntimeError: a bug")
    assert run_script("bench_x", lambda: {"a": 1}) == 0 and run_script("bench_x", lambda: 1) == 1


def test_a_script_run_from_the_shell_exits_2_on_a_bad_output_folder(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "results.json").write_text(json.dumps(LONG_DOC))
    (tmp_path / "out").symlink_to(tmp_path / "elsewhere")
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "long_divergence.py"), "x.yaml", "--out",
                           str(tmp_path / "out"), "--render-only"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "is a symlink" in done.stderr, done.stderr
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["results.json"]


def test_a_name_too_long_for_the_file_system_is_bad_input_in_every_command(capsys, tmp_path):
    """Issue 58: a 300-character file name (a perplexity source, a model path, an adopt folder) was an internal
    error (exit 3); every command reads it as the bad input it is (exit 2, one line)."""
    def opens():
        (tmp_path / ("a" * 300)).read_text()

    assert run_script("kvquant", opens) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(" + f"{len(str(tmp_path)) + 301:,}" + " characters) is a name too long" in err


@pytest.mark.parametrize("script, args, planted, needle", [
    ("gpu_check", ["--render", "--out", "{tmp}"], None, "results.json does not exist"),
    ("gpu_check", ["--render", "--out", "{tmp}"], "[1, 2]", "holds a JSON list"),
    ("gpu_check", ["--render", "--out", "{tmp}"], "{}", "is not a results.json gpu_check writes"),
    ("simulate_gate", ["--json", "{tmp}/results.json"], "{not json", "is not a JSON file this command reads"),
    ("simulate_gate", ["--json", "{tmp}/results.json"], "[]", "holds a JSON list"),
])
def test_a_scripts_own_json_that_it_cannot_read_is_one_line(tmp_path, capsys, script, args, planted, needle):
    """Each was exit 3 (a traceback in a log), and a FIFO hung."""
    if planted is not None:
        (tmp_path / "results.json").write_text(planted)
    module = experiment(script)
    assert run_script(script, lambda: module.main([a.format(tmp=tmp_path) for a in args])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_a_fifo_is_refused_not_waited_on(tmp_path, capsys):
    os.mkfifo(tmp_path / "results.json")
    module = experiment("gpu_check")
    assert run_script("gpu_check", lambda: module.main(["--render", "--out", str(tmp_path)])) == 2
    assert "is not a JSON file this command reads" in capsys.readouterr().err


@pytest.mark.parametrize("script, args, needle", [
    ("simulate_gate", ["--json", "{tmp}/missing/x.json", "--section", "power", "--power-reps", "1"],
     "--json: cannot write {tmp}/missing/x.json (No such file or directory)"),
    ("simulate_gate", ["--json", "{tmp}/x.json"], "nothing to do: name a --section"),
    ("simulate_gate", ["--json", "{tmp}/x.json", "--write-docs"], "--write-docs: cannot read docs/gate.md"),
    ("simulate_counts", ["--root", "{tmp}/nowhere", "--json", "{tmp}/x.json"],
     "--root: {tmp}/nowhere/smollm2-long/results.json does not exist"),
    ("simulate_counts", ["--render", "--write-docs", "--json", "{tmp}/x.json"],
     "--write-docs: cannot read docs/gate.md"),
    ("simulate_trend", ["--root", "{tmp}/nowhere", "--json", "{tmp}/x.json"],
     "--root: {tmp}/nowhere/smollm2-long/results.json does not exist"),
    ("simulate_trend", ["--render", "--write-docs", "--json", "{tmp}/x.json"],
     "--write-docs: cannot read docs/gate.md"),
    ("bench_growth", ["--quantizers", "nosuch", "--steps", "1"], "unknown quantizer 'nosuch'"),
    ("bench_growth", ["--contexts", "16000000", "--rows", "1000", "--steps", "1"], "more than this machine's"),
])
def test_what_a_script_cannot_do_is_refused_before_its_work(tmp_path, capsys, monkeypatch, script, args, needle):
    """Probe 58: each was found only after the work (a whole simulation, then exit 3 writing its JSON or docs), or
    printed a header first (bench_growth), or did nothing and exited 0 (simulate_gate without a section). Run from a
    folder without docs/gate.md: nothing is printed but the one line, nothing written."""
    monkeypatch.chdir(tmp_path)
    module = experiment(script)
    assert run_script(script, lambda: module.main([a.format(tmp=tmp_path) for a in args])) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and needle.format(tmp=tmp_path) in out.err, out
    assert sorted(p.name for p in tmp_path.iterdir()) == []
