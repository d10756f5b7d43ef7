"""Hostile input at the entries (issue 19): lm-eval's pass-through flags, a model whose weights hold NaN/Inf, and
broken offline task data. Each is refused with one line and exit 2 (or one :class:`KVQuantError`), and, where it
can be, before a model loads (the loaders and lm-eval's own CLI are booby-trapped)."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import kvquant.scoring.lm_eval_model
import kvquant.scoring.models
import kvquant.run
from kvquant import lm_eval as lm_eval_cli
from kvquant.scoring import tasks
from kvquant.errors import KVQuantError
from kvquant.paths import data_dir, resolve

MODEL = "local:models/stories260K/hf"
STORIES = "local:text/tinystories/validation-first1000.jsonl"
NAIVE = ["--model", "kvquant", "--tasks", "tinystories_lastword"]


def assert_one_line(code: int, err: str, needle: str, prog: str = "kvquant", started: bool = False) -> str:
    """``started``: the refusal comes after the run was cleared to start (the model loaded), when the config's
    warnings (e.g. too few windows to decide a pass) have been printed already."""
    assert code == 2, (code, err)
    visible = [line.rsplit("\r", 1)[-1] for line in err.splitlines()]  # what a terminal shows after progress bars
    progress = ("%|", "examples/s]", *((f"{prog}: warning: ",) if started else ()))  # printed before the refusal
    lines = [line for line in visible if line.strip() and not any(p in line for p in progress)]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    assert needle in lines[0], (needle, lines[0])
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def trapped(monkeypatch, tmp_path):
    """No model may load and lm-eval's own CLI may not start; GGUF conversions would go to a throwaway cache."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])

    def trap(*args, **kwargs):
        raise AssertionError("reached a model load (or lm-eval's CLI) for an input that should have been refused")

    for module in (kvquant.scoring.models, kvquant.scoring.lm_eval_model, kvquant.run):
        monkeypatch.setattr(module, "load_model", trap)
    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", trap)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "limit0.yaml").write_text(yaml.safe_dump({"limit": 0}))
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump({"tasks": ["tinystories_lastwrod"]}))
    (tmp_path / "args.yaml").write_text(yaml.safe_dump({"model_args": {"pretrained": resolve(MODEL),
                                                                        "quantizer": "int5"}}))
    (tmp_path / "list.yaml").write_text("- a\n")
    return tmp_path


def entry(argv: list[str], files: Path) -> list[str]:
    return [a.replace("{model}", resolve(MODEL)).replace("{files}", str(files)) for a in argv]


