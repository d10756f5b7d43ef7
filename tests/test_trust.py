"""The trust boundary (docs/trust.md): nothing executable is loaded from a folder another user can write, no write
follows a symlink kvquant did not create, one lock holder however many runs race, SIGTERM unwinds like Ctrl-C,
and partial results are reused only when they verify."""

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import kvquant.run
import kvquant.runner.pipeline
from kvquant.errors import KVQuantError
from kvquant.exits import write_error_log
from kvquant.fs import private_dir, set_aside, write_together
from kvquant.paths import data_dir
from kvquant.runner.store import LOCK, ResultStore, RunLock

ROOT = Path(__file__).parents[1]
STORIES = "local:text/tinystories/validation-first1000.jsonl"
TINY = {
    "name": "tiny",
    "model": {"path": "local:models/stories260K/hf"},
    "candidates": [{"quantizer": "int4", "name": "int4", "options": {"residual_length": 0}}],
    "eval": {"perplexity": [{"name": "tinystories", "source": STORIES, "limit": 4, "max_length": 64}],
             "tasks": {"names": ["tinystories_lastword"], "limit": 5}},
    "gate": {"bootstrap": 1000},
}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_cli(args: list[str], env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvquant.run", *args], capture_output=True, text=True,
                          env={**os.environ, **OFFLINE, **(env or {})}, cwd=ROOT, timeout=600, **kwargs)


def write_config(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, "output_dir": str(tmp_path / "reports"), **changes}))
    return path


# --- code execution -------------------------------------------------------------------------------------------

EVIL_TASK = """task: tinystories_lastword
dataset_path: json
dataset_kwargs: {data_files: {test: %s}}
test_split: test
process_docs: !function evil.process_docs
output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
metric_list: [{metric: acc}]
"""


def plant_evil(folder: Path, tmp_path: Path, task: str = "tinystories_lastword") -> Path:
    """Write into ``folder`` a task ``task`` whose ``!function`` writes a marker file; returns the marker."""
    marker = tmp_path / "pwned"
    docs = folder / "docs.jsonl"
    docs.write_text(json.dumps({"context": "a", "target": " b"}) + "\n")
    (folder / "evil.py").write_text(f"def process_docs(ds):\n    open({str(marker)!r}, 'w').write('ran')\n"
                                    "    return ds\n")
    (folder / "evil.yaml").write_text(EVIL_TASK.replace("tinystories_lastword", task) % docs)
    return marker


@pytest.mark.slow
def test_code_execution_a_task_yaml_planted_in_the_shared_temp_folder_is_never_loaded(tmp_path):
    """An attacker who can write the temp directory plants a task that redefines the gated task with
    ``!function``; building kvquant's task manager and task must not run it (it did: the folder was
    ``$TMPDIR/kvquant-tasks/<data dir tag>``, a path anyone could predict and create first)."""
    shared_tmp = tmp_path / "tmp"
    planted = shared_tmp / "kvquant-tasks" / re.sub(r"[^A-Za-z0-9]+", "_", str(data_dir()))
    planted.mkdir(parents=True)
    planted.chmod(0o777)
    marker = plant_evil(planted, tmp_path)
    script = ("from lm_eval.tasks import get_task_dict\nfrom kvquant.scoring.tasks import task_manager\n"
              "get_task_dict(['tinystories_lastword'], task_manager())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **OFFLINE, "TMPDIR": str(shared_tmp)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert not marker.exists(), "kvquant loaded a task file another user planted"


def test_the_default_task_folder_is_private_and_new_for_each_process(tmp_path):
    script = ("from kvquant.scoring.tasks import task_dir\nimport os\nd = task_dir()\n"
              "print(d, oct(os.stat(d.parent).st_mode))")
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "TMPDIR": str(tmp_path)}).stdout.split() for _ in range(2)]
    (first, mode), (second, _) = runs
    assert first != second and mode.endswith("700")
    assert not Path(first).exists(), "the folder outlives its process"


