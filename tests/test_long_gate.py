"""The long-context gate wired into the runner (issue 40): needle tasks, position buckets as metrics, which rows
``gate.min_context`` gates, the baseline-above-chance rule, the length verdicts, and the bad inputs refused before
the model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from scipy.stats import binom

import kvquant.run
from kvquant.errors import KVQuantError
from kvquant.runner.gate import (INCONCLUSIVE, LengthVerdict, above_chance, is_gated, length_verdicts, metric_length,
    needles_at_chance)
from kvquant.runner.counts import MIN_PASS
from kvquant.experiment.gate_config import GateConfig
from kvquant.experiment.results import MetricId, MetricRow, long_outcomes
from kvquant.scoring.needles import DEPTHS, needle_chance, task_documents
from kvquant.experiment.long_config import needle_task
from tiny_configs import set_args as S

STORIES = "local:text/tinystories/validation-first1000.jsonl"


# --- needle tasks -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, found", [("needle_single_4096", ("single", 4096)),
                                         ("needle_variables_8", ("variables", 8)), ("arc_easy", None),
                                         ("passkey_512", None), ("needle_single", None)])
def test_needle_task_names(name, found):
    assert needle_task(name) == found


@pytest.mark.parametrize("name, message", [("needle_triple_512", "needle kind 'triple' is unknown"),
                                           ("needle_single_0512", "without leading zeros"),
                                           ("needle_single_0", "a positive length")])
def test_bad_needle_task_names_are_refused(name, message):
    with pytest.raises(KVQuantError, match=message):
        needle_task(name)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvquant.paths import data_dir

    return AutoTokenizer.from_pretrained(str(data_dir() / "models/stories260K/hf"))


def test_needle_task_documents_depend_on_the_name_and_index_only(tokenizer):
    seven = task_documents(tokenizer, "needle_single_480", 7)
    assert task_documents(tokenizer, "needle_single_480", 3) == seven[:3]  # a longer limit only adds documents
    assert [d["depth"] for d in seven] == [*DEPTHS, DEPTHS[0], DEPTHS[1]]
    assert [d["index"] for d in seven] == [0, 0, 0, 0, 0, 1, 1]
    assert all(d["chance"] == needle_chance("needle_single_480") == 0.25 for d in seven)
    assert all(d["choices"][d["gold"]] == d["target"] and d["target"] in d["context"] for d in seven)
    assert len({d["target"] for d in seven}) == 7
    assert needle_chance("needle_variables_4096") == 0.5


def test_a_needle_longer_than_its_haystack_is_refused(tokenizer):
    with pytest.raises(KVQuantError, match="needle length 300 leaves a haystack of"):
        task_documents(tokenizer, "needle_single_300", 2)


# --- position buckets as metrics ----------------------------------------------------------------------------------

def test_long_outcomes_sum_each_documents_positions_per_bucket():
    raw = {"kl": [[0.1, 0.2, 0.3, 0.4, 0.5], [1.0, 2.0, 3.0]], "top1": [[1, 1, 0, 1, 0], [0, 1, 1]]}
    out = {o.metric.name: o for o in long_outcomes("wiki", raw, [2, 4, 8])}
    assert list(out) == ["kl/wiki@2", "top1/wiki@2", "kl/wiki@4", "top1/wiki@4", "kl/wiki@8", "top1/wiki@8"]
    assert out["kl/wiki@2"].scores == pytest.approx((0.3, 3.0)) and out["kl/wiki@2"].tokens == (2, 2)
    assert out["kl/wiki@4"].scores == pytest.approx((0.7, 3.0)) and out["kl/wiki@4"].tokens == (2, 1)
    assert out["kl/wiki@8"].scores == pytest.approx((0.5, 0.0)) and out["kl/wiki@8"].tokens == (1, 0)
    assert out["top1/wiki@4"].scores == (1.0, 1.0)
    assert out["kl/wiki@4"].value == pytest.approx(3.7 / 3)  # position-weighted over documents
    assert [metric_length(o.metric) for o in out.values()] == [2, 2, 4, 4, 8, 8]
    assert not long_outcomes("wiki", raw, [2, 4, 8, 16])[-1].metric.source.endswith("@16")  # past every end: none


def test_a_buckets_exercise_is_what_its_own_chunks_read():
    """A bucket inside a full-precision window reads nothing quantized, whatever the whole document read."""
    quantized = {"keys_quantized": 90, "keys": 100, "values_quantized": 90, "values": 100}
    exact = {"keys_quantized": 0, "keys": 100, "values_quantized": 0, "values": 100}
    raw = {"kl": [[0.0] * 7, [0.0] * 7], "top1": [[1] * 7, [1] * 7], "lengths": [8, 8],
           "reads": {k: a + b for (k, a), b in zip(exact.items(), quantized.values())},
           "chunk_reads": [[0, 2, exact], [2, 4, quantized], [4, 6, quantized], [6, 8, quantized]]}
    out = {o.metric.name: o for o in long_outcomes("wiki", raw, [2, 3, 7])}
    assert out["kl/wiki@2"].exercise.quantized_share == 0  # positions 0-1: the first chunk only
    assert out["kl/wiki@3"].exercise.quantized_share == 0.9  # position 2: the second chunk
    assert out["kl/wiki@7"].exercise.reads.keys == 300  # positions 3-6: the chunk across the edge counts too


@pytest.mark.parametrize("metric, min_context, gated", [
    (MetricId("kl", "wiki@1024"), None, False), (MetricId("kl", "wiki@1024"), 2048, True),
    (MetricId("kl", "wiki@4096"), 2048, False), (MetricId("acc", "needle_single_2048"), 2048, True),
    (MetricId("acc", "needle_single_4096"), 2048, False), (MetricId("acc", "arc_easy"), None, True),
    (MetricId("kl", "wiki"), None, True), (MetricId("top1", "wiki@1024"), 2048, False),  # no top-1 threshold
])
def test_min_context_gates_the_long_rows_up_to_it(metric, min_context, gated):
    assert is_gated(metric, GateConfig(max_kl_divergence=0.05, min_context=min_context)) is gated


def _row(candidate, metric, value, low, high, baseline=1.0, n=100):
    return MetricRow(candidate, metric, value, baseline, n, False, low, high, 1.0, 0.95)


@pytest.mark.parametrize("n, chance", [(20, 0.25), (40, 0.5), (8, 0.25)])
def test_above_chance_is_the_exact_one_sided_binomial_test(n, chance):
    least = next(k for k in range(n + 1) if binom.sf(k - 1, n, chance) < 0.025)  # the fewest right that show it
    assert above_chance(least, n, chance, 0.95) and not above_chance(least - 1, n, chance, 0.95)


def test_a_needle_is_at_chance_on_every_document_the_baseline_scored():
    """Decided once per task from the baseline's own documents (all of them), for every candidate alike."""
    from kvquant.experiment.results import Measured, Outcomes

    scores = lambda right, n: tuple([1.0] * right + [0.0] * (n - right))  # noqa: E731
    baseline = Measured("baseline", (
        Outcomes(MetricId("acc", "needle_single_512"), scores(10, 20)),  # 10 of 20 at chance 1/4: above
        Outcomes(MetricId("acc", "needle_variables_512"), scores(13, 20)),  # 13 of 20 at chance 1/2: not shown
        Outcomes(MetricId("acc", "arc_easy"), scores(0, 20))))
    assert needles_at_chance(baseline, GateConfig()) == {"needle_variables_512"}


