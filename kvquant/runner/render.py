"""A report rendered again from stored results, no model loaded (``python -m kvquant.run CONFIG --render-only
[--partial FOLDER]``): every (candidate, metric) result the run would read is taken from a partial-results folder
(the report's own ``partial/``, or a folder of results carried from elsewhere) and judged by today's gate.

The results are keyed by their inputs and the code version that measured them, so a run under today's code would
measure them again; here they are read under the code version they were measured by (one for the whole folder),
each checked as :mod:`kvquant.runner.travel` checks a result that travels: its key is the digest of its inputs,
its path names the candidate and metric it is the result of, one model's weights measured them all; and the inputs
this config's run would key it with, rebuilt by the run's own :class:`~kvquant.scoring.session.Session` code (the
model's config and tokenizer stand in for the model, the weights digest is the one the results name), are exactly
the ones stored. A result of other inputs, or one whose signature does not verify under this user's key (unless
its folder is named with ``--partial``: the user vouches for it, as for an adopted one), refuses the render with
one line, nothing written. Sequential looks are taken as the run takes them (:func:`.judging.add_documents`); a
look the gate asks for that the folder does not hold is not measured: the row keeps the verdict of the look before
and says which documents are not stored.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hmac
import time
from pathlib import Path

from kvquant.errors import KVQuantError, one_line
from kvquant.fs import check_env_dirs, read_json
from kvquant.experiment import provenance
from kvquant.runner.expected import Expected, difference, model_without_weights, plain
from kvquant.runner.gate import FAIL, INCONCLUSIVE
from kvquant.runner.lookplan import PLAN, LookPlan, PlanRecord, _signature, new_plan_entry, read_plan_file
from kvquant.runner.preflight import check_report_dir, context_length, preflight_warnings, say
from kvquant.experiment.provenance import commit_provenance
from kvquant.runner.store import ResultStore
from kvquant.signing import result_key
from kvquant.runner.travel import ACTION, check_found, check_looks_carried, check_weights, read_folder
from kvquant.scoring import data, parallel
from kvquant.scoring.models import check_model, load_tokenizer, model_dtype
from kvquant.scoring.session import BASELINE, Session, probe_counts
from kvquant.scoring.tasks import prepare_probe_tasks


class NotStored(Exception):
    """The folder holds no result of ``(candidate, metric)``."""

    def __init__(self, candidate: str, metric: str):
        super().__init__(f"{metric} of {candidate}")
        self.candidate, self.metric = candidate, metric


def refuse_render(message: str):
    raise KVQuantError(f"render: {message}; nothing rendered")


class StoredResults(ResultStore):
    """The results of one partial-results folder as a run's store: :meth:`get_or_compute` returns the stored result
    of exactly the inputs asked for, and never computes (:class:`NotStored` where there is none). ``vouched``: the
    folder was named by the user, so results signed under another key are taken (as ``kvquant.adopt`` takes them);
    otherwise each must verify under this user's key."""

    def __init__(self, folder: Path, warnings: list[str], vouched: bool, expected: Expected):
        token = ACTION.set(("render", "rendered"))
        try:
            found = read_folder(folder)
            codes = {report_code(f.saved["inputs"]) for f in found}
            if len(codes) > 1:
                refuse_render(f"{folder} holds results measured by {len(codes)} code versions "
                              f"({', '.join(sorted(codes))}); render the results of one")
            for f in found:  # before anything is printed or written: of this config's inputs, by that one code
                check_found(f, found[0].saved["inputs"]["code"], expected)
            check_weights(found, set(), folder)
            if vouched:  # travelled: its looks must travel with it, as kvquant.adopt requires
                check_looks_carried(folder, found)
        finally:
            ACTION.reset(token)
        secret = result_key(make=False) or b""
        super().__init__(folder, found[0].saved["inputs"]["code"], warnings, parallel.ONE, secret=secret)
        unsigned = [f for f in found if self.verified_result(f.path) is None]
        if unsigned and not vouched:
            refuse_render(f"{unsigned[0].path}: its signature does not verify under your key (edited, or written by "
                          "another user or machine); name its folder with --partial to vouch for results measured "
                          "elsewhere")
        self.found = {(f.candidate, f.metric): f for f in found}
        self.read: set[tuple[str, str]] = set()
        self.vouched = len(unsigned)
        self.weights = str(found[0].saved["inputs"].get("weights"))

    def get_or_compute(self, candidate: str, metric: str, key: dict, compute):
        found = self.found.get((candidate, metric))
        if found is None:
            raise NotStored(candidate, metric)
        inputs, digest = self._inputs(candidate, metric, key)
        if found.saved["key"] != digest:
            refuse_render(f"{found.path} is no result this config's run would read: "
                          f"{difference(plain(inputs), found.saved['inputs'])}")
        self.read.add((candidate, metric))
        self.reused = len(self.read)  # each result once, however often the looks read it again
        if isinstance(found.saved.get("seconds"), (int, float)):
            self.seconds[candidate, metric] = float(found.saved["seconds"])
        return found.saved["result"]


