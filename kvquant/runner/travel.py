"""Partial results that travel (``python -m kvquant.adopt``, docs/trust.md "Results that travel"): the
partial-results folders a user vouches for, read (never written), every result checked against this checkout's code
version and what this config's run would key it with, merged into one set, and placed in the run's own ``partial/``
signed under this user's key. Every check refuses with one :class:`KVQuantError` line before anything is written."""

from __future__ import annotations

import contextvars
import json
import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from kvquant.errors import KVQuantError, one_line
from kvquant.experiment.metric import ACCURACY
from kvquant.fs import read_file
from kvquant.runner.expected import Expected
from kvquant.runner.plausible import problem
from kvquant.runner.lookplan import PLAN, read_plan_file
from kvquant.runner.store import ResultStore, inputs_digest, plan_file, result_name


@dataclass(frozen=True)
class Found:
    """One result read from a folder: where, the (candidate, metric) it is the result of, and what it holds
    (``key``, ``inputs``, ``result``; the signature it came with is under another key, so it is dropped)."""

    path: Path
    candidate: str
    metric: str
    saved: dict
    #: the id of the report folder it was measured in ("": a result from before ids), which its plan carries too
    report: str = ""


#: the command reading the folders and what it does with them, as a refusal names them: ``python -m kvquant.adopt``
#: adopts them, ``python -m kvquant.run --render-only`` renders a report from them (:mod:`kvquant.runner.render`)
ACTION = contextvars.ContextVar("action", default=("adopt", "adopted"))


def refuse(message: str):
    command, done = ACTION.get()
    raise KVQuantError(f"{command}: {message}; nothing {done}")


def _kind(path: str) -> str:
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return "a symlink"
    return "a folder" if stat.S_ISDIR(info.st_mode) else "a file" if stat.S_ISREG(info.st_mode) else "not a file"


def _entries(folder: str) -> list[os.DirEntry]:
    """``folder``'s entries by name, those starting with ``.`` left out (none kvquant writes in ``partial/``)."""
    try:
        with os.scandir(folder) as it:
            return sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as err:
        refuse(f"cannot read {folder} ({err.strerror or err})")


def read_folder(folder: Path) -> list[Found]:
    """Every result in the partial-results folder ``folder`` (``<candidate>/<metric>.json``, as
    :class:`~kvquant.runner.store.ResultStore` writes them), read and never written. Names starting with ``.``
    and files not ending ``.json`` (a set-aside ``*.corrupt``) are passed over; anything else in place of a
    candidate's folder or a result (a file, a symlink, a FIFO) refuses the folder, and so does one holding no
    result. A folder named on the command line is followed where it is a symlink; nothing inside it is."""
    if not folder.is_dir():
        refuse(f"{folder} is not a folder" if folder.exists() else f"{folder} does not exist")
    if (folder / "partial").is_dir() and all(p.name == PLAN for p in (folder / "partial").glob("*.json")):  # a run's
        refuse(f"{folder} is a report folder; name its partial results instead: {folder / 'partial'}")
    found = []
    for entry in _entries(str(folder)):
        if plan_file(entry):  # the plan the results were measured under: read_plan
            continue
        if _kind(entry.path) != "a folder":
            refuse(f"{entry.path} is {_kind(entry.path)}; a partial-results folder holds one folder per candidate "
                   "(<candidate>/<metric>.json), so this is not one")
        for item in _entries(entry.path):
            if not item.name.endswith(".json"):
                continue
            if _kind(item.path) != "a file":
                refuse(f"{item.path} is {_kind(item.path)}, not a result file (adopt reads files only, never "
                       "through a link)")
            found.append(read_result(Path(item.path), entry.name))
    if not found:
        refuse(f"{folder} holds no partial results (<candidate>/<metric>.json); name a run's partial/ folder")
    return found