BASE = ["--model", "kvquant", "--model_args", "pretrained={model}", "--tasks", "tinystories_lastword"]
ENTRY_CASES = [
    # --limit: a document count >= 1 or a fraction in (0, 1)
    ("limit-0", [*BASE, "--limit", "0"], "--limit must be a whole number of documents >= 1 or a fraction"),
    ("limit-negative", [*BASE, "--limit", "-3"], "got '-3'"),
    ("limit-nan", [*BASE, "--limit", "nan"], "got 'nan'"),
    ("limit-inf", [*BASE, "--limit", "inf"], "got 'inf'"),
    ("limit-part-count", [*BASE, "--limit", "2.5"], "got '2.5'"),
    ("limit-text", [*BASE, "--limit", "many"], "got 'many'"),
    ("limit-abbreviated", [*BASE, "--lim", "0"], "--limit must be"),
    ("limit-config-yaml", [*BASE, "--config", "{files}/limit0.yaml"], "--limit must be"),
    # --num_fewshot
    ("fewshot-negative", [*BASE, "--num_fewshot", "-2"], "--num_fewshot must be an integer >= 0, got '-2'"),
    ("fewshot-text", [*BASE, "--num_fewshot", "x"], "--num_fewshot must be an integer >= 0, got 'x'"),
    # --batch_size: an integer >= 1, auto, auto:N; --max_batch_size
    *[(f"batch-size-{v}", [*BASE, "--batch_size", v], f"--batch_size must be an integer >= 1, 'auto' or 'auto:N'"
       f" (N >= 1), got {v!r}") for v in ("0", "-1", "x", "auto:0", "auto:x", "1.5", "auto:", "automatic")],
    ("batch-size-abbreviated", [*BASE, "--batch", "0"], "--batch_size must be"),
    ("max-batch-size-0", [*BASE, "--max_batch_size", "0"], "--max_batch_size must be an integer >= 1, got '0'"),
    ("max-batch-size-text", [*BASE, "--max_batch_size", "x"], "--max_batch_size must be an integer >= 1"),
    # --seed: one integer (or None) or 3-4 comma-separated, each in numpy's range
    ("seed-negative", [*BASE, "--seed", "-1"], "--seed"),
    ("seed-two", [*BASE, "--seed", "1,2"], "--seed"),
    ("seed-text", [*BASE, "--seed", "x"], "--seed"),
    ("seed-huge", [*BASE, "--seed", str(2**40)], "--seed"),
    # --output_path: results are written after the whole evaluation, so a path that cannot be written is refused
    ("output-path-file", [*BASE, "--output_path", "{files}/a_file"], "a_file is a file"),
    ("output-path-under-file", [*BASE, "--output_path", "{files}/a_file/out"], "a_file is not a directory"),
    ("output-json-under-file", [*BASE, "--output_path", "{files}/a_file/r.json"], "a_file is not a directory"),
    # flags lm-eval itself refuses only with a ValueError (exit 3) once it starts
    ("samples-and-limit", [*BASE, "--limit", "2", "--samples", '{"tinystories_lastword": [0]}'], "--samples"),
    ("log-samples-no-output", [*BASE, "--log_samples"], "--log_samples needs --output_path"),
    ("no-tasks", ["--model", "kvquant", "--model_args", "pretrained={model}"], "--tasks is required"),
    ("unknown-model", ["--model", "kvqant", "--model_args", "pretrained={model}", "--tasks", "tinystories_lastword"],
     "--model: unknown model 'kvqant'; did you mean kvquant"),
    # lm-eval hands the model --batch_size and --device itself: a model_args copy was "multiple values" (exit 3)
    ("model-args-device", ["--model", "kvquant", "--model_args", "pretrained={model},device=cpu", "--tasks",
                           "tinystories_lastword"], "model_args: device is set with lm-eval's own flag: pass --device"),
    # abbreviated flags are resolved as lm-eval resolves them, and then checked
    ("tasks-abbreviated", ["--model", "kvquant", "--model_args", "pretrained={model}", "--task",
                           "tinystories_lastwrod"], "unknown task 'tinystories_lastwrod'"),
    ("model-args-abbreviated", ["--model", "kvquant", "--model_arg", "pretrained={model},quantizer=int5", "--tasks",
                                "tinystories_lastword"], "unknown quantizer 'int5'"),
    ("model-abbreviated", ["--mode", "kvquant", "--model_args", "pretrained={model}", "--tasks",
                           "tinystories_lastword"], "--mode could match --model, --model_args"),  # as lm-eval says
    ("flag-ambiguous", ["--mod", "kvquant", *BASE[2:]], "--mod could match --model, --model_args"),
    ("flag-unknown", [*BASE, "--limitt", "3"], "unrecognized arguments: --limitt"),
    # an lm-eval config file (--config) is read as lm-eval reads it: command-line flags win over it
    ("config-tasks", ["--model", "kvquant", "--model_args", "pretrained={model}", "--config", "{files}/typo.yaml"],
     "unknown task 'tinystories_lastwrod'"),
    ("config-model-args", ["--model", "kvquant", "--tasks", "tinystories_lastword", "--config", "{files}/args.yaml"],
     "unknown quantizer 'int5'"),
    ("config-missing", [*BASE, "--config", "{files}/nope.yaml"], "nope.yaml"),
    ("config-list", [*BASE, "--config", "{files}/list.yaml"], "must be a mapping"),
]


