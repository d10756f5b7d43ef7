"""What a run measures: the baseline and every candidate of a config, each (candidate, metric) result through
the run's :class:`kvquant.runner.store.ResultStore` so finished results are kept and reused.

Everything that decides a measured value lives here or below (cache, quantizers, scoring, data, tasks); the
runner, config, gate and report code only orchestrate and render, so they are not part of a result's code version
(:func:`kvquant.experiment.provenance.code_version`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import dataclasses
import os
from dataclasses import asdict, dataclass

import torch

from kvquant.cache import make_cache, spec_memory
from kvquant.compat.lm_eval import quiet_git
from kvquant.scoring import data
from kvquant.scoring.data import windows_digest

from kvquant.scoring import parallel
from kvquant.experiment.config import Candidate, ExperimentConfig
from kvquant.experiment.gate_config import looks
from kvquant.errors import KVQuantError
from kvquant.scoring.divergence import divergences
from kvquant.scoring.scorer import Scorer, memory_probe, perplexity_samples
from kvquant.scoring.models import max_length
from kvquant.experiment.results import (LONG_CONTEXT, Measured, Memory, Outcomes, divergence_outcomes, long_outcomes,
    perplexity_outcomes, task_outcomes)
from kvquant.scoring.longctx import position_divergences
from kvquant.scoring.task_setup import lm_eval_task
from kvquant.scoring.tasks import (MAX_PROBE_DOCUMENTS, PROBE_DOCUMENTS, gated_metric, prepare_probe_tasks,
    probe_length, probe_tasks, resolve_task, task_data_digest, task_manager)

BASELINE = Candidate(quantizer="fp16", name="baseline")
#: Candidates compared with the baseline's next-token distributions in one pass of it over the windows: the baseline
#: is scored once for them all, not once per candidate (an interrupted run recomputes at most one such group).
SHARED_BASELINE = 4


def shares_prefix(candidate: Candidate) -> bool:
    """Whether requests sharing a context read it from one prefilled, forked cache (a stage says; plain
    candidates always do, which scores exactly as prefilling each request: tested)."""
    return getattr(candidate, "prefix_sharing", True)


def cache_settings(cache) -> dict:
    """A cache's options and what it derived from the model (the groups actually used), per-layer settings last:
    resume keys and reports."""
    settings = cache.settings()
    layers = settings.pop("layers", None)
    return {**settings, **cache.derived_settings(), **({"layers": layers} if layers else {})}


def check_baseline_finite(scores: list[float], cfg: ExperimentConfig, what: str) -> None:
    """Scores that are not finite through the identity cache mean the model is broken, not the quantizer."""
    bad = sum(1 for x in scores if not math.isfinite(float(x)))
    if bad:
        raise KVQuantError(f"model {cfg.model.path!r}: {what} scores NaN or Inf through the identity cache (the fp16 "
                           f"baseline; {bad} of {len(scores)} scores), so the model itself is broken, not a quantizer")


@contextlib.contextmanager
def _environ(**values: str):
    """``os.environ`` with ``values`` set inside the block, as it was after it."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def task_lm(model, tokenizer, candidate: Candidate, cfg: ExperimentConfig, maxlen: int):
    """The lm-eval model a task is scored with through ``candidate``'s cache (``KVQuantLM``, as the run configures
    it)."""
    from kvquant.scoring.lm_eval_model import KVQuantLM

    return KVQuantLM(model, tokenizer=tokenizer, quantizer=candidate.spec, mode=cfg.eval.mode,
                     chunk_size=cfg.eval.chunk_size, batch_size=cfg.eval.batch_size, max_length=maxlen,
                     share_prefix=shares_prefix(candidate), share_out="requests")


