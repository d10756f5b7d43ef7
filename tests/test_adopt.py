"""Results that travel (``python -m kvquant.adopt``, docs/trust.md "Results that travel"): partial results signed on
another machine are adopted into a run's own ``partial/`` under this user's key and then reused; folders of several
machines merge; a result the run would not reuse, or a folder that is not a run's partial results, is refused in one
line (exit 2) with nothing written and nothing lost. "Another machine" is another signing key: another
``$KVQUANT_CACHE_DIR``."""

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

import kvquant.run
import kvquant.runner.pipeline
from refusals import error_line
from tiny_configs import tiny_run, tiny_weights
from kvquant.adopt import main
from kvquant.runner.preflight import context_length
from kvquant.experiment import provenance
from kvquant.experiment.config import load_config
from kvquant.runner.expected import ANY, Expected
from kvquant.runner.lookplan import LookPlan, PlanRecord
from kvquant.runner.store import ResultStore, RunLock, inputs_digest
from kvquant.scoring.models import check_model

TASK, PPL = "task/tinystories_lastword", "ppl/tinystories"
#: what a run of the tiny config measures, by value (the shapes of real results, smaller)
RESULTS = {
    ("baseline", TASK): {"task": "tinystories_lastword", "acc": [1.0, 0.0, 1.0, 1.0, 0.0]},
    ("int4", TASK): {"task": "tinystories_lastword", "acc": [1.0, 0.0, 0.0, 1.0, 0.0]},
    ("int4", PPL): {"nll": [93.5, 93.0, 72.9, 58.0], "tokens": [63, 63, 63, 63]},
}
WEIGHTS = tiny_weights()


@pytest.fixture(autouse=True)
def here(tmp_path, monkeypatch):
    """This machine: its own signing key (a private cache of the test's), offline."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "here"))


def write_config(folder: Path, **changes) -> Path:
    """The tiny run's config (reports under ``folder/reports``), with ``changes`` to its sections."""
    folder.mkdir(parents=True, exist_ok=True)
    doc = {**tiny_run("tiny", "int4", 5), "output_dir": str(folder / "reports")}
    for section, values in changes.items():
        doc[section] = {**doc[section], **values} if isinstance(values, dict) else values
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run_key(config: Path, label: str, metric: str, weights: str = WEIGHTS) -> dict:
    """The key ``config``'s run on a model of ``weights`` asks its store for ``(label, metric)`` under."""
    cfg = load_config(config)
    model_config = check_model(cfg.model)
    key = Expected(cfg, model_config, context_length(cfg, model_config)).inputs(label, metric)
    assert ANY not in [v for k, v in key.items() if k != "weights"]
    return {**key, "weights": weights}


def measured(monkeypatch, tmp_path: Path, machine: str, config: Path, results: dict, code: dict | None = None,
             weights: str = WEIGHTS) -> Path:
    """``<tmp>/<machine>/partial``: what ``config``'s run on another machine (its own key) leaves, ``results``:
    ``{(candidate, metric): result}``, measured by ``code`` (default: this checkout's) on ``weights``, with the plan
    they were measured under (``plan.json``, written with the first result, as a run writes it)."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / machine / "cache"))
    store = ResultStore(tmp_path / machine / "partial", code or provenance.code_version(), [])
    PlanRecord(store, LookPlan.of(load_config(str(config), []))).settle()
    for (label, metric), result in results.items():
        store.get_or_compute(label, metric, run_key(config, label, metric, weights), lambda r=result: r)
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "here"))
    return tmp_path / machine / "partial"


def snapshot(folder: Path) -> dict:
    """Every entry under ``folder``: a file's bytes and modification time, a link's target, a folder's name."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            out[str(path.relative_to(folder))] = os.readlink(path)
        elif path.is_file():
            out[str(path.relative_to(folder))] = (path.read_bytes(), os.lstat(path).st_mtime_ns)
        else:
            out[str(path.relative_to(folder))] = "folder"
    return out


