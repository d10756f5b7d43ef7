"""The cost preview (``python -m kvquant.run CONFIG --dry-run``): the tokens it states for every scorer's pass are
the tokens the run then scores (each result's ``lengths``), at the first look and over every sequential look, and
a dry run measures and writes nothing."""

import json

import yaml

from kvquant import run
from kvquant.planner.shapes import shape_from_config
from kvquant.runner import preview
from kvquant.runner.config import load_config
from kvquant.scoring.session import Session
from tests.hostile_helpers import tiny_run


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
    _, rows, _ = run.preflight(cfg)
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
    assert task.most_tokens == sum(scored_tokens(partial, "baseline", m)
                                   for m in ["task__tinystories_lastword", *looked])
    assert task.most_tokens > task.tokens
    # simulated mode feeds every request whole: the model tokens are the request tokens (streaming mode's fewer
    # are the scorer's own count: tests/test_prefixes.py)
    assert cfg.eval.mode == "simulated" and all((c.fed, c.most_fed) == (c.tokens, c.most_tokens) for c in found)
