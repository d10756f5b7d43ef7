"""Few-shot contexts that fit the model: a task asked for N examples whose requests are longer than the model's
context would be cut to it (the examples at the front dropped) while the report still says N-shot, so such a run
is refused, naming the task, the shots, the context needed and the model's.

- ``python -m kvquant.run``: :func:`check_runner_fewshot` builds, before the model loads (the tokenizer only), the
  very requests lm-eval will build (each task's documents and look ranges, its seed, its few-shot draws).
- ``python -m kvquant.lm_eval --model kvquant``: the shots are bounded before the model loads
  (:func:`check_shots_flag`); the kvquant model checks every request's length once they are built, right after the
  model loads and before it scores any (:func:`check_requests`, told the shots by :func:`expect`). Shots a task's
  own YAML sets (``num_fewshot:``, without ``--num_fewshot``) are bounded and told to the model the moment lm-eval
  has read them, after the model loads and before any request is built (:func:`task_files_checked`).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterable

from kvquant.errors import KVQuantError, is_python_int

#: new tokens a generation request asks for where it does not say (as :mod:`kvquant.scoring.lm_eval_model`)
DEFAULT_MAX_GEN = 256
#: ``--num_fewshot`` above this is refused before anything loads (the runner's ``eval.tasks.num_fewshot`` bound)
MAX_SHOTS = 100
_expected: dict[str, int] = {}
#: task -> the shots lm-eval runs it with (its YAML's ``num_fewshot``, or ``--num_fewshot``): :func:`note_tasks`
_task_shots: dict[str, int] = {}


def positions(request_type: str, args: tuple, encode: Callable[[list[str]], list[int]]) -> int:
    """Positions the kvquant model feeds for one request (``args``: lm-eval's ``Instance.args``): context and
    continuation less the last token for a log-likelihood, the context and its new tokens for a generation.
    ``encode``: texts -> their token counts, as the model's ``tok_encode`` counts them."""
    if request_type == "generate_until":
        options = args[1] if len(args) > 1 and isinstance(args[1], dict) else {}
        return encode([args[0]])[0] + int(options.get("max_gen_toks", DEFAULT_MAX_GEN))
    return encode([args[0] + args[1]])[0] - 1


def refusal(key: str, task: str, shots: int, needed: int, context: int, hint: str) -> KVQuantError:
    return KVQuantError(f"{key}: task {task!r} with {shots} few-shot examples needs contexts of up to {needed} "
                        f"tokens, and the model's context is {context}: the examples would be cut off while the "
                        f"results say {shots}-shot; ask for fewer shots{hint}")


def longest(instances: Iterable, encode: Callable[[list[str]], list[int]]) -> int:
    """The most positions any of lm-eval's ``instances`` needs (0 for none)."""
    by_type: dict[str, list] = {}
    for instance in instances:
        by_type.setdefault(instance.request_type, []).append(instance.args)
    most = 0
    for kind, args in by_type.items():
        if kind == "loglikelihood_rolling":
            continue  # cut into windows of the model's length, never cut off
        if kind == "generate_until":
            most = max([most, *(positions(kind, a, encode) for a in args)])
        else:  # one batch through the tokenizer: thousands of choices
            most = max([most, *(n - 1 for n in encode([a[0] + a[1] for a in args]))])
    return most


def counter(tokenizer) -> Callable[[list[str]], list[int]]:
    """Token counts of texts as the kvquant model encodes them (special tokens added)."""
    return lambda texts: [len(ids) for ids in tokenizer(list(texts), add_special_tokens=True, verbose=False).input_ids]


def task_builds(cfg, task: str, size: int) -> list[dict]:
    """The requests the runner has lm-eval build for ``task`` (a task of ``size`` documents): the first ``limit``,
    then each sequential look's range of documents (``kvquant.runner.judging.add_documents``), each with a fresh
    few-shot draw."""
    from kvquant.experiment.gate_config import looks

    limit = cfg.eval.tasks.limit_for(task)
    builds = [{"limit": limit}]
    if limit is None or cfg.gate.max_documents is None or task not in cfg.gated_tasks():
        return builds
    counts = looks(limit, cfg.gate.max_documents)
    for start, stop in zip(counts, counts[1:]):
        if min(stop, size) > start:
            builds.append({"samples": list(range(start, min(stop, size)))})
    return builds


def check_runner_fewshot(cfg, tokenizer: Callable, context: int, folder, documents: int | None = None) -> None:
    """Every task of ``cfg`` with few-shot examples: lm-eval uses them (a task whose own YAML fixes
    ``num_fewshot: 0`` ignores a config's), and every request the run will build fits ``context`` positions. Built
    as lm-eval builds them in :func:`kvquant.scoring.session.run_task` (same documents, seed and draws) with
    ``tokenizer()``
    (called only where a task has examples), before the model loads; ``documents``: the requests of the first
    ``documents`` only (the cost preview builds no others)."""
    from kvquant.scoring.task_setup import lm_eval_task

    shots = {t: cfg.eval.tasks.fewshot_for(t) for t in cfg.eval.tasks.names if cfg.eval.tasks.fewshot_for(t)}
    if not shots:
        return
    encode = counter(tokenizer())
    for task, count in shots.items():
        found = lm_eval_task(task, folder, cfg.eval.tasks.fewshot_sampler)
        if found.get_config("num_fewshot") == 0:
            raise KVQuantError(f"eval.tasks.num_fewshot: task {task!r} fixes num_fewshot: 0 in its own task file, "
                               f"so lm-eval would run it 0-shot while the results say {count}-shot; ask for 0")
        found.set_config(key="num_fewshot", value=count)
        builds = task_builds(cfg, task, len(found.eval_docs))
        for build in builds if documents is None else [{"limit": min(builds[0]["limit"] or documents, documents)}]:
            found.set_fewshot_seed(seed=cfg.eval.seed)
            with contextlib.redirect_stderr(io.StringIO()):  # its progress bar: stderr holds one line on bad input
                found.build_all_requests(**build, rank=0, world_size=1)
            needed = longest(found.instances, encode)
            if needed > context:
                hint = " or raise model.max_length" if cfg.model.max_length and cfg.model.max_length < needed else ""
                raise refusal("eval.tasks.num_fewshot", task, count, needed, context, hint)


def check_shots_flag(value, probes: dict[str, int]) -> None:
    """``--num_fewshot`` (already a whole number >= 0) at most :data:`MAX_SHOTS`, and below the documents of each
    ``passkey_<D>`` task (``probes``: task -> documents asked for), which draws its examples from them."""
    from kvquant.scoring.tasks import PROBE_DOCUMENTS

    shots = int(value)
    if shots > MAX_SHOTS:
        raise KVQuantError(f"--num_fewshot must be at most {MAX_SHOTS}, got {value}: kvquant's bound (as for "
                           "eval.tasks.num_fewshot in a config)")
    for task, documents in probes.items():
        pool = max(documents, PROBE_DOCUMENTS)  # the documents written: lm-eval draws the examples from them
        if shots > pool - 1:
            raise KVQuantError(f"--num_fewshot: task {task!r} draws its {shots} examples from its {pool} documents "
                               "(never the document itself); ask for fewer")


def expect(shots: int | None) -> None:
    """Tell the kvquant models this process builds next that every task runs with ``shots`` examples (lm-eval's
    ``--num_fewshot``; None or 0: zero-shot, nothing to check)."""
    _expected.clear()
    _task_shots.clear()
    if shots:
        _expected["*"] = int(shots)


def expected_shots() -> int:
    """The shots :func:`expect` announced (0: none)."""
    return _expected.get("*", 0)


def check_requests(instances: list, encode: Callable[[list[str]], list[int]], shots: int, context: int) -> None:
    """Before any is scored: no task with examples (``shots``, or the task's own as lm-eval read them:
    :func:`note_tasks`) may have a request needing more than ``context`` positions."""
    tasks: dict[str, list] = {}
    for instance in instances:
        tasks.setdefault(instance.task_name, []).append(instance)
    for task, mine in tasks.items():
        count = _task_shots.get(task, shots)
        if count and (needed := longest(mine, encode)) > context:
            flag = "*" in _expected
            raise refusal("--num_fewshot" if flag else "num_fewshot (its task file's)", task, count, needed, context,
                          " or a model with a longer context" if flag else
                          " (set num_fewshot in its task file, or pass --num_fewshot) or a model with a longer context")


def note_tasks(tasks: dict) -> None:
    """lm-eval's tasks (``{name: Task}``) with the shots it will run each with: each at most :data:`MAX_SHOTS` (a
    task file's ``num_fewshot:`` bounded as ``--num_fewshot`` is), remembered for :func:`check_requests`."""
    for name, task in tasks.items():
        count = task.get_config("num_fewshot") if hasattr(task, "get_config") else None
        name = str(getattr(getattr(task, "config", None), "task", None) or name)
        if count is None:
            continue
        if not (is_python_int(count) and 0 <= count <= MAX_SHOTS):
            raise KVQuantError(f"task {name!r}: its task file sets num_fewshot: {count!r:.40}; kvquant's bound is a "
                               f"whole number in 0..{MAX_SHOTS} (as for --num_fewshot): set a smaller one there")
        _task_shots[name] = count


@contextlib.contextmanager
def task_files_checked():
    """While lm-eval runs in this process (``kvquant.lm_eval``): the tasks it hands its ``evaluate`` (the model
    loaded, the shots of every task settled from its YAML and ``--num_fewshot``, no request built yet) go through
    :func:`note_tasks` first."""
    import lm_eval.evaluator as evaluator

    original = evaluator.evaluate

    def evaluate(*args, **kwargs):
        task_dict = kwargs["task_dict"] if "task_dict" in kwargs else args[1] if len(args) > 1 else None
        note_tasks(task_dict.get("tasks", {}) if isinstance(task_dict, dict) else {})
        return original(*args, **kwargs)

    evaluator.evaluate = evaluate
    try:
        yield
    finally:
        evaluator.evaluate = original
