"""Issue 36, trust and silent truncation: a model folder's own Python code, modules another user planted in the
working directory or that a task's ``!function`` would import from anywhere, the ranks of one data-parallel run
running different things, and few-shot contexts longer than the model's.

Each case is one line and exit 2, before the model loads where the input shows it (``load_model`` is booby-trapped),
else right after it and before anything is scored; no planted file ever runs (each writes a marker if it does).
"""

import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kvquant.scoring.lm_eval_model
import kvquant.run
from kvquant import lm_eval as lm_eval_cli
from kvquant import plan
from kvquant.scoring import parallel
from kvquant.errors import KVQuantError
from kvquant.paths import resolve
from hostile_helpers import MODEL, tiny_run

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
CONFIG = tiny_run("trust", "q", tasks_limit=4)


def one_line(code: int, err: str, prog: str, *needles: str) -> str:
    """The single error line of a refused command (exit 2), holding every needle."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), (code, err[-3000:])
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def write_config(tmp_path: Path, name: str = "config.yaml", **changes) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / "reports"), **changes}))
    return path


def python_m(module: str, args: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    """``python -m module args`` run from ``cwd`` (whose folder ``python -m`` puts first on ``sys.path``)."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **OFFLINE}, timeout=600, **kwargs)


# --- 1. a model folder's own Python code never runs, and nothing asks on the terminal -----------------------------


@pytest.fixture
def remote_code_model(tmp_path) -> tuple[Path, Path]:
    """A model folder whose config names its own classes (``auto_map``); its Python writes a marker if it runs."""
    folder, marker = tmp_path / "remote-model", tmp_path / "remote-code-ran"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "kvquant_remote_probe", "architectures": ["ProbeModel"],
        "auto_map": {"AutoConfig": "configuration_probe.ProbeConfig",
                     "AutoModelForCausalLM": "modeling_probe.ProbeModel"},
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 8,
        "vocab_size": 32, "max_position_embeddings": 64}))
    code = (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
            "from transformers import PretrainedConfig\n\n\nclass ProbeConfig(PretrainedConfig):\n"
            "    model_type = 'kvquant_remote_probe'\n")
    (folder / "configuration_probe.py").write_text(code)
    (folder / "modeling_probe.py").write_text(code.replace("PretrainedConfig", "PreTrainedModel")
                                              .replace("ProbeConfig", "ProbeModel"))
    return folder, marker


@pytest.mark.parametrize("entry", ["run", "plan", "lm_eval"])
def test_a_model_folder_that_needs_its_own_code_is_refused_even_when_the_user_answers_yes(
        tmp_path, capsys, monkeypatch, no_model_load, remote_code_model, entry):
    """transformers asked "Do you wish to run the custom code?" (trust_remote_code was never passed) during the
    runner's pre-load checks, the planner and the lm-eval entry; answering y ran the folder's Python."""
    folder, marker = remote_code_model
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 8))  # a user who would answer yes to any prompt
    if entry == "run":
        code, prog = kvquant.run.main([str(write_config(tmp_path, model={"path": str(folder)}))]), "kvquant"
    elif entry == "plan":
        code, prog = plan.main(["--model", str(folder), "--context", "16"]), "kvquant"
    else:
        monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
        code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={folder}",
                                 "--tasks", "tinystories_lastword", "--limit", "2"])
        prog = "kvquant"
    out, err = capsys.readouterr()
    line = one_line(code, err, prog, str(folder))
    assert "auto_map" in line or "custom code" in line, line
    assert "Do you wish" not in out + err
    assert not marker.exists(), "the model folder's Python ran"
    assert not (tmp_path / "reports").exists()


def test_the_planner_on_a_terminal_never_prompts_for_a_model_folders_code(tmp_path, remote_code_model):
    """The same from a real terminal: stdin a tty on which the user types y."""
    folder, marker = remote_code_model
    master, slave = os.openpty()
    try:
        os.write(master, b"y\n" * 8)
        proc = subprocess.run([sys.executable, "-m", "kvquant.plan", "--model", str(folder), "--context", "16"],
                              stdin=slave, capture_output=True, text=True, cwd=tmp_path, timeout=300,
                              env={**os.environ, **OFFLINE})
    finally:
        os.close(slave)
        os.close(master)
    one_line(proc.returncode, proc.stderr, "kvquant", str(folder))
    assert "Do you wish" not in proc.stdout + proc.stderr
    assert not marker.exists(), "the model folder's Python ran"