def report_code(inputs: dict) -> str:
    """A stored result's code version as one phrase (its measuring sources and the libraries)."""
    code = inputs.get("code")
    return ", ".join(f"{k} {v}" for k, v in sorted(code.items())) if isinstance(code, dict) else str(code)


class Replay(Session):
    """A :class:`Session` whose model is not loaded: its config (in the dtype the run loads the model in) stands
    in wherever the session reads only the config, the weights digest is the stored results', and every
    measurement comes from :class:`StoredResults`. A sequential look the folder lacks is left out (the candidate
    stays at the look before) and noted in :attr:`not_stored`."""

    def __init__(self, cfg, store: StoredResults, shape_of):
        model_config = check_model(cfg.model)
        self.cfg, self.store, self.tokenizer = cfg, store, load_tokenizer(cfg.model)
        self.model = copy.copy(model_config)
        self.model.dtype = model_dtype(cfg.model)  # what the run's model computes (and its cache stores) in
        self.shape = shape_of(model_config, cfg.model.path)  # the model's shapes, for the cache's bits
        self.processes, self.maxlen, self.weights = parallel.ONE, context_length(cfg, model_config), store.weights
        probes = probe_counts(cfg)
        self.folder = functools.cache(lambda: str(prepare_probe_tasks(self.tokenizer, probes, self.maxlen,
                                                                      "eval.tasks.names")))
        #: (label, task) -> the first look's documents the folder does not hold
        self.not_stored: dict[tuple[str, str], range] = {}

    def key(self, candidate, split):
        """:meth:`Session.key`; a cache that stores keys before RoPE is built on the model without its weights
        (:func:`~kvquant.runner.expected.model_without_weights`): make_cache takes RoPE from the model's modules."""
        if not candidate.spec.pre_rope:
            return super().key(candidate, split)
        config, self.model = self.model, self._without_weights()
        try:
            return super().key(candidate, split)
        finally:
            self.model = config

    @functools.cache  # noqa: B019  (one replay per render)
    def _without_weights(self):
        return model_without_weights(self.model)

    def measure(self, candidate, split, label=None, tasks=True, probe=None, divergence=None, shared=None):
        """:meth:`Session.measure` from the stored results, ``split``'s looks cut at the first one not stored."""
        while True:
            try:
                return super().measure(candidate, split, label, tasks, probe, divergence, shared)
            except NotStored as err:
                task, _, part = err.metric.removeprefix("task/").partition("@")
                looked = [r for r in split.more.get(task, ()) if f"{r.start}-{r.stop}" == part]
                if not err.metric.startswith("task/") or not looked:
                    raise
                self.not_stored[err.candidate, task] = looked[0]
                kept = tuple(r for r in split.more[task] if r.start < looked[0].start)
                split = dataclasses.replace(split, more={**split.more, task: kept})

    def with_unstored_looks(self, verdicts: list, statuses: dict[str, str]) -> list:
        """``verdicts`` with each inconclusive gated verdict whose next look, which the run would take (its
        candidate has not failed), is not stored saying so; a row that takes no more looks (its note says why)
        keeps its note unless the look is the candidate's own, or the baseline's within the candidate's documents
        of the task (a flips row counts fewer): a look the run took."""
        own_n: dict[tuple[str, str], int] = {}
        for v in verdicts:
            key = (v.row.candidate, v.row.metric.source)
            own_n[key] = max(v.row.n, own_n.get(key, 0))
        out = []
        for v in verdicts:
            key = (v.row.candidate, v.row.metric.source)
            own, base = self.not_stored.get(key), self.not_stored.get((BASELINE.label, key[1]))
            missing = own or base
            taken = v.note is None or own is not None or (base is not None and base.start < own_n[key])
            if missing is not None and v.row.gated and v.verdict == INCONCLUSIVE and taken and \
                    statuses[v.row.candidate] != FAIL:
                v = dataclasses.replace(v, note=f"documents {missing.start}-{missing.stop - 1} not stored yet; "
                                                "the run without --render-only takes them")
            out.append(v)
        return out

    def render_provenance(self, out_dir: Path) -> dict:
        """What the report's header and results.json say of this render (:attr:`Provenance.rendered`)."""
        code, judged = dict(self.store.code), provenance.code_version()["kvquant_source_sha256"]
        try:  # the report it replaces names the commit of these measuring sources (measured or, rendered, its own)
            earlier = read_json(out_dir / "results.json", "report")
            named = [earlier.get("environment"), (earlier.get("rendered") or {}).get("measured_by")]
        except (KVQuantError, AttributeError):
            named = []
        for env in (e for e in named if isinstance(e, dict) and e.get("git_commit")):
            if env.get("kvquant_source_sha256") == code["kvquant_source_sha256"]:
                code["git_commit"] = env["git_commit"]
        return {"from": str(self.store.directory), "results": len(self.store.found), "vouched": self.store.vouched,
                "measured_by": code,
                "judged_by": {"kvquant_source_sha256": judged, "git_commit": commit_provenance(judged)},
                "not_stored": [f"{label} {task} documents {r.start}-{r.stop - 1}"
                               for (label, task), r in sorted(self.not_stored.items())]}


