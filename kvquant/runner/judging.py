"""A run's judgement of what it measured: the sequential looks (a gated task's documents added, doubling, while a
verdict is open: :func:`add_documents`), and the gate's rows and decision over the results (:func:`judge_run`; a
staged run's last stage that passes). The gate itself is pure (:mod:`kvquant.runner.gate`); this is where a run
asks it, scores more where it is asked to, and warns of what the gate cannot see."""

from __future__ import annotations

import dataclasses

from kvquant.experiment.config import ExperimentConfig
from kvquant.runner.gate import ACCURACY, FAIL, INCONCLUSIVE, NOT_EXERCISED, decide, metric_rows, needles_at_chance
from kvquant.experiment.gate_config import looks
from kvquant.experiment.results import Decision, Measured, RunPlan, Verdict
from kvquant.runner.store import warn
from kvquant.scoring.session import BASELINE, Session, evaluation_split, probe_counts, probe_tokens, task_size
from kvquant.scoring.stages import staged_decision
from kvquant.scoring.tasks import probe_length


def planned_looks(cfg: ExperimentConfig) -> dict[str, int]:
    """Per gated task, the looks a sequential gate plans (each look's interval is widened for all of them)."""
    if cfg.gate.max_documents is None:
        return {}
    return {task: len(looks(cfg.eval.tasks.limit_for(task), cfg.gate.max_documents)) for task in cfg.gated_tasks()}


def last_looks(cfg: ExperimentConfig, sizes: dict[str, int], baseline: Measured) -> dict[str, tuple[int, str]]:
    """Per gated task whose ``baseline`` has scored to its last look, the documents there and what sets them: the
    plan's last look (``gate.max_documents``) or, where ``sizes`` knows it, the task's end if that comes first (a
    generated task's: the most documents the config writes, where that is fewer); none without sequential looks.
    A task whose baseline stops short (a render's look not stored) has no end yet."""
    if cfg.gate.max_documents is None:
        return {}
    scored: dict[str, int] = {}
    for o in baseline.outcomes:
        if o.metric.kind.on_tasks:
            scored[o.metric.source] = min(o.n, scored.get(o.metric.source, o.n))
    written, out = probe_counts(cfg), {}
    for task in cfg.gated_tasks():
        planned = looks(cfg.eval.tasks.limit_for(task), cfg.gate.max_documents)[-1]
        if task in written:  # generated: a larger gate.max_documents writes more, up to a cap
            end = (written[task], f"every document the config writes ({written[task]:,})") \
                if written[task] < planned else None
        else:
            end = (sizes[task], f"every document the task has ({sizes[task]:,})") \
                if task in sizes and sizes[task] <= planned else None
        end = end or (planned, f"the plan's last (gate.max_documents = {cfg.gate.max_documents:,})")
        if scored.get(task, 0) >= end[0]:
            out[task] = end
    return out


def at_last_look(v: Verdict, ends: dict[str, tuple[int, str]]) -> bool:
    """Whether ``v`` is a gated task row still inconclusive with every document it can have (``ends``: per task
    whose baseline has scored to its last look, those documents and what sets them,
    :func:`last_looks`), counted by the candidate's own documents, not the baseline's, which
    other candidates' looks may have taken further."""
    end = ends.get(v.row.metric.source)
    return v.verdict == INCONCLUSIVE and v.row.gated and v.row.kind.on_tasks and end is not None and \
        v.row.n >= end[0]


def open_at_last_look(verdicts: list[Verdict], ends: dict[str, tuple[int, str]]) -> dict[str, Verdict]:
    """Per candidate, its first row :func:`at_last_look`: such a candidate cannot pass on this data."""
    found: dict[str, Verdict] = {}
    for v in verdicts:
        if at_last_look(v, ends):
            found.setdefault(v.row.candidate, v)
    return found


def stages_beyond(stages: tuple[str, ...], out_of_reach: set[str] | frozenset[str]) -> dict[str, str]:
    """Per stage of a staged run (``stages``: their labels in order; empty for candidates) after the first that
    cannot pass (in ``out_of_reach``: shown to fail, a metric not exercised, a task open at its last look), that
    first stage: the answer is a stage before it, or none, so more documents for these change nothing."""
    first = next((s for s in stages if s in out_of_reach), None)
    return {} if first is None else {s: first for s in stages[stages.index(first) + 1:]}