def test_length_verdicts_from_bucket_and_needle_rows():
    policy = GateConfig(max_kl_divergence=0.05, min_context=1024)
    kl = lambda c, end, lo, hi: _row(c, MetricId("kl", f"wiki@{end}"), (lo + hi) / 2, lo, hi)  # noqa: E731
    needle = lambda c, length, lo, hi, base=0.9: _row(c, MetricId("acc", f"needle_single_{length}"),  # noqa: E731
                                                      base * (lo + hi) / 2, lo, hi, baseline=base)
    rows = [kl("a", 1024, 0.01, 0.02), kl("a", 2048, 0.02, 0.04), kl("a", 4096, 0.04, 0.07),
            needle("a", 2048, 0.98, 1.0), needle("a", 4096, 0.5, 0.8),
            kl("b", 1024, 0.01, 0.02), kl("b", 2048, 0.06, 0.09), kl("b", 4096, 0.01, 0.02),
            needle("b", 2048, 0.99, 1.0), needle("b", 4096, 0.2, 0.4)]
    got = length_verdicts(rows, policy)
    assert got["a"] == LengthVerdict(2048, 4096)  # 4096: KL inconclusive, the needle fails
    assert got["b"] == LengthVerdict(1024, 2048)
    assert got["b"].describe() == "passes up to 1K, fails from 2K"
    # the needle at 4096 left out (the baseline at chance there): 4096 is judged on its KL alone
    left_out = length_verdicts(rows, policy, frozenset({"needle_single_4096"}))
    assert left_out["a"] == LengthVerdict(2048, None, (4096,)) and left_out["b"] == LengthVerdict(1024, 2048)


