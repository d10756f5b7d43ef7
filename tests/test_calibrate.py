"""Static KV scales calibrated on a split held apart from evaluation (kvquant/scoring/calibrate.py), against scales
recomputed here from the states a plain DynamicCache stores, and the runner measuring with the frozen scales."""

import dataclasses
import json

import pytest
import torch
from transformers import DynamicCache

from kvquant.scoring import calibrate

from kvquant.scoring import data
from kvquant.experiment.config import load_config
from kvquant.scoring.models import load_tokenizer
from kvquant.run import main

CONFIG = """
name: cal
output_dir: {out}
candidates:
  - {{quantizer: vllm_fp8, name: fp8-tensor, calibrate: tensor}}
  - {{quantizer: vllm_fp8, name: fp8-head, calibrate: head}}
  - {{quantizer: vllm_fp8, name: fp8-scale1}}
calibration: {{windows: 3}}
eval:
  perplexity:
    - {{name: tinystories, source: local:text/tinystories/validation-first1000.jsonl, limit: 4, max_length: 128}}
gate: {{bootstrap: 1000}}
"""


def reference_amax(model, windows, per_head: bool, averaging: float = 0.01) -> dict:
    """Per layer and stream: the averaged range's absolute maximum, from the keys and values a DynamicCache holds
    after each window's forward (the post-RoPE states attention reads)."""
    running = {}
    for ids in windows:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.tensor([ids]), cache=cache, use_cache=True)
        for layer, entry in enumerate(cache.layers):
            for role, x in (("k", entry.keys), ("v", entry.values)):
                dims = (0, 2, 3) if per_head else (0, 1, 2, 3)
                low, high = x.float().amin(dims), x.float().amax(dims)
                if (layer, role) in running:
                    old_low, old_high = running[layer, role]
                    low = old_low * (1 - averaging) + low * averaging
                    high = old_high * (1 - averaging) + high * averaging
                running[layer, role] = (low, high)
    return {key: torch.maximum(-low.clamp(max=0), high.clamp(min=0)) for key, (low, high) in running.items()}


def calibration_split(path, tokenizer):
    """The 3 windows after the 4 evaluation windows of the config's perplexity text, cut as evaluation cuts it."""
    cfg = load_config(path)
    pset = cfg.eval.perplexity[0]
    rows = data.load_rows(pset)
    return [w.ids for w in data.windows(dataclasses.replace(pset, limit=7), tokenizer, 128, rows)[4:]]


@pytest.mark.parametrize("per_head", [False, True])
def test_observed_ranges_equal_the_states_a_dynamic_cache_holds(model, tokenizer, stories, per_head):
    windows = [tokenizer(text).input_ids[:60] for text in stories[:3]]
    observed = calibrate.observe(model, windows, per_head, 0.01)
    want = reference_amax(model, windows, per_head)
    for layer, entry in observed.items():
        for role in ("k", "v"):
            assert torch.allclose(torch.tensor(entry[f"{role}_amax"]), want[layer, role].reshape(-1), rtol=1e-6)
    assert len(observed[0]["k_amax"]) == (model.config.num_key_value_heads if per_head else 1)