def evaluate_task(lm, cfg: ExperimentConfig, task: str, folder: str, documents: list[int] | None = None,
                  found=None) -> tuple[str, dict]:
    """lm-eval's evaluation of one task with ``lm``: (its lm-eval name, lm-eval's output with the samples);
    ``documents``: these document indices instead of the first ``limit``; ``found``: the task object, loaded
    already (:func:`~kvquant.scoring.task_setup.lm_eval_task` with the config's sampler)."""
    import lm_eval

    name = resolve_task(task)
    sampler = cfg.eval.tasks.fewshot_sampler
    seed = cfg.eval.seed
    limit = cfg.eval.tasks.limit_for(task) or (PROBE_DOCUMENTS if probe_length(task) is not None else None)
    with _environ(LOCAL_RANK="0"), quiet_git():  # lm-eval returns results only where it is 0;
        # under several processes here, every one builds every request and holds every score (share_out)
        found = found if found is not None else name if sampler == "default" else lm_eval_task(task, folder, sampler)
        out = lm_eval.simple_evaluate(model=lm, tasks=[found], num_fewshot=cfg.eval.tasks.fewshot_for(task),
                                      limit=None if documents else limit,
                                      samples={name: list(documents)} if documents else None,
                                      task_manager=task_manager(folder, name), log_samples=True,
                                      bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed,
                                      torch_random_seed=seed, fewshot_random_seed=seed, verbosity="ERROR")
    return name, out


def sampler_key(cfg: ExperimentConfig) -> dict:
    """The few-shot sampler in a task result's key where it is not lm-eval's default (whose results keep the keys
    they had before the sampler could be chosen)."""
    sampler = cfg.eval.tasks.fewshot_sampler
    return {} if sampler == "default" else {"fewshot_sampler": sampler}


def task_size(session: Session, task: str) -> int:
    """How many documents a task holds (lm-eval's evaluation split of it); a probe task (passkey, needle), whose
    documents are generated: those this config has written (:func:`probe_counts`), whatever else an earlier run
    left in a shared task folder."""
    if probe_length(task) is not None:
        return probe_counts(session.cfg)[task]
    return len(lm_eval_task(task, session.folder()).eval_docs)


def run_task(model, tokenizer, candidate: Candidate, cfg: ExperimentConfig, task: str, maxlen: int,
             folder: str, documents: list[int] | None = None) -> dict:
    """Accuracy of one lm-eval task through the candidate's cache, with per-document outcomes; ``folder``: the
    task files (:func:`kvquant.scoring.tasks.task_dir`); ``documents``: these document indices instead of the first
    ``limit``."""
    lm = task_lm(model, tokenizer, candidate, cfg, maxlen)
    name, out = evaluate_task(lm, cfg, task, folder, documents)
    samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
    if candidate is BASELINE:
        scores = [r[0] for s in samples for r in s["filtered_resps"] if isinstance(r, (list, tuple))]
        check_baseline_finite(scores, cfg, f"task {task!r}")
    metrics = [m for m in ("acc", "acc_norm") if f"{m},none" in out["results"][name]]
    return {"task": name, **{m: [float(s[m]) for s in samples] for m in metrics},
            "reads": lm.scorer.reads.to_dict(), "lengths": lm.scorer.lengths}


def probe_counts(cfg: ExperimentConfig, first_look: bool = False) -> dict[str, int]:
    """Documents each probe task (passkey, needle) needs written: its evaluation documents (a sequential gate's
    last look where it gates the task, unless ``first_look``: the cost preview builds no other), plus the
    calibration documents after them when the search gates it."""
    counts = probe_tasks(cfg.eval.tasks.names, cfg.eval.tasks.limit_for)
    if cfg.gate.max_documents is not None and not first_look:
        for task in cfg.gated_tasks():
            if task in counts:
                last = looks(cfg.eval.tasks.limit_for(task), cfg.gate.max_documents)[-1]
                counts[task] = max(counts[task], min(last, MAX_PROBE_DOCUMENTS))
    if cfg.search and cfg.search.documents:  # refused with a sequential gate (config): nothing else to cover
        for task in cfg.gated_tasks():
            if probe_length(task) is not None:
                counts[task] = cfg.eval.tasks.limit_for(task) + cfg.search.documents
    return counts