def with_halt_notes(verdicts: list[Verdict], ends: dict[str, tuple[int, str]], failed: frozenset[str],
                    sequential: bool, stages: tuple[str, ...]) -> list[Verdict]:
    """``verdicts`` with each row :func:`at_last_look` saying what ends its looks, and each other inconclusive
    task row of the same candidate, of a candidate with a metric not exercised, or of a stage after one that cannot
    pass (:func:`stages_beyond`; ``stages``: a staged run's in order) saying why it was not looked at further
    (``sequential``: whether the run takes looks at all); ``failed``: candidates shown to fail, which are not looked
    at further for that."""
    halted, out = open_at_last_look(verdicts, ends), []
    unexercised: dict[str, Verdict] = {}
    for v in verdicts:
        if v.verdict == NOT_EXERCISED:
            unexercised.setdefault(v.row.candidate, v)
    beyond = stages_beyond(stages, failed | set(unexercised) | set(halted)) if sequential else {}
    for v in verdicts:
        stop = None if v.row.candidate in failed else halted.get(v.row.candidate)
        idle = None if v.row.candidate in failed or not sequential else unexercised.get(v.row.candidate)
        after = None if v.row.candidate in failed else beyond.get(v.row.candidate)
        open_task = v.verdict == INCONCLUSIVE and v.row.gated and v.row.kind.on_tasks
        if stop is not None and at_last_look(v, ends):
            v = dataclasses.replace(v, note=f"its last look: {ends[v.row.metric.source][1]}")
        elif idle is not None and open_task:
            v = dataclasses.replace(v, note=f"not looked at further: {idle.row.metric.name} is not exercised, so "
                                            "none can make this pass")
        elif stop is not None and open_task:
            v = dataclasses.replace(v, note=f"not looked at further: {stop.row.metric.source} is open at its last "
                                            f"look ({stop.row.n:,} documents), so none can make this pass")
        elif after is not None and open_task:
            v = dataclasses.replace(v, note=f"not looked at further: an earlier stage, {after}, cannot pass, so "
                                            "this stage cannot be the answer")
        out.append(v)
    return out


def halt_notes(ends: dict[str, tuple[int, str]], sequential: bool, stages: tuple[str, ...], then=None):
    """What :func:`~kvquant.runner.gate.decide` adds to the verdicts' notes (its ``annotate``): the rows that take no
    more looks (:func:`with_halt_notes`, ``sequential``: whether the run takes looks; ``stages``: a staged run's in
    order; a candidate shown to fail is not looked at further for that), then ``then``'s (a render's looks not
    stored)."""
    def annotate(verdicts: list[Verdict], statuses: dict[str, str]) -> list[Verdict]:
        failed = frozenset(name for name, s in statuses.items() if s == FAIL)
        verdicts = with_halt_notes(verdicts, ends, failed, sequential, stages)
        return then(verdicts, statuses) if then else verdicts
    return annotate


