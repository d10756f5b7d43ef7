"""A run's plan, fixed before the data (``partial/plan.json``; docs/gate.md "The plan is fixed"): everything that
decides which documents and windows are measured and how they are judged — the gate (thresholds, confidence,
``max_documents``), each gated task's looks and the confidence of each look, the tasks' limits and shots, the
perplexity sets' windows, the long-context lengths and documents, the seed.

The first run into a report folder records its plan beside its partial results, signed like them; a later run
whose plan differs is refused with one line naming the first field that changed, before the model loads (nothing
written or moved), or, with ``--replan``, goes on and keeps every plan in the file's history. Each judgement of a
gated metric is recorded as a *look* (the documents or windows it read, and its one-sided error, half of
``1 - confidence``); a re-planned run's error is the union bound over every look taken under any plan: per
metric, the sum over distinct looks of the largest error any plan judged that look at (a look judged again at a
narrower width errs only where the wider one did).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import stat
import string
from dataclasses import dataclass
from pathlib import Path

from kvquant.errors import KVQuantError, one_line
from kvquant.fs import read_file, real_dir, set_aside, write_file
from kvquant.experiment.gate_config import GateConfig, look_confidence, looks
from kvquant.runner.store import warn

PLAN = "plan.json"
#: what a plan file's signature signs besides its history: no other signature under the key is ever a valid one
DOMAIN = b"kvquant plan.json v1\0"


def _plain(value):
    """``value`` as JSON reads it back (lists for tuples, string keys)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


@dataclass(frozen=True)
class LookPlan:
    """What decides which documents a run measures and how it judges them (:meth:`of` a config)."""

    gate: dict
    #: per gated task with sequential documents: the documents scored at each look, and each look's confidence
    looks: dict
    confidence: dict
    #: per task: its first look's documents (limit), shots and their sampler
    tasks: dict
    #: per perplexity set: its text, layout and windows
    perplexity: dict
    long_context: dict | None
    seed: int
    max_length: int | None

    @classmethod
    def of(cls, cfg) -> LookPlan:
        gate, tasks = cfg.gate, cfg.eval.tasks
        planned = {t: looks(tasks.limit_for(t), gate.max_documents) for t in cfg.gated_tasks()} \
            if gate.max_documents is not None else {}
        long = cfg.eval.long_context
        return cls(gate=_plain(dataclasses.asdict(gate)), looks=_plain(planned),
                   confidence={t: look_confidence(gate, len(n)) for t, n in planned.items()},
                   tasks=_plain({t: {"limit": tasks.limit_for(t), "num_fewshot": tasks.fewshot_for(t),
                                     "fewshot_sampler": tasks.fewshot_sampler} for t in tasks.names}),
                   perplexity=_plain({p.name: dataclasses.asdict(p) for p in cfg.eval.perplexity}),
                   long_context=_plain(dataclasses.asdict(long)) if long else None, seed=cfg.eval.seed,
                   max_length=cfg.model.max_length)

    @classmethod
    def from_dict(cls, data: dict) -> LookPlan:
        fields = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict) or sorted(data) != sorted(fields):
            raise ValueError("not a plan kvquant wrote")
        return cls(**{name: data[name] for name in fields})

    def to_dict(self) -> dict:
        return _plain(dataclasses.asdict(self))

    def flat(self) -> dict:
        """Every field by its dotted name (``gate.max_documents``, ``looks.lambada_openai``), in order."""
        out = {}

        def walk(prefix: str, value):
            if isinstance(value, dict) and value:
                for key, inner in value.items():
                    walk(f"{prefix}.{key}" if prefix else str(key), inner)
            else:
                out[prefix] = value
        plain = self.to_dict()
        for name in (f.name for f in dataclasses.fields(self)):  # in the fields' order: the gate first
            walk(name, plain[name])
        return out

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def difference(self, other: LookPlan) -> str | None:
        """The first field in which this plan differs from ``other`` (an earlier one), as a phrase; None: equal. A
        gate setting ``other`` lacks (recorded before kvquant had it: a gated metric added since) is read at its
        default, what kvquant did before it: off."""
        mine, theirs = self.flat(), {**_GATE_DEFAULTS, **other.flat()}
        for key in [*mine, *(k for k in theirs if k not in mine)]:
            if mine.get(key, "absent") != theirs.get(key, "absent"):
                return f"{key} is {_show(mine.get(key, 'absent'))} now, {_show(theirs.get(key, 'absent'))} before"
        return None

    def spec(self, source: str) -> str:
        """What decides which data a look at ``n`` documents or windows of ``source`` reads, but ``n`` (a digest):
        a task's shots and sampler, a perplexity set's text and windows, the long-context documents, the seed."""
        if source in self.tasks:
            what = {k: v for k, v in self.tasks[source].items() if k != "limit"}
        elif source in self.perplexity:
            what = {**self.perplexity[source], "model.max_length": self.max_length}
        elif self.long_context and source.partition("@")[0] == self.long_context.get("text"):
            what = {**self.long_context, "model.max_length": self.max_length}
        else:
            what = {}
        return hashlib.sha256(json.dumps([what, self.seed], sort_keys=True).encode()).hexdigest()[:8]


