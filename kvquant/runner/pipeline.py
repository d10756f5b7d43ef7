"""A run of ``python -m kvquant.run`` from its checked arguments to its exit code (:func:`run_experiment`): the
config loaded, everything checked before the model loads (:mod:`.preflight`), the run's lock taken, then the plan's
steps: calibration, the search, a staged run's serving shape, the candidates measured, the sequential looks and the
gate (:mod:`.judging`), the report and the deploy file. ``--dry-run`` prices the run instead (:mod:`.preview`), and
``--render-only`` takes the same steps over stored results (:mod:`.render`). Exit codes and what is written on each
are those the command's own help states (``kvquant/run.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvquant.errors import EXIT_FAIL, EXIT_INCONCLUSIVE, EXIT_PASS, KVQuantError
from kvquant.exits import run_guarded
from kvquant.runner import preview, render, report
from kvquant.experiment import provenance as provenance_module
from kvquant.experiment.config import ExperimentConfig, Stage, load_config
from kvquant.runner.gate import FAIL, INCONCLUSIVE, PASS
from kvquant.runner.judging import add_documents, judge_run
from kvquant.runner.lookplan import LookPlan, PlanRecord, replanned_note
from kvquant.runner.preflight import AboveRunner, plan_steps, preflight, say, serving_text
from kvquant.experiment.results import Provenance, RunPlan, RunResult, StageServing, Staged
from kvquant.runner.search import search
from kvquant.experiment.provenance import SourceWatch
from kvquant.runner.store import ResultStore, RunLock, warn
from kvquant.scoring import models, parallel
from kvquant.scoring.calibrate import with_calibration
from kvquant.scoring.models import load_model
from kvquant.scoring.session import BASELINE, Session, measure_all
from kvquant.scoring.stages import serve
from kvquant.scoring.task_setup import held_tasks
from kvquant.scoring.tasks import scratch_tasks


@dataclass(frozen=True)
class RunOptions:
    """``python -m kvquant.run``'s arguments: the config, its ``--set`` overrides, and how to run it."""

    config: str
    overrides: list[str]
    dry_run: bool = False  #: print what the run would score and cost, then exit
    render_only: bool = False  #: judge stored results with today's gate and write the report; measure nothing
    partial: Path | None = None  #: with ``render_only``: a folder of stored results the user vouches for
    replan: bool = False  #: go on where the partial results were measured under another plan


def run_experiment(options: RunOptions, command: str, above: AboveRunner) -> int:
    """The exit code of the run ``options`` ask for (``command``: its command line, as the report states it;
    ``above``: what the run takes from the planner and the deploy files). Bad input is one line and exit 2, an
    interrupt exit 130 naming where finished results are kept, anything else exit 3 with its traceback in the
    report directory's ``error.log`` (:func:`kvquant.exits.run_guarded`)."""
    held: list[Path] = []  # the report directory, once this run holds it

    def run() -> int:
        if options.partial and not options.render_only:
            raise KVQuantError("--partial names the stored results --render-only reads; add --render-only")
        cfg = load_config(options.config, options.overrides)
        parallel.start(cpu=not models.pick_device(cfg.model.device).startswith("cuda"))
        out_dir = Path(cfg.output_dir) / cfg.name
        if options.dry_run:  # task files go to this process's own folder, removed at exit; each task loaded once
            with scratch_tasks(), held_tasks():
                _, rows, warnings = preflight(cfg, above, preview.SAMPLE_DOCUMENTS)
                return preview.dry_run(cfg, rows, warnings, options.replan, above.shape_of)
        if options.render_only:  # nothing is measured: what it reads is checked against the stored results
            with hold_lock(out_dir, held):
                return render.render_only(cfg, plan_steps(cfg), out_dir, command, options.partial, options.replan,
                                          functools.partial(take_steps, above=above), above.shape_of)
        with held_tasks():  # preflight's checks share each task's object; the measurements load their own
            plan, rows, warnings = preflight(cfg, above)
        parallel.check_same_run(cfg, rows)  # before the lock and the model: every process runs the same run
        with hold_lock(out_dir, held):
            return execute(cfg, plan, out_dir, command, rows, warnings, above, options.replan)

    def resume_hint() -> str:
        return (f"; finished results are kept in {held[0] / 'partial'} (finished groups of windows in "
                f"{held[0] / 'windows'}); run the same command to resume"
                if held else "")

    return run_guarded("kvquant", run, log_dir=lambda: held[0] if held else None, on_interrupt=resume_hint)


