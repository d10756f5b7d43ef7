"""experiments/gpu_check.py's whole gated run, the parts a CPU can run: the comparison of a run's results.json with
the committed CPU report's (reports/int4/results.json against itself, against copies with one verdict flipped or the
KL moved, with a candidate missing), its verdict lines, and the stage itself end to end on a tiny config on the CPU
(a real ``python -m kvquant.run`` in a scratch folder, its files copied, its time limit)."""

import copy
import json
from pathlib import Path

import pytest

from tests.conftest import experiment

ROOT = Path(__file__).resolve().parents[1]
CPU = json.loads((ROOT / "reports" / "int4" / "results.json").read_text())


@pytest.fixture(scope="module")
def gated():
    return experiment("gpu_gated")


def test_the_committed_cpu_report_agrees_with_itself(gated):
    rows = gated.compare_gated(CPU, CPU)
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    (candidate,) = CPU["candidates"]
    metrics = candidate["metrics"]
    kl = [m for m in metrics if metrics[m]["kind"] == "divergence"]
    assert kl == ["kl/wikitext2"]
    # the decision, the candidate's verdict, each metric's verdict, the KL's value after its verdict
    names = sorted(metrics)
    at = names.index("kl/wikitext2") + 1
    assert [r["what"] for r in rows] == (["decision", "int4-g32 verdict"]
                                         + [f"int4-g32 {m} verdict" for m in names[:at]]
                                         + ["int4-g32 kl/wikitext2 value"]
                                         + [f"int4-g32 {m} verdict" for m in names[at:]])
    assert rows[0] == {"what": "decision", "cpu": "fail", "gpu": "fail", "ok": True, "rule": "equal"}
    # the tolerance: a fifth of the CPU's interval half-width, 0.2 * (0.017248 - 0.014149) / 2
    assert rows[at + 2]["rule"] == "within 3.10e-04 (0.2 x the CPU's interval half-width)"


def test_one_flipped_verdict_is_the_one_row_that_disagrees(gated):
    gpu = copy.deepcopy(CPU)
    gpu["candidates"][0]["metrics"]["acc_norm/piqa"]["verdict"] = "pass"
    assert CPU["candidates"][0]["metrics"]["acc_norm/piqa"]["verdict"] == "inconclusive"
    bad = [r for r in gated.compare_gated(gpu, CPU) if not r["ok"]]
    assert bad == [{"what": "int4-g32 acc_norm/piqa verdict", "cpu": "inconclusive", "gpu": "pass", "ok": False,
                    "rule": "equal"}]
    gpu = copy.deepcopy(CPU)
    gpu["decision"] = "pass"
    assert [r["what"] for r in gated.compare_gated(gpu, CPU) if not r["ok"]] == ["decision"]


def test_the_kl_may_move_by_its_tolerance_and_no_more(gated):
    m = CPU["candidates"][0]["metrics"]["kl/wikitext2"]
    tolerance = 0.2 * (m["ci_high"] - m["ci_low"]) / 2
    for shift, ok in ((0.9 * tolerance, True), (-0.9 * tolerance, True), (1.1 * tolerance, False),
                      (-1.1 * tolerance, False)):
        gpu = copy.deepcopy(CPU)
        gpu["candidates"][0]["metrics"]["kl/wikitext2"]["value"] = m["value"] + shift
        rows = {r["what"]: r for r in gated.compare_gated(gpu, CPU)}
        assert rows["int4-g32 kl/wikitext2 value"]["ok"] is ok, shift
        assert all(r["ok"] for w, r in rows.items() if w != "int4-g32 kl/wikitext2 value")


def test_a_candidate_on_one_side_only_disagrees(gated):
    gpu = copy.deepcopy(CPU)
    gpu["candidates"][0]["name"] = "other"
    rows = gated.compare_gated(gpu, CPU)
    bad = [r["what"] for r in rows if not r["ok"]]
    assert bad == [r["what"] for r in rows[1:]]  # every int4-g32 row, then the GPU's extra candidate
    assert bad[-1] == "other verdict" and bad[0] == "int4-g32 verdict" and len(bad) == len(rows) - 1


