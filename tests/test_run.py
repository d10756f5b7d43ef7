"""The experiment runner end to end on stories260K: report files, exit codes, resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvquant.run import main

ROOT = Path(__file__).parents[1]

SMALL = """
name: small
output_dir: {out}
candidates:
  - {{quantizer: int8, name: int8, options: {{group_size: 32, residual_length: 0}}}}
  - {{quantizer: int2, name: int2, options: {{residual_length: 0}}}}
eval:
  perplexity:
    - {{name: tinystories, source: local:text/tinystories/validation-first1000.jsonl, limit: 12, max_length: 256}}
    - {{name: wikitext2, source: local:text/wikitext-2-raw-v1/wiki.test.raw, layout: stream, limit: 3, max_length: 256}}
  tasks: {{names: [tinystories_lastword], limit: 30}}
gate: {{bootstrap: 200}}
"""


def write_config(tmp_path, text=SMALL):
    path = tmp_path / "small.yaml"
    path.write_text(text.format(out=tmp_path / "reports"))
    return path


def test_end_to_end_report(tmp_path, capsys):
    code = main([str(write_config(tmp_path))])
    out_dir = tmp_path / "reports" / "small"
    results = json.loads((out_dir / "results.json").read_text())
    assert code == (0 if results["decision"] == "pass" else 1)
    assert results["decision"] == "pass" and results["chosen"] == "int8"
    by_name = {c["name"]: c for c in results["candidates"]}
    assert by_name["int8"]["passed"] and not by_name["int2"]["passed"]  # int2 loses too much
    for cand in results["candidates"]:
        assert cand["bits_per_element"] < 16 and 0 < cand["memory_ratio"] < 1
        assert set(cand["metrics"]) == {"ppl/tinystories", "ppl/wikitext2", "acc/tinystories_lastword"}
        for entry in cand["metrics"].values():
            assert {"value", "baseline", "relative", "threshold", "passed", "n"} <= set(entry)
    ppl = by_name["int2"]["metrics"]["ppl/tinystories"]
    assert ppl["value"] > ppl["baseline"] and ppl["n"] == 12 and ppl["tokens"] == ppl["baseline_tokens"]
    assert by_name["int2"]["metrics"]["acc/tinystories_lastword"]["n"] == 30
    for name in ("results.csv", "report.md", "plot.png", "config.resolved.yaml"):
        assert (out_dir / name).stat().st_size > 0
    report = (out_dir / "report.md").read_text()
    assert "Decision: PASS" in report and "python -m kvquant.run" in report
    printed = capsys.readouterr().out
    assert "kvquant: PASS" in printed and "report.md" in printed


def test_bad_config_exits_2_with_one_line(tmp_path):
    bad = write_config(tmp_path, SMALL.replace("gate: {{", "gate: {{threshold: 1, "))
    proc = subprocess.run([sys.executable, "-m", "kvquant.run", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "unknown key gate.threshold" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("change, message", [
    ("local:text/tinystories/validation-first1000.jsonl", "local:text/missing.jsonl"),
    ("quantizer: int2", "quantizer: int3"),
])
def test_missing_data_or_bad_quantizer_exits_2(tmp_path, capsys, change, message):
    path = write_config(tmp_path, SMALL.replace(change, message))
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvquant: error:") and ("missing.jsonl" in err or "int3" in err)


def test_killed_run_resumes_without_recomputing(tmp_path):
    path = write_config(tmp_path)
    partial = tmp_path / "reports" / "small" / "partial"
    proc = subprocess.Popen([sys.executable, "-m", "kvquant.run", str(path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(partial.glob("*/*.json"))) < 4:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = {p: p.stat().st_mtime_ns for p in partial.glob("*/*.json")}
    assert len(done) >= 4 and not (tmp_path / "reports" / "small" / "results.json").exists()
    assert main([str(path)]) in (0, 1)
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in done.items())  # finished results were not recomputed
    resumed = json.loads((tmp_path / "reports" / "small" / "results.json").read_text())
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    assert main([str(write_config(fresh_dir))]) in (0, 1)
    fresh = json.loads((fresh_dir / "reports" / "small" / "results.json").read_text())
    assert [c["metrics"] for c in resumed["candidates"]] == [c["metrics"] for c in fresh["candidates"]]