def test_a_candidate_left_with_no_gated_metric_is_not_a_pass():
    """A needle the baseline cannot do is ungated; a candidate with nothing else gated is shown nothing."""
    from kvquant.runner.gate import decide

    row = _row("int2", MetricId("acc", "needle_single_480"), 0.1, 0.0, 0.5)
    decision = decide([row], {"int2": 6.0}, GateConfig(min_context=480))
    assert decision.decision == INCONCLUSIVE and decision.statuses == {"int2": INCONCLUSIVE}
    assert "int2: no gated metric was left to judge" in decision.reason


# --- bad input, refused before the model loads --------------------------------------------------------------------

@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump({
        "name": "long", "output_dir": str(tmp_path / "reports"), "model": {"path": "local:models/stories260K/hf"},
        "candidates": [{"quantizer": "int8", "name": "int8", "options": {"residual_length": 0}}],
        "eval": {"mode": "streaming", "chunk_size": 64,
                 "perplexity": [{"name": "tinystories", "source": STORIES, "layout": "stream", "limit": 2,
                                 "max_length": 128}],
                 "long_context": {"text": "tinystories", "lengths": [128, 256, 512], "documents": 2}},
        "gate": {"max_kl_divergence": 0.05, "min_context": 256}}))
    return path


def _refused(capsys, argv, needle):
    code = kvquant.run.main([str(a) for a in argv])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], (code, lines)


@pytest.mark.parametrize("overrides, needle", [
    (["eval.long_context.lengths=[512, 256]"], "eval.long_context.lengths must increase (position buckets in order"),
    (["eval.long_context.lengths=[256, 256]"], "lengths must increase"),
    (["eval.long_context.lengths=[1]"], "lengths[0] must be an integer >= 2"),
    (["eval.long_context.text=wiki"], "eval.long_context.text: 'wiki' is not among eval.perplexity"),
    (["eval.long_context=null"], "gate.min_context: no long-context metric to judge"),
    (["gate.max_kl_divergence=null"], "gate.min_context: no long-context metric to judge"),
    (["gate.min_context=300"], "gate.min_context 300 is no length measured here; the long-context metrics are "
                               "judged at 128, 256, 512 tokens"),
    (["eval.long_context.lengths=[256, 1024]", "gate.min_context=1024"],
     "eval.long_context.lengths: 1024 tokens is beyond the model's context (512 positions)"),
    (["eval.long_context.documents=5000"], "holds 767 windows of 512 tokens, fewer than documents (5000)"),
    (["eval.long_context.documents=1"], "documents must be in 2..10000 (the intervals are over documents"),
    (["eval.tasks.names=[needle_single_480]", "gate.min_context=480"], "the needle tasks needle_single_480 (480) "
                                                                       "end inside a position bucket"),
    (["eval.tasks.names=[needle_single_300]", "gate.min_context=null"], "needle length 300 leaves a haystack of"),
    (["eval.tasks.names=[needle_single_1024]", "gate.min_context=null"],
     "needle_single_1024': the model reads 512 tokens, not more than the needle task's length"),
    (["eval.tasks.names=[needle_single_512]", "gate.min_context=null"],
     "needle_single_512': the model reads 512 tokens, not more than"),
    (["eval.tasks.names=[needle_single_0300]", "gate.min_context=null"], "without leading zeros"),
])
def test_bad_long_context_input_is_one_line_before_the_model_loads(config, no_model_load, capsys, overrides, needle):
    _refused(capsys, [config, *S(*overrides)], needle)
    assert not (config.parent / "reports").exists()


