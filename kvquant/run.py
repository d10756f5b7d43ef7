"""``python -m kvquant.run configs/int4.yaml``: may I ship this KV-cache quantization for this model?

Measures the fp16 baseline (the identity quantizer, through the same cache code) and every candidate on the
same model, token windows and task documents, with the quantized K/V read by attention; gates the result and
writes ``reports/<name>/``.

Exit code: 0 the gate passes, 1 it fails, 4 it cannot tell yet (inconclusive: more documents would decide), 2 bad
input (config, data, model, device, quantizer options: one line naming the key, file or value), 3 an internal
error (the traceback goes to error.log in the report directory), 130 interrupted. Everything is checked before
the model loads, and nothing is written into the report directory until then. Every finished (candidate,
metric) result is saved at once under a key of its inputs and the code version, so an interrupted run resumes
where it stopped; a lock refuses a second run into the same directory.

Under ``torchrun`` or ``accelerate launch`` the run's processes share out the scoring of every measurement (each
scores its share of the windows and documents through its own quantized cache, and every process gathers all the
scores, so all of them take the same steps); process 0 alone holds the lock and writes partial results and the
report (``docs/parallel.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvquant.scoring import data, models, parallel
from kvquant.runner import preview, render, report
from kvquant.experiment import provenance as provenance_module
from kvquant.scoring.calibrate import calibrated, check_calibration
from kvquant.experiment.config import Candidate, ExperimentConfig, Stage, load_config
from kvquant.experiment.binding import add_set_option
from kvquant.integrations.deploy import deploy_beside
from kvquant.errors import EXIT_FAIL, EXIT_INCONCLUSIVE, EXIT_PASS, KVQuantError, OneLineParser, parse_args
from kvquant.exits import guarded
from kvquant.scoring.fewshot import check_runner_fewshot
from kvquant.importpath import drop_working_dir
from kvquant.fs import check_env_dirs
from kvquant.runner.gate import (ACCURACY, FAIL, INCONCLUSIVE, NOT_EXERCISED, PASS, decide, metric_rows,
    needles_at_chance)
from kvquant.experiment.gate_config import looks
from kvquant.scoring.session import (BASELINE, Session, check_long_documents, evaluation_split, measure, probe_counts,
    probe_tokens, task_size)
from kvquant.scoring.models import check_model, load_model, load_tokenizer, model_dtype
from kvquant.planner.shapes import check_candidate, parse_bytes, shape_from_config
from kvquant.experiment.results import FLIPS, Decision, Provenance, RunPlan, RunResult, Serving, Staged
from kvquant.formats.quantizers import QUANTIZERS, available_quantizers
from kvquant.formats.llamacpp_gguf import check_rope_layout
from kvquant.runner.search import check_search, search
from kvquant.runner.disjoint import check_disjoint
from kvquant.runner.preflight import check_report_dir, context_length, preflight_warnings, say
from kvquant.runner.store import ResultStore, RunLock, warn
from kvquant.runner.lookplan import LookPlan, PlanRecord, replanned_note
from kvquant.experiment.provenance import SourceWatch
from kvquant.scoring.stages import serve, serving_tokens, staged_decision
from kvquant.scoring.task_setup import check_answer_tasks, held_tasks, lm_eval_task
from kvquant.scoring.tasks import (check_task_data, check_tasks, prepare_probe_tasks, probe_length, scratch_tasks,
    task_dir)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def plan_steps(cfg: ExperimentConfig) -> RunPlan:
    """The steps a valid config asks for, in the order the runner takes them."""
    given = [c.label for c in cfg.stages or cfg.candidates]
    return RunPlan(candidates=(*given, *([cfg.search.name] if cfg.search else [])),
                calibrate=tuple(c.label for c in cfg.stages or cfg.candidates if c.calibrate),
                search=cfg.search.name if cfg.search else None, staged=bool(cfg.stages), looks=planned_looks(cfg))


def preflight(cfg: ExperimentConfig, first_look: bool = False) -> tuple[RunPlan, dict[str, list[str]], list[str]]:
    """Check everything a run needs before loading anything heavy: the report directory, the model (path, GGUF
    file, tokenizer, device, config), every candidate's quantizer options on the model's shapes, every
    perplexity set's text and every task name (``first_look``, for the cost preview: the few-shot contexts and probe
    documents of the documents it prices only, the probes written nowhere but this process's own task folder).
    Returns the run's plan, the perplexity rows and warnings."""
    check_env_dirs()
    check_report_dir(Path(cfg.output_dir) / cfg.name)
    check_processes(cfg, parallel.current().world)
    model_config = check_model(cfg.model)
    shape = shape_from_config(model_config, cfg.model.path)
    for setting in [*cfg.candidates, *cfg.stages, *(cfg.search.ladder if cfg.search else [])]:
        check_rope_layout(model_config, setting.quantizer, setting.options, f"{setting.label}: options")
    evicting = check_settings(cfg, shape)
    context = context_length(cfg, model_config)
    if cfg.serving:
        parse_bytes(cfg.serving.memory_budget, "serving.memory_budget")
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
    probes = probe_counts(cfg, first_look)
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
    check_runner_fewshot(cfg, lambda: tokenizer or load_tokenizer(cfg.model), context, folder or task_dir(),
                         preview.SAMPLE_DOCUMENTS if first_look else None)
    if any(c.calibrate for c in [*cfg.candidates, *cfg.stages]):
        check_calibration(cfg, tokenizer, context, rows)
    if cfg.search:
        for i, rung in enumerate(cfg.search.ladder):
            check_candidate(rung, shape, f"search.ladder[{i}] ({rung.label})")
        check_search(cfg, shape, model_dtype(cfg.model), tokenizer, context, rows, folder)
    check_disjoint(cfg, tokenizer, context, rows)
    return plan_steps(cfg), rows, preflight_warnings(cfg, model_config, evicting)


