"""The plan is fixed before the data (issue 53 item 2): a run whose plan (looks, margins, windows, limits) differs
from the one its partial results were measured under is refused with one line before the model loads, or, with
``--replan``, goes on and states the error over every look taken under any plan."""

import json
import os
from pathlib import Path

import pytest

from kvquant.run import main
from kvquant.runner import pipeline
from kvquant.experiment.config import load_config
from kvquant.experiment.results import MetricId, MetricRow
from tiny_configs import TINY

ROOT = Path(__file__).parents[1]



def snapshot(folder: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*")}


def first_run(tmp_path, monkeypatch) -> tuple[Path, Path, int]:
    """TINY run once into ``tmp_path``: ``(its config, its report folder, its exit)``."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY.format(out=tmp_path / "reports"))
    return path, tmp_path / "reports" / "tiny", main([str(path)])


def no_model(monkeypatch) -> None:
    def trap(*args, **kwargs):
        raise AssertionError("the model was loaded for a plan that should have been refused")

    monkeypatch.setattr(pipeline, "load_model", trap)


def test_a_changed_plan_under_the_same_partials_is_refused_or_replanned(tmp_path, capsys, monkeypatch):
    """The windows doubled after the data (as smollm2-decide's WikiText-2 windows were): refused with one line
    naming the field, before the model loads, nothing written or moved (was: measured again and reported at the
    plan's nominal error); with --replan, the verdict line, report.md and results.json state the union bound over
    both looks (2 x 2.5% = 5%)."""
    path, out_dir, first = first_run(tmp_path, monkeypatch)
    assert first == 4  # TINY's two windows are too few to decide (the counts); the plan is recorded alike
    before = snapshot(out_dir)
    capsys.readouterr()
    real_load = pipeline.load_model
    no_model(monkeypatch)
    changed = ["--set", "eval.perplexity.0.max_length=64"]
    assert main([str(path), *changed]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "another plan" in err
    assert "perplexity.tinystories.max_length is 64 now, 128 before" in err and "--replan" in err
    assert snapshot(out_dir) == before  # nothing written or moved
    assert not list(out_dir.parent.glob("tiny/partial.old-*"))
    assert json.loads((out_dir / "partial" / "plan.json").read_text())["history"][0]["looks"]

    monkeypatch.setattr(pipeline, "load_model", real_load)
    assert main([str(path), *changed, "--replan"]) == first
    printed = capsys.readouterr().out
    note = "re-planned: error up to 5.0% over 2 looks of ppl/tinystories under 2 plans, not 2.5%"
    assert note in printed
    doc = json.loads((out_dir / "results.json").read_text())
    assert note in doc["reason"]
    assert doc["replanned"]["error"] == pytest.approx(0.05) and doc["replanned"]["plans"] == 2
    assert doc["replanned"]["changes"] == ["perplexity.tinystories.max_length is 64 now, 128 before"]
    assert "plan changed after the data" in (out_dir / "report.md").read_text()
    # the same changed plan again: no third plan, the same error; back to the first plan needs --replan too
    assert main([str(path), *changed]) == first
    assert json.loads((out_dir / "results.json").read_text())["replanned"]["error"] == pytest.approx(0.05)
    capsys.readouterr()
    assert main([str(path)]) == 2


def test_an_edited_plan_file_is_refused_or_replanned_with_the_error_unknown(tmp_path, capsys, monkeypatch):
    """A plan file that does not verify (edited, or another machine's) under partial results: refused with one line
    before the model loads, nothing moved (probe 58, p01: it was set aside and the run went on under the edited
    plan, stating the nominal error); with --replan it is set aside once, said once, and the verdict line, report.md
    and results.json say the error over the earlier looks is unknown, on this run and the next."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY.format(out=tmp_path / "reports"))
    first = main([str(path)])
    out_dir = tmp_path / "reports" / "tiny"
    plan = out_dir / "partial" / "plan.json"
    doc = json.loads(plan.read_text())
    doc["history"][0]["plan"]["gate"]["confidence"] = 0.5
    plan.write_text(json.dumps(doc))
    before = snapshot(out_dir)
    capsys.readouterr()
    real_load = pipeline.load_model

    def trap(*args, **kwargs):
        raise AssertionError("the model was loaded for a plan record that should have been refused")

    monkeypatch.setattr(pipeline, "load_model", trap)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "does not verify" in err and "--replan" in err, err
    assert snapshot(out_dir) == before  # nothing written or moved

    monkeypatch.setattr(pipeline, "load_model", real_load)
    assert main([str(path), "--replan"]) == first
    captured = capsys.readouterr()
    assert captured.err.count("plan.json is unusable") == 1, captured.err
    note = "re-planned after an unverifiable plan record: the error over the looks taken before it is unknown"
    assert note in captured.out
    assert plan.with_name("plan.json.corrupt").exists() and plan.exists()
    results = json.loads((out_dir / "results.json").read_text())
    assert note in results["reason"] and results["replanned"]["error"] is None
    assert "a wrong pass's chance is unknown" in (out_dir / "report.md").read_text()
    assert main([str(path)]) == first  # the record now verifies; the unknown stays said
    assert note in json.loads((out_dir / "results.json").read_text())["reason"]


def test_the_dry_run_refuses_the_plans_the_run_refuses(tmp_path, capsys, monkeypatch):
    """--dry-run checks the config as a run would: a changed plan and a plan file that does not verify are refused
    with the run's one line, before the model loads, nothing moved (probe 56: the preview exited 0 and priced every
    result as reused); with --replan it previews, plan.json left where it is."""
    path, out_dir, _ = first_run(tmp_path, monkeypatch)
    capsys.readouterr()
    real_load = pipeline.load_model
    no_model(monkeypatch)
    changed = ["--set", "eval.perplexity.0.max_length=64"]
    before = snapshot(out_dir)
    assert main([str(path), *changed, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "perplexity.tinystories.max_length is 64 now, 128 before" in err, err
    plan = out_dir / "partial" / "plan.json"
    doc = json.loads(plan.read_text())
    doc["history"][0]["plan"]["gate"]["confidence"] = 0.5
    plan.write_text(json.dumps(doc))
    before = snapshot(out_dir)
    assert main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "does not verify" in err, err
    assert snapshot(out_dir) == before
    monkeypatch.setattr(pipeline, "load_model", real_load)
    assert main([str(path), "--dry-run", "--replan"]) == 0
    assert "cost preview" in capsys.readouterr().out
    assert snapshot(out_dir) == before and not plan.with_name("plan.json.corrupt").exists()

def rows(label: str, metric: MetricId, counts, confidence: float) -> list[MetricRow]:
    return [MetricRow(label, metric, 0.5, 0.5, n, True, confidence=confidence) for n in counts]


def test_smollm2_decides_history_gives_the_union_bound_over_every_look():
    """smollm2-decide's three plans (git: 776345c, f83b73d, c62dd49): looks to 1,600 with 24 windows of 512
    tokens, then to 3,200 with 16 windows of 1,024, then to 5,153. LAMBADA was judged at 200..1,600 at 99.375%,
    3,200 at 99.5% and 5,153 at 99.58%: 4 x 0.625% + 0.5% + 0.417% = 3.42% one-sided; WikiText-2's KL on two
    sets of windows: 2 x 2.5% = 5%. A look judged again at a narrower width adds nothing."""
    from kvquant.runner.lookplan import LookPlan, PlanRecord, replanned_error
    from kvquant.runner.store import ResultStore

    config = ROOT / "configs" / "smollm2-decide.yaml"
    plans = [load_config(config, ["gate.max_documents=1600", "eval.perplexity.0.limit=24",
                                  "eval.perplexity.0.max_length=512"]),
             load_config(config, ["gate.max_documents=3200"]), load_config(config)]
    history = []
    lambada, kl = MetricId("acc", "lambada_openai"), MetricId("kl", "wikitext2")
    for cfg in plans:
        plan = LookPlan.of(cfg)
        record = PlanRecord(ResultStore(Path("/nonexistent"), {}, []), plan)
        record.history = [*history, {"plan": plan.to_dict(), "digest": plan.digest(), "looks": {}}]
        record.write = lambda: None
        taken = plan.looks["lambada_openai"]
        record.record(rows("fp8_e4m3", lambada, taken, plan.confidence["lambada_openai"]))
        record.record(rows("int8", kl, [cfg.eval.perplexity[0].limit], cfg.gate.confidence))
        history = record.history
    bound = replanned_error(history, 0.025)
    assert bound["errors"]["acc/lambada_openai"] == pytest.approx(4 * 0.025 / 4 + 0.025 / 5 + 0.025 / 6)
    assert round(bound["errors"]["acc/lambada_openai"], 4) == 0.0342
    assert bound["errors"]["kl/wikitext2"] == pytest.approx(0.05)
    assert bound["metric"] == "kl/wikitext2" and bound["plans"] == 3
    assert bound["changes"][0].startswith("gate.max_documents is 3200 now, 1600 before")
    assert replanned_error(history[:1], 0.025) is None  # one plan: its own Bonferroni bound holds


def test_the_plan_holds_what_decides_the_documents_and_their_judgement():
    """Every input that decides which documents are measured or how they are judged is a field of the plan:
    looks, each look's confidence, margins, windows, task limits and shots, the seed."""
    from kvquant.runner.lookplan import LookPlan

    cfg = load_config(ROOT / "configs" / "smollm2-decide.yaml")
    plan = LookPlan.of(cfg)
    assert plan.looks["lambada_openai"] == [200, 400, 800, 1600, 3200, 5153]
    assert plan.confidence["lambada_openai"] == pytest.approx(1 - 0.05 / 6)
    for change, field in [("gate.min_relative_accuracy=0.96", "gate.min_relative_accuracy"),
                          ("gate.max_kl_divergence=0.02", "gate.max_kl_divergence"),
                          ("eval.tasks.limit=100", "looks.arc_easy"),
                          ("eval.perplexity.0.limit=8", "perplexity.wikitext2.limit"),
                          ("eval.seed=7", "seed")]:
        other = LookPlan.of(load_config(ROOT / "configs" / "smollm2-decide.yaml", [change]))
        assert other.digest() != plan.digest()
        assert other.difference(plan).startswith(field), (change, other.difference(plan))
    assert LookPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    same = load_config(ROOT / "configs" / "smollm2-decide.yaml", ["eval.batch_size=4"])
    assert LookPlan.of(same).difference(plan) is None  # how fast, not what: no plan change


def test_partial_results_folder_with_a_plan_is_checked_not_refused(tmp_path):
    """check_partial takes the plan file beside the candidates' folders; a symlink in its place is refused."""
    from kvquant.errors import KVQuantError
    from kvquant.runner.store import check_partial

    partial = tmp_path / "partial"
    (partial / "int8").mkdir(parents=True)
    (partial / "plan.json").write_text("{}")
    check_partial(partial)
    os.unlink(partial / "plan.json")
    os.symlink(tmp_path / "elsewhere", partial / "plan.json")
    with pytest.raises(KVQuantError, match="symlink"):
        check_partial(partial)


def test_adopt_carries_the_plan_and_refuses_a_conflicting_one(tmp_path, capsys, monkeypatch):
    """Partial results adopted from another sitting bring the plan they were measured under: carried into this
    run's plan file (its history and looks), so a later run under a raised plan is refused here too; a folder
    whose plan is not this config's is refused with one line, nothing adopted."""
    from kvquant.adopt import main as adopt

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY.format(out=tmp_path / "reports"))
    assert main([str(path)]) == 4  # TINY's two windows are too few to decide (the counts); its results are kept
    there = tmp_path / "reports" / "tiny" / "partial"
    assert adopt([str(path), str(there), "--set", "name=elsewhere", "--set", "gate.max_perplexity_ratio=1.04"]) == 2
    assert "measured under another plan (gate.max_perplexity_ratio is 1.04 now, 1.05 before" in capsys.readouterr().err
    assert not (tmp_path / "reports" / "elsewhere").exists()
    assert adopt([str(path), str(there), "--set", "name=elsewhere"]) == 0
    carried = json.loads((tmp_path / "reports" / "elsewhere" / "partial" / "plan.json").read_text())["history"]
    assert carried == json.loads((there / "plan.json").read_text())["history"]
    capsys.readouterr()
    assert main([str(path), "--set", "name=elsewhere", "--set", "gate.max_perplexity_ratio=1.04"]) == 2
    assert "another plan" in capsys.readouterr().err
    # the plan here removed from under its results: the looks taken here are unknown, so adopting over it (which
    # wrote the carried plan in its place) is refused, nothing written
    os.unlink(tmp_path / "reports" / "elsewhere" / "partial" / "plan.json")
    before = snapshot(tmp_path / "reports" / "elsewhere")
    assert adopt([str(path), str(there), "--set", "name=elsewhere"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "is missing" in err and "--replan" in err, err
    assert snapshot(tmp_path / "reports" / "elsewhere") == before


def test_results_travel_only_with_the_plan_they_were_judged_under(tmp_path, capsys, monkeypatch):
    """A result's looks are recorded in its folder's plan.json alone. A copy with its plan.json removed was adopted
    (the run then recorded its own plan as the first: a look planned after the data passed as planned), and so was
    one beside another report folder's plan.json of the same config (closing note and review of 2026-12-07). Each is
    refused with one line naming the folder, nothing written, by kvquant.adopt and by --render-only --partial, and
    so is a good folder named with a bad one; the folder whole is adopted. Results from before folder ids: task
    results need a plan, perplexity results alone travel without one."""
    import shutil

    from kvquant.adopt import main as adopt
    from tiny_configs import set_args, write_run

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    path = write_run(tmp_path)
    first = main([str(path)])
    assert main([str(path), *set_args("name=other")]) == first
    there = tmp_path / "reports" / "small" / "partial"
    assert sorted(p.name for p in there.glob("*/task__*.json")) == ["task__tinystories_lastword.json"] * 2
    bare, swapped = tmp_path / "bare", tmp_path / "swapped"
    shutil.copytree(there, bare)
    os.unlink(bare / "plan.json")
    shutil.copytree(there, swapped)
    shutil.copy(tmp_path / "reports" / "other" / "partial" / "plan.json", swapped / "plan.json")  # same config
    capsys.readouterr()

    def refused(args, *words, command=adopt):
        assert command([*args, *set_args("name=elsewhere")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.splitlines() == [err] and all(w in err for w in words), err
        assert not (tmp_path / "reports" / "elsewhere").exists()  # nothing written, not even a lock

    refused([str(path), str(bare)], str(bare), "no plan.json")
    refused([str(path), str(swapped)], "not the plan its results were measured under")
    refused([str(path), str(there), str(bare)], str(bare), "no plan.json")
    refused([str(path), "--render-only", "--partial", str(bare)], "no plan.json", command=main)

    for result in bare.glob("*/*.json"):  # results from before folder ids
        saved = json.loads(result.read_text())
        del saved["report"]
        result.write_text(json.dumps(saved))
    refused([str(path), str(bare)], "holds task results", "no plan.json")
    for task in bare.glob("*/task__*.json"):
        os.unlink(task)
    assert adopt([str(path), str(bare), *set_args("name=perplexity-only")]) == 0, capsys.readouterr().err
    assert adopt([str(path), str(there), *set_args("name=elsewhere")]) == 0  # whole, with its plan


def test_a_plan_copied_from_another_report_folder_is_refused_a_whole_folder_copied_is_not(tmp_path, capsys,
                                                                                          monkeypatch):
    """A signed plan.json copied from another report folder of the same config verified (issue 58): its signature
    was not tied to the results beside it, so another folder's record of looks (or none) could stand in for this
    folder's. Each report folder's plan and partial results carry the same random id under the signature: a plan
    copied over, or removed, under results measured here is refused with one line before the model loads, nothing
    written (with --replan: set aside, the error over the earlier looks unknown); a result copied from another
    folder is set aside and measured again; a whole folder copied or moved goes on, every result reused."""
    import shutil

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY.format(out=tmp_path / "reports"))
    first = main([str(path)])
    assert main([str(path), "--set", "name=other"]) == first
    here, other = tmp_path / "reports" / "tiny" / "partial", tmp_path / "reports" / "other" / "partial"
    shutil.copytree(here.parent, tmp_path / "reports" / "copy")  # a whole folder, copied: nothing to refuse
    capsys.readouterr()
    assert main([str(path), "--set", "name=copy"]) == first
    assert "0 results measured, 5 reused" in capsys.readouterr().out
    assert (here / "plan.json").read_bytes() != (other / "plan.json").read_bytes()  # same history, other folder
    plan_b = json.loads((other / "plan.json").read_text())
    assert plan_b["history"] == json.loads((here / "plan.json").read_text())["history"]

    real_load = pipeline.load_model

    def trap(*args, **kwargs):
        raise AssertionError("the model was loaded for a plan record that should have been refused")

    monkeypatch.setattr(pipeline, "load_model", trap)
    saved = (here / "plan.json").read_bytes()
    for how in ("copied", "removed"):
        if how == "copied":
            shutil.copy(other / "plan.json", here / "plan.json")
        else:
            os.unlink(here / "plan.json")
        before = snapshot(here.parent)
        assert main([str(path)]) == 2, how
        err = capsys.readouterr().err.strip()
        assert err.splitlines() == [err] and "--replan" in err, err
        assert ("another report folder" if how == "copied" else "is missing") in err, err
        assert snapshot(here.parent) == before  # nothing written or moved
    (here / "plan.json").write_bytes(saved)  # its own plan back, and one result copied from the other folder
    monkeypatch.setattr(pipeline, "load_model", real_load)
    shutil.copy(other / "int8" / "ppl__tinystories.json", here / "int8" / "ppl__tinystories.json")
    capsys.readouterr()
    assert main([str(path)]) == first
    captured = capsys.readouterr()
    assert "1 results measured, 4 reused" in captured.out and "another report folder" in captured.err
    assert (here / "int8" / "ppl__tinystories.json.corrupt").exists()

    shutil.copy(other / "plan.json", here / "plan.json")
    assert main([str(path), "--replan"]) == first
    captured = capsys.readouterr()
    note = "re-planned after an unverifiable plan record: the error over the looks taken before it is unknown"
    assert note in captured.out and "0 results measured, 5 reused" in captured.out  # the results here go on
    assert json.loads((here.parent / "results.json").read_text())["replanned"]["error"] is None
    assert (here / "plan.json.corrupt").read_bytes() == (other / "plan.json").read_bytes()


def test_a_folder_from_before_report_ids_goes_on_untied_and_a_tied_plan_is_not_its_own(tmp_path, monkeypatch):
    """A plan file and results as kvquant wrote them before report folder ids (no ``report``; the plan signed over
    the domain and its history alone, recomputed here) still verify and are reused; a plan of a tied folder copied
    over them is another folder's."""
    import hashlib
    import hmac

    from kvquant.runner.lookplan import DOMAIN, FOREIGN, LookPlan, PlanRecord, new_plan_entry
    from kvquant.runner.store import ResultStore
    from kvquant.signing import result_key

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY.format(out=tmp_path / "reports"))
    plan, partial = LookPlan.of(load_config(path)), tmp_path / "old" / "partial"
    for folder in ("old", "new"):
        (tmp_path / folder).mkdir()
    old = ResultStore(partial, {"code": "v1"}, [])  # no id: as before ids
    old.get_or_compute("int8", "memory", {"k": 1}, lambda: {"bits": 8.5})
    record = PlanRecord(old, plan)
    record.history = [new_plan_entry(plan)]
    record.write()
    doc = json.loads((partial / "plan.json").read_text())
    text = json.dumps(doc["history"], sort_keys=True, separators=(",", ":")).encode()
    assert "report" not in doc and "report" not in json.loads((partial / "int8" / "memory.json").read_text())
    assert doc["signature"] == hmac.new(result_key(), DOMAIN + text, hashlib.sha256).hexdigest()

    again = ResultStore(partial, {"code": "v1"}, [])
    settled = PlanRecord(again, plan)
    settled.settle()
    assert again.report == "" and settled.history == doc["history"]
    assert again.get_or_compute("int8", "memory", {"k": 1}, lambda: pytest.fail("recomputed")) == {"bits": 8.5}

    tied = ResultStore(tmp_path / "new" / "partial", {"code": "v1"}, [])
    fresh = PlanRecord(tied, plan)
    fresh.settle()
    tied.get_or_compute("int8", "memory", {"k": 1}, lambda: {"bits": 8.5})  # writes the plan first, with its id
    assert len(tied.report) == 32 and json.loads((tied.directory / "plan.json").read_text())["report"] == tied.report
    (partial / "plan.json").write_bytes((tied.directory / "plan.json").read_bytes())
    assert PlanRecord(ResultStore(partial, {"code": "v1"}, []), plan)._unknown() == FOREIGN


def test_a_plan_recorded_before_a_gate_setting_existed_is_the_same_plan_at_its_default():
    """A gate setting added since a plan was recorded (a gated metric's threshold) is read at its default, what
    kvquant did before it: resuming such a run is not refused; a setting changed from its default still is."""
    import dataclasses

    from kvquant.runner.lookplan import LookPlan

    plan = LookPlan.of(load_config(ROOT / "configs" / "smollm2-decide.yaml"))
    older = dataclasses.replace(plan, gate={k: v for k, v in plan.gate.items() if k != "max_flip_rate"})
    assert plan.gate["max_flip_rate"] is None and plan.difference(older) is None
    stricter = LookPlan.of(load_config(ROOT / "configs" / "smollm2-decide.yaml", ["gate.max_flip_rate=0.1"]))
    assert stricter.difference(older) == "gate.max_flip_rate is 0.1 now, null before"
