"""experiments/compare_reports.py: provenance is left out, any other difference is reported (exit 1)."""

import json
from pathlib import Path

from refusals import error_line
from tests.conftest import experiment

compare = experiment("compare_reports")


def folder(root: Path, run: str, ppl: float, line: str = "| int4 | 1.01 |") -> Path:
    root.mkdir()
    (root / "results.json").write_text(json.dumps({"run_id": run, "environment": {"date": run}, "seconds": 3.0,
                                                   "candidates": [{"ppl": ppl, "kl": float("nan")}]}))
    (root / "report.md").write_text(f"# r\n- command: `python -m kvquant.run {run}`\n- run {run * 12}\n{line}\n")
    (root / "plot.png").write_bytes(b"\x89PNG same")
    (root / "partial").mkdir()
    (root / "partial" / "x.json").write_text(run)  # signed per run: skipped
    return root


def test_provenance_aside_identical(tmp_path, capsys):
    a, b = folder(tmp_path / "a", "a", 1.5), folder(tmp_path / "b", "b", 1.5)
    assert compare.main([str(a), str(b)]) == 0
    assert "3 of 3 files identical" in capsys.readouterr().out


def test_a_changed_value_line_or_file_is_reported(tmp_path, capsys):
    a = folder(tmp_path / "a", "a", 1.5)
    b = folder(tmp_path / "b", "b", 1.5000001, line="| int4 | 1.02 |")
    (b / "extra.csv").write_text("x\n")
    assert compare.main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "/candidates[0]/ppl: 1.5 | 1.5000001" in out and "1.01" in out and "extra.csv: DIFFERENT" in out
    assert compare.main([str(a), str(b), "--ignore", r"\| int4"]) == 1  # the value and the extra file remain


compare_runs = experiment("compare_runs")


def test_nothing_to_compare_is_refused_not_reported_identical(tmp_path, capsys):
    """Before: missing folders, empty folders and two files all gave '0 of 0 files identical' and exit 0."""
    a = folder(tmp_path / "a", "a", 1.5)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.json").write_text("{}")
    for argv, words in [([str(a), str(tmp_path / "missing")], "does not exist"),
                        ([str(tmp_path / "empty"), str(a)], "holds no report files"),
                        ([str(tmp_path / "file.json"), str(tmp_path / "file.json")], "a file"),
                        ([str(a), str(a), "--ignore", "("], "not a regular expression")]:
        error_line(compare.main(argv), capsys.readouterr().err, words, prog="compare_reports")


def run_folder(root: Path, result: dict) -> Path:
    (root / "partial" / "int4").mkdir(parents=True)
    (root / "partial" / "int4" / "ppl.json").write_text(json.dumps({"result": result}))
    (root / "results.json").write_text(json.dumps({"decision": "pass", "results": {}, "candidates": [
        {"name": "int4", "metrics": {"ppl": {"value": 1.5}}}]}))
    return root


def test_compare_runs_refuses_what_it_cannot_compare_and_fails_on_other_shapes(tmp_path, capsys):
    """Before: missing or empty folders gave tracebacks (or an empty table and exit 0); results of different
    shapes a traceback."""
    a = run_folder(tmp_path / "a", {"nll": [1.0, 2.0]})
    (tmp_path / "empty" / "partial").mkdir(parents=True)
    for other, words in [("missing", "not a report folder"), ("empty", "holds no partial results")]:
        error_line(compare_runs.main([str(a), str(tmp_path / other)]), capsys.readouterr().err, words,
                   prog="compare_runs")
    b = run_folder(tmp_path / "b", {"nll": [1.0, 2.0, 3.0]})
    assert compare_runs.main([str(a), str(b)]) == 1 and "fields differ" in capsys.readouterr().err
    c = run_folder(tmp_path / "c", {"nll": [1.0, 2.5]})
    assert compare_runs.main([str(a), str(c)]) == 0
    assert "| int4/ppl.json | nll | 2 | 1 | 1 |" in capsys.readouterr().out