# --- 2. nothing is imported from the working directory, nor by a !function from anywhere but beside its file -----

PLANTED = ("numpy", "yaml", "flash_attn")


def plant(folder: Path) -> Path:
    """Modules another user left in ``folder``, each writing ``<folder>/ran/<name>`` when imported."""
    ran = folder / "ran"
    ran.mkdir(parents=True)
    for name in PLANTED:
        (folder / f"{name}.py").write_text(f"open({str(ran / name)!r}, 'w').write('ran')\n")
    return ran


@pytest.mark.slow
@pytest.mark.parametrize("module, args, prog", [
    ("kvquant.run", ["{config}"], "kvquant"),
    ("kvquant.plan", ["--model", "llama-3.1-8b", "--context", "0"], "kvquant"),
    ("kvquant.export", ["{work}/no-such-report"], "kvquant"),
    ("kvquant.adopt", ["{config}", "{work}/no-such-partial"], "kvquant"),
    ("kvquant.lm_eval", ["--model", "kvquant", "--model_args", "pretrained={model}", "--tasks", "tinystories_lastwrod"],
     "kvquant"),
], ids=["run", "plan", "export", "adopt", "lm_eval"])
def test_modules_planted_in_the_working_directory_never_run(tmp_path, module, args, prog):
    """``python -m`` puts the working directory first on ``sys.path``: a ``numpy.py`` left there ran as kvquant
    started, a ``flash_attn.py`` during the runner's pre-load checks. Each command is refused (exit 2) for a bad
    input it reads after the model's config, so it gets that far."""
    work = tmp_path / "shared-work"
    ran = plant(work)
    config = write_config(tmp_path, eval={**CONFIG["eval"], "tasks": {"names": ["tinystories_lastwrod"]}},
                          gate={"perplexity": ["tinystories"], "tasks": []})
    filled = [a.format(config=config, work=work, model=resolve(MODEL)) for a in args]
    proc = python_m(module, filled, work)
    assert sorted(p.name for p in ran.iterdir()) == [], f"planted modules ran: {proc.stderr[-2000:]}"
    one_line(proc.returncode, proc.stderr, prog)


def test_only_python_m_of_a_kvquant_command_drops_the_working_directory(monkeypatch, tmp_path):
    from kvquant import importpath

    monkeypatch.chdir(tmp_path)
    for argv, module in [
        (["py", "-u", "-m", "kvquant.run", "x.yaml"], "kvquant.run"), (["py", "-mkvquant.plan"], "kvquant.plan"),
        (["py", "-W", "error", "-X", "dev", "-m", "kvquant.lm_eval"], "kvquant.lm_eval"),
        (["py", "-c", "import kvquant", "-m", "x"], None), (["py", "script.py", "-m", "kvquant.run"], None),
        (["py"], None),
    ]:
        assert importpath.module_run(argv) == module, argv
    for argv, before, after in [
        (["py", "-m", "kvquant.run"], [str(tmp_path), "/lib"], ["/lib"]),
        (["py", "-m", "kvquant.run"], ["", "/lib"], ["/lib"]),
        (["py", "-m", "kvquant.run"], ["/lib", str(tmp_path)], ["/lib", str(tmp_path)]),  # not -m's entry
        (["py", "-m", "pytest"], [str(tmp_path), "/lib"], [str(tmp_path), "/lib"]),  # another tool's import path
        (["py", "myscript.py"], [str(tmp_path), "/lib"], [str(tmp_path), "/lib"]),
    ]:
        monkeypatch.setattr(sys, "path", list(before))
        monkeypatch.setattr(importpath, "_dropped", False)
        importpath.drop_working_dir(argv)
        importpath.drop_working_dir(argv)  # once only: a later entry that is the working directory stays
        assert sys.path == after, (argv, before, sys.path)


FUNCTION_TASK = ("task: own\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {docs}}}}}\ntest_split: test\n"
                 "output_type: loglikelihood\ndoc_to_text: '{{{{context}}}}'\ndoc_to_target: '{{{{target}}}}'\n"
                 "metric_list: [{{metric: acc}}]\nprocess_docs: !function {function}\n")