def read_plan(folder: Path) -> list[tuple[Path, list[dict]]]:
    """The plan history ``folder`` carries (``plan.json``, :mod:`kvquant.runner.lookplan`; its signature another
    machine's, dropped), as ``[(file, history)]``; none where it has no plan file (results of a kvquant before
    plans were recorded)."""
    path = folder / PLAN
    try:
        found = read_plan_file(path)
    except (OSError, ValueError, RecursionError) as err:
        refuse(f"{path} is not a plan kvquant wrote ({one_line(getattr(err, 'strerror', None) or err)[:100]})")
    return [] if found is None else [(path, found[0])]


def check_looks_carried(folder: Path, found: list[Found]) -> None:
    """A result's looks (the judgements it entered, and their errors) are recorded in its folder's ``plan.json``
    alone, so the plan must travel with the results ``found`` in ``folder``: results that carry a report folder's id
    (measured under a recorded plan) are refused without a plan of the same id beside them (none, or another
    folder's, even of the same config); results from before ids are refused without a plan where any is a task
    result (judged in looks as documents are added), and perplexity and divergence results of that age, one look
    each of the windows their key names, travel without one. Refused with one line naming the folder."""
    ids = {f.report for f in found} - {""}
    plan = read_plan_file(folder / PLAN)  # read_plan refused it already where it is not a plan file
    carried = "" if plan is None else plan[2]
    if ids and plan is None:
        refuse(f"{folder} holds results measured under a recorded plan but no {PLAN}: the looks they were judged at "
               "travel in it alone; copy the folder whole, its plan.json with it")
    if ids and ids != {carried}:
        refuse(f"{folder / PLAN} is not the plan its results were measured under (another report folder's); copy the "
               "folder whole, its own plan.json with it")
    task = next((f for f in found if f.metric.startswith("task/")), None)
    if task is not None and plan is None:
        refuse(f"{folder} holds task results ({task.path}) but no {PLAN}: the looks they were judged at travel in it "
               "alone; copy the folder whole, its plan.json with it")


