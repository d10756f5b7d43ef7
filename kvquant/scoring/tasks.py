"""lm-eval tasks that run offline from the data directory, plus ``tinystories_lastword``.

A config names tasks by lm-eval's own names (``lambada_openai``, ``hellaswag``, ...). Where the data directory
holds a copy of a task's data, :func:`task_manager` writes a small YAML that includes lm-eval's built-in task
and swaps its dataset for the local file, and :func:`resolve_task` maps the name to that offline task; on a
machine without the data the built-in (hub) task is used unchanged.

``tinystories_lastword`` is a task the tiny stories260K model can actually do: predict the last word of a
TinyStories validation story (stories 500-999, held apart from the perplexity stories 0-199), scored like
LAMBADA (accuracy = the whole word is the greedy continuation).

``passkey_<D>`` (e.g. ``passkey_4096``) is the long-range probe of :mod:`kvquant.scoring.passkey`: retrieve a pass key
stated D tokens earlier, scored like LAMBADA. Its documents are cut with the model's own tokenizer, so they are
written per tokenizer (:func:`task_dir` with a tokenizer) before lm-eval's task manager is built.
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import fnmatch
import functools
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from importlib import metadata
from pathlib import Path

import yaml

from kvquant.scoring.data import _json
from kvquant.errors import KVQuantError, one_line
from kvquant.fs import cache_dir, env_dir, private_dir, write_file
from kvquant.paths import data_dir
from kvquant.experiment.long_config import needle_task
from kvquant.scoring.needles import task_documents
from kvquant.scoring.task_rows import row_problem

#: The metric a task is gated on where it is not ``acc``: the one its literature reports (length-normalized
#: accuracy for HellaSwag, PIQA and ARC-Challenge); both are always reported.
GATED_METRIC = {"hellaswag": "acc_norm", "piqa": "acc_norm", "arc_challenge": "acc_norm"}


def gated_metric(task: str) -> str:
    """``acc`` or ``acc_norm``: the metric of ``task`` (a config's task name; ``<task>_local``, the offline copy,
    is gated as its task) that the gate judges."""
    return GATED_METRIC.get(task.removesuffix("_local"), "acc")


def task_data_digest(name: str) -> str | None:
    """A digest of the offline data file ``name`` reads (its ``<task>_local`` copy, or the stories of the last-word
    task), so results are never reused over edited documents; None for a hub task or a probe (whose documents
    kvquant writes from the tokenizer, keyed with the model)."""
    root = data_dir()
    task = name.removesuffix("_local")
    rel = LASTWORD_SOURCE if task == LASTWORD else OFFLINE_TASKS[task][2] if task in OFFLINE_TASKS else None
    if root is None or rel is None or not (root / rel).is_file():
        return None
    path = (root / rel).resolve()
    return _file_digest(str(path), path.stat().st_size, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


#: task -> (built-in YAML under lm_eval/tasks, split name, data file under the data directory, extra keys)
OFFLINE_TASKS = {
    "lambada_openai": ("lambada/lambada_openai.yaml", "test", "tasks/lambada_openai/lambada_test_en.jsonl", {}),
    "hellaswag": ("hellaswag/hellaswag.yaml", "validation", "tasks/hellaswag/hellaswag_val_sample1000.jsonl",
                  {"training_split": None}),
    "arc_easy": ("arc/arc_easy.yaml", "test", "tasks/arc_easy/test.jsonl",
                 {"training_split": None, "validation_split": None}),
    "arc_challenge": ("arc/arc_easy.yaml", "test", "tasks/arc_challenge/test.jsonl",
                      {"training_split": None, "validation_split": None}),
    "piqa": ("piqa/piqa.yaml", "validation", "tasks/piqa/validation.jsonl", {"training_split": None}),
    "boolq": ("super_glue/boolq/default.yaml", "validation", "tasks/boolq/validation.jsonl", {"training_split": None}),
    "winogrande": ("winogrande/default.yaml", "validation", "tasks/winogrande/validation.jsonl",
                   {"training_split": None}),
}
LASTWORD = "tinystories_lastword"
PROBE = re.compile(r"passkey_([0-9]+)")
#: documents per probe distance where the config sets no limit; at least this many are written
PROBE_DOCUMENTS = 50
#: most documents per probe distance
MAX_PROBE_DOCUMENTS = 10_000
LASTWORD_SOURCE = "text/tinystories/validation-first1000.jsonl"
LASTWORD_STORIES = slice(500, 1000)


def _lastword_docs(stories: list[str]) -> list[dict[str, str]]:
    """Context = the story up to its last word; target = ' ' + that word (closing punctuation dropped)."""
    docs = []
    for story in stories:
        text = re.sub(r"[\s.!?\"',;:)]+$", "", story.strip())
        context, _, word = text.rpartition(" ")
        if context and word.isalpha():
            docs.append({"context": context, "target": " " + word})
    return docs


def _write(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text(encoding="utf-8") != content:
        write_file(path, content)


def write_task_dir(directory: Path) -> Path:
    """Write the offline task YAMLs (and the last-word data) for the current data directory into ``directory``."""
    import lm_eval

    builtin = Path(lm_eval.__file__).parent / "tasks"
    root = data_dir()
    stories = _stories(root)
    docs = _lastword_docs(stories[LASTWORD_STORIES])
    data_file = directory / f"{LASTWORD}.jsonl"
    _write(data_file, "".join(json.dumps(d) + "\n" for d in docs))
    lastword = {
        "task": LASTWORD,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test",
        "output_type": "loglikelihood",
        "doc_to_text": "{{context}}",
        "doc_to_target": "{{target}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0, "source": f"TinyStories validation stories {LASTWORD_STORIES.start}-"
                     f"{LASTWORD_STORIES.stop - 1}"},
    }
    _write(directory / f"{LASTWORD}.yaml", yaml.safe_dump(lastword, sort_keys=False))
    if root is not None:
        for task, (include, split, rel, extra) in OFFLINE_TASKS.items():
            if not (root / rel).exists():
                continue
            spec = {"include": str(builtin / include), "task": f"{task}_local", "tag": [], "dataset_path": "json",
                    "dataset_name": None, "dataset_kwargs": {"data_files": {split: str(root / rel)}}, **extra}
            _write(directory / f"{task}_local.yaml", yaml.safe_dump(spec, sort_keys=False))
    return directory


def _stories(root: Path | None) -> list[str]:
    """The TinyStories validation stories: the data directory's copy, read as :func:`_check_rows` reads it (one line
    naming the file for a row that is not a JSON object with a text, or JSON nested too deeply), else the hub's."""
    if root is not None and (root / LASTWORD_SOURCE).exists():
        return [row["text"] for row in _check_rows(LASTWORD, root / LASTWORD_SOURCE)]
    import datasets

    ds = datasets.load_dataset("roneneldan/TinyStories", split=f"validation[:{LASTWORD_STORIES.stop}]")
    return list(ds["text"])