def own_task(tmp_path: Path, function: str, where: str = "") -> Path:
    """A task file of one's own (a 0700 folder) naming ``!function function``, in ``where`` below it."""
    own = tmp_path / "own"
    (own / where).mkdir(parents=True, mode=0o700, exist_ok=True)
    own.chmod(0o700)
    docs = own / "docs.jsonl"
    docs.write_text(json.dumps({"context": "a", "target": " b"}) + "\n")
    (own / where / "t.yaml").write_text(FUNCTION_TASK.format(docs=docs, function=function))
    return own / where / "t.yaml"


@pytest.mark.parametrize("how", ["module-absent", "dotted-module-absent", "no-module", "in-an-included-file"])
def test_a_function_whose_module_is_not_beside_its_task_file_is_refused(tmp_path, how):
    """lm-eval imports ``!function mod.fn`` from beside the YAML when ``mod.py`` is there, else from anywhere on
    Python's path (the working directory's ``mod.py`` of another user)."""
    function = {"module-absent": "mod.process_docs", "dotted-module-absent": "pkg.mod.process_docs",
                "no-module": "process_docs", "in-an-included-file": "mod.process_docs"}[how]
    task = own_task(tmp_path, function, "sub" if how == "in-an-included-file" else "")
    if how == "in-an-included-file":  # mod.py beside the including file, not beside the file that names it
        (task.parent.parent / "mod.py").write_text("def process_docs(ds):\n    return ds\n")
        (task.parent.parent / "top.yaml").write_text("include: sub/t.yaml\ntask: top\n")
        task = task.parent.parent / "top.yaml"
    argv = ["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)}", "--tasks", str(task), "--limit", "1"]
    with pytest.raises(KVQuantError, match=re.escape(f"`!function {function}` names no module file beside it")):
        lm_eval_cli.check(argv)


def test_a_function_module_beside_its_task_file_is_accepted(tmp_path):
    task = own_task(tmp_path, "mod.process_docs")
    (task.parent / "mod.py").write_text("def process_docs(ds):\n    return ds\n")
    argv = ["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)}", "--tasks", str(task), "--limit", "1"]
    lm_eval_cli.check(argv)


@pytest.mark.slow
def test_a_function_module_planted_in_the_working_directory_never_runs(tmp_path):
    """The issue's case end to end: ``python -m kvquant.lm_eval --tasks own/t.yaml`` from a folder where another
    user left ``mod.py``; the task names ``!function mod.process_docs`` and has no ``mod.py`` beside it."""
    task = own_task(tmp_path, "mod.process_docs")
    work = tmp_path / "shared-work"
    work.mkdir()
    marker = tmp_path / "mod-ran"
    (work / "mod.py").write_text(f"def process_docs(ds):\n    open({str(marker)!r}, 'w').write('ran')\n"
                                 "    return ds\n")
    proc = python_m("kvquant.lm_eval", ["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)}",
                                        "--tasks", str(task), "--limit", "1"], work)
    assert not marker.exists(), "the planted module ran"
    one_line(proc.returncode, proc.stderr, "kvquant", "`!function mod.process_docs` names no module file")


# --- 3. the processes of one data-parallel run must run the same thing ---------------------------------------------


class Ranks(parallel.Processes):
    """Process 0 of two, whose peer gathered ``theirs`` (a change of this process's parts)."""

    def __init__(self, change: dict):
        super().__init__(rank=0, world=2)
        object.__setattr__(self, "change", change)

    def gather(self, obj):
        return [obj, {**obj, **self.change}]

    def broadcast(self, obj):
        return obj


@pytest.mark.parametrize("part", ["config", "code", "data", "model files"])
def test_ranks_that_disagree_on_config_code_data_or_model_are_refused_before_the_model_loads(
        tmp_path, capsys, monkeypatch, no_model_load, part):
    """int8 on one rank and int4 on the other (same candidate name) blended their scores into one result, stored
    as signed int8 results that a later correct run reused."""
    monkeypatch.setattr(parallel, "current", lambda: Ranks({part: "0123456789abcdef"}))
    code = kvquant.run.main([str(write_config(tmp_path))])
    one_line(code, capsys.readouterr().err, "kvquant", f"process 1 differs from process 0 in its {part}",
             "nothing was measured")
    assert not (tmp_path / "reports").exists()


