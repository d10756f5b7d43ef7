"""What a run will cost, before anything is measured (issue 39 item 3): ``python -m kvquant.run CONFIG --dry-run``.

For the baseline and every candidate, each scoring pass of the evaluation split: the documents it starts with, the
most it may take (a sequential gate's looks, up to ``gate.max_documents`` or the task's end), the model tokens each
costs, and a time from a short timing probe of each setting on this machine.

Tokens are those of every request a scorer is handed, context + continuation, counted as the run's scorer records
them (``Scorer.lengths``, kept in every result as ``lengths``): a task's first look is built here by lm-eval with the
model's tokenizer exactly as the run builds it (its first :data:`SAMPLE_DOCUMENTS` documents where it holds more),
with a recorder in place of the scorer (each task loaded once); perplexity and long-context windows are cut as the
run cuts them. Larger looks are priced from counts, never built: the tokens per document of those built times the
documents each look holds (so the preview takes the same time whatever
``gate.max_documents`` is, and writes no probe document beyond the first look's). A result the run would reuse from
the report folder's signed partial results (:meth:`kvquant.runner.store.ResultStore.reusable`: read, never moved)
costs nothing, and the preview says how many there are. Streaming mode with prefix sharing runs a shared context
through the model once, so fewer tokens pass through it than it scores. A candidate's perplexity and KL divergence
come from one pass; the baseline is scored again beside every :data:`~kvquant.scoring.session.SHARED_BASELINE`
candidates for the divergences. Not previewed: calibration, the search, a staged run's serving loop and the memory
probe (a calibrating setting's results are priced as measured: their keys hold the scales calibration finds).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvquant.compat.lm_eval import quiet_git
from kvquant.experiment import provenance
from kvquant.experiment.config import Candidate, ExperimentConfig
from kvquant.runner.gate import duration
from kvquant.experiment.gate_config import looks
from kvquant.runner.lookplan import LookPlan, PlanRecord
from kvquant.runner.preflight import say
from kvquant.runner.store import ResultStore
from kvquant.signing import result_key
from kvquant.scoring.models import load_model
from kvquant.scoring.prefixes import model_tokens
from kvquant.scoring.scorer import Scored, Scorer
from kvquant.scoring.session import (BASELINE, SHARED_BASELINE, Session, evaluate_task, evaluation_split,
                                     probe_counts, shares_prefix, task_lm, windows_digest)
from kvquant.scoring.task_setup import lm_eval_task
from kvquant.scoring.tasks import probe_length

#: Request tokens each setting's timing probe scores, after a warm-up of WARM_UP tokens (a probe of 1,024 tokens,
#: warmed up on as many, was most of a dry run's time with six settings of SmolLM2 on 2 shared cores)
PROBE_TOKENS = 256
WARM_UP = 64
#: Quantizer options that set the numbers a cache holds, not the work it does: settings of one quantizer class that
#: differ only in these run the same code on tensors of the same shapes, so one timing probe prices them all
#: (SmolLM2-135M, configs/smollm2-decide.yaml's settings each scoring WikiText-2 requests of 128, 256 and 1,024
#: tokens, CPU seconds on one thread of 2 shared CPU cores, 2026-12-06: int4 g32, int4 g128 and K8V4 g32 within 5% of
#: each other, as close as two probes of one setting; every setting, the baseline too, within 15%)
SAME_WORK = ("key_bits", "value_bits", "group_size", "key_group_size", "value_group_size", "rotation_seed")
#: Documents of a task whose requests are built to price it: its first look where that holds no more (exact), else
#: these first ones, their tokens per document times the documents of each look.
SAMPLE_DOCUMENTS = 32


@dataclass(frozen=True)
class Cost:
    """One scoring pass of a run: whose scorer (``scorer``), on what (``measurement``, as results name it), the
    documents it starts with and the request tokens they cost, and the most documents and tokens it may take."""

    scorer: str
    measurement: str
    documents: int
    tokens: int
    most_documents: int
    most_tokens: int
    #: whose timing probe prices it (None: ``scorer``'s own; the baseline's divergence passes name the baseline)
    setting: str | None = None
    #: the tokens the scorer feeds the model for them (fewer where contexts are shared:
    #: :func:`kvquant.scoring.prefixes.model_tokens`), at the first look and at most
    fed: int = 0
    most_fed: int = 0
    seconds: float = float("nan")
    most_seconds: float = float("nan")
    #: of the results this pass makes (a task: one per look), those the run would reuse (their model tokens: 0)
    reused: int = 0
    results: int = 1


class Recorder:
    """Stands in for a :class:`Scorer` under lm-eval: records each request handed to it and scores nothing."""

    def __init__(self):
        self.requests: list[tuple[list[int], list[int]]] = []

    def score_many(self, requests, desc=None, local=False):
        self.requests += [(list(c), list(t)) for c, t in requests]
        return [Scored(torch.zeros(len(t)), torch.zeros(len(t), dtype=torch.bool)) for _, t in requests]


def recorded_requests(model, tokenizer, tasks: list[str], limit: int, shots: int = 0, sampler: str = "default",
                      seed: int = 0, first: int = 0) -> list[tuple[list[int], list[int]]]:
    """Every ``(context ids, continuation ids)`` lm-eval asks of ``tasks`` (``limit`` documents each from document
    ``first`` on, ``shots`` examples drawn by ``sampler``: :func:`kvquant.scoring.task_setup.use_sampler`), as
    ``KVQuantLM`` hands them to its scorer."""
    import lm_eval

    from kvquant.scoring.lm_eval_model import KVQuantLM
    from kvquant.scoring.tasks import task_dir

    lm = KVQuantLM(model, tokenizer=tokenizer, quantizer="fp16")
    lm.scorer = Recorder()
    found = [lm_eval_task(t, task_dir(), sampler) for t in tasks]
    samples = {t.config.task: list(range(first, first + limit)) for t in found} if first else None
    with quiet_git():
        lm_eval.simple_evaluate(model=lm, tasks=found, limit=None if first else limit, samples=samples,
                                num_fewshot=shots, bootstrap_iters=0,
                                verbosity="ERROR", random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                fewshot_random_seed=seed)
    return lm.scorer.requests


def tokens_per_call(session: Session, requests: list, label: str) -> int:
    """Tokens the scorer of ``label`` feeds the model for one scoring call of ``requests``."""
    cfg = session.cfg
    shares = {c.label: shares_prefix(c) for c in [BASELINE, *(cfg.stages or cfg.candidates)]}
    return model_tokens(requests, cfg.eval.mode, cfg.eval.chunk_size, shares.get(label, True))


def request_tokens(requests: list) -> int:
    return sum(len(c) + len(t) for c, t in requests)


def task_costs(session: Session, reuse, task: str, labels: list[str], samples: dict) -> list[Cost]:
    """Every scorer's pass over ``task``: the first look's documents, and the most a sequential gate may add (its
    looks, up to ``gate.max_documents`` or the task's end, as :func:`.judging.add_documents` takes them), priced
    from the requests of the first look (built once, as the run builds them) or of its first
    :data:`SAMPLE_DOCUMENTS` documents where it holds more: their tokens per document times each look's documents."""
    cfg, folder = session.cfg, session.folder()
    found = lm_eval_task(task, folder, cfg.eval.tasks.fewshot_sampler)  # the only time it is loaded
    size = probe_counts(cfg)[task] if probe_length(task) is not None else len(found.eval_docs)
    first = min(cfg.eval.tasks.limit_for(task) or size, size)
    lm = task_lm(session.model, session.tokenizer, BASELINE, cfg, session.maxlen)
    lm.scorer = Recorder()
    built = None if first <= SAMPLE_DOCUMENTS else list(range(SAMPLE_DOCUMENTS))  # the first look, or a sample
    name, evaluated = evaluate_task(lm, cfg, task, folder, built, found=found)
    sampled, requests = len(evaluated["samples"][name]), lm.scorer.requests
    samples.setdefault(f"task/{task}", requests)
    parts: list[range | None] = [None]  # the first look, then each later look's documents
    if task in cfg.gated_tasks() and cfg.gate.max_documents is not None:
        scored = first
        for n in looks(cfg.eval.tasks.limit_for(task), cfg.gate.max_documents):
            if min(n, size) > scored:
                parts.append(range(scored, min(n, size)))
                scored = min(n, size)
    tokens = request_tokens(requests)
    counts = [first, *(len(p) for p in parts[1:])]  # documents of each look

    def per(spent: int) -> list[int]:  # ``spent`` for the documents built, for each look's documents
        return [round(spent * n / max(sampled, 1)) for n in counts]

    out = []
    for label in labels:
        key = reuse.key(label)
        kept = [reuse(label, f"task/{task}" + (f"@{p.start}-{p.stop}" if p is not None else ""),
                      session.task_key(key, task, p)) for p in parts]
        each, spent = per(tokens), per(tokens_per_call(session, requests, label))
        out.append(Cost(label, f"task/{task}", first, each[0], sum(counts), sum(each),
                        fed=0 if kept[0] else spent[0], most_fed=sum(n for n, k in zip(spent, kept) if not k),
                        reused=sum(kept), results=len(parts)))
    return out


def window_costs(session: Session, what: str, windows, labels: list[str], reused: dict[str, bool],
                 setting: str | None = None) -> list[Cost]:
    """The passes of ``labels`` over ``windows`` (priced by ``setting``'s probe where given; nothing where
    ``reused`` says the run would reuse the pass's result)."""
    requests = [(w.ids[: w.score_from], w.ids[w.score_from :]) for w in windows]
    tokens = request_tokens(requests)
    spent = {label: 0 if reused[label] else tokens_per_call(session, requests, setting or label) for label in labels}
    return [Cost(label, what, len(windows), tokens, len(windows), tokens, setting=setting, fed=spent[label],
                 most_fed=spent[label], reused=int(reused[label])) for label in labels]


def baseline_passes(session: Session, what: str, windows, candidates: list[str], reused: dict[str, bool]
                    ) -> list[Cost]:
    """The baseline's extra passes for the divergences of ``candidates`` (one per group of SHARED_BASELINE; none
    where every divergence of the group is reused)."""
    groups = {f"{BASELINE.label} (for {', '.join(g)})": all(reused[c] for c in g)
              for g in (candidates[i : i + SHARED_BASELINE] for i in range(0, len(candidates), SHARED_BASELINE))}
    return window_costs(session, what, windows, list(groups), groups, BASELINE.label)


class Reuse:
    """Which results the run would reuse from ``store`` (None: none, e.g. no signing key yet): ``reuse(label,
    metric, key)``; :meth:`key` is a setting's result key on the evaluation split. A calibrating setting's key
    holds the scales calibration finds, so its results are priced as measured."""

    def __init__(self, session: Session, store):
        self.session, self.store = session, store
        cfg = session.cfg
        self.settings = {c.label: c for c in [BASELINE, *(cfg.stages or cfg.candidates)]}

    def key(self, label: str) -> dict:
        return self.session.key(self.settings[label], "evaluation")

    def __call__(self, label: str, metric: str, key: dict) -> bool:
        return self.store is not None and not self.settings[label].calibrate and \
            self.store.reusable(label, metric, key)

    def reused_on_windows(self, labels: list[str], metric: str, digest: str) -> dict[str, bool]:
        return {label: self(label, metric, {**self.key(label), "windows": digest}) for label in labels}


def costs(session: Session, rows: dict, store=None) -> tuple[list[Cost], dict[str, list]]:
    """Every scoring pass of the run's evaluation split (nothing for those whose results ``store``, the report's
    partial results, would give the run), and sample requests for the timing probe."""
    cfg, reuse = session.cfg, Reuse(session, store)
    labels = [c.label for c in cfg.stages or cfg.candidates]
    split = evaluation_split(cfg, session.tokenizer, session.maxlen, rows)
    out, samples = [], {}
    for name, windows in split.windows.items():
        samples.setdefault(f"ppl/{name}", [(w.ids[: w.score_from], w.ids[w.score_from :]) for w in windows])
        digest = windows_digest(windows)
        out += window_costs(session, f"ppl/{name}", windows, [BASELINE.label],
                            reuse.reused_on_windows([BASELINE.label], f"ppl/{name}", digest))
        # a candidate's perplexity comes with its KL divergence, from the same pass: reused with the divergence
        divergent = reuse.reused_on_windows(labels, f"kl/{name}", digest)
        out += window_costs(session, f"ppl/{name}", windows, labels, divergent)
        out += baseline_passes(session, f"kl/{name}", windows, labels, divergent)
    if split.long:
        what = f"long/{cfg.eval.long_context.text}"
        kept = reuse.reused_on_windows(labels, what, windows_digest(list(split.long), long=True))
        out += window_costs(session, what, split.long, labels, kept)
        out += baseline_passes(session, what, split.long, labels, kept)
    for task in cfg.eval.tasks.names:
        out += task_costs(session, reuse, task, [BASELINE.label, *labels], samples)
    return out, samples


def probe_kind(candidate: Candidate) -> tuple:
    """What decides a setting's cost per token: its quantizer's class and every option of it but
    :data:`SAME_WORK`, the cache's full-precision tokens, eviction and per-layer settings, and prefix sharing."""
    spec = candidate.spec
    options = {k: v for k, v in spec.quantizer.describe().items() if k not in SAME_WORK}
    return (type(spec.quantizer).__name__, repr(options), spec.residual_length, spec.sink_tokens,
            repr(spec.eviction), repr(spec.layers), shares_prefix(candidate))


def probe_groups(cfg: ExperimentConfig, settings: set[str]) -> dict[str, list[str]]:
    """The timing probes that price ``settings`` (labels): the first setting of each :func:`probe_kind` -> every
    setting its probe prices, itself first."""
    groups: dict[tuple, list[str]] = {}
    for candidate in [BASELINE, *(cfg.stages or cfg.candidates)]:
        if candidate.label in settings:
            groups.setdefault(probe_kind(candidate), []).append(candidate.label)
    return {labels[0]: labels for labels in groups.values()}


def rates(session: Session, samples: dict[str, list], settings: set[str]) -> dict[str, float]:
    """Tokens fed to the model per second by each of ``settings``' scorers on this machine, one timing probe per
    :func:`probe_groups`: the first requests of the first measurement, up to :data:`PROBE_TOKENS` request tokens (a
    longer first request cut to them), scored once timed after a warm-up on its first :data:`WARM_UP` tokens."""
    requests = next(iter(samples.values()), [])
    probe, total = [], 0
    for context, continuation in requests:
        if probe and total + len(context) + len(continuation) > PROBE_TOKENS:
            break
        probe.append((context, continuation))
        total += len(context) + len(continuation)
    if total > PROBE_TOKENS:  # one request longer than the probe: its first tokens, half of them scored
        ids = [*probe[0][0], *probe[0][1]][:PROBE_TOKENS]
        probe = [(ids[: len(ids) // 2], ids[len(ids) // 2 :])]
    warm = [*probe[0][0], *probe[0][1]][:WARM_UP] if probe else []
    cfg, out = session.cfg, {}
    chosen = {c.label: c for c in [BASELINE, *(cfg.stages or cfg.candidates)]}
    for label, priced in probe_groups(cfg, settings).items():
        candidate = chosen[label]
        scorer = Scorer(session.model, candidate.spec, cfg.eval.mode, cfg.eval.chunk_size,
                        batch_size=cfg.eval.batch_size, share_prefix=shares_prefix(candidate))
        scorer.score_many([(warm[: len(warm) // 2], warm[len(warm) // 2 :])])
        before, start = scorer.tokens_fed, time.perf_counter()
        scorer.score_many(probe)
        out.update(dict.fromkeys(priced, (scorer.tokens_fed - before) / max(time.perf_counter() - start, 1e-9)))
    return out


def with_seconds(cost: Cost, rate: dict[str, float]) -> Cost:
    if not cost.most_fed:  # nothing to measure (reused): no probe
        return dataclasses.replace(cost, seconds=0.0, most_seconds=0.0)
    per_token = 1 / rate[cost.setting or cost.scorer]
    return dataclasses.replace(cost, seconds=cost.fed * per_token, most_seconds=cost.most_fed * per_token)


def preview(session: Session, rows: dict, store=None) -> tuple[list[Cost], dict[str, float]]:
    """Every scoring pass of the run with its time from this machine's timing probe (of the settings that have
    anything to measure), and the probe's rates; ``store``: the report's partial results, read only."""
    found, samples = costs(session, rows, store)
    rate = rates(session, samples, {c.setting or c.scorer for c in found if c.most_fed})
    return [with_seconds(c, rate) for c in found], rate


def render_preview(cfg: ExperimentConfig, found: list[Cost], rate: dict[str, float], partial=None) -> str:
    """The preview as printed; ``partial``: the folder reused results come from."""
    lines = [f"kvquant: cost preview of {cfg.name} (nothing measured, nothing written)", "",
             "| scorer | measurement | documents | tokens | model tokens | time | reused | most documents | "
             "most tokens | most model tokens | most time |", "|---|---|" + "---:|" * 9]
    for c in found:
        lines.append(f"| {c.scorer} | {c.measurement} | {c.documents} | {c.tokens:,} | {c.fed:,} | "
                     f"{duration(c.seconds)} | {c.reused} of {c.results} | {c.most_documents} | {c.most_tokens:,} | "
                     f"{c.most_fed:,} | {duration(c.most_seconds)} |")
    total = {k: sum(getattr(c, k) for c in found) for k in ("tokens", "fed", "seconds", "most_tokens", "most_fed",
                                                            "most_seconds", "reused", "results")}
    lines += [f"| **all** | | | **{total['tokens']:,}** | **{total['fed']:,}** | **{duration(total['seconds'])}** | "
              f"**{total['reused']} of {total['results']}** | | **{total['most_tokens']:,}** | "
              f"**{total['most_fed']:,}** | **{duration(total['most_seconds'])}** |", "",
              "tokens: context + continuation of every request a scorer is handed; model tokens: those it feeds the "
              "model (streaming mode runs a context shared by several requests once, and the whole chunks contexts "
              f"begin with alike once), 0 where the run reuses the result; mode {cfg.eval.mode}, chunk "
              f"{cfg.eval.chunk_size}, batch {cfg.eval.batch_size}",
              f"reused: {total['reused']} of {total['results']} results (a task's: one per look) the run would take "
              f"from {partial or 'the partial results'} (signed, of these inputs), priced 0 s",
              f"most: every planned look taken; a look of more than {SAMPLE_DOCUMENTS} documents is priced from the "
              f"tokens per document of the first {SAMPLE_DOCUMENTS} (not built; the run checks every look's few-shot "
              "contexts before its model loads)",
              "time: model tokens per second of each setting in a timing probe on this machine (one probe per "
              "quantizer and cache layout: settings that differ only in bits or group sizes share it): " +
              (", ".join(f"{', '.join(labels)} {rate[first]:,.0f}/s" for first, labels in
                         probe_groups(cfg, set(rate)).items()) or "none needed (nothing to measure)")]
    left = [what for what, there in (("calibration", any(c.calibrate for c in [*cfg.candidates, *cfg.stages])),
                                     ("the search", cfg.search), ("the staged serving loop", cfg.serving)) if there]
    if left:
        lines.append(f"not previewed: {', '.join(left)}")
    return "\n".join(lines)


def dry_run(cfg: ExperimentConfig, rows: dict, warnings: list[str], replan: bool, shape_of) -> int:
    """The cost preview of a checked config: printed, nothing written. A plan the run would refuse
    (:meth:`PlanRecord.check`) is refused here too, before the model loads and before preflight's ``warnings`` are
    printed (a refusal stays one line). ``shape_of(model_config, path)``: the model's shapes (the planner's)."""
    partial, key = Path(cfg.output_dir) / cfg.name / "partial", result_key(make=False)  # no key: nothing signed yet
    # without a key nothing there verifies, as for the run, which makes a new one
    store = ResultStore(partial, provenance.code_version(), [], secret=key if key is not None else b"")
    record = PlanRecord(store, LookPlan.of(cfg), replan)
    record.check()
    if key is not None:
        record.identify()  # the folder's id: which of its results a run would reuse
    say(warnings)
    model, tokenizer = load_model(cfg.model)
    session = Session(cfg, model, tokenizer, None, shape_of(model.config, cfg.model.path), first_look=True)
    print(render_preview(cfg, *preview(session, rows, store if key is not None else None), partial))
    return 0
