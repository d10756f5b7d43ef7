"""Hostile configs, names and partial results (issue 36): the gate's keys, names that cannot be file names,
numbers and nesting Python cannot read, partial results that are folders or copies, and reruns that replace
finished results. Each refusal is one line and exit 2 before a model loads (``load_model`` is booby-no_model_load);
a copied or outdated partial result is recomputed (and kept), never an internal error."""

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

import kvquant.run
from kvquant.errors import ConfigError
from kvquant.experiment.config import load_config
from kvquant.runner.store import ResultStore
from hostile_helpers import set_args as S

ROOT = Path(__file__).parents[1]
STORIES = "local:text/tinystories/validation-first1000.jsonl"
BASE = {
    "name": "hostile",
    "model": {"path": "local:models/stories260K/hf"},
    "candidates": [{"quantizer": "int8", "name": "int8", "options": {"group_size": 32, "residual_length": 0}}],
    "eval": {"perplexity": [{"name": "tinystories", "source": STORIES, "limit": 2, "max_length": 64}],
             "memory_probe_tokens": 64},
}
LONG = "a" * 300


@pytest.fixture
def base(tmp_path, monkeypatch) -> Path:
    """The base config (reports under ``tmp_path/reports``), and a private cache for the signing key."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump({**BASE, "output_dir": str(tmp_path / "reports")}))
    return path


def refused(capsys, argv: list[str], needle: str) -> str:
    """``kvquant.run`` on ``argv`` exits 2 with one line holding ``needle``; returns the line."""
    code = kvquant.run.main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvquant: error: "), (code, err[-2000:])
    assert needle in lines[0], (needle, lines[0])
    return lines[0]


CONFIG_CASES = [  # (id, the --set overrides, what the refusal says)
    # the gate's keys: a zero-width interval turned INCONCLUSIVE into PASS; 0% quantized reads passed int2
    ("bootstrap-1", ["gate.bootstrap=1"], "gate.bootstrap must be at least 1000 resamples for 0.95 intervals"),
    ("bootstrap-999", ["gate.bootstrap=999"], "gate.bootstrap must be at least 1000"),
    ("bootstrap-for-confidence", ["gate.confidence=0.99"], "gate.bootstrap must be at least 5000 resamples"),
    ("confidence-beyond-bootstrap", ["gate.confidence=0.9999", "gate.bootstrap=100000"],
     "gate.confidence 0.9999 needs more than 100000 bootstrap resamples"),
    # issue 58: "paired 1% intervals" turned inconclusive results into PASS (bootstrap and the share had floors)
    ("confidence-one-percent", ["gate.confidence=0.01"], "gate.confidence must be in [0.9, 1), got 0.01"),
    ("confidence-just-below", ["gate.confidence=0.89", "gate.bootstrap=1000"], "gate.confidence must be in [0.9, 1)"),
    ("share-zero", ["gate.min_quantized_share=0"], "gate.min_quantized_share must be in [0.5, 1], got 0.0"),
    ("share-below-half", ["gate.min_quantized_share=0.49"], "gate.min_quantized_share must be in [0.5, 1]"),
    # flips need a task's right-or-wrong answers (issue 39)
    ("flips-without-tasks", ["gate.max_flip_rate=0.1"], "gate.max_flip_rate: flips are counted on the documents of "
                                                        "gated tasks"),
    ("flips-rate-beyond-one", ["gate.max_flip_rate=1.5"], "gate.max_flip_rate must be in (0, 1)"),
    # probe 58 (n03): sequential documents with no gated task were accepted and did nothing
    ("max-documents-without-tasks", ["gate.max_documents=80"], "gate.max_documents: sequential documents are "
                                                               "scored on gated tasks only, and none is gated"),
    # a task without a right or wrong answer per document: was an internal error (exit 3) while loading it
    ("flips-on-a-task-without-answers", ["eval.tasks.names=[wikitext]", "gate.tasks=[wikitext]",
                                         "gate.max_flip_rate=0.1"],
     "task 'wikitext' makes lm-eval 'loglikelihood_rolling' requests, which give no right or wrong answer per "
     "document, and the runner measures accuracy and the flips gate.max_flip_rate limits"),
    ("generated-answers", ["eval.tasks.names=[lambada_openai, gsm8k]"], "task 'gsm8k' makes lm-eval 'generate_until'"),
    # shared few-shot prefixes (issue 39 item 1)
    ("sampler-without-shots", ["eval.tasks.names=[arc_easy]", "eval.tasks.fewshot_sampler=first_n"],
     "eval.tasks.fewshot_sampler: 'first_n' draws few-shot examples, and num_fewshot gives no task any"),
    ("sampler-unknown", ["eval.tasks.names=[arc_easy]", "eval.tasks.num_fewshot=2", "eval.tasks.fewshot_sampler=first"],
     "eval.tasks.fewshot_sampler must be one of ['default', 'first_n'], got 'first'"),
    ("shared-prefix-beyond-the-context", ["eval.tasks.names=[arc_easy]", "eval.tasks.limit=4",
                                          "eval.tasks.num_fewshot=40", "eval.tasks.fewshot_sampler=first_n",
                                          "eval.mode=streaming"],
     "task 'arc_easy' with 40 few-shot examples needs contexts of up to "),
    # names that become file names: were OSError "File name too long" (exit 3, the set's after a measurement)
    ("run-name-long", [f"name={LONG}"], "name 'aaaaaaaaaaaaaaaaaaaaaaaa'... is 300 bytes long"),
    ("set-name-long", [f"eval.perplexity.0.name={LONG}"], "eval.perplexity[0].name 'aaaa"),
    ("candidate-name-long", ["candidates.0.name=" + "b" * 129], "is 129 bytes long; it becomes part of a file"),
    ("task-name-long", [f"eval.tasks.names=[{LONG}]"], "eval.tasks.names: task 'aaaa"),
    ("output-dir-nul", ['output_dir="/tmp/a\\0b"'], "output_dir '/tmp/a\\x00b' holds a NUL character"),
    ("output-dir-surrogate", ['output_dir="/tmp/\\ud800"'], "holds a lone surrogate"),
    ("output-dir-component", [f"output_dir=/tmp/{LONG}"], "is 300 bytes long; a file or folder name holds at most"),
    # issue 58: names of files the run reads, too long for the file system, were an internal error (exit 3)
    ("source-long", [f"eval.perplexity.0.source=local:text/{LONG}"], "characters) is a name too long for this file"),
    ("model-path-long", [f"model.path=local:models/{LONG}"], "characters) is a name too long for this file system"),
    ("tokenizer-long", [f"model.tokenizer={LONG}"], "(300 characters) is a name too long for this file system"),
    ("gguf-file-long", [f"model.gguf_file={LONG}.gguf"], "characters) is a name too long for this file system"),
    ("output-dir-path", ["output_dir=" + "/abcdefgh" * 300], "a report folder's path holds at most 2048"),
    ("gguf-file-nul", ['model.gguf_file="a\\0b"'], "model.gguf_file 'a\\x00b' holds a NUL character"),
    # issue 58: K in an order llama.cpp does not use for this model (stories260K is a Llama: norm), measured and
    # deployed as llama.cpp's cache with the default DEPLOY.md; the model's own layout stays accepted (test below)
    ("rope-layout-against-the-model", ["candidates.0.quantizer=llamacpp_q4_0", "candidates.0.options={rope_layout: "
                                       "neox}"], "int8: options: rope_layout 'neox', but llama.cpp stores this "
                                                 "model's K ('llama') in the 'norm' layout"),
    ("rope-layout-in-a-layers-map", ["candidates.0.options={layers: {0: {quantizer: llamacpp_q8_0, rope_layout: "
                                     "neox}}}"], "int8: options: layers[0]: rope_layout 'neox', but llama.cpp"),
    # numbers and nesting Python cannot read: were ValueError / RecursionError (exit 3)
    ("integer-5000-digits", ["gate.bootstrap=" + "7" * 5000], "an integer of 5,000 digits, beyond the 4,300"),
    ("date-that-is-not", ["gate.bootstrap=2024-99-99"], "'2024-99-99' cannot be read as timestamp"),
    ("set-key-thousands-deep", [".".join(["model.device_map", *["a"] * 5000]) + "=1"], "5002 keys deep"),
    ("set-key-and-value-deep", [".".join(["candidates.0.options", *["a"] * 60]) + "=" + "[" * 10 + "]" * 10],
     "nested deeper than 64 levels"),
]


@pytest.mark.parametrize("overrides, needle", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_config_refused_when_read(base, no_model_load, capsys, overrides, needle):
    refused(capsys, [base, *S(*overrides)], needle)
    assert not (base.parent / "reports").exists()


def test_a_config_file_whose_name_is_not_utf8_is_refused_before_anything_is_measured(base, no_model_load, capsys):
    """Issue 58: every result was measured, then writing the report failed (exit 3) on the file's name."""
    bad = base.parent / os.fsdecode(b"bad\xff.yaml")
    bad.write_text(base.read_text())
    refused(capsys, [bad], "a config file whose name is not UTF-8; rename it")
    assert not (base.parent / "reports").exists()


