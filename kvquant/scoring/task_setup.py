"""How a run sets up lm-eval's task objects: the few-shot sampler (:func:`use_sampler`), and which tasks give a right
or wrong answer per document, the only ones the runner scores (:func:`check_answer_tasks`, before the model loads).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import yaml

from kvquant.errors import KVQuantError
from kvquant.experiment.long_config import needle_task
from kvquant.scoring.tasks import LASTWORD, OFFLINE_TASKS, probe_length, resolve_task, task_manager


#: while :func:`held_tasks` is held: the task objects built, by (task, folder, sampler)
_HELD: list[dict[tuple[str, str, str], object]] = []


@contextlib.contextmanager
def held_tasks():
    """While held, :func:`lm_eval_task` builds each task's object once (per folder and sampler) and hands every
    caller that one: preflight's checks and the cost preview share it. Each of them sets what its requests depend
    on (shots, few-shot seed, documents) before it builds them, as lm-eval's evaluation does. A run's measurements,
    after it is released, load their own."""
    _HELD.append(_HELD[-1] if _HELD else {})
    try:
        yield
    finally:
        _HELD.pop()


def lm_eval_task(task: str, folder, sampler: str = "default"):
    """The lm-eval task object behind a task name, its files from ``folder``
    (:func:`kvquant.scoring.tasks.task_dir`), drawing its few-shot examples with ``sampler``
    (:func:`use_sampler`); under :func:`held_tasks`, built once."""
    key = (task, str(folder), sampler)
    if _HELD and key in _HELD[-1]:
        return _HELD[-1][key]
    name = resolve_task(task)
    found = use_sampler(task_manager(str(folder), name).load([name])["tasks"][name], sampler)
    if _HELD:
        _HELD[-1][key] = found
    return found


#: How a task's few-shot examples are drawn: ``default``, lm-eval's seeded draw per document; ``first_n``, the
#: first examples of the few-shot pool in front of every document (one prefix, shared: ``docs/lm-eval.md``).
SAMPLERS = ("default", "first_n")


def use_sampler(found, sampler: str):
    """lm-eval task ``found`` (a loaded task object) with its few-shot examples drawn by ``sampler`` (one of
    :data:`SAMPLERS`). With ``first_n`` every document gets the pool's first examples, except that a document
    among them is left out of its own examples: where the pool is the evaluated split itself (an offline task with
    no training split), lm-eval is told so, since it leaves the document out only then."""
    if sampler == "default":
        return found
    from lm_eval.api.samplers import FirstNSampler

    config, few = found.config, found.fewshot_cfg
    own_split = few.split is None and not found.has_training_docs() and not (
        found.has_validation_docs() and found.has_test_docs())
    if own_split and few.split != config.test_split:
        few.split = config.test_split
        few.process_docs = config.process_docs  # the pool is the evaluated documents, prepared alike
    found.sampler = FirstNSampler(list(found.fewshot_docs()), rnd=None)
    return found


#: lm-eval request kinds whose documents each have a right or wrong answer (``acc``: the choice of the highest
#: log-likelihood, or the greedy continuation); others (``loglikelihood_rolling``, ``generate_until``) have none
ANSWERED = ("multiple_choice", "loglikelihood")


class _TagsIgnored(yaml.SafeLoader):
    """Reads a task YAML's keys; ``!function`` and other tags are read as None (the kind of a task needs none)."""


_TagsIgnored.add_multi_constructor("!", lambda loader, suffix, node: None)


def output_type(task: str, folder=None) -> str:
    """The kind of requests lm-eval's ``task`` makes (its YAML's ``output_type``, followed through ``include``;
    lm-eval's default ``generate_until`` where none says), read from its task files without loading its data."""
    entry = task_manager(str(folder) if folder else None).task_index.get(resolve_task(task))
    path, seen = Path(entry.yaml_path) if entry is not None and entry.yaml_path else None, set()
    while path is not None and path not in seen:
        seen.add(path)
        try:
            config = yaml.load(path.read_text(encoding="utf-8"), Loader=_TagsIgnored) or {}
        except (OSError, yaml.YAMLError):
            return "unknown"
        if "output_type" in config:
            return str(config["output_type"])
        include = config.get("include")
        path = path.parent / include if isinstance(include, str) else None
    return "generate_until"


def check_answer_tasks(names: list[str], key: str, flips: bool) -> None:
    """Every task among ``names`` gives each document a right or wrong answer (:data:`ANSWERED`), which the
    runner's accuracy, its paired test and flips (``flips``: ``gate.max_flip_rate`` is set) all count; else one
    line naming the task and what it makes instead. kvquant's own tasks (offline copies, the last-word task,
    probes and needles) do."""
    for name in names:
        if name in OFFLINE_TASKS or name == LASTWORD or probe_length(name) is not None or needle_task(name):
            continue
        kind = output_type(name)
        if kind not in ANSWERED:
            counted = "accuracy and the flips gate.max_flip_rate limits" if flips else "accuracy"
            raise KVQuantError(f"{key}: task {name!r} makes lm-eval {kind!r} requests, which give no right or wrong "
                               f"answer per document, and the runner measures {counted} per document on "
                               f"multiple-choice and log-likelihood tasks only; measure a text's perplexity with "
                               "eval.perplexity instead, or choose a task with answers")
