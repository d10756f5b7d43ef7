"""lm-eval asks git for the working folder's commit (``git describe``) when it records its results: run from a folder
that is not a git checkout (an installed kvquant, a scratch folder), git printed ``fatal: not a git repository`` on
kvquant's stderr (issue 58). kvquant runs lm-eval with git's own stderr silenced (kvquant/compat/lm_eval.py)."""

import os
import subprocess
import sys

import pytest

from kvquant.paths import resolve


def run_lm_eval(folder, extra=()):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GIT_CEILING_DIRECTORIES": str(folder.parent)}  # git never looks above the scratch folder
    argv = [sys.executable, "-m", "kvquant.lm_eval", "--model", "kvquant", "--model_args",
            f"pretrained={resolve('local:models/stories260K/hf')}", "--tasks", "tinystories_lastword", "--limit", "2",
            *extra]
    return subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_lm_eval_from_a_folder_outside_git_prints_no_fatal_line(tmp_path):
    folder = tmp_path / "scratch"
    folder.mkdir()
    assert subprocess.run(["git", "rev-parse"], cwd=folder, capture_output=True,
                          env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)}).returncode != 0
    done = run_lm_eval(folder)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tinystories_lastword" in done.stdout  # lm-eval's table: it scored
    assert not [line for line in done.stderr.splitlines() if "fatal:" in line], done.stderr[-2000:]


def scratch_folder(tmp_path, monkeypatch):
    """A folder that is no git checkout, git never looking above it, as the working folder."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.chdir(folder)
    return folder


def test_quiet_git_records_lm_evals_commit_with_gits_stderr_silenced(tmp_path, monkeypatch, capfd):
    """Inside a git checkout the commit lm-eval records is git's own (``git describe --always``, asked here
    directly); outside one it is None, as lm-eval's own gives, and git says nothing on stderr, where lm-eval's own
    let it print ``fatal:``."""
    import lm_eval.evaluator

    from kvquant.compat.lm_eval import quiet_git

    scratch_folder(tmp_path, monkeypatch)
    own = lm_eval.evaluator.get_git_commit_hash
    assert own() is None
    assert "fatal: not a git repository" in capfd.readouterr().err  # lm-eval's own: the stray line
    with quiet_git():
        assert lm_eval.evaluator.get_git_commit_hash() is None
    assert capfd.readouterr().err == ""
    assert lm_eval.evaluator.get_git_commit_hash is own  # put back

    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run([*git, *args], cwd=repo, check=True)
    monkeypatch.chdir(repo)
    expected = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
    with quiet_git():
        assert lm_eval.evaluator.get_git_commit_hash() == expected.stdout.strip() == own()
