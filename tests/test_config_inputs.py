"""A run's config refused before a model loads: every mistake in its YAML, its ``--set`` overrides, the config file
itself, the names that become file names and numbers Python cannot read is one line and exit 2 (never a traceback,
never a silent pass), before ``load_model`` (booby-trapped) is reached, and a finished report is byte-for-byte
unchanged afterwards."""

import os
from pathlib import Path

import pytest
import torch
import yaml

import kvquant.run
from kvquant.errors import ConfigError, KVQuantError
from kvquant.packaged import PACKAGES
from kvquant.experiment.config import load_config
from kvquant.experiment.model_config import ModelConfig
from refusals import S, error_line, fill, only_task, run_refused, snapshot, src
from tiny_configs import MODEL, STORIES, set_args

ROOT = Path(__file__).parents[1]

GGUF_DIR = "local:models/stories260K"

NO_GPU = not torch.cuda.is_available()

LONG = "a" * 300

GEMMA = next(iter(PACKAGES.values()))


RUN_CASES = [
    # the gate: a name it refers to must be measured, and something must be gated
    ("gate-task-typo", S("gate.tasks=[tinystories_lastwrod]"), "'tinystories_lastwrod' is not measured"),
    ("gate-ppl-typo", S("gate.perplexity=[tinystorys]"), "eval.perplexity has: tinystories"),
    ("gate-task-not-measured", S("eval.tasks.names=[]", "eval.tasks.limits={}"), "gate.tasks"),
    ("gate-nothing-gated", S("gate.tasks=[]", "gate.perplexity=[]"), "nothing is gated"),
    ("gate-ratio-nan", S("gate.max_perplexity_ratio=.nan"), "gate.max_perplexity_ratio must be a finite"),
    ("gate-ratio-inf", S("gate.max_perplexity_ratio=.inf"), "gate.max_perplexity_ratio must be a finite"),
    ("gate-ratio-below-1", S("gate.max_perplexity_ratio=0.5"), "gate.max_perplexity_ratio"),
    ("gate-accuracy-above-1", S("gate.min_relative_accuracy=1.5"), "gate.min_relative_accuracy"),
    ("gate-accuracy-zero", S("gate.min_relative_accuracy=0"), "gate.min_relative_accuracy"),
    # thresholds that switch the gate off without being 0 (int2 PASSed, exit 0)
    ("gate-accuracy-tiny", S("gate.min_relative_accuracy=1.0e-300"), "must be in [0.5, 1], got 1e-300; a looser gate"),
    ("gate-ratio-huge", S("gate.max_perplexity_ratio=1.0e+300"), "must be in [1, 2.0], got 1e+300; a looser gate"),
    ("gate-accuracy-string", S("gate.min_relative_accuracy=high"), "gate.min_relative_accuracy must be float"),
    ("gate-bootstrap-huge", S("gate.bootstrap=300000000"), "gate.bootstrap must be in 1..100000"),
    ("gate-bootstrap-zero", S("gate.bootstrap=0"), "gate.bootstrap"),
    ("gate-confidence-1", S("gate.confidence=1"), "gate.confidence"),
    ("gate-decide-typo", S("gate.decide_on=lowerbound"), "gate.decide_on must be one of"),
    ("gate-tasks-scalar", S("gate.tasks=tinystories_lastword"), "gate.tasks must be a list"),
    # dataset sizes and ranges
    ("ppl-limit-0", S("eval.perplexity.0.limit=0"), "eval.perplexity[0].limit must be >= 1"),
    ("ppl-limit-negative", S("eval.perplexity.0.limit=-998"), "eval.perplexity[0].limit must be >= 1"),
    ("ppl-limit-float", S("eval.perplexity.0.limit=2.5"), "eval.perplexity[0].limit must be int"),
    ("ppl-max-length-0", S("eval.perplexity.0.max_length=0"), "eval.perplexity[0].max_length must be >= 2"),
    ("ppl-max-length-negative", S("eval.perplexity.0.max_length=-5"), "max_length must be >= 2"),
    ("ppl-stream-limit-0", S("eval.perplexity.0.layout=stream", "eval.perplexity.0.limit=0"), "limit must be >= 1"),
    ("ppl-stride-0", S("eval.perplexity.0.stride=0"), "eval.perplexity[0].stride must be in 1..max_length"),
    ("ppl-stride-too-big", S("eval.perplexity.0.stride=65"), "stride must be in 1..max_length (64)"),
    ("ppl-layout-typo", S("eval.perplexity.0.layout=docs"), "eval.perplexity[0].layout must be one of"),
    ("ppl-no-source-no-hub", S("eval.perplexity.0.source=null"), "source or hub"),
    ("ppl-duplicate-names", S("eval.perplexity=[{name: t, source: x.txt}, {name: t, source: y.txt}]",
                              "gate.perplexity=[t]"), "eval.perplexity: set names must be unique"),
    ("ppl-name-path", S("eval.perplexity.0.name=../x"), "eval.perplexity[0].name '../x' must be a plain name"),
    ("ppl-text-field-empty", S("eval.perplexity.0.text_field=''"), "text_field"),
    ("tasks-limit-0", S("eval.tasks.limit=0"), "eval.tasks.limit must be >= 1"),
    ("tasks-limits-typo", S("eval.tasks.limits={tinystories_lastwrod: 5}"), "'tinystories_lastwrod' is not among"),
    ("tasks-limits-negative", S("eval.tasks.limits={tinystories_lastword: -1}"), "limits.tinystories_lastword"),
    ("tasks-fewshot-negative", S("eval.tasks.num_fewshot=-1"), "eval.tasks.num_fewshot must be an integer in 0..100"),
    ("tasks-fewshot-huge", S("eval.tasks.num_fewshot=5000"), "eval.tasks.num_fewshot must be an integer in 0..100"),
    ("tasks-fewshot-typo", S("eval.tasks.num_fewshot={tinystories_lastwrod: 3}"),
     "'tinystories_lastwrod' is not among"),
    ("tasks-fewshot-beyond-documents", only_task("passkey_64", "eval.tasks.num_fewshot=60"),
     "'passkey_64' asks for 60 examples"),
    ("tasks-fewshot-bool", S("eval.tasks.num_fewshot={tinystories_lastword: true}"),
     "num_fewshot.tinystories_lastword"),
    # sequential documents, the exercised rule, divergence thresholds
    ("gate-max-documents-0", S("gate.max_documents=0"), "gate.max_documents must be >= 1"),
    ("gate-max-documents-below-limit", S("eval.tasks.limits={}", "eval.tasks.limit=50", "gate.max_documents=20"),
     "gate.max_documents 20 is where sequential documents stop, and task 'tinystories_lastword' starts at 50"),
    ("gate-max-documents-no-limit", S("eval.tasks.limits={}", "eval.tasks.limit=null", "gate.max_documents=20"),
     "starts at all its documents"),
    ("gate-share-above-1", S("gate.min_quantized_share=1.5"), "gate.min_quantized_share must be in [0, 1]"),
    ("gate-kl-zero", S("gate.max_kl_divergence=0"), "gate.max_kl_divergence must be in (0, 1.0]"),
    ("gate-kl-huge", S("gate.max_kl_divergence=50"), "gate.max_kl_divergence must be in (0, 1.0]"),
    ("gate-top1-low", S("gate.min_top1_agreement=0.1"), "gate.min_top1_agreement must be in [0.5, 1]"),
    ("gate-kl-without-perplexity", S("gate.max_kl_divergence=0.01", "gate.perplexity=[]"),
     "divergence from the baseline is measured on perplexity sets (or long documents), and none is gated"),
    ("tasks-duplicate", S("eval.tasks.names=[tinystories_lastword, tinystories_lastword]"), "must be unique"),
    ("tasks-unknown", only_task("tinystories_lastwrod"),
     "unknown task 'tinystories_lastwrod'; did you mean tinystories_lastword"),
    ("tasks-group", only_task("mmlu"), "'mmlu' is a group"),
    ("probe-too-short", only_task("passkey_8"),
     "eval.tasks.names: probe distance 8 is shorter than the probe's own text from the key on (46 tokens"),
    ("probe-too-long", only_task("passkey_4096"),
     "eval.tasks.names: 'passkey_4096': the model reads 512 tokens, not more than the distance"),
    ("probe-just-too-long", only_task("passkey_470"), "eval.tasks.names: 'passkey_470': its documents take up to"),
    ("eval-chunk-0", S("eval.chunk_size=0"), "eval.chunk_size must be >= 1"),
    ("eval-chunk-bool", S("eval.chunk_size=true"), "eval.chunk_size must be int, got bool"),
    ("eval-chunk-float", S("eval.chunk_size=2.5"), "eval.chunk_size must be int, got float"),
    ("eval-seed-negative", S("eval.seed=-1"), "eval.seed must be in 0.."),
    ("eval-mode-typo", S("eval.mode=stream"), "eval.mode must be one of ['simulated', 'streaming']"),
    ("eval-probe-1", S("eval.memory_probe_tokens=1"), "eval.memory_probe_tokens must be >= 2"),
    # names that would escape output_dir, candidates
    ("name-escapes", S("name=../../x"), "name '../../x' must be a plain name"),
    ("name-absolute", S("name=/tmp/x"), "name '/tmp/x'"),
    ("candidate-name-escapes", S("candidates.0.name=../evil"), "candidates[0].name '../evil'"),
    ("candidates-empty", S("candidates=[]"), "at least one cache setting"),
    ("candidate-baseline-name", S("candidates.0.name=baseline"), "not 'baseline'"),
    ("quantizer-typo", S("candidates.0.quantizer=int3"), "unknown quantizer 'int3'"),
    ("quantizer-null", S("candidates.0.quantizer=null"), "candidates[0].quantizer must be str"),
    ("option-bool", S("candidates.0.options.group_size=true"), "group_size"),
    ("option-float-bits", S("candidates.0.options.key_bits=4.0"), "key_bits"),
    ("option-bits-3", S("candidates.0.options.key_bits=3"), "key_bits"),
    ("option-group-misfit", S("candidates.0.options.group_size=3"), "group_size 3"),
    ("option-unknown", S("candidates.0.options.gruop_size=32"), "'gruop_size'"),
    ("option-residual-negative", S("candidates.0.options.residual_length=-1"), "residual_length"),
    ("option-quantizer-key", S("candidates.0.options.quantizer=int8"), "'quantizer' is not an option"),
    ("options-scalar", S("candidates.0.options=3"), "candidates[0].options must be a mapping"),
    # the model and the device
    ("device-banana", S("model.device=banana"), "model.device 'banana' is not a device"),
    ("device-meta", S("model.device=meta"), "model.device 'meta'"),
    ("device-map-typo", S("model.device_map=autoo"), "device_map"),
    ("device-map-entry", S("model.device_map={model.layers.0: banana}"), "model.device_map.model.layers.0 'banana'"),
    ("device-map-index", S("model.device_map={model.layers.0: -1}"), "a GPU index must be >= 0, got -1"),
    ("device-map-empty", S("model.device_map={}"), "an explicit map names at least one module"),
    ("dtype-typo", S("model.dtype=float64"), "model.dtype must be one of"),
    ("model-missing-path", S("model.path=/nonexistent/model"), "'/nonexistent/model' does not exist"),
    ("model-missing-local", S("model.path=local:models/nope"), "local:models/nope"),
    ("model-dir-no-config", S("model.path={files}/empty_model"), "holds no config.json"),
    ("model-gguf-missing", S(f"model.path={GGUF_DIR}", "model.gguf_file=nope.gguf"), "nope.gguf does not exist"),
    ("model-gguf-tokenizer", S(f"model.path={GGUF_DIR}", "model.gguf_file=stories260K.gguf"), "model.tokenizer"),
    ("model-max-length-1", S("model.max_length=1"), "model.max_length must be >= 2"),
    ("model-scalar", S("model=3"), "model must be a mapping"),
    # --set itself
    ("set-through-scalar", S("gate.bootstrap.x=1"), "gate.bootstrap is int 1000, which has no key 'x'"),
    ("set-into-new-key", S("eval.seed.x=1"), "eval.seed must be int, got dict"),
    ("set-no-equals", S("eval.seed"), "--set expects key=value"),
    ("set-no-item", S("candidates.5.quantizer=int8"), "has no item 5"),
    ("set-unknown-key", S("eval.sed=3"), "unknown key eval.sed"),
    ("set-empty-key", S(".=3"), "not a key"),
    ("set-bad-yaml", S("eval.seed=[1"), "is not a YAML value"),
    # the config file
    ("config-missing", ["{files}/nope.yaml"], "no such config file"),
    ("config-directory", ["{files}/config.dir.yaml"], "is a directory"),
    ("config-binary", ["{files}/config.bin.yaml"], "binary file"),
    ("config-latin1", ["{files}/config.latin1.yaml"], "not UTF-8"),
    ("config-bad-yaml", ["{files}/config.bad.yaml"], "not valid YAML"),
    ("config-list", ["{files}/config.list.yaml"], "must be a mapping of keys, got list"),
    ("config-empty", ["{files}/config.empty.yaml"], "got NoneType"),
    ("cli-unknown-flag", ["{cfg}", "--sett", "x=1"], "unrecognized arguments: --sett"),
    # perplexity data, checked before the model loads
    ("data-missing", src("{files}/nothere.jsonl"), "nothere.jsonl' does not exist"),
    ("data-bad-jsonl", src("{files}/bad.jsonl"), "bad.jsonl, line 2: not valid JSON"),
    ("data-binary-txt", src("{files}/binary.txt"), "binary.txt: a binary file"),
    ("data-blank-txt", src("{files}/blank.txt"), "blank.txt holds no text"),
    ("data-no-field", src("{files}/nofield.jsonl"), "row 1 has no text field 'text' (fields: story)"),
    ("data-empty-jsonl", src("{files}/empty.jsonl"), "empty.jsonl holds no text"),
    ("data-number-text", src("{files}/numbers.jsonl"), "numbers.jsonl: row 1: field 'text' is int"),
    ("data-latin1", src("{files}/latin1.txt"), "latin1.txt: not UTF-8"),
    ("data-csv", src("{files}/table.csv"), "unsupported text file type '.csv'"),
    ("data-directory", src("{files}/a_dir"), "a_dir is not a file"),
    ("data-fake-parquet", src("{files}/fake.parquet"), "fake.parquet: not a readable parquet file"),
    ("data-missing-local", src("local:text/nope.jsonl"), "local:text/nope.jsonl"),
    # where the report goes
    ("output-dir-is-file", S("output_dir={files}/a_file"), "a_file exists and is not a directory"),
]


