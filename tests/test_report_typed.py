"""report.md, the plots and the tables are rendered from the typed ``RunResult`` (issue 38, item 2): a run built
by hand here (no model, no measurement) gives the table rows its values say, for a PASS, a FAIL, an INCONCLUSIVE
and a not-gated metric, the divergence quantiles, and a staged run's stages; results.json keeps its format."""

import dataclasses
import json
import math

import numpy as np
import pytest

from kvquant.runner import report
from kvquant.cache.reads import Reads
from kvquant.runner.report_facts import candidate_reports, stage_rows
from kvquant.runner.report_markdown import markdown
from kvquant.experiment.results import (Decision, Exercise, Measured, Memory, MetricId, MetricRow, Outcomes, Provenance,
    RunResult, StageServing, Staged, Verdict)

STORIES = "local:text/tinystories/validation-first1000.jsonl"
ENV = {"python": "3.x", "kvquant": "k", "torch": "t", "transformers": "tf", "lm_eval": "le", "datasets": "d",
       "kvquant_source_sha256": "sha", "git_commit": "abc", "machine": "test machine", "date": "2000-01-01T00:00:00"}
ACC = MetricId("acc", "tinystories_lastword")
PPL = MetricId("ppl", "tinystories")
KL, TOP1 = MetricId("kl", "tinystories"), MetricId("top1", "tinystories")
KL_WINDOWS = ((0.1, 0.2, 0.3), (0.4, 0.5))  # per position, two windows: the median of all five is 0.3


@pytest.fixture(scope="module")
def config(tiny_config):
    return tiny_config("typed",
                       candidates=[{"quantizer": "int8", "name": "int8"}, {"quantizer": "int4", "name": "int4"}],
                       eval={"perplexity": [{"name": "tinystories", "source": STORIES, "limit": 4, "max_length": 64}],
                             "tasks": {"names": ["tinystories_lastword"], "limit": 50}},
                       gate={"tasks": ["tinystories_lastword"], "perplexity": ["tinystories"], "bootstrap": 1000,
                             "max_kl_divergence": 0.05})


def memory(bits: float, ratio: float) -> Memory:
    return Memory({"quantizer": "q", "residual_length": 0}, {"bits_per_element": bits, "ratio": ratio, "tokens": 256},
                  {"ratio": ratio / 2, "bits_per_element": bits / 2, "fp16_bytes": 3 * 2**20})


def exercise(lengths: tuple[int, ...], bits: float) -> Exercise:
    return Exercise(Reads(keys_quantized=3, keys=4, values_quantized=3, values=4), lengths, bits)


def hand_built_run(config) -> RunResult:
    """int8 passes its accuracy and fails perplexity; int4's accuracy is inconclusive (120 more documents), its
    perplexity not gated, its KL divergence passes."""
    rows = {
        "pass": MetricRow("int8", ACC, 0.82, 0.82, 50, ci_low=0.98, ci_high=1.02, quantized_share=0.75,
                          confidence=0.95),
        "fail": MetricRow("int8", PPL, 12.5, 10.0, 4, ci_low=0.78, ci_high=0.82, confidence=0.95),
        "inconclusive": MetricRow("int4", ACC, 0.8, 0.82, 50, ci_low=0.9, ci_high=1.05, quantized_share=0.5,
                                  confidence=0.9),
        "not gated": MetricRow("int4", PPL, 10.0, 10.0, 4, gated=False, ci_low=0.99, ci_high=1.01, confidence=0.95),
        "kl": MetricRow("int4", KL, 0.02, 0.0, 2, ci_low=0.01, ci_high=0.03, confidence=0.95),
        "top1": MetricRow("int4", TOP1, 0.9, 1.0, 2, gated=False, ci_low=0.85, ci_high=0.95, confidence=0.95),
    }
    verdicts = [Verdict(rows["pass"], 0.97, 1.0, "pass"), Verdict(rows["fail"], 1 / 1.05, 0.8, "fail"),
                Verdict(rows["inconclusive"], 0.97, 0.8 / 0.82, "inconclusive", more=120),
                Verdict(rows["not gated"], math.nan, 1.0, "not gated"), Verdict(rows["kl"], 0.05, 0.02, "pass"),
                Verdict(rows["top1"], math.nan, 0.9, "not gated")]
    ppl = Outcomes(PPL, (4.0, 6.0), (100, 100))
    results = {
        "baseline": Measured("baseline", (Outcomes(ACC, (1.0, 0.0)), ppl), memory(32.0, 1.0)),
        "int8": Measured("int8", (Outcomes(ACC, (1.0, 0.0), (), exercise((40, 50, 60), 8.5)),
                                  Outcomes(PPL, (5.0, 7.0), (100, 100))), memory(8.5, 0.266)),
        "int4": Measured("int4", (Outcomes(ACC, (1.0, 0.0)), ppl,
                                  Outcomes(KL, (0.6, 0.9), (3, 2), None, KL_WINDOWS), Outcomes(TOP1, (3.0, 2.0),
                                                                                              (3, 2))),
                         memory(4.25, 0.133)),
    }
    decision = Decision("inconclusive", None, {"int8": False, "int4": False}, verdicts, "int4 is undecided",
                        {"int8": "fail", "int4": "inconclusive"})
    return RunResult(config, tuple(config.candidates), results, tuple(v.row for v in verdicts), decision,
                     "python -m kvquant.run typed.yaml", Provenance(6, 0))


