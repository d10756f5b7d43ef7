"""The cost preview (``python -m kvquant.run CONFIG --dry-run``): the tokens it states for every scorer's pass are
the tokens the run then scores (each result's ``lengths``) at the first look, later looks priced from its tokens
per document; results the run would reuse cost nothing; a dry run measures and writes nothing, loads each task once
and builds one look's requests, whatever ``gate.max_documents`` is."""

import json
import os
import re

import pytest
import yaml

from kvquant import run
from kvquant.runner.preflight import preflight
from kvquant.planner.shapes import shape_from_config
from kvquant.runner import preview
from kvquant.experiment.config import load_config
from kvquant.experiment.gate_config import looks
from kvquant.experiment.provenance import code_version
from kvquant.runner.lookplan import LookPlan, PlanRecord
from kvquant.runner.store import ResultStore
from kvquant.scoring.session import Session
from kvquant.scoring.task_setup import lm_eval_task
from kvquant.scoring.tasks import task_dir
from tests.tiny_configs import tiny_run


def config(out) -> dict:
    """Two candidates on stories260K, 3 perplexity windows and a gated task of 8 documents, looks up to 32."""
    cfg = tiny_run("small", "int8", 8, max_documents=32, perplexity=None)
    cfg["output_dir"] = str(out)
    cfg["candidates"] = [{"quantizer": "int8", "name": "int8", "options": {"group_size": 32, "residual_length": 0}},
                         {"quantizer": "int2", "name": "int2", "options": {"residual_length": 0}}]
    cfg["eval"]["perplexity"][0].update(limit=3, max_length=128)
    return cfg


def scored_tokens(partial, label: str, metric: str) -> int:
    """Request tokens the run scored for one result file (context + continuation, as its scorer recorded them)."""
    return sum(json.loads((partial / label / f"{metric}.json").read_text())["result"]["lengths"])


