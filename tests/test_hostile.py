"""Hostile but realistic inputs: every mistake gets one clear line and exit 2 (never a traceback, never a silent
pass), and a finished report directory is byte-for-byte unchanged afterwards.

The runner, planner and lm-eval cases run in-process through ``main(argv)`` (a few through a subprocess, for the
real stderr and exit code); runner cases must fail before a model loads (``load_model`` is booby-trapped).
"""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig

import kvquant
import kvquant.cache.kernels
import kvquant.run
from kvquant import lm_eval as lm_eval_cli
from kvquant import plan
from kvquant.experiment.config import PerplexitySet
from kvquant.experiment.model_config import ModelConfig
from kvquant.experiment.gate_config import GateConfig
from kvquant.errors import KVQuantError
from kvquant.scoring.scorer import Scorer
from kvquant.paths import data_dir, resolve
from hostile_helpers import MODEL, set_args, tiny_run

ROOT = Path(__file__).parents[1]
GGUF_DIR = "local:models/stories260K"
NO_GPU = not torch.cuda.is_available()

BASE = tiny_run("finished", "int4", tasks_limit=5, bootstrap=1000)


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (hidden ones too) with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A finished report (a committed one, copied), the base config that targets it, and hostile files."""
    root = tmp_path_factory.mktemp("hostile")
    finished = root / "reports" / "finished"
    shutil.copytree(ROOT / "reports" / "int4", finished, ignore=shutil.ignore_patterns(".lock", "partial"))
    cfg = root / "base.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "output_dir": str(root / "reports")}))
    files = root / "files"
    files.mkdir()
    writes = {
        "bad.jsonl": b'{"text": "fine"}\n{"text": "cut\n', "binary.txt": bytes(range(256)) * 8,
        "blank.txt": b"  \n\n\t \n", "nofield.jsonl": b'{"story": "a"}\n', "empty.jsonl": b"",
        "latin1.txt": "caf\xe9 cr\xe8me".encode("latin-1"), "table.csv": b"text\nhello\n",
        "fake.parquet": b"not parquet at all", "numbers.jsonl": b'{"text": 5}\n',
        "config.bin.yaml": b"\x00\x01\x02name: x", "config.latin1.yaml": "name: caf\xe9\n".encode("latin-1"),
        "config.bad.yaml": b"candidates: [unclosed\n", "config.list.yaml": b"- a\n- b\n", "config.empty.yaml": b"",
        "a_file": b"x", "list_config.json": b"[1, 2]", "binary_config.json": bytes(range(256)),
        "no_heads.json": json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64}).encode(),
        "zero_heads.json": json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                                       "num_attention_heads": 0}).encode(),
    }
    for name, content in writes.items():
        (files / name).write_bytes(content)
    for name in ("a_dir", "config.dir.yaml", "empty_model"):
        (files / name).mkdir()
    return {"root": root, "finished": finished, "cfg": cfg, "files": files}


def fill(argv: list[str], env: dict) -> list[str]:
    """Put the paths of ``env`` in for ``{cfg}`` and ``{files}``."""
    return [a.replace("{cfg}", str(env["cfg"])).replace("{files}", str(env["files"])) for a in argv]


def assert_one_clear_line(code: int, out: str, err: str, needle: str, prog: str) -> None:
    assert code == 2, (code, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in out + err


def S(*overrides: str) -> list[str]:
    """The base config with ``--set`` overrides."""
    return ["{cfg}", *set_args(*overrides)]


def only_task(name: str, *overrides: str) -> list[str]:
    """The base config evaluating (and gating) ``name`` alone, with its own limits."""
    return S(f"eval.tasks.names=[{name}]", "gate.tasks=null", "eval.tasks.limits={}", *overrides)


def src(path: str) -> list[str]:
    """The base config with its perplexity source replaced (and no hub to fall back on)."""
    return S(f"eval.perplexity.0.source={path}")


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

LLAMA = ["--model", "llama-3.1-8b", "--context", "1024"]
PLAN_CASES = [
    ("reserve-negative", [*LLAMA, "--gpu-memory", "80GB", "--reserve=-50%"], "--reserve: '-50%'"),
    ("reserve-100", [*LLAMA, "--gpu-memory", "80GB", "--reserve", "100%"], "--reserve: '100%'"),
    ("reserve-text", [*LLAMA, "--gpu-memory", "80GB", "--reserve", "abc%"], "--reserve: 'abc%'"),
    ("reserve-as-flag", [*LLAMA, "--gpu-memory", "80GB", "--reserve", "-50%"], "--reserve"),
    ("gpu-memory-two-dots", [*LLAMA, "--gpu-memory", "1.2.3GB"], "--gpu-memory: cannot read '1.2.3GB'"),
    ("gpu-memory-negative", [*LLAMA, "--gpu-memory=-5GB"], "--gpu-memory: cannot read '-5GB'"),
    ("gpu-memory-unit", [*LLAMA, "--gpu-memory", "80GBs"], "cannot read '80GBs'"),
    ("gpu-memory-too-small", [*LLAMA, "--gpu-memory", "1GB"], "does not cover the weights"),
    ("weights-text", [*LLAMA, "--gpu-memory", "80GB", "--weights", "heavy"], "--weights: cannot read 'heavy'"),
    ("context-text", ["--model", "llama-3.1-8b", "--context", "long"], "--context: invalid int value: 'long'"),
    ("context-zero", ["--model", "llama-3.1-8b", "--context", "0"], "--context must be between 1"),
    ("batch-zero", [*LLAMA, "--batch", "0"], "--batch must be between 1"),
    ("shared-prefix-negative", [*LLAMA, "--shared-prefix", "-1"], "--shared-prefix must be between 0"),
    ("cache-typo", [*LLAMA, "--cache", "int3"], "unknown cache setting 'int3'"),
    ("cache-option-text", [*LLAMA, "--cache", "int4:group_size=abc"], "group_size"),
    ("cache-option-float", [*LLAMA, "--cache", "int4:key_bits=4.0"], "key_bits"),
    ("cache-option-misfit", [*LLAMA, "--cache", "int4:group_size=3"], "group_size 3"),
    ("cache-option-unknown", [*LLAMA, "--cache", "int4:gruop_size=3"], "'gruop_size'"),
    ("cache-option-no-value", [*LLAMA, "--cache", "int4:group_size"], "options are key=value"),
    ("cache-fp16-options", [*LLAMA, "--cache", "fp16:group_size=32"], "fp16 takes no options"),
    ("cache-residual-negative", [*LLAMA, "--cache", "int4:residual_length=-1"], "residual_length"),
    ("dtype-choice", [*LLAMA, "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    ("model-unknown", ["--model", "no-such-model", "--context", "10"], "unknown model 'no-such-model'"),
    ("model-json-list", ["--model", "{files}/list_config.json", "--context", "10"], "list_config.json"),
    ("model-json-binary", ["--model", "{files}/binary_config.json", "--context", "10"], "binary_config.json"),
    ("model-no-heads", ["--model", "{files}/no_heads.json", "--context", "10"], "num_attention_heads"),
    ("model-zero-heads", ["--model", "{files}/zero_heads.json", "--context", "10"], "zero_heads.json"),
]

HF = "pretrained={data}/models/stories260K/hf"
TASK = ["--tasks", "tinystories_lastword", "--limit", "2"]
LM_EVAL_CASES = [
    ("quantizer-typo", [f"{HF},quantizer=int5"], "unknown quantizer 'int5'"),
    ("quantizer-none", [f"{HF},quantizer=None"], "model_args.quantizer must be str"),
    ("group-size-text", [f"{HF},quantizer=int4,group_size=abc"], "group_size"),
    ("group-size-misfit", [f"{HF},quantizer=int4,group_size=3"], "group_size 3"),
    ("option-unknown", [f"{HF},quantizer=int4,gruop_size=32"], "'gruop_size'"),
    ("mode-typo", [f"{HF},mode=stream"], "model_args.mode must be one of ['simulated', 'streaming']"),
    ("chunk-size-0", [f"{HF},chunk_size=0"], "model_args.chunk_size must be >= 1"),
    ("dtype-typo", [f"{HF},dtype=float64"], "model_args.dtype must be one of"),
    ("device-banana", [f"{HF},device=banana"], "device is set with lm-eval's own flag: pass --device banana"),
    ("max-length-1", [f"{HF},max_length=1"], "model_args.max_length must be >= 2"),
    ("pretrained-missing", ["quantizer=int4"], "pretrained=DIR is required"),
    ("pretrained-nonexistent", ["pretrained=/nonexistent/model"], "model_args.pretrained: '/nonexistent/model'"),
    ("gguf-tokenizer", ["pretrained={data}/models/stories260K,gguf_file=stories260K.gguf"], "tokenizer="),
    ("gguf-missing", ["pretrained={data}/models/stories260K,gguf_file=nope.gguf"], "nope.gguf does not exist"),
    ("model-args-no-equals", [f"{HF},int4"], "argument --model_args: expected `key=value`, got 'int4'"),
    ("batch-size-in-model-args", [f"{HF},batch_size=4"], "pass --batch_size 4 instead"),
    ("share-prefix-maybe", [f"{HF},share_prefix=maybe"], "model_args.share_prefix must be true or false, got 'maybe'"),
    ("share-out-typo", [f"{HF},share_out=docs"], "model_args.share_out must be one of documents, requests, got 'docs'"),
]


@pytest.mark.parametrize("argv, needle", [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES])
def test_runner_refuses(env, capsys, no_model_load, argv, needle):
    before = snapshot(env["finished"])
    code = kvquant.run.main(fill(argv, env))
    captured = capsys.readouterr()
    assert_one_clear_line(code, captured.out, captured.err, needle, "kvquant")
    assert snapshot(env["finished"]) == before


@pytest.mark.parametrize("argv, needle", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_planner_refuses(env, capsys, argv, needle):
    before = snapshot(env["finished"])
    code = plan.main(fill(argv, env))
    captured = capsys.readouterr()
    assert_one_clear_line(code, captured.out, captured.err, needle, "kvquant")
    assert snapshot(env["finished"]) == before


@pytest.mark.parametrize("model_args, needle", [c[1:] for c in LM_EVAL_CASES], ids=[c[0] for c in LM_EVAL_CASES])
def test_lm_eval_refuses(env, capsys, monkeypatch, model_args, needle):
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    before = snapshot(env["finished"])
    args = [a.replace("{data}", str(data_dir())) for a in model_args]
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args", *args, *TASK])
    captured = capsys.readouterr()
    assert_one_clear_line(code, captured.out, captured.err, needle, "kvquant")
    assert snapshot(env["finished"]) == before


@pytest.mark.parametrize("tasks, needle", [
    ("tinystories_lastwrod", "unknown task 'tinystories_lastwrod'; did you mean tinystories_lastword"),
    ("tinystories_lastword,hellaswagg", "unknown task 'hellaswagg'"),
], ids=["typo", "second-of-two"])
def test_lm_eval_refuses_unknown_tasks(env, capsys, monkeypatch, tasks, needle):
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)}", "--tasks", tasks])
    captured = capsys.readouterr()
    assert_one_clear_line(code, captured.out, captured.err, needle, "kvquant")


@pytest.fixture(scope="module")
def tiny_config():
    return AutoConfig.from_pretrained(resolve(MODEL))


API_CASES = [
    ("unknown-quantizer", lambda c: kvquant.get_quantizer("int3"), "'int3'"),
    ("group-size-bool", lambda c: kvquant.get_quantizer("int4", group_size=True), "group_size"),
    ("key-bits-float", lambda c: kvquant.get_quantizer("int4", key_bits=4.0), "key_bits"),
    ("key-bits-3", lambda c: kvquant.get_quantizer("int4", key_bits=3), "key_bits"),
    ("group-size-0", lambda c: kvquant.get_quantizer("int4", group_size=0), "group_size"),
    ("unknown-option", lambda c: kvquant.get_quantizer("int4", gruop_size=32), "'gruop_size'"),
    ("fp8-granularity", lambda c: kvquant.get_quantizer("fp8_e4m3", granularity="channel"), "granularity"),
    ("scale-dtype", lambda c: kvquant.get_quantizer("int4", scale_dtype="float64"), "scale_dtype"),
    ("quantizer-none", lambda c: kvquant.make_cache(c, None), "None"),
    ("residual-negative", lambda c: kvquant.make_cache(c, "int4", residual_length=-1), "residual_length"),
    ("residual-bool", lambda c: kvquant.make_cache(c, "int4", residual_length=True), "residual_length"),
    ("sinks-float", lambda c: kvquant.make_cache(c, "int4", sink_tokens=1.5), "sink_tokens"),
    ("not-a-model", lambda c: kvquant.make_cache("gpt2", "int4"), "str"),
    ("model-config-device", lambda c: ModelConfig(device="banana"), "device 'banana'"),
    ("gate-nan", lambda c: GateConfig(max_perplexity_ratio=math.nan), "max_perplexity_ratio"),
    ("perplexity-limit-0", lambda c: PerplexitySet(name="t", source="x.txt", limit=0), "limit must be >= 1"),
]


@pytest.mark.parametrize("call, needle", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_refuses(env, tiny_config, call, needle):
    before = snapshot(env["finished"])
    with pytest.raises(KVQuantError) as info:
        call(tiny_config)
    message = str(info.value)
    assert "\n" not in message.strip() and needle in message, message
    assert snapshot(env["finished"]) == before


@pytest.mark.parametrize("mode, chunk_size, needle", [("stream", 64, "stream"), ("streaming", 0, "chunk_size")],
                         ids=["mode-typo", "chunk-size-0"])
def test_api_scorer_refuses(model, mode, chunk_size, needle):
    with pytest.raises(KVQuantError, match=needle):
        Scorer(model, kvquant.CacheSpec.of("int4"), mode, chunk_size)


def test_api_kvquant_lm_refuses_a_bad_quantizer(model, tokenizer):
    from kvquant.scoring.lm_eval_model import KVQuantLM

    with pytest.raises(KVQuantError, match="int5"):
        KVQuantLM(model, tokenizer=tokenizer, quantizer="int5")


@pytest.mark.parametrize("argv, needle", [
    ([sys.executable, "-m", "kvquant.run", "{files}/config.bin.yaml"], "binary file"),
    ([sys.executable, "-m", "kvquant.plan", *LLAMA, "--gpu-memory", "1.2.3GB"], "cannot read '1.2.3GB'"),
    ([sys.executable, "-m", "kvquant.lm_eval", "--model", "kvquant", "--model_args", f"pretrained={MODEL}",
      "--tasks", "tinystories_lastwrod"], "unknown task"),
], ids=["run", "plan", "lm_eval"])
def test_real_processes_print_one_line(env, argv, needle):
    proc = subprocess.run(fill(argv, env), capture_output=True, text=True, cwd=ROOT)
    prog = "kvquant"  # every command names itself so (the console script docs/trust.md recommends)
    assert_one_clear_line(proc.returncode, proc.stdout, proc.stderr, needle, prog)


# The five worst cases of issue 8, each by name.

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


def test_prerun_checks_catch_missing_and_malformed_data_and_unknown_tasks(env, capsys, no_model_load):
    """Each of these crashed with a traceback and exit 1 after the model had loaded."""
    for argv, needle in [(src("{files}/nothere.jsonl"), "does not exist"), (src("{files}/bad.jsonl"), "not valid JSON"),
                         (src("{files}/binary.txt"), "binary file"),
                         (only_task("tinystories_lastwrod"),
                          "unknown task")]:
        assert kvquant.run.main(fill(argv, env)) == 2  # load_model would raise: it is never reached
        assert needle in capsys.readouterr().err


def test_dataset_sizes_are_validated(env, capsys, no_model_load):
    """Sizes that gave a complete-looking report with n = 0, a slice from the end, or an 11 GiB allocation."""
    for override in ["eval.perplexity.0.limit=0", "eval.perplexity.0.limit=-998", "eval.perplexity.0.max_length=0",
                     "eval.perplexity.0.max_length=-5", "eval.tasks.num_fewshot=-1", "gate.max_perplexity_ratio=.nan",
                     "gate.bootstrap=300000000"]:
        assert kvquant.run.main(fill(S(override), env)) == 2, override
        assert override.split("=")[0].split(".")[-1] in capsys.readouterr().err
    for blank in ("blank.txt", "empty.jsonl"):
        assert kvquant.run.main(fill(src("{files}/" + blank), env)) == 2
        assert "holds no text" in capsys.readouterr().err


def test_api_works_under_autograd(model, story_ids, monkeypatch):
    """The eager dequantization path (every GPU, fp16 models, KVQUANT_KERNELS=0) outside torch.no_grad()."""
    monkeypatch.setattr(kvquant.cache.kernels, "usable", lambda out: False)
    cache = kvquant.make_cache(model, "int4")
    out = model(story_ids, cache=cache, use_cache=True)
    assert torch.isfinite(out.logits).all()


def test_failed_run_does_not_damage_a_finished_report(env, capsys, monkeypatch, tmp_path):
    """A run that fails (before or after the model loads) leaves a finished report byte-for-byte unchanged,
    and a new report directory is not left behind holding half a report."""
    before = snapshot(env["finished"])
    assert kvquant.run.main(fill(S("candidates.0.options.group_size=3"), env)) == 2

    def bad_model(spec):
        raise KVQuantError("cannot load model (simulated)")

    monkeypatch.setattr(kvquant.run, "load_model", bad_model)
    assert kvquant.run.main(fill(["{cfg}"], env)) == 2  # past preflight, under the lock
    assert snapshot(env["finished"]) == before
    fresh = S(f"output_dir={tmp_path / 'new'}")
    assert kvquant.run.main(fill(fresh, env)) == 2
    assert not (tmp_path / "new" / "finished").exists()
    assert "cannot load model (simulated)" in capsys.readouterr().err


LM_EVAL_ARGUMENT_CASES = [  # (case, argv after --model kvquant --model_args pretrained=..., the line's words);
    # issue 58: each was lm-eval's own argument error, exit 3 "internal error" with a log
    ("no-tasks", ["--tasks", ","], "--tasks is required"),
    ("samples-not-json", ["--tasks", "tinystories_lastword", "--samples", "notjson"],
     "--samples: 'notjson' is neither JSON nor a file"),
    ("samples-other-task", ["--tasks", "tinystories_lastword", "--samples", '{"x": [1]}'],
     "--samples: 'x' is not among --tasks (tinystories_lastword)"),
    ("samples-not-indices", ["--tasks", "tinystories_lastword", "--samples", '{"tinystories_lastword": ["a"]}'],
     "--samples: 'tinystories_lastword' must map to a list of document indices"),
    ("multiturn-without-chat", ["--tasks", "tinystories_lastword", "--fewshot_as_multiturn", "--num_fewshot", "1",
                                "--limit", "2"], "`fewshot_as_multiturn` is True, `apply_chat_template` must be set"),
    ("multiturn-no-template", ["--tasks", "tinystories_lastword", "--fewshot_as_multiturn", "--apply_chat_template",
                               "--num_fewshot", "1", "--limit", "2"], "lm-eval refused its arguments before scoring"),
    ("hub-task-offline", ["--tasks", "arc_easy", "--limit", "2"],
     "(the data directory's offline copies: arc_easy -> arc_easy_local)"),
]


@pytest.mark.parametrize("argv, needle", [c[1:] for c in LM_EVAL_ARGUMENT_CASES],
                         ids=[c[0] for c in LM_EVAL_ARGUMENT_CASES])
def test_lm_evals_own_argument_errors_are_one_line(env, capsys, monkeypatch, argv, needle):
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)}", *argv])
    captured = capsys.readouterr()
    assert_one_clear_line(code, captured.out, captured.err, needle, "kvquant")


def test_a_bad_pretrained_id_for_lm_evals_own_model_is_one_line(env, capsys, monkeypatch):
    """Issue 58: ``--model hf`` with a model id the hub cannot give (offline) was exit 3, an internal error."""
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = lm_eval_cli.main(["--model", "hf", "--model_args", "pretrained=no-such/model-xyz", *TASK])
    captured = capsys.readouterr()
    assert_one_clear_line(code, captured.out, captured.err, "lm-eval refused its arguments before scoring anything: "
                          "OSError", "kvquant")