def test_the_runner_measures_with_scales_calibrated_on_the_held_out_windows(tmp_path, model):
    path = tmp_path / "cal.yaml"
    path.write_text(CONFIG.format(out=tmp_path))
    assert main([str(path)]) in (0, 1, 4)
    doc = json.loads((tmp_path / "cal" / "results.json").read_text())
    cfg = load_config(path)
    windows = calibration_split(path, load_tokenizer(cfg.model))
    assert len(windows) == 3
    for label, per_head in (("fp8-tensor", False), ("fp8-head", True)):
        want = reference_amax(model, windows, per_head)
        entry = doc["calibration"][label]
        assert entry["granularity"] == ("head" if per_head else "tensor") and entry["windows"] == 3
        for layer, own in entry["layers"].items():
            for role in ("k", "v"):
                got = torch.tensor(own[f"{role}_scale"]).reshape(-1)
                assert torch.allclose(got, want[int(layer), role].reshape(-1) / 448, rtol=1e-6), (label, layer, role)
        measured = next(c for c in doc["candidates"] if c["name"] == label)["settings"]["layers"]
        # the gate measured these frozen scales, layer by layer
        frozen = {int(k.split("-")[0]): (v["k_scale"], v["v_scale"]) for k, v in measured.items()}
        assert frozen == {int(k): (v["k_scale"], v["v_scale"]) for k, v in entry["layers"].items()}
    report = (tmp_path / "cal" / "report.md").read_text()
    assert "## Calibrated scales" in report and "| fp8-head | head | 3 |" in report
    assert "fp8-scale1" not in doc["calibration"]

    # exported as a checkpoint declares them: compressed-tensors parses the scheme, the scales are the ones observed
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    from kvquant.export import main as export_main
    from kvquant.signing import SIGNATURE, signed_json

    doc.pop(SIGNATURE)
    for label, per_head in (("fp8-tensor", False), ("fp8-head", True)):
        # as if the gate had chosen it (export deploys a chosen setting that passed, signed by this user's run)
        doc["chosen"], doc["decision"] = label, "pass"
        entry = next(c for c in doc["candidates"] if c["name"] == label)
        entry["verdict"], entry["passed"] = "pass", True
        for metric in entry["metrics"].values():
            metric["verdict"] = "pass" if metric["gated"] else metric["verdict"]
        (tmp_path / "cal" / "results.json").write_text(signed_json(doc))
        assert export_main([str(tmp_path / "cal")]) == 0
        scheme = json.loads((tmp_path / "cal" / "kv_cache_scheme.json").read_text())["quantization_config"]
        parsed = QuantizationConfig.model_validate(scheme).kv_cache_scheme
        assert (parsed.num_bits, parsed.type, parsed.dynamic, parsed.symmetric) == (8, "float", False, True)
        assert parsed.strategy == ("attn_head" if per_head else "tensor")
        tensors = load_file(tmp_path / "cal" / "kv_scales.safetensors")
        want = reference_amax(model, windows, per_head)
        heads = model.config.num_key_value_heads
        for layer in range(model.config.num_hidden_layers):
            for role in ("k", "v"):
                got = tensors[f"model.layers.{layer}.self_attn.{role}_scale"]
                assert got.shape == ((heads, 1, 1) if per_head else (1,)) and got.dtype == torch.float32
                assert torch.allclose(got.reshape(-1), want[layer, role].reshape(-1) / 448, rtol=1e-6)
        deploy = (tmp_path / "cal" / "DEPLOY.md").read_text()
        assert "--kv-cache-dtype fp8" in deploy
        # SGLang loads compressed-tensors KV scales per tensor only; its scale JSON would not reach attention's read
        assert ("--kv-cache-dtype fp8_e4m3" in deploy) is not per_head
        assert ("SGLang: not for these scales" in deploy) is per_head
        assert "`--quantization-param-path` JSON is not written" in deploy or per_head
        assert not (tmp_path / "cal" / "quantization_param.json").exists()