#: every gate setting with a default, by its dotted name, as a plan records it
_GATE_DEFAULTS = {f"gate.{f.name}": _plain(f.default) for f in dataclasses.fields(GateConfig)
                  if f.default is not dataclasses.MISSING}


def _show(value) -> str:
    return json.dumps(value, default=str)[:60]


def look_errors(history: list[dict]) -> dict[str, dict[str, float]]:
    """Per metric, every distinct look taken under any plan of ``history`` and the largest one-sided error it was
    judged at."""
    union: dict[str, dict[str, float]] = {}
    for entry in history:
        for metric, taken in entry["looks"].items():
            mine = union.setdefault(metric, {})
            for look, error in taken.items():
                mine[look] = max(mine.get(look, 0.0), float(error))
    return union


#: a history entry's mark: the plan record before it did not verify and was set aside with ``--replan``, so the
#: looks taken before it are unknown
UNKNOWN_BEFORE = "unknown_before"


def replanned_error(history: list[dict], nominal: float) -> dict | None:
    """Where ``history`` holds more than one plan: the union bound of the worst metric over every look taken under
    any of them (:func:`look_errors`), with the plans' changes; where it begins after a plan record that did not
    verify (:data:`UNKNOWN_BEFORE`), the error is unknown (``None``); else None (one plan: at most ``nominal``)."""
    unknown = any(e.get(UNKNOWN_BEFORE) for e in history)
    if len(history) < 2 and not unknown:
        return None
    totals = {m: (sum(taken.values()), len(taken)) for m, taken in look_errors(history).items() if taken}
    metric = max(totals, key=lambda m: totals[m][0]) if totals else None
    plans = [LookPlan.from_dict(e["plan"]) for e in history]
    changes = [later.difference(earlier) for earlier, later in zip(plans, plans[1:])]
    return {"error": None if unknown else totals[metric][0] if metric else 0.0,
            "looks": totals[metric][1] if metric else 0, "metric": metric, "nominal": nominal,
            "plans": len(history) + unknown,
            "changes": ["an unverifiable plan record, set aside", *changes] if unknown else changes,
            "errors": {m: total for m, (total, _) in sorted(totals.items())}}


def replanned_note(replanned: dict) -> str:
    """The phrase a re-planned run adds to its verdict line and decision."""
    if replanned["error"] is None:
        return (f"re-planned after an unverifiable plan record: the error over the looks taken before it is "
                f"unknown, not {replanned['nominal']:.1%}")
    return (f"re-planned: error up to {replanned['error']:.1%} over {replanned['looks']} looks of "
            f"{replanned['metric']} under {replanned['plans']} plans, not {replanned['nominal']:.1%}")