def test_a_config_file_with_a_huge_integer_names_its_line(base, no_model_load, capsys):
    text = base.read_text() + "gate: {bootstrap: " + "9" * 5000 + "}\n"
    base.write_text(text)
    line = refused(capsys, [base], "an integer of 5,000 digits")
    assert f"line {text.count(chr(10))}" in line


@pytest.mark.parametrize("value", ["0x_", "0b_"])
def test_a_malformed_short_integer_is_not_called_too_long(base, no_model_load, capsys, value):
    """``0x_`` was refused as "an integer of 3 digits, beyond the 4,300 Python reads"."""
    line = refused(capsys, [base, *S(f"eval.seed={value}")], "cannot be read as int")
    assert "digits" not in line


def test_run_name_and_search_name_together_name_a_config_that_loads():
    """searched.yaml reruns the map as ``<name>-<search.name>``: that name must be one a config can have."""
    cfg = load_config(ROOT / "configs/smollm2-search.yaml", ["name=" + "r" * 100])
    assert len(cfg.name) == 100  # alone it is fine
    with pytest.raises(ConfigError, match=r"name and search.name \(searched.yaml reruns the map"):
        load_config(ROOT / "configs/smollm2-search.yaml", ["name=" + "r" * 120])


DATA_CASES = [
    ("deep.jsonl", "[" * 100_000 + "]" * 100_000 + "\n", "line 1: JSON nested too deeply"),
    ("deep.json", "[" * 100_000 + "]" * 100_000, "deep.json: JSON nested too deeply"),
    ("huge.jsonl", '{"text": ' + "1" * 5000 + "}\n", "line 1: a number of more than 4,300 digits"),
    ("huge.json", "[" + "1" * 5000 + "]", "huge.json: a number of more than 4,300 digits"),
]