@torch.no_grad()
def weights_digest(model, tokenizer) -> str:
    """A digest of what the model computes with: its config, its tokenizer (vocabulary, merges, special tokens)
    and its weights (per tensor: name, dtype, shape and bytes), so a result is never reused for another model
    behind the same path; one pass over the weights, far cheaper than any evaluation. Where the model was read from
    is no part of it (the config's ``_name_or_path``), nor how many threads read it: the same model in another
    folder or on another machine digests the same. (Was: each tensor's sum and sum of squares, whose rounding
    follows torch's thread count: Qwen2.5 digested three ways at 1, 2 and 4 threads, so a result measured on a
    machine of other cores, or under another ``OMP_NUM_THREADS``, was keyed as another model's.)"""
    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update((backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))).encode())
    for name, p in model.named_parameters():
        if p.device.type != "meta":
            digest.update(f"{name}{p.dtype}{tuple(p.shape)}".encode())
            digest.update(p.detach().reshape(-1).view(torch.uint8).cpu().numpy())  # reshape: contiguous
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Split:
    """What a measurement reads: ``name`` (``evaluation`` or ``calibration``, part of every resume key), the
    token windows of each perplexity set, and each task's documents (None: the first ``eval.tasks.limit``), then
    ``more`` of them: further ranges of documents, each measured and kept on its own and appended in order (a
    sequential gate adds documents this way, and every document scored stays scored)."""

    name: str
    windows: dict[str, list[data.Window]]
    documents: dict[str, range | None]
    progress: bool = True  # a progress bar per perplexity set
    more: dict[str, tuple[range, ...]] = dataclasses.field(default_factory=dict)
    #: the long documents of ``eval.long_context`` (evaluation only)
    long: tuple[data.Window, ...] = ()


def long_windows(cfg: ExperimentConfig, tokenizer, maxlen: int, rows: dict[str, list[str]]) -> list[data.Window]:
    """``eval.long_context``'s documents: windows of its longest length cut from its text's rows, joined."""
    long = cfg.eval.long_context
    if long is None:
        return []
    pset = next(p for p in cfg.eval.perplexity if p.name == long.text)
    pset = dataclasses.replace(pset, layout="stream", limit=long.documents, max_length=long.lengths[-1], stride=None)
    return data.windows(pset, tokenizer, maxlen, rows[long.text])


def check_long_documents(cfg: ExperimentConfig, tokenizer, context: int, rows: dict[str, list[str]]) -> None:
    """Before the model loads: ``eval.long_context``'s lengths fit the model's ``context`` and its text holds
    ``documents`` windows of the longest (one line naming what is short, else)."""
    long = cfg.eval.long_context
    if long.lengths[-1] > context:
        raise KVQuantError(f"eval.long_context.lengths: {long.lengths[-1]} tokens is beyond the model's context "
                           f"({context} positions); the longest bucket must end at or below it")
    got = long_windows(cfg, tokenizer, context, rows)
    full = sum(len(w.ids) == long.lengths[-1] for w in got)
    if full < long.documents:
        raise KVQuantError(f"eval.long_context: perplexity set {long.text!r} holds {full} windows of "
                           f"{long.lengths[-1]} tokens, fewer than documents ({long.documents}); lower documents or "
                           "the longest length, or name a longer text")


def evaluation_split(cfg: ExperimentConfig, tokenizer, maxlen: int, rows: dict[str, list[str]]) -> Split:
    """The windows and documents every candidate is evaluated on; ``rows``: each perplexity set's text."""
    return Split("evaluation", {p.name: data.windows(p, tokenizer, maxlen, rows[p.name]) for p in cfg.eval.perplexity},
                 dict.fromkeys(cfg.eval.tasks.names), long=tuple(long_windows(cfg, tokenizer, maxlen, rows)))


@dataclass
class SharedBaseline:
    """The candidates one :func:`measure_all` call measures, in order: their divergences share the baseline's
    scoring (one computed ahead of its candidate's turn is stored at once). Without one, every divergence scores
    the baseline for itself."""

    ahead: list[Candidate] = dataclasses.field(default_factory=list)