def metric_lines(text: str) -> dict[tuple[str, str], str]:
    """The metrics table's rows by (candidate, metric)."""
    section = text.split("## Metrics")[1].split("\n\n")[1]
    return {tuple(cell.strip() for cell in line.split("|")[1:3]): line for line in section.splitlines()[2:]}


def test_metric_rows_state_each_verdict_with_its_values(config):
    run = hand_built_run(config)
    text = markdown(run, candidate_reports(run), "run-1", ENV)
    lines = metric_lines(text)
    assert lines[("int8", "acc/tinystories_lastword")] == (
        "| int8 | acc/tinystories_lastword | 0.8200 | 0.8200 | 1.0000 | [0.9800, 1.0200] (95.0%) | 0.9700 | PASS | "
        "75.0% | 50 / 58 | 8.50 | 50 |")  # lengths 40, 50, 60: median 50, p90 58
    assert lines[("int8", "ppl/tinystories")] == (
        "| int8 | ppl/tinystories | 12.5000 | 10.0000 | 0.8000 | [0.7800, 0.8200] (95.0%) | 0.9524 | FAIL | - | - | - "
        "| 4 |")  # relative: baseline / candidate perplexity = 10 / 12.5
    assert lines[("int4", "acc/tinystories_lastword")] == (
        "| int4 | acc/tinystories_lastword | 0.8000 | 0.8200 | 0.9756 | [0.9000, 1.0500] (90.0%) | 0.9700 | "
        "INCONCLUSIVE, ~120 more to decide | 50.0% | - | - | 50 |")
    assert lines[("int4", "ppl/tinystories")] == (
        "| int4 | ppl/tinystories | 10.0000 | 10.0000 | 1.0000 | [0.9900, 1.0100] (95.0%) | - | not gated | - | - | - "
        "| 4 |")
    assert lines[("int4", "kl/tinystories")].startswith("| int4 | kl/tinystories | 0.0200 | 0.0000 | 0.0200 |")
    assert len(lines) == 6
    assert "**Decision: INCONCLUSIVE** — int4 is undecided." in text


def test_candidates_and_divergence_tables_read_the_typed_run(config):
    run = hand_built_run(config)
    text = markdown(run, candidate_reports(run), "run-1", ENV)
    assert "| int8 | quantizer=q, residual_length=0 | 8.50 | 0.266 | 0.133 | FAIL |" in text
    assert "| int4 | quantizer=q, residual_length=0 | 4.25 | 0.133 | 0.067 | INCONCLUSIVE |" in text
    assert "(fp16 takes 3.0 MiB per sequence there)" in text and "holds 32 bits/element" in text
    row = next(line for line in text.splitlines() if line.startswith("| int4 | tinystories |"))
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert cells[2] == "0.02000 [0.01000, 0.03000]"  # the mean: the row's value and interval
    p99 = np.quantile([0.1, 0.2, 0.3, 0.4, 0.5], 0.99)  # of every position's KL, both windows together
    assert cells[3].startswith("0.30000 [") and cells[4].startswith(f"{p99:.5f} [")
    assert cells[5] == "0.9000 [0.8500, 0.9500]"  # top-1 agreement of the same set


def test_results_json_is_rendered_from_the_same_reports(config, tmp_path):
    """The document keeps its format: per candidate the metrics by name, perplexity sums, KL quantiles."""
    run = hand_built_run(config)
    files, written = report.render(tmp_path, run, "run-1", ENV)
    doc = json.loads(files["results.json"])
    assert written == {k: v for k, v in doc.items() if k != "signature"}  # what the runner deploys
    int8, int4 = doc["candidates"]
    assert list(int8["metrics"]) == ["acc/tinystories_lastword", "ppl/tinystories"]
    assert int8["metrics"]["ppl/tinystories"]["nll_sum"] == 12.0 and int8["metrics"]["ppl/tinystories"][
        "baseline_nll_sum"] == 10.0
    assert int8["metrics"]["acc/tinystories_lastword"]["median_length"] == 50.0
    assert int4["metrics"]["kl/tinystories"]["median"] == pytest.approx(0.3)
    assert int4["metrics"]["acc/tinystories_lastword"]["more_documents"] == 120
    assert doc["environment"] == ENV and doc["run_id"] == "run-1"
    assert files["report.md"] == markdown(run, candidate_reports(run), "run-1", ENV)
    assert files["plot.png"].startswith(b"\x89PNG") and "probe.png" not in files