# where torch sees no GPU, a GPU is refused; where it sees one, an index it does not have
RUN_CASES += [
    ("device-cuda-absent", S("model.device=cuda"), "torch sees no GPU"),
    ("device-map-absent", S("model.device_map={model.layers.0: 0, lm_head: cpu}"), "torch sees no GPU"),
] if NO_GPU else [
    ("device-cuda-index", S("model.device=cuda:99"), "cuda:99"),
    ("device-map-absent", S("model.device_map={model.layers.0: 99}"), "cuda:99"),
]


@pytest.mark.parametrize("argv, needle", [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES])
def test_runner_refuses(refusal_env, capsys, no_model_load, argv, needle):
    before = snapshot(refusal_env["finished"])
    code = kvquant.run.main(fill(argv, refusal_env))
    captured = capsys.readouterr()
    error_line(code, captured.err, needle, out=captured.out)
    assert snapshot(refusal_env["finished"]) == before


def test_gate_typo_cannot_switch_the_gate_off(capsys, no_model_load):
    """configs/int2.yaml with a misspelt gated task (or perplexity set) passed with exit 0 at 0.34 relative
    perplexity; now it is refused before anything runs, naming the measured names."""
    int2 = ROOT / "configs/tiny/sweep.yaml"  # int2 among its candidates
    for override, valid in [("gate.tasks=[tinystories_lastwrod]", "tinystories_lastword, lambada_openai"),
                            ("gate.perplexity=[tinystories, wikitext]", "tinystories, wikitext2")]:
        code = kvquant.run.main([str(int2), "--set", override,
                                 "--set", "output_dir=/nonexistent-never-written"])
        err = capsys.readouterr().err
        assert code == 2 and "is not measured, so it would never be gated" in err and valid in err