@contextlib.contextmanager
def hold_lock(out_dir: Path, held: list[Path]):
    """The run's hold on ``out_dir``: process 0 takes its :class:`RunLock` and tells the others whether it could
    (so all of them stop with its one line when it cannot)."""
    processes = parallel.current()
    with contextlib.ExitStack() as stack:
        refused = None
        if processes.is_main_process:
            try:
                stack.enter_context(RunLock(out_dir))
                held.append(out_dir)
            except KVQuantError as err:
                refused = str(err)
        refused = processes.broadcast(refused)
        if refused is not None:
            raise KVQuantError(refused)
        yield


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def serve_stages(session: Session, rows: dict, parse_bytes) -> Staged:
    """A staged run's serving step: each stage (and the baseline, no prefix sharing) on the serving shape, through
    the result store, and what the report needs to order and judge them (``parse_bytes``: the planner's, for the
    memory budget)."""
    cfg, store = session.cfg, session.store
    pset, prefix, suffixes = serving_text(cfg, session.tokenizer, rows)
    serving = {}
    for stage in [Stage(BASELINE.quantizer, {}, BASELINE.label), *cfg.stages]:
        key = {"model": dataclasses.asdict(cfg.model), "serving": dataclasses.asdict(cfg.serving),
               "stage": dataclasses.asdict(stage), "text": pset.name}
        serving[stage.label] = StageServing.from_dict(store.get_or_compute(
            stage.label, "serving", key,
            lambda s=stage: serve(session.model, s, cfg.serving, prefix, suffixes).to_dict()))
    return Staged(serving, tuple(s.label for s in cfg.stages), parse_bytes(cfg.serving.memory_budget),
                  dataclasses.asdict(cfg.serving), {s.label: s.prefix_sharing for s in cfg.stages})


def execute(cfg: ExperimentConfig, plan: RunPlan, out_dir: Path, command: str, rows: dict, warnings: list[str],
            above: AboveRunner, replan: bool = False) -> int:
    """Take ``plan``'s steps for a validated config into ``out_dir`` (held under its lock): calibration, the
    search (its map joins the candidates), the serving shape of a staged run, the candidates (or stages) measured,
    sequential looks, the gate, the report. The config is never rewritten: each step reads it as given. Every
    process of several takes every step (each holds every result); process 0 alone writes. Before the model loads,
    the measuring sources are noted (a change under the run stops it at its next signed write) and the plan is
    settled (:class:`PlanRecord`: a changed one refused, unless ``replan``); ``above``: the planner's shapes and
    the deploy file."""
    start, processes = time.monotonic(), parallel.current()
    store = ResultStore(out_dir / "partial", provenance_module.code_version(), warnings, processes, SourceWatch())
    record = PlanRecord(store, LookPlan.of(cfg), replan)
    found = len(warnings)  # preflight's, printed once the plan is settled (a refusal stays one line)
    record.settle()  # the plan's own warnings are printed as they are found, once
    say(warnings[:found])
    seed_everything(cfg.eval.seed)
    device = parallel.process_gpu()  # one GPU per process; the resume keys keep the config's own device
    model, tokenizer = load_model(dataclasses.replace(cfg.model, device=device) if device else cfg.model)
    session = Session(cfg, model, tokenizer, store, above.shape_of(model.config, cfg.model.path))
    try:
        return take_steps(session, plan, out_dir, command, rows, start, record, above=above)
    finally:
        store.note_retired()  # where the results it replaced went, also when the run stops early


