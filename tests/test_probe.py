"""The long-range probe: documents with exactly the distance they claim, and lm-eval tasks ``passkey_<D>`` that
score them through the quantized cache exactly as kvquant's own scorer does; a distance too short for the tokenizer
names the shortest that works, and each probe has one spelling."""

import json
import re

import lm_eval
import pytest
import yaml

import kvquant  # noqa: F401  (registers model "kvquant")
from kvquant.errors import KVQuantError
from kvquant.scoring.scorer import Scorer
from kvquant.cache import CacheSpec
from kvquant.scoring.lm_eval_model import KVQuantLM
from kvquant.paths import resolve
from kvquant.scoring.passkey import probe_documents
from kvquant.runner.report_facts import probe_curve
from kvquant.runner.report_markdown import probe_table, wilson_interval
from kvquant.experiment.results import MetricId, MetricRow
from kvquant.scoring.tasks import (PROBE_DOCUMENTS, check_tasks, prepare_probe_tasks, probe_distance, probe_tasks,
    task_dir, task_manager)


def tokens_after(tokenizer, context: str, char: int) -> int:
    """Tokens of ``context`` from the one holding character ``char`` to the end (independent of probe.py)."""
    spans = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return sum(1 for _, end in spans if end > char)


@pytest.mark.parametrize("distance", [64, 100, 333])
def test_documents_have_the_distance_they_claim(tokenizer, distance):
    docs = probe_documents(tokenizer, [distance], 3, seed=7)
    keys = [d["target"].strip() for d in docs]
    assert len(set(keys)) == 3 and all(k.isdigit() and len(k) == 5 for k in keys)
    for doc, key in zip(docs, keys):
        context = doc["context"]
        assert doc["distance"] == distance and doc["target"] == " " + key
        assert context.count(key) == 2 and context.endswith("The pass key is")
        assert tokens_after(tokenizer, context, context.rindex(key)) == distance


def test_documents_are_reproducible_and_independent_of_each_other(tokenizer):
    both = probe_documents(tokenizer, [64, 100], 2, seed=3)
    assert both == probe_documents(tokenizer, [64, 100], 2, seed=3)
    assert both[2:] == probe_documents(tokenizer, [100], 2, seed=3)  # adding a distance changes no other document
    assert probe_documents(tokenizer, [64], 3, seed=3)[:2] == both[:2]  # nor does adding documents
    assert probe_documents(tokenizer, [64], 2, seed=4) != both[:2]


def test_a_distance_shorter_than_the_question_is_one_clear_error(tokenizer):
    with pytest.raises(KVQuantError, match="probe distance 40 is shorter than the probe's own text"):
        probe_documents(tokenizer, [40], 1)


def test_baseline_documents_hold_no_key(tokenizer):
    informed = probe_documents(tokenizer, [100], 2)
    blind = probe_documents(tokenizer, [100], 2, baseline=True)
    for a, b in zip(informed, blind):
        key = a["target"].strip()
        assert key not in b["context"] and a["context"].endswith(b["context"]) and a["target"] == b["target"]


