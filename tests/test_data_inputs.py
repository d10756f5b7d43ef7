"""Data a run or lm-eval reads, refused before a model loads: perplexity files that are missing, malformed, empty or
not text; JSON Python cannot read; sizes that would measure nothing; offline task data that is broken. Each is one
line naming the file, the line and what is wrong (exit 2 from a command, one :class:`KVQuantError` line from the
API)."""

import json
import re
from pathlib import Path

import pytest

import kvquant.run
from kvquant import lm_eval as lm_eval_cli
from kvquant.errors import KVQuantError
from kvquant.paths import data_dir, resolve
from kvquant.scoring import tasks
from refusals import PROGRESS, S, error_line, fill, one_line, only_task, src
from tiny_configs import MODEL


def test_prerun_checks_catch_missing_and_malformed_data_and_unknown_tasks(refusal_env, capsys, no_model_load):
    """Each of these crashed with a traceback and exit 1 after the model had loaded."""
    for argv, needle in [(src("{files}/nothere.jsonl"), "does not exist"), (src("{files}/bad.jsonl"), "not valid JSON"),
                         (src("{files}/binary.txt"), "binary file"),
                         (only_task("tinystories_lastwrod"),
                          "unknown task")]:
        error_line(kvquant.run.main(fill(argv, refusal_env)), capsys.readouterr().err, needle)  # load_model never ran


def test_dataset_sizes_are_validated(refusal_env, capsys, no_model_load):
    """Sizes that gave a complete-looking report with n = 0, a slice from the end, or an 11 GiB allocation."""
    for override in ["eval.perplexity.0.limit=0", "eval.perplexity.0.limit=-998", "eval.perplexity.0.max_length=0",
                     "eval.perplexity.0.max_length=-5", "eval.tasks.num_fewshot=-1", "gate.max_perplexity_ratio=.nan",
                     "gate.bootstrap=300000000"]:
        error_line(kvquant.run.main(fill(S(override), refusal_env)), capsys.readouterr().err,
                   override.split("=")[0].split(".")[-1])
    for blank in ("blank.txt", "empty.jsonl"):
        error_line(kvquant.run.main(fill(src("{files}/" + blank), refusal_env)), capsys.readouterr().err,
                   "holds no text")


JSON_CASES = [
    ("deep.jsonl", "[" * 100_000 + "]" * 100_000 + "\n", "line 1: JSON nested too deeply"),
    ("deep.json", "[" * 100_000 + "]" * 100_000, "deep.json: JSON nested too deeply"),
    ("huge.jsonl", '{"text": ' + "1" * 5000 + "}\n", "line 1: a number of more than 4,300 digits"),
    ("huge.json", "[" + "1" * 5000 + "]", "huge.json: a number of more than 4,300 digits"),
]


@pytest.mark.parametrize("name, text, needle", JSON_CASES, ids=[c[0] for c in JSON_CASES])
def test_data_file_python_cannot_read_is_refused(refusal_env, no_model_load, capsys, tmp_path, name, text, needle):
    (tmp_path / name).write_text(text)
    error_line(kvquant.run.main(fill(src(str(tmp_path / name)), refusal_env)), capsys.readouterr().err, needle)


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

TASK_DATA_CASES = [
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


def task_data_refused(names: list[str]) -> str:
    """The one line ``check_task_data`` refuses ``names`` with."""
    with pytest.raises(KVQuantError) as info:
        tasks.check_task_data(names, "eval.tasks.names")
    message = one_line(info)
    assert message.startswith("eval.tasks.names: "), message
    return message


@pytest.mark.parametrize("task, content, needle", [c[1:] for c in TASK_DATA_CASES], ids=[c[0] for c in TASK_DATA_CASES])
def test_task_data_refused(data, task, content, needle):
    path = data_file(data, task)
    path.unlink()
    path.write_bytes(content)
    message = task_data_refused([task])
    assert f"task {task!r}: {path}" in message and needle in message, message


def test_task_data_not_a_file_or_too_large(data, monkeypatch):
    path = data_file(data, "piqa")
    path.unlink()
    path.mkdir()
    assert "is not a regular file" in task_data_refused(["piqa"])
    monkeypatch.setattr(tasks, "MAX_TASK_FILE_BYTES", 1000)
    assert f"{data_file(data, 'boolq')} is larger than" in task_data_refused(["boolq"])


@pytest.mark.parametrize("task", ["hellaswag", tasks.LASTWORD])
def test_task_data_missing_offline_is_refused(data, monkeypatch, task):
    """A missing offline copy falls back to the hub task, which cannot be downloaded with the hub switched off."""
    data_file(data, task).unlink()
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    message = task_data_refused([task])
    assert f"{data_file(data, task)} does not exist" in message and "HF_DATASETS_OFFLINE" in message, message
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    tasks.check_task_data([task], "eval.tasks.names")  # with a hub to reach: the hub task, as documented


def test_real_task_data_passes(data):
    tasks.check_task_data([*tasks.OFFLINE_TASKS, tasks.LASTWORD, "passkey_100", "mmlu"], "eval.tasks.names")


def test_lm_eval_refuses_broken_task_data_before_loading(data, lm_eval_trapped, capsys):
    path = data_file(data, "hellaswag")
    path.unlink()
    path.write_bytes(rows({"ctx": "A man runs.", "endings": ["a"], "label": 0}))
    for name in ("hellaswag", "hellaswag_local"):
        code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)}",
                                 "--tasks", f"{name},tinystories_lastword"])
        error_line(code, capsys.readouterr().err, f"--tasks: task 'hellaswag': {path}, line 1: no field",
                   besides=PROGRESS)


@pytest.mark.parametrize("row, needle", [
    ({"text": "\u0000\u0000\u0000\u0000"}, "row 1 is not text: 4 of its 4 characters are control characters (NUL"),
    ({"text": "\x01\x02\x03 almost nothing but control bytes \x04\x05\x06"}, "row 1 is not text: 6 of its"),
    ({"text": "\ud800 lone surrogate"}, "row 1 is not text: it holds a lone surrogate at character 0"),
    ({"text": 5}, "row 1: field 'text' is int 5, not text"),
    ({"text": None}, "row 1: field 'text' is NoneType None, not text"),
])
def test_perplexity_rows_that_are_not_text_are_refused(tmp_path, row, needle):
    """NUL text was accepted (and measured), a lone surrogate crashed the tokenizer (exit 3), and a number in the
    text field was called a missing field."""
    from kvquant.experiment.config import PerplexitySet
    from kvquant.scoring.data import load_rows

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8", errors="surrogatepass")
    with pytest.raises(KVQuantError, match=re.escape(needle)) as info:
        load_rows(PerplexitySet(name="t", source=str(path)))
    one_line(info)


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


@pytest.mark.parametrize("line, needle", [
    ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "line 1: JSON nested too deeply to read"),
    ('{"text": "cut', "line 1: not valid JSON"),
    ('{"story": "a"}', "line 1: "),
])
def test_stories_python_cannot_read_are_one_line(tmp_path, monkeypatch, line, needle):
    """Was: tasks.py read these with a bare json.loads (RecursionError, KeyError: exit 3), for any task list."""
    from kvquant.scoring import tasks

    source = tmp_path / "data" / tasks.LASTWORD_SOURCE
    source.parent.mkdir(parents=True)
    source.write_text(line + "\n")
    monkeypatch.setenv("KVQUANT_DATA", str(tmp_path / "data"))
    with pytest.raises(KVQuantError, match=re.escape(f"{source}, {needle}")):
        tasks.write_task_dir(tmp_path / "tasks")