@pytest.mark.parametrize("change, message", [
    ("calibration: {windows: 3}", "calibrate needs a calibration split held apart from evaluation"),
    ("quantizer: vllm_fp8, name: fp8-tensor, calibrate: tensor", "'int4' has no static scales (k_scale, v_scale) to "
     "calibrate; these have: vllm_fp8, vllm_nvfp4"),
    ("quantizer: vllm_fp8, name: fp8-head, calibrate: head", "k_scale is one global scale per layer, not a list"),
    ("name: fp8-tensor, calibrate: tensor}", "calibrate sets k_scale and v_scale per layer; remove options.k_scale"),
    ("calibrate: tensor}", "calibrate must be one of ['tensor', 'head', 'key_offset', 'kmeans', 'fisher_kmeans', "
     "'key_bias'] or null"),
])
def test_bad_calibration_settings_are_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, change, message):
    replacement = {
        "calibration: {windows: 3}": "",
        "quantizer: vllm_fp8, name: fp8-tensor, calibrate: tensor":
            "quantizer: int4, name: fp8-tensor, calibrate: tensor",
        "quantizer: vllm_fp8, name: fp8-head, calibrate: head":
            "quantizer: vllm_nvfp4, name: fp8-head, calibrate: head",
        "name: fp8-tensor, calibrate: tensor}": "name: fp8-tensor, calibrate: tensor, options: {k_scale: 0.1}}",
        "calibrate: tensor}": "calibrate: channel}",
    }[change]
    text = CONFIG.format(out=tmp_path).replace(change, replacement, 1)
    (tmp_path / "bad.yaml").write_text(text)
    monkeypatch.setattr("kvquant.runner.pipeline.load_model", lambda spec: pytest.fail("the model was loaded"))
    assert main([str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_values_beyond_the_format_at_the_calibrated_scale_are_named():
    observed = {0: {"k_amax": [1.0], "k_peak": [600.0 / 448], "v_amax": [1.0], "v_peak": [1.0]}}
    layers = calibrate.scales(observed, 448.0, per_head=False)
    assert layers == {"0": {"k_scale": 1.0 / 448, "v_scale": 1.0 / 448}}
    assert calibrate.saturating(observed, layers, 448.0) == [
        "layer 0 keys reach 600x their scale on the calibration split, beyond the 448x the format holds: they "
        "saturate"]
    # nvfp4's global scale is amax / (6 x 448): a peak at the average saturates nothing
    nvfp4 = calibrate.scales(observed, 6 * 448.0, per_head=False)
    assert calibrate.saturating({0: {**observed[0], "k_peak": [1.0]}}, nvfp4, 6 * 448.0) == []
    # one KV head calibrated per head stays a list (the export declares attn_head)
    assert calibrate.scales({0: {"k_amax": [2.0], "v_amax": [4.0]}}, 2.0, per_head=True) == \
        {"0": {"k_scale": [1.0], "v_scale": [2.0]}}


@pytest.mark.parametrize("peak, shown", [(448.3, "448.3"), (448.04, "448.04"), (448.0004, "448.0004"), (449.6, "450")],
                         ids=["448.3", "448.04", "448.0004", "449.6"])
def test_a_peak_just_beyond_the_format_does_not_read_as_the_limit(peak, shown):
    """Was: 448.3 printed as "reach 448x ..., beyond the 448x the format holds"."""
    observed = {0: {"k_amax": [1.0], "k_peak": [peak / 448], "v_amax": [1.0], "v_peak": [1.0]}}
    assert calibrate.saturating(observed, calibrate.scales(observed, 448.0, per_head=False), 448.0) == [
        f"layer 0 keys reach {shown}x their scale on the calibration split, beyond the 448x the format holds: they "
        "saturate"]


def test_an_unnamed_candidate_keeps_its_label_once_calibrated():
    from kvquant.experiment.config import Candidate

    plain = Candidate("vllm_fp8", calibrate="tensor")
    calibrated = calibrate.with_layers(plain, {"0": {"k_scale": 0.1, "v_scale": 0.2}})
    assert calibrated.label == plain.label == "vllm_fp8" and calibrated.calibrate is None


STORIES = "local:text/tinystories/validation-first1000.jsonl"
STREAM = {"name": "tinystories", "source": STORIES, "layout": "stream", "limit": 2, "max_length": 64}
OVERLAPS = [  # (case, the eval section, the refusal's words); issue 58: each ran and passed (exit 0)
    # the long documents are cut from the same rows: tokens 128-255, the calibration windows, inside the second one
    ("long-context", {"perplexity": [STREAM], "long_context": {"text": "tinystories", "lengths": [64, 128],
                                                                "documents": 2}},
     "are evaluated too, by eval.long_context (text 'tinystories')"),
    # another set reads the same text cut otherwise (longer windows), so it is not "cut alike" and reads on
    ("another-set", {"perplexity": [STREAM, {**STREAM, "name": "longer", "max_length": 128, "limit": 4}]},
     "are evaluated too, by perplexity set 'longer'"),
    # the same stories as documents, 20 of them: the stream's calibration windows are in the first few
    ("documents-layout", {"perplexity": [STREAM, {"name": "docs", "source": STORIES, "limit": 20}]},
     "are evaluated too, by perplexity set 'docs'"),
    # overlapping windows: window `limit` (the first calibration one) shares 32 tokens with the last evaluated one
    ("stride", {"perplexity": [{**STREAM, "stride": 32}]}, "are evaluated too, by perplexity set 'tinystories'"),
    # tinystories_lastword reads stories 500-999 of the same file; documents 500-509 as calibration windows
    ("task", {"perplexity": [{"name": "tinystories", "source": STORIES, "limit": 500, "max_length": 64}],
              "tasks": {"names": ["tinystories_lastword"], "limit": 8}},
     "are evaluated too, by task 'tinystories_lastword'"),
]


def overlap_config(tmp_path, evaluation: dict) -> str:
    gated = [p["name"] for p in evaluation["perplexity"]][:1]
    cfg = {"name": "overlap", "output_dir": str(tmp_path / "reports"), "model": {"path": "local:models/stories260K/hf"},
           "candidates": [{"quantizer": "vllm_fp8", "name": "fp8", "calibrate": "tensor"}],
           "calibration": {"windows": 2}, "eval": {**evaluation, "memory_probe_tokens": 64},
           "gate": {"perplexity": gated, "tasks": evaluation.get("tasks", {}).get("names", [])}}
    path = tmp_path / "overlap.yaml"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("evaluation, needle", [c[1:] for c in OVERLAPS], ids=[c[0] for c in OVERLAPS])
def test_calibration_windows_that_are_evaluated_are_refused(tmp_path, no_model_load, capsys, evaluation, needle):
    """Issue 58: a calibrated candidate took its calibration windows from text that a long-context set, another
    perplexity set or a task then evaluated, and the run passed: scales judged on the data they were fitted to."""
    code = main([overlap_config(tmp_path, evaluation)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, lines)
    assert "calibration.windows: the calibration windows of perplexity set 'tinystories'" in lines[0], lines[0]
    assert needle in lines[0] and "judged on its own data" in lines[0], lines[0]
    assert not (tmp_path / "reports").exists()


def test_calibration_apart_from_every_evaluated_set_is_taken(tmp_path, no_model_load, monkeypatch):
    """The same texts read apart (the long documents after nothing calibrated, the other set within the evaluated
    windows, the task's stories after the calibration windows) pass the check and reach the model."""
    from kvquant.run import ABOVE_RUNNER
    from kvquant.runner.preflight import preflight

    evaluation = {"perplexity": [{**STREAM, "limit": 8}, {**STREAM, "name": "shorter", "max_length": 32, "limit": 4},
                                 {"name": "docs", "source": STORIES, "limit": 1}],
                  "long_context": {"text": "tinystories", "lengths": [64, 128], "documents": 2},
                  "tasks": {"names": ["tinystories_lastword"], "limit": 8}}
    cfg = load_config(overlap_config(tmp_path, evaluation))
    plan, _, _ = preflight(cfg, ABOVE_RUNNER)  # no refusal
    assert plan.calibrate == ("fp8",)
