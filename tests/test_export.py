"""``python -m kvquant.export``: a decision a serving engine runs becomes its flags (DEPLOY.md); anything else is one
line and exit 2."""

import copy
import json
from pathlib import Path

import pytest

from kvquant.export import main
from kvquant.run import main as run_main
from kvquant.signing import signed_json


def candidate(name, quantizer, verdict, bits, **settings):
    metric = {"value": 1.01, "baseline": 1.0, "verdict": verdict, "gated": True}
    return {"name": name, "settings": {"quantizer": quantizer, "residual_length": 0, "sink_tokens": 0, **settings},
            "verdict": verdict, "bits_per_element": bits, "metrics": {"ppl/wikitext2": metric},
            "memory": {"per_layer": [{"layer": i} for i in range(30)]}}


DOC = {"run_id": "abc", "decision": "pass", "chosen": "int8-pth", "reason": "int8-pth is the cheapest passing",
       "command": "python -m kvquant.run x.yaml", "config": {"model": {"path": "local:models/m"}},
       "candidates": [candidate("int8-pth", "vllm_int8_per_token_head", "pass", 8.5),
                      candidate("int4-pth", "vllm_int4_per_token_head", "fail", 4.5),
                      candidate("kivi", "int4", "pass", 5.0, group_size=32)]}


def write(tmp_path, doc):
    """``doc`` as the runner writes it: signed with this user's key (an edited document is signed again here)."""
    (tmp_path / "results.json").write_text(signed_json(doc))
    return tmp_path


def test_an_engine_native_decision_writes_the_engines_flags(tmp_path, capsys):
    assert main([str(write(tmp_path, DOC))]) == 0
    text = (tmp_path / "DEPLOY.md").read_text()
    assert "--kv-cache-dtype int8_per_token_head" in text and "kv_cache_dtype='int8_per_token_head'" in text
    assert "PASS" in text and "| ppl/wikitext2 | 1.01 (baseline 1) | pass |" in text and "Not measured" in text
    assert "wrote" in capsys.readouterr().out


