"""The checks before a model loads: those ``python -m kvquant.run`` and ``python -m kvquant.adopt`` share (the report
directory a run writes into, the longest sequence it feeds, and the run's warnings from them), and the run's own
(:func:`preflight`: the model, every setting on its shapes, the data, the tasks, the processes) with the plan of its
steps (:func:`plan_steps`)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from kvquant.errors import KVQuantError
from kvquant.formats.llamacpp_gguf import check_rope_layout
from kvquant.formats.quantizers import QUANTIZERS, available_quantizers
from kvquant.experiment.config import Candidate, ExperimentConfig
from kvquant.runner.counts import count_warnings
from kvquant.runner.store import check_partial
from kvquant.scoring import parallel
from kvquant.scoring.models import DEFAULT_MAX_LENGTH, trained_context
from kvquant.fs import check_env_dirs
from kvquant.runner.disjoint import check_disjoint
from kvquant.runner.judging import planned_looks
from kvquant.experiment.results import RunPlan
from kvquant.runner.search import check_search
from kvquant.scoring import data, models
from kvquant.scoring.calibrate import CALIBRATIONS, check_calibration
from kvquant.scoring.fewshot import check_runner_fewshot
from kvquant.scoring.models import check_model, load_tokenizer, model_dtype
from kvquant.scoring.session import check_long_documents, probe_counts
from kvquant.scoring.stages import serving_tokens
from kvquant.scoring.task_setup import check_answer_tasks, lm_eval_task
from kvquant.scoring.tasks import check_task_data, check_tasks, prepare_probe_tasks, task_dir


def context_length(cfg: ExperimentConfig, model_config) -> int:
    """Longest sequence the run feeds, before the model loads (as :func:`kvquant.scoring.models.max_length` once it
    has)."""
    return cfg.model.max_length or trained_context(model_config) or DEFAULT_MAX_LENGTH


def check_report_dir(out_dir: Path) -> None:
    """The report directory can be created and written (checked without creating anything); kvquant does not
    write through a symlink at the report directory or its ``partial/``, and what it would read or replace in
    ``partial/`` and ``windows/`` is its own (:func:`kvquant.runner.store.check_partial`)."""
    for path in (out_dir, out_dir / "partial"):
        if path.is_symlink():
            raise KVQuantError(f"output_dir/name: {path} is a symlink; kvquant writes only into directories it can "
                               "trust, so move it away or write elsewhere (--set name=... or --set output_dir=...)")
    existing = next(p for p in [out_dir, *out_dir.parents] if p.exists() or p == Path(p.anchor))
    if not existing.is_dir():
        raise KVQuantError(f"output_dir/name: {existing} exists and is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise KVQuantError(f"output_dir/name: cannot write into {existing}")
    check_partial(out_dir / "partial")
    check_partial(out_dir / "windows")  # the finished groups of windows of interrupted passes, kept alike


def context_warnings(cfg: ExperimentConfig, model_config) -> list[str]:
    """Sequences past the model's trained context, and perplexity windows cut shorter than configured."""
    trained = trained_context(model_config)
    out = []
    if trained and cfg.model.max_length and cfg.model.max_length > trained:
        out.append(f"model.max_length {cfg.model.max_length} is past the model's trained context ({trained} "
                   "positions): scores on longer sequences measure extrapolation, not the model")
    limit = context_length(cfg, model_config)
    out += [f"perplexity set {p.name!r}: max_length {p.max_length} is cut to the model's {limit} tokens"
            for p in cfg.eval.perplexity if p.max_length > limit]
    return out


def preflight_warnings(cfg: ExperimentConfig, model_config, evicting: list[Candidate]) -> list[str]:
    """What preflight warns of, printed once the run is cleared to start (:func:`say`, so that a refusal is one
    line): the model's context against the config's lengths, fewer windows or long documents than a verdict needs
    (:func:`kvquant.runner.counts.count_warnings`), and a chunk wider than an evicting setting's window."""
    warnings = [*context_warnings(cfg, model_config), *count_warnings(cfg)]
    for c in evicting:
        window = c.spec.eviction.window
        if cfg.eval.chunk_size > window:
            warnings.append(f"{c.label}: eval.chunk_size {cfg.eval.chunk_size} is above its window {window}: a "
                            "chunk reads up to chunk_size - 1 tokens beyond the window")
    return warnings


def say(warnings: list[str]) -> None:
    """Print preflight's warnings (process 0 of several)."""
    if parallel.current().is_main_process:
        for message in warnings:
            print(f"kvquant: warning: {message}", file=sys.stderr)


@dataclasses.dataclass(frozen=True)
class AboveRunner:
    """What a run takes from the packages above ``runner/`` on docs/layout.md's floors (the capacity planner and the
    deploy files): the command (``kvquant/run.py``) hands them in, so that nothing in ``runner/`` imports a floor
    above it."""

    shape_of: Callable  #: the model's shapes from its config: :func:`kvquant.planner.shapes.shape_from_config`
    check_candidate: Callable  #: a setting's options on those shapes: :func:`kvquant.planner.shapes.check_candidate`
    parse_bytes: Callable  #: ``80GB`` as bytes: :func:`kvquant.planner.shapes.parse_bytes`
    deploy_beside: Callable  #: the engine's flags beside a report: :func:`kvquant.integrations.deploy.deploy_beside`


