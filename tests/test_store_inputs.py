"""A report folder's partial results and signing key against what is already on disk: partial results kvquant cannot
replace (folders, FIFOs, symlinks, files) are refused before a model loads; stray dotfiles are left alone; a result
copied from another metric is recomputed, and finished results a rerun replaces are kept aside; a signing key others
can read is refused; a failed run leaves a finished report byte-for-byte unchanged and no half report behind."""

import json
import os
import shutil

import pytest

import kvquant.run
import kvquant.runner.pipeline
from kvquant.errors import KVQuantError
from kvquant.runner.store import ResultStore
from refusals import S, fill, run_refused, snapshot


PARTIAL_CASES = [  # what is already under reports/tiny-int8/partial, and what the refusal says
    ("result-is-a-folder", "int8/memory.json/", "int8/memory.json is a folder, not a result kvquant wrote"),
    ("result-is-a-fifo", "int8/ppl__tinystories.json|", "ppl__tinystories.json is not a file"),
    ("candidate-is-a-file", "int8", "partial/int8 is a file"),
    ("candidate-is-a-symlink", "int8@", "partial/int8 is a symlink"),
    ("partial-is-a-file", "", "tiny-int8/partial is not a folder"),
]


@pytest.mark.parametrize("entry, needle", [c[1:] for c in PARTIAL_CASES], ids=[c[0] for c in PARTIAL_CASES])
def test_a_partial_result_kvquant_cannot_replace_is_refused_before_loading(run_yaml, no_model_load, capsys, tmp_path,
                                                                             entry, needle):
    """Was: PermissionError (exit 3) while setting the folder aside, after the model loaded and measured."""
    partial = tmp_path / "reports" / "tiny-int8" / "partial"
    partial.parent.mkdir(parents=True)
    if not entry:
        partial.write_text("x")
    else:
        partial.mkdir()
        target = partial / entry.rstrip("/|@")
        target.parent.mkdir(parents=True, exist_ok=True)
        if entry.endswith("/"):
            target.mkdir()
        elif entry.endswith("|"):
            os.mkfifo(target)
        elif entry.endswith("@"):
            target.symlink_to(tmp_path)
        else:
            target.write_text("x")
    before = sorted(str(p) for p in partial.parent.rglob("*"))
    run_refused(capsys, [run_yaml], needle)
    assert sorted(str(p) for p in partial.parent.rglob("*")) == before