class ReadOnlyRecord(PlanRecord):
    """The plan history the folder carries, kept in memory: the looks the render takes count toward the re-planned
    error, and nothing is written."""

    def write(self) -> None:
        return None


def plan_record(cfg, store: StoredResults, vouched: bool, replan: bool) -> PlanRecord | None:
    """The plan the stored results were measured under (the folder's ``plan.json``): a changed plan refuses unless
    ``replan`` (then the error over every look taken is reported); None, with a warning, where the folder carries
    no plan (results measured before kvquant recorded plans: judged under this config's plan)."""
    path = store.directory / PLAN
    try:
        found = read_plan_file(path)
    except (OSError, ValueError, RecursionError) as err:
        refuse_render(f"{path} is not a plan kvquant wrote ({one_line(err)[:100]})")
    if found is None:
        store.warnings.append(f"{store.directory} carries no recorded plan (measured before kvquant recorded plans)"
                              ": judged under this config's plan as if it was fixed before the data; looks taken "
                              "under another plan, if any, are not counted")
        return None
    history, signature, report = found
    if not vouched and not hmac.compare_digest(signature, _signature(history, store.secret, report)):
        refuse_render(f"{path}: its signature does not verify under your key; name its folder with --partial to vouch "
                      "for it")
    plan = LookPlan.of(cfg)
    record = ReadOnlyRecord(store, plan, replan)
    change = plan.difference(LookPlan.from_dict(history[-1]["plan"]))
    if change is not None and not replan:
        refuse_render(f"the results in {store.directory} were measured under another plan ({change}); render with the "
                      "config of that plan, or with --replan to report the error over every look taken")
    record.history = [*history, *([new_plan_entry(plan)] if change is not None else [])]
    return record


def render_only(cfg, plan, out_dir: Path, command: str, folder: Path | None, replan: bool, steps,
                shape_of) -> int:
    """``python -m kvquant.run CONFIG --render-only``: the report of ``cfg``'s run (``plan``: its steps) judged by
    today's gate from the results stored in ``folder`` (None: the report's own ``partial/``, whose signatures must
    verify under this user's key; a folder named is vouched for), written through ``steps`` (the runner's
    ``take_steps``, with the session standing in for the model; ``shape_of``: the planner's ``shape_from_config``,
    which the session's bits per element are computed on). Returns the gate's exit code."""
    if any(c.calibrate for c in [*cfg.candidates, *cfg.stages]):
        refuse_render("calibration runs on the model between measurements; only runs without it are rendered from "
                      "stored results")
    check_env_dirs()
    check_report_dir(out_dir)
    model_config = check_model(cfg.model)
    warnings = preflight_warnings(cfg, model_config, [])
    expected = Expected(cfg, model_config, context_length(cfg, model_config))
    store = StoredResults(folder or out_dir / "partial", warnings, folder is not None, expected)
    record = plan_record(cfg, store, folder is not None, replan)
    found = len(warnings)  # printed once the report is written (a refusal stays one line)
    rows = {p.name: data.load_rows(p) for p in cfg.eval.perplexity}
    try:
        code = steps(Replay(cfg, store, shape_of), plan, out_dir, command, rows, time.monotonic(), record)
    except NotStored as err:
        refuse_render(f"{store.directory} holds no {err.metric} of {err.candidate}, which the report needs; measure it "
                      "(python -m kvquant.run CONFIG) or name the folder that holds it")
    say(warnings[:found])  # the report's header holds them too
    return code