def check_settings(cfg: ExperimentConfig, shape) -> list[Candidate]:
    """Every candidate's and stage's quantizer options on the model's ``shape`` (a calibrating one with placeholder
    scales), no stage offloaded, eviction only in streaming mode; returns the settings that evict (the search's
    ladder included)."""
    checked = []
    for i, candidate in enumerate(cfg.candidates):
        where = f"candidates[{i}] ({candidate.label})"
        checked.append(placeholder_scales(candidate, shape, where))
        check_candidate(checked[-1], shape, where)
    for i, stage in enumerate(cfg.stages):
        where = f"stages[{i}] ({stage.label})"
        checked.append(placeholder_scales(stage, shape, where))
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


def placeholder_scales(candidate: Candidate, shape, where: str) -> Candidate:
    """A candidate that calibrates, with scales of 1.0 in place of the ones calibration will find (one per KV
    head for ``head``), so preflight checks its quantizer's options; any other candidate as it is."""
    if not candidate.calibrate:
        return candidate
    statics = [n for n in available_quantizers() if "k_scale" in QUANTIZERS.options(n)]
    if candidate.quantizer not in statics:
        raise KVQuantError(f"{where}: calibrate: {candidate.quantizer!r} has no static scales (k_scale, v_scale) to "
                           f"calibrate; these have: {', '.join(statics)}")
    clash = [k for k in ("k_scale", "v_scale", "layers") if k in candidate.options]
    if clash:
        raise KVQuantError(f"{where}: calibrate sets k_scale and v_scale per layer; remove options.{clash[0]}")
    one = 1.0 if candidate.calibrate == "tensor" else [1.0] * shape.kv_heads
    return dataclasses.replace(candidate, options={**candidate.options, "k_scale": one, "v_scale": one})


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