def test_an_undecided_row_says_when_its_task_has_too_few_documents_left(config, tmp_path):
    """int4's 120 more documents against 100 left in the task: the metrics table and results.json say so."""
    run = hand_built_run(config)
    verdicts = tuple(dataclasses.replace(v, left=100) if v.more else v for v in run.decision.verdicts)
    run = dataclasses.replace(run, decision=dataclasses.replace(run.decision, verdicts=verdicts))
    files, _ = report.render(tmp_path, run, "run-1", ENV)
    assert "INCONCLUSIVE, ~120 more to decide, more than the 100 the task has left |" in \
        metric_lines(files["report.md"])[("int4", "acc/tinystories_lastword")]
    int4 = json.loads(files["results.json"])["candidates"][1]["metrics"]["acc/tinystories_lastword"]
    assert (int4["more_documents"], int4["documents_left"]) == (120, 100)


def test_stage_rows_read_the_serving_figures_and_the_gate(config):
    run = hand_built_run(config)
    serving = {name: StageServing(4, 160, 4000, 1000.0, 1000, own, 0, 8000, (1.0, 2.0), 1.5, 2.0)
               for name, own in (("baseline", 750.0), ("int8", 250.0), ("int4", 125.0))}
    staged = Staged(serving, ("int8", "int4"), 3000, {"requests": 4, "prefix": 128, "suffix": 32, "decode_steps": 8,
                                                      "memory_budget": "3000B"}, {"int4": True}, "int8")
    rows = stage_rows(dataclasses.replace(run, staged=staged), candidate_reports(run))
    assert [(r.name, r.max_batch, r.worst, r.passed, r.sharing) for r in rows] == [
        ("baseline", 2, 1.0, True, False),  # (3000 - 1000) // 750
        ("int8", 8, 0.8, False, False),  # the lowest gated relative score: perplexity's 10 / 12.5
        ("int4", 16, 0.8 / 0.82, False, True)]  # the not-gated perplexity row does not count


def test_flips_table_counts_the_answers_changed_each_way(config):
    """Baseline right on documents 0, 1, 4 of 5; int4 right on 1, 2, 4: one right-to-wrong (0), one wrong-to-right
    (2), the same accuracy. int8 answers as the baseline does. Exact intervals (Clopper-Pearson) at 95%."""
    run = hand_built_run(config)
    scores = {"baseline": (1.0, 1.0, 0.0, 0.0, 1.0), "int8": (1.0, 1.0, 0.0, 0.0, 1.0),
              "int4": (0.0, 1.0, 1.0, 0.0, 1.0)}
    run = dataclasses.replace(run, results={
        label: dataclasses.replace(m, outcomes=tuple(dataclasses.replace(o, scores=scores[label]) if o.metric == ACC
                                                     else o for o in m.outcomes))
        for label, m in run.results.items()})
    text = markdown(run, candidate_reports(run), "run-1", ENV)
    assert "| int4 | acc/tinystories_lastword | 5 | 1 (20.0% [0.5%, 71.6%]) | 1 (20.0% [0.5%, 71.6%]) | " \
           "2 (40.0% [5.3%, 85.3%]) |" in text
    assert "| int8 | acc/tinystories_lastword | 5 | 0 (0.0% [0.0%, 52.2%]) | 0 (0.0% [0.0%, 52.2%]) | " \
           "0 (0.0% [0.0%, 52.2%]) |" in text


def test_the_environment_line_names_the_tokenizer_and_gguf_versions_where_recorded(config):
    """tokenizers and gguf (not pinned) read the data and turn a GGUF into the model measured: a report names the
    versions it ran with; results.json files written before they were recorded still render."""
    run = hand_built_run(config)
    line = lambda env: next(x for x in markdown(run, candidate_reports(run), "run-1", env).splitlines()  # noqa: E731
                            if x.startswith("- environment: "))
    assert line({**ENV, "tokenizers": "0.99.1", "gguf": "0.98.2"}) == (
        "- environment: test machine; python 3.x, torch t, transformers tf, lm_eval le, tokenizers 0.99.1, "
        "gguf 0.98.2, kvquant k (measuring sources sha); git abc; 2000-01-01T00:00:00")
    assert line(ENV) == ("- environment: test machine; python 3.x, torch t, transformers tf, lm_eval le, kvquant k "
                         "(measuring sources sha); git abc; 2000-01-01T00:00:00")
