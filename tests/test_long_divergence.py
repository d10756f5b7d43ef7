"""experiments/long_divergence.py on stories260K: the report's buckets are computed from the per-position numbers
it kept, a rerun measures nothing (reads documents/, loads no model) and writes the same numbers, and a document of
other inputs is measured again."""

import json
import math

import pytest
import torch

from kvquant.runner.counts import MIN_FAIL, MIN_PASS, MIN_TREND
from kvquant.runner.positions import buckets
from tests.conftest import experiment

CONFIG = """
name: tiny-long
candidates:
  - {quantizer: int8, name: int8, options: {group_size: 32, residual_length: 0}}
  - {quantizer: int2, name: int2, options: {group_size: 32, residual_length: 0}}
eval:
  mode: streaming
  chunk_size: 64
  perplexity:
    - {name: tinystories, source: local:text/tinystories/validation-first1000.jsonl, layout: stream, limit: 2,
       max_length: 300}
"""


@pytest.fixture(scope="module")
def script():
    return experiment("long_divergence")


def test_report_resume_and_remeasure(script, tmp_path, monkeypatch):
    config = tmp_path / "long.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "out"
    script.main([str(config), "--out", str(out)])
    assert torch.is_grad_enabled()  # the script turns autograd off for its own call only (it leaked into later tests)
    doc = json.loads((out / "results.json").read_text())
    assert doc["edges"] == [0, 300] and doc["documents"] == 2
    kept = [json.loads((out / "documents" / f"doc-{d}.json").read_text())["result"] for d in range(2)]
    for label in ("int8", "int2"):
        assert [len(k[label]["kl"]) for k in kept] == [299, 299]
        want = buckets([k[label]["kl"] for k in kept], (0, 300))[0]
        assert doc["candidates"][label]["kl"][0]["mean"] == pytest.approx(want.mean, rel=1e-12)
    assert 0 < doc["candidates"]["int8"]["kl"][0]["mean"] < doc["candidates"]["int2"]["kl"][0]["mean"]
    assert "| 0-300 | 2 |" in (out / "report.md").read_text()
    ends, mean, low, high = script.curves(doc)["int2"]  # what kl.png draws: the buckets above
    assert (ends, mean) == ([300], [doc["candidates"]["int2"]["kl"][0]["mean"]]) and low[0] <= mean[0] <= high[0]
    assert (out / "kl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](kl.png)" in (out / "report.md").read_text()

    monkeypatch.setattr(script, "load_model", lambda *a: pytest.fail("a rerun loaded the model"))
    script.main([str(config), "--out", str(out), "--max-kl-divergence", "0.05"])
    again = json.loads((out / "results.json").read_text())
    assert again["candidates"] == doc["candidates"]
    int8, int2 = (doc["candidates"][c]["kl"][0] for c in ("int8", "int2"))
    assert int8["mean"] <= 0.05 < int2["mean"]  # the one bucket's means lie on either side of 0.05, but over 2
    # documents the studentized interval is unbounded and decides nothing (docs/gate.md: a fail needs MIN_FAIL)
    assert (int8["low"], int8["high"]) == (-math.inf, math.inf)
    few = f"passes at no length, too few documents at 300 (n = 2 of the {MIN_FAIL} needed)"
    assert script.length_verdicts(again, 0.05) == {"int8": few, "int2": few}
    report = (out / "report.md").read_text()
    assert f"| int2 | {few} |" in report and f"too few documents (n = 2 of the {MIN_TREND} needed)" in report
    # the same bucket over enough documents decides (rendered from a results.json with the count raised)
    enough = {**again, "documents": MIN_FAIL, "candidates": {
        label: {**r, "kl": [{**k, "documents": MIN_FAIL, "low": 0.9 * k["mean"], "high": 1.1 * k["mean"]}
                            for k in r["kl"]]} for label, r in again["candidates"].items()}}
    assert script.length_verdicts(enough, 0.05) == {"int8": f"passes at no length, too few documents at 300 (n = "
                                                    f"{MIN_FAIL} of the {MIN_PASS} needed)",
                                                    "int2": "passes at no length, fails from 300"}
    script.main([str(config), "--out", str(out), "--render-only", "--max-kl-divergence", "1e-9"])  # no model: rendered
    assert f"| int8 | {few} |" in (out / "report.md").read_text()
    assert json.loads((out / "results.json").read_text())["candidates"] == doc["candidates"]

    # other inputs (a longer window): measured again, so the model loads; the finished file of the earlier inputs is
    # set aside first, never overwritten (issue 58)
    before = (out / "documents" / "doc-0.json").read_text()
    with pytest.raises(pytest.fail.Exception, match="loaded the model"):
        script.main([str(config), "--set", "eval.perplexity.0.max_length=310", "--out", str(out)])
    assert (out / "documents" / "doc-0.json.old").read_text() == before


@pytest.mark.parametrize("tamper", ["edited", "unsigned"])
def test_a_document_file_not_signed_here_is_set_aside_and_measured_again(script, tmp_path, capsys, tamper):
    """Issue 58: a ``documents/doc-N.json`` of this run's inputs was reused whatever its numbers (only its inputs were
    compared): one edited by hand, or one without a signature (written before signed documents, like the committed
    reports' files), is moved to ``doc-N.json.unsigned`` and measured again; the report rests on the measurement."""
    config = tmp_path / "long.yaml"
    config.write_text(CONFIG.replace("limit: 2", "limit: 1"))
    out = tmp_path / "out"
    script.main([str(config), "--out", str(out)])
    path = out / "documents" / "doc-0.json"
    measured = json.loads(path.read_text())
    forged = {**measured, "result": {**measured["result"], "int2": {**measured["result"]["int2"],
                                                                    "kl": [0.0] * 299}}}
    if tamper == "unsigned":
        forged = {k: v for k, v in measured.items() if k != "signature"}
    path.write_text(json.dumps(forged))
    capsys.readouterr()
    script.main([str(config), "--out", str(out)])
    printed = capsys.readouterr().out
    why = "it carries no signature" if tamper == "unsigned" else "its signature does not verify"
    assert f"{path} is not reused: {why}" in printed and "moved to doc-0.json.unsigned and measured again" in printed
    assert "document 1/1 (300 tokens)" in printed  # measured again
    assert json.loads((out / "documents" / "doc-0.json.unsigned").read_text()) == forged
    again = json.loads(path.read_text())
    assert again["result"]["int2"]["kl"] == measured["result"]["int2"]["kl"] != [0.0] * 299
    doc = json.loads((out / "results.json").read_text())
    assert doc["candidates"]["int2"]["kl"][0]["mean"] == pytest.approx(
        sum(measured["result"]["int2"]["kl"]) / 299, rel=1e-9)


def test_refit_fits_the_buckets_and_trend_again_from_the_kept_documents(script, tmp_path, monkeypatch):
    """Issue 53: the committed long reports' trends were fitted by an estimator since replaced, and
    ``--render-only`` could only render results.json's numbers again. ``--refit`` fits buckets and trend again by
    today's code from documents/ (no model), and refuses, writing nothing, where a document is missing."""
    from kvquant.runner.positions import trend

    config = tmp_path / "long.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "out"
    script.main([str(config), "--out", str(out)])
    doc = json.loads((out / "results.json").read_text())
    # two buckets, so the trend is a number (the measured report has one bucket of 300 positions)
    stale = {**doc, "edges": [0, 100, 300], "candidates": {
        label: {**r, "trend": {"factor": 9.0, "low": 8.0, "high": 10.0, "verdict": "grows"}}
        for label, r in doc["candidates"].items()}}
    (out / "results.json").write_text(json.dumps(stale))
    monkeypatch.setattr(script, "load_model", lambda *a: pytest.fail("a render loaded the model"))
    script.main([str(config), "--out", str(out), "--render-only"])
    assert json.loads((out / "results.json").read_text())["candidates"]["int2"]["trend"]["factor"] == 9.0
    script.main([str(config), "--out", str(out), "--render-only", "--refit"])
    again = json.loads((out / "results.json").read_text())
    kept = [json.loads((out / "documents" / f"doc-{d}.json").read_text())["result"] for d in range(2)]
    for label in ("int8", "int2"):
        kl = [k[label]["kl"] for k in kept]
        want = trend(kl, (0, 100, 300))
        assert math.isfinite(want.factor) and want.factor != 9.0
        assert again["candidates"][label]["trend"]["factor"] == pytest.approx(want.factor, rel=1e-12)
        assert [b["mean"] for b in again["candidates"][label]["kl"]] == pytest.approx(
            [b.mean for b in buckets(kl, (0, 100, 300))], rel=1e-12)
    assert "trend fitted again at git" in (out / "report.md").read_text()
    (out / "documents" / "doc-1.json").unlink()
    before = (out / "results.json").read_text()
    with pytest.raises(script.KVQuantError, match="doc-1.json is missing"):
        script.main([str(config), "--out", str(out), "--render-only", "--refit"])
    assert (out / "results.json").read_text() == before
