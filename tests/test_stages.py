"""The staged memory loop: the decision rule, the serving measurements (bytes with and without prefix sharing and
eviction, max batch), and a run on stories260K where prefix sharing changes no score."""

import json

import pytest
import torch
import transformers

import kvquant
from kvquant.errors import ConfigError
from kvquant.experiment.config import ServingConfig, Stage, load_config
from kvquant.run import main
from kvquant.scoring.stages import serve, serving_tokens, staged_decision

STAGES = [Stage("fp8_e4m3", {}, "a"), Stage("fp8_e4m3", {}, "b", True), Stage("int2", {}, "c", True)]


@pytest.mark.parametrize("passed, expected", [
    ({"a": True, "b": True, "c": True}, ("pass", "c", None)),
    ({"a": True, "b": True, "c": False}, ("pass", "b", "c")),
    ({"a": True, "b": False, "c": True}, ("pass", "a", "b")),  # a later pass does not undo the first failure
    ({"a": False, "b": True, "c": True}, ("fail", None, "a")),
])
def test_the_decision_is_the_last_stage_before_the_first_failing_one(passed, expected):
    assert staged_decision(STAGES, passed)[:3] == expected


def tiny_model():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_serving_bytes_with_sharing_and_eviction():
    model = tiny_model()
    serving = ServingConfig(requests=4, prefix=40, suffix=8, decode_steps=3, memory_budget="1MiB")
    prefix, suffixes = serving_tokens(serving, list(range(3, 64)) * 2)
    assert len(prefix) == 40 and [len(s) for s in suffixes] == [8] * 4 and suffixes[0] != suffixes[1]
    options = {"group_size": 8, "residual_length": 0}
    alone = serve(model, Stage("int4", options, "x"), serving, prefix, suffixes)
    shared = serve(model, Stage("int4", options, "y", True), serving, prefix, suffixes)
    evict = serve(model, Stage("int4", {**options, "eviction": "window", "window": 16}, "z", True), serving, prefix,
                  suffixes)
    # sharing stores the prefix's 40 tokens (5 whole key groups) once instead of four times
    cache = kvquant.make_cache(model, "int4", **options)
    with torch.no_grad():
        model(torch.tensor([prefix]), cache=cache)
    once = cache.memory_report()["shareable_bytes"]
    assert shared.shared_bytes == once and shared.shared_saved_bytes == 3 * once
    assert shared.kv_bytes == alone.kv_bytes - 3 * once
    assert alone.shared_bytes == 0 and alone.kv_bytes_per_request == alone.kv_bytes / 4
    # the window keeps 16 tokens (+ up to a group of 8 more keys) of each request's 51: far fewer bytes
    assert evict.kv_bytes < alone.kv_bytes / 2
    assert len(alone.step_ms) == 3 and alone.p50_ms <= alone.p99_ms
    # max batch: the shared bytes once, then each request's own bytes
    budget = 10**6
    assert shared.max_batch(budget) == int((budget - once) // shared.own_bytes_per_request)
    assert alone.max_batch(budget) == int(budget // (alone.kv_bytes / 4))
    with pytest.raises(kvquant.KVQuantError, match="tokens are needed"):
        serving_tokens(serving, list(range(50)))


CONFIG = """
name: staged
output_dir: {out}
stages:
  - {{quantizer: int8, name: int8, options: {{residual_length: 0}}}}
  - {{quantizer: int8, name: int8_prefix, options: {{residual_length: 0}}, prefix_sharing: true}}
  - {{quantizer: int8, name: int8_prefix_evict, prefix_sharing: true,
     options: {{residual_length: 0, eviction: sink_window, sink_tokens: 2, window: 16}}}}
serving: {{requests: 3, prefix: 64, suffix: 16, decode_steps: 4, memory_budget: 2MiB}}
eval:
  mode: streaming
  chunk_size: 16
  batch_size: 8
  perplexity:
    - {{name: tinystories, source: local:text/tinystories/validation-first1000.jsonl, limit: 4, max_length: 128}}
  tasks: {{names: [tinystories_lastword], limit: 12}}
gate: {{bootstrap: 1000}}
"""


def staged_config(tmp_path):
    path = tmp_path / "staged.yaml"
    path.write_text(CONFIG.format(out=tmp_path))
    return path


@pytest.mark.slow
def test_a_staged_run_reports_stages_in_order_and_sharing_costs_nothing(tmp_path):
    path = staged_config(tmp_path)
    code = main([str(path)])
    doc = json.loads((tmp_path / "staged" / "results.json").read_text())
    by_name = {c["name"]: c for c in doc["candidates"]}
    assert list(by_name) == ["int8", "int8_prefix", "int8_prefix_evict"]
    # prefix sharing changes no score: the same per-document outcomes and the same perplexity
    for metric, entry in by_name["int8"]["metrics"].items():
        assert by_name["int8_prefix"]["metrics"][metric]["value"] == entry["value"], metric
    # a window of 16 tokens (chunks of 16) loses perplexity against keeping everything
    ppl = by_name["int8_prefix_evict"]["metrics"]["ppl/tinystories"]
    assert ppl["value"] > by_name["int8"]["metrics"]["ppl/tinystories"]["value"]
    staged = doc["staged"]
    assert staged["stages"] == ["int8", "int8_prefix", "int8_prefix_evict"]
    serving = staged["serving"]
    assert serving["int8_prefix"]["kv_bytes"] < serving["int8"]["kv_bytes"] < serving["baseline"]["kv_bytes"]
    assert serving["int8_prefix_evict"]["kv_bytes"] < serving["int8_prefix"]["kv_bytes"]
    passed = {name: c["passed"] for name, c in by_name.items()}
    verdict, chosen, first, _ = staged_decision(
        [Stage("int8", {}, n) for n in staged["stages"]], passed)
    if first is not None and chosen is None and by_name[first]["verdict"] != "fail":
        verdict = "inconclusive"  # the first stage is not shown to pass, nor to fail
    assert (doc["decision"], doc["chosen"], staged["first_failing"]) == (verdict, chosen, first)
    assert code == {"pass": 0, "fail": 1, "inconclusive": 4}[verdict]
    report = (tmp_path / "staged" / "report.md").read_text()
    assert "## Stages" in report and (tmp_path / "staged" / "stages.png").stat().st_size > 0


@pytest.mark.parametrize("change, message", [
    ("candidates=[{quantizer: int8}]", "a staged run measures its stages only"),
    ("serving.requests=0", "requests must be in 1..1000000"),
])
def test_bad_staged_configs(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load_config(staged_config(tmp_path), [change])


def test_eviction_in_simulated_mode_is_refused_before_the_model_loads(tmp_path, capsys):
    path = staged_config(tmp_path)
    assert main([str(path), "--set", "eval.mode=simulated"]) == 2
    assert "set eval.mode: streaming" in capsys.readouterr().err


def test_a_serving_shape_beyond_the_model_or_its_text_is_refused_before_the_model_loads(tmp_path, capsys):
    path = staged_config(tmp_path)
    assert main([str(path), "--set", "serving.prefix=1000"]) == 2  # stories260K has 512 positions
    assert "beyond the model's 512 positions" in capsys.readouterr().err
    assert main([str(path), "--set", "serving.requests=100000", "--set", "serving.suffix=16"]) == 2
    assert "tokens are needed (prefix + requests x suffix)" in capsys.readouterr().err


def test_a_simulated_scorer_refuses_an_evicting_cache():
    from kvquant.scoring.scorer import Scorer
    model = tiny_model()
    with pytest.raises(kvquant.KVQuantError, match="use streaming mode"):
        Scorer(model, kvquant.CacheSpec.of("fp8_e4m3", {"eviction": "window", "window": 8}), "simulated")


def test_a_first_stage_that_is_only_inconclusive_is_not_said_to_fail():
    """The reason names a first stage that does not pass without calling it failed: the runner adds whether it
    failed or is inconclusive (it read "fp8 fails the gate; fp8 is inconclusive, not shown to fail")."""
    reason = staged_decision(STAGES, {s.label: False for s in STAGES})[3]
    assert reason == f"the first stage, {STAGES[0].label}, does not pass the gate"
    reason = staged_decision(STAGES, {s.label: i == 0 for i, s in enumerate(STAGES)})[3]
    assert "fail" not in reason and reason.endswith(f"the first that does not pass ({STAGES[1].label})")
