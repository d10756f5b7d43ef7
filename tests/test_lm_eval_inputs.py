"""``python -m kvquant.lm_eval``'s input: the kvquant model's ``--model_args``, unknown tasks, lm-eval's pass-through
flags (``--limit``, ``--num_fewshot``, ``--batch_size``, ``--seed``, ``--output_path``, ``--config``, abbreviated
flags) and lm-eval's own argument errors. Each refusal is one line and exit 2 (or one :class:`KVQuantError` line),
before a model loads where it can be (the loaders and lm-eval's own CLI are booby-trapped); lm-eval's own syntax
reaches lm-eval unchanged."""

import sys
from pathlib import Path

import pytest
import yaml

import kvquant.run
import kvquant.scoring.lm_eval_model
from kvquant import lm_eval as lm_eval_cli
from kvquant.errors import KVQuantError
from kvquant.paths import data_dir, resolve
from refusals import PROGRESS, error_line, one_line, snapshot
from tiny_configs import MODEL


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


@pytest.mark.parametrize("model_args, needle", [c[1:] for c in LM_EVAL_CASES], ids=[c[0] for c in LM_EVAL_CASES])
def test_lm_eval_refuses(refusal_env, capsys, monkeypatch, model_args, needle):
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    before = snapshot(refusal_env["finished"])
    args = [a.replace("{data}", str(data_dir())) for a in model_args]
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args", *args, *TASK])
    captured = capsys.readouterr()
    error_line(code, captured.err, needle, out=captured.out)
    assert snapshot(refusal_env["finished"]) == before


@pytest.mark.parametrize("tasks, needle", [
    ("tinystories_lastwrod", "unknown task 'tinystories_lastwrod'; did you mean tinystories_lastword"),
    ("tinystories_lastword,hellaswagg", "unknown task 'hellaswagg'"),
], ids=["typo", "second-of-two"])
def test_lm_eval_refuses_unknown_tasks(refusal_env, capsys, monkeypatch, tasks, needle):
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)}", "--tasks", tasks])
    captured = capsys.readouterr()
    error_line(code, captured.err, needle, out=captured.out)


def test_api_kvquant_lm_refuses_a_bad_quantizer(model, tokenizer):
    from kvquant.scoring.lm_eval_model import KVQuantLM

    with pytest.raises(KVQuantError, match="int5"):
        KVQuantLM(model, tokenizer=tokenizer, quantizer="int5")


LM_EVAL_ARGUMENT_CASES = [  # (case, argv after --model kvquant --model_args pretrained=..., the line's words);
    # each was lm-eval's own argument error, exit 3 "internal error" with a log
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
def test_lm_evals_own_argument_errors_are_one_line(refusal_env, capsys, monkeypatch, argv, needle):
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)}", *argv])
    captured = capsys.readouterr()
    error_line(code, captured.err, needle, out=captured.out)


def test_a_bad_pretrained_id_for_lm_evals_own_model_is_one_line(refusal_env, capsys, monkeypatch):
    """``--model hf`` with a model id the hub cannot give (offline) was exit 3, an internal error."""
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = lm_eval_cli.main(["--model", "hf", "--model_args", "pretrained=no-such/model-xyz", *TASK])
    captured = capsys.readouterr()
    error_line(code, captured.err, "lm-eval refused its arguments before scoring anything: OSError", out=captured.out)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "limit0.yaml").write_text(yaml.safe_dump({"limit": 0}))
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump({"tasks": ["tinystories_lastwrod"]}))
    (tmp_path / "args.yaml").write_text(yaml.safe_dump({"model_args": {"pretrained": resolve(MODEL),
                                                                        "quantizer": "int5"}}))
    (tmp_path / "list.yaml").write_text("- a\n")
    (tmp_path / "device.yaml").write_text(yaml.safe_dump({"device": "cuda:99"}))
    (tmp_path / "device_cpu.yaml").write_text(yaml.safe_dump({"device": "cpu"}))
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
    # a GPU torch does not see: was the CPU, with a note before lm-eval's output (cuda:99: no machine here has 100)
    ("device-gpu-absent", [*BASE, "--device", "cuda:99"], "--device is 'cuda:99', but"),
    ("device-gpu-absent-config", [*BASE, "--config", "{files}/device.yaml"], "--device is 'cuda:99', but"),
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
def test_lm_eval_entry_refuses(lm_eval_trapped, files, capsys, argv, needle):
    code = lm_eval_cli.main(entry(argv, files))
    error_line(code, capsys.readouterr().err, needle, besides=PROGRESS)


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
def test_lm_eval_entry_accepts(lm_eval_trapped, files, monkeypatch, extra):
    """lm-eval's own syntax passes the checks and reaches lm-eval unchanged (plus the offline task folder)."""
    seen = []
    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", lambda: seen.append(list(sys.argv[1:])))
    argv = entry([*BASE, *extra], files)
    assert lm_eval_cli.main(argv) == 0
    assert seen and seen[0][: len(argv)] == argv and seen[0][len(argv)] == "--include_path"


