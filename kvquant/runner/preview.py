"""What a run will cost, before anything is measured (issue 39 item 3): ``python -m kvquant.run CONFIG --dry-run``.

For the baseline and every candidate, each scoring pass of the evaluation split: the documents it starts with, the
most it may take (a sequential gate's looks, up to ``gate.max_documents`` or the task's end), the model tokens each
costs, and a time from a short timing probe of each setting on this machine.

Tokens are those of every request a scorer is handed, context + continuation, counted as the run's scorer records
them (``Scorer.lengths``, kept in every result as ``lengths``): a task's requests are built here by lm-eval with the
model's tokenizer exactly as the run builds them, with a recorder in place of the scorer; perplexity and long-context
windows are cut as the run cuts them. Streaming mode with prefix sharing runs a shared context through the model
once, so fewer tokens pass through it than it scores. A candidate's perplexity and KL divergence come from one pass;
the baseline is scored again beside every :data:`~kvquant.scoring.session.SHARED_BASELINE` candidates for the
divergences. Not previewed: calibration, the search, a staged run's serving loop and the memory probe.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from kvquant.runner.config import ExperimentConfig
from kvquant.runner.gate import duration, looks
from kvquant.scoring.prefixes import model_tokens
from kvquant.scoring.scorer import Scored, Scorer
from kvquant.scoring.session import (BASELINE, SHARED_BASELINE, Session, evaluate_task, evaluation_split,
                                     shares_prefix, task_lm, task_size)

#: Request tokens each setting's timing probe scores (at least one whole request).
PROBE_TOKENS = 1024


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
    from kvquant.scoring.task_setup import lm_eval_task
    from kvquant.scoring.tasks import task_dir

    lm = KVQuantLM(model, tokenizer=tokenizer, quantizer="fp16")
    lm.scorer = Recorder()
    found = [lm_eval_task(t, task_dir(), sampler) for t in tasks]
    samples = {t.config.task: list(range(first, first + limit)) for t in found} if first else None
    lm_eval.simple_evaluate(model=lm, tasks=found, limit=None if first else limit, samples=samples,
                            num_fewshot=shots, bootstrap_iters=0,
                            verbosity="ERROR", random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                            fewshot_random_seed=seed)
    return lm.scorer.requests


def task_requests(session: Session, task: str, documents: range | None) -> tuple[int, list]:
    """(documents, requests) of one task's scoring call as the run makes it: its first ``limit`` documents
    (``documents`` None) or those of a sequential look."""
    lm = task_lm(session.model, session.tokenizer, BASELINE, session.cfg, session.maxlen)
    lm.scorer = Recorder()
    name, out = evaluate_task(lm, session.cfg, task, session.folder(), list(documents) if documents else None)
    return len(out["samples"][name]), lm.scorer.requests


def fed(session: Session, requests: list, label: str) -> int:
    """Tokens the scorer of ``label`` feeds the model for one scoring call of ``requests``."""
    cfg = session.cfg
    shares = {c.label: shares_prefix(c) for c in [BASELINE, *(cfg.stages or cfg.candidates)]}
    return model_tokens(requests, cfg.eval.mode, cfg.eval.chunk_size, shares.get(label, True))


def request_tokens(requests: list) -> int:
    return sum(len(c) + len(t) for c, t in requests)


def task_costs(session: Session, task: str, labels: list[str], samples: dict) -> list[Cost]:
    """Every scorer's pass over ``task``: the first look's documents, and the most a sequential gate may add (its
    looks, up to ``gate.max_documents`` or the task's end, as :func:`kvquant.run.add_documents` takes them)."""
    cfg = session.cfg
    first, requests = task_requests(session, task, None)
    samples.setdefault(f"task/{task}", requests)
    calls, scored = [requests], first
    if task in cfg.gated_tasks() and cfg.gate.max_documents is not None:
        planned, size = looks(cfg.eval.tasks.limit_for(task), cfg.gate.max_documents), task_size(session, task)
        while (nxt := min(next((n for n in planned if n > scored), scored), size)) > scored:
            added, more = task_requests(session, task, range(scored, nxt))
            scored, calls = scored + added, [*calls, more]
    return [Cost(label, f"task/{task}", first, request_tokens(requests), scored, sum(map(request_tokens, calls)),
                 fed=fed(session, requests, label), most_fed=sum(fed(session, r, label) for r in calls))
            for label in labels]


def window_costs(session: Session, what: str, windows, labels: list[str], setting: str | None = None) -> list[Cost]:
    """The passes of ``labels`` over ``windows`` (priced by ``setting``'s probe where given)."""
    requests = [(w.ids[: w.score_from], w.ids[w.score_from :]) for w in windows]
    tokens = request_tokens(requests)
    spent = {label: fed(session, requests, setting or label) for label in labels}
    return [Cost(label, what, len(windows), tokens, len(windows), tokens, setting=setting, fed=spent[label],
                 most_fed=spent[label]) for label in labels]


def baseline_passes(session: Session, what: str, windows, candidates: list[str]) -> list[Cost]:
    """The baseline's extra passes for the divergences of ``candidates`` (one per group of SHARED_BASELINE)."""
    groups = [candidates[i : i + SHARED_BASELINE] for i in range(0, len(candidates), SHARED_BASELINE)]
    return window_costs(session, what, windows, [f"{BASELINE.label} (for {', '.join(g)})" for g in groups],
                        BASELINE.label)


def costs(session: Session, rows: dict) -> tuple[list[Cost], dict[str, list]]:
    """Every scoring pass of the run's evaluation split, and sample requests for the timing probe."""
    cfg = session.cfg
    labels = [c.label for c in cfg.stages or cfg.candidates]
    split = evaluation_split(cfg, session.tokenizer, session.maxlen, rows)
    out, samples = [], {}
    for name, windows in split.windows.items():
        samples.setdefault(f"ppl/{name}", [(w.ids[: w.score_from], w.ids[w.score_from :]) for w in windows])
        out += window_costs(session, f"ppl/{name}", windows, [BASELINE.label])
        out += window_costs(session, f"ppl/{name}", windows, labels)  # with its KL divergence, from the same pass
        out += baseline_passes(session, f"kl/{name}", windows, labels)
    if split.long:
        text = cfg.eval.long_context.text
        out += window_costs(session, f"long/{text}", split.long, labels)
        out += baseline_passes(session, f"long/{text}", split.long, labels)
    for task in cfg.eval.tasks.names:
        out += task_costs(session, task, [BASELINE.label, *labels], samples)
    return out, samples


def rates(session: Session, samples: dict[str, list]) -> dict[str, float]:
    """Tokens fed to the model per second by each setting's scorer on this machine: the first requests of the first
    measurement, up to :data:`PROBE_TOKENS` request tokens, scored once untimed (a warm-up) and once timed."""
    requests = next(iter(samples.values()), [])
    probe, total = [], 0
    for context, continuation in requests:
        if probe and total + len(context) + len(continuation) > PROBE_TOKENS:
            break
        probe.append((context, continuation))
        total += len(context) + len(continuation)
    cfg, out = session.cfg, {}
    for candidate in [BASELINE, *(cfg.stages or cfg.candidates)]:
        scorer = Scorer(session.model, candidate.spec, cfg.eval.mode, cfg.eval.chunk_size,
                        batch_size=cfg.eval.batch_size, share_prefix=shares_prefix(candidate))
        scorer.score_many(probe[:1])
        before, start = scorer.fed, time.perf_counter()
        scorer.score_many(probe)
        out[candidate.label] = (scorer.fed - before) / max(time.perf_counter() - start, 1e-9)
    return out


def timed(cost: Cost, rate: dict[str, float]) -> Cost:
    per_token = 1 / rate[cost.setting or cost.scorer]
    return dataclasses.replace(cost, seconds=cost.fed * per_token, most_seconds=cost.most_fed * per_token)


def preview(session: Session, rows: dict) -> tuple[list[Cost], dict[str, float]]:
    """Every scoring pass of the run with its time from this machine's timing probe, and the probe's rates."""
    found, samples = costs(session, rows)
    rate = rates(session, samples) if found else {}
    return [timed(c, rate) for c in found], rate


def render(cfg: ExperimentConfig, found: list[Cost], rate: dict[str, float]) -> str:
    lines = [f"kvquant: cost preview of {cfg.name} (nothing measured, nothing written)", "",
             "| scorer | measurement | documents | tokens | model tokens | time | most documents | most tokens | "
             "most model tokens | most time |", "|---|---|" + "---:|" * 8]
    for c in found:
        lines.append(f"| {c.scorer} | {c.measurement} | {c.documents} | {c.tokens:,} | {c.fed:,} | "
                     f"{duration(c.seconds)} | {c.most_documents} | {c.most_tokens:,} | {c.most_fed:,} | "
                     f"{duration(c.most_seconds)} |")
    total = {k: sum(getattr(c, k) for c in found) for k in ("tokens", "fed", "seconds", "most_tokens", "most_fed",
                                                            "most_seconds")}
    lines += [f"| **all** | | | **{total['tokens']:,}** | **{total['fed']:,}** | **{duration(total['seconds'])}** | | "
              f"**{total['most_tokens']:,}** | **{total['most_fed']:,}** | **{duration(total['most_seconds'])}** |", "",
              "tokens: context + continuation of every request a scorer is handed; model tokens: those it feeds the "
              "model (streaming mode runs a context shared by several requests once, and the whole chunks contexts "
              f"begin with alike once); mode {cfg.eval.mode}, chunk {cfg.eval.chunk_size}, batch "
              f"{cfg.eval.batch_size}",
              "time: model tokens per second of each setting in a timing probe on this machine: " +
              ", ".join(f"{label} {r:,.0f}/s" for label, r in rate.items())]
    left = [what for what, there in (("calibration", any(c.calibrate for c in [*cfg.candidates, *cfg.stages])),
                                     ("the search", cfg.search), ("the staged serving loop", cfg.serving)) if there]
    if left:
        lines.append(f"not previewed: {', '.join(left)}")
    return "\n".join(lines)
