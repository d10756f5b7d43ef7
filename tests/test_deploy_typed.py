"""Deploy renders from typed results (issue 38, item 2): export reads results.json into a checked, typed
:class:`~kvquant.integrations.deploy_read.Report`, and the runner deploys the document it has just written without
reading it back; both give the same report and the same files."""

import json
import math
import shutil
from pathlib import Path

import pytest

from kvquant.integrations.deploy import deploy_beside, export
from kvquant.integrations.deploy_read import checked_report, load_report
from kvquant.runner import report
from kvquant.experiment.results import (Decision, Measured, Memory, MetricId, MetricRow, Outcomes, Provenance,
    RunResult, Verdict)

REPORTS = Path(__file__).parents[1] / "reports"
DEPLOY_FILES = ("DEPLOY.md", "kv_cache_scheme.json", "kv_scales.safetensors")
ACC = MetricId("acc", "tinystories_lastword")


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))


def plain(values) -> str:
    """Values as JSON text, so that NaN equals NaN."""
    return json.dumps(values)


@pytest.mark.parametrize("name", ["int4", "smollm2-engine-search", "staged", "smollm2-fp8-calibrated"])
def test_a_committed_report_loads_typed_with_the_values_it_records(tmp_path, name):
    doc = json.loads((REPORTS / name / "results.json").read_text())
    shutil.copyfile(REPORTS / name / "results.json", tmp_path / "results.json")
    loaded = load_report(tmp_path, trust_unsigned=True)
    assert (loaded.path, loaded.decision, loaded.run_id, loaded.reason, loaded.command, loaded.model) == (
        tmp_path / "results.json", doc["decision"], doc["run_id"], doc["reason"], doc["command"],
        doc["config"]["model"]["path"])
    if doc["chosen"] is None:
        assert loaded.chosen is None and loaded.candidates == () and loaded.layers is None
        return
    assert loaded.chosen.name == doc["chosen"] and loaded.layers == len(doc["baseline"]["memory"]["per_layer"])
    assert [(c.name, c.settings, c.bits_per_element, c.verdict) for c in loaded.candidates] == [
        (c["name"], c["settings"], c["bits_per_element"], c["verdict"]) for c in doc["candidates"]]
    assert plain([[[m.name, m.value, m.baseline, m.verdict, m.gated] for m in c.metrics] for c in loaded.candidates]
                 ) == plain([[[k, m["value"], m["baseline"], m["verdict"], m["gated"]] for k, m in c["metrics"].items()]
                             for c in doc["candidates"]])
    for candidate, entry in zip(loaded.candidates, doc["candidates"]):
        keys = entry["settings"].get("layers") or {}
        assert sum(len(range(int(k.split("-")[0]), int(k.split("-")[-1]) + 1)) for k in keys) == len(candidate.layers)


@pytest.fixture(scope="module")
def config(tiny_config):
    return tiny_config("deploy",
                       candidates=[{"quantizer": "vllm_fp8", "name": "fp8-head"},
                                   {"quantizer": "int4", "name": "int4"}],
                       eval={"tasks": {"names": ["tinystories_lastword"], "limit": 50}},
                       gate={"tasks": ["tinystories_lastword"], "bootstrap": 1000})


def memory(settings: dict, bits: float) -> Memory:
    measured = {"bits_per_element": bits, "ratio": bits / 16, "tokens": 256, "per_layer": [{"layer": 0}, {"layer": 1}]}
    return Memory(settings, measured, {"ratio": bits / 16, "bits_per_element": bits, "fp16_bytes": 2**20})


def run_choosing_per_head_fp8(config) -> RunResult:
    """A PASS for static fp8 with per-head scales, which the cache records as tuples (``VllmFp8``) and results.json
    as lists."""
    heads = {"0": {"quantizer": "vllm_fp8", "k_scale": (0.01, 0.02), "v_scale": (0.03, 0.04)},
             "1": {"quantizer": "vllm_fp8", "k_scale": (0.05, 0.06), "v_scale": (0.07, 0.08)}}
    fp8 = {"quantizer": "vllm_fp8", "k_scale": 1.0, "v_scale": 1.0, "residual_length": 0, "sink_tokens": 0,
           "layers": heads}
    int4 = {"quantizer": "int4", "group_size": 32, "residual_length": 128, "sink_tokens": 0}
    rows = [MetricRow("fp8-head", ACC, 0.8, 0.8, 50, ci_low=0.98, ci_high=1.02, confidence=0.95),
            MetricRow("int4", ACC, 0.7, 0.8, 50, ci_low=0.8, ci_high=0.9, confidence=0.95)]
    verdicts = [Verdict(rows[0], 0.97, 1.0, "pass"), Verdict(rows[1], 0.97, 0.875, "fail")]
    outcomes = (Outcomes(ACC, (1.0, 0.0)),)
    results = {"baseline": Measured("baseline", outcomes, memory({"quantizer": "fp16"}, 16.0)),
               "fp8-head": Measured("fp8-head", outcomes, memory(fp8, 8.0)),
               "int4": Measured("int4", outcomes, memory(int4, 4.5))}
    decision = Decision("pass", "fp8-head", {"fp8-head": True, "int4": False}, verdicts, "fp8-head is the cheapest "
                        "passing", {"fp8-head": "pass", "int4": "fail"})
    return RunResult(config, tuple(config.candidates), results, tuple(rows), decision,
                     "python -m kvquant.run deploy.yaml", Provenance(3, 0))


def test_the_runner_deploys_the_document_it_wrote_as_export_reads_it_back(tmp_path, config):
    run = run_choosing_per_head_fp8(config)
    out = tmp_path / "report"
    out.mkdir()
    _, written = report.write(out, run)
    assert isinstance(run.results["fp8-head"].memory.settings["layers"]["0"]["k_scale"], tuple)
    assert written["candidates"][0]["settings"]["layers"]["0"]["k_scale"] == [0.01, 0.02]  # as the file holds it
    in_memory = checked_report(written, out / "results.json")
    assert in_memory == load_report(out)
    assert in_memory.chosen.name == "fp8-head" and in_memory.layers == 2 and math.isclose(
        in_memory.chosen.metrics[0].value, 0.8)
    assert deploy_beside(out, written) == (out / "DEPLOY.md", None)
    beside = {name: (out / name).read_bytes() for name in DEPLOY_FILES}
    assert json.loads(beside["kv_cache_scheme.json"])["quantization_config"]["kv_cache_scheme"]["strategy"] == \
        "attn_head"
    for name in DEPLOY_FILES:
        (out / name).unlink()
    assert export(out) == out / "DEPLOY.md"
    assert {name: (out / name).read_bytes() for name in DEPLOY_FILES} == beside


def test_the_runner_step_checks_the_report_directory_as_export_does(tmp_path, config):
    """The document is not read back, but the folder DEPLOY.md goes into is checked as export checks it."""
    run = run_choosing_per_head_fp8(config)
    out = tmp_path / "report"
    out.mkdir()
    _, written = report.write(out, run)
    (out / "results.json").unlink()
    deployed, why = deploy_beside(out, written)
    assert deployed is None and "is not a kvquant report directory: cannot read results.json" in why
    assert not (out / "DEPLOY.md").exists()