def test_layers_kept_at_full_precision_become_the_engines_skip_layers(tmp_path):
    doc = copy.deepcopy(DOC)
    doc["candidates"][0]["settings"]["layers"] = {"0": {"quantizer": "fp16"}, "29": {"quantizer": "fp16"}}
    assert main([str(write(tmp_path, doc))]) == 0
    text = (tmp_path / "DEPLOY.md").read_text()
    assert "--kv-cache-dtype int8_per_token_head --kv-cache-dtype-skip-layers 0 29" in text
    assert "kv_cache_dtype_skip_layers=['0', '29']" in text


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(chosen="kivi"), "research setting: no serving engine runs kivi (int4); the nearest engine "
     "format measured here is vllm_int4_per_token_head (int4-pth, 4.50 bits/element): FAIL"),
    (lambda d: d["candidates"][0]["settings"].update(residual_length=128), "research setting: no serving engine runs"
     " int8-pth"),
    (lambda d: d["candidates"][0]["settings"].update(layers={"3": {"quantizer": "int4"}}), "research setting"),
    (lambda d: d.update(decision="fail", chosen=None), "the decision is FAIL, with no setting chosen"),
    (lambda d: d.update(chosen="ghost"), "the chosen setting 'ghost' is not among its candidates"),
    (lambda d: d.pop("candidates"), "is not a kvquant results.json"),
    (lambda d: d["candidates"][0]["settings"].update(quantizer="vllm_nvfp4", k_scale=1.0, v_scale=1.0,
                                                     layers={"0": {"k_scale": 0.01, "v_scale": 0.02}}),
     "exporting vllm_nvfp4's global scales (ModelOpt's hf_quant_config.json) is not built yet; the engine would "
     "run at 1.0"),
    (lambda d: d["candidates"][0]["settings"].update(quantizer="vllm_fp8", k_scale=0.05, v_scale=1.0),
     "one k_scale/v_scale for all layers is not exported"),
])
def test_what_cannot_be_deployed_is_one_line_and_exit_2(tmp_path, capsys, change, message):
    doc = copy.deepcopy(DOC)
    change(doc)
    assert main([str(write(tmp_path, doc))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "DEPLOY.md").exists()


INT8_AT_64 = ("keys as 8-bit codes per channel in groups of 128 tokens (the newest up to 127 in the model's dtype "
              "until their group fills), values as 8-bit codes per token in groups of 64 channels; a float16 scale "
              "and zero point per group (asymmetric min-max)")


def recorded_int(name: str, head_dim: int, **options) -> dict:
    """A KIVI-style setting as the runner records it: the quantizer's options and what it derived at head_dim."""
    from kvquant.formats.quantizers import get_quantizer

    quantizer = get_quantizer(name, **options)
    return {**quantizer.describe(), **quantizer.derived_settings(head_dim)}


def test_a_research_setting_says_what_a_kernel_would_store(tmp_path, capsys):
    """Issue 56: where no engine runs the decision, say what a kernel would need. int8 as Qwen2.5's report recorded
    it (head_dim 64): its keys' and values' codes, groups, scales and zero points, the window kept in the model's
    dtype, and the bits; before, the refusal named only the nearest engine format."""
    doc = copy.deepcopy(DOC)
    settings = {k: v for k, v in recorded_int("int8", 64).items() if k != "quantizer"}
    doc["candidates"].append(candidate("int8", "int8", "pass", 8.375, **{**settings, "residual_length": 128}))
    doc["chosen"] = "int8"
    assert main([str(write(tmp_path, doc))]) == 2
    err = capsys.readouterr().err
    assert (f"research setting: no serving engine runs int8 (int8); a kernel would store {INT8_AT_64}; the newest "
            "128 tokens in the model's dtype; 8.38 bits/element all-in; the nearest engine format measured here is "
            "vllm_int8_per_token_head (int8-pth, 8.50 bits/element): PASS") in err, err
    assert err.count("\n") == 1 and not (tmp_path / "DEPLOY.md").exists()


def test_the_kernel_layout_is_the_codecs_the_cache_builds():
    """The words name the groups and bits the codecs store (K8V4 g32 at head_dim 64, int8 at 80, where values take
    the largest divisor of 80 not above 128, per-token keys), and their bits per element with an fp16 scale and zero
    point per group are the table's in docs/quantizers.md; a setting without the groups a report records, a
    keys_values mix or a codebook format says nothing."""
    from kvquant.formats.quantizers import QUANTIZERS, get_quantizer

    int4 = QUANTIZERS.classes["int4"]
    assert int4.kernel_layout(recorded_int("int4", 64, key_bits=8, group_size=32)) == (
        "keys as 8-bit codes per channel in groups of 32 tokens (the newest up to 31 in the model's dtype until their "
        "group fills), values as 4-bit codes per token in groups of 32 channels; a float16 scale and zero point per "
        "group (asymmetric min-max)")
    assert QUANTIZERS.classes["int8"].kernel_layout(recorded_int("int8", 64)) == INT8_AT_64
    assert QUANTIZERS.classes["int8"].kernel_layout(recorded_int("int8", 80, key_axis="token")) == (
        "keys as 8-bit codes per token in groups of 80 channels, values as 8-bit codes per token in groups of 80 "
        "channels; a float16 scale and zero point per group (asymmetric min-max)")
    for name, head_dim, options in (("int8", 64, {}), ("int4", 64, {"key_bits": 8, "group_size": 32}),
                                    ("int8", 80, {"key_axis": "token"})):
        key, value = get_quantizer(name, **options).codecs(head_dim)
        words = QUANTIZERS.classes[name].kernel_layout(recorded_int(name, head_dim, **options))
        for stream, codec in (("keys", key), ("values", value)):
            unit = "tokens" if codec.axis == "channel" else "channels"
            assert f"{stream} as {codec.bits}-bit codes per {codec.axis} in groups of {codec.group} {unit}" in words
    bits = [(8 + 32 / 128 + 8 + 32 / 64) / 2, (8 + 32 / 32 + 4 + 32 / 32) / 2]
    assert bits == [8.375, 7.0]  # int8 and K8V4 g32 at head_dim 64: the reports' 8.38 and 7.00
    assert int4.kernel_layout({"quantizer": "int4", "group_size": 32}) is None
    for name in ("lloyd_max", "keys_values", "vllm_int8_per_token_head"):
        assert QUANTIZERS.classes[name].kernel_layout({"key_bits": 4, "key_group": 32}) is None


def test_a_directory_that_is_not_a_report_is_refused(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "is not a kvquant report directory" in capsys.readouterr().err
    (tmp_path / "results.json").write_text("{not json")
    assert main([str(tmp_path)]) == 2
    assert "not JSON" in capsys.readouterr().err


def test_the_runner_writes_deploy_md_beside_a_report_that_chose_an_engine_format(tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text(f"""
name: engine
output_dir: {tmp_path / "reports"}
candidates:
  - {{quantizer: vllm_int8_per_token_head, name: int8-pth}}
eval:
  perplexity:
    - {{name: tinystories, source: local:text/tinystories/validation-first1000.jsonl, limit: 96, max_length: 128}}
gate: {{bootstrap: 1000, max_kl_divergence: 0.05}}   # 96 windows: the fewest a pass reads (kvquant.runner.counts)
""")
    assert run_main([str(config)]) == 0
    out = tmp_path / "reports" / "engine"
    assert json.loads((out / "results.json").read_text())["chosen"] == "int8-pth"
    assert "--kv-cache-dtype int8_per_token_head" in (out / "DEPLOY.md").read_text()


def test_turboquant_names_the_boundary_layers_vllm_keeps_on_its_own_that_were_measured_quantized(tmp_path):
    doc = copy.deepcopy(DOC)
    chosen = doc["candidates"][0]
    chosen["settings"].update(quantizer="vllm_turboquant_k8v4", layers={"1": {"quantizer": "fp16"},
                                                                        "5": {"quantizer": "fp16"}})
    chosen["memory"] = {"per_layer": [{"layer": i} for i in range(30)]}
    assert main([str(write(tmp_path, doc))]) == 0
    text = (tmp_path / "DEPLOY.md").read_text()
    assert "--kv-cache-dtype turboquant_k8v4 --kv-cache-dtype-skip-layers 1 5" in text
    assert "kvquant measured layers 0, 28, 29 in the format, which vLLM keeps at model precision on its own" in text
    chosen["settings"]["layers"] = {"0-1": {"quantizer": "fp16"}, "28-29": {"quantizer": "fp16"}}
    assert main([str(write(tmp_path, doc))]) == 0
    assert "on its own:" not in (tmp_path / "DEPLOY.md").read_text()


def test_a_searched_map_of_an_engine_format_and_fp16_exports_the_fp16_layers_as_skip_layers():
    """The settings a search map records (the cheapest rung for the cache, fp16 rungs as ``layers`` entries,
    normalized by the cache) are an engine format with skipped layers."""
    import transformers

    import kvquant
    from kvquant.experiment.config import Candidate
    from kvquant.integrations.deploy import native
    from kvquant.integrations.deploy_read import CandidateRecord
    from kvquant.scoring.session import cache_settings
    from kvquant.runner.search import map_candidate

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    ladder = [Candidate("vllm_int4_per_token_head"), Candidate("fp16")]
    found = map_candidate(ladder, {0: 1, 1: 0, 2: 1, 3: 1}, "searched")
    settings = cache_settings(kvquant.make_cache(config, found.quantizer, **found.options))
    entry = {"name": "searched", "settings": settings, "bits_per_element": 4.0, "verdict": "pass", "metrics": {}}
    setting = CandidateRecord.read(entry, 4, Path("results.json"))
    serving, skipped = native(setting)
    assert (serving.engine, serving.flag, serving.needs, skipped) == ("vLLM", "int4_per_token_head",
                                                                      "vLLM's Triton attention backend", [0, 2, 3])
