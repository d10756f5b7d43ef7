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


INT8_AT_64 = ("keys as 8-bit codes per channel in groups of 128 tokens (keys that do not fill a group yet, up to 127, "
              "in the model's dtype), values as 8-bit codes per token in groups of 64 channels; per group a float16 "
              "scale and a float16 minimum (x = minimum + code * scale)")


def recorded_int(name: str, head_dim: int, **options) -> dict:
    """A KIVI-style setting as the runner records it: the quantizer's options and what it derived at head_dim."""
    from kvquant.formats.quantizers import get_quantizer

    quantizer = get_quantizer(name, **options)
    return {**quantizer.describe(), **quantizer.derived_settings(head_dim)}


def refused_research(tmp_path, capsys, settings: dict, bits: float) -> str:
    """export's one line for a report whose decision is ``settings`` (an int format as recorded), chosen alone."""
    doc = copy.deepcopy(DOC)
    own = {k: v for k, v in settings.items() if k != "quantizer"}
    doc["candidates"].append(candidate("mine", settings["quantizer"], "pass", bits, **own))
    doc["chosen"] = "mine"
    assert main([str(write(tmp_path, doc))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not (tmp_path / "DEPLOY.md").exists()
    return err


def test_a_research_setting_says_what_a_kernel_would_store(tmp_path, capsys):
    """Issue 56: where no engine runs the decision, say what a kernel would need. int8 as Qwen2.5's report recorded
    it (head_dim 64, 8.375 bits): its keys' and values' codes, groups and what each group stores, and the bits;
    before, the refusal named only the nearest engine format."""
    err = refused_research(tmp_path, capsys, recorded_int("int8", 64), 8.375)
    assert (f"research setting: no serving engine runs mine (int8); a kernel would store {INT8_AT_64}; 8.38 "
            "bits/element all-in as the report measured them; the nearest engine format measured here is "
            "vllm_int8_per_token_head (int8-pth, 8.50 bits/element): PASS") in err, err


def test_the_kernel_text_adds_kvquants_own_options_and_none_where_layers_differ_or_tokens_are_evicted(tmp_path,
                                                                                                    capsys):
    """Sinks, a full-precision window, pre-RoPE keys and a rotation (with its block) each get their words; a
    per-layer map and eviction get none (the refusal goes on to the nearest engine format)."""
    settings = {**recorded_int("int4", 80, rotation="hadamard", key_bits=8), "residual_length": 128,
                "sink_tokens": 4, "pre_rope": True}
    err = refused_research(tmp_path, capsys, settings, 7.1)
    for words in ("keys as 8-bit codes per channel in groups of 32 tokens", "values as 4-bit codes per token in groups "
                  "of 20 channels", "; the first 4 tokens in the model's dtype, groups counted from the token after "
                  "them", "; the newest 128 tokens in the model's dtype too, key groups formed only from tokens older "
                  "than them", "; keys stored before RoPE", "rotated along head_dim (hadamard blocks of 16, seed 0",
                  "; 7.10 bits/element all-in"):
        assert words in err, (words, err)
    for change in ({"layers": {"3": {"quantizer": "int8"}}}, {"eviction": "h2o", "budget": 256}):
        err = refused_research(tmp_path, capsys, {**recorded_int("int8", 64), **change}, 8.375)
        assert "a kernel would store" not in err and "the nearest engine format measured here is" in err, err


@pytest.mark.parametrize("name, head_dim, options", [
    ("int8", 64, {}), ("int4", 64, {"key_bits": 8, "group_size": 32}), ("int8", 80, {"key_axis": "token"}),
    ("int2", 128, {"value_axis": "channel", "scale_dtype": "float32", "key_group_size": 1}),
])
def test_the_kernel_layout_is_what_the_codecs_the_cache_builds_store(name, head_dim, options):
    """The words name each stream's bits, axis and group, the partial group a per-channel stream keeps in the
    model's dtype (up to group - 1 tokens) and the dtype of each group's scale and minimum, as the codecs the cache
    builds from the same options hold them."""
    from kvquant.formats.quantizers import QUANTIZERS, get_quantizer

    words = QUANTIZERS.classes[name].kernel_layout(recorded_int(name, head_dim, **options))
    key, value = get_quantizer(name, **options).codecs(head_dim)
    for stream, codec in (("key", key), ("value", value)):
        unit = ("token" if codec.axis == "channel" else "channel") + ("s" if codec.group > 1 else "")
        said = f"{stream}s as {codec.bits}-bit codes per {codec.axis} in groups of {codec.group} {unit}"
        assert said in words, (said, words)
        partial = f"({stream}s that do not fill a group yet, up to {codec.group - 1}, in the model's dtype)"
        assert (partial in words) == (codec.axis == "channel" and codec.group > 1), words
    dtype = str(key.scale_dtype).removeprefix("torch.")
    assert words.endswith(f"; per group a {dtype} scale and a {dtype} minimum (x = minimum + code * scale)")


def test_only_the_integer_formats_say_a_kernel_layout():
    """A format that stores something else says nothing, even given a whole integer setting's record (it does not
    inherit the integer formats' words), and an integer setting without the groups a report records says nothing."""
    from kvquant.formats.quantizers import QUANTIZERS

    whole = recorded_int("int8", 64)
    assert QUANTIZERS.classes["int8"].kernel_layout(whole) == INT8_AT_64
    for name in ("lloyd_max", "normal_float", "keys_values", "fp8_e4m3", "vllm_int8_per_token_head", "llamacpp_q8_0"):
        assert QUANTIZERS.classes[name].kernel_layout(whole) is None, name
    assert QUANTIZERS.classes["int4"].kernel_layout({"quantizer": "int4", "group_size": 32}) is None


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