def serve_stages(session: Session, rows: dict) -> Staged:
    """A staged run's serving step: each stage (and the baseline, no prefix sharing) on the serving shape, through
    the result store, and what the report needs to order and judge them."""
    cfg, store = session.cfg, session.store
    pset, prefix, suffixes = serving_text(cfg, session.tokenizer, rows)
    serving = {}
    for stage in [Stage(BASELINE.quantizer, {}, BASELINE.label), *cfg.stages]:
        key = {"model": dataclasses.asdict(cfg.model), "serving": dataclasses.asdict(cfg.serving),
               "stage": dataclasses.asdict(stage), "text": pset.name}
        serving[stage.label] = Serving.from_dict(store.get_or_compute(
            stage.label, "serving", key,
            lambda s=stage: serve(session.model, s, cfg.serving, prefix, suffixes).to_dict()))
    return Staged(serving, tuple(s.label for s in cfg.stages), parse_bytes(cfg.serving.memory_budget),
                  dataclasses.asdict(cfg.serving), {s.label: s.prefix_sharing for s in cfg.stages})


def planned_looks(cfg: ExperimentConfig) -> dict[str, int]:
    """Per gated task, the looks a sequential gate plans (each look's interval is widened for all of them)."""
    if cfg.gate.max_documents is None:
        return {}
    return {task: len(looks(cfg.eval.tasks.limit_for(task), cfg.gate.max_documents)) for task in cfg.gated_tasks()}


def add_documents(session: Session, candidates: list, rows: dict, results: dict, bits: dict,
                  planned: dict[str, int], record=None) -> tuple[dict, dict[str, int]]:
    """Sequential documents: while a gated task's verdict is inconclusive for a candidate that has not failed (nor
    has a metric that is not exercised, which more documents cannot make pass), score the next look's documents
    (doubling, up to ``gate.max_documents`` or the task's end) for it and the baseline, reusing every document
    already scored; then judge again. ``planned``: per gated task, the looks planned; ``record``: given each
    judgement's rows (:meth:`PlanRecord.record`). Returns the results with every look, and the size (documents) of
    each task it looked to extend, but for generated (probe) tasks."""
    cfg, sizes = session.cfg, {}
    split = evaluation_split(cfg, session.tokenizer, session.maxlen, rows)
    probe = probe_tokens(cfg, split, session.tokenizer, session.maxlen)
    more: dict[str, dict[str, list[range]]] = {c.label: {} for c in [BASELINE, *candidates]}
    stuck: set[str] = set()  # tasks whose last look the baseline could not have (a render's, not stored)
    while True:
        table = metric_rows(cfg, results, [c.label for c in candidates], planned_looks=planned)
        if record is not None:
            record(table)
        decision = decide(table, bits, cfg.gate, at_chance=needles_at_chance(results[BASELINE.label], cfg.gate))
        wanted: dict[str, set[str]] = {}
        hopeless = {v.row.candidate for v in decision.verdicts if v.verdict == NOT_EXERCISED}  # can never pass
        for v in decision.verdicts:
            if v.verdict == INCONCLUSIVE and v.row.kind in (ACCURACY, FLIPS) and v.row.metric.source in planned and \
                    decision.statuses[v.row.candidate] != FAIL and v.row.candidate not in hopeless:
                wanted.setdefault(v.row.metric.source, set()).add(v.row.candidate)
        grown, gated = {}, {}
        for task, labels in wanted.items():
            gated[task] = next(r.metric for r in table if r.metric.source == task and r.gated and r.kind == ACCURACY)
            scored = results[BASELINE.label][gated[task]].n
            if task not in sizes:
                sizes[task] = task_size(session, task)
            nxt = next((n for n in looks(cfg.eval.tasks.limit_for(task), cfg.gate.max_documents) if n > scored), None)
            nxt = min(nxt, sizes[task]) if nxt is not None else None
            if nxt is not None and nxt > scored and task not in stuck:
                grown[task] = (range(scored, nxt), labels)
        if not grown:  # a generated task can always have more: no size to run out of
            return results, {task: size for task, size in sizes.items() if probe_length(task) is None}
        for task, (docs, labels) in grown.items():
            if session.processes.main:
                print(f"kvquant: sequential look: {task} documents {docs.start}-{docs.stop - 1} for "
                      f"{', '.join(sorted(labels))} (inconclusive at {docs.start}) and the baseline")
            for label in [BASELINE.label, *labels]:
                more[label].setdefault(task, []).append(docs)
        for c in [BASELINE, *candidates]:
            if any(task in more[c.label] for task in grown):
                extended = dataclasses.replace(split, more={t: tuple(r) for t, r in more[c.label].items()})
                results[c.label] = session.measure(c, extended, probe=probe)
        stuck |= {task for task, (docs, _) in grown.items() if results[BASELINE.label][gated[task]].n < docs.stop}


