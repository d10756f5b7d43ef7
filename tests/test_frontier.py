"""experiments/frontier.py: a family's settings from its reports (stage 2 before the screen), the frontier by bits
and KL, and one line for a family with no report."""

import json
from pathlib import Path

import pytest

from kvquant.errors import KVQuantError
from tests.conftest import experiment

frontier = experiment("frontier")


def report(root: Path, settings: dict[str, tuple[float, float, int, str]]) -> Path:
    root.mkdir(parents=True)
    cands = [{"name": name, "bits_per_element": bits,
              "metrics": {"kl/wikitext2": {"value": kl, "ci_low": kl / 2, "ci_high": kl * 2, "n": n, "verdict": v}}}
             for name, (bits, kl, n, v) in settings.items()]
    (root / "results.json").write_text(json.dumps({"candidates": cands}))
    return root


def test_stage_two_wins_and_the_frontier_is_what_nothing_cheaper_beats(tmp_path):
    screen = report(tmp_path / "screen", {"a": (3.0, 0.05, 12, "fail"), "b": (4.0, 0.02, 12, "too few documents"),
                                          "c": (4.0, 0.03, 12, "fail"), "d": (5.0, 0.04, 12, "fail")})
    stage2 = report(tmp_path / "stage2", {"b": (4.0, 0.008, 96, "pass")})
    rows = {r["name"]: r for r in frontier.on_frontier(frontier.settings([stage2, tmp_path / "absent", screen]))}
    assert rows["b"]["n"] == 96 and rows["b"]["report"] == "stage2"  # the stage-2 row, not the screen's
    assert {n for n, r in rows.items() if r["frontier"]} == {"a", "b"}  # c and d: b is as cheap or cheaper, lower
    text = "\n".join(frontier.table("x", list(rows.values())))
    assert "| `b` | 4.000 | 0.0080 [0.0040, 0.0160] | 96 | pass | yes | `stage2` |" in text


def test_writes_the_table_and_plot_and_refuses_no_reports(tmp_path):
    report(tmp_path / "r", {"a": (3.0, 0.05, 12, "fail")})
    frontier.main(["--family", f"F={tmp_path / 'r'}", "--out", str(tmp_path / "out")])
    assert "| `a` | 3.000 |" in (tmp_path / "out" / "frontier.md").read_text()
    assert (tmp_path / "out" / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(KVQuantError, match="no report with kl/wikitext2"):
        frontier.main(["--family", f"F={tmp_path / 'nothing'}", "--out", str(tmp_path / "out2")])


def test_a_verdict_with_a_caveat_is_never_quoted_without_it(tmp_path):
    """smollm2-mixed-6bit's PASS is its search's second map on the same windows (5%, not 2.5%): the frontier marks
    its verdict and writes the caveat under the table; other rows get no mark, a table without the report no note."""
    plain = report(tmp_path / "plain", {"a": (3.0, 0.05, 12, "fail")})
    marked = report(tmp_path / "smollm2-mixed-6bit", {"m": (6.0, 0.0096, 96, "pass")})
    text = "\n".join(frontier.table("x", frontier.on_frontier(frontier.settings([plain, marked]))))
    assert "| 96 | pass (*) | yes | `smollm2-mixed-6bit` |" in text and "| 12 | fail | yes | `plain` |" in text
    assert text.count("(*)") == 2 and "the chance that either passed falsely is 5%" in text
    alone = "\n".join(frontier.table("x", frontier.on_frontier(frontier.settings([plain]))))
    assert "(*)" not in alone