# --- the whole run ------------------------------------------------------------------------------------------------

def test_a_run_gates_position_buckets_up_to_min_context_and_two_documents_decide_nothing(config, capsys):
    """stories260K, 2 windows of 256 tokens: int2 g8's divergence exceeds a 0.05 nats threshold in every bucket and
    fp8's stays below it; the buckets up to min_context are gated, the others reported. Two documents decide no
    bucket (kvquant.runner.counts): each is "too few documents", the decision inconclusive, the length verdicts
    empty. Before issue 53, these two documents made int2 "fail from 64" and fp8 "pass up to 256" and chose fp8."""
    text = yaml.safe_load(config.read_text())
    text["candidates"] = [{"quantizer": "fp8_e4m3", "name": "fp8", "options": {"residual_length": 0}},
                          {"quantizer": "int2", "name": "int2", "options": {"group_size": 8, "residual_length": 0}}]
    config.write_text(yaml.safe_dump(text))
    code = kvquant.run.main([str(config), *S("gate.perplexity=[]", "eval.perplexity.0.max_length=32",
                                             "eval.long_context.lengths=[64, 128, 256]", "gate.min_context=128")])
    doc = json.loads((config.parent / "reports/long/results.json").read_text())
    metrics = {c["name"]: c["metrics"] for c in doc["candidates"]}
    for end in (64, 128, 256):
        fp8, int2 = metrics["fp8"][f"kl/tinystories@{end}"], metrics["int2"][f"kl/tinystories@{end}"]
        # two documents: the studentized interval is unbounded, so the means (not the intervals) are ordered
        assert 0 < fp8["value"] < 0.05 < int2["value"], (end, fp8, int2)
        assert fp8["ci_low"] <= fp8["value"] <= fp8["ci_high"] and int2["ci_low"] <= int2["value"] <= int2["ci_high"]
        assert fp8["gated"] is int2["gated"] is (end <= 128)
        assert int2["n"] == 2 and fp8["passed"] is not True and int2["passed"] is not True
        if end <= 128:
            assert fp8["verdict"] == int2["verdict"] == "too few documents"
    assert doc["long_context"]["candidates"]["int2"]["fails_from"] is None
    assert doc["long_context"]["candidates"]["fp8"]["passes_up_to"] is None
    assert doc["decision"] == "inconclusive" and doc["chosen"] is None and code == 4
    assert "too few documents" in (config.parent / "reports/long/report.md").read_text()