def add_documents(session: Session, candidates: list, rows: dict, results: dict, bits: dict,
                  planned: dict[str, int], record=None) -> tuple[dict, dict[str, int]]:
    """Sequential documents: while a gated task's verdict is inconclusive for a candidate that has not failed (nor
    has a metric that is not exercised, nor a gated task still open at its own last look: more documents cannot
    make either pass, only another task fail; nor, in a staged run, comes after a stage that cannot pass: the
    answer is before it), score the next look's documents (doubling, up to
    ``gate.max_documents`` or the task's end) for it and the baseline, reusing every document already scored; then
    judge again. ``planned``: per gated task, the looks planned; ``record``: given each
    judgement's rows (:meth:`PlanRecord.record`). Returns the results with every look, and the size (documents) of
    each task it looked to extend, but for generated (probe) tasks."""
    cfg, sizes = session.cfg, {}
    stages = tuple(c.label for c in candidates) if cfg.stages else ()
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
            if v.verdict == INCONCLUSIVE and v.row.kind.on_tasks and v.row.metric.source in planned and \
                    decision.statuses[v.row.candidate] != FAIL and v.row.candidate not in hopeless:
                wanted.setdefault(v.row.metric.source, set()).add(v.row.candidate)
        for task in wanted:
            if task not in sizes:
                sizes[task] = task_size(session, task)
        ends = last_looks(cfg, sizes, results[BASELINE.label])
        hopeless |= set(open_at_last_look(decision.verdicts, ends))  # nor can these
        failed = {label for label, s in decision.statuses.items() if s == FAIL}
        hopeless |= set(stages_beyond(stages, hopeless | failed))  # nor can these be a staged run's answer
        grown, gated = {}, {}
        for task, labels in ((t, labels - hopeless) for t, labels in wanted.items()):
            if not labels:
                continue
            gated[task] = next(r.metric for r in table if r.metric.source == task and r.gated and r.kind is ACCURACY)
            scored = results[BASELINE.label][gated[task]].n
            nxt = next((n for n in looks(cfg.eval.tasks.limit_for(task), cfg.gate.max_documents) if n > scored), None)
            nxt = min(nxt, sizes[task]) if nxt is not None else None
            if nxt is not None and nxt > scored and task not in stuck:
                grown[task] = (range(scored, nxt), labels)
        if not grown:  # a generated task can always have more: no size to run out of
            return results, {task: size for task, size in sizes.items() if probe_length(task) is None}
        for task, (docs, labels) in grown.items():
            if session.processes.is_main_process:
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
    def seconds_of(label: str, task: str) -> float | None:
        parts = [s for (who, metric), s in seconds.items()
                 if who == label and (metric == f"task/{task}" or metric.startswith(f"task/{task}@"))]
        return sum(parts) if parts else None

    pace = {}
    for row in table:
        if row.kind.on_tasks and row.gated and row.n:
            mine, base = seconds_of(row.candidate, row.metric.source), seconds_of(BASELINE.label, row.metric.source)
            if mine is not None and base is not None:
                pace[row.candidate, row.metric.source] = (mine + base) / row.n
    return pace


def judge_run(cfg: ExperimentConfig, plan: RunPlan, candidates: list, results: dict,
              warnings: list[str], store_seconds: dict | None = None,
              sizes: dict[str, int] | None = None, annotate=None) -> tuple[list, Decision, str | None]:
    """The gate's rows and decision over the measured ``results`` (a staged run: the last stage before the first
    that does not pass, which is returned too; None: every stage passes, or no stages); ``store_seconds``: how long
    each result took (:attr:`ResultStore.seconds`), to state how long more documents would take; ``sizes``:
    documents per task where known, to state where more would be needed than a task holds; ``annotate``: what the
    caller adds to the verdicts' notes (:func:`~kvquant.runner.gate.decide`)."""
    store_seconds = store_seconds or {}
    table = metric_rows(cfg, results, [c.label for c in candidates], planned_looks=plan.looks)
    for row in table:
        if row.gated and row.kind is ACCURACY and row.baseline == 0 and row.candidate == candidates[0].label:
            warn(warnings, f"gated metric {row.metric.name}: the baseline scores 0, so a ratio to it has no "
                 "interval: every candidate stays inconclusive on it (none can pass), and it says nothing of a cache")
    bits = {c.label: results[c.label].memory.bits_per_element for c in candidates}
    for label, b in bits.items():
        if b >= results[BASELINE.label].memory.bits_per_element:
            warn(warnings, f"{label} holds {b:.2f} bits/element, no fewer than the baseline, after "
                 f"{results[label].memory.measured['tokens']} tokens: it stores them at full precision (a residual "
                 "window or key group longer than the sequence), so its scores say nothing about quantization")
    at_chance = needles_at_chance(results[BASELINE.label], cfg.gate)
    notes = halt_notes(last_looks(cfg, sizes or {}, results[BASELINE.label]), cfg.gate.max_documents is not None,
                       tuple(c.label for c in candidates) if plan.staged else (), annotate)
    decision, first = decide(table, bits, cfg.gate, task_pace(store_seconds, table), sizes, at_chance,
                             annotate=notes), None
    if plan.staged:
        verdict, chosen, first, reason = staged_decision(candidates, decision.passed)
        if first is not None and decision.statuses[first] != FAIL:  # not shown to fail: shown nothing yet
            reason += f"; {first} is {decision.statuses[first]}, not shown to fail"
            verdict = verdict if chosen is not None else INCONCLUSIVE
        decision = dataclasses.replace(decision, decision=verdict, chosen=chosen, reason=reason)
    return table, decision, first