@pytest.mark.parametrize("name, text, needle", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_data_file_python_cannot_read_is_refused(base, no_model_load, capsys, tmp_path, name, text, needle):
    (tmp_path / name).write_text(text)
    refused(capsys, [base, *S(f"eval.perplexity.0.source={tmp_path / name}")], needle)


PARTIAL_CASES = [  # what is already under reports/hostile/partial, and what the refusal says
    ("result-is-a-folder", "int8/memory.json/", "int8/memory.json is a folder, not a result kvquant wrote"),
    ("result-is-a-fifo", "int8/ppl__tinystories.json|", "ppl__tinystories.json is not a file"),
    ("candidate-is-a-file", "int8", "partial/int8 is a file"),
    ("candidate-is-a-symlink", "int8@", "partial/int8 is a symlink"),
    ("partial-is-a-file", "", "hostile/partial is not a folder"),
]


@pytest.mark.parametrize("entry, needle", [c[1:] for c in PARTIAL_CASES], ids=[c[0] for c in PARTIAL_CASES])
def test_a_partial_result_kvquant_cannot_replace_is_refused_before_loading(base, no_model_load, capsys, tmp_path,
                                                                             entry, needle):
    """Was: PermissionError (exit 3) while setting the folder aside, after the model loaded and measured."""
    partial = tmp_path / "reports" / "hostile" / "partial"
    partial.parent.mkdir(parents=True)
    if not entry:
        partial.write_text("x")
    else:
        partial.mkdir()
        target = partial / entry.rstrip("/|@")
        target.parent.mkdir(parents=True, exist_ok=True)
        if entry.endswith("/"):
            target.mkdir()
        elif entry.endswith("|"):
            os.mkfifo(target)
        elif entry.endswith("@"):
            target.symlink_to(tmp_path)
        else:
            target.write_text("x")
    before = sorted(str(p) for p in partial.parent.rglob("*"))
    refused(capsys, [base], needle)
    assert sorted(str(p) for p in partial.parent.rglob("*")) == before


def test_a_partial_result_copied_from_another_metric_is_not_reused(tmp_path, monkeypatch):
    """ppl and kl of one candidate share their inputs: a ppl file copied over the kl file verified (its key and
    signature were the ppl result's) and was read as KL (exit 3). The key names its own candidate and metric."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    warnings: list[str] = []
    store = ResultStore(tmp_path / "partial", {"code": "v1"}, warnings)
    ppl, kl = {"nll": [2.0, 3.0], "tokens": [4, 4]}, {"kl": [0.1, 0.2], "positions": [4, 4]}
    assert store.get_or_compute("int4", "ppl/x", {"k": 1}, lambda: ppl) == ppl
    assert store.get_or_compute("int4", "kl/x", {"k": 1}, lambda: kl) == kl
    folder = tmp_path / "partial" / "int4"
    shutil.copy(folder / "ppl__x.json", folder / "kl__x.json")
    assert store.get_or_compute("int4", "kl/x", {"k": 1}, lambda: kl) == kl  # was: the ppl result
    assert "is the result of int4 ppl/x, copied here" in warnings[-1] and "kl__x.json.corrupt" in warnings[-1]
    assert json.loads((folder / "kl__x.json.corrupt").read_text())["result"] == ppl
    assert store.get_or_compute("int4", "kl/x", {"k": 1}, pytest.fail) == kl  # the recomputed one is reused
    assert store.get_or_compute("int4", "ppl/x", {"k": 1}, pytest.fail) == ppl


def test_a_rerun_keeps_the_results_it_replaces_and_a_copied_result_is_recomputed(base, capsys, tmp_path):
    """A rerun with other inputs replaced finished partial results without a word; now they are moved to
    ``partial.old-<time>/`` and one warning says how many and where. A ppl result copied over the kl one (same
    inputs) is recomputed with a warning, not an internal error."""
    report = tmp_path / "reports" / "hostile"
    first = kvquant.run.main([str(base)])
    assert first in (0, 1, 4)
    partial = report / "partial"
    (partial / "int8" / "kl__tinystories.json").write_bytes((partial / "int8" / "ppl__tinystories.json").read_bytes())
    capsys.readouterr()
    assert kvquant.run.main([str(base)]) == first  # was: exit 3
    err = capsys.readouterr().err
    assert "is the result of int8 ppl/tinystories, copied here" in err and "recomputed" in err
    assert "finished partial result" not in err and not list(report.glob("partial.old-*"))  # nothing else replaced
    assert json.loads((report / "results.json").read_text())["results"]["computed"] == 1
    kept = {p.relative_to(partial): p.read_bytes() for p in partial.glob("*/*.json")}
    assert len(kept) == 5  # ppl of both, kl and memory of int8, memory of the baseline

    assert kvquant.run.main([str(base), "--set", "eval.batch_size=2"]) == first  # other inputs: all replaced
    err = capsys.readouterr().err
    olds = list(report.glob("partial.old-*"))
    assert len(olds) == 1
    warning = [line for line in err.splitlines() if "finished partial results" in line]
    assert warning == [f"kvquant: warning: 5 finished partial results of other inputs or code (config, data or "
                       f"kvquant version) replaced by this run's; the earlier ones are kept in {olds[0]}"]
    assert {p.relative_to(olds[0]): p.read_bytes() for p in olds[0].glob("*/*.json")} == kept
    doc = json.loads((report / "results.json").read_text())
    assert doc["results"]["computed"] == 5 and warning[0].removeprefix("kvquant: warning: ") in doc["warnings"]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660], ids=oct)
def test_a_signing_key_others_can_read_is_refused(tmp_path, monkeypatch, mode):
    """A partial-results key that group or others could read was used: whoever read it could sign results (and
    exported reports) as this user."""
    from kvquant import signing
    from kvquant.errors import KVQuantError

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    first = signing.result_key()  # made private (0600) and used as is
    assert signing.result_key() == first
    (tmp_path / "cache" / "keys" / "partial-results.key").chmod(mode)
    with pytest.raises(KVQuantError, match="is not a key only you can read"):
        signing.result_key()