@pytest.mark.parametrize("min_context, verdict", [(None, "fail"), (1024, "pass")])
def test_a_length_shown_to_fail_is_part_of_the_decision_without_min_context(min_context, verdict):
    """Issue 58: without gate.min_context the length verdict was reported only, so a candidate whose KL "fails from
    2048" still passed (exit 0, and a DEPLOY.md told an engine to use it). A length shown to fail is now a fail;
    with min_context, the lengths beyond it bound the deployment (DEPLOY.md), not the decision."""
    from kvquant.runner.gate import decide

    policy = GateConfig(max_kl_divergence=0.01, min_context=min_context)
    docs = MIN_PASS  # enough documents that each end decides (kvquant.runner.counts)
    short = MetricRow("int4", MetricId("kl", "wiki"), 0.004, 0.0, docs, True, 0.003, 0.005, 1.0, 0.95)
    bucket = {n: MetricRow("int4", MetricId("kl", f"wiki@{n}"), v, 0.0, docs, is_gated(MetricId("kl", f"wiki@{n}"),
                                                                                         policy), lo, hi, 1.0, 0.95)
              for n, v, lo, hi in ((1024, 0.005, 0.004, 0.006), (2048, 0.03, 0.02, 0.04))}
    decision = decide([short, *bucket.values()], {"int4": 5.0}, policy)
    assert decision.statuses["int4"] == verdict and decision.decision == verdict
    assert ("int4: fails from 2K tokens of context (its length verdict)" in decision.reason) is (verdict == "fail")


def test_a_row_not_gated_is_never_passed():
    """Issue 58: results.json wrote ``passed: true`` for rows reported only (a KL of 0.536 against 0.3)."""
    from kvquant.runner.gate import judge

    policy = GateConfig(max_kl_divergence=0.3, min_context=256)
    row = MetricRow("int2", MetricId("kl", "wiki@1024"), 0.536, 0.0, 8, False, 0.5, 0.6, 1.0, 0.95)
    assert judge(row, policy).verdict == "not gated" and judge(row, policy).passed is None


def test_deploy_md_bounds_the_context_to_the_length_verdict():
    from kvquant.integrations.deploy import context_text
    from kvquant.integrations.deploy_read import Report

    def report(lengths):
        return Report(Path("r"), "pass", None, (), 30, "id", "why", "cmd", "m", lengths)

    text = context_text(report((4096, 8192)))
    assert "shown safe up to 4,096 tokens of context and shown to fail from 8,192" in text
    assert "`--max-model-len 4096`" in text and "`-c 4096`" in text
    assert "shown safe at no context length measured" in context_text(report((None, 512)))
    assert context_text(report(None)) == ""


# --- the planner at the fitted context ----------------------------------------------------------------------------

INT4 = {"quantizer": "int4", "group_size": 32, "residual_length": 0, "key_group": 32, "value_group": 32}


def _report(folder, long_context, sign=True, model="local:models/stories260K/hf", verdicts=None):
    from kvquant.signing import signed_json

    folder.mkdir(parents=True)
    verdicts = verdicts or {"int4": "pass", "int2": "fail"}
    doc = {"decision": "pass", "long_context": long_context, "config": {"model": {"path": model}},
           "candidates": [{"name": name, "settings": {**INT4, "quantizer": name}, "verdict": verdict}
                          for name, verdict in verdicts.items()]}
    (folder / "results.json").write_text(signed_json(doc) if sign else json.dumps(doc))
    return folder


LENGTHS = {"min_context": None, "candidates": {
    "int4": {"passes_up_to": 2048, "fails_from": 8192, "inconclusive": [4096], "not_exercised": [],
             "summary": "passes up to 2K, fails from 8K, inconclusive at 4K"},
    "int2": {"passes_up_to": None, "fails_from": 512, "inconclusive": [], "not_exercised": [],
             "summary": "passes at no length, fails from 512"}}, "baseline_at_chance": []}