@pytest.mark.parametrize("argv, needle", [c[1:] for c in ENTRY_CASES], ids=[c[0] for c in ENTRY_CASES])
def test_lm_eval_entry_refuses(trapped, files, capsys, argv, needle):
    code = lm_eval_cli.main(entry(argv, files))
    assert_one_line(code, capsys.readouterr().err, needle)


ACCEPT_CASES = [
    ("batch-size-auto", ["--batch_size", "auto"]),
    ("batch-size-auto-4", ["--batch_size", "auto:4"]),
    ("batch-size-8", ["--batch_size", "8", "--max_batch_size", "16"]),
    ("limit-fraction", ["--limit", "0.5"]),
    ("limit-count", ["--limit", "3", "--num_fewshot", "0"]),
    ("limit-abbreviated", ["--lim", "2"]),
    ("seed-list", ["--seed", "0,None,8,52"]),
    ("output-dir", ["--output_path", "{files}/new/results"]),
    ("output-json", ["--output_path", "{files}/new/r.json"]),
]


@pytest.mark.parametrize("extra", [c[1] for c in ACCEPT_CASES], ids=[c[0] for c in ACCEPT_CASES])
def test_lm_eval_entry_accepts(trapped, files, monkeypatch, extra):
    """lm-eval's own syntax passes the checks and reaches lm-eval unchanged (plus the offline task folder)."""
    seen = []
    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", lambda: seen.append(list(sys.argv[1:])))
    argv = entry([*BASE, *extra], files)
    assert lm_eval_cli.main(argv) == 0
    assert seen and seen[0][: len(argv)] == argv and seen[0][len(argv)] == "--include_path"


@pytest.mark.parametrize("batch_size, max_batch_size, expected", [
    ("auto", None, 16), ("auto:4", None, 16), ("auto", 4, 4), ("auto:2", "8", 8), ("8", None, 8), (3, None, 3),
    (None, None, 1),
], ids=["auto", "auto-4", "auto-max-4", "auto-2-max-8", "text-8", "int-3", "none"])
def test_kvquant_lm_accepts_lm_eval_batch_sizes(model, tokenizer, batch_size, max_batch_size, expected):
    lm = kvquant.scoring.lm_eval_model.KVQuantLM(model, tokenizer=tokenizer, batch_size=batch_size,
                                         max_batch_size=max_batch_size)
    assert lm.scorer.batch_size == expected


@pytest.mark.parametrize("batch_size, max_batch_size, needle", [
    ("0", None, "batch_size"), (-1, None, "batch_size"), ("x", None, "batch_size"), ("auto:0", None, "batch_size"),
    ("auto:x", None, "batch_size"), ("1.5", None, "batch_size"), (True, None, "batch_size"),
    ("auto", 0, "max_batch_size"), ("auto", "x", "max_batch_size"),
], ids=["0", "negative", "text", "auto-0", "auto-x", "float", "bool", "max-0", "max-text"])
def test_kvquant_lm_refuses_batch_sizes_before_loading(trapped, batch_size, max_batch_size, needle):
    with pytest.raises(KVQuantError, match=needle) as info:
        kvquant.scoring.lm_eval_model.KVQuantLM(resolve(MODEL), batch_size=batch_size, max_batch_size=max_batch_size)
    assert "\n" not in str(info.value)


# A model whose weights hold NaN/Inf outside the K/V path


def broken_model(directory: Path, weight: str, value: float) -> Path:
    """A copy of the toy model with one element of ``weight`` set to ``value``."""
    shutil.copytree(resolve(MODEL), directory)
    weights = load_file(directory / "model.safetensors")
    weights[weight].view(-1)[7] = value
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


WEIGHTS = [("model.layers.2.mlp.down_proj.weight", float("nan")), ("model.layers.0.mlp.up_proj.weight", float("inf")),
           ("model.norm.weight", float("-inf")), ("model.embed_tokens.weight", float("nan"))]