def probe_distance(name: str) -> int | None:
    """D of a ``passkey_<D>`` task name, else None."""
    match = PROBE.fullmatch(name)
    return int(match.group(1)) if match else None


def probe_length(name: str) -> int | None:
    """How far back a probe task's documents make the model read: D of ``passkey_<D>``, the length of
    ``needle_<kind>_<length>`` (:mod:`kvquant.scoring.needles`); None for any other task."""
    found = needle_task(name)
    return found[1] if found else probe_distance(name)


def probe_tasks(names: list[str], limit_for) -> dict[str, int]:
    """``{probe task: documents to write}`` among ``names`` (passkey and needle tasks; ``limit_for(name)``, or
    :data:`PROBE_DOCUMENTS`)."""
    return {n: limit_for(n) or PROBE_DOCUMENTS for n in names if probe_length(n) is not None}


def _needle_spec(name: str, data_file: Path) -> dict:
    """The lm-eval task of a needle task: multiple choice over the document's ``choices`` (each starts with its
    space, so no delimiter is added), ``acc`` = the gold choice has the highest log-likelihood."""
    kind, length = needle_task(name)
    return {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data_file)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{context}}",
            "doc_to_choice": "choices", "doc_to_target": "gold", "target_delimiter": "",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0, "length": length, "kind": kind,
                         "source": "kvquant.scoring.needles: needles in WikiText-2 test filler"}}