def _signature(history: list, secret: bytes, report: str = "") -> str:
    """The signature of a plan file's ``history`` in the report folder ``report`` (its id; "": older than ids)."""
    text = json.dumps(history, sort_keys=True, separators=(",", ":"))
    tied = f"{report}\0".encode() if report else b""
    return hmac.new(secret, DOMAIN + tied + text.encode(), hashlib.sha256).hexdigest()


def parse_history(data) -> list[dict]:
    """A plan file's history, checked for its shape (ValueError: not one kvquant wrote)."""
    history = data.get("history") if isinstance(data, dict) else None
    if not isinstance(history, list) or not history:
        raise ValueError("holds no plan history")
    for entry in history:
        if not (isinstance(entry, dict) and isinstance(entry.get("looks"), dict)
                and entry.get("digest") == LookPlan.from_dict(entry.get("plan")).digest()):
            raise ValueError("a plan in its history is not one kvquant wrote (its digest does not match)")
        for taken in entry["looks"].values():
            if not isinstance(taken, dict) or not all(isinstance(e, (int, float)) and 0 <= e <= 1
                                                      for e in taken.values()):
                raise ValueError("its looks are not errors kvquant recorded")
    return history


def read_plan_file(path: Path) -> tuple[list[dict], str, str] | None:
    """The history, signature and report folder id ("": a plan file older than ids) in ``path`` (a regular file,
    never followed through a link), None where absent; ValueError where it is not a plan file kvquant wrote."""
    if not os.path.lexists(path):
        return None
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise ValueError("it is not a regular file")
    data = json.loads(read_file(path).decode("utf-8"))
    history, report = parse_history(data), data.get("report", "")
    if not (isinstance(report, str) and len(report) <= 64 and all(c in string.hexdigits for c in report)):
        raise ValueError("its report folder id is not one kvquant wrote")
    return history, str(data.get("signature")), report


def merge_histories(first: list[dict], second: list[dict]) -> list[dict] | None:
    """One history of two whose plans agree as far as the shorter goes (one went on re-planning from the other),
    every look of both kept; None where they went different ways."""
    longer, shorter = (first, second) if len(first) >= len(second) else (second, first)
    if [e["digest"] for e in longer[:len(shorter)]] != [e["digest"] for e in shorter]:
        return None
    merged = []
    for i, entry in enumerate(longer):
        both = [entry, *([shorter[i]] if i < len(shorter) else [])]
        merged.append({**entry, "looks": look_errors(both)})
    return merged


def new_plan_entry(plan: LookPlan) -> dict:
    return {"plan": plan.to_dict(), "digest": plan.digest(), "looks": {}}


#: why a plan file that verifies is not the record of the partial results beside it
FOREIGN = "is another report folder's plan, copied here (no partial result beside it was measured under it)"