@pytest.mark.parametrize("weight, value", WEIGHTS, ids=["mlp-nan", "mlp-inf", "norm-neg-inf", "embedding-nan"])
def test_load_model_refuses_non_finite_weights(tmp_path, weight, value):
    from kvquant.experiment.model_config import ModelConfig

    path = broken_model(tmp_path / "broken", weight, value)
    with pytest.raises(KVQuantError) as info:
        kvquant.scoring.models.load_model(ModelConfig(path=str(path), device="cpu"))
    message = str(info.value)
    assert "\n" not in message and str(path) in message and weight in message and "NaN or Inf" in message, message


CONFIG = {
    "name": "broken",
    "candidates": [{"quantizer": "int4", "name": "int4", "options": {"residual_length": 0}}],
    "eval": {"perplexity": [{"name": "tinystories", "source": STORIES, "limit": 4, "max_length": 64}],
             "tasks": {"names": ["tinystories_lastword"], "limit": 5}},
    "gate": {"tasks": ["tinystories_lastword"], "perplexity": ["tinystories"], "bootstrap": 1000},
}


def run_config(tmp_path: Path, model_path: str, *overrides: str) -> int:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "model": {"path": model_path, "device": "cpu"},
                                   "output_dir": str(tmp_path / "reports")}))
    return kvquant.run.main([str(cfg), *(a for o in overrides for a in ("--set", o))])


def test_run_refuses_a_model_with_nan_weights(tmp_path, capsys, monkeypatch):
    """Was: a NaN baseline and "FAIL: int4 ..." (exit 1)."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    path = broken_model(tmp_path / "broken", "model.layers.1.mlp.gate_proj.weight", float("nan"))
    line = assert_one_line(run_config(tmp_path, str(path)), capsys.readouterr().err, str(path), "kvquant", True)
    assert "model.layers.1.mlp.gate_proj.weight" in line


@pytest.mark.parametrize("overrides, metric", [
    ((), "perplexity 'tinystories'"),
    (("eval.perplexity=[]", "gate.perplexity=[]"), "task 'tinystories_lastword'"),
], ids=["perplexity", "task"])
def test_run_refuses_a_non_finite_baseline(tmp_path, capsys, monkeypatch, overrides, metric):
    """Scores that are not finite through the identity cache (here: the final norm poisoned after the load check,
    so keys and values stay finite) mean the model is broken, not the quantizer. Was: "FAIL: int4 ..." (exit 1)."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    real = kvquant.scoring.models.load_model

    def poisoned(spec):
        model, tokenizer = real(spec)
        with torch.no_grad():
            model.model.norm.weight[0] = float("nan")
        return model, tokenizer

    monkeypatch.setattr(kvquant.run, "load_model", poisoned)
    line = assert_one_line(run_config(tmp_path, MODEL, *overrides), capsys.readouterr().err, MODEL, "kvquant", True)
    assert "identity cache" in line and metric in line, line


# Offline task data: checked before a model loads


@pytest.fixture
def data(tmp_path, monkeypatch):
    """A data directory of symlinks to the real one (so single files can be replaced by broken ones)."""
    real = data_dir()
    root = tmp_path / "data"
    for rel in [*(spec[2] for spec in tasks.OFFLINE_TASKS.values()), tasks.LASTWORD_SOURCE]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).symlink_to(real / rel)
    (root / "models").symlink_to(real / "models")
    monkeypatch.setenv("KVQUANT_DATA", str(root))
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    return root


def rows(*docs) -> bytes:
    return "".join(json.dumps(d) + "\n" for d in docs).encode()


HELLA = {"activity_label": "Pole vault", "ctx_a": "A man runs.", "ctx_b": "he", "label": 1,
         "endings": ["jumps.", "falls.", "sits.", "sleeps."]}