def _probe_documents(tokenizer, name: str, count: int) -> list[dict]:
    """The first ``count`` documents of a probe task, each with ``tokens``: its longest request's tokens."""
    if needle_task(name):
        docs = task_documents(tokenizer, name, count)
        for doc in docs:
            doc["tokens"] = doc["context_tokens"] + max(
                len(tokenizer(c, add_special_tokens=False).input_ids) for c in doc["choices"]) + 1
        return docs
    from kvquant.scoring.passkey import probe_documents

    docs = probe_documents(tokenizer, [probe_distance(name)], count)
    for doc in docs:
        doc["tokens"] = (len(tokenizer(doc["context"]).input_ids)
                         + len(tokenizer(doc["target"], add_special_tokens=False).input_ids))
    return docs


def write_probe_tasks(directory: Path, tokenizer, probes: dict[str, int]) -> dict[str, int]:
    """``passkey_<D>.yaml`` and its documents (cut with ``tokenizer``) for each ``{task: documents}``; returns
    ``{task: tokens of its longest requested document, target included}``. A document depends only on (D, its
    index), so a file only ever grows (never below :data:`PROBE_DOCUMENTS`): runs sharing the folder read the same
    first documents, and lm-eval's ``limit`` takes the first ones."""
    longest = {}
    for name, count in probes.items():
        data_file = directory / f"{name}.jsonl"
        try:
            existing = [json.loads(line) for line in data_file.read_text(encoding="utf-8").splitlines()]
        except (OSError, ValueError, RecursionError):  # not what this folder's own writer wrote: written again
            existing = []
        if len(existing) < max(count, PROBE_DOCUMENTS) or not all("tokens" in d for d in existing):
            existing = _probe_documents(tokenizer, name, max(count, PROBE_DOCUMENTS))
            _write(data_file, "".join(json.dumps(d) + "\n" for d in existing))
        longest[name] = max(d["tokens"] for d in existing[:count])
        if needle_task(name):
            _write(directory / f"{name}.yaml", yaml.safe_dump(_needle_spec(name, data_file), sort_keys=False))
            continue
        spec = {
            "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data_file)}},
            "test_split": "test", "output_type": "loglikelihood", "doc_to_text": "{{context}}",
            "doc_to_target": "{{target}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0, "distance": probe_distance(name),
                         "source": "kvquant.scoring.passkey: pass key, WikiText-2 test filler"},
        }
        _write(directory / f"{name}.yaml", yaml.safe_dump(spec, sort_keys=False))
    return longest


def prepare_probe_tasks(tokenizer, probes: dict[str, int], context: int, key: str) -> Path:
    """The task folder of ``tokenizer`` with the ``probes`` written (see :func:`task_dir`), checked: every distance
    fits the model's ``context`` tokens (as the kvquant lm-eval model keeps them: ``context + 1`` with the
    target). Errors name ``key``."""
    for name, count in probes.items():
        if probe_length(name) >= context:  # a document holds at least its distance (length) and the question
            what = "the needle task's length" if needle_task(name) else "the distance"
            raise KVQuantError(f"{key}: {name!r}: the model reads {context} tokens, not more than {what} (its "
                               "documents add a question and an answer)")
        if count > MAX_PROBE_DOCUMENTS:
            raise KVQuantError(f"{key}: {name}: {count} documents asked for; "
                               f"at most {MAX_PROBE_DOCUMENTS} per distance")
    try:
        folder, longest = _task_dir(tokenizer, probes)
    except KVQuantError as err:
        raise KVQuantError(f"{key}: {one_line(err)}") from None
    for name, tokens in longest.items():
        if tokens > context + 1 and needle_task(name):
            raise KVQuantError(f"{key}: {name!r}: its documents take up to {tokens} tokens with their longest answer; "
                               f"the model reads {context}")
        if tokens > context + 1:
            distance = probe_distance(name)
            raise KVQuantError(f"{key}: {name!r}: its documents take up to {tokens} tokens; the model reads {context} "
                               f"(largest distance here: {distance - (tokens - context - 1)})")
    return folder