def test_lm_eval_ranks_that_run_other_flags_are_refused_before_the_model_loads(capsys, monkeypatch, no_model_load):
    """``torchrun -m kvquant.lm_eval --model kvquant``: ranks with other model_args (another quantizer) or tasks
    would score their shares of other things and rank 0 would gather them into one table."""
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    monkeypatch.setattr(parallel, "current", lambda: Ranks({"command": "0123456789abcdef"}))
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)},quantizer=int4",
                             "--tasks", "tinystories_lastword", "--limit", "2"])
    one_line(code, capsys.readouterr().err, "kvquant", "process 1 differs from process 0 in its command")


def test_ranks_that_agree_go_on():
    parts = {"config": "a", "code": "b"}
    parallel.agree(Ranks({}), parts)
    parallel.agree(parallel.ONE, parts)
    with pytest.raises(KVQuantError, match="in its data"):
        parallel.agree(Ranks({"data": "x"}), parts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_real_ranks_with_int8_and_int4_under_one_name_store_nothing(tmp_path):
    """The issue's run: two processes of one run (as ``torchrun`` starts them, each on its own machine with its
    own config copy), int8 on rank 0 and int4 on rank 1 under the same candidate name."""
    port, procs = free_port(), []
    for rank, quantizer in enumerate(["int8", "int4"]):
        config = write_config(tmp_path, f"rank{rank}.yaml", candidates=[{"quantizer": quantizer, "name": "q"}])
        env = {**os.environ, **OFFLINE, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "kvquant.run", str(config)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        one_line(proc.returncode, err, "kvquant", "process 1 differs from process 0 in its config")
    assert not (tmp_path / "reports").exists(), "a result was stored"


# --- 4. few-shot contexts longer than the model's are refused, never cut ------------------------------------------

FEWSHOT_EVAL = {**CONFIG["eval"], "tasks": {"names": ["tinystories_lastword", "arc_easy"], "limit": 4,
                                            "num_fewshot": {"arc_easy": 5}}}


@pytest.mark.slow
def test_the_runner_refuses_few_shot_contexts_longer_than_the_model_before_it_loads(tmp_path, capsys, no_model_load):
    """eval.tasks.num_fewshot 5 on arc_easy at model.max_length 128: lm-eval's contexts were cut to 128 tokens
    (the examples at the front dropped) while the report said 5-shot."""
    config = write_config(tmp_path, model={"path": MODEL, "max_length": 128}, eval=FEWSHOT_EVAL)
    code = kvquant.run.main([str(config)])
    line = one_line(code, capsys.readouterr().err, "kvquant", "task 'arc_easy' with 5 few-shot examples needs "
                    "contexts of up to", "the model's context is 128", "raise model.max_length")
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
    one_line(code, capsys.readouterr().err, "kvquant", needle)


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


def test_the_kvquant_script_never_imports_a_kvquant_module_planted_in_the_working_directory(tmp_path):
    """``python -m kvquant.plan`` from a folder holding another user's ``kvquant.py`` runs that file (Python
    resolves the ``-m`` package from the working directory before any kvquant code exists); the ``kvquant``
    console script (``pyproject.toml``'s ``[project.scripts]``) starts from its own folder and never does."""
    script = Path(sys.executable).parent / "kvquant"
    assert script.is_file(), f"{script} is missing: reinstall kvquant (pip install -e .) to get the console script"
    marker = tmp_path / "ran"
    (tmp_path / "kvquant.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    args = ["plan", "--model", "llama-3.1-8b", "--context", "1024", "--cache", "int4"]
    done = subprocess.run([str(script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "model llama-3.1-8b: 32 layers" in done.stdout and not marker.exists()
    unsafe = subprocess.run([sys.executable, "-m", "kvquant.plan", *args[1:]], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert marker.exists() and unsafe.returncode != 0  # the risk the script avoids, shown
    bad = subprocess.run([str(script), "nope"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("kvquant: error: unknown command 'nope'")


def test_an_unknown_command_with_escape_sequences_is_shown_inert_once(capsys):
    """Probe 58 (x03): the console script's unknown command was escaped, then quoted with ``repr``, which doubled
    every backslash (``'\\\\u001b[2J'``): what the user typed is shown as ``\\u001b`` once, never sent raw."""
    from kvquant import cli

    assert cli.main(["\x1b[2J\x07x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvquant: error: unknown command '\\u001b[2J\\u0007x'; usage: kvquant") and "\x1b" not in err