def reused(partial: Path, config: Path, wanted: dict) -> None:
    """A store of this machine's key reuses every ``(candidate, metric)`` of ``wanted`` at its value, computing
    nothing."""
    store = ResultStore(partial, provenance.code_version(), [])
    PlanRecord(store, LookPlan.of(load_config(str(config), []))).identify()  # the folder's id, as a run reads it
    for (label, metric), result in wanted.items():
        assert store.get_or_compute(label, metric, run_key(config, label, metric), pytest.fail) == result
    assert (store.reused, store.computed, store.set_aside) == (len(wanted), 0, [])


def refused(capsys, argv: list, needle: str) -> str:
    """``python -m kvquant.adopt argv`` exits 2 with one line holding ``needle``; returns it."""
    capsys.readouterr()
    return error_line(main([str(a) for a in argv]), capsys.readouterr().err, needle)


# --- adopted, then reused -------------------------------------------------------------------------------------


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """This machine's config, and the partial results another machine measured with it (every result of RESULTS)."""
    config = write_config(tmp_path)
    return config, measured(monkeypatch, tmp_path, "other-machine", config, RESULTS)


def test_a_result_signed_on_another_machine_is_adopted_and_then_reused(tmp_path, elsewhere, capsys):
    config, there = elsewhere
    before = snapshot(there)
    partial = tmp_path / "reports" / "tiny" / "partial"
    shutil.copytree(there, partial)  # copied as it is, a result signed elsewhere is set aside and recomputed
    warnings = []
    copied = ResultStore(partial, provenance.code_version(), warnings)
    assert copied.get_or_compute("int4", PPL, run_key(config, "int4", PPL), lambda: "again") == "again"
    assert "signature does not verify" in warnings[0]
    shutil.rmtree(tmp_path / "reports")

    assert main([str(config), str(there)]) == 0
    out = capsys.readouterr().out
    assert f"adopted 3 results from 1 folder into {partial}, signed with your key" in out
    assert f"python -m kvquant.run {config} reuses them" in out
    reused(partial, config, RESULTS)
    signatures = [json.loads((f / "int4" / "ppl__tinystories.json").read_text())["signature"] for f in (there, partial)]
    assert signatures[0] != signatures[1]  # signed again, under this machine's key
    assert snapshot(there) == before  # the folder adopted from is only read
    assert main([str(config), str(there)]) == 0  # again: everything is already here
    again = capsys.readouterr().out
    assert "adopted 0 results from 1 folder" in again and "3 already there, kept" in again
    reused(partial, config, RESULTS)


def test_two_machines_merge_and_an_identical_copy_is_one(tmp_path, monkeypatch, capsys):
    config = write_config(tmp_path)
    first = {k: RESULTS[k] for k in [("baseline", TASK), ("int4", PPL)]}
    second = {k: RESULTS[k] for k in [("int4", TASK), ("int4", PPL)]}  # int4's perplexity measured on both
    a = measured(monkeypatch, tmp_path, "machine-a", config, first)
    b = measured(monkeypatch, tmp_path, "machine-b", config, second)
    assert main([str(config), str(a), str(b)]) == 0
    assert "adopted 3 results from 2 folders" in capsys.readouterr().out
    reused(tmp_path / "reports" / "tiny" / "partial", config, RESULTS)


def test_different_results_of_the_same_inputs_are_refused_naming_both(tmp_path, monkeypatch, capsys):
    config = write_config(tmp_path)
    a = measured(monkeypatch, tmp_path, "machine-a", config, {("int4", PPL): RESULTS["int4", PPL]})
    other = {**RESULTS["int4", PPL], "nll": [1.0] * 4}
    b = measured(monkeypatch, tmp_path, "machine-b", config, {("int4", PPL): other})
    err = refused(capsys, [config, a, b], "hold different results of the same inputs (int4 ppl/tinystories)")
    assert str(a / "int4" / "ppl__tinystories.json") in err and str(b / "int4" / "ppl__tinystories.json") in err
    assert err.startswith("kvquant: error: adopt: ") and err.endswith("; nothing adopted")
    assert not (tmp_path / "reports").exists()


