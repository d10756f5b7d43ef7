"""lm-eval's command line with the ``kvquant`` model registered and the offline tasks on the include path.

    python -m kvquant.lm_eval --model kvquant \\
        --model_args pretrained=../shared/data/models/stories260K/hf,quantizer=int4,residual_length=0 \\
        --tasks tinystories_lastword,lambada_openai_local --limit 100

lm-eval's own ``lm_eval`` command does not discover models from other packages; this one accepts all of its
flags. Offline copies of the data directory's tasks are named ``<task>_local``.

Before lm-eval starts, the task names and (for ``--model kvquant``) the model arguments are checked the way
``kvquant.run`` checks a config: a bad one is one line and exit 2, with no model loaded; so is whatever lm-eval
itself refuses before it hands its model the first request (an unknown task, ``--samples``, a model id it cannot
load, ``--fewshot_as_multiturn`` without a chat template, a hub task offline), its log lines held back until then so
the refusal is the one line. Exit codes as
``kvquant.run``: 0 done, 2 bad input, 3 internal error (traceback in a log file), 130 interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import glob
import inspect
import math
import os
import sys
from pathlib import Path

from kvquant.compat.lm_eval import int_or_none_list, parser_actions, quiet_git, run_parser
from kvquant.experiment.binding import build
from kvquant.experiment.config import MAX_SEED, Candidate, EvalConfig
from kvquant.experiment.model_config import ModelConfig, check_device
from kvquant.yaml_reader import load_yaml, read_text_file
from kvquant.scoring import fewshot
from kvquant.scoring import parallel
from kvquant.errors import EXIT_PASS, ConfigError, KVQuantError, one_line
from kvquant.exits import run_guarded
from kvquant.fs import check_env_dirs, check_trusted
from kvquant.importpath import drop_working_dir
from kvquant.scoring.lm_eval_model import batch_rows, parse_value, whole_number
from kvquant.scoring.models import (DEFAULT_MAX_LENGTH, check_device_present, check_model, load_tokenizer,
    resolve_model_path, trained_context)
from kvquant.scoring.tasks import (check_task_data, check_tasks, prepare_probe_tasks, probe_tasks, task_data_digest,
    task_dir)

#: model_args of ``--model kvquant`` that configure the model, by their :class:`ModelConfig` field.
MODEL_ARGS = {"pretrained": "path", "tokenizer": "tokenizer", "gguf_file": "gguf_file", "dtype": "dtype",
              "device": "device", "device_map": "device_map", "max_length": "max_length"}
EVAL_ARGS = ("mode", "chunk_size")
PASS_THROUGH = {"-h", "--help", "ls", "validate"}


def parse_model_args(values: list[str]) -> dict:
    """``pretrained=DIR,quantizer=int4`` (one or more such strings) or one JSON object, as a dict."""
    if len(values) == 1 and values[0].lstrip().startswith("{"):
        parsed = parse_value(values[0])
        if not isinstance(parsed, dict):
            raise KVQuantError(f"--model_args: {values[0]!r} is not a JSON object")
        return parsed
    out = {}
    for item in (i for v in values for i in v.split(",") if i.strip()):
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise KVQuantError(f"--model_args: expected key=value, got {item!r}")
        out[key.strip()] = parse_value(text.strip())
    return out


def _model_spec(args: dict) -> ModelConfig:
    fields = {field: args.pop(arg) for arg, field in MODEL_ARGS.items() if arg in args}
    try:
        return build(ModelConfig, fields, "model_args")
    except ConfigError as err:
        raise KVQuantError(str(err).replace("model_args.path", "model_args.pretrained")) from None


def check_kvquant_args(model_args: dict) -> None:
    """The model arguments of ``--model kvquant`` (model, device, mode, chunk_size, quantizer and its options),
    by the runner's own checks, without loading the model's weights."""
    from kvquant.scoring.lm_eval_model import KVQuantLM, check_sharing
    from kvquant.planner.shapes import check_candidate, shape_from_config

    args = dict(model_args)
    if args.get("pretrained") in (None, ""):
        raise KVQuantError("model_args: pretrained=DIR is required (a model directory, a GGUF's directory with "
                           "gguf_file=F.gguf, or a hub id)")
    spec = _model_spec(args)
    keys = {"path": "model_args.pretrained", **{f: f"model_args.{f}" for f in ("tokenizer", "gguf_file", "device")}}
    model_config = check_model(spec, keys)
    build(EvalConfig, {k: args.pop(k) for k in EVAL_ARGS if k in args}, "model_args")
    check_sharing(args.get("share_prefix", True), args.get("share_out", "documents"), "model_args.")
    quantizer = args.pop("quantizer", "fp16")
    for name in inspect.signature(KVQuantLM.__init__).parameters:  # its own (batch_size, ...), checked by it
        args.pop(name, None)
    candidate = build(Candidate, {"quantizer": quantizer, "options": args, "name": "lm_eval"}, "model_args")
    check_candidate(candidate, shape_from_config(model_config, spec.path), "model_args")


#: flags kvquant checks itself from the raw text (lm-eval's own types would reject with a traceback, or accept
#: values it later fails on)
RAW_FLAGS = ("limit", "num_fewshot", "max_batch_size", "seed")


def _run_parser():
    """lm-eval's own ``run`` parser (so abbreviations, aliases and unknown flags resolve exactly as lm-eval
    resolves them), its errors raised as :class:`KVQuantError`, and the flags of :data:`RAW_FLAGS` kept as text."""
    parser = run_parser()

    def error(message: str):
        raise KVQuantError(message)

    parser.error = error
    for action in parser_actions(parser):
        if action.dest in RAW_FLAGS:
            action.type = None
    return parser


def lm_eval_flags(argv: list[str]) -> dict:
    """The flags lm-eval will run with: its ``--config`` YAML (when given) overridden by the command line, as
    lm-eval's ``EvaluatorConfig.from_cli`` merges them (a flag wins when it is set, or 0)."""
    flags = vars(_run_parser().parse_args(argv[1:] if argv[:1] == ["run"] else argv))
    merged = {}
    if flags.get("config"):
        path = Path(flags["config"])
        loaded = load_yaml(read_text_file(path, "--config"), f"--config: {path}")
        if not isinstance(loaded, dict):
            raise KVQuantError(f"--config: {path} must be a mapping of lm-eval flags, got {type(loaded).__name__}")
        merged.update(loaded)
    merged.update({k: v for k, v in flags.items() if (v or v == 0) and k not in ("command", "func")})
    return merged