class PlanRecord:
    """A run's plan and the history of plans its partial results were measured under (``<partial>/plan.json``,
    signed with the store's key). :meth:`settle` (before the model loads) refuses a changed plan unless
    ``replan``; :meth:`record` keeps the looks each judgement takes; :meth:`replanned_error` is the re-planned error.

    The plan file and every partial result beside it carry the report folder's id (random, made with its first
    plan) under their signatures (:attr:`ResultStore.report <kvquant.runner.store.ResultStore.report>`): a plan
    file copied from another report folder, or removed, under results measured here is a plan record that does
    not verify; a whole folder copied or moved keeps its id and goes on."""

    def __init__(self, store, plan: LookPlan, replan: bool = False):
        self.store, self.plan, self.replan = store, plan, replan
        self.path = store.directory / PLAN
        self.history: list[dict] = []
        self._ids, self._fresh = None, secrets.token_hex(16)

    @property
    def ids(self) -> collections.Counter:
        """How many of the partial results here are signed for each report folder id (read once, before this
        record writes anything)."""
        if self._ids is None:
            self._ids = self.store.reports()
        return self._ids

    def _carried_id(self, fresh: bool = True) -> str:
        """The report folder id most of the results here carry; where none is here, this record's fresh one
        (``fresh``; the same at every call) or ""."""
        return self.ids.most_common(1)[0][0] if self.ids else self._fresh if fresh else ""

    def identify(self) -> None:
        """Give the store this folder's id (its plan's, else its results'), reading only: what a run would reuse."""
        if self.signed_history(move=False) is None:
            self.store.report = self._carried_id()

    def settle(self) -> None:
        """Read the recorded plan, compare, and write this run's (a first plan, or one more with ``replan``);
        a changed plan without ``replan`` raises :class:`KVQuantError` with nothing written or moved. Process 0
        alone reads and writes; every process of several stops with its line."""
        refused = None
        if self.store.processes.is_main_process:
            try:
                self._settle()
            except KVQuantError as err:
                refused = str(err)
        refused = self.store.processes.broadcast(refused)
        if refused is not None:
            raise KVQuantError(refused)

    def _read(self) -> tuple[list[dict], str] | None:
        """The history and report folder id in this run's plan file, None where there is none; ValueError where
        this user's key did not sign it, or where it is another folder's (:data:`FOREIGN`)."""
        found = read_plan_file(self.path)
        if found is None:
            return None
        history, signature, report = found
        if not hmac.compare_digest(signature, _signature(history, self.store.secret, report)):
            raise ValueError("its signature does not verify: edited, or written by another user or machine")
        if self.ids and report not in self.ids:
            raise ValueError(FOREIGN)
        return history, report

    def signed_history(self, move: bool = True) -> list[dict] | None:
        """The history in this run's plan file where this user's key signed it for this report folder (the store
        then signs for the folder's id); None where there is none, or where it does not verify (then, with
        ``move``, set aside with a warning: its looks are not counted)."""
        try:
            found = self._read()
        except (OSError, ValueError, RecursionError) as err:
            self._not_a_folder()
            if move:
                aside = set_aside(self.path)
                warn(self.store.warnings, f"{self.path} is unusable ({one_line(err)[:100]}); moved to {aside.name}: "
                     "looks taken under the plans it recorded are not counted")
            return None
        if found is None:
            return None
        self.store.report = found[1]
        return found[0]

    def _not_a_folder(self) -> None:
        if os.path.lexists(self.path) and stat.S_ISDIR(os.lstat(self.path).st_mode):
            raise KVQuantError(f"{self.path} is a folder, not the plan kvquant wrote; move it away") from None

    def _unknown(self) -> str | None:
        """Why the plan the partial results here were measured under is unknown (its file does not verify, is
        another folder's, or is gone though they were measured under one), as a phrase after the file's name;
        None where it is known, or nothing was measured here."""
        if not any(self.store.directory.glob("*/*.json")):
            return None
        if not os.path.lexists(self.path):
            return "is missing, though the partial results beside it were measured under a recorded plan" \
                if any(self.ids) else None
        try:
            self._read()
        except (OSError, ValueError, RecursionError) as err:
            self._not_a_folder()
            return FOREIGN if str(err) == FOREIGN else "does not verify (edited, or written by another user or machine)"
        return None

    def adopt(self, carried: list[tuple[Path, list[dict]]], write: bool = True) -> None:
        """Merge the plan histories ``carried`` with the partial results adopted (each ``(file, history)``; their
        signatures are another machine's, so the user vouches for them as for the results) into this run's, and
        (``write``) keep them: a history that went another way than another's, or whose last plan is not this
        config's, refuses with one line (nothing written), as does a plan here that is unknown (:meth:`_unknown`)."""
        why = self._unknown()
        if why is not None:
            raise KVQuantError(f"adopt: {self.path} {why}: the plan the partial results there were measured under is "
                               "unknown; run python -m kvquant.run with --replan first, or move the folder away; "
                               "nothing adopted")
        merged = self.signed_history(move=False) or []
        if not merged:  # results placed without a plan carried with them stay without one, as they were measured
            self.store.report = self._carried_id(fresh=bool(carried))
        for path, history in carried:
            change = self.plan.difference(LookPlan.from_dict(history[-1]["plan"]))
            if change is not None:
                raise KVQuantError(f"adopt: {path}: its results were measured under another plan ({change}); adopt "
                                   "them under that plan's config, then run with --replan; nothing adopted")
            joined = merge_histories(merged, history) if merged else history
            if joined is None:
                raise KVQuantError(f"adopt: {path} records plans that went another way than those of the results "
                                   "adopted with it or already here; adopt one of them; nothing adopted")
            merged = joined
        if carried and write:
            self.history = merged
            self.write()

    def check(self) -> None:
        """Raise what :meth:`settle` refuses (a plan that is unknown beside measured results: its file does not
        verify, is another folder's or is gone; a changed plan; each unless ``replan``; a folder in its place),
        reading only: nothing written or moved (the cost preview asks, and :meth:`settle` first)."""
        why = self._unknown()
        if why is not None:
            if self.replan:
                return
            # never set the record aside silently: the run would claim the nominal error
            raise KVQuantError(
                f"{self.path} {why}: the plan the partial results in {self.store.directory} were measured under "
                "is unknown; rerun with --replan to go on (the verdict then says the error over the earlier looks "
                "is unknown), or move the folder away to start afresh")
        history = self.signed_history(move=False)
        change = None if history is None else self.plan.difference(LookPlan.from_dict(history[-1]["plan"]))
        if change is not None and not self.replan:
            raise KVQuantError(
                f"the partial results in {self.store.directory} were measured under another plan ({change}); a "
                "plan raised after the data inflates the error: rerun with the plan they were measured under, "
                "or with --replan to go on and report the error over every look taken")

    def _settle(self) -> None:
        self.check()
        measured = any(self.store.directory.glob("*/*.json"))
        if self._unknown() is not None:  # with --replan
            if os.path.lexists(self.path):
                self.signed_history()  # set aside, said
            self.store.report = self._carried_id()  # the results here go on
            self.history = [{**new_plan_entry(self.plan), UNKNOWN_BEFORE: True}]
            self.write()
            return
        history = self.signed_history()
        found = None if history is None else (history, "")
        if found is None:
            self.store.report = self._carried_id()  # its results' ("" where older than ids), else a fresh one
            if measured:
                warn(self.store.warnings, f"the partial results in {self.store.directory} carry no recorded plan "
                     "(measured before kvquant recorded plans): this run's plan is recorded from now on, and looks "
                     "taken earlier under another plan, if any, are not counted")
            self.history = [new_plan_entry(self.plan)]
            if os.path.lexists(self.store.directory):
                self.write()
            else:  # with the first result: a run stopped before any leaves no folder behind
                self.store.first_write = self.write
        else:
            self.history = found[0]
            last = LookPlan.from_dict(self.history[-1]["plan"])
            if self.plan.difference(last) is not None:  # with --replan
                self.history = [*self.history, new_plan_entry(self.plan)]
                self.write()

    def write(self) -> None:
        if not self.store.processes.is_main_process:
            return
        self.store.check_sources()
        real_dir(self.store.directory, "partial results")
        report = self.store.report
        write_file(self.path, json.dumps({"history": self.history, **({"report": report} if report else {}),
                                          "signature": _signature(self.history, self.store.secret, report)}, indent=1))

    def record(self, rows) -> dict | None:
        """Keep the looks the gate's ``rows`` took (each gated row: its documents or windows, its one-sided error)
        under the current plan, written at once where any is new; returns :meth:`replanned_error` (None in a process
        other than 0, which keeps no history)."""
        if not self.history:
            return None
        taken, new = self.history[-1]["looks"], False
        for row in rows:
            if not row.gated or self.plan.gate.get("decide_on") == "point":
                continue
            look, error = f"{row.n}@{self.plan.spec(row.metric.source)}", (1 - row.confidence) / 2
            mine = taken.setdefault(row.metric.name, {})
            if mine.get(look, -1.0) < error:
                mine[look], new = error, True
        if new:
            self.write()
        return self.replanned_error()

    def replanned_error(self) -> dict | None:
        return replanned_error(self.history, (1 - self.plan.gate["confidence"]) / 2)