def _tokenizer_tag(tokenizer) -> str:
    """A short hash of everything that decides how ``tokenizer`` cuts text."""
    text = tokenizer.backend_tokenizer.to_str() if getattr(tokenizer, "is_fast", False) else repr(tokenizer)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def task_dir(tokenizer=None, probes: dict[str, int] | None = None) -> Path:
    """Where the offline task files of this data directory live; with ``probes`` (:func:`probe_tasks`), a folder
    of this tokenizer that also holds those probe tasks. lm-eval executes what these YAMLs name, so they live
    only in a folder no other user can write: ``$KVQUANT_TASK_DIR`` (checked by :func:`kvquant.fs.private_dir`),
    else a fresh folder of this process (``mkdtemp``: mode 0700, an unpredictable name), removed at exit."""
    return _task_dir(tokenizer, probes)[0]


@functools.lru_cache(maxsize=1)
def _process_dir() -> Path:
    directory = Path(tempfile.mkdtemp(prefix="kvquant-tasks-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


#: held by :func:`scratch_tasks`: task files go to this process's own folder, whatever ``$KVQUANT_TASK_DIR`` says
_SCRATCH: list[bool] = []


@contextlib.contextmanager
def scratch_tasks():
    """While held, this process writes its task files (offline copies, probe documents) only to its own folder
    (``mkdtemp``, removed at exit), never to ``$KVQUANT_TASK_DIR``: the cost preview writes nothing that outlives
    it. Released on exit, so a later run in the same process checks ``$KVQUANT_TASK_DIR`` again."""
    _SCRATCH.append(True)
    try:
        yield
    finally:
        _SCRATCH.pop()


def _task_dir(tokenizer, probes: dict[str, int] | None) -> tuple[Path, dict[str, int]]:
    env = None if _SCRATCH else env_dir("KVQUANT_TASK_DIR")
    base = private_dir(env, "$KVQUANT_TASK_DIR") if env is not None else _process_dir()
    root = data_dir()
    tag = re.sub(r"[^A-Za-z0-9]+", "_", str(root)) if root else "hub"
    if probes:
        tag += f"-tok{_tokenizer_tag(tokenizer)}"
    directory = write_task_dir(Path(base) / tag)
    return directory, write_probe_tasks(directory, tokenizer, probes) if probes else {}


def resolve_task(name: str) -> str:
    """The task to run for a config's task name: its offline copy where the data directory has one."""
    root = data_dir()
    if name in OFFLINE_TASKS and root is not None and (root / OFFLINE_TASKS[name][2]).exists():
        return f"{name}_local"
    return name


def task_manager(directory: str | None = None, task: str | None = None):
    """lm-eval's TaskManager with ``directory`` (default: :func:`task_dir`) on its include path; built once per
    process for a folder and the task files in it, so tasks written later are seen. For ``task`` (an lm-eval name,
    :func:`resolve_task`) whose file kvquant wrote in that folder (``<task>.yaml``: an offline copy, a probe, a
    needle task, the last-word task), one that indexes that folder alone: the task it loads is the same (its file
    includes lm-eval's by path), without indexing lm-eval's own ~14,000 task files (~6 s of CPU)."""
    directory = directory or str(task_dir())
    files = tuple(sorted(p.name for p in Path(directory).glob("*.yaml")))
    return _task_manager(directory, files, task is not None and f"{task}.yaml" in files)


@functools.lru_cache(maxsize=4)
def _task_manager(directory: str, files: tuple[str, ...], own: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=directory, include_defaults=not own)


def known_tasks() -> dict[str, list[str]]:
    """``{"tasks": [...], "groups": [...], "tags": [...]}`` that :func:`task_manager` knows, from an index kept
    in kvquant's private cache (keyed by the lm-eval version and the offline task files), so checking a name is
    cheap."""
    directory = task_dir()
    files = sorted(p.name for p in directory.glob("*.yaml"))
    key = f"{metadata.version('lm_eval')}|{'|'.join(files)}"
    index = cache_dir("tasks") / f"task-index-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        saved = json.loads(index.read_text(encoding="utf-8"))
        if saved.get("key") == key:
            return saved["names"]
    except (OSError, ValueError, AttributeError, RecursionError):  # unreadable: listed again
        pass
    manager = task_manager()
    names = {"tasks": sorted(manager.all_subtasks), "groups": sorted(manager.all_groups),
             "tags": sorted(manager.all_tags)}
    _write(index, json.dumps({"key": key, "names": names}))
    return names


def check_tasks(names: list[str], key: str, single: bool = True) -> None:
    """Every name is a task lm-eval knows (``single``: a task, not a group or tag, since the runner scores one
    task at a time); an unknown one is an error with the closest known names."""
    offline = {LASTWORD, *OFFLINE_TASKS, *map(resolve_task, OFFLINE_TASKS)}
    for name in names:
        needle_task(name)  # a needle task's spelling, kind and length (one line if wrong)
        if probe_distance(name) == 0:
            raise KVQuantError(f"{key}: {name!r}: the probe distance must be a positive number of tokens")
        if probe_distance(name) is not None and name != f"passkey_{probe_distance(name)}":
            raise KVQuantError(f"{key}: {name!r}: write passkey_{probe_distance(name)} (a distance without leading "
                               "zeros: one spelling per probe, so none is measured and gated twice)")
    unchecked = [n for n in names if n not in offline and probe_length(n) is None]
    if not unchecked:
        return
    index = known_tasks()
    valid = set(index["tasks"]) | (set() if single else set(index["groups"]) | set(index["tags"]))
    for name in unchecked:
        if name in valid or (not single and any(fnmatch.fnmatchcase(v, name) for v in valid)):
            continue
        if single and name in set(index["groups"]) | set(index["tags"]):
            raise KVQuantError(f"{key}: {name!r} is a group of lm-eval tasks; list its tasks one by one")
        close = difflib.get_close_matches(name, sorted(valid | offline), n=5, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else "see `python -m kvquant.lm_eval ls tasks`"
        raise KVQuantError(f"{key}: unknown task {name!r}; {hint} "
                           f"(offline here: {', '.join(sorted(offline))}, passkey_<D>, needle_<kind>_<length>)")


#: largest offline task data file :func:`check_task_data` reads (the real ones are a few MB)
MAX_TASK_FILE_BYTES = 256 << 20
#: task -> the fields of a row its lm-eval task (or, for tinystories_lastword, :func:`_stories`) reads
TASK_FIELDS = {
    "lambada_openai": ("text",),
    "hellaswag": ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
    "arc_easy": ("question", "choices", "answerKey"),
    "arc_challenge": ("question", "choices", "answerKey"),
    "piqa": ("goal", "sol1", "sol2", "label"),
    "boolq": ("passage", "question", "label"),
    "winogrande": ("sentence", "option1", "option2", "answer"),
    LASTWORD: ("text",),
}
#: the switches that keep ``datasets`` from downloading a hub task, and the values that turn them on
OFFLINE_SWITCHES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
ON = {"1", "ON", "YES", "TRUE"}


def check_task_data(names: list[str], key: str) -> None:
    """The data file of every offline task among ``names`` (a ``<task>_local`` name counts as its task) holds rows
    the task can score: UTF-8 JSON lines, each an object with the fields the task reads, of the types and values
    it needs (:func:`kvquant.scoring.task_rows.row_problem`), a field's type the same on every row (``datasets`` would
    otherwise store it as JSON text). A missing file means the hub task (:func:`resolve_task`), refused where the
    hub is switched off. Other names (hub tasks, ``passkey_<D>``) are not checked here. Errors are one line naming
    ``key``, the task and the file."""
    root = data_dir()
    local = {f"{task}_local": task for task in OFFLINE_TASKS}
    switch = next((v for v in OFFLINE_SWITCHES if os.environ.get(v, "").upper() in ON), None)
    for task in dict.fromkeys(t for t in (local.get(n, n) for n in names) if t in TASK_FIELDS):
        path = root / (LASTWORD_SOURCE if task == LASTWORD else OFFLINE_TASKS[task][2]) if root else None
        try:
            if path is not None and path.exists():
                _check_rows(task, path)
            elif path is not None and switch:
                raise KVQuantError(f"{path} does not exist, and with {switch} set lm-eval cannot download the "
                                   "hub task instead")
        except KVQuantError as err:
            raise KVQuantError(f"{key}: task {task!r}: {one_line(err)}") from None


def _read_task_file(path: Path) -> str:
    """The UTF-8 text of the regular file at ``path`` (symlinks followed), at most :data:`MAX_TASK_FILE_BYTES`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO does not block the open
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_TASK_FILE_BYTES:
            os.close(fd)
            raise KVQuantError(f"{path} is not a regular file" if not stat.S_ISREG(info.st_mode) else
                               f"{path} is larger than {MAX_TASK_FILE_BYTES} bytes; no task data file is that big")
        with os.fdopen(fd, "rb") as f:
            raw = f.read(info.st_size + 1)
    except OSError as err:
        raise KVQuantError(f"{path}: cannot read it ({err.strerror or err})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise KVQuantError(f"{path}: not UTF-8 (line {line}), byte {err.start}; save it as UTF-8") from None


def _check_rows(task: str, path: Path) -> list[dict]:
    """Every row of ``task``'s data file at ``path`` is one it can score, and there are enough of them; the rows."""
    text = _read_task_file(path)
    text = text if task == LASTWORD else text.removeprefix("\ufeff")
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # the line ends pyarrow and Python read
    if lines[-1] == "":
        lines.pop()
    first: dict[str, tuple[type, int]] = {}  # field -> (its type on the first row, that row's line)
    rows = []
    for number, line in enumerate(lines, 1):
        if task != LASTWORD and not line.strip(" \t"):  # pyarrow skips blank lines; _stories does not
            continue
        where = f"{path}, line {number}"
        row = _json(line, where)
        if not isinstance(row, dict):
            raise KVQuantError(f"{where}: not a JSON object (got {type(row).__name__})")
        problem = row_problem(task, row, TASK_FIELDS[task]) or _type_change(row, TASK_FIELDS[task], first, number)
        if problem:
            raise KVQuantError(f"{where}: {problem}")
        rows.append(row)
    if task == LASTWORD:
        _check_stories(path, [row["text"] for row in rows])
    elif not rows:
        raise KVQuantError(f"{path} holds no rows")
    return rows


def _type_change(row: dict, fields: tuple[str, ...], first: dict[str, tuple[type, int]], number: int) -> str | None:
    """Which of ``fields`` has another type on row ``number`` than on the first row (``first`` records it)."""
    for name in fields:
        kind, line = first.setdefault(name, (type(row[name]), number))
        if type(row[name]) is not kind:
            return f"field {name!r} is {type(row[name]).__name__} here but {kind.__name__} on line {line}"
    return None


def _check_stories(path: Path, stories: list[str]) -> None:
    """There are the stories :data:`LASTWORD_STORIES` names, and some of them give a document."""
    start, stop = LASTWORD_STORIES.start, LASTWORD_STORIES.stop
    if len(stories) < stop:
        raise KVQuantError(f"{path} holds {len(stories)} stories; {LASTWORD} reads stories {start}-{stop - 1}, "
                           f"so it needs at least {stop}")
    if not _lastword_docs(stories[LASTWORD_STORIES]):
        raise KVQuantError(f"{path}: none of stories {start}-{stop - 1} ends in a word to predict")
