"""A report's provenance is the code that measured it (issue 53 item 5): a change of the measuring sources under a
running run stops it with one line before its next signed write (results so far kept, nothing mixed), and the
commit a report records hashes to the sources it records, or the report names the uncommitted files."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import kvquant
from tiny_configs import TINY
from kvquant.paths import data_dir
from kvquant.runner import report
from kvquant.experiment import provenance


# Runs kvquant from a copy of its package: after the first partial result is written, a measuring module is added
# to the copy's kvquant/scoring/ (as a checkout switched under a running process changes its sources).
CHANGE_MID_RUN = """
import pathlib, sys
import kvquant
import kvquant.runner.store as store
added = pathlib.Path(kvquant.__file__).parent / "scoring" / "changed_mid_run.py"
real = store.write_file

def write_then_change(path, content):
    real(path, content)
    if path.suffix == ".json" and path.parent.parent.name == "partial" and not added.exists():
        added.write_text("# a change under the running run\\n")

store.write_file = write_then_change
from kvquant.run import main
sys.exit(main([sys.argv[1]]))
"""


def test_a_source_change_mid_run_stops_it_with_one_line_keeping_what_was_written(tmp_path):
    """Was: the run went on, its later results keyed with the code version hashed at its start, and its report
    naming whatever commit the checkout held at the end (smollm2-decide's c3a8342, whose sources are a726fdf6, not
    the a5b37fae that measured it)."""
    copy = tmp_path / "src"
    shutil.copytree(Path(kvquant.__file__).parent, copy / "kvquant", ignore=shutil.ignore_patterns("__pycache__"))
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.format(out=tmp_path / "reports"))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(copy), "KVQUANT_DATA": str(data_dir()),
           "KVQUANT_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", CHANGE_MID_RUN, str(config)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=600)
    out_dir = tmp_path / "reports" / "tiny"
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert err.splitlines()[-1].startswith("kvquant: error: kvquant's measuring sources changed under this run")
    assert "kvquant/scoring/changed_mid_run.py" in err and "Traceback" not in err
    written = sorted(out_dir.glob("partial/*/*.json"))
    assert len(written) == 1  # the result written before the change is kept; none after it
    saved = json.loads(written[0].read_text())
    assert saved["inputs"]["code"]["kvquant_source_sha256"] in err  # the version it was measured under
    assert not (out_dir / "results.json").exists()


def test_the_recorded_commit_holds_the_recorded_sources(monkeypatch):
    """This checkout's commit is named bare only where its measuring sources are the ones the report records; a
    report whose sources are neither the commit's nor the checkout's says so (was: the bare commit)."""
    env = report.environment()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(kvquant.__file__).parents[1], capture_output=True,
                          text=True).stdout.strip()
    assert env["git_commit"].startswith(head)
    real = provenance.code_version()
    monkeypatch.setattr(provenance, "code_version", lambda: {**real, "kvquant_source_sha256": "0123456789abcdef"})
    other = report.environment()["git_commit"]
    assert other.startswith(head) and "measured with sources 0123456789abcdef" in other and "neither" in other


def git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_uncommitted_measuring_changes_are_named(tmp_path):
    """In a checkout whose measuring file differs from its commit, the report names that file."""
    from kvquant.experiment.provenance import commit_provenance, digest_of, source_files

    package = tmp_path / "repo" / "kvquant"
    (package / "scoring").mkdir(parents=True)
    (package / "scoring" / "score.py").write_text("x = 1\n")
    (package / "run.py").write_text("# orchestrates\n")
    git(package.parent, "init", "-q")
    git(package.parent, "add", ".")
    git(package.parent, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=package, capture_output=True, text=True).stdout.strip()
    assert commit_provenance(digest_of(source_files(package)), package) == commit
    (package / "run.py").write_text("# changed, not measuring\n")
    assert commit_provenance(digest_of(source_files(package)), package) == \
        f"{commit} (with uncommitted changes outside the measuring sources)"
    (package / "scoring" / "score.py").write_text("x = 2\n")
    assert commit_provenance(digest_of(source_files(package)), package) == \
        f"{commit} (with uncommitted changes: kvquant/scoring/score.py)"


def test_the_environment_records_the_installed_tokenizers_and_gguf():
    from importlib import metadata

    env = report.environment()
    assert env["tokenizers"] == metadata.version("tokenizers") and env["gguf"] == metadata.version("gguf")