def task_pace(seconds: dict[tuple[str, str], float], table: list) -> dict[tuple[str, str], float]:
    """Seconds per document of each (candidate, task) the gate judges, the baseline's scoring of them included (a
    sequential look scores both), from how long this run's results took (``seconds``: the store's, per
    (candidate, metric); a task's looks are its metrics ``task/<task>`` and ``task/<task>@<a>-<b>``); a pair
    missing any time is left out."""
    def spent(label: str, task: str) -> float | None:
        parts = [s for (who, metric), s in seconds.items()
                 if who == label and (metric == f"task/{task}" or metric.startswith(f"task/{task}@"))]
        return sum(parts) if parts else None

    pace = {}
    for row in table:
        if row.kind in (ACCURACY, FLIPS) and row.gated and row.n:
            mine, base = spent(row.candidate, row.metric.source), spent(BASELINE.label, row.metric.source)
            if mine is not None and base is not None:
                pace[row.candidate, row.metric.source] = (mine + base) / row.n
    return pace


def judge_run(cfg: ExperimentConfig, plan: RunPlan, candidates: list, results: dict,
              warnings: list[str], store_seconds: dict | None = None,
              sizes: dict[str, int] | None = None) -> tuple[list, Decision, str | None]:
    """The gate's rows and decision over the measured ``results`` (a staged run: the last stage before the first
    that does not pass, which is returned too; None: every stage passes, or no stages); ``store_seconds``: how long
    each result took (:attr:`ResultStore.seconds`), to state how long more documents would take; ``sizes``:
    documents per task where known, to state where more would be needed than a task holds."""
    store_seconds = store_seconds or {}
    table = metric_rows(cfg, results, [c.label for c in candidates], planned_looks=plan.looks)
    for row in table:
        if row.gated and row.kind == ACCURACY and row.baseline == 0 and row.candidate == candidates[0].label:
            warn(warnings, f"gated metric {row.metric.name}: the baseline scores 0, so every candidate keeps it "
                 "(relative 1.0) and the gate says nothing about it")
    bits = {c.label: results[c.label].memory.bits_per_element for c in candidates}
    for label, b in bits.items():
        if b >= results[BASELINE.label].memory.bits_per_element:
            warn(warnings, f"{label} holds {b:.2f} bits/element, no fewer than the baseline, after "
                 f"{results[label].memory.measured['tokens']} tokens: it stores them at full precision (a residual "
                 "window or key group longer than the sequence), so its scores say nothing about quantization")
    at_chance = needles_at_chance(results[BASELINE.label], cfg.gate)
    decision, first = decide(table, bits, cfg.gate, task_pace(store_seconds, table), sizes, at_chance), None
    if plan.staged:
        verdict, chosen, first, reason = staged_decision(candidates, decision.passed)
        if first is not None and decision.statuses[first] != FAIL:  # not shown to fail: shown nothing yet
            reason += f"; {first} is {decision.statuses[first]}, not shown to fail"
            verdict = verdict if chosen is not None else INCONCLUSIVE
        decision = dataclasses.replace(decision, decision=verdict, chosen=chosen, reason=reason)
    return table, decision, first


