"""A report rendered again from stored results (``python -m kvquant.run CONFIG --render-only [--partial DIR]``,
issue 53 item 2): no model loaded, nothing measured; the same stored results under the same code give the run's
own verdicts; a stored result of other inputs, or one whose signature does not verify, refuses with one line and
nothing written; a look the folder lacks is named on its row; the header names the code that measured the results
and the code that judged them."""

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml

import kvquant.adopt
import kvquant.run
import kvquant.runner.pipeline
import kvquant.scoring.models
from refusals import error_line
from tiny_configs import SEARCHED_RUN, tiny_run, tiny_weights
from kvquant.run import main
from kvquant.experiment import provenance
from kvquant.experiment.config import load_config
from kvquant.runner.expected import Expected, model_without_weights
from kvquant.runner.preflight import context_length
from kvquant.runner.lookplan import LookPlan, PlanRecord
from kvquant.runner.store import ResultStore
from kvquant.scoring.models import check_model

TASK, PPL, KL = "task/tinystories_lastword", "ppl/tinystories", "kl/tinystories"
#: stories260K's weights digest: what the run's store keys every result with
WEIGHTS = tiny_weights()
LOOKS = [(0, 5), (5, 10), (10, 20), (20, 40)]  # limit 5, max_documents 40
READS = {"keys_quantized": 1000, "keys": 1000, "values_quantized": 1000, "values": 1000}


@pytest.fixture(autouse=True)
def here(tmp_path, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))


def memory(bits: float) -> dict:
    total = int(40960 * bits)
    return {"total_bytes": total, "ratio": bits / 16, "bits_per_element": bits, "payload_bytes": total,
            "scale_bytes": 0, "full_precision_bytes": 0, "fp16_bytes": 40960 * 16, "shared_saved_bytes": 0,
            "shareable_bytes": total, "shared_bytes": 0, "tokens": 512, "per_device": {"cpu": total}}


def stored(rng) -> dict:
    """What the tiny run measures, synthetic: 4 windows of 63 scored tokens, 40 documents in 4 looks; int4 loses
    about a fifth of the baseline's right answers (open at every look)."""
    base = (rng.random(40) < 0.6).astype(float)
    lost = base * (rng.random(40) < 0.8)
    out = {("baseline", "memory"): memory(32.0), ("int4", "memory"): memory(6.5)}
    for label, scores in (("baseline", base), ("int4", lost)):
        for a, b in LOOKS:
            metric = TASK if a == 0 else f"{TASK}@{a}-{b}"
            out[label, metric] = {"task": "tinystories_lastword", "acc": scores[a:b].tolist(), "reads": READS,
                                  "lengths": [400] * (b - a)}
        nll = (90 + rng.random(4) * (0 if label == "baseline" else 3)).tolist()
        out[label, PPL] = {"nll": nll, "tokens": [63] * 4, "reads": READS, "lengths": [64] * 4}
    kl = (rng.gamma(2.0, 0.005, size=(4, 63))).tolist()
    out["int4", KL] = {**out["int4", PPL], "kl": kl, "top1": [60, 59, 61, 58]}
    return out


def setup(tmp_path: Path, results: dict, code: dict | None = None, folder: Path | None = None) -> tuple[Path, Path]:
    """The tiny config with sequential looks, and its ``partial/`` (or ``folder``, with the plan a run records beside
    its results: results travel with their plan) holding ``results`` signed under this user's key, keyed as the run
    keys them (measured by ``code``, default this checkout's)."""
    config = tmp_path / "tiny.yaml"
    if not config.exists():
        doc = {**tiny_run("tiny", "int4", 5, max_documents=40), "output_dir": str(tmp_path / "reports")}
        config.write_text(yaml.safe_dump(doc))
    cfg = load_config(config)
    model_config = check_model(cfg.model)
    expected = Expected(cfg, model_config, context_length(cfg, model_config))
    partial = folder or tmp_path / "reports" / "tiny" / "partial"
    partial.parent.mkdir(parents=True, exist_ok=True)
    store = ResultStore(partial, code or provenance.code_version(), [])
    if folder is not None:
        PlanRecord(store, LookPlan.of(cfg)).settle()
    for (label, metric), result in results.items():
        key = {**expected.inputs(label, metric), "weights": WEIGHTS}
        store.get_or_compute(label, metric, key, lambda r=result: r)
    return config, partial