def plan_steps(cfg: ExperimentConfig) -> RunPlan:
    """The steps a valid config asks for, in the order the runner takes them."""
    given = [c.label for c in cfg.stages or cfg.candidates]
    return RunPlan(candidates=(*given, *([cfg.search.name] if cfg.search else [])),
                calibrate=tuple(c.label for c in cfg.stages or cfg.candidates if c.calibrate),
                search=cfg.search.name if cfg.search else None, staged=bool(cfg.stages), looks=planned_looks(cfg))


def preflight(cfg: ExperimentConfig, above: AboveRunner,
              priced: int | None = None) -> tuple[RunPlan, dict[str, list[str]], list[str]]:
    """Check everything a run needs before loading anything heavy: the report directory, the model (path, GGUF
    file, tokenizer, device, config), every candidate's quantizer options on the model's shapes (``above``: the
    planner's), every perplexity set's text and every task name (``priced``, for the cost preview: the documents
    per task it prices, whose few-shot contexts and probe documents alone are checked, the probes written nowhere
    but this process's own task folder). Returns the run's plan, the perplexity rows and warnings."""
    check_env_dirs()
    check_report_dir(Path(cfg.output_dir) / cfg.name)
    check_processes(cfg, parallel.current().world)
    model_config = check_model(cfg.model)
    shape = above.shape_of(model_config, cfg.model.path)
    for setting in [*cfg.candidates, *cfg.stages, *(cfg.search.ladder if cfg.search else [])]:
        check_rope_layout(model_config, setting.quantizer, setting.options, f"{setting.label}: options")
    evicting = check_settings(cfg, shape, above.check_candidate)
    for setting in (s for s in [*cfg.candidates, *cfg.stages] if s.calibrate):  # the model's own layers
        CALIBRATIONS[setting.calibrate].check_model(model_config, f"{setting.label}: calibrate")
    context = context_length(cfg, model_config)
    if cfg.serving:
        above.parse_bytes(cfg.serving.memory_budget, "serving.memory_budget")
        need = cfg.serving.prefix + cfg.serving.suffix + cfg.serving.decode_steps
        if need > context:
            raise KVQuantError(f"serving: prefix + suffix + decode_steps = {need} tokens, beyond the model's "
                               f"{context} positions")
    rows = {p.name: data.load_rows(p) for p in cfg.eval.perplexity}
    check_tasks(cfg.eval.tasks.names, "eval.tasks.names")
    check_task_data(cfg.eval.tasks.names, "eval.tasks.names")
    check_answer_tasks(cfg.eval.tasks.names, "eval.tasks.names", cfg.gate.max_flip_rate is not None)
    if cfg.eval.tasks.names:
        task_dir()  # the folder lm-eval will load task files from: private, or refused now
    probes = probe_counts(cfg, priced is not None)
    tokenizer = load_tokenizer(cfg.model) if probes or cfg.search or cfg.serving or cfg.calibration or \
        cfg.eval.long_context else None
    if cfg.eval.long_context:
        check_long_documents(cfg, tokenizer, context, rows)
    if cfg.serving:  # the requests' text is long enough
        serving_text(cfg, tokenizer, rows)
    folder = None
    if probes:  # documents are cut with the model's tokenizer: write and check them now
        folder = prepare_probe_tasks(tokenizer, probes, context, "eval.tasks.names")
    check_fewshot(cfg, folder)
    check_runner_fewshot(cfg, lambda: tokenizer or load_tokenizer(cfg.model), context, folder or task_dir(), priced)
    if any(c.reads_calibration for c in [*cfg.candidates, *cfg.stages]):
        check_calibration(cfg, tokenizer, context, rows)
    if cfg.search:
        for i, rung in enumerate(cfg.search.ladder):
            above.check_candidate(rung, shape, f"search.ladder[{i}] ({rung.label})")
        check_search(cfg, shape, model_dtype(cfg.model), tokenizer, context, rows, folder)
    check_disjoint(cfg, tokenizer, context, rows)
    return plan_steps(cfg), rows, preflight_warnings(cfg, model_config, evicting)


def check_settings(cfg: ExperimentConfig, shape, check_candidate: Callable) -> list[Candidate]:
    """Every candidate's and stage's quantizer options on the model's ``shape`` (a calibrating one with placeholder
    scales; ``check_candidate``: the planner's), no stage offloaded, eviction only in streaming mode; returns the
    settings that evict (the search's ladder included)."""
    checked = []
    for i, candidate in enumerate(cfg.candidates):
        where = f"candidates[{i}] ({candidate.label})"
        checked.append(placeholder_calibration(candidate, shape, where))
        check_candidate(checked[-1], shape, where)
    for i, stage in enumerate(cfg.stages):
        where = f"stages[{i}] ({stage.label})"
        checked.append(placeholder_calibration(stage, shape, where))
        check_candidate(checked[-1], shape, where)
        if stage.offload:
            raise KVQuantError(f"stages[{i}] ({stage.label}): offload is not supported on this device "
                               f"({models.pick_device(cfg.model.device)}), nor yet on a GPU: see docs/staged.md, "
                               "'Offloading'")
    evicting = [c for c in [*checked, *(cfg.search.ladder if cfg.search else [])] if c.spec.eviction is not None]
    if evicting and cfg.eval.mode != "streaming":
        raise KVQuantError(f"{evicting[0].label}: eviction acts between forwards, and simulated mode scores each "
                           "sequence in one forward, which reads every token; set eval.mode: streaming (with a "
                           "chunk_size below the window)")
    return evicting