def execute(cfg: ExperimentConfig, plan: RunPlan, out_dir: Path, command: str, rows: dict, warnings: list[str],
            replan: bool = False) -> int:
    """Take ``plan``'s steps for a validated config into ``out_dir`` (held under its lock): calibration, the
    search (its map joins the candidates), the serving shape of a staged run, the candidates (or stages) measured,
    sequential looks, the gate, the report. The config is never rewritten: each step reads it as given. Every
    process of several takes every step (each holds every result); process 0 alone writes. Before the model loads,
    the measuring sources are noted (a change under the run stops it at its next signed write) and the plan is
    settled (:class:`PlanRecord`: a changed one refused, unless ``replan``)."""
    start, processes = time.monotonic(), parallel.current()
    store = ResultStore(out_dir / "partial", provenance_module.code_version(), warnings, processes, SourceWatch())
    record = PlanRecord(store, LookPlan.of(cfg), replan)
    found = len(warnings)  # preflight's, printed once the plan is settled (a refusal stays one line)
    record.settle()  # the plan's own warnings are printed as they are found, once
    say(warnings[:found])
    seed_everything(cfg.eval.seed)
    device = parallel.device()  # one GPU per process; the resume keys keep the config's own device
    model, tokenizer = load_model(dataclasses.replace(cfg.model, device=device) if device else cfg.model)
    session = Session(cfg, model, tokenizer, store, shape_from_config(model.config, cfg.model.path))
    try:
        return take_steps(session, plan, out_dir, command, rows, start, record)
    finally:
        store.note_retired()  # where the results it replaced went, also when the run stops early


def take_steps(session: Session, plan: RunPlan, out_dir: Path, command: str, rows: dict, start: float,
               record: PlanRecord | None = None) -> int:
    """:func:`execute`'s steps, with the model loaded (``session``); ``start``: when the run began; ``record``: the
    plan, which keeps every look the gate takes."""
    cfg, store, processes, warnings = session.cfg, session.store, session.processes, session.store.warnings
    chosen, calibration = {c.label: c for c in cfg.stages or cfg.candidates}, {}
    for label in plan.calibrate:
        chosen[label], calibration[label] = calibrated(session, chosen[label], rows)
        saturating = calibration[label]["saturating"]
        if saturating:  # every layer's line is in results.json and report.md
            warn(warnings, f"{label}: calibration values of {len(saturating)} layer streams reach beyond the "
                 f"format's range at their calibrated scale (they saturate), e.g. {saturating[0]}")
    searched = staged = None
    if plan.search:
        chosen[plan.search], searched = search(session, rows)
    if plan.staged:
        staged = serve_stages(session, rows)
    candidates = [chosen[label] for label in plan.candidates]
    results, sizes = measure(session, candidates, rows), {}
    if plan.looks:
        bits = {c.label: results[c.label].memory.bits_per_element for c in candidates}
        results, sizes = add_documents(session, candidates, rows, results, bits, plan.looks,
                                       record and record.record)
    table, decision, first = judge_run(cfg, plan, candidates, results, warnings, store.seconds, sizes)
    replayed = isinstance(session, render.Replay)  # a report rendered from stored results (--render-only)
    decision = session.noted(decision) if replayed else decision  # the looks it lacks, named
    replanned = record and record.record(table)
    if replanned:  # the verdict line, report.md's header and results.json say the plan changed after the data
        decision = dataclasses.replace(decision, reason=f"{decision.reason} ({replanned_note(replanned)})")
    staged = staged and dataclasses.replace(staged, first_failing=first)
    # under a launcher a process's code other than 0 reads as a crash (torchrun stops the run and prints a failure
    # report), so each process of several ends 0 once the run is done, whatever the decision; process 0 prints the
    # decision and results.json holds it
    code = {PASS: EXIT_PASS, FAIL: EXIT_FAIL, INCONCLUSIVE: EXIT_INCONCLUSIVE}[decision.decision]
    code = code if processes.world == 1 else EXIT_PASS
    if not processes.main:
        return code
    store.note_retired()  # before the report, which keeps the warnings
    provenance = Provenance(store.computed, store.reused, tuple(store.set_aside), tuple(warnings), processes.world,
                            round(time.monotonic() - start, 1), session.rendered(out_dir) if replayed else None)
    run = RunResult(cfg, tuple(candidates), results, tuple(table), decision, command, provenance, searched, staged,
                    calibration, plan, replanned)
    store.check_sources()  # results.json is signed: never of other code than the results it reports
    paths, document = report.write(out_dir, run)
    deployed, undeployed = deploy_beside(out_dir, document)  # nothing to deploy is no bad input: the exit is the gate's
    print(f"\nkvquant: {decision.decision.upper()}: {decision.reason}")
    print(f"kvquant: {store.computed} results measured, {store.reused} reused from {store.directory}"
          + (f", by {processes.world} processes" if processes.world > 1 else ""))
    print(f"kvquant: report: {paths['report']} (also results.json, results.csv, {paths['plot'].name}"
          + (f", {deployed.name}: the serving engine's flags)" if deployed else ")"))
    if undeployed:
        print(f"kvquant: no DEPLOY.md written: {undeployed}")
    return code