def _text(value) -> str:
    return value if isinstance(value, str) else repr(value)


def check_limit(value) -> None:
    """``--limit``: a whole number of documents >= 1, or a fraction of each task in (0, 1)."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and (0 < number < 1 or (number >= 1 and number == int(number)))):
        raise KVQuantError(f"--limit must be a whole number of documents >= 1 or a fraction in (0, 1), "
                           f"got {_text(value)!r}")


def check_seed(value) -> None:
    """``--seed``: one integer or None for all four generators, or 3-4 comma-separated, each in numpy's range."""
    try:
        seeds = (int_or_none_list(3, 4, "0,1234,1234,1234", value) if isinstance(value, str)
                 else list(value) if isinstance(value, list) else [value])
    except ValueError as err:
        raise KVQuantError(f"--seed: {err} (one integer, or 4 comma-separated integers or None)") from None
    for seed in seeds:
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
            raise KVQuantError(f"--seed: each seed must be None or an integer in 0..{MAX_SEED}, got {seed!r}")


def check_output_path(value: str) -> None:
    """``--output_path``: a results directory, or a ``.json`` file in one; lm-eval writes it only after the whole
    evaluation, so a path it cannot create is refused now."""
    path = Path(value)
    folder = path.parent if path.suffix == ".json" else path
    if folder.exists() and not folder.is_dir() and folder == path:
        raise KVQuantError(f"--output_path: {folder} is a file; lm-eval writes a results directory there "
                           "(or name a .json file)")
    for parent in (folder, *folder.parents):
        if parent.exists():
            if not parent.is_dir():
                raise KVQuantError(f"--output_path: {parent} is not a directory")
            return