def take_steps(session: Session, plan: RunPlan, out_dir: Path, command: str, rows: dict, start: float,
               record: PlanRecord | None = None, *, above: AboveRunner) -> int:
    """:func:`execute`'s steps, with the model loaded (``session``); ``start``: when the run began; ``record``: the
    plan, which keeps every look the gate takes; ``above``: the planner's byte sizes and the deploy file."""
    cfg, store, processes, warnings = session.cfg, session.store, session.processes, session.store.warnings
    chosen, calibration = {c.label: c for c in cfg.stages or cfg.candidates}, {}
    for label in plan.calibrate:
        chosen[label], calibration[label] = with_calibration(session, chosen[label], rows)
        saturating = calibration[label].get("saturating")
        if saturating:  # every layer's line is in results.json and report.md
            warn(warnings, f"{label}: calibration values of {len(saturating)} layer streams reach beyond the "
                 f"format's range at their calibrated scale (they saturate), e.g. {saturating[0]}")
    searched = staged = None
    if plan.search:
        chosen[plan.search], searched = search(session, rows)
    if plan.staged:
        staged = serve_stages(session, rows, above.parse_bytes)
    candidates = [chosen[label] for label in plan.candidates]
    results, sizes = measure_all(session, candidates, rows), {}
    if plan.looks:
        bits = {c.label: results[c.label].memory.bits_per_element for c in candidates}
        results, sizes = add_documents(session, candidates, rows, results, bits, plan.looks,
                                       record and record.record)
    replayed = isinstance(session, render.Replay)  # a report rendered from stored results (--render-only)
    table, decision, first = judge_run(cfg, plan, candidates, results, warnings, store.seconds, sizes,
                                       session.with_unstored_looks if replayed else None)  # the looks it lacks
    replanned = record and record.record(table)
    if replanned:  # the verdict line, report.md's header and results.json say the plan changed after the data
        decision = dataclasses.replace(decision, reason=f"{decision.reason} ({replanned_note(replanned)})")
    staged = staged and dataclasses.replace(staged, first_failing=first)
    # under a launcher a process's code other than 0 reads as a crash (torchrun stops the run and prints a failure
    # report), so each process of several ends 0 once the run is done, whatever the decision; process 0 prints the
    # decision and results.json holds it
    code = {PASS: EXIT_PASS, FAIL: EXIT_FAIL, INCONCLUSIVE: EXIT_INCONCLUSIVE}[decision.decision]
    code = code if processes.world == 1 else EXIT_PASS
    if not processes.is_main_process:
        return code
    store.note_retired()  # before the report, which keeps the warnings
    provenance = Provenance(store.computed, store.reused, tuple(store.set_aside), tuple(warnings), processes.world,
                            round(time.monotonic() - start, 1),
                            session.render_provenance(out_dir) if replayed else None)
    run = RunResult(cfg, tuple(candidates), results, tuple(table), decision, command, provenance, searched, staged,
                    calibration, plan, replanned)
    store.check_sources()  # results.json is signed: never of other code than the results it reports
    paths, document = report.write(out_dir, run)
    # nothing to deploy is no bad input: the exit is the gate's
    deployed, undeployed = above.deploy_beside(out_dir, document)
    print(f"\nkvquant: {decision.decision.upper()}: {decision.reason}")
    print(f"kvquant: {store.computed} results measured, {store.reused} reused from {store.directory}"
          + (f", by {processes.world} processes" if processes.world > 1 else ""))
    print(f"kvquant: report: {paths['report']} (also results.json, results.csv, {paths['plot'].name}"
          + (f", {deployed.name}: the serving engine's flags)" if deployed else ")"))
    if undeployed:
        print(f"kvquant: no DEPLOY.md written: {undeployed}")
    return code