def test_a_local_result_that_verifies_is_kept_and_one_of_other_code_is_retired(tmp_path, monkeypatch, capsys):
    config = write_config(tmp_path)
    partial = tmp_path / "reports" / "tiny" / "partial"
    partial.parent.mkdir(parents=True)
    mine = {"nll": [90.0, 90.0, 70.0, 60.0], "tokens": [63] * 4}
    ResultStore(partial, provenance.code_version(), []).get_or_compute("int4", PPL, run_key(config, "int4", PPL),
                                                                   lambda: mine)
    older = ResultStore(partial, {**provenance.code_version(), "torch": "1.0"}, [])  # a result of other code
    older.get_or_compute("baseline", TASK, run_key(config, "baseline", TASK), lambda: {"acc": [0.0]})
    there = measured(monkeypatch, tmp_path, "other-machine", config, RESULTS)
    assert main([str(config), str(there)]) == 0
    captured = capsys.readouterr()
    assert "adopted 2 results from 1 folder" in captured.out and "1 already there, kept" in captured.out
    assert "1 finished partial result of other inputs or code" in captured.err
    reused(partial, config, {**RESULTS, ("int4", PPL): mine})  # this machine's own measurement stays
    retired = list(tmp_path.glob("reports/tiny/partial.old-*/baseline/task__tinystories_lastword.json"))
    assert [json.loads(p.read_text())["result"] for p in retired] == [{"acc": [0.0]}]


def test_a_dry_run_checks_and_writes_nothing(tmp_path, elsewhere, capsys):
    config, there = elsewhere
    assert main([str(config), str(there), "--dry-run"]) == 0
    assert "3 results from 1 folder can be adopted" in capsys.readouterr().out
    assert not (tmp_path / "reports").exists()


def test_a_run_in_progress_is_not_raced(tmp_path, elsewhere, capsys):
    config, there = elsewhere
    with RunLock(tmp_path / "reports" / "tiny"):
        refused(capsys, [config, there], "is in use by another run")
        assert [p.name for p in (tmp_path / "reports" / "tiny").iterdir()] == [".lock"]


# --- tampered, copied, foreign: refused, nothing written or lost ---------------------------------------------


def edit(saved: dict, how: str) -> dict:
    if how in ("inputs", "inputs-rekeyed"):
        saved["inputs"]["seed"] = 7
    if how == "inputs-rekeyed":  # anyone can compute the digest again
        saved["key"] = inputs_digest(saved["inputs"])
    return saved


def cases(names: str, table: list[tuple[str, str]]):
    """Parametrize over ``(case, needle)`` rows, each test named by its case."""
    return pytest.mark.parametrize(names, table, ids=[case for case, _ in table])


EDITS = [
    ("inputs", "its key is not the digest of its inputs, so they were edited after it was written"),
    ("inputs-rekeyed", "inputs.seed is 7, this config's run would use 1234"),
    ("renamed", 'is the result of ["int4", "ppl/tinystories"], not of the candidate and metric its path names'),
    ("truncated", "is not a result kvquant wrote"),
]


@cases("how, needle", EDITS)
def test_an_edited_or_renamed_result_is_refused(tmp_path, elsewhere, capsys, how, needle):
    config, there = elsewhere
    path = there / "int4" / "ppl__tinystories.json"
    if how == "renamed":
        path.rename(there / "baseline" / path.name)
    elif how == "truncated":
        path.write_text(path.read_text()[:100])
    else:
        path.write_text(json.dumps(edit(json.loads(path.read_text()), how)))
    refused(capsys, [config, there], needle)
    assert not (tmp_path / "reports").exists()


