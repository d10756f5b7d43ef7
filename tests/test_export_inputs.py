"""``python -m kvquant.export`` and the runner's deploy step against reports it should not trust: a results.json this
user's run did not sign, another user's file, symlinks, hostile text, hand-edited decisions, metrics, scales and
layers, malformed documents and blocked targets are each one line and exit 2 with nothing written; a setting that
quantizes nothing deploys the model-precision cache; a run that passed with nothing to deploy exits 0 and says so.
"""

import copy
import json
import os
from pathlib import Path

import pytest

from kvquant.export import main
from kvquant.signing import SIGNATURE, signed_json


LAYERS = 30

DEPLOY_FILES = ("DEPLOY.md", "kv_cache_scheme.json", "kv_scales.safetensors")

AS_ROOT = pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user")


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    """This test's own key (kvquant's private cache in a fresh folder)."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))


def candidate(name: str, quantizer: str, verdict: str = "pass", bits: float = 8.5, **settings) -> dict:
    metric = {"value": 1.01, "baseline": 1.0, "verdict": verdict, "gated": True}
    return {"name": name, "settings": {"quantizer": quantizer, "residual_length": 0, "sink_tokens": 0, **settings},
            "verdict": verdict, "passed": verdict == "pass", "bits_per_element": bits,
            "metrics": {"ppl/wikitext2": metric}, "memory": {"per_layer": [{"layer": i} for i in range(LAYERS)]}}


def document() -> dict:
    """A PASS decision for an engine format, with a failing engine format beside it."""
    return {"run_id": "abc", "decision": "pass", "chosen": "int8-pth", "reason": "int8-pth is the cheapest passing",
            "command": "python -m kvquant.run x.yaml", "config": {"model": {"path": "local:models/m"}},
            "candidates": [candidate("int8-pth", "vllm_int8_per_token_head"),
                           candidate("int4-pth", "vllm_int4_per_token_head", "fail", 4.5)]}


def calibrated_pass_document() -> dict:
    """A PASS decision for static fp8 with per-layer scales (what ``calibrate: tensor`` records)."""
    doc = document()
    doc["chosen"] = "fp8-cal"
    layers = {str(i): {"k_scale": 0.02 + i / 1000, "v_scale": 0.03} for i in range(LAYERS)}
    doc["candidates"].append(candidate("fp8-cal", "vllm_fp8", bits=8.0, k_scale=1.0, v_scale=1.0, layers=layers))
    return doc


def report(tmp_path: Path, doc: dict | None = None, text: str | None = None, name: str = "report") -> Path:
    """A report directory holding ``doc`` signed with this test's key (or ``text`` as it is)."""
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "results.json").write_text(signed_json(doc or document()) if text is None else text)
    return folder


def refused(capsys, folder: Path, args: list[str], message: str) -> str:
    """Export exits 2 with one line holding ``message``, and writes nothing."""
    assert main([str(folder), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not [n for n in DEPLOY_FILES if os.path.lexists(folder / n)]
    return err


def test_a_results_json_no_run_of_this_user_signed_is_refused_unless_trusted(tmp_path, capsys):
    folder = report(tmp_path, text=json.dumps(document()))  # forged by hand: a valid document, no signature
    refused(capsys, folder, [], "carries no signature")
    assert main([str(folder), "--trust-unsigned"]) == 0  # an older kvquant's report, checked by its owner
    assert "--kv-cache-dtype int8_per_token_head" in (folder / "DEPLOY.md").read_text()


def test_an_edited_or_foreign_signed_results_json_does_not_verify(tmp_path, capsys, monkeypatch):
    folder = report(tmp_path)
    doc = json.loads((folder / "results.json").read_text())
    doc["chosen"] = "int4-pth"  # the failing format, chosen by hand under the old signature
    doc["candidates"][1]["verdict"] = "pass"
    (folder / "results.json").write_text(json.dumps(doc))
    refused(capsys, folder, [], "its signature does not verify")
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "other-users-cache"))  # another key signs it
    folder = report(tmp_path, document(), name="theirs")
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    refused(capsys, folder, [], "its signature does not verify")


