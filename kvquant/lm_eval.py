"""lm-eval's command line with the ``kvquant`` model registered and the offline tasks on the include path.

    python -m kvquant.lm_eval --model kvquant \\
        --model_args pretrained=../shared/data/models/stories260K/hf,quantizer=int4,residual_length=0 \\
        --tasks tinystories_lastword,lambada_openai_local --limit 100

lm-eval's own ``lm_eval`` command does not discover models from other packages; this one accepts all of its
flags. Offline copies of the data directory's tasks are named ``<task>_local``.

Before lm-eval starts, the task names and (for ``--model kvquant``) the model arguments are checked the way
``kvquant.run`` checks a config: a bad one is one line and exit 2, with no model loaded. Exit codes as
``kvquant.run``: 0 done, 2 bad input, 3 internal error (traceback in a log file), 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import sys
from pathlib import Path

import torch
import yaml

from . import _register_with_lm_eval
from .config import Candidate, ConfigError, EvalConfig, ModelConfig, build, check_device
from .errors import EXIT_PASS, KVQuantError, guarded
from .models import DEFAULT_MAX_LENGTH, check_model, load_tokenizer, trained_context
from .tasks import check_tasks, prepare_probe_tasks, probe_tasks, task_dir

#: model_args of ``--model kvquant`` that configure the model, by their :class:`ModelConfig` field.
MODEL_ARGS = {"pretrained": "path", "tokenizer": "tokenizer", "gguf_file": "gguf_file", "dtype": "dtype",
              "device": "device", "device_map": "device_map", "max_length": "max_length"}
EVAL_ARGS = ("mode", "chunk_size")
PASS_THROUGH = {"-h", "--help", "ls", "validate"}


def _value(text: str):
    """A model_args value as lm-eval and the kvquant model read it: ``None`` -> None, else YAML (``32`` -> 32)."""
    if text in ("None", "none"):
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_model_args(values: list[str]) -> dict:
    """``pretrained=DIR,quantizer=int4`` (one or more such strings) or one JSON object, as a dict."""
    if len(values) == 1 and values[0].lstrip().startswith("{"):
        parsed = _value(values[0])
        if not isinstance(parsed, dict):
            raise KVQuantError(f"--model_args: {values[0]!r} is not a JSON object")
        return parsed
    out = {}
    for item in (i for v in values for i in v.split(",") if i.strip()):
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise KVQuantError(f"--model_args: expected key=value, got {item!r}")
        out[key.strip()] = _value(text.strip())
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
    from .lm_eval_model import KVQuantLM
    from .plan import shape_from_config
    from .run import check_candidate

    args = dict(model_args)
    if args.get("pretrained") in (None, ""):
        raise KVQuantError("model_args: pretrained=DIR is required (a model directory, a GGUF's directory with "
                           "gguf_file=F.gguf, or a hub id)")
    spec = _model_spec(args)
    keys = {"path": "model_args.pretrained", **{f: f"model_args.{f}" for f in ("tokenizer", "gguf_file", "device")}}
    if spec.device.startswith("cuda") and not torch.cuda.is_available():
        spec = dataclasses.replace(spec, device="cpu")  # as the kvquant model does: the CPU where no GPU is
    model_config = check_model(spec, keys)
    build(EvalConfig, {k: args.pop(k) for k in EVAL_ARGS if k in args}, "model_args")
    quantizer = args.pop("quantizer", "fp16")
    for name in inspect.signature(KVQuantLM.__init__).parameters:  # its own (batch_size, ...), checked by it
        args.pop(name, None)
    candidate = build(Candidate, {"quantizer": quantizer, "options": args, "name": "lm_eval"}, "model_args")
    check_candidate(candidate, shape_from_config(model_config, spec.path), "model_args")


def _checked_flags(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model", "-M")
    parser.add_argument("--model_args", "-a", nargs="+")
    parser.add_argument("--tasks", "-t", nargs="+")
    parser.add_argument("--device")
    parser.add_argument("--include_path")
    parser.add_argument("--limit", "-L", nargs="?")
    return parser.parse_known_args(argv)[0]


#: model arguments lm-eval always hands the model from its own flags (``--batch_size`` defaults to 1)
LM_EVAL_FLAGS = ("batch_size",)


def _documents(limit: str | None) -> int | None:
    """Documents per task that ``--limit`` asks for (None: all, a fraction, or not a finite number: lm-eval's to
    judge)."""
    try:
        value = float(limit) if limit is not None else 0.0
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value >= 1 else None


def check(argv: list[str]) -> Path | None:
    """Task names (unless a user include path adds tasks we cannot see) and the kvquant model's arguments.
    Returns the folder of task files to include (None where the user gave ``--include_path``): for
    ``passkey_<D>`` tasks, one holding their documents cut with the model's tokenizer."""
    flags = _checked_flags(argv)
    tasks = [t for v in flags.tasks or [] for t in v.split(",") if t]
    if flags.include_path is None:
        check_tasks([t for t in tasks if not Path(t).exists()], "--tasks", single=False)
    if flags.device:
        check_device("--device", flags.device)
    model_args = parse_model_args(flags.model_args or []) if flags.model == "kvquant" else {}
    if flags.model == "kvquant":
        for name in LM_EVAL_FLAGS:  # lm-eval passes these itself, so a model_args copy would collide
            if name in model_args:
                raise KVQuantError(f"model_args: {name} is set with lm-eval's own flag: pass --{name} "
                                   f"{model_args[name]} instead")
        check_kvquant_args(model_args)
    probes = probe_tasks(tasks, lambda _: _documents(flags.limit))
    if not probes:
        return None if flags.include_path else task_dir()
    if flags.include_path or flags.model != "kvquant":
        raise KVQuantError("--tasks: passkey_<D> documents are cut with the model's tokenizer: run them with "
                           "--model kvquant and without --include_path")
    spec = _model_spec(dict(model_args))
    context = (spec.max_length or trained_context(check_model(dataclasses.replace(spec, device="cpu")))
               or DEFAULT_MAX_LENGTH)
    return prepare_probe_tasks(load_tokenizer(spec), probes, context, "--tasks")


def _evaluate(argv: list[str]) -> int:
    if not PASS_THROUGH & set(argv[:1]):
        folder = check(argv)
        if folder is not None:
            argv = [*argv, "--include_path", str(folder)]
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except SystemExit as stop:  # lm-eval's own usage errors and --help
        return stop.code if isinstance(stop.code, int) else 2
    return EXIT_PASS


def main(argv: list[str] | None = None) -> int:
    _register_with_lm_eval()
    argv = list(sys.argv[1:] if argv is None else argv)
    return guarded("kvquant.lm_eval", lambda: _evaluate(argv))


if __name__ == "__main__":
    sys.exit(main())
