"""Few-shot contexts longer than the model's are refused, never cut: the runner's ``eval.tasks.num_fewshot``, lm-eval's
``--num_fewshot`` and the shot count a task's own YAML sets, each checked against the model's context before any
request is scored (one line, exit 2); the token counts of the check log nothing."""

import logging
import re
import sys

import pytest
import yaml

import kvquant.run
from kvquant import lm_eval as lm_eval_cli
from kvquant.errors import KVQuantError
from kvquant.paths import resolve
from refusals import error_line
from tiny_configs import MODEL, SMALL_GATED, write_run


FEWSHOT_EVAL = {**SMALL_GATED["eval"], "tasks": {"names": ["tinystories_lastword", "arc_easy"], "limit": 4,
                                            "num_fewshot": {"arc_easy": 5}}}


@pytest.mark.slow
def test_the_runner_refuses_few_shot_contexts_longer_than_the_model_before_it_loads(tmp_path, capsys, no_model_load):
    """eval.tasks.num_fewshot 5 on arc_easy at model.max_length 128: lm-eval's contexts were cut to 128 tokens
    (the examples at the front dropped) while the report said 5-shot."""
    config = write_run(tmp_path, model={"path": MODEL, "max_length": 128}, eval=FEWSHOT_EVAL)
    code = kvquant.run.main([str(config)])
    line = error_line(code, capsys.readouterr().err, "task 'arc_easy' with 5 few-shot examples needs contexts of up to",
                      "the model's context is 128", "raise model.max_length")
    needed = int(re.search(r"up to (\d+) tokens", line).group(1))
    assert needed > 128
    assert not (tmp_path / "reports").exists()

    # the bound is exact: at the context the message names, the same run passes the check
    from transformers import AutoTokenizer

    from kvquant.experiment.config import load_config
    from kvquant.scoring.fewshot import check_runner_fewshot
    from kvquant.scoring.tasks import task_dir

    cfg = load_config(str(config))
    tokenizer = AutoTokenizer.from_pretrained(resolve(MODEL))
    check_runner_fewshot(cfg, lambda: tokenizer, needed, task_dir())
    with pytest.raises(KVQuantError, match=f"up to {needed} tokens, and the model's context is {needed - 1}"):
        check_runner_fewshot(cfg, lambda: tokenizer, needed - 1, task_dir())


@pytest.mark.parametrize("args, needle", [
    (["--tasks", "tinystories_lastword", "--num_fewshot", "100000"],
     "--num_fewshot must be at most 100, got 100000: kvquant's bound"),
    (["--tasks", "tinystories_lastword", "--num_fewshot", "9" * 5000],
     "--num_fewshot must be an integer >= 0, got a 5000-digit number"),
    (["--tasks", "passkey_64", "--limit", "2", "--num_fewshot", "60"],
     "task 'passkey_64' draws its 60 examples from its 50 documents"),
], ids=["100000", "5000-digits", "beyond-the-probe-documents"])
def test_lm_eval_refuses_more_shots_than_it_can_hold_before_the_model_loads(capsys, monkeypatch, no_model_load,
                                                                          args, needle):
    """``--num_fewshot 100000`` failed only after the model loaded (exit 3)."""
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)}", *args])
    error_line(code, capsys.readouterr().err, needle)