@pytest.mark.parametrize("make", ["world_writable", "group_writable", "symlink", "file", "foreign_ancestor"])
def test_private_dir_refuses_folders_others_can_write(tmp_path, make):
    target = tmp_path / "tasks"
    if make == "world_writable":
        target.mkdir()
        target.chmod(0o777)
    elif make == "group_writable":
        target.mkdir()
        target.chmod(0o770)
    elif make == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        target.symlink_to(tmp_path / "elsewhere")
    elif make == "file":
        target.write_text("x")
    else:  # an ancestor every user may write, without the sticky bit: the folder can be swapped
        open_parent = tmp_path / "open"
        open_parent.mkdir()
        open_parent.chmod(0o777)
        target = open_parent / "tasks"
    with pytest.raises(KVQuantError, match="refusing .*only you can write"):
        private_dir(target, "$KVQUANT_TASK_DIR")


def test_private_dir_accepts_a_folder_of_its_own_under_a_sticky_temp_dir(tmp_path):
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    made = private_dir(sticky / "kvquant", "cache")
    assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o700
    assert private_dir(made, "cache") == made


@pytest.mark.parametrize("after_a_dry_run", [False, True])
def test_a_shared_task_folder_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys, after_a_dry_run):
    """Also after a --dry-run in the same process (which writes its task files to a private folder only while it
    runs: once it held that switch for good, and every later run in the process skipped this check)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("KVQUANT_TASK_DIR", str(shared))
    if after_a_dry_run:
        assert kvquant.run.main([str(write_config(tmp_path)), "--dry-run"]) == 0
        capsys.readouterr()
    monkeypatch.setattr(kvquant.runner.pipeline, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code = kvquant.run.main([str(write_config(tmp_path))])
    err = capsys.readouterr().err
    assert code == 2 and "$KVQUANT_TASK_DIR: refusing" in err and err.count("\n") == 1


def test_a_kernel_folder_others_can_write_is_not_loaded_from(tmp_path):
    shared = tmp_path / "kernels"
    shared.mkdir()
    shared.chmod(0o777)
    script = "import kvquant.formats.kernels as k\nprint(k.available())"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "KVQUANT_KERNEL_DIR": str(shared)})
    assert out.stdout.strip() == "False" and "refusing" in out.stderr
    assert not any(shared.iterdir())


# --- writes never follow a symlink ----------------------------------------------------------------------------


def test_symlink_at_the_report_directory_is_refused(tmp_path, capsys, monkeypatch):
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "tiny").symlink_to(victim)
    monkeypatch.setattr(kvquant.runner.pipeline, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code = kvquant.run.main([str(write_config(tmp_path))])
    assert code == 2 and "is a symlink" in capsys.readouterr().err
    assert not any(victim.iterdir())


AS_ROOT = pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a folder to another user")


@pytest.mark.parametrize("make", ["foreign", "world_writable"])
def test_a_report_directory_another_user_owns_or_may_write_is_refused(tmp_path, capsys, monkeypatch, make):
    """A report folder another user made (or that every user may write) beforehand: that user could swap
    ``partial/`` for a link between the run's check and its write, so the run refuses it before the model loads,
    writing nothing (export and plan refuse such a folder too). Before: accepted, config and partial/ written."""
    if make == "foreign" and os.getuid() != 0:
        pytest.skip("needs root to give a folder to another user")
    report = tmp_path / "reports" / "tiny"
    report.mkdir(parents=True)
    if make == "foreign":
        os.chown(report, 4242, 4242)
    else:
        report.chmod(0o777)
    monkeypatch.setattr(kvquant.runner.pipeline, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code = kvquant.run.main([str(write_config(tmp_path))])
    err = capsys.readouterr().err
    assert code == 2 and "refusing" in err and len(err.strip().splitlines()) == 1
    assert ("belongs to another user (uid 4242)" if make == "foreign" else "writable by every user") in err
    assert not any(report.iterdir())


@AS_ROOT
def test_another_users_file_in_the_report_directory_is_never_replaced(tmp_path):
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.md").write_text("theirs")
    os.chown(report / "report.md", 4242, 4242)
    with pytest.raises(KVQuantError, match="belongs to another user"):
        write_together(report, {"results.json": "{}", "report.md": "ours"})
    assert (report / "report.md").read_text() == "theirs" and not (report / "results.json").exists()


def test_symlink_at_partial_candidate_is_refused_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    partial = tmp_path / "report" / "partial"
    partial.mkdir(parents=True)
    (partial / "int4").symlink_to(victim)
    store = ResultStore(partial, {"code": "x"}, [])
    with pytest.raises(KVQuantError, match="is a symlink"):
        store.get_or_compute("int4", "ppl/x", {"a": 1}, lambda: {"nll": [1.0]})
    assert not any(victim.iterdir())


def test_symlinks_at_report_files_and_error_log_are_replaced_not_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    report = tmp_path / "report"
    report.mkdir()
    for name in ("results.json", "error.log"):
        (report / name).symlink_to(outside)
    write_together(report, {"results.json": "{}"})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log = write_error_log(report)
    assert outside.read_text() == "keep me"
    assert log == report / "error.log" and not log.is_symlink() and "boom" in log.read_text()
    assert not (report / "results.json").is_symlink() and (report / "results.json").read_text() == "{}"


# --- one lock holder ------------------------------------------------------------------------------------------


def _contender(directory: str, barrier, holders: str, doubles) -> None:
    barrier.wait()
    try:
        with RunLock(Path(directory)):
            try:
                fd = os.open(holders, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                with doubles.get_lock():
                    doubles.value += 1
                return
            time.sleep(0.002)
            os.close(fd)
            os.unlink(holders)
    except KVQuantError:
        pass


@pytest.mark.slow
def test_lock_race_over_a_stale_lock_has_one_holder_at_a_time(tmp_path):
    """8 processes take over a lock left by a dead process at once, 30 times: never two holders."""
    ctx = multiprocessing.get_context("fork")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    doubles = ctx.Value("i", 0)
    for trial in range(30):
        directory = tmp_path / f"r{trial}"
        directory.mkdir()
        (directory / LOCK).write_text(dead)
        barrier = ctx.Barrier(8)
        procs = [ctx.Process(target=_contender, args=(str(directory), barrier, str(tmp_path / f"h{trial}"), doubles))
                 for _ in range(8)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert all(p.exitcode == 0 for p in procs)
        assert not (directory / LOCK).exists()
    assert doubles.value == 0


def test_a_held_lock_refuses_a_second_run_naming_the_holder(tmp_path):
    with RunLock(tmp_path / "r"):
        with pytest.raises(KVQuantError, match=f"in use by another run \\(process {os.getpid()}"):
            RunLock(tmp_path / "r").__enter__()


def test_a_symlink_at_the_lock_is_refused(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / LOCK).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(KVQuantError, match="symlink"):
        RunLock(tmp_path / "r").__enter__()
    assert not (tmp_path / "elsewhere").exists()


# --- partial results and set-aside files ----------------------------------------------------------------------


def test_an_edited_partial_result_is_recomputed_and_set_aside_files_are_kept(tmp_path):
    warnings = []
    store = ResultStore(tmp_path / "partial", {"code": "v1"}, warnings)
    compute = lambda: {"nll": [2.0, 3.0], "tokens": [4, 4]}  # noqa: E731
    assert store.get_or_compute("int4", "ppl/x", {"k": 1}, compute) == compute()
    path = tmp_path / "partial" / "int4" / "ppl__x.json"
    saved = json.loads(path.read_text())
    assert store.get_or_compute("int4", "ppl/x", {"k": 1}, pytest.fail) == compute()  # reused: it verifies
    for edit in [0.1, 0.2]:  # an edit keeping the key, twice
        saved["result"]["nll"][0] = edit
        path.write_text(json.dumps(saved))
        assert store.get_or_compute("int4", "ppl/x", {"k": 1}, compute) == compute()
        assert "signature does not verify" in warnings[-1]
    asides = sorted(p.name for p in path.parent.iterdir() if ".corrupt" in p.name)
    assert asides == ["ppl__x.json.corrupt", "ppl__x.json.corrupt.1"]
    assert [json.loads((path.parent / a).read_text())["result"]["nll"][0] for a in asides] == [0.1, 0.2]


def test_set_aside_never_overwrites_and_moves_a_symlink_itself(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("keep")
    (tmp_path / "a.json.corrupt").write_text("first")
    (tmp_path / "a.json").symlink_to(outside)
    aside = set_aside(tmp_path / "a.json")
    assert aside.name == "a.json.corrupt.1" and aside.is_symlink()
    assert (tmp_path / "a.json.corrupt").read_text() == "first" and outside.read_text() == "keep"


# --- whole runs: SIGTERM, leftovers ---------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_unwinds_like_ctrl_c_and_a_rerun_removes_what_it_does_not_regenerate(tmp_path):
    config = write_config(tmp_path)
    report = tmp_path / "reports" / "tiny"
    proc = subprocess.Popen([sys.executable, "-m", "kvquant.run", str(config)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **OFFLINE})
    deadline = time.time() + 300
    while not list(report.glob("partial/*/*.json")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)  # a finished result is kept (and the report folder with it); on a loaded machine this
    proc.send_signal(signal.SIGTERM)  # took longer than the 1 s the test waited before
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "kvquant: terminated (SIGTERM)" in err and "run the same command to resume" in err
    assert not (report / LOCK).exists()
    for stale in ("stages.png", "searched.yaml", "error.log", "probe.png"):
        (report / stale).write_text("an earlier run's")
    (report / "notes.txt").write_text("mine")
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    done = run_cli([str(config)], env={"TMPDIR": str(own_tmp)})
    assert done.returncode in (0, 1, 4), done.stderr[-2000:]
    left = {p.name for p in report.iterdir()}
    assert left == {"partial", "windows", "notes.txt", "results.json", "results.csv", "report.md", "plot.png",
                    "config.resolved.yaml"}  # windows/: the passes' finished groups of windows, kept beside partial/
    assert not list(own_tmp.iterdir()), "the run left its task folder behind"


# --- every other way a task file reaches lm-eval -------------------------------------------------------------


def _shared_evil(tmp_path: Path) -> tuple[Path, Path]:
    """A folder like /tmp (sticky, anyone may add files) holding a task whose !function writes a marker."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    return shared, plant_evil(shared, tmp_path, "evil")