def test_the_preview_states_the_tokens_the_run_then_scores(tmp_path, capsys, model, tokenizer):
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(config(tmp_path / "reports")))
    assert run.main([str(path), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "cost preview of small (nothing measured, nothing written)" in printed
    assert "| int2 | task/tinystories_lastword | 8 |" in printed
    assert not (tmp_path / "reports").exists()

    cfg = load_config(path)
    _, rows, _ = preflight(cfg, run.ABOVE_RUNNER)
    session = Session(cfg, model, tokenizer, None, shape_from_config(model.config, cfg.model.path))
    found, _ = preview.costs(session, rows)
    costs = {(c.scorer, c.measurement): c for c in found}
    assert set(costs) == {(s, m) for s in ("baseline", "int8", "int2") for m in ("ppl/tinystories",
                                                                                "task/tinystories_lastword")} \
        | {("baseline (for int8, int2)", "kl/tinystories")}
    task = costs["baseline", "task/tinystories_lastword"]
    assert (task.documents, task.most_documents) == (8, 32)  # looks 8, 16, 32

    assert run.main([str(path)]) in (0, 1, 4)
    partial = tmp_path / "reports" / "small" / "partial"
    for label in ("baseline", "int8", "int2"):
        assert costs[label, "ppl/tinystories"].tokens == scored_tokens(partial, label, "ppl__tinystories")
        assert costs[label, "task/tinystories_lastword"].tokens == \
            scored_tokens(partial, label, "task__tinystories_lastword")
    for label in ("int8", "int2"):  # the same pass scores a candidate's perplexity and divergence
        assert scored_tokens(partial, label, "kl__tinystories") == costs[label, "ppl/tinystories"].tokens
    looked = sorted(p.stem for p in (partial / "baseline").glob("task__tinystories_lastword@*.json"))
    assert looked == ["task__tinystories_lastword@16-32", "task__tinystories_lastword@8-16"]  # every look taken
    # later looks are priced from counts (never built): the first look's tokens per document, for 8 + 16 more
    assert task.most_tokens == task.tokens + round(task.tokens * 8 / 8) + round(task.tokens * 16 / 8)
    actual = sum(scored_tokens(partial, "baseline", m) for m in ["task__tinystories_lastword", *looked])
    print(f"estimated {task.most_tokens} request tokens over every look, scored {actual}")
    assert task.most_tokens > task.tokens
    # simulated mode feeds every request whole: the model tokens are the request tokens (streaming mode's fewer
    # are the scorer's own count: tests/test_prefixes.py)
    assert cfg.eval.mode == "simulated" and all((c.fed, c.most_fed) == (c.tokens, c.most_tokens) for c in found)

    # issue 58: the same preview of the finished report: every result the run wrote is reused (priced 0 s); only
    # the looks it did not take (a candidate that failed at the first look takes none) are priced
    store = ResultStore(partial, code_version(), [])
    PlanRecord(store, LookPlan.of(cfg)).identify()  # the folder's id, as the dry run reads it: its results' own
    found, _ = preview.preview(session, rows, store)
    assert all((c.fed, c.seconds) == (0, 0) for c in found)
    for c in found:
        kept = len(list((partial / c.scorer).glob("task__tinystories_lastword*.json"))) \
            if c.measurement.startswith("task/") else 1
        assert (c.reused, c.results) == (kept, 3 if c.measurement.startswith("task/") else 1), c
        assert (c.most_fed == 0) == (c.most_seconds == 0) == (c.reused == c.results), c
    capsys.readouterr()
    assert run.main([str(path), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    reused, results = sum(c.reused for c in found), sum(c.results for c in found)
    assert results == 4 + 3 * 3  # perplexity: 3 passes and the baseline's for the divergences; tasks: 3 looks each
    assert f"reused: {reused} of {results} results (a task's: one per look) the run would take from {partial}" \
        in printed
    assert f"| **0 s** | **{reused} of {results}** |" in printed
    # a result of other inputs (a seed of its own) is priced again, the rest still reused
    reseeded = [c for c in preview.preview(Session(load_config(path, ["eval.seed=7"]), model, tokenizer, None,
                                                   shape_from_config(model.config, cfg.model.path)), rows, store)[0]]
    assert all(c.reused == 0 and c.most_fed > 0 for c in reseeded)


@pytest.mark.parametrize("task", ["tinystories_lastword", "needle_single_480"])
def test_a_dry_run_builds_one_look_loads_each_task_once_and_writes_nothing(tmp_path, capsys, monkeypatch, task):
    """Issue 58: with ``gate.max_documents`` 1,000,000 the preview built every look's requests (and wrote 10,000
    needle documents): > 110 s. Now each task is loaded once and its first look built once, later looks priced from
    counts; nothing is written in the report folder, the working directory, ``$KVQUANT_TASK_DIR`` or the cache (no
    signing key is made)."""
    cfg = config(tmp_path / "reports")
    cfg["eval"]["tasks"]["names"] = cfg["gate"]["tasks"] = [task]
    cfg["eval"]["tasks"]["limit"] = 40  # more than the preview builds: priced from its first 32 documents
    cfg["gate"]["max_documents"] = 1_000_000
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(cfg))
    tasks, cache, cwd = tmp_path / "tasks", tmp_path / "cache", tmp_path / "cwd"
    for folder in (tasks, cache, cwd):
        folder.mkdir(mode=0o700)
    monkeypatch.setenv("KVQUANT_TASK_DIR", str(tasks))
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(cache))
    monkeypatch.chdir(cwd)
    calls = {"load": 0, "build": 0}
    built = []

    def counted(what, real):
        def call(*args, **kwargs):
            calls[what] += 1
            if what == "build":
                built.append(args[4])  # the documents whose requests are built
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(preview, "lm_eval_task", counted("load", preview.lm_eval_task))
    monkeypatch.setattr(preview, "evaluate_task", counted("build", preview.evaluate_task))
    assert run.main([str(path), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert calls == {"load": 1, "build": 1} and built == [list(range(preview.SAMPLE_DOCUMENTS))]
    assert not (tmp_path / "reports").exists() and os.listdir(cwd) == [] and os.listdir(tasks) == []
    assert not (cache / "keys" / "partial-results.key").exists()
    # needles: at most 10,000 written; the lastword task: its size
    most = 10_000 if task.startswith("needle") else len(lm_eval_task(task, task_dir()).eval_docs)
    taken = len({min(n, most) for n in looks(40, 1_000_000)})  # 40, 80, ..., then the last capped at ``most``
    row = next(line for line in printed.splitlines() if line.startswith(f"| baseline | task/{task} |"))
    assert row.startswith(f"| baseline | task/{task} | 40 |") and f"| 0 of {taken} | {most} |" in row, row


def test_a_dry_run_builds_the_task_manager_each_task_and_each_kind_of_probe_once(tmp_path, capsys, monkeypatch):
    """Issue 58: a dry run of configs/smollm2-decide.yaml spent ~6 s of CPU indexing lm-eval's ~14,000 task files,
    built each few-shot task three times (preflight's two checks, then the preview) and timed a probe for each of
    its six settings. Now one TaskManager, of the task folder alone (every task here is one kvquant wrote), one task
    object per task, shared, and one probe per quantizer and cache layout: int2 and int2 g32 differ only in their
    group size, so int2's probe prices both."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks import TaskManager

    from kvquant.scoring import tasks

    cfg = config(tmp_path / "reports")
    cfg["candidates"].append({"quantizer": "int2", "name": "int2-g32", "options": {"group_size": 32,
                                                                                  "residual_length": 0}})
    cfg["eval"]["tasks"].update(num_fewshot=2, fewshot_sampler="first_n")  # both preflight checks load the task
    cfg["model"]["max_length"] = 2048  # two stories' examples: past the model's 512 positions (a warning)
    path = tmp_path / "shots.yaml"
    path.write_text(yaml.safe_dump(cfg))
    managers, built, probed = [], [], []

    def spied(cls, seen, where):
        real = cls.__init__

        def init(self, *args, **kwargs):
            seen.append(where(args, kwargs))
            real(self, *args, **kwargs)
        monkeypatch.setattr(cls, "__init__", init)

    spied(TaskManager, managers, lambda args, kwargs: kwargs.get("include_defaults", True))
    spied(ConfigurableTask, built, lambda args, kwargs: (kwargs.get("config") or {}).get("task"))
    real_scorer = preview.Scorer

    def scorer(model, spec, *args, **kwargs):
        probed.append(spec.options)
        return real_scorer(model, spec, *args, **kwargs)
    monkeypatch.setattr(preview, "Scorer", scorer)
    tasks._task_manager.cache_clear()  # none built by an earlier test
    try:
        assert run.main([str(path), "--dry-run"]) == 0
    finally:
        tasks._task_manager.cache_clear()
    printed = capsys.readouterr().out
    assert "| int2-g32 | task/tinystories_lastword | 8 |" in printed
    # include_defaults=False: the task folder alone; the baseline's, int8's and int2's probes
    assert (managers, built) == ([False], ["tinystories_lastword"])
    assert probed == [{}, cfg["candidates"][0]["options"], cfg["candidates"][1]["options"]]
    assert re.search(r"probe on this machine .*: baseline [\d,]+/s, int8 [\d,]+/s, int2, int2-g32 [\d,]+/s$",
                     printed.strip().splitlines()[-1]), printed.strip().splitlines()[-1]
    tables = [line for line in printed.splitlines() if line.startswith("| int2")]
    for metric in ("ppl/tinystories", "task/tinystories_lastword"):  # same model tokens, same time
        int2, g32 = (next(r.split(" | ") for r in tables if r.startswith(f"| {label} | {metric} |"))
                     for label in ("int2", "int2-g32"))
        assert int2[4:6] == g32[4:6], (int2, g32)