def test_the_verdict_lines_name_each_row_and_both_wall_times(gated):
    gpu = copy.deepcopy(CPU)
    gpu["results"]["seconds"] = 61.5
    gpu["candidates"][0]["metrics"]["ppl/wikitext2"]["verdict"] = "fail"
    g = {"rows": gated.compare_gated(gpu, CPU), "seconds": gated.seconds(gpu, CPU), "wall_s": 75.25,
         "prepare_s": 3.0, "computed": 13, "reused": 0, "command": "python -m kvquant.run c.yaml", "returncode": 1}
    lines = gated.gated_verdicts(g)
    assert [line.split(" ")[0] for line in lines].count("FAIL") == 1
    assert "FAIL gated run on the GPU: int4-g32 ppl/wikitext2 verdict fail (CPU pass; equal)" in lines
    assert lines[-1] == ("NOTE gated run `python -m kvquant.run c.yaml` (exit 1): GPU 61.5 s model load to gate "
                         "(75.2 s the whole command, 3.0 s converting and loading the model before it, untimed), CPU "
                         "259.8 s (Linux-6.18.44-fc-v857-x86_64-with-glibc2.36, CPU (2 cores), 2026-12-03T08:45:37, "
                         "git 01906f9f0e94883b3b2515f309b0dc64c51e35c5); 13 results measured, 0 reused")
    assert gated.gated_verdicts({"command": "python -m kvquant.run x", "error": "Traceback\nkvquant: error: no"}) == [
        "FAIL gated run on the GPU (python -m kvquant.run x): kvquant: error: no"]


TINY = """name: tiny-gated
model: {path: "local:models/stories260K/hf", dtype: float32, device: auto}
candidates:
  - {quantizer: int4, name: int4-g32, options: {group_size: 32, residual_length: 0}}
eval:
  mode: streaming
  chunk_size: 64
  batch_size: 4
  seed: 1234
  perplexity:
    - {name: tinystories, source: "local:text/tinystories/validation-first1000.jsonl", split: validation,
       layout: documents, limit: 3, max_length: 64}
gate: {max_perplexity_ratio: 1.05, max_kl_divergence: 0.05, perplexity: [tinystories]}
"""


def test_the_stage_runs_a_whole_config_in_a_scratch_folder_and_compares_it(gated, tmp_path):
    """A real run (the tiny model, 3 documents, on the CPU here): its files copied to the output folder, the
    comparison made against a report (here its own results with the decision changed), and a run that outlasts its
    time limit is an error, not a hang."""
    (tmp_path / "tiny.yaml").write_text(TINY)
    out = tmp_path / "out"
    out.mkdir()
    g = gated.run_gated(tmp_path / "tiny.yaml", {}, "cpu", lambda: 300, out, root=ROOT)
    assert "error" not in g, g.get("error")
    assert sorted(p.name for p in out.iterdir()) == ["gated-report.md", "gated-results.json"]
    ran = json.loads((out / "gated-results.json").read_text())
    assert ran["config"]["model"]["device"] == "cpu" and ran["results"]["reused_from_partial"] == 0
    assert g["returncode"] == {"pass": 0, "fail": 1, "inconclusive": 4}[ran["decision"]]
    assert g["command"].startswith(f"python -m kvquant.run {tmp_path / 'tiny.yaml'} --set model.device=cpu --set "
                                   "output_dir=")
    assert g["rows"] == [{"what": "decision", "cpu": None, "gpu": ran["decision"], "ok": False, "rule": "equal"},
                         {"what": "int4-g32 verdict", "cpu": None, "gpu": ran["candidates"][0]["verdict"],
                          "ok": False, "rule": "equal"}]
    assert g["wall_s"] > ran["results"]["seconds"] > 0 and g["prepare_s"] > 0
    assert all(r["ok"] for r in gated.compare_gated(ran, ran))
    slow = gated.run_gated(tmp_path / "tiny.yaml", ran, "cpu", lambda: 0, out, root=ROOT)
    assert slow["error"] == "the gated run did not finish in 1 s (its stage's time limit)"