@AS_ROOT
@pytest.mark.parametrize("whose", ["results.json", "."])
def test_a_report_another_user_owns_is_refused_even_when_trusted(tmp_path, capsys, whose):
    folder = report(tmp_path)
    os.chown(folder / whose, 4242, 4242)
    for args in ([], ["--trust-unsigned"]):
        refused(capsys, folder, args, "belongs to another user (uid 4242)")


def test_a_symlinked_report_directory_is_refused_and_nothing_is_written_through_it(tmp_path, capsys):
    real = report(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    refused(capsys, link, [], "is a symlink")
    assert not (real / "DEPLOY.md").exists()
    refused(capsys, Path(f"{link}/"), [], "is a symlink")


def test_a_symlinked_results_json_is_refused(tmp_path, capsys):
    elsewhere = report(tmp_path, name="elsewhere")
    folder = tmp_path / "report"
    folder.mkdir()
    (folder / "results.json").symlink_to(elsewhere / "results.json")
    refused(capsys, folder, [], "a symlink is refused")


def test_a_results_json_that_is_a_directory_is_one_line_and_exit_2(tmp_path, capsys):
    """As a FIFO is: a directory opens read-only, and reading it failed with a traceback."""
    folder = tmp_path / "report"
    (folder / "results.json").mkdir(parents=True)
    assert main([str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "results.json is not a regular file" in err, err
    assert sorted(p.name for p in folder.iterdir()) == ["results.json"]


NAME = "x\n# Pwned\n<script>alert(1)</script> `` ` <iframe src=//evil>"

HOSTILE = {
    "command": "python -m kvquant.run x.yaml\n\n<script>alert(2)</script>\n## command",
    "reason": "ok </p><iframe src=javascript:alert(3)></iframe> [click](http://evil) **bold** | &amp; <b>x</b>",
    "config": {"model": {"path": "`` <img src=x onerror=alert(4)> ``\n## model"}},
    "run_id": "<script>alert(5)</script>",
}


def test_names_command_reason_and_model_path_are_rendered_inert(tmp_path):
    import markdown_it
    doc = {**document(), **HOSTILE, "chosen": NAME}
    doc["candidates"][0]["name"] = NAME
    doc["candidates"][0]["metrics"] = {"ppl | <script>m</script>": doc["candidates"][0]["metrics"]["ppl/wikitext2"]}
    folder = report(tmp_path, doc)
    assert main([str(folder)]) == 0
    text = (folder / "DEPLOY.md").read_text()
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(text)
    for tag in ("<script", "<iframe", "<img", "<a ", "<b>", "<h2", "</p><iframe"):
        assert tag not in html, (tag, html)
    assert html.count("<h1>") == 1 and html.count("<strong>") == 1  # the title and **PASS**, nothing of theirs
    assert html.count("<tr>") == 2  # the header and one metric: a | in its name splits no cell
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "\\u000a# Pwned" in html  # shown, on one line
    assert "&amp;amp;" in html  # an entity in the reason is shown as written, not decoded


def test_bare_links_in_the_reason_and_names_are_not_links_on_github(tmp_path):
    """GitHub turns a bare ``https://...``, ``www....`` or ``a@b.c`` into a link; each trigger is escaped (the
    reason was written as it came)."""
    doc = {**document(), "reason": "see https://evil.example/pay or www.evil.example or pay@evil.example"}
    folder = report(tmp_path, doc)
    assert main([str(folder)]) == 0
    text = (folder / "DEPLOY.md").read_text()
    assert "https\\://evil\\.example/pay" in text and "www\\.evil" in text and "pay\\@evil" in text
    assert "s://" not in text and "www.evil" not in text and "y@e" not in text


def test_a_megabyte_name_makes_no_megabyte_deploy_md_nor_error_line(tmp_path, capsys):
    name = "n" * 1_000_000
    doc = {**document(), "chosen": name, "command": "c" * 1_000_000, "reason": "r" * 1_000_000}
    doc["candidates"][0]["name"] = name
    folder = report(tmp_path, doc)
    assert main([str(folder)]) == 0
    text = (folder / "DEPLOY.md").read_text()
    assert len(text) < 10_000 and "more characters)" in text
    doc["decision"] = "fail"
    err = refused(capsys, report(tmp_path, doc, name="failed"), [], "the decision is FAIL")
    assert len(err) < 1000


def chosen(doc: dict) -> dict:
    return next(c for c in doc["candidates"] if c["name"] == doc["chosen"])


def set_layers(doc: dict, layers: dict) -> None:
    chosen(doc)["settings"]["layers"] = layers


EDITS = [
    ("fail", lambda d: d.update(decision="fail"), "the decision is FAIL and 'int8-pth''s verdict 'pass', yet it "
     "names 'int8-pth' as chosen"),
    ("inconclusive", lambda d: d.update(decision="inconclusive"), "the decision is INCONCLUSIVE"),
    ("verdict", lambda d: chosen(d).update(verdict="inconclusive"), "'int8-pth''s verdict 'inconclusive'"),
    ("metric-fail", lambda d: chosen(d)["metrics"]["ppl/wikitext2"].update(verdict="fail"),
     "metric 'ppl/wikitext2' verdict must be pass (the setting passed), got str 'fail'"),
    ("nan", lambda d: chosen(d)["metrics"]["ppl/wikitext2"].update(value=float("nan")),
     "metric 'ppl/wikitext2' value must be finite (it passed), got float nan"),
    ("inf", lambda d: chosen(d)["metrics"]["ppl/wikitext2"].update(baseline=float("inf")),
     "metric 'ppl/wikitext2' baseline must be finite (it passed)"),
    ("huge-int", lambda d: chosen(d)["metrics"]["ppl/wikitext2"].update(value=10 ** 400), ".value must be a number"),
    ("no-gate", lambda d: chosen(d)["metrics"]["ppl/wikitext2"].update(gated=False), "passed no gated metric"),
    ("3M layers", lambda d: set_layers(d, {"3000000": {"quantizer": "fp16"}}), "must be below 30 (the model's"),
    ("3M range", lambda d: set_layers(d, {"0-2999999": {"quantizer": "fp16"}}), "must be below 30"),
    ("reversed", lambda d: set_layers(d, {"5-3": {"quantizer": "fp16"}}), "range must be low-high (low <= high), "
     "got str '5-3'"),
    ("twice", lambda d: set_layers(d, {"0-3": {"quantizer": "fp16"}, "2": {"quantizer": "fp16"}}),
     "must be the only key naming layer 2"),
    ("key", lambda d: set_layers(d, {"٥": {"quantizer": "fp16"}}), "key must be a layer N or a range N-M"),
    ("per-layer", lambda d: chosen(d)["memory"].update(per_layer=[{}] * 5000), "a list of 1 to 4096 layers"),
    ("no-memory", lambda d: chosen(d).pop("memory"), "no per-layer memory (memory.per_layer) says how many layers"),
]


@pytest.mark.parametrize("change, message", [e[1:] for e in EDITS], ids=[e[0] for e in EDITS])
def test_hand_edited_decisions_metrics_and_layers_are_refused_even_when_trusted(tmp_path, capsys, change, message):
    doc = document()
    change(doc)
    folder = report(tmp_path, doc)
    refused(capsys, folder, [], message)
    refused(capsys, report(tmp_path, text=json.dumps(doc)), ["--trust-unsigned"], message)


SCALES = [("nan", float("nan")), ("negative", -0.02), ("zero", 0), ("inf-in-float32", 1e300),
          ("zero-in-float32", 1e-50), ("string", "0.02"), ("bool", True), ("head-nan", [0.02, float("nan")]),
          ("empty", []), ("nested", [[0.02]])]


@pytest.mark.parametrize("value", [s[1] for s in SCALES], ids=[s[0] for s in SCALES])
def test_scales_that_are_not_finite_positive_float32_numbers_are_refused(tmp_path, capsys, value):
    doc = calibrated_pass_document()
    chosen(doc)["settings"]["layers"]["7"]["v_scale"] = value
    err = refused(capsys, report(tmp_path, doc), [], "'fp8-cal''s settings.layers['7'].v_scale must be")
    assert "finite" in err


def test_scales_of_mixed_shapes_are_refused(tmp_path, capsys):
    doc = calibrated_pass_document()
    chosen(doc)["settings"]["layers"]["7"]["k_scale"] = [0.02, 0.03]  # one layer per head, the others per tensor
    refused(capsys, report(tmp_path, doc), [], "the static scales mix shapes [(1,), (2, 1, 1)]")


def keeps_every_layer_doc(layers: int) -> dict:
    """A search over [vllm_fp8, fp16] that kept every layer at fp16, with the settings the runner records."""
    import transformers

    import kvquant
    from kvquant.experiment.config import Candidate
    from kvquant.scoring.session import cache_settings
    from kvquant.runner.search import map_candidate

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    found = map_candidate([Candidate("vllm_fp8"), Candidate("fp16")], dict.fromkeys(range(layers), 1), "searched")
    doc = document()
    entry = candidate("searched", "vllm_fp8", bits=16.0)
    entry["settings"] = cache_settings(kvquant.make_cache(config, found.quantizer, **found.options))
    entry["memory"]["per_layer"] = [{"layer": i} for i in range(layers)]
    doc["candidates"].append(entry)
    doc["chosen"] = "searched"
    return doc


@pytest.mark.parametrize("kind", ["searched", "fp16"])
def test_a_setting_that_quantizes_nothing_deploys_the_model_precision_cache(tmp_path, kind):
    doc = keeps_every_layer_doc(4)
    if kind == "fp16":
        chosen(doc)["settings"] = {"quantizer": "fp16", "residual_length": 0, "sink_tokens": 0}
    folder = report(tmp_path, doc)
    (folder / "kv_scales.safetensors").write_bytes(b"an earlier export's")
    assert main([str(folder)]) == 0
    text = (folder / "DEPLOY.md").read_text()
    assert "keep the model-precision KV cache" in text and "without `--kv-cache-dtype`" in text
    assert "--kv-cache-dtype fp8" not in text and "kv_scales" not in text and "skip-layers" not in text
    assert not (folder / "kv_scales.safetensors").exists() and not (folder / "kv_cache_scheme.json").exists()
    if kind == "searched":
        assert "keeps all 4 layers at fp16" in text


def test_a_setting_that_quantizes_some_layers_still_deploys_its_format(tmp_path):
    doc = keeps_every_layer_doc(4)
    chosen(doc)["settings"]["layers"] = {"0-2": chosen(doc)["settings"]["layers"]["0-3"]}
    folder = report(tmp_path, doc)
    assert main([str(folder)]) == 0
    assert "--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0 1 2" in (folder / "DEPLOY.md").read_text()


@pytest.mark.slow
def test_a_run_that_passed_with_nothing_to_deploy_exits_0_and_says_why(tmp_path, capsys):
    from kvquant.run import main as run_main

    config = tmp_path / "fp8.yaml"
    config.write_text(f"""
name: fp8
output_dir: {tmp_path / "reports"}
model: {{path: "local:models/stories260K/hf"}}
candidates:
  - {{quantizer: vllm_fp8, name: fp8-scaled, options: {{k_scale: 0.05, v_scale: 0.05}}}}
eval:
  perplexity:
    - {{name: tinystories, source: local:text/tinystories/validation-first1000.jsonl, limit: 96, max_length: 64}}
gate: {{bootstrap: 1000, max_kl_divergence: 1.0}}   # 96 windows: the fewest a pass reads (kvquant.runner.counts)
""")
    assert run_main([str(config)]) == 0
    out = capsys.readouterr().out
    assert ("kvquant: no DEPLOY.md written: fp8-scaled: one k_scale/v_scale for all layers is not exported" in out
            and out.count("no DEPLOY.md") == 1), out
    folder = tmp_path / "reports" / "fp8"
    assert json.loads((folder / "results.json").read_text())["decision"] == "pass"
    assert not (folder / "DEPLOY.md").exists()
    assert main([str(folder)]) == 2  # the report the run signed exports as the same one line
    assert "one k_scale/v_scale for all layers is not exported" in capsys.readouterr().err


def signed_text(change):
    """The text of a document changed by ``change``, signed by the test's key when the test runs."""
    def text() -> str:
        doc = document()
        change(doc)
        return signed_json(doc)
    return text


MALFORMED = [
    ("truncated", lambda: signed_text(lambda d: None)()[:500], "not JSON"),
    ("list", "[1, 2]", "not a JSON object but list"),
    ("null", "null", "not a JSON object but NoneType"),
    ("deep", "[" * 100_000 + "]" * 100_000, "not JSON"),
    ("candidates-dict", signed_text(lambda d: d.update(candidates={"a": 1})), "candidates must be a list, got dict"),
    ("chosen-int", signed_text(lambda d: d.update(chosen=5)), "chosen must be a string, got int 5"),
    ("decision", signed_text(lambda d: d.update(decision=["pass"])), "decision must be one of pass, fail"),
    ("candidate-str", signed_text(lambda d: d["candidates"].append("x")), "candidates[2] must be an object"),
    ("metrics-list", signed_text(lambda d: chosen(d).update(metrics=[1])), "candidates[0].metrics must be an object"),
    ("metric-str", signed_text(lambda d: chosen(d)["metrics"].update(x="y")), "metrics['x'] must be an object"),
    ("settings-list", signed_text(lambda d: chosen(d).update(settings=[])), "candidates[0].settings must be an object"),
    ("quantizer", signed_text(lambda d: chosen(d)["settings"].update(quantizer=None)), "settings.quantizer must be a"),
    ("bits", signed_text(lambda d: d["candidates"][1].update(bits_per_element="4.5")), "bits_per_element must be a "
     "finite number >= 0, got str '4.5'"),
    ("layers-list", signed_text(lambda d: chosen(d)["settings"].update(layers=[1])), "settings.layers must be an "
     "object"),
    ("layer-str", signed_text(lambda d: set_layers(d, {"1": "fp16"})), "settings.layers['1'] must be an object"),
    ("model", signed_text(lambda d: d.update(config={"model": "m"})), "config.model must be an object"),
    ("reason", signed_text(lambda d: d.update(reason={"x": 1})), "reason must be a string"),
    ("signature", lambda: signed_text(lambda d: None)().replace('"signature": "', '"signature": "\\u00e9'),
     "does not verify"),
]


@pytest.mark.parametrize("text, message", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_a_malformed_results_json_is_one_line_and_exit_2(tmp_path, capsys, text, message):
    refused(capsys, report(tmp_path, text=text() if callable(text) else text), [], message)


@pytest.mark.parametrize("blocked", DEPLOY_FILES)
def test_a_folder_at_a_target_is_refused_before_anything_is_written(tmp_path, capsys, blocked):
    folder = report(tmp_path, calibrated_pass_document())
    (folder / blocked).mkdir()
    (folder / blocked / "theirs").write_text("kept")
    assert main([str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{folder / blocked} is a directory; move it away" in err, err
    assert [n for n in DEPLOY_FILES if os.path.lexists(folder / n)] == [blocked]  # no half-written set
    assert (folder / blocked / "theirs").read_text() == "kept"
    os.remove(folder / blocked / "theirs")
    os.rmdir(folder / blocked)
    assert main([str(folder)]) == 0 and all((folder / n).is_file() for n in DEPLOY_FILES)


def test_a_symlink_at_a_target_is_replaced_not_written_through(tmp_path):
    outside = tmp_path / "outside.md"
    outside.write_text("keep me")
    folder = report(tmp_path, calibrated_pass_document())
    for name in DEPLOY_FILES:
        (folder / name).symlink_to(outside)
    assert main([str(folder)]) == 0
    assert outside.read_text() == "keep me"
    assert all((folder / n).is_file() and not (folder / n).is_symlink() for n in DEPLOY_FILES)


def test_the_signature_is_the_documents_last_key_and_covers_every_value(tmp_path):
    from kvquant.signing import why_unverified

    doc = json.loads(signed_json(calibrated_pass_document()))
    assert list(doc)[-1] == SIGNATURE and why_unverified(doc) is None
    edited = copy.deepcopy(doc)
    chosen(edited)["settings"]["layers"]["3"]["k_scale"] *= 2
    assert "does not verify" in why_unverified(edited)
    assert "carries no signature" in why_unverified({k: v for k, v in doc.items() if k != SIGNATURE})