@contextlib.contextmanager
def locked(out_dir: Path, held: list[Path]):
    """The run's hold on ``out_dir``: process 0 takes its :class:`RunLock` and tells the others whether it could
    (so all of them stop with its one line when it cannot)."""
    processes = parallel.current()
    with contextlib.ExitStack() as stack:
        refused = None
        if processes.main:
            try:
                stack.enter_context(RunLock(out_dir))
                held.append(out_dir)
            except KVQuantError as err:
                refused = str(err)
        refused = processes.broadcast(refused)
        if refused is not None:
            raise KVQuantError(refused)
        yield


def main(argv: list[str] | None = None) -> int:
    drop_working_dir()
    parser = OneLineParser("kvquant", prog="python -m kvquant.run", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="experiment YAML, e.g. configs/int4.yaml")
    add_set_option(parser, "override a config key, e.g. --set eval.tasks.limit=50 (repeatable)")
    once = parser.add_mutually_exclusive_group()
    once.add_argument("--dry-run", action="store_true", help="print what the run would score and cost, then exit")
    once.add_argument("--render-only", action="store_true", help="judge the stored results (--partial, default: the "
                      "report's partial/) with today's gate and write the report; no model loaded, nothing measured")
    parser.add_argument("--partial", type=Path, help="with --render-only: a folder of stored results you vouch for")
    parser.add_argument("--replan", action="store_true", help="go on where the partial results were measured under "
                        "another plan, and report the error over every look taken (docs/gate.md)")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args
    command = "python -m kvquant.run " + shlex.join(sys.argv[1:] if argv is None else argv)
    held: list[Path] = []  # the report directory, once this run holds it

    def run() -> int:
        if args.partial and not args.render_only:
            raise KVQuantError("--partial names the stored results --render-only reads; add --render-only")
        cfg = load_config(args.config, args.overrides)
        parallel.start(cpu=not models.pick_device(cfg.model.device).startswith("cuda"))
        out_dir = Path(cfg.output_dir) / cfg.name
        if args.dry_run:  # task files go to this process's own folder, removed at exit; each task loaded once
            with scratch_tasks(), held_tasks():
                _, rows, warnings = preflight(cfg, True)
                return preview.dry_run(cfg, rows, warnings, args.replan, shape_from_config)
        if args.render_only:  # nothing is measured: what it reads is checked against the stored results
            with locked(out_dir, held):
                return render.render_only(cfg, plan_steps(cfg), out_dir, command, args.partial, args.replan,
                                          take_steps, shape_from_config)
        with held_tasks():  # preflight's checks share each task's object; the measurements load their own
            plan, rows, warnings = preflight(cfg)
        parallel.check_same_run(cfg, rows)  # before the lock and the model: every process runs the same run
        with locked(out_dir, held):
            return execute(cfg, plan, out_dir, command, rows, warnings, args.replan)

    def resume_hint() -> str:
        return (f"; finished results are kept in {held[0] / 'partial'}; run the same command to resume"
                if held else "")

    return guarded("kvquant", run, log_dir=lambda: held[0] if held else None, on_interrupt=resume_hint)


if __name__ == "__main__":
    sys.exit(main())