def check_model_name(name: str | None) -> None:
    import lm_eval.models  # noqa: F401  (fills lm-eval's registry with its built-in models)
    from lm_eval.api.registry import model_registry

    known = sorted(model_registry)
    if name is not None and name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(known)}"
        raise KVQuantError(f"--model: unknown model {name!r}; {hint}")


def check_flags(flags: dict) -> None:
    """The values lm-eval would refuse only once it runs (or accept and misuse), refused before it starts."""
    if not _task_names(flags):
        raise KVQuantError("--tasks is required (comma-separated task names; see `python -m kvquant.lm_eval ls "
                           "tasks`)")
    check_model_name(flags.get("model"))
    if flags.get("limit") is not None:
        check_limit(flags["limit"])
    if flags.get("samples") and flags.get("limit") is not None:
        raise KVQuantError("--samples and --limit cannot be used together: --samples names the documents")
    if flags.get("samples"):
        check_samples(flags["samples"], _task_names(flags))
    if flags.get("num_fewshot") is not None:
        whole_number(flags["num_fewshot"], "--num_fewshot", 0)
    if "batch_size" in flags or flags.get("max_batch_size") is not None:
        batch_rows(flags.get("batch_size", 1), flags.get("max_batch_size"), ("--batch_size", "--max_batch_size"))
    if flags.get("seed") is not None:
        check_seed(flags["seed"])
    if (flags.get("log_samples") or flags.get("predict_only")) and not flags.get("output_path"):
        raise KVQuantError("--log_samples needs --output_path (and so does --predict_only): the samples are "
                           "written there")
    if flags.get("output_path"):
        check_output_path(flags["output_path"])
    if flags.get("device"):
        check_device("--device", flags["device"])


def check_samples(value, tasks: list[str]) -> None:
    """``--samples`` as lm-eval reads it (a mapping, JSON text, or a JSON file's name) maps tasks of ``--tasks`` to
    lists of document indices (whole numbers >= 0)."""
    import json

    samples = value
    if isinstance(value, str):
        try:
            samples = json.loads(value)
        except ValueError:
            if not Path(value).is_file():
                raise KVQuantError(f"--samples: {value!r:.80} is neither JSON nor a file; give "
                                   '\'{"task": [0, 1, 2]}\' or a JSON file holding that') from None
            try:
                samples = json.loads(read_text_file(Path(value), "--samples file"))
            except ValueError as err:
                raise KVQuantError(f"--samples: {value}: not valid JSON ({one_line(err)})") from None
    if not isinstance(samples, dict) or not samples:
        raise KVQuantError(f"--samples must map task names to lists of document indices, got "
                           f"{type(samples).__name__} {str(samples)!r:.80}")
    for task, docs in samples.items():
        if task not in tasks:
            raise KVQuantError(f"--samples: {str(task)!r:.80} is not among --tasks ({', '.join(tasks)})")
        if not isinstance(docs, list) or not docs or \
                not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in docs):
            raise KVQuantError(f"--samples: {task!r} must map to a list of document indices (whole numbers >= 0), "
                               f"got {str(docs)!r:.80}")


def _task_names(flags: dict) -> list[str]:
    tasks = flags.get("tasks") or []
    tasks = tasks.split(",") if isinstance(tasks, str) else tasks
    return [t.strip() for v in tasks for t in str(v).split(",") if t.strip()]


def task_paths(tasks: list[str]) -> list[str]:
    """The ``--tasks`` entries lm-eval reads as files or folders (a path, or a glob it expands), each checked to
    be only yours (:func:`kvquant.fs.check_trusted`); a glob that matches nothing is refused."""
    paths = []
    for task in tasks:
        pathlike = os.sep in task or task.endswith((".yaml", ".yml")) or any(c in task for c in "*?[")
        if not (pathlike or Path(task).exists()):
            continue
        matches = sorted(glob.glob(task)) if any(c in task for c in "*?[") else [task] if Path(task).exists() else []
        if not matches:
            raise KVQuantError(f"--tasks: {task} names no file or folder")
        for match in matches:
            if not (Path(match).is_dir() or Path(match).suffix in (".yaml", ".yml")):
                raise KVQuantError(f"--tasks: {match} is a file but not a task YAML; name a task, a .yaml file or a "
                                   "folder")
            check_trusted(match, "--tasks")
        paths.append(task)
    return paths