IMPOSSIBLE = [  # (case, the file edited, the edit, what the refusal says); issue 58: each was adopted and signed
    ("accuracy-two", "int4/task__tinystories_lastword.json", lambda r: {**r, "acc": [2.0, 0.0, 0.0, 1.0, 0.0]},
     "holds a document's score other than 0 or 1"),
    ("accuracy-half", "int4/task__tinystories_lastword.json", lambda r: {**r, "acc": [0.5] * 5},
     "holds a document's score other than 0 or 1"),
    ("fewer-documents", "int4/task__tinystories_lastword.json", lambda r: {**r, "acc": [1.0, 0.0, 1.0]},
     "score 5 and 3 documents of the same task inputs"),
    ("fewer-windows", "int4/ppl__tinystories.json", lambda r: {"nll": r["nll"][:2], "tokens": r["tokens"][:2]},
     "its 'nll' has 2 values where its inputs read 4"),
    ("no-tokens", "int4/ppl__tinystories.json", lambda r: {**r, "tokens": [0, 0, 0, 0]},
     "its token counts [0, 0, 0, 0] are not those of the windows it read [63, 63, 63, 63]"),
    ("negative-nll", "int4/ppl__tinystories.json", lambda r: {**r, "nll": [-1.0, 2.0, 3.0, 4.0]},
     "holds a value that is no negative log-likelihood"),
    ("empty", "int4/task__tinystories_lastword.json", lambda r: {}, "it holds neither 'acc' nor 'acc_norm'"),
    ("huge-integer", "int4/ppl__tinystories.json", lambda r: {**r, "extra": 10 ** 400},
     "holds an integer of 401 digits"),
    # adopted, then the run that reused them exited 3
    ("reads-unknown", "int4/ppl__tinystories.json", lambda r: {**r, "reads": {"foo": 1}},
     "its 'reads' are not the four counts a run writes"),
    ("reads-more-quantized", "int4/ppl__tinystories.json", lambda r: {**r, "reads": {
        "keys_quantized": 9, "keys": 8, "values_quantized": 0, "values": 8}}, "quantized <= read"),
    ("lengths-negative", "int4/task__tinystories_lastword.json", lambda r: {**r, "lengths": [-1] * 5},
     "its 'lengths' are not request lengths"),
]


@pytest.mark.parametrize("file, change, needle", [c[1:] for c in IMPOSSIBLE], ids=[c[0] for c in IMPOSSIBLE])
def test_a_result_no_run_could_write_is_refused(tmp_path, elsewhere, capsys, file, change, needle):
    config, there = elsewhere
    path = there / file
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "result": change(saved["result"])}))
    refused(capsys, [config, there], needle)
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("seconds, needle", [(1e308, "its seconds are 1e+308"), (10 ** 400, "its seconds are 1000"),
                                             (-1, "its seconds are -1")])
def test_a_time_no_run_took_is_refused(tmp_path, elsewhere, capsys, seconds, needle):
    config, there = elsewhere
    path = there / "int4" / "ppl__tinystories.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "seconds": seconds}))
    refused(capsys, [config, there], needle)


def test_adoption_cannot_tell_an_edited_result_from_a_measured_one(tmp_path, elsewhere, capsys):
    """The key is a digest of the inputs only, and the signature that covers the result is under the other machine's
    key, which this one does not hold: a result edited with its inputs untouched is adopted as it is. Adopting is
    vouching for the values (docs/trust.md, "Results that travel")."""
    config, there = elsewhere
    path = there / "int4" / "ppl__tinystories.json"
    saved = json.loads(path.read_text())
    saved["result"]["nll"] = [1.0] * 4
    path.write_text(json.dumps(saved))
    assert main([str(config), str(there)]) == 0
    reused(tmp_path / "reports" / "tiny" / "partial", config, {("int4", PPL): saved["result"]})


FOREIGN = [
    ("other-code", "was measured by other code (torch \"0.0\", this checkout's"),
    ("other-seed", "inputs.seed is 7, this config's run would use 1234"),
    ("other-setting", "inputs.settings.group_size is 32, this config's run would use null"),
    ("other-candidate", "this config's run measures no candidate 'int8' (it measures baseline, int4)"),
    ("other-window-length", "inputs.windows is"),
    ("other-task-limit", "inputs.limit is 9, this config's run would use 5"),
    ("a-look-not-taken", "this config's run measures no task/tinystories_lastword@5-10 of int4"),
    ("other-weights-than-mine", "other model weights (digest 0000000000000000) than this machine's own results"),
    ("two-models", "were measured on different model weights"),
]