def read_result(path: Path, candidate: str) -> Found:
    """The result at ``path`` in ``candidate``'s folder: a JSON object of ``key``, ``inputs`` and ``result`` whose
    key is the digest of its inputs (not edited since it was written) and whose inputs name it the result of this
    candidate and of the metric its file name says (not copied or renamed)."""
    try:
        saved = json.loads(read_file(path).decode("utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        refuse(f"{path} is not a result kvquant wrote ({one_line(getattr(err, 'strerror', None) or err)[:100]})")
    if not (isinstance(saved, dict) and isinstance(saved.get("key"), str) and isinstance(saved.get("inputs"), dict)
            and isinstance(saved.get("result"), dict)):
        refuse(f"{path} is not a result kvquant wrote (a key, its inputs and a result)")
    inputs = saved["inputs"]
    if saved["key"] != inputs_digest(inputs):
        refuse(f"{path}: its key is not the digest of its inputs, so they were edited after it was written")
    owner = inputs.get("result_of")
    if not (isinstance(owner, list) and len(owner) == 2 and all(isinstance(x, str) for x in owner)
            and owner[0] == candidate and result_name(owner[1]) == path.name):
        refuse(f"{path} is the result of {json.dumps(owner, default=str)[:80]}, not of the candidate and metric its "
               "path names: copied or renamed")
    report = saved.get("report", "")
    return Found(path, candidate, owner[1], {k: saved[k] for k in ("key", "inputs", "result", "seconds") if k in saved},
                 report if isinstance(report, str) else "")


def check_found(found: Found, code: dict, expected: Expected) -> None:
    """``found`` was measured by this checkout's code (:func:`kvquant.experiment.provenance.code_version`) on the inputs
    this config's run would key it with (:class:`~kvquant.runner.expected.Expected`)."""
    theirs = found.saved["inputs"].get("code")
    if theirs != code:
        name = next((k for k in sorted(code) if not isinstance(theirs, dict) or theirs.get(k) != code[k]), "code")
        was = theirs.get(name) if isinstance(theirs, dict) else theirs
        refuse(f"{found.path} was measured by other code ({name} {json.dumps(was, default=str)[:40]}, this "
               f"checkout's {code.get(name)}); a result is reused only by the code that measured it")
    reason = expected.difference(found.candidate, found.metric, found.saved["inputs"])
    if reason:
        refuse(f"{found.path} is no result this config's run would reuse: {reason}")
    kind = found.metric.partition("/")[0]
    why = problem(kind, found.saved["result"], expected.shape(found.candidate, found.metric, found.saved["inputs"]),
                  found.saved.get("seconds"))
    if why:
        refuse(f"{found.path} is no result a run could have written: {why}")


def check_documents(found: list[Found]) -> None:
    """Every task result of the same inputs (task, documents or limit, shots, data) holds as many documents,
    whichever candidate measured it: a run scores the baseline and each candidate on the same documents."""
    seen: dict[str, Found] = {}
    for f in found:
        if f.metric.startswith("task/"):
            inputs = {k: v for k, v in f.saved["inputs"].items() if k not in ("settings", "result_of", "weights")}
            first = seen.setdefault(_text(inputs), f)
            counts = [len(next((r[m] for m in ACCURACY.measures if m in r), ()))
                      for r in (first.saved["result"], f.saved["result"])]
            if counts[0] != counts[1]:
                refuse(f"{first.path} and {f.path} score {counts[0]} and {counts[1]} documents of the same task "
                       "inputs; a run scores every candidate on the same documents")


def merge(found: list[Found]) -> list[Found]:
    """One result per (candidate, metric): copies with the same key and the same result are one; two of other
    keys, or other results of the same key, refuse naming both files."""
    chosen: dict[tuple[str, str], Found] = {}
    for f in found:
        other = chosen.setdefault((f.candidate, f.metric), f)
        if other is f:
            continue
        if other.saved["key"] != f.saved["key"]:
            refuse(f"{other.path} and {f.path} are results of {f.candidate} {f.metric} for other inputs; adopt one "
                   "of them")
        if _text(other.saved["result"]) != _text(f.saved["result"]):
            refuse(f"{other.path} and {f.path} hold different results of the same inputs ({f.candidate} "
                   f"{f.metric}); adopt the one you trust")
    return list(chosen.values())


def _text(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def local_weights(store: ResultStore, code: dict, model) -> set[str]:
    """The weights digests of this user's own results in ``store``'s folder (signed by this user's key) of this
    code and ``model`` (the config's ``model`` section): what this machine's model files hash to."""
    found = set()
    for path in sorted(store.directory.glob("*/*.json")) if store.directory.is_dir() else []:
        saved = store.verified_result(path) if path.is_file() and not path.is_symlink() else None
        inputs = saved["inputs"] if saved else {}
        if inputs.get("code") == code and _text(inputs.get("model")) == _text(asdict(model)) and "weights" in inputs:
            found.add(str(inputs["weights"]))
    return found


def check_weights(found: list[Found], local: set[str], partial: Path) -> None:
    """Every result that names the model's weights names the same (one model measured them all) and, where
    this machine's own results name theirs (``local``), one of those."""
    first: dict[str, Found] = {}
    for f in found:
        if "weights" in f.saved["inputs"]:
            first.setdefault(str(f.saved["inputs"]["weights"]), f)
    if len(first) > 1:
        (a, one), (b, two) = list(first.items())[:2]
        refuse(f"{one.path} and {two.path} were measured on different model weights (digests {a} and {b}); adopt "
               "results of one model")
    for digest, f in first.items():
        if local and digest not in local:
            refuse(f"{f.path} was measured on other model weights (digest {digest}) than this machine's own results "
                   f"in {partial} ({', '.join(sorted(local))}): the two machines' model files differ")


def place(found: list[Found], store: ResultStore) -> tuple[int, int]:
    """Put every result in ``store`` (:meth:`ResultStore.adopt`); returns (placed, kept: already there)."""
    placed = sum(store.adopt(f.candidate, f.metric, f.saved) for f in found)
    return placed, len(found) - placed