def test_code_execution_a_task_file_named_on_the_lm_eval_command_line_from_a_shared_folder_is_refused(tmp_path):
    """``--tasks /shared/evil.yaml``: lm-eval loads the file and imports what its ``!function`` names from the
    same folder. A file in a folder others can write (or that another user owns) is refused before lm-eval
    starts; it ran before (exit 0)."""
    from kvquant import lm_eval as lm_eval_cli

    shared, marker = _shared_evil(tmp_path)
    model = str(data_dir() / "models/stories260K/hf")
    argv = ["--model", "kvquant", "--model_args", f"pretrained={model}", "--tasks", str(shared / "evil.yaml"),
            "--limit", "1"]
    with pytest.raises(KVQuantError, match=r"--tasks: refusing .*evil.yaml: .*shared is writable by other users"):
        lm_eval_cli.check_arguments(argv)
    assert lm_eval_cli.main(argv) == 2 and not marker.exists()
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    (own / "task.yaml").write_text("task: x\n")
    (own / "task.yaml").chmod(0o600)
    from kvquant.fs import check_trusted
    assert check_trusted(own / "task.yaml", "--tasks") == (own / "task.yaml").resolve()  # a file of one's own
    with pytest.raises(KVQuantError, match="--include_path: refusing"):
        lm_eval_cli.check_arguments([*argv[:5], "tinystories_lastword", "--include_path", str(shared)])