def test_the_kvquant_model_refuses_cut_few_shot_contexts_before_scoring_any(model, tokenizer, monkeypatch):
    from lm_eval.api.instance import Instance

    from kvquant.scoring import fewshot
    from kvquant.scoring.lm_eval_model import KVQuantLM

    story = "Once upon a time there was a little girl who liked to play in the park with her dog. " * 4
    short = Instance("loglikelihood", {}, ("Once upon a", " time"), 0, ("short_task", 0, 1))
    long = Instance("loglikelihood", {}, (story, " end"), 0, ("arc_easy", 1, 1))
    needed = len(tokenizer(story + " end").input_ids) - 1
    assert needed > 64
    try:
        fewshot.expect(5)
        lm = KVQuantLM(model, tokenizer=tokenizer, max_length=64)
        scored = []
        monkeypatch.setattr(lm.scorer, "score_many", lambda pairs, desc=None: scored.append(pairs) or [])
        with pytest.raises(KVQuantError, match=f"--num_fewshot: task 'arc_easy' with 5 few-shot examples needs "
                                               f"contexts of up to {needed} tokens, and the model's context is 64"):
            lm.loglikelihood([short, long])
        with pytest.raises(KVQuantError, match="task 'arc_easy'"):
            lm.generate_until([Instance("generate_until", {}, (story, {"max_gen_toks": 8}), 0, ("arc_easy", 1, 1))])
        assert scored == []  # nothing was scored
        fewshot.expect(None)  # zero-shot: as lm-eval's own models, the front of a long document is cut
        assert KVQuantLM(model, tokenizer=tokenizer, max_length=64).shots == 0
    finally:
        fewshot.expect(None)


@pytest.mark.slow
def test_lm_eval_refuses_few_shot_contexts_longer_than_the_model_right_after_it_loads(capsys, monkeypatch):
    """End to end: ``--num_fewshot 5`` on arc_easy with max_length=64; lm-eval's results table said 5-shot."""
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    # lm-eval's log handler may still hold an earlier test's captured (now closed) stderr; logging then prints
    # "--- Logging error --- Traceback ..." about itself, which is no traceback of kvquant's
    monkeypatch.setattr(logging, "raiseExceptions", False)
    monkeypatch.setattr("kvquant.scoring.scorer.Scorer.score_many", lambda *a, **k: pytest.fail("a request was scored"))
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)},max_length=64",
                             "--tasks", "arc_easy_local", "--num_fewshot", "5", "--limit", "2"])
    err = capsys.readouterr().err  # lm-eval has started: its own log lines (timestamped) come before ours
    ours = [line for line in err.splitlines() if line.startswith("kvquant: ")]
    assert code == 2 and len(ours) == 1 and "Traceback" not in err, err[-3000:]
    assert ours[0].startswith("kvquant: error: --num_fewshot: task 'arc_easy_local' with 5 few-shot "
                              "examples needs contexts of up to") and "the model's context is 64" in ours[0], ours