class Session:
    """One model, tokenizer, config and result store: measures any candidate on any split, each (candidate,
    metric) result through the store (kept and reused, keyed by everything that decides it)."""

    def __init__(self, cfg: ExperimentConfig, model, tokenizer, store, shape, first_look: bool = False):
        self.cfg, self.model, self.tokenizer, self.store, self.shape = cfg, model, tokenizer, store, shape
        self.processes = parallel.current()  # several share out every measurement's scoring
        self.maxlen = max_length(model, cfg.model)
        self.weights = weights_digest(model, tokenizer)
        # probe documents are cut with this tokenizer, written when first needed (``first_look``: those of the
        # first look only, as the cost preview builds no other)
        probes = probe_counts(cfg, first_look)
        self.folder = functools.cache(lambda: str(prepare_probe_tasks(tokenizer, probes, self.maxlen,
                                                                      "eval.tasks.names")))

    def measure(self, candidate: Candidate, split: Split, label: str | None = None, tasks: bool = True,
                probe: list[int] | None = None, divergence: bool | None = None,
                shared: SharedBaseline | None = None) -> Measured:
        """``candidate``'s outcomes on ``split`` (its tasks too unless ``tasks`` is False; its KL divergence from
        the baseline when ``divergence``, by default on the evaluation split only, sharing the baseline's scoring
        with the candidates ``shared`` holds after it) and, given ``probe`` tokens, its memory; stored under
        ``label`` (default: the candidate's)."""
        label = label or candidate.label
        shared = shared or SharedBaseline()
        key = self.key(candidate, split.name)
        settings = key["settings"]
        divergent = candidate is not BASELINE and (split.name == "evaluation" if divergence is None else divergence)
        outcomes, compared = [], []
        for name, ws in split.windows.items():
            raw = self._divergence(candidate, label, key, name, ws, split.progress, shared) if divergent else None
            outcomes.append(self._perplexity(candidate, label, key, name, ws, split.progress, raw))
            if raw is not None:
                compared += divergence_outcomes(name, raw, self._bits(candidate, [len(w.ids) for w in ws]))
        outcomes += compared
        if split.long and candidate is not BASELINE:
            outcomes += self._long(candidate, label, key, list(split.long), split.progress, shared)
        for task, documents in (split.documents.items() if tasks else ()):
            chunks = [self._task(candidate, label, key, task, documents)]
            chunks += [self._task(candidate, label, key, task, more, f"@{more.start}-{more.stop}")
                       for more in split.more.get(task, ())]
            outcomes += [Outcomes.concat(parts) for parts in zip(*chunks)]
        memory = self._memory(candidate, label, key, settings, probe) if probe else None
        return Measured(label, tuple(outcomes), memory)

    def key(self, candidate: Candidate, split: str) -> dict:
        """What every result of ``candidate`` on split ``split`` is keyed by (each metric adds its own data)."""
        cfg = self.cfg
        settings = cache_settings(make_cache(self.model, candidate.spec))  # what the cache uses, defaults filled
        return {"model": asdict(cfg.model), "weights": self.weights, "mode": cfg.eval.mode,
                "chunk_size": cfg.eval.chunk_size, "batch_size": cfg.eval.batch_size, "seed": cfg.eval.seed,
                "max_length": self.maxlen, "split": split, "settings": settings,
                **({} if shares_prefix(candidate) else {"prefix_sharing": False})}

    def task_key(self, key: dict, task: str, documents: range | None) -> dict:
        """A task result's key: ``key`` (:meth:`key`) with the task, its documents (None: the first ``limit``), its
        shots and sampler and its data."""
        cfg = self.cfg
        which = ({"documents": [documents.start, documents.stop]} if documents is not None
                 else {"limit": cfg.eval.tasks.limit_for(task)})
        return {**key, "task": task, **which, "num_fewshot": cfg.eval.tasks.fewshot_for(task), **sampler_key(cfg),
                "data": task_data_digest(task)}

    def _perplexity(self, candidate, label, key, name: str, windows: list[data.Window], progress: bool,
                    compared: dict | None = None) -> Outcomes:
        """Perplexity of a set, window by window; from the scoring that ``compared`` it with the baseline (a
        :func:`divergences` result) where there is one, else scored for itself."""
        ids = windows_digest(windows)
        desc = f"{label} {name}" if progress else None
        if compared is not None and "nll" in compared:
            compute = lambda: {k: compared[k] for k in ("nll", "tokens", "reads", "lengths")}  # noqa: E731
        else:
            compute = lambda: perplexity_samples(  # noqa: E731
                self._scorer(candidate), windows, desc, self._keep_in_store(label, f"ppl/{name}", key))
        raw = self.store.get_or_compute(label, f"ppl/{name}", {**key, "windows": ids}, compute)
        if candidate is BASELINE:
            check_baseline_finite(raw["nll"], self.cfg, f"perplexity {name!r}")
        return perplexity_outcomes(name, raw, self._bits(candidate, [len(w.ids) for w in windows]))

    def _scorer(self, candidate: Candidate) -> Scorer:
        """A scorer of its own (so what it counts is one measurement's) reading through ``candidate``'s caches."""
        cfg = self.cfg
        return Scorer(self.model, candidate.spec,
                      cfg.eval.mode, cfg.eval.chunk_size, batch_size=cfg.eval.batch_size,
                      share_prefix=shares_prefix(candidate), processes=self.processes)

    def _divergence(self, candidate, label, key, name: str, windows: list[data.Window], progress: bool,
                    shared: SharedBaseline) -> dict:
        """KL divergence from the baseline's next-token distributions on a perplexity set, window by window (and
        the candidate's log-likelihood from the same scoring): the raw result."""
        ids = windows_digest(windows)
        desc = f"{label} {name} divergence" if progress else None
        return self.store.get_or_compute(label, f"kl/{name}", {**key, "windows": ids},
                                         lambda: self._shared_pass(candidate, label, f"kl/{name}", key, ids, windows,
                                                                   desc, shared))

    def _long(self, candidate, label, key, windows: list[data.Window], progress: bool,
              shared: SharedBaseline) -> list[Outcomes]:
        """Divergence by position on the long documents (``eval.long_context``), as per-bucket outcomes."""
        long = self.cfg.eval.long_context
        ids = windows_digest(windows, long=True)
        desc = f"{label} {long.text} long documents" if progress else None
        what = f"long/{long.text}"
        raw = self.store.get_or_compute(
            label, what, {**key, "windows": ids},
            lambda: self._shared_pass(candidate, label, what, key, ids, windows, desc, shared, by_position=True))
        return long_outcomes(long.text, raw, long.lengths, self._bits(candidate, [len(w.ids) for w in windows]))

    def _keep_in_store(self, label: str, metric: str, key: dict):
        """The :data:`~kvquant.scoring.windowed.Keep` of ``label``'s ``metric`` pass: each finished group of its
        windows a result of the store's :meth:`~kvquant.runner.store.ResultStore.window_groups`, keyed by ``key`` and
        the group's own windows."""
        groups = self.store.window_groups()
        return lambda start, stop, ws, compute: groups.get_or_compute(
            label, f"{metric}@{start}-{stop}", {**key, "windows": windows_digest(ws)}, compute)

    def _shared_pass(self, candidate, label, metric: str, key: dict, ids: str, windows: list[data.Window],
                     desc: str | None, shared: SharedBaseline, by_position: bool = False) -> dict:
        """``label``'s ``metric`` result on ``windows`` (digest ``ids``; ``key``: :meth:`key` of ``candidate``),
        its divergence from the baseline (``by_position``: per position of each whole window,
        :func:`position_divergences`): computed beside up to :data:`SHARED_BASELINE` - 1 of the candidates
        ``shared`` holds after it that have no stored result of it yet, which share the baseline's scoring. Theirs
        are stored as soon as the pass ends (an interruption after it loses none), and read back in their turn."""
        ahead = shared.ahead
        keys = {c.label: {**self.key(c, key["split"]), "windows": ids}
                for c in ahead[ahead.index(candidate) + 1 :]} if label == candidate.label and candidate in ahead \
            else {}
        # decided by the main process (it reads the store) so every process scores the same group
        stored = self.processes.broadcast({name for name, k in keys.items() if self.store.reusable(name, metric, k)}
                                          if self.processes.is_main_process else None)
        later = [c for c in ahead if c.label in keys and c.label not in stored]
        group = [candidate, *later[: SHARED_BASELINE - 1]]
        scorers = [self._scorer(c) for c in group]
        if by_position:
            raws = position_divergences(self._scorer(BASELINE), scorers, [w.ids for w in windows], desc)
        else:  # its groups are kept as the first candidate's, keyed by every candidate compared in them
            beside = [[c.label, keys[c.label]["settings"]] for c in group[1:]]
            raws = divergences(self._scorer(BASELINE), scorers, windows, desc,
                               self._keep_in_store(label, metric, {**key, "beside": beside}))
        for other, raw in zip(group[1:], raws[1:]):
            self.store.store_ahead(other.label, metric, keys[other.label], raw)
        return raws[0]

    def _bits(self, candidate, lengths: list[int]) -> float:
        """Bits per element this cache stores at the median of ``lengths`` tokens (its own code, shapes only)."""
        if not lengths:
            return math.nan
        tokens = max(1, int(sorted(lengths)[len(lengths) // 2]))
        return spec_memory(candidate.spec, self.shape, tokens=tokens, dtype=self.model.dtype)["bits_per_element"]

    def _task(self, candidate, label, key, task: str, documents: range | None, part: str = "") -> list[Outcomes]:
        cfg = self.cfg
        raw = self.store.get_or_compute(
            label, f"task/{task}{part}", self.task_key(key, task, documents),
            lambda: run_task(self.model, self.tokenizer, candidate, cfg, task, self.maxlen, self.folder(),
                             list(documents) if documents is not None else None))
        outcomes = task_outcomes(task, raw, gated_metric(task), self._bits(candidate, raw.get("lengths", [])))
        if task in cfg.gated_tasks() and not any(o.metric.standard for o in outcomes):
            raise KVQuantError(f"gate.tasks: task {task!r} reports no {gated_metric(task)} (what it is gated on), "
                               "so the gate could not judge it; gate other tasks")
        return outcomes

    def _memory(self, candidate, label, key, settings: dict, probe: list[int]) -> Memory:
        measured = self.store.get_or_compute(label, "memory", {**key, "probe": probe},
                                             lambda: memory_probe(self.model, candidate.spec, probe))
        # the planner's arithmetic at a long context, by the cache's own code
        long = spec_memory(candidate.spec, self.shape, tokens=LONG_CONTEXT, dtype=self.model.dtype)
        return Memory(settings, measured, long)


def probe_tokens(cfg: ExperimentConfig, split: Split, tokenizer, maxlen: int) -> list[int]:
    """The tokens every cache's memory is measured after: ``eval.memory_probe_tokens`` of the perplexity text
    (without any, a phrase repeated: bytes do not depend on which tokens)."""
    size = min(cfg.eval.memory_probe_tokens, maxlen)
    probe = [t for ws in split.windows.values() for w in ws for t in w.ids] or tokenizer("Once upon a time").input_ids
    return (probe * -(-size // len(probe)))[:size]


def measure_all(session: Session, candidates: list[Candidate], rows: dict[str, list[str]]) -> dict[str, Measured]:
    """The baseline and every candidate on the evaluation split, with memory: ``{label: Measured}``.
    ``rows``: the text of every perplexity set, read by preflight."""
    split = evaluation_split(session.cfg, session.tokenizer, session.maxlen, rows)
    probe = probe_tokens(session.cfg, split, session.tokenizer, session.maxlen)
    shared = SharedBaseline(list(candidates))
    return {c.label: session.measure(c, split, probe=probe, shared=shared) for c in [BASELINE, *candidates]}