@pytest.mark.parametrize("model, extra, device", [
    ("kvquant", [], ["--device", "auto"]), ("kvquant", ["--device", "cpu"], []),
    ("kvquant", ["--config", "{files}/device_cpu.yaml"], []), ("hf", [], []),
], ids=["kvquant-default", "kvquant-cpu", "kvquant-config-cpu", "hf-default"])
def test_lm_eval_gives_the_kvquant_model_auto_where_no_device_is_asked(lm_eval_trapped, files, monkeypatch, model,
                                                                        extra, device):
    """Was: lm-eval's default cuda:0 reached the kvquant model, which on a machine without a GPU printed a note
    ("kvquant: device 'cuda:0' is not available") before a refusal's one line. Another model keeps lm-eval's own
    default."""
    seen = []
    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", lambda: seen.append(list(sys.argv[1:])))
    argv = entry(["--model", model, *BASE[2:], *extra], files)
    assert lm_eval_cli.main(argv) == 0
    assert seen[0][:len(argv) + 1] == [*argv, "--include_path"] and seen[0][len(argv) + 2:] == device, seen


@pytest.mark.parametrize("batch_size, max_batch_size, expected", [
    ("auto", None, 16), ("auto:4", None, 16), ("auto", 4, 4), ("auto:2", "8", 8), ("8", None, 8), (3, None, 3),
    (None, None, 1),
], ids=["auto", "auto-4", "auto-max-4", "auto-2-max-8", "text-8", "int-3", "none"])
def test_kvquant_lm_accepts_lm_eval_batch_sizes(model, tokenizer, batch_size, max_batch_size, expected):
    lm = kvquant.scoring.lm_eval_model.KVQuantLM(model, tokenizer=tokenizer, batch_size=batch_size,
                                         max_batch_size=max_batch_size)
    assert lm.scorer.batch_size == expected


def test_kvquant_lm_refuses_a_gpu_torch_does_not_see_before_loading(lm_eval_trapped):
    """Was: the CPU, with a note on stderr (from Python, a device asked for is the user's own)."""
    with pytest.raises(KVQuantError, match=r"^device is 'cuda:99', but") as info:
        kvquant.scoring.lm_eval_model.KVQuantLM(resolve(MODEL), device="cuda:99")
    one_line(info)


@pytest.mark.parametrize("batch_size, max_batch_size, needle", [
    ("0", None, "batch_size"), (-1, None, "batch_size"), ("x", None, "batch_size"), ("auto:0", None, "batch_size"),
    ("auto:x", None, "batch_size"), ("1.5", None, "batch_size"), (True, None, "batch_size"),
    ("auto", 0, "max_batch_size"), ("auto", "x", "max_batch_size"),
], ids=["0", "negative", "text", "auto-0", "auto-x", "float", "bool", "max-0", "max-text"])
def test_kvquant_lm_refuses_batch_sizes_before_loading(lm_eval_trapped, batch_size, max_batch_size, needle):
    with pytest.raises(KVQuantError, match=needle) as info:
        kvquant.scoring.lm_eval_model.KVQuantLM(resolve(MODEL), batch_size=batch_size, max_batch_size=max_batch_size)
    one_line(info)


# kvquant's own get_task_dict call printed lm-eval's DeprecationWarning before a refusal's one line
def test_lm_eval_task_lookup_prints_no_deprecation_warning():
    import warnings

    from kvquant.scoring.task_setup import lm_eval_task
    from kvquant.scoring.tasks import task_dir

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = lm_eval_task("tinystories_lastword", task_dir())
    assert task is not None
    # (lm-eval's get_task_dict also warned through load_task_or_group, "Use TaskManager.load()", which got through)
    assert not [w for w in caught if "get_task_dict" in str(w.message) or "TaskManager.load" in str(w.message)], \
        [str(w.message) for w in caught]