@cases("case, needle", FOREIGN)
def test_results_of_other_code_or_inputs_are_refused_and_nothing_is_lost(tmp_path, monkeypatch, capsys, case,
                                                                         needle):
    config = write_config(tmp_path)
    partial = tmp_path / "reports" / "tiny" / "partial"
    partial.parent.mkdir(parents=True)
    ResultStore(partial, provenance.code_version(), []).get_or_compute(
        "baseline", TASK, run_key(config, "baseline", TASK), lambda: RESULTS["baseline", TASK])
    theirs = {  # the config of the other machine's run, the results it measured, by what, on which weights
        "other-seed": ({"eval": {"seed": 7}}, None, WEIGHTS),
        "other-setting": ({"candidates": [{"quantizer": "int4", "name": "int4",
                                           "options": {"residual_length": 0, "group_size": 32}}]}, None, WEIGHTS),
        "other-candidate": ({"candidates": [{"quantizer": "int8", "name": "int8"}]}, None, WEIGHTS),
        "other-window-length": ({"eval": {**tiny_run("tiny", "int4", 5)["eval"], "perplexity": [
            {**tiny_run("tiny", "int4", 5)["eval"]["perplexity"][0], "max_length": 32}]}}, None, WEIGHTS),
        "other-task-limit": ({"eval": {**tiny_run("tiny", "int4", 5)["eval"], "tasks": {
            "names": ["tinystories_lastword"], "limit": 9}}}, None, WEIGHTS),
        "other-code": ({}, {**provenance.code_version(), "torch": "0.0"}, WEIGHTS),
        "other-weights-than-mine": ({}, None, "0000000000000000"),
    }
    if case == "two-models":
        measured(monkeypatch, tmp_path, "machine-b", config, {("int4", TASK): RESULTS["int4", TASK]}, weights="1" * 16)
        folders = [measured(monkeypatch, tmp_path, "machine-a", config, {("int4", PPL): RESULTS["int4", PPL]},
                            weights="2" * 16), tmp_path / "machine-b" / "partial"]
    elif case == "a-look-not-taken":
        gated = write_config(tmp_path / "looks", gate={"max_documents": 20})
        folders = [measured(monkeypatch, tmp_path, "machine-a", gated, {("int4", TASK + "@5-10"): {"acc": [1.0]}})]
    else:
        changes, code, weights = theirs[case]
        other = write_config(tmp_path / "theirs", **changes)
        label = "int8" if case == "other-candidate" else "int4"
        metric = TASK if "task" in case or case == "other-candidate" else PPL
        folders = [measured(monkeypatch, tmp_path, "machine-a", other, {(label, metric): RESULTS["int4", metric]},
                            code, weights)]
    before, sources = snapshot(tmp_path / "reports"), [snapshot(f) for f in folders]
    refused(capsys, [config, *folders], needle)
    assert snapshot(tmp_path / "reports") == before and [snapshot(f) for f in folders] == sources
    reused(partial, config, {("baseline", TASK): RESULTS["baseline", TASK]})


NOT_PARTIAL = [
    ("missing", "does not exist"),
    ("a-file", "is not a folder"),
    ("empty", "holds no partial results (<candidate>/<metric>.json)"),
    ("a-report-folder", "is a report folder; name its partial results instead"),
    ("a-file-beside-the-candidates", "notes.txt is a file; a partial-results folder holds one folder per candidate"),
    ("a-symlinked-result", "ppl__tinystories.json is a symlink, not a result file (adopt reads files only"),
    ("a-symlinked-candidate", "int4 is a symlink; a partial-results folder holds one folder per candidate"),
    ("a-folder-as-a-result", "ppl__tinystories.json is a folder, not a result file"),
    ("its-own-partial-folder", "is this run's own partial folder"),
]


