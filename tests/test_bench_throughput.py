"""experiments/bench_throughput.py: the bare model's scores are the identity cache's, on lm-eval's own requests;
a quick run writes every variant's ratio to the bare model."""

import json

import pytest

from tests.conftest import MODEL, experiment


@pytest.fixture(scope="module")
def script():
    return experiment("bench_throughput")


@pytest.fixture(scope="module")
def requests(script, model, tokenizer):
    return script.recorded_requests(model, tokenizer, ["tinystories_lastword"], 6)


def test_the_recorded_requests_are_lm_evals_with_contexts_of_different_lengths(requests):
    assert len(requests) == 6  # one continuation (the last word) per document
    assert len({len(c) for c, _ in requests}) > 1  # so the bare batches are padded
    assert all(c and t for c, t in requests)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_the_bare_model_scores_what_the_identity_cache_scores_and_a_quantizer_does_not(script, model, requests,
                                                                                        batch_size):
    args = script.parse(["--batch-size", str(batch_size), "--chunk-size", "128"])
    bare = script.bare_scores(model, requests, batch_size)
    for mode in ("simulated", "streaming"):
        identity = script.scorer_scores(model, requests, mode, "fp16", args)
        assert max(abs(a - b) for a, b in zip(bare, identity)) < 1e-4, mode
        int2 = script.scorer_scores(model, requests, mode, "int2", args)
        assert max(abs(a - b) for a, b in zip(bare, int2)) > 1e-2, mode


def test_a_quick_run_writes_each_variants_ratio_to_the_bare_model(script, tmp_path):
    doc = script.main(["--quick", "--model", MODEL, "--gguf-file", "", "--tasks", "tinystories_lastword",
                       "--quantizers", "fp16", "int4", "--out", str(tmp_path)])
    assert list(doc["variants"]) == ["bare", "simulated fp16", "simulated int4", "streaming fp16", "streaming int4"]
    bare = doc["variants"]["bare"]["seconds"][0]
    for v in doc["variants"].values():  # one round: the ratio is that round's
        assert v["ratio"]["median"] == pytest.approx(bare / v["seconds"][0])
        assert v["tokens_per_s"] == pytest.approx(doc["tokens"] / v["seconds"][0])
    assert doc["variants"]["simulated fp16"]["max_abs_loglik_diff"] < 1e-4
    assert doc["variants"]["simulated int4"]["max_abs_loglik_diff"] > 1e-3
    report = (tmp_path / "report.md").read_text()
    assert "| streaming int4 |" in report and json.loads((tmp_path / "results.json").read_text()) == doc
