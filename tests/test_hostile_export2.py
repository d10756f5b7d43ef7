"""Hostile inputs to ``python -m kvquant.export`` found by the second blind probe (issue 36): a llama.cpp setting
whose rotation blocks llama.cpp never rotates with, or that carries static scales; an engine format with per-layer
scales the engine would not run; tens of thousands of gated metrics; a results.json that is a directory. Each is
one line and exit 2, with nothing written (the documents are signed with this test's key: what an older signed
file, or one passed with ``--trust-unsigned``, looks like)."""

import pytest
from test_export_llamacpp import LAYERS, document, export, recorded, refused

from kvquant.export import main


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))


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
    # E17: attn_rot true, nothing rotated (the runner refuses attn_rot true where llama.cpp rotates nothing)
    ({"attn_rot": True, "key_rotation_block": None, "value_rotation_block": None},
     "rotation blocks must be present for every quantized type"),
    ({"attn_rot": True, "value_rotation_block": None}, "rotation blocks must be present for every quantized type"),
    # E19: both quantized, K rotated and V not: one head size decides both
    ({"value_rotation_block": None}, "rotation blocks must be present for both quantized types or neither"),
    ({"key_rotation_block": None}, "rotation blocks must be present for both quantized types or neither"),
    # E18, E38: llama.cpp rotates V by 64 only
    ({"value_rotation_block": 128}, "value_rotation_block must be null or 64, llama.cpp's V block"),
    ({"value_rotation_block": 65536}, "value_rotation_block must be null or 64, llama.cpp's V block"),
    # E15: the runner writes an int
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
    (edited("llamacpp_q8_0", k_scale=100.0), "settings.k_scale must be absent"),  # E30
    (edited("llamacpp_q8_0", v_scale=1.0), "settings.v_scale must be absent"),
    (layered(recorded("llamacpp_q8_0"), k_scale=0.5), "settings.layers['0'].k_scale must be absent"),  # E31
    (layered(recorded("llamacpp_q4_0"), v_scale=0.5), "settings.layers['0'].v_scale must be absent"),
])
def test_static_scales_on_a_llamacpp_setting_are_refused(tmp_path, capsys, settings, message):
    """llama.cpp's cache types take no static scales: DEPLOY.md would drop them silently."""
    refused(tmp_path, capsys, document(settings), message)


@pytest.mark.parametrize(("settings", "message"), [
    # E87: a dynamic per-token-head format has no static scales: vLLM would run its own, not these
    (layered({"quantizer": "vllm_int8_per_token_head"}, k_scale=0.5, v_scale=0.5),
     "vllm_int8_per_token_head takes no static k_scale/v_scale"),
    ({"quantizer": "vllm_int8_per_token_head", "v_scale": 0.5}, "takes no static k_scale/v_scale"),
    # E98: nvfp4's global scales per layer, with none at the top
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
    """E101: DEPLOY.md's table has a row per gated metric: more than 1,024 is no report the runner writes."""
    doc = document(recorded("llamacpp_q8_0"))
    metric = doc["candidates"][0]["metrics"]["kl/wikitext2"]
    doc["candidates"][0]["metrics"] = {f"m{i:05d}" + "x" * 194: dict(metric) for i in range(60_000)}
    refused(tmp_path, capsys, doc, "gated metrics must be at most 1,024, got str '60,000 of them'")
    doc["candidates"][0]["metrics"] = {f"m{i:05d}" + "x" * 194: dict(metric) for i in range(1024)}
    text = export(tmp_path, doc)
    assert text.count("| m0") == 1024 and len(text.encode()) < 1_000_000


def test_a_results_json_that_is_a_directory_is_one_line_and_exit_2(tmp_path, capsys):
    """F13: as a FIFO is (a directory opens read-only, and reading it fails)."""
    folder = tmp_path / "report"
    (folder / "results.json").mkdir(parents=True)
    assert main([str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "results.json is not a regular file" in err, err
    assert sorted(p.name for p in folder.iterdir()) == ["results.json"]