def test_a_group_writable_ancestor_of_another_group_is_refused(tmp_path):
    """Members of that group could rename the task folder away and plant their own between two reads."""
    parent = tmp_path / "group"
    parent.mkdir()
    os.chown(parent, -1, os.getgid() + 1)
    parent.chmod(0o775)
    with pytest.raises(KVQuantError, match=r"refusing .*writable by the users of group"):
        private_dir(parent / "tasks", "$KVQUANT_TASK_DIR")
    parent.chmod(0o1775)  # sticky: members may add entries but not swap ours
    assert private_dir(parent / "tasks", "$KVQUANT_TASK_DIR").is_dir()


@pytest.mark.parametrize("text, needle", [
    ("name: a\ngate: {min_relative_accuracy: 0.97}\ngate: {max_perplexity_ratio: 1000000}\n",
     "key 'gate' appears twice in one mapping (line 3)"),
    ("candidates: [{quantizer: int4, quantizer: int2}]\n", "key 'quantizer' appears twice"),
    ("x: " + "[" * 20000 + "]" * 20000 + "\n", "nested deeper than 64 levels"),
    ("a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefg", "bcdefgh")),
     "expands to more than 1,000,000 values"),
])
def test_configs_with_duplicate_keys_deep_nesting_or_alias_bombs_are_refused_quickly(tmp_path, text, needle):
    """Duplicate keys were last-wins (a second gate: switched the gate off: int2 PASSed); 20,000 levels raised
    RecursionError (exit 3); an alias bomb was expanded into an error message for minutes."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    start = time.monotonic()
    proc = run_cli([str(path)])
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-800:]
    assert time.monotonic() - start < 60


def test_a_fifo_or_a_device_as_the_config_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    proc = run_cli([str(fifo)])
    assert proc.returncode == 2 and "not a regular file" in proc.stderr
    proc = run_cli(["/dev/zero"])
    assert proc.returncode == 2 and "not a regular file" in proc.stderr


def test_the_planner_refuses_an_option_set_twice():
    from kvquant.planner.shapes import parse_setting

    for text in ("int4:group_size=32,group_size=64", "{quantizer: int4, quantizer: int2}"):
        with pytest.raises(KVQuantError, match="twice"):
            parse_setting(text)


def test_a_sigterm_while_an_error_is_being_reported_still_exits_143():
    """The signal can land while run_guarded() prints an error line; it escaped as a raw traceback with exit 1."""
    from kvquant.errors import EXIT_TERMINATED
    from kvquant.exits import Terminated, run_guarded

    class Late(KVQuantError):
        def __str__(self):  # the SIGTERM handler fires while the message is formatted
            raise Terminated()

    def body():
        raise Late("bad input")

    assert run_guarded("kvquant", body) == EXIT_TERMINATED


OWN_TASK = ("task: own\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {docs}}}}}\ntest_split: test\n"
            "output_type: loglikelihood\ndoc_to_target: '{{{{target}}}}'\nmetric_list: [{{metric: acc}}]\n")


@pytest.mark.parametrize("how", ["glob", "include", "symlink-in-own-folder", "config-include-path-list",
                                 "function-by-absolute-path", "function-module-symlinked", "include-through-txt",
                                 "utf16-include", "include-after-a-mebibyte"])
def test_code_execution_every_way_a_task_file_reaches_lm_eval_is_checked(tmp_path, how):
    """Each ran the planted task (exit 0) or crashed (exit 3): a glob on
    --tasks, a task file of one's own that ``include:``s a shared one, a symlink in one's own folder to a shared
    file, and ``include_path`` as a list in an lm-eval --config file."""
    from kvquant import lm_eval as lm_eval_cli

    shared, marker = _shared_evil(tmp_path)
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    model = str(data_dir() / "models/stories260K/hf")
    base = ["--model", "kvquant", "--model_args", f"pretrained={model}", "--limit", "1"]
    if how == "glob":
        argv = [*base, "--include_path", str(own), "--tasks", str(shared / "evi*.yaml")]
    elif how == "include":
        (own / "inc.yaml").write_text(f"include: {shared / 'evil.yaml'}\ntask: inc\n")
        argv = [*base, "--tasks", str(own / "inc.yaml")]
    elif how == "symlink-in-own-folder":
        (own / "t.yaml").symlink_to(shared / "evil.yaml")
        argv = [*base, "--tasks", str(own)]
    elif how == "config-include-path-list":
        (own / "lm.yaml").write_text(yaml.safe_dump({"include_path": [str(shared)], "tasks": ["evil"]}))
        argv = [*base, "--config", str(own / "lm.yaml")]
    else:  # a task file of one's own that reaches shared code another way
        task = OWN_TASK.format(docs=shared / "docs.jsonl")
        text = {"function-by-absolute-path": task + f"process_docs: !function {shared}/evil.process_docs\n",
                "function-module-symlinked": task + "process_docs: !function evil.process_docs\n",
                "include-through-txt": "include: base.txt\ntask: own\n",
                "utf16-include": f"include: {shared / 'evil.yaml'}\ntask: own\n",
                "include-after-a-mebibyte": "task: own\n# " + "a" * (1 << 20) + f"\ninclude: {shared / 'evil.yaml'}\n"}
        if how == "function-module-symlinked":
            (own / "evil.py").symlink_to(shared / "evil.py")
        if how == "include-through-txt":
            (own / "base.txt").write_text(f"include: {shared / 'evil.yaml'}\n")
        (own / "t.yaml").write_bytes(text[how].encode("utf-16" if how == "utf16-include" else "utf-8"))
        argv = [*base, "--tasks", str(own / "t.yaml")]
    with pytest.raises(KVQuantError, match="--include_path must be one folder" if "list" in how else "refusing"):
        lm_eval_cli.check_arguments(argv)
    assert lm_eval_cli.main(argv) == 2 and not marker.exists()


def test_how_long_a_result_took_is_kept_beside_it_and_read_back_when_it_is_reused(tmp_path, monkeypatch):
    """The time prices more documents only: it is noted outside the signature, so a changed time neither breaks a
    result's signature nor is trusted beyond that use."""
    clock = iter([100.0, 112.5])
    monkeypatch.setattr("kvquant.runner.store.time.monotonic", lambda: next(clock))
    store = ResultStore(tmp_path / "partial", {"code": "v1"}, [])
    store.get_or_compute("int4", "task/arc", {"k": 1}, lambda: {"acc": [1.0]})
    assert store.seconds == {("int4", "task/arc"): 12.5}
    path = tmp_path / "partial" / "int4" / "task__arc.json"
    saved = json.loads(path.read_text())
    assert saved["seconds"] == 12.5
    saved["seconds"] = 30
    path.write_text(json.dumps(saved))
    again = ResultStore(tmp_path / "partial", {"code": "v1"}, [])
    assert again.get_or_compute("int4", "task/arc", {"k": 1}, pytest.fail) == {"acc": [1.0]}
    assert again.seconds == {("int4", "task/arc"): 30.0} and again.reused == 1


@pytest.mark.parametrize("make", ["foreign_owner", "world_writable"])
def test_private_dir_creates_nothing_inside_a_folder_others_can_change(tmp_path, make):
    """A refused private folder leaves no trace: ``$KVQUANT_CACHE_DIR`` pointing into another user's folder (or a
    world-writable one) made ``gguf/`` there before refusing it."""
    parent = tmp_path / "theirs"
    parent.mkdir()
    if make == "foreign_owner":
        if os.getuid() != 0:
            pytest.skip("needs root to give a folder to another user")
        os.chown(parent, 4242, -1)
    else:
        parent.chmod(0o777)
    with pytest.raises(KVQuantError, match="refusing .*only you can write"):
        private_dir(parent / "cache" / "gguf", "$KVQUANT_CACHE_DIR")
    assert list(parent.iterdir()) == []