def test_the_planner_plans_at_the_context_a_report_showed_safe(tmp_path, monkeypatch, capsys):
    """The report's own model and setting: its context, its candidate's cache (int4 g32, no window), no warning."""
    from kvquant.plan import main

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    folder = _report(tmp_path / "rep", LENGTHS, model="llama-3.1-8b")
    assert main(["--model", "llama-3.1-8b", "--context-from", f"{folder}:int4", "--json"]) == 0
    captured = capsys.readouterr()
    fitted = json.loads(captured.out)
    assert captured.err == "" and fitted["context_from"]["warning"] is None
    assert main(["--model", "llama-3.1-8b", "--context", "2048", "--cache", "int4:group_size=32,residual_length=0",
                 "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert fitted["context"] == 2048 and fitted["kv_bytes"] == plain["kv_bytes"] and len(fitted["settings"]) == 1
    assert fitted["context_from"]["verdict"] == "passes up to 2K, fails from 8K, inconclusive at 4K"


def test_the_planner_says_loudly_when_the_model_is_not_the_one_measured(tmp_path, monkeypatch, capsys):
    """Before: Llama-3.1-8B planned at a stories260K report's context, exit 0 and silent."""
    from kvquant.plan import main

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    folder = _report(tmp_path / "rep", LENGTHS)
    assert main(["--model", "llama-3.1-8b", "--context-from", f"{folder}:int4"]) == 0
    captured = capsys.readouterr()
    assert "warning: the context was shown safe for int4 on local:models/stories260K/hf, not on llama-3.1-8b" \
        in captured.err
    assert "WARNING: the context was shown safe" in captured.out and "int4 (as measured)" in captured.out


def test_a_context_from_a_report_prints_its_text_inert(tmp_path, monkeypatch, capsys):
    """Before: the summary went to the terminal raw: escape sequences (clear screen, window title, BEL) and
    newlines that forge lines."""
    from kvquant.plan import main

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    hostile = {**LENGTHS, "candidates": {"int4": {**LENGTHS["candidates"]["int4"],
                                                  "summary": "ok\x1b[2J\x1b]0;title\x07\nFAKE LINE\u202e"}}}
    folder = _report(tmp_path / "rep", hostile, model="evil\x1b[31m\nFAKE MODEL")
    assert main(["--model", "llama-3.1-8b", "--context-from", f"{folder}:int4"]) == 0
    captured = capsys.readouterr()
    for stream in (captured.out, captured.err):
        assert "\x1b" not in stream and "\x07" not in stream and "\u202e" not in stream
        assert not any(line.startswith(("FAKE", "\x1b")) for line in stream.splitlines())
    assert "ok\\u001b[2J\\u001b]0;title\\u0007\\u000aFAKE LINE\\u202e" in captured.out


@pytest.mark.parametrize("argument, sign, needle", [
    ("{rep}:int2", True, "int2 is shown safe at no context in"),
    ("{rep}:int8", True, "has no length verdict for 'int8'; it has int4, int2"),
    ("{rep}", True, "must be REPORT_DIR:CANDIDATE"),
    ("{rep}:int4", False, "carries no signature"),
    ("{none}:int4", True, "holds no length verdict"),
    ("{failed}:int4", True, "int4 FAILED the gate in"),
    # probe 58 (l26): refused as "--context must be between 1 and ...", an option the user did not give
    ("{huge}:int4", True, "int4's passes_up_to is 1000000000000000000000000000000, not a number of tokens in "
                          "1..1,073,741,824"),
])
def test_a_context_the_report_does_not_give_is_one_line(tmp_path, monkeypatch, capsys, argument, sign, needle):
    from kvquant.plan import main

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    rep, none = _report(tmp_path / "rep", LENGTHS, sign), _report(tmp_path / "none", None)
    failed = _report(tmp_path / "failed", LENGTHS, verdicts={"int4": "fail"})
    huge = _report(tmp_path / "huge", {**LENGTHS, "candidates": {"int4": {**LENGTHS["candidates"]["int4"],
                                                                           "passes_up_to": 10**30}}})
    code = main(["--model", "llama-3.1-8b", "--context-from", argument.format(rep=rep, none=none, failed=failed,
                                                                               huge=huge)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], lines


def test_context_from_plans_only_the_setting_the_report_measured(tmp_path, monkeypatch, capsys):
    """Before: ``--cache int2`` planned int2 at the length int4 was shown safe at, and no ``--cache`` planned every
    default cache there, exit 0 and silent. Now only the candidate's setting is planned; another is one line."""
    from kvquant.plan import main

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    folder = _report(tmp_path / "rep", LENGTHS, model="llama-3.1-8b")
    code = main(["--model", "llama-3.1-8b", "--context-from", f"{folder}:int4", "--cache", "int2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "leave out --cache" in err


def test_context_from_a_huge_results_json_is_refused_within_the_planners_time(tmp_path, monkeypatch, capsys):
    """Issue 58: a signed results.json of 143-248 MiB (a long filler beside the verdicts) took the planner 10.6-23 s
    to verify and parse, past its 10 s promise; it reads at most 16 MiB now (export still takes up to 256)."""
    import time

    from kvquant.plan import main
    from kvquant.signing import signed_json

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "rep"
    folder.mkdir()
    doc = {"decision": "pass", "long_context": LENGTHS, "config": {"model": {"path": "llama-3.1-8b"}},
           "candidates": [{"name": "int4", "settings": {**INT4, "quantizer": "int4"}, "verdict": "pass"}],
           "filler": "x" * (17 * 2**20)}
    (folder / "results.json").write_text(signed_json(doc))
    start = time.monotonic()
    code = main(["--model", "llama-3.1-8b", "--context-from", f"{folder}:int4"])
    took = time.monotonic() - start
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "more than the 16,777,216 the planner reads" in lines[0], lines
    assert took < 2, took


def test_context_from_a_llamacpp_report_plans_the_setting_it_measured(tmp_path, monkeypatch, capsys):
    """Before: refused, because the report's settings hold what llama.cpp's quantizer derives from the head size
    (``key_rotation_block``, ``value_rotation_block``), which a hand list of derived names did not know. The
    settings are reports/qwen2.5-sweep's llamacpp-q8_0 row, as its results.json records them."""
    from kvquant.plan import main
    from kvquant.signing import signed_json

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    settings = {"quantizer": "llamacpp_q8_0", "rotation": None, "rotation_seed": 0, "key_type": "q8_0",
                "value_type": "q8_0", "attn_rot": None, "cpu": "x86", "rope_layout": "neox", "residual_length": 0,
                "sink_tokens": 0, "key_rotation_block": 64, "value_rotation_block": 64}
    folder = tmp_path / "rep"
    folder.mkdir()
    doc = {"decision": "pass", "long_context": {**LENGTHS, "candidates": {"q8": LENGTHS["candidates"]["int4"]}},
           "config": {"model": {"path": "llama-3.1-8b"}},
           "candidates": [{"name": "q8", "settings": settings, "verdict": "pass"}]}
    (folder / "results.json").write_text(signed_json(doc))
    assert main(["--model", "llama-3.1-8b", "--context-from", f"{folder}:q8", "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert main(["--model", "llama-3.1-8b", "--context", "2048", "--cache", "llamacpp_q8_0:residual_length=0",
                 "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert fitted["context"] == 2048 and fitted["kv_bytes"] == plain["kv_bytes"]


@pytest.mark.parametrize("settings, needle", [
    ({**INT4, "bogus_option": 7}, "int4 was measured with bogus_option, no option of int4 here"),
    ({**INT4, "quantizer": 5}, "int4's settings: unknown quantizer 5"),
    ({**INT4, "group_size": "x"}, "int4's settings: int4"),
])
def test_context_from_refuses_settings_it_cannot_plan_as_measured(tmp_path, monkeypatch, capsys, settings, needle):
    """A setting with an option this kvquant does not have (a report of another version) was planned without it,
    exit 0: a plan for a setting other than the one measured. Refused in one line, and bad values too."""
    from kvquant.plan import main
    from kvquant.signing import signed_json

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "rep"
    folder.mkdir()
    doc = {"decision": "pass", "long_context": LENGTHS, "config": {"model": {"path": "llama-3.1-8b"}},
           "candidates": [{"name": "int4", "settings": settings, "verdict": "pass"}]}
    (folder / "results.json").write_text(signed_json(doc))
    assert main(["--model", "llama-3.1-8b", "--context-from", f"{folder}:int4"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err