def task_yaml(folder, shots, text: str = "Once upon a time there was a cat who liked to nap in the sun. " * 3):
    """A user task (``mytask``) of 8 stories that sets ``num_fewshot: shots`` in its own YAML."""
    import json

    data = folder / "mytask.jsonl"
    data.write_text("".join(json.dumps({"context": f"{text} Story {i}.", "target": " end"}) + "\n" for i in range(8)))
    (folder / "mytask.yaml").write_text(yaml.safe_dump({
        "task": "mytask", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test", "fewshot_split": "test", "output_type": "loglikelihood", "doc_to_text": "{{context}}",
        "doc_to_target": "{{target}}", "num_fewshot": shots,
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    return folder / "mytask.yaml"


def run_lm_eval(monkeypatch, capsys, *args) -> tuple[int, list[str], str]:
    """kvquant.lm_eval with the toy model, in process: its exit code, its own lines and all of stderr and stdout."""
    import logging
    import sys

    from kvquant import lm_eval as lm_eval_cli
    from kvquant.paths import resolve

    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    monkeypatch.setattr(logging, "raiseExceptions", False)  # lm-eval's handler may hold an earlier closed stderr
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args",
                             f"pretrained={resolve('local:models/stories260K/hf')},max_length=64", *args])
    captured = capsys.readouterr()
    ours = [line for line in captured.err.splitlines() if line.startswith("kvquant: ")]
    return code, ours, captured.err + captured.out


class FakeTask:
    """What :func:`kvquant.scoring.fewshot.note_tasks` reads of an lm-eval task."""

    def __init__(self, name, shots):
        self.config, self.shots = type("Config", (), {"task": name})(), shots

    def get_config(self, key):
        return self.shots if key == "num_fewshot" else None


@pytest.mark.parametrize("shots", [101, 10**6, "5", True, -1])
def test_a_task_file_shot_count_beyond_the_bound_is_refused(shots):
    from kvquant.scoring import fewshot

    try:
        said = re.escape(repr(shots))
        with pytest.raises(KVQuantError, match=rf"^task 'mytask': its task file sets num_fewshot: {said}; kvquant's "
                                               r"bound is a whole number in 0\.\.100"):
            fewshot.note_tasks({"mytask": FakeTask("mytask", shots)})
        fewshot.note_tasks({"a": FakeTask("a", 3), "b": FakeTask("b", None), "c": FakeTask("c", 100)})
        assert fewshot._task_shots == {"a": 3, "c": 100}
    finally:
        fewshot.expect(None)
    assert fewshot._task_shots == {}


@pytest.mark.slow
def test_shots_a_task_file_sets_must_fit_the_model_before_any_request_is_scored(tmp_path, monkeypatch, capsys):
    """Was: lm-eval ran the task file's 5 shots unchecked, the contexts cut to the model's 64 tokens while its
    results said 5-shot."""
    monkeypatch.setattr("kvquant.scoring.scorer.Scorer.score_many", lambda *a, **k: pytest.fail("a request was scored"))
    code, ours, text = run_lm_eval(monkeypatch, capsys, "--tasks", str(task_yaml(tmp_path, 5)), "--limit", "2")
    assert code == 2 and len(ours) == 1 and "Traceback" not in text, text[-3000:]
    assert ours[0].startswith("kvquant: error: num_fewshot (its task file's): task 'mytask' with 5 few-shot "
                              "examples needs contexts of up to") and "the model's context is 64" in ours[0], ours


@pytest.mark.slow
def test_the_flag_still_overrides_a_task_file(tmp_path, monkeypatch, capsys):
    from kvquant.scoring import fewshot

    yaml_path = str(task_yaml(tmp_path, 5))
    code, ours, text = run_lm_eval(monkeypatch, capsys, "--tasks", yaml_path, "--limit", "2", "--num_fewshot", "0")
    assert code == 0 and ours == [] and "|mytask|" in text.replace(" ", ""), text[-3000:]
    assert fewshot._task_shots == {}  # forgotten after the command


def test_the_model_checks_each_task_with_the_shots_its_file_set(tokenizer):
    """:func:`kvquant.scoring.fewshot.check_requests` reads each task's own count (as lm-eval settled it), not one
    for all."""
    from lm_eval.api.instance import Instance

    from kvquant.scoring import fewshot

    story = "Once upon a time there was a little girl who liked to play in the park with her dog. " * 4
    requests = [Instance("loglikelihood", {}, (story, " end"), 0, (task, 0, 1)) for task in ("zero", "some")]
    encode = fewshot.counter(tokenizer)
    try:
        fewshot.note_tasks({"zero": FakeTask("zero", 0), "some": FakeTask("some", 1)})
        fewshot.check_requests(requests[:1], encode, 0, 64)  # zero-shot: cut to the context as lm-eval's models do
        fewshot.check_requests(requests[1:], encode, 0, 512)  # fits
        with pytest.raises(KVQuantError, match=r"^num_fewshot \(its task file's\): task 'some' with 1 few-shot"):
            fewshot.check_requests(requests, encode, 0, 64)
    finally:
        fewshot.expect(None)


# the few-shot check's token counts logged transformers' "Token indices sequence length is longer
# than the specified maximum sequence length" before the refusal's one line (and, in a long pytest run, through a
# handler whose stream an earlier test had closed: 189 lines of "--- Logging error ---")
def test_the_few_shot_token_count_logs_no_sequence_length_warning():
    import logging

    from transformers import AutoTokenizer

    from kvquant.scoring.fewshot import counter
    from kvquant.paths import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve(MODEL))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.tokenization_utils_base")
    logger.addHandler(handler)
    try:
        long_text = "one two three " * (tokenizer.model_max_length + 50)
        counts = counter(tokenizer)([long_text, "one"])
    finally:
        logger.removeHandler(handler)
    assert counts[0] > tokenizer.model_max_length and counts[1] == len(tokenizer("one").input_ids)
    assert not [r for r in records if "sequence length" in r.getMessage()], [r.getMessage() for r in records]