ARC = {"question": "Which?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "B"}
PIQA = {"goal": "g", "sol1": "a", "sol2": "b", "label": 0}
WINO = {"sentence": "Sarah beat Maria so _ won.", "option1": "Sarah", "option2": "Maria", "answer": "1"}
STORY = {"text": "Once upon a time there was a cat. The cat liked to nap."}

DATA_CASES = [
    ("empty", "hellaswag", b"", "holds no rows"),
    ("blank", "hellaswag", b"\n  \n", "holds no rows"),
    ("garbage", "hellaswag", b"this is not json\n", "line 1: not valid JSON"),
    ("garbage-second-line", "hellaswag", rows(HELLA) + b'{"ctx": "cut\n', "line 2: not valid JSON"),
    ("latin1", "hellaswag", "caf\xe9\n".encode("latin-1"), "not UTF-8 (line 1)"),
    ("binary", "lambada_openai", bytes(range(256)), "not UTF-8"),
    ("row-list", "hellaswag", b"[1, 2]\n", "line 1: not a JSON object"),
    ("no-endings", "hellaswag", rows(HELLA, {k: v for k, v in HELLA.items() if k != "endings"}),
     "line 2: no field 'endings' (the task reads activity_label, ctx_a, ctx_b, endings, label)"),
    ("ctx-only", "hellaswag", rows({"ctx": "A man runs.", "endings": ["a"], "label": 0}), "line 1: no field"),
    ("endings-not-list", "hellaswag", rows({**HELLA, "endings": "jumps."}), "line 1: field 'endings'"),
    ("label-out-of-range", "hellaswag", rows({**HELLA, "label": 7}), "line 1: field 'label'"),
    ("label-type-changes", "hellaswag", rows(HELLA, {**HELLA, "label": "2"}),
     "line 2: field 'label' is str here but int on line 1"),
    ("lambada-no-text", "lambada_openai", rows({"txt": "a b"}), "line 1: no field 'text'"),
    ("lambada-text-number", "lambada_openai", rows({"text": 5}), "line 1: field 'text'"),
    ("arc-answer-not-a-label", "arc_easy", rows(ARC, {**ARC, "answerKey": "E"}), "line 2: field 'answerKey'"),
    ("arc-choices-flat", "arc_challenge", rows({**ARC, "choices": ["a", "b"]}), "line 1: field 'choices'"),
    ("piqa-no-label", "piqa", rows({k: v for k, v in PIQA.items() if k != "label"}), "line 1: no field 'label'"),
    ("boolq-label-text", "boolq", rows({"passage": "p", "question": "q", "label": "yes"}), "line 1: field 'label'"),
    ("winogrande-no-blank", "winogrande", rows({**WINO, "sentence": "no blank"}), "line 1: field 'sentence'"),
    ("winogrande-answer-3", "winogrande", rows({**WINO, "answer": "3"}), "line 1: field 'answer'"),
    ("stories-garbage", tasks.LASTWORD, b"Once upon a time\n", "line 1: not valid JSON"),
    ("stories-no-text", tasks.LASTWORD, rows(*[{"story": "a b"}] * 600), "line 1: no field 'text'"),
    ("stories-too-few", tasks.LASTWORD, rows(*[STORY] * 100), "100 stories"),
    ("stories-blank-line", tasks.LASTWORD, rows(*[STORY] * 600) + b"\n", "line 601: not valid JSON"),
]


def data_file(root: Path, task: str) -> Path:
    return root / (tasks.LASTWORD_SOURCE if task == tasks.LASTWORD else tasks.OFFLINE_TASKS[task][2])


def refused(names: list[str]) -> str:
    with pytest.raises(KVQuantError) as info:
        tasks.check_task_data(names, "eval.tasks.names")
    message = str(info.value)
    assert "\n" not in message and message.startswith("eval.tasks.names: "), message
    return message


@pytest.mark.parametrize("task, content, needle", [c[1:] for c in DATA_CASES], ids=[c[0] for c in DATA_CASES])
def test_task_data_refused(data, task, content, needle):
    path = data_file(data, task)
    path.unlink()
    path.write_bytes(content)
    message = refused([task])
    assert f"task {task!r}: {path}" in message and needle in message, message


def test_task_data_not_a_file_or_too_large(data, monkeypatch):
    path = data_file(data, "piqa")
    path.unlink()
    path.mkdir()
    assert "is not a regular file" in refused(["piqa"])
    monkeypatch.setattr(tasks, "MAX_TASK_FILE_BYTES", 1000)
    assert f"{data_file(data, 'boolq')} is larger than" in refused(["boolq"])


@pytest.mark.parametrize("task", ["hellaswag", tasks.LASTWORD])
def test_task_data_missing_offline_is_refused(data, monkeypatch, task):
    """A missing offline copy falls back to the hub task, which cannot be downloaded with the hub switched off."""
    data_file(data, task).unlink()
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    message = refused([task])
    assert f"{data_file(data, task)} does not exist" in message and "HF_DATASETS_OFFLINE" in message, message
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    tasks.check_task_data([task], "eval.tasks.names")  # with a hub to reach: the hub task, as documented


def test_real_task_data_passes(data):
    tasks.check_task_data([*tasks.OFFLINE_TASKS, tasks.LASTWORD, "passkey_100", "mmlu"], "eval.tasks.names")


def test_lm_eval_refuses_broken_task_data_before_loading(data, trapped, capsys):
    path = data_file(data, "hellaswag")
    path.unlink()
    path.write_bytes(rows({"ctx": "A man runs.", "endings": ["a"], "label": 0}))
    for name in ("hellaswag", "hellaswag_local"):
        code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)}",
                                 "--tasks", f"{name},tinystories_lastword"])
        assert_one_line(code, capsys.readouterr().err, f"--tasks: task 'hellaswag': {path}, line 1: no field")