def test_a_partial_result_copied_from_another_metric_is_not_reused(tmp_path, monkeypatch):
    """ppl and kl of one candidate share their inputs: a ppl file copied over the kl file verified (its key and
    signature were the ppl result's) and was read as KL (exit 3). The key names its own candidate and metric."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    warnings: list[str] = []
    store = ResultStore(tmp_path / "partial", {"code": "v1"}, warnings)
    ppl, kl = {"nll": [2.0, 3.0], "tokens": [4, 4]}, {"kl": [0.1, 0.2], "positions": [4, 4]}
    assert store.get_or_compute("int4", "ppl/x", {"k": 1}, lambda: ppl) == ppl
    assert store.get_or_compute("int4", "kl/x", {"k": 1}, lambda: kl) == kl
    folder = tmp_path / "partial" / "int4"
    shutil.copy(folder / "ppl__x.json", folder / "kl__x.json")
    assert store.get_or_compute("int4", "kl/x", {"k": 1}, lambda: kl) == kl  # was: the ppl result
    assert "is the result of int4 ppl/x, copied here" in warnings[-1] and "kl__x.json.corrupt" in warnings[-1]
    assert json.loads((folder / "kl__x.json.corrupt").read_text())["result"] == ppl
    assert store.get_or_compute("int4", "kl/x", {"k": 1}, pytest.fail) == kl  # the recomputed one is reused
    assert store.get_or_compute("int4", "ppl/x", {"k": 1}, pytest.fail) == ppl


def test_a_rerun_keeps_the_results_it_replaces_and_a_copied_result_is_recomputed(run_yaml, capsys, tmp_path):
    """A rerun with other inputs replaced finished partial results without a word; now they are moved to
    ``partial.old-<time>/`` and one warning says how many and where. A ppl result copied over the kl one (same
    inputs) is recomputed with a warning, not an internal error."""
    report = tmp_path / "reports" / "tiny-int8"
    first = kvquant.run.main([str(run_yaml)])
    assert first in (0, 1, 4)
    partial = report / "partial"
    (partial / "int8" / "kl__tinystories.json").write_bytes((partial / "int8" / "ppl__tinystories.json").read_bytes())
    capsys.readouterr()
    assert kvquant.run.main([str(run_yaml)]) == first  # was: exit 3
    err = capsys.readouterr().err
    assert "is the result of int8 ppl/tinystories, copied here" in err and "recomputed" in err
    assert "finished partial result" not in err and not list(report.glob("partial.old-*"))  # nothing else replaced
    assert json.loads((report / "results.json").read_text())["results"]["computed"] == 1
    kept = {p.relative_to(partial): p.read_bytes() for p in partial.glob("*/*.json")}
    assert len(kept) == 5  # ppl of both, kl and memory of int8, memory of the baseline

    assert kvquant.run.main([str(run_yaml), "--set", "eval.batch_size=2"]) == first  # other inputs: all replaced
    err = capsys.readouterr().err
    olds = list(report.glob("partial.old-*"))
    assert len(olds) == 1
    warning = [line for line in err.splitlines() if "finished partial results" in line]
    assert warning == [f"kvquant: warning: 5 finished partial results of other inputs or code (config, data or "
                       f"kvquant version) replaced by this run's; the earlier ones are kept in {olds[0]}"]
    assert {p.relative_to(olds[0]): p.read_bytes() for p in olds[0].glob("*/*.json")} == kept
    doc = json.loads((report / "results.json").read_text())
    assert doc["results"]["computed"] == 5 and warning[0].removeprefix("kvquant: warning: ") in doc["warnings"]


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660], ids=oct)
def test_a_signing_key_others_can_read_is_refused(tmp_path, monkeypatch, mode):
    """A partial-results key that group or others could read was used: whoever read it could sign results (and
    exported reports) as this user."""
    from kvquant import signing
    from kvquant.errors import KVQuantError

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    first = signing.result_key()  # made private (0600) and used as is
    assert signing.result_key() == first
    (tmp_path / "cache" / "keys" / "partial-results.key").chmod(mode)
    with pytest.raises(KVQuantError, match="is not a key only you can read"):
        signing.result_key()


def test_stray_dotfiles_in_partial_are_left_alone_but_kvquant_names_are_still_checked(tmp_path):
    """Was: a ``.DS_Store`` in ``partial/`` refused every rerun ("holds one folder per candidate")."""
    import os

    from kvquant.runner.store import check_partial

    partial = tmp_path / "partial"
    (partial / "int8").mkdir(parents=True)
    (partial / "int8" / "ppl__tinystories.json").write_text("{}")
    (partial / ".DS_Store").write_bytes(b"\0")
    (partial / ".nfs0000123").write_text("x")
    (partial / ".trash").mkdir()
    os.mkfifo(partial / ".fifo")
    (partial / ".link").symlink_to(tmp_path)
    (partial / "int8" / ".ppl__tinystories.json.swp").write_text("x")
    (partial / "int8" / ".editor.json").mkdir()
    check_partial(partial)  # none of them is a name kvquant writes
    (partial / "int8" / "memory.json").mkdir()
    with pytest.raises(KVQuantError, match="int8/memory.json is a folder, not a result kvquant wrote"):
        check_partial(partial)
    (partial / "int8" / "memory.json").rmdir()
    (partial / "int4").symlink_to(tmp_path)
    with pytest.raises(KVQuantError, match="partial/int4 is a symlink"):
        check_partial(partial)


def test_failed_run_does_not_damage_a_finished_report(refusal_env, capsys, monkeypatch, tmp_path):
    """A run that fails (before or after the model loads) leaves a finished report byte-for-byte unchanged,
    and a new report directory is not left behind holding half a report."""
    before = snapshot(refusal_env["finished"])
    assert kvquant.run.main(fill(S("candidates.0.options.group_size=3"), refusal_env)) == 2

    def bad_model(spec):
        raise KVQuantError("cannot load model (simulated)")

    monkeypatch.setattr(kvquant.runner.pipeline, "load_model", bad_model)
    assert kvquant.run.main(fill(["{cfg}"], refusal_env)) == 2  # past preflight, under the lock
    assert snapshot(refusal_env["finished"]) == before
    fresh = S(f"output_dir={tmp_path / 'new'}")
    assert kvquant.run.main(fill(fresh, refusal_env)) == 2
    assert not (tmp_path / "new" / "finished").exists()
    assert "cannot load model (simulated)" in capsys.readouterr().err
