"""experiments/compare_reports.py: provenance is left out, any other difference is reported (exit 1)."""

import json
from pathlib import Path

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