def placeholder_calibration(candidate: Candidate, shape, where: str) -> Candidate:
    """A candidate that calibrates, with placeholders of the right shape in place of the options calibration will
    find (scales of 1.0, one per KV head for ``head``; a zero key offset; levels: the quantizer's own), so preflight
    checks its quantizer's options; any other candidate as it is. A calibration of the keys after RoPE
    (:attr:`kvquant.scoring.calibrate.Calibration.before_rope` false) is refused beside ``pre_rope``."""
    if not candidate.calibrate:
        return candidate
    calibration = CALIBRATIONS[candidate.calibrate]
    able = [n for n in available_quantizers() if set(calibration.options) <= set(QUANTIZERS.options(n))]
    if candidate.quantizer not in able:
        raise KVQuantError(f"{where}: calibrate: {candidate.quantizer!r} has no {calibration.what} "
                           f"({', '.join(calibration.options)}) to calibrate; these have: {', '.join(able)}")
    clash = [k for k in (*calibration.options, "layers") if k in candidate.options]
    if clash:
        raise KVQuantError(f"{where}: calibrate sets {' and '.join(calibration.options)} per layer; remove "
                           f"options.{clash[0]}")
    if candidate.options.get("pre_rope") is True and not calibration.before_rope:
        raise KVQuantError(f"{where}: calibrate: {candidate.calibrate} observes the keys after RoPE (as an engine's "
                           "cache receives them), and pre_rope stores them before it: what it would fit is not what "
                           "the cache quantizes; drop one")
    refusal = calibration.refusal(candidate)
    if refusal:
        raise KVQuantError(f"{where}: {refusal}")
    return dataclasses.replace(candidate, options={**candidate.options, **calibration.placeholder(shape)})


def check_processes(cfg: ExperimentConfig, world: int) -> None:
    """Several data-parallel processes (``world``) can share this run: one model per process (no device map),
    a GPU each where the model runs on GPUs, and something to score for each in every measurement (when the
    config bounds the windows and documents)."""
    if world == 1:
        return
    if cfg.model.device_map:
        raise KVQuantError(f"model.device_map shards one model over devices, and {world} data-parallel processes "
                           "each load their own; launch one process, or drop model.device_map")
    device = models.pick_device(cfg.model.device)
    here = parallel.env_int("LOCAL_WORLD_SIZE", world, low=1)  # this machine's processes (torchrun sets it)
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    if device.startswith("cuda") and here > gpus:
        raise KVQuantError(f"{here} processes on this machine, each driving one GPU, but it has {gpus}; launch at "
                           f"most {gpus} per machine")
    sizes = [p.limit for p in cfg.eval.perplexity] + [cfg.eval.tasks.limit_for(t) for t in cfg.eval.tasks.names]
    if sizes and all(sizes) and world > max(sizes):
        raise KVQuantError(f"{world} processes, and no measurement has more than {max(sizes)} windows or documents "
                           f"to share out (eval.perplexity[].limit, eval.tasks.limit): launch at most {max(sizes)}")


def check_fewshot(cfg: ExperimentConfig, folder) -> None:
    """Few-shot examples come from the task's own documents (the offline tasks hold one split): a task needs more
    documents than its examples."""
    shots = {t: cfg.eval.tasks.fewshot_for(t) for t in cfg.eval.tasks.names if cfg.eval.tasks.fewshot_for(t)}
    if not shots:
        return
    import datasets

    datasets.disable_progress_bars()  # stderr holds one line on bad input
    for task, count in shots.items():
        found = lm_eval_task(task, folder or task_dir(), cfg.eval.tasks.fewshot_sampler)  # as the run loads it
        pool = found.fewshot_docs()
        own = pool is None or not (found.has_training_docs() or found.has_validation_docs())
        pool = found.eval_docs if pool is None else pool
        if count > len(pool) - own:  # drawn from the evaluation documents: never the document itself
            raise KVQuantError(f"eval.tasks.num_fewshot: {task!r} asks for {count} examples, and its task draws them "
                               f"from {len(pool)} documents; ask for fewer")


def serving_text(cfg: ExperimentConfig, tokenizer, rows: dict):
    """The perplexity set the serving requests are cut from, the shared prefix and each request's tokens."""
    pset = next(p for p in cfg.eval.perplexity if cfg.serving.text in (None, p.name))
    return (pset, *serving_tokens(cfg.serving, tokenizer(pset.separator.join(rows[pset.name])).input_ids))