@pytest.mark.parametrize("row, needle", [
    ({"text": "\u0000\u0000\u0000\u0000"}, "row 1 is not text: 4 of its 4 characters are control characters (NUL"),
    ({"text": "\x01\x02\x03 almost nothing but control bytes \x04\x05\x06"}, "row 1 is not text: 6 of its"),
    ({"text": "\ud800 lone surrogate"}, "row 1 is not text: it holds a lone surrogate at character 0"),
    ({"text": 5}, "row 1: field 'text' is int 5, not text"),
    ({"text": None}, "row 1: field 'text' is NoneType None, not text"),
])
def test_perplexity_rows_that_are_not_text_are_refused(tmp_path, row, needle):
    """Found by the second hostile session: NUL text was accepted (and measured), a lone surrogate crashed the
    tokenizer (exit 3), and a number in the text field was called a missing field."""
    from kvquant.experiment.config import PerplexitySet
    from kvquant.scoring.data import load_rows

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8", errors="surrogatepass")
    with pytest.raises(KVQuantError, match=re.escape(needle)) as info:
        load_rows(PerplexitySet(name="t", source=str(path)))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("separator, needle", [("\u0000\u0000", "separator is not text"),
                                               ("\ud800", "separator is not text: it holds a lone surrogate")])
def test_a_separator_that_is_not_text_is_refused(tmp_path, separator, needle):
    """The rows were checked but not what joins them (a NUL separator was measured; a surrogate was exit 3)."""
    from kvquant.experiment.config import PerplexitySet
    from kvquant.scoring.data import load_rows

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": "Once upon a time."}) + "\n")
    with pytest.raises(KVQuantError, match=re.escape(needle)):
        load_rows(PerplexitySet(name="t", source=str(path), layout="stream", separator=separator))


@pytest.mark.parametrize("command, argv", [
    ("plan", ["--model", "llama-3.1-8b", "--context", "0"]),
    ("export", ["/nonexistent/report"]),
    ("adopt", ["/nonexistent/config.yaml", "/nonexistent/partial"]),
    ("run", ["/nonexistent/config.yaml"]),
    ("packaged", ["no-such-package"]),
])
def test_every_command_names_itself_kvquant_in_its_one_line(capsys, command, argv):
    """Issue 58: one-line errors began ``kvquant.plan:``, ``kvquant.packaged:`` or ``kvquant:`` by command; every
    command is ``kvquant COMMAND`` (the console script docs/trust.md recommends), so each line begins ``kvquant:``."""
    from kvquant import cli

    assert cli.main([command, *argv]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvquant: error: "), lines