def no_model(monkeypatch) -> None:
    """Any model load fails the test."""
    def trap(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(kvquant.runner.pipeline, "load_model", trap)
    monkeypatch.setattr(kvquant.scoring.models, "load_model", trap)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", trap)


def verdicts(doc: dict) -> dict:
    """Every metric's verdict, interval and documents, and the decision."""
    rows = {(c["name"], m): (e["verdict"], e["ci_low"], e["ci_high"], e["n"], e["value"], e["confidence"])
            for c in doc["candidates"] for m, e in c["metrics"].items()}
    return {"decision": (doc["decision"], doc["chosen"]), **rows}


def refused(capsys, argv: list, needle: str) -> None:
    capsys.readouterr()
    line = error_line(main([str(a) for a in argv]), capsys.readouterr().err, needle)
    assert line.startswith("kvquant: error: render: "), line


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """The tiny run, its results stored beforehand (it measures nothing, so its model only hashes its weights):
    its config, partial folder, exit code and results.json."""
    results = stored(np.random.default_rng(20261206))
    config, partial = setup(tmp_path, results)
    code = main([str(config)])
    doc = json.loads((tmp_path / "reports" / "tiny" / "results.json").read_text())
    assert doc["results"]["computed"] == 0  # every result was stored
    return config, partial, code, doc, results


def test_a_report_rendered_from_its_own_stored_results_gives_the_runs_verdicts(measured, monkeypatch, capsys):
    config, partial, code, doc, results = measured
    no_model(monkeypatch)
    assert main([str(config), "--render-only"]) == code
    out_dir = partial.parent
    again = json.loads((out_dir / "results.json").read_text())
    assert verdicts(again) == verdicts(doc)
    assert again["candidates"][0]["metrics"]["acc/tinystories_lastword"]["n"] == 40  # every look taken
    measured_by = dict(again["rendered"]["measured_by"])
    assert measured_by.pop("git_commit") == doc["environment"]["git_commit"]  # the commit the run recorded
    assert measured_by == provenance.code_version()
    assert again["rendered"]["results"] == len(results) and again["rendered"]["vouched"] == 0
    assert again["rendered"]["not_stored"] == [] and again["results"]["computed"] == 0
    text = (out_dir / "report.md").read_text()
    assert "rendered from stored results, no model loaded" in text
    assert f"`python -m kvquant.run {config} --render-only`" in text
    assert f"measuring sources {provenance.code_version()['kvquant_source_sha256']}" in text
    # the plan its results were measured under (partial/plan.json) is the plan they are judged under
    before = snapshot(out_dir)
    refused(capsys, [config, "--render-only", "--set", "gate.max_documents=20"],
            "measured under another plan (gate.max_documents is 20 now, 40 before)")
    assert snapshot(out_dir) == before
    main([str(config), "--render-only", "--set", "gate.max_documents=20", "--replan"])
    replanned = json.loads((out_dir / "results.json").read_text())["replanned"]
    assert replanned["plans"] == 2 and replanned["changes"] == ["gate.max_documents is 20 now, 40 before"]
    assert snapshot(out_dir / "partial") == {p: b for p, b in before.items() if "partial" in p.parts}  # not written


def test_a_look_not_stored_is_named_on_its_row_and_not_measured(measured, monkeypatch):
    config, partial, code, doc, _ = measured
    no_model(monkeypatch)
    (partial / "int4" / "task__tinystories_lastword@20-40.json").unlink()
    main([str(config), "--render-only"])
    again = json.loads((partial.parent / "results.json").read_text())
    row = again["candidates"][0]["metrics"]["acc/tinystories_lastword"]
    assert (row["n"], row["verdict"]) == (20, "inconclusive")
    note = "documents 20-39 not stored yet; the run without --render-only takes them"
    assert row["note"] == note
    assert again["rendered"]["not_stored"] == ["int4 tinystories_lastword documents 20-39"]
    assert note in (partial.parent / "report.md").read_text()


def test_a_baselines_look_not_stored_leaves_the_candidate_open_not_at_its_last_look(measured, monkeypatch):
    """Review: the candidate's 40 documents are stored, the baseline's last look is not, so the row has no paired
    interval; it is not at its last look (which would stop its looks and hide what is missing): it names the look."""
    config, partial, *_ = measured
    no_model(monkeypatch)
    (partial / "baseline" / "task__tinystories_lastword@20-40.json").unlink()
    main([str(config), "--render-only"])
    again = json.loads((partial.parent / "results.json").read_text())
    row = again["candidates"][0]["metrics"]["acc/tinystories_lastword"]
    assert (row["verdict"], row["note"]) == ("inconclusive",
                                             "documents 20-39 not stored yet; the run without --render-only takes them")
    assert again["rendered"]["not_stored"] == ["baseline tinystories_lastword documents 20-39"]


def snapshot(folder: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_stored_results_of_other_inputs_or_unverified_signatures_are_refused(measured, monkeypatch, capsys,
                                                                            tmp_path):
    config, partial, _, _, _ = measured
    no_model(monkeypatch)
    before = snapshot(partial.parent)
    refused(capsys, [config, "--render-only", "--set", "eval.batch_size=2"],
            "inputs.batch_size is 1, this config's run would use 2")
    assert snapshot(partial.parent) == before
    # a value edited under its key: the signature no longer verifies under this user's key
    path = partial / "int4" / "ppl__tinystories.json"
    saved = json.loads(path.read_text())
    saved["result"]["nll"][0] -= 5.0
    path.write_text(json.dumps(saved))
    before = snapshot(partial.parent)
    refused(capsys, [config, "--render-only"], f"{path}: its signature does not verify under your key")
    assert snapshot(partial.parent) == before
    # the same folder named with --partial: the user vouches for it (as kvquant.adopt), and the header says so
    carried = tmp_path / "carried"
    shutil.copytree(partial, carried)
    main([str(config), "--render-only", "--partial", str(carried)])
    again = json.loads((partial.parent / "results.json").read_text())
    assert again["rendered"]["vouched"] == 1 and again["rendered"]["from"] == str(carried)
    # a result the report needs and no look's: refused, not measured
    (carried / "int4" / "memory.json").unlink()
    before = snapshot(partial.parent)
    refused(capsys, [config, "--render-only", "--partial", carried], f"{carried} holds no memory of int4")
    assert snapshot(partial.parent) == before


def test_results_measured_by_other_code_are_judged_by_todays_and_say_so(measured, monkeypatch, capsys, tmp_path):
    """Stored by a code version other than this checkout's (a run under today's code would measure them again):
    rendered with the same verdicts, the header naming both; a folder of two code versions is refused."""
    config, partial, code, doc, results = measured
    other = {**provenance.code_version(), "kvquant_source_sha256": "0123456789abcdef"}
    folder = tmp_path / "elsewhere"
    setup(tmp_path, results, other, folder)
    no_model(monkeypatch)
    assert main([str(config), "--render-only", "--partial", str(folder)]) == code
    again = json.loads((partial.parent / "results.json").read_text())
    assert verdicts(again) == verdicts(doc)
    assert again["rendered"]["measured_by"]["kvquant_source_sha256"] == "0123456789abcdef"
    today = provenance.code_version()["kvquant_source_sha256"]
    assert again["rendered"]["judged_by"]["kvquant_source_sha256"] == today != "0123456789abcdef"
    assert "measured by code with measuring sources 0123456789abcdef" in (partial.parent / "report.md").read_text()
    shutil.copy(partial / "int4" / "memory.json", folder / "int4" / "memory.json")  # of this checkout's code
    refused(capsys, [config, "--render-only", "--partial", folder], "measured by 2 code versions")


def test_partial_without_render_only_is_refused(tmp_path, capsys):
    config, _ = setup(tmp_path, {})
    capsys.readouterr()
    assert main([str(config), "--partial", str(tmp_path)]) == 2
    assert "--partial names the stored results --render-only reads" in capsys.readouterr().err



def test_a_cache_that_stores_keys_before_rope_is_rendered_and_adopted(tmp_path, monkeypatch):
    """A pre-RoPE cache takes RoPE from the model's modules: adopting or rendering its stored results keyed it on
    the model's config and refused ('pre_rope needs the loaded model'); now on the model built without its weights,
    with exactly the keys the run gives them (it measures nothing) and the run's verdicts."""
    config = tmp_path / "tiny.yaml"
    doc = {**tiny_run("tiny", "int4", 5, max_documents=40), "output_dir": str(tmp_path / "reports")}
    doc["candidates"][0]["options"]["pre_rope"] = True
    config.write_text(yaml.safe_dump(doc))
    results = stored(np.random.default_rng(20261207))
    _, partial = setup(tmp_path, results)  # keyed by kvquant.runner.expected, as adopt and the render check them
    code = main([str(config)])
    measured = json.loads((partial.parent / "results.json").read_text())
    assert measured["results"]["computed"] == 0  # the run, on the loaded model, keys every result the same
    assert measured["candidates"][0]["settings"]["pre_rope"] is True
    carried = tmp_path / "carried"
    shutil.move(partial, carried)
    assert kvquant.adopt.main([str(config), str(carried)]) == 0
    no_model(monkeypatch)
    assert main([str(config), "--render-only"]) == code
    again = json.loads((partial.parent / "results.json").read_text())
    assert verdicts(again) == verdicts(measured) and again["rendered"]["results"] == len(results)


def test_a_run_that_calibrates_is_refused_in_one_line(tmp_path, capsys):
    """Calibration fits on the model between measurements: refused, nothing written (a search no longer is)."""
    config = tmp_path / "tiny.yaml"
    doc = {**tiny_run("tiny", "fp8", 5), "output_dir": str(tmp_path / "reports")}
    doc["candidates"] = [{"quantizer": "vllm_fp8", "name": "fp8", "calibrate": "tensor"}]
    doc["calibration"] = {"windows": 2}
    config.write_text(yaml.safe_dump(doc))
    refused(capsys, [config, "--render-only"], "calibration runs on the model between measurements")
    assert not (tmp_path / "reports" / "tiny").exists()


def searched(out: Path) -> str:
    """tiny_configs.SEARCHED_RUN with keys stored before RoPE in both rungs, the search gated on perplexity alone at
    a ratio some maps pass (so it bisects) and the gate on point estimates."""
    doc = yaml.safe_load(SEARCHED_RUN.format(out=out))
    doc["gate"]["decide_on"] = "point"
    doc["search"].update(documents=0, max_perplexity_ratio=1.05)
    for rung in doc["search"]["ladder"]:
        rung["options"]["pre_rope"] = True
    return yaml.safe_dump(doc)


@pytest.mark.slow
def test_a_run_with_a_search_of_keys_before_rope_renders_its_own_verdicts(tmp_path, monkeypatch):
    """A search replays from the stored results its run measured (each map it checked on the calibration split is
    one), and a cache that stores keys before RoPE is keyed on the model's modules without its weights: before,
    the render refused every search, and every pre-RoPE candidate with 'pre_rope needs the loaded model'."""
    config = tmp_path / "searched.yaml"
    config.write_text(searched(tmp_path / "reports"))
    code = main([str(config)])
    out_dir = tmp_path / "reports" / "searched-tiny"
    doc = json.loads((out_dir / "results.json").read_text())
    assert doc["candidates"][0]["settings"]["pre_rope"] is True
    assert doc["search"]["found"] and len(doc["search"]["checked"]) > 2  # a bisection over the maps, which it replays
    no_model(monkeypatch)
    assert main([str(config), "--render-only"]) == code
    again = json.loads((out_dir / "results.json").read_text())
    assert verdicts(again) == verdicts(doc)
    assert again["search"] == doc["search"]  # the same sensitivities, maps checked and map
    assert again["candidates"][0]["settings"] == doc["candidates"][0]["settings"]
    assert again["results"]["computed"] == 0 and again["rendered"]["results"] == doc["results"]["computed"]


def test_a_search_is_replayed_not_refused(tmp_path, capsys):
    """Before, a config with a search was refused outright; now its stored results are read, so a folder without
    them refuses naming the first result the search needs."""
    config = tmp_path / "searched.yaml"
    config.write_text(searched(tmp_path / "reports"))
    cfg = load_config(config)
    model_config = check_model(cfg.model)
    expected = Expected(cfg, model_config, context_length(cfg, model_config))
    (tmp_path / "reports" / "searched-tiny").mkdir(parents=True)
    store = ResultStore(tmp_path / "reports" / "searched-tiny" / "partial", provenance.code_version(), [])
    store.get_or_compute("baseline", "memory", {**expected.inputs("baseline", "memory"), "weights": WEIGHTS},
                         lambda: memory(32.0))
    refused(capsys, [config, "--render-only"], "holds no ppl/tinystories of search-baseline")


def test_the_model_without_weights_leaves_its_config_alone_and_computes_rope():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=64)
    before = copy.deepcopy(config.__dict__)
    model = model_without_weights(config)
    assert config.__dict__ == before  # building a model writes to the config it is given: a copy here
    assert all(p.device.type == "meta" for p in model.parameters())
    torch.manual_seed(0)
    built = transformers.LlamaForCausalLM(config)
    assert torch.equal(model.model.rotary_emb.inv_freq, built.model.rotary_emb.inv_freq)
