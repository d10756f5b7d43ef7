"""experiments/bench_fewshot.py: a quick run on stories260K writes planned and fed tokens that agree, fewer
shared than unshared, and the same log-likelihoods both ways."""

import json

from tests.conftest import MODEL, experiment


def test_a_quick_run_feeds_the_planned_tokens_and_scores_alike(tmp_path):
    script = experiment("bench_fewshot")
    doc = script.main(["--quick", "--model", MODEL, "--gguf-file", "", "--chunk-size", "16", "--plan-chunks", "16",
                       "512", "--out", str(tmp_path)])
    row = doc["shots"]["2"]
    plan, fed = row["planned_tokens_per_document"], row["fed_tokens_per_document"]
    assert fed == plan["16"]  # the scorer's own count (main raises where it is not the plan's)
    assert fed["shared"] < fed["unshared"] <= row["request_tokens_per_document"]
    assert plan["512"]["shared"] <= plan["512"]["unshared"]
    assert row["max_abs_loglik_diff"] < 1e-3  # batched rows: float noise, not another computation
    assert row["exact"] == {"requests": 16, "max_abs_loglik_diff": 0.0}  # 4 documents, 4 choices, one row a batch
    assert json.loads((tmp_path / "results.json").read_text())["shots"]["2"] == json.loads(json.dumps(row))
    assert "| 2 |" in (tmp_path / "report.md").read_text()