CONFIG_CASES = [  # (id, the --set overrides, what the refusal says)
    # the gate's keys: a zero-width interval turned INCONCLUSIVE into PASS; 0% quantized reads passed int2
    ("bootstrap-1", ["gate.bootstrap=1"], "gate.bootstrap must be at least 1000 resamples for 0.95 intervals"),
    ("bootstrap-999", ["gate.bootstrap=999"], "gate.bootstrap must be at least 1000"),
    ("bootstrap-for-confidence", ["gate.confidence=0.99"], "gate.bootstrap must be at least 5000 resamples"),
    ("confidence-beyond-bootstrap", ["gate.confidence=0.9999", "gate.bootstrap=100000"],
     "gate.confidence 0.9999 needs more than 100000 bootstrap resamples"),
    # "paired 1% intervals" turned inconclusive results into PASS (bootstrap and the share had floors)
    ("confidence-one-percent", ["gate.confidence=0.01"], "gate.confidence must be in [0.9, 1), got 0.01"),
    ("confidence-just-below", ["gate.confidence=0.89", "gate.bootstrap=1000"], "gate.confidence must be in [0.9, 1)"),
    ("share-zero", ["gate.min_quantized_share=0"], "gate.min_quantized_share must be in [0.5, 1], got 0.0"),
    ("share-below-half", ["gate.min_quantized_share=0.49"], "gate.min_quantized_share must be in [0.5, 1]"),
    # flips need a task's right-or-wrong answers (issue 39)
    ("flips-without-tasks", ["gate.max_flip_rate=0.1"], "gate.max_flip_rate: flips are counted on the documents of "
                                                        "gated tasks"),
    ("flips-rate-beyond-one", ["gate.max_flip_rate=1.5"], "gate.max_flip_rate must be in (0, 1)"),
    # sequential documents with no gated task were accepted and did nothing
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
    # names of files the run reads, too long for the file system, were an internal error (exit 3)
    ("source-long", [f"eval.perplexity.0.source=local:text/{LONG}"], "characters) is a name too long for this file"),
    ("model-path-long", [f"model.path=local:models/{LONG}"], "characters) is a name too long for this file system"),
    ("tokenizer-long", [f"model.tokenizer={LONG}"], "(300 characters) is a name too long for this file system"),
    ("gguf-file-long", [f"model.gguf_file={LONG}.gguf"], "characters) is a name too long for this file system"),
    ("output-dir-path", ["output_dir=" + "/abcdefgh" * 300], "a report folder's path holds at most 2048"),
    ("gguf-file-nul", ['model.gguf_file="a\\0b"'], "model.gguf_file 'a\\x00b' holds a NUL character"),
    # K in an order llama.cpp does not use for this model (stories260K is a Llama: norm), measured and
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
def test_config_refused_when_read(run_yaml, no_model_load, capsys, overrides, needle):
    run_refused(capsys, [run_yaml, *set_args(*overrides)], needle)
    assert not (run_yaml.parent / "reports").exists()


def test_a_config_file_whose_name_is_not_utf8_is_refused_before_anything_is_measured(run_yaml, no_model_load, capsys):
    """Every result was measured, then writing the report failed (exit 3) on the file's name."""
    bad = run_yaml.parent / os.fsdecode(b"bad\xff.yaml")
    bad.write_text(run_yaml.read_text())
    run_refused(capsys, [bad], "a config file whose name is not UTF-8; rename it")
    assert not (run_yaml.parent / "reports").exists()


def test_a_config_file_with_a_huge_integer_names_its_line(run_yaml, no_model_load, capsys):
    text = run_yaml.read_text() + "gate: {bootstrap: " + "9" * 5000 + "}\n"
    run_yaml.write_text(text)
    line = run_refused(capsys, [run_yaml], "an integer of 5,000 digits")
    assert f"line {text.count(chr(10))}" in line


@pytest.mark.parametrize("value", ["0x_", "0b_"])
def test_a_malformed_short_integer_is_not_called_too_long(run_yaml, no_model_load, capsys, value):
    """``0x_`` was refused as "an integer of 3 digits, beyond the 4,300 Python reads"."""
    line = run_refused(capsys, [run_yaml, *set_args(f"eval.seed={value}")], "cannot be read as int")
    assert "digits" not in line


def test_run_name_and_search_name_together_name_a_config_that_loads():
    """searched.yaml reruns the map as ``<name>-<search.name>``: that name must be one a config can have."""
    cfg = load_config(ROOT / "configs/smollm2-search.yaml", ["name=" + "r" * 100])
    assert len(cfg.name) == 100  # alone it is fine
    with pytest.raises(ConfigError, match=r"name and search.name \(searched.yaml reruns the map"):
        load_config(ROOT / "configs/smollm2-search.yaml", ["name=" + "r" * 120])


SMALL_RUN = {
    "name": "small",
    "model": {"path": MODEL, "device": "cpu"},
    "candidates": [{"quantizer": "int8", "options": {"group_size": 8, "residual_length": 0}}],
    "eval": {"mode": "simulated", "batch_size": 2,
             "perplexity": [{"name": "ts", "source": STORIES, "limit": 2, "max_length": 64}]},
    "gate": {"perplexity": ["ts"]},
}


def run_config(tmp_path: Path, **sections) -> list[str]:
    """argv for the runner on :data:`SMALL_RUN` with ``sections`` replaced (output under ``tmp_path``)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL_RUN, "output_dir": str(tmp_path / "out"), **sections}))
    return [str(cfg)]


# a package: model's gguf_file escaping the verified folder measured another file under the package's name
@pytest.mark.parametrize("gguf_file", ["../../../../probe2/x.gguf", "other.gguf", f"./{GEMMA.file}"])
def test_package_gguf_file_must_be_the_packages_file(gguf_file, tmp_path, capsys, no_model_load):
    with pytest.raises(KVQuantError, match="gguf_file: under package:"):
        ModelConfig(path=f"package:{GEMMA.name}", gguf_file=gguf_file)
    model = {"path": f"package:{GEMMA.name}", "gguf_file": gguf_file, "tokenizer": MODEL, "device": "cpu"}
    line = error_line(kvquant.run.main(run_config(tmp_path, model=model)), capsys.readouterr().err)
    assert "model.gguf_file" in line and GEMMA.file in line and gguf_file in line
    assert not (tmp_path / "out").exists()


def test_package_gguf_file_may_be_the_packages_file_or_absent():
    assert ModelConfig(path=f"package:{GEMMA.name}", gguf_file=GEMMA.file).gguf_file == GEMMA.file
    assert ModelConfig(path=f"package:{GEMMA.name}").gguf_file is None
    assert ModelConfig(path="/some/folder", gguf_file="../x.gguf").gguf_file == "../x.gguf"  # not a package


# calibration.windows had no bound (10**9 calibrated on the whole rest of the text, >300 s after loading)
CALIBRATING = {"candidates": [{"quantizer": "vllm_fp8", "calibrate": "tensor"}],
               "gate": {"max_perplexity_ratio": 1.05, "perplexity": ["ts"]}}


def test_calibration_windows_bounded_like_search_windows(tmp_path, capsys, no_model_load):
    argv = run_config(tmp_path, **CALIBRATING, calibration={"windows": 10**9})
    error_line(kvquant.run.main(argv), capsys.readouterr().err,
               "calibration.windows must be in 1..100000, got 1000000000")


def test_calibration_windows_beyond_the_text_refused_before_loading(tmp_path, capsys, no_model_load):
    argv = run_config(tmp_path, **CALIBRATING, calibration={"windows": 100_000})
    line = error_line(kvquant.run.main(argv), capsys.readouterr().err,
                      "calibration.windows: 100,000 asked, but perplexity set 'ts' holds only")
    held = int(line.split("holds only ")[1].split(" windows")[0].replace(",", ""))
    assert 0 < held < 100_000 and f"at most {held:,}" in line
    assert not (tmp_path / "out").exists()