@cases("what, needle", NOT_PARTIAL)
def test_what_is_not_a_partial_results_folder_is_refused(tmp_path, elsewhere, capsys, what, needle):
    config, there = elsewhere
    outside = tmp_path / "outside"
    shutil.move(there / "int4", outside)
    (there / "int4").mkdir()
    folder = there
    if what == "missing":
        folder = tmp_path / "nowhere"
    elif what == "a-file":
        folder = outside / "ppl__tinystories.json"
    elif what == "empty":
        folder = tmp_path / "empty"
        folder.mkdir()
    elif what == "a-report-folder":
        folder = there.parent
    elif what == "a-file-beside-the-candidates":
        (there / "notes.txt").write_text("mine")
    elif what == "a-symlinked-result":
        (there / "int4" / "ppl__tinystories.json").symlink_to(outside / "ppl__tinystories.json")
    elif what == "a-symlinked-candidate":
        (there / "int4").rmdir()
        (there / "int4").symlink_to(outside)
    elif what == "a-folder-as-a-result":
        (there / "int4" / "ppl__tinystories.json").mkdir()
    elif what == "its-own-partial-folder":
        folder = tmp_path / "reports" / "tiny" / "partial"
        shutil.copytree(there, folder)
    before = snapshot(tmp_path / "reports") if (tmp_path / "reports").exists() else None
    refused(capsys, [config, folder], needle)
    assert (snapshot(tmp_path / "reports") if (tmp_path / "reports").exists() else None) == before


# --- the keys rebuilt are the keys a run builds --------------------------------------------------------------


class Asked(Exception):
    """A measurement asked its store for its first result."""


class Recording:
    """A result store that records the (candidate, metric, key) a measurement asks for first, and stops it there."""

    def get_or_compute(self, candidate, metric, key, compute):
        self.asked = (candidate, metric, key)
        raise Asked


def first_asked(store: Recording, measure) -> tuple:
    with pytest.raises(Asked):
        measure()
    return store.asked


def asked_by_a_run(cfg, model) -> list[tuple]:
    """What a run of ``cfg`` (its candidates or its stages, its calibration, its search) asks its store for
    first at each step, through the run's own code on ``model``."""
    from kvquant.planner.shapes import parse_bytes, shape_from_config
    from kvquant.runner.search import _label, map_candidate, search
    from kvquant.scoring.calibrate import calibration_documents, calibration_windows
    from kvquant.scoring import data
    from kvquant.scoring.calibrate import CALIBRATIONS, with_calibration, with_layers
    from kvquant.scoring.models import load_tokenizer
    from kvquant.scoring.session import BASELINE, Session, Split, evaluation_split, probe_tokens

    store, tokenizer = Recording(), load_tokenizer(cfg.model)
    shape = shape_from_config(model.config, cfg.model.path)
    session = Session(cfg, model, tokenizer, store, shape)
    rows = {p.name: data.load_rows(p) for p in cfg.eval.perplexity}
    split = evaluation_split(cfg, tokenizer, session.maxlen, rows)
    first, *others = cfg.stages or cfg.candidates
    steps = [lambda: session.measure(BASELINE, split), lambda: session.measure(first, split),  # ppl; kl
             lambda: session.measure(first, split, divergence=False),  # ppl
             lambda: session.measure(first, Split("evaluation", {}, split.documents)),  # the task
             lambda: session.measure(first, Split("evaluation", {}, {}),  # memory
                                     probe=probe_tokens(cfg, split, tokenizer, session.maxlen))]
    if split.long:  # the divergence by position on long documents
        steps.append(lambda: session.measure(first, Split("evaluation", {}, {}, long=split.long)))
    if cfg.stages:
        steps.append(lambda: kvquant.runner.pipeline.serve_stages(session, rows, parse_bytes))
    for c in (c for c in others if c.calibrate):  # measured with options of the shape calibration finds
        layers = {str(i): CALIBRATIONS[c.calibrate].placeholder(shape) for i in range(model.config.num_hidden_layers)}
        steps += [lambda c=c: with_calibration(session, c, rows),
                  lambda c=c, layers=layers: session.measure(with_layers(c, layers), split)]
    if cfg.search:
        rungs = dict.fromkeys(range(model.config.num_hidden_layers), 0)
        mapped = map_candidate(cfg.search.ladder, rungs, _label(rungs))
        windows = {name: ws for name, (_, ws) in calibration_windows(cfg, tokenizer, session.maxlen, rows).items()}
        steps += [lambda: search(session, rows),  # the baseline on the calibration split
                  lambda: session.measure(mapped, Split("calibration", windows, {}), _label(rungs)),
                  lambda: session.measure(mapped, Split("calibration", {}, calibration_documents(cfg)), _label(rungs))]
    return [first_asked(store, step) for step in steps]


