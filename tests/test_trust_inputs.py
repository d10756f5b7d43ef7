"""Code that must never run: a model folder's own Python (nothing asks on the terminal either), modules another user
planted in the working directory, a task's ``!function`` module from anywhere but beside its task file, a
``kvquant.py`` beside the console script; and private folders given as relative paths. Each case is one line and
exit 2, before the model loads (``load_model`` is booby-trapped); no planted file ever runs (each writes a marker
if it does)."""

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvquant.run
from kvquant import lm_eval as lm_eval_cli
from kvquant import plan
from kvquant.errors import KVQuantError
from kvquant.paths import resolve
from refusals import error_line
from tiny_configs import MODEL, SMALL_GATED, write_run


OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def python_m(module: str, args: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    """``python -m module args`` run from ``cwd`` (whose folder ``python -m`` puts first on ``sys.path``)."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **OFFLINE}, timeout=600, **kwargs)


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
        code, prog = kvquant.run.main([str(write_run(tmp_path, model={"path": str(folder)}))]), "kvquant"
    elif entry == "plan":
        code, prog = plan.main(["--model", str(folder), "--context", "16"]), "kvquant"
    else:
        monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
        code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={folder}",
                                 "--tasks", "tinystories_lastword", "--limit", "2"])
        prog = "kvquant"
    out, err = capsys.readouterr()
    line = error_line(code, err, str(folder), prog=prog)
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
    error_line(proc.returncode, proc.stderr, str(folder))
    assert "Do you wish" not in proc.stdout + proc.stderr
    assert not marker.exists(), "the model folder's Python ran"


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
    config = write_run(tmp_path, eval={**SMALL_GATED["eval"], "tasks": {"names": ["tinystories_lastwrod"]}},
                          gate={"perplexity": ["tinystories"], "tasks": []})
    filled = [a.format(config=config, work=work, model=resolve(MODEL)) for a in args]
    proc = python_m(module, filled, work)
    assert sorted(p.name for p in ran.iterdir()) == [], f"planted modules ran: {proc.stderr[-2000:]}"
    error_line(proc.returncode, proc.stderr, prog=prog)


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
        lm_eval_cli.check_arguments(argv)


def test_a_function_module_beside_its_task_file_is_accepted(tmp_path):
    task = own_task(tmp_path, "mod.process_docs")
    (task.parent / "mod.py").write_text("def process_docs(ds):\n    return ds\n")
    argv = ["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)}", "--tasks", str(task), "--limit", "1"]
    lm_eval_cli.check_arguments(argv)


@pytest.mark.slow
def test_a_function_module_planted_in_the_working_directory_never_runs(tmp_path):
    """The whole case end to end: ``python -m kvquant.lm_eval --tasks own/t.yaml`` from a folder where another
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
    error_line(proc.returncode, proc.stderr, "`!function mod.process_docs` names no module file")


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


@pytest.mark.parametrize("variable", ["KVQUANT_CACHE_DIR", "KVQUANT_TASK_DIR"])
def test_a_relative_private_folder_is_refused_and_nothing_created(no_model_load, tmp_path, monkeypatch, capsys,
                                                                  variable):
    """Was: ``KVQUANT_CACHE_DIR=relative/dir`` created relative/dir/... under the working directory on exit 2."""
    import kvquant.run

    cfg = str(write_run(tmp_path))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv(variable, "relative/dir")
    assert kvquant.run.main([cfg]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"kvquant: error: ${variable}: 'relative/dir' is a relative path; set an absolute one (a private "
                   "folder of kvquant must not depend on the folder you run from)")
    assert list(work.iterdir()) == []


def test_a_relative_kernel_folder_is_refused_where_it_is_read(tmp_path, monkeypatch):
    from kvquant.fs import cache_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVQUANT_KERNEL_DIR", "kernels")
    with pytest.raises(KVQuantError, match=r"^\$KVQUANT_KERNEL_DIR: 'kernels' is a relative path"):
        cache_dir("kernels", env="KVQUANT_KERNEL_DIR")
    monkeypatch.setenv("KVQUANT_KERNEL_DIR", str(tmp_path / "absolute"))  # absolute (and ~/...) are used as given
    assert cache_dir("kernels", env="KVQUANT_KERNEL_DIR") == tmp_path / "absolute"
    assert [p.name for p in tmp_path.iterdir()] == ["absolute"]