def test_probe_names_and_lengths_are_checked(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("KVQUANT_TASK_DIR", str(tmp_path))
    assert probe_distance("passkey_4096") == 4096 and probe_distance("passkey_x") is None
    assert probe_distance("lambada_openai") is None
    assert probe_tasks(["passkey_64", "arc_easy"], lambda t: 5) == {"passkey_64": 5}
    check_tasks(["passkey_64", "lambada_openai"], "tasks")
    with pytest.raises(KVQuantError, match="positive"):
        check_tasks(["passkey_0"], "tasks")
    folder = prepare_probe_tasks(tokenizer, {"passkey_100": 3}, 512, "tasks")
    longest = max(json.loads(line)["tokens"] for line in (folder / "passkey_100.jsonl").read_text().splitlines()[:3])
    docs = probe_documents(tokenizer, [100], 3)
    tokens = lambda text, **kw: len(tokenizer(text, **kw).input_ids)  # noqa: E731
    assert longest == max(tokens(d["context"]) + tokens(d["target"], add_special_tokens=False) for d in docs)
    prepare_probe_tasks(tokenizer, {"passkey_100": 3}, longest - 1, "tasks")  # the model keeps max_length + 1
    with pytest.raises(KVQuantError, match=f"tasks: 'passkey_100': its documents take up to {longest} tokens; the "
                       f"model reads {longest - 2} .largest distance here: 99."):
        prepare_probe_tasks(tokenizer, {"passkey_100": 3}, longest - 2, "tasks")
    with pytest.raises(KVQuantError, match="tasks: probe distance 40 is shorter than the probe's own text"):
        prepare_probe_tasks(tokenizer, {"passkey_40": 3}, 512, "tasks")
    with pytest.raises(KVQuantError, match="not more than the distance"):
        prepare_probe_tasks(tokenizer, {"passkey_600": 3}, 512, "tasks")
    with pytest.raises(KVQuantError, match="at most 10000"):
        prepare_probe_tasks(tokenizer, {"passkey_64": 10**9}, 512, "tasks")


@pytest.mark.slow
def test_probe_files_only_grow_and_managers_see_new_tasks(tokenizer, tmp_path, monkeypatch):
    """Two runs sharing a folder: the second asking fewer documents does not shrink the file (the first run's
    documents stay what they were), and a task written after a manager was built is found."""
    monkeypatch.setenv("KVQUANT_TASK_DIR", str(tmp_path))
    folder = task_dir(tokenizer, {"passkey_64": 60})
    first = (folder / "passkey_64.jsonl").read_text()
    assert len(first.splitlines()) == 60
    task_dir(tokenizer, {"passkey_64": 2})
    assert (folder / "passkey_64.jsonl").read_text() == first
    before = task_manager(str(folder))
    assert "passkey_64" in before.all_subtasks and "passkey_100" not in before.all_subtasks
    task_dir(tokenizer, {"passkey_100": 2})
    assert len((folder / "passkey_100.jsonl").read_text().splitlines()) == PROBE_DOCUMENTS
    assert "passkey_100" in task_manager(str(folder)).all_subtasks


@pytest.mark.slow
def test_lm_eval_task_scores_the_documents_like_the_scorer(model, tokenizer, tmp_path, monkeypatch):
    """``passkey_<D>`` through lm-eval and the kvquant model (int4, streaming) gives, document by document, the
    log-likelihood and greedy outcome of scoring the same (context, target) directly."""
    monkeypatch.setenv("KVQUANT_TASK_DIR", str(tmp_path))
    folder = task_dir(tokenizer, {"passkey_120": 3})
    assert folder.is_relative_to(tmp_path)
    lm = KVQuantLM(model, tokenizer=tokenizer, quantizer="int4", mode="streaming", chunk_size=32, batch_size=4,
                   residual_length=0)
    out = lm_eval.simple_evaluate(model=lm, tasks=["passkey_120"], limit=3, task_manager=task_manager(str(folder)),
                                  log_samples=True, bootstrap_iters=0, verbosity="ERROR")
    samples = sorted(out["samples"]["passkey_120"], key=lambda s: s["doc_id"])
    docs = probe_documents(tokenizer, [120], 3)
    assert [s["doc"]["context"] for s in samples] == [d["context"] for d in docs]
    scorer = Scorer(model, CacheSpec.of("int4", {"residual_length": 0}), "streaming", 32)
    for sample, doc in zip(samples, docs):
        ids = tokenizer(doc["context"]).input_ids
        scored = scorer.score_many([(ids, tokenizer(doc["target"], add_special_tokens=False).input_ids)])[0]
        assert sample["resps"][0][0][0] == pytest.approx(float(scored.logprobs.double().sum()), abs=1e-4)
        assert sample["acc"] == float(scored.greedy.all())


def test_wilson_interval_matches_the_formula():
    z = 1.959963984540054
    for k, n in [(0, 6), (5, 6), (29, 30), (8, 8)]:
        p = k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5
        low, high = wilson_interval(k, n)
        assert low == pytest.approx(max(0.0, centre - half), abs=1e-9)
        assert high == pytest.approx(min(1.0, centre + half), abs=1e-9)


def test_report_lists_the_probe_by_distance():
    rows = [MetricRow("int2", MetricId("acc", task), value, base, 8)
            for task, value, base in [("passkey_1024", 0.25, 1.0), ("passkey_256", 0.5, 1.0), ("arc_easy", 0.4, 0.5)]]
    curve = probe_curve(rows)
    assert curve == {"baseline": {1024: (1.0, 8), 256: (1.0, 8)}, "int2": {1024: (0.25, 8), 256: (0.5, 8)}}
    table = "\n".join(probe_table(curve))
    assert "| 256 | 8/8 [0.68, 1.00] | 4/8 [0.22, 0.78] |" in table
    assert table.index("| 256 |") < table.index("| 1024 |")


@pytest.mark.slow
def test_lm_eval_cli_runs_probe_tasks_with_the_models_tokenizer(tmp_path, monkeypatch, capsys):
    from kvquant.lm_eval import main

    monkeypatch.setenv("KVQUANT_TASK_DIR", str(tmp_path))
    tiny = resolve("local:models/stories260K/hf")
    code = main(["--model", "kvquant", "--model_args", f"pretrained={tiny},quantizer=int4,residual_length=0",
                 "--tasks", "passkey_64", "--limit", "2", "--output_path", str(tmp_path / "out")])
    assert code == 0
    assert "passkey_64" in capsys.readouterr().out
    assert len((next(tmp_path.glob("*-tok*")) / "passkey_64.jsonl").read_text().splitlines()) == PROBE_DOCUMENTS


def test_lm_eval_cli_refuses_probe_tasks_without_the_kvquant_model(capsys):
    from kvquant.lm_eval import main

    assert main(["--model", "hf", "--model_args", "pretrained=x", "--tasks", "passkey_64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cut with the model's tokenizer" in err[0] and "Traceback" not in err[0]


# --- pass-key task names: the shortest distance a tokenizer allows is named; one spelling per probe -----


@pytest.fixture
def short_filler(monkeypatch):
    """The probe's filler cut to WikiText-2's first 40,000 characters (tokenizing all of it takes seconds)."""
    from kvquant.scoring import passkey as probe

    text = probe._filler_text()[:40_000]
    probe._filler.cache_clear()
    monkeypatch.setattr(probe, "_filler_text", lambda: text)
    yield
    probe._filler.cache_clear()


def test_a_probe_too_short_for_the_tokenizer_names_the_shortest_that_works(tokenizer, short_filler):
    """passkey_32 was documented (any D >= 32) and refused without saying what would work."""
    from kvquant.scoring.passkey import probe_documents

    with pytest.raises(KVQuantError, match=r"probe distance 32 is shorter .*\(46 tokens with this tokenizer.*the "
                                           r"shortest distance this tokenizer allows is 46 \(passkey_46\)$"):
        probe_documents(tokenizer, [32], 50)
    docs = probe_documents(tokenizer, [46], 50)  # the one it names works, for as many documents
    assert len(docs) == 50 and {d["distance"] for d in docs} == {46}
    with pytest.raises(KVQuantError, match=r"allows is 46 \(passkey_46\)"):
        probe_documents(tokenizer, [45], 50)


def test_the_runner_names_the_shortest_probe_before_loading(no_model_load, short_filler, tmp_path, capsys):
    import kvquant.run

    cfg = tmp_path / "probe.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "probe", "output_dir": str(tmp_path / "reports"), "model": {"path": "local:models/stories260K/hf"},
        "candidates": [{"quantizer": "int8"}], "eval": {"tasks": {"names": ["passkey_32"], "limit": 2}},
        "gate": {"tasks": ["passkey_32"]}}))
    assert kvquant.run.main([str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvquant: error: eval.tasks.names: probe distance 32 is shorter") and "\n" not in err
    assert err.endswith("the shortest distance this tokenizer allows is 46 (passkey_46)")
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("names, needle", [
    (["passkey_64", "passkey_0064"], "'passkey_0064': write passkey_64 (a distance without leading zeros"),
    (["passkey_064"], "'passkey_064': write passkey_64"),
])
def test_a_probe_has_one_spelling(names, needle):
    """passkey_64 and passkey_0064 were both accepted: one probe measured and gated twice under two names."""
    from kvquant.scoring.tasks import check_tasks

    with pytest.raises(KVQuantError, match=re.escape(f"eval.tasks.names: {needle}")):
        check_tasks(names, "eval.tasks.names")
    check_tasks(["passkey_64", "passkey_100"], "eval.tasks.names")  # the canonical names pass


def test_lm_eval_refuses_a_second_spelling_of_a_probe_before_loading(no_model_load, capsys, monkeypatch):
    import sys

    from kvquant import lm_eval as lm_eval_cli
    from kvquant.paths import resolve

    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    model = resolve("local:models/stories260K/hf")
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={model}", "--tasks",
                             "passkey_64,passkey_0064", "--limit", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == ("kvquant: error: --tasks: 'passkey_0064': write passkey_64 (a distance "
                                 "without leading zeros: one spelling per probe, so none is measured and gated twice)")