def _model_args(flags: dict) -> dict:
    args = flags.get("model_args") or {}
    return parse_model_args([args]) if isinstance(args, str) else dict(args)


#: model arguments lm-eval always hands the model from its own flags (``--batch_size`` defaults to 1, ``--device``
#: to cuda:0, in whose place the kvquant model gets auto: :func:`lm_eval_argv`)
LM_EVAL_FLAGS = ("batch_size", "device")


def _documents(limit) -> int | None:
    """Documents per task that ``--limit`` asks for (None: all, or a fraction)."""
    return int(float(limit)) if limit is not None and float(limit) >= 1 else None


def check_arguments(argv: list[str]) -> Path | None:
    """Every flag lm-eval will read (:func:`check_flags`), the task names (unless a user include path adds
    tasks we cannot see) and their offline data, and the kvquant model's arguments. Returns the folder of task
    files to include (None where the user gave ``--include_path``): for ``passkey_<D>`` tasks, one holding
    their documents cut with the model's tokenizer."""
    check_env_dirs()
    flags = lm_eval_flags(argv)
    check_flags(flags)
    tasks = _task_names(flags)
    paths = task_paths(tasks)
    include = flags.get("include_path")
    if include is not None:
        if not isinstance(include, str):
            raise KVQuantError(f"--include_path must be one folder, got {type(include).__name__} {include!r:.80}")
        check_trusted(include, "--include_path")
    else:
        check_tasks([t for t in tasks if t not in paths], "--tasks", single=False)
        check_task_data(tasks, "--tasks")
    model_args = _model_args(flags) if flags.get("model") == "kvquant" else {}
    if flags.get("num_fewshot") is not None:
        fewshot.check_shots_flag(flags["num_fewshot"], probe_tasks(tasks, lambda _: _documents(flags.get("limit"))))
    if flags.get("model") == "kvquant":
        fewshot.expect(int(flags["num_fewshot"]) if flags.get("num_fewshot") is not None else None)
        for name in LM_EVAL_FLAGS:  # lm-eval passes these itself, so a model_args copy would collide
            if name in model_args:
                raise KVQuantError(f"model_args: {name} is set with lm-eval's own flag: pass --{name} "
                                   f"{model_args[name]} instead")
        if flags.get("device"):
            check_device_present(flags["device"], "--device")
        check_kvquant_args(model_args)
    probes = probe_tasks(tasks, lambda _: _documents(flags.get("limit")))
    if not probes:
        return None if flags.get("include_path") else task_dir()
    if flags.get("include_path") or flags.get("model") != "kvquant":
        raise KVQuantError("--tasks: passkey_<D> documents are cut with the model's tokenizer: run them with "
                           "--model kvquant and without --include_path")
    spec = _model_spec(dict(model_args))
    context = (spec.max_length or trained_context(check_model(dataclasses.replace(spec, device="cpu")))
               or DEFAULT_MAX_LENGTH)
    return prepare_probe_tasks(load_tokenizer(spec), probes, context, "--tasks")


def same_command(flags: dict) -> None:
    """Under several processes (``torchrun -m kvquant.lm_eval --model kvquant``), every process runs the same
    command with the same kvquant version, task data and model files (:func:`kvquant.scoring.parallel.agree`), before
    the
    model loads: ranks of other settings would blend their scores into one result."""
    if flags.get("model") != "kvquant" or parallel.current().world == 1:
        return
    spec = _model_spec(_model_args(flags))
    parts = {"command": parallel.digest(flags), "code": parallel.code_digest(),
             "data": parallel.digest({t: task_data_digest(t) for t in _task_names(flags)}),
             "model files": parallel.files_digest(resolve_model_path(spec))}
    parallel.agree(parallel.current(), parts)


def _evaluate(argv: list[str]) -> int:
    try:
        return _checked_evaluate(argv)
    finally:
        fewshot.expect(None)  # the shots were this command's (its kvquant model has read them)