def test_the_keys_rebuilt_without_the_model_are_those_a_run_builds(tmp_path, model):
    plain = tiny_run("tiny", "int4", 5)
    searched = {**plain, "candidates": [*plain["candidates"], {"quantizer": "vllm_fp8", "name": "fp8",
                                                               "calibrate": "tensor"},
                                        {"quantizer": "lloyd_max", "name": "offset", "calibrate": "key_offset"},
                                        {"quantizer": "fitted_levels", "name": "levels", "calibrate": "fisher_kmeans"}],
                "eval": {**plain["eval"], "long_context": {"text": "tinystories", "lengths": [32, 64], "documents": 2}},
                "calibration": {"windows": 2}, "search": {"name": "mixed", "windows": 2, "documents": 4, "ladder": [
                    {"quantizer": "int2", "name": "int2"}, {"quantizer": "int8", "name": "int8"}]}}
    staged = {**plain, "candidates": [], "serving": {"requests": 2, "prefix": 16, "suffix": 8, "decode_steps": 2},
              "stages": [{"quantizer": "int8", "name": "int8"},
                         {"quantizer": "int8", "name": "shared", "prefix_sharing": True}]}
    seen = set()
    for name, doc in [("searched", searched), ("staged", staged)]:
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**doc, "output_dir": str(tmp_path)}))
        cfg = load_config(tmp_path / f"{name}.yaml")
        model_config = check_model(cfg.model)
        expected = Expected(cfg, model_config, context_length(cfg, model_config))
        for label, metric, key in asked_by_a_run(cfg, model):
            assert expected.difference(label, metric, key) is None, (label, metric)
            if "seed" in key:  # and a difference is named
                assert "inputs.seed is 7" in expected.difference(label, metric, {**key, "seed": 7})
            seen.add((label.split("-")[0] if label.startswith("search-") else label, metric))
    assert seen == {("baseline", PPL), ("baseline", "serving"),
                    ("int4", PPL), ("int4", "kl/tinystories"), ("int4", TASK), ("int4", "memory"),
                    ("int4", "long/tinystories"),
                    ("int8", PPL), ("int8", "kl/tinystories"), ("int8", TASK), ("int8", "memory"),
                    ("fp8", "calibration"), ("fp8", "kl/tinystories"), ("offset", "calibration"),
                    ("offset", "kl/tinystories"), ("levels", "calibration"), ("levels", "kl/tinystories"),
                    ("search", PPL), ("search", TASK)}


# --- a whole run ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_reuses_what_it_adopted_from_another_machines_run(tmp_path, monkeypatch, capsys):
    there, here = write_config(tmp_path / "there"), write_config(tmp_path / "here")
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "there" / "cache"))
    assert kvquant.run.main([str(there)]) in (0, 1, 4)
    assert "7 results measured, 0 reused" in capsys.readouterr().out
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "here" / "cache"))
    assert main([str(here), str(tmp_path / "there" / "reports" / "tiny" / "partial")]) == 0
    assert "adopted 7 results from 1 folder" in capsys.readouterr().out
    assert kvquant.run.main([str(here)]) in (0, 1, 4)
    assert "0 results measured, 7 reused" in capsys.readouterr().out
    done = [json.loads((tmp_path / side / "reports/tiny/results.json").read_text()) for side in ("there", "here")]
    assert [{k: d[k] for k in ("decision", "baseline", "candidates")} for d in done[:1]] == [
        {k: done[1][k] for k in ("decision", "baseline", "candidates")}]