def lm_eval_argv(argv: list[str], flags: dict, folder: Path | None) -> list[str]:
    """The command line lm-eval runs: ``argv`` with kvquant's folder of task files on the include path (where
    :func:`check_arguments` gave one) and, for ``--model kvquant`` without ``--device``, ``--device auto`` (the GPU
    where there is one, else the CPU, as ``kvquant.run`` does) instead of lm-eval's default cuda:0."""
    if folder is not None:
        argv = [*argv, "--include_path", str(folder)]
    if flags.get("model") == "kvquant" and not flags.get("device"):
        argv = [*argv, "--device", "auto"]
    return argv


def _checked_evaluate(argv: list[str]) -> int:
    if not PASS_THROUGH & set(argv[:1]):
        folder = check_arguments(argv)
        flags = lm_eval_flags(argv)
        same_command(flags)
        argv = lm_eval_argv(argv, flags, folder)
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *argv]
    try:
        # shots a task's own YAML sets: bounded; git asked for lm-eval's record of the commit: silent
        with fewshot.task_files_checked(), until_scoring() as phase, quiet_git():
            try:
                cli_evaluate()
            except Exception as err:
                if phase.scoring or isinstance(err, (KVQuantError, AssertionError)):
                    raise
                raise KVQuantError(f"lm-eval refused its arguments before scoring anything: {type(err).__name__}: "
                                   f"{one_line(err)}{offline_hint(argv)}") from None
    except SystemExit as stop:  # lm-eval's own usage errors and --help
        return stop.code if isinstance(stop.code, int) else 2
    return EXIT_PASS


class _Held:
    """Stands in for ``sys.stderr`` while lm-eval reads its arguments: what it writes is held (its log lines) and
    written out once scoring starts, or dropped where it refuses them, so a refusal is one line."""

    def __init__(self, real):
        self.real, self.held, self.scoring = real, [], False

    def write(self, text: str) -> int:
        if self.scoring:
            return self.real.write(text)
        self.held.append(text)
        return len(text)

    def flush(self) -> None:
        if self.scoring:
            self.real.flush()

    def start(self) -> None:
        self.scoring = True
        self.real.write("".join(self.held))
        self.held.clear()

    def __getattr__(self, name):
        return getattr(self.real, name)


REQUEST_TYPES = ("loglikelihood", "loglikelihood_rolling", "generate_until")


@contextlib.contextmanager
def until_scoring():
    """Marks when lm-eval first hands its model requests (``phase.scoring``): every failure before is its reading of
    the arguments (tasks, samples, the model's id, chat templates), one line and exit 2; after, a failure of the
    evaluation itself. stderr is held until then (:class:`_Held`), and written out when it comes."""
    import lm_eval.evaluator

    phase, evaluate = _Held(sys.stderr), lm_eval.evaluator.evaluate

    def evaluate_marking_scoring(lm, *args, **kwargs):
        for name in REQUEST_TYPES:
            method = getattr(lm, name, None)
            if method is not None:
                setattr(lm, name, functools.partial(_first, phase, method))
        return evaluate(lm, *args, **kwargs)

    sys.stderr, lm_eval.evaluator.evaluate = phase, evaluate_marking_scoring
    try:
        yield phase
    finally:
        if not phase.scoring and not isinstance(sys.exc_info()[1], Exception):  # done, or argparse's usage: shown
            phase.start()
        sys.stderr, lm_eval.evaluator.evaluate = phase.real, evaluate


def _first(phase: _Held, method, *args, **kwargs):
    if not phase.scoring:
        phase.start()
    return method(*args, **kwargs)


def offline_hint(argv: list[str]) -> str:
    """Where lm-eval could not reach the hub for a task the data directory holds: the offline copy's name."""
    from kvquant.scoring.tasks import resolve_task

    local = [f"{t} -> {resolve_task(t)}" for t in _task_names(lm_eval_flags(argv)) if resolve_task(t) != t]
    return f" (the data directory's offline copies: {', '.join(local)})" if local else ""


def main(argv: list[str] | None = None) -> int:
    drop_working_dir()
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_guarded("kvquant", lambda: _evaluate(argv))


if __name__ == "__main__":
    sys.exit(main())
