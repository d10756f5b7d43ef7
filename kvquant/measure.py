"""What a run measures: the baseline and every candidate of a config, each (candidate, metric) result through
the run's :class:`kvquant.run.ResultStore` so finished results are kept and reused.

Everything that decides a measured value lives here or below (cache, quantizers, scoring, data, tasks); the
runner, config, gate and report code only orchestrate and render, so they are not part of a result's code version
(:func:`kvquant.report.code_version`).
"""

from __future__ import annotations

import functools
from dataclasses import asdict

from . import data
from .cache import make_cache
from .config import Candidate, ExperimentConfig
from .evaluate import Scorer, memory_probe, perplexity_samples
from .models import max_length
from .tasks import PROBE_DOCUMENTS, prepare_probe_tasks, probe_distance, probe_tasks, resolve_task, task_manager

BASELINE = Candidate(quantizer="fp16", name="baseline")


def shares_prefix(candidate: Candidate) -> bool:
    """Whether requests sharing a context read it from one prefilled, forked cache (a stage says; plain
    candidates always do, which scores exactly as prefilling each request: tested)."""
    return getattr(candidate, "prefix_sharing", True)


def run_task(model, tokenizer, candidate: Candidate, cfg: ExperimentConfig, task: str, maxlen: int,
             folder: str, documents: list[int] | None = None) -> dict:
    """Accuracy of one lm-eval task through the candidate's cache, with per-document outcomes; ``folder``: the
    task files (:func:`kvquant.tasks.task_dir`); ``documents``: these document indices instead of the first
    ``limit``."""
    import lm_eval

    from .lm_eval_model import KVQuantLM

    lm = KVQuantLM(model, tokenizer=tokenizer, quantizer=candidate.quantizer, mode=cfg.eval.mode,
                   chunk_size=cfg.eval.chunk_size, batch_size=cfg.eval.batch_size, max_length=maxlen,
                   share_prefix=shares_prefix(candidate), **candidate.options)
    name = resolve_task(task)
    seed = cfg.eval.seed
    limit = cfg.eval.tasks.limit_for(task) or (PROBE_DOCUMENTS if probe_distance(task) is not None else None)
    out = lm_eval.simple_evaluate(model=lm, tasks=[name], num_fewshot=cfg.eval.tasks.num_fewshot,
                                  limit=None if documents else limit,
                                  samples={name: list(documents)} if documents else None,
                                  task_manager=task_manager(folder), log_samples=True,
                                  bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed,
                                  torch_random_seed=seed, fewshot_random_seed=seed, verbosity="ERROR")
    samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
    metrics = [m for m in ("acc", "acc_norm") if f"{m},none" in out["results"][name]]
    return {"task": name, **{m: [float(s[m]) for s in samples] for m in metrics}}


def measure(cfg: ExperimentConfig, model, tokenizer, store,
            rows: dict[str, list[str]]) -> tuple[dict, dict]:
    """Results of the baseline and every candidate: {label: {metric: result}} and {label: memory report}.
    ``rows``: the text of every perplexity set, read by :func:`preflight`."""
    maxlen = max_length(model, cfg.model)
    windows = {p.name: data.windows(p, tokenizer, maxlen, rows[p.name]) for p in cfg.eval.perplexity}
    size = min(cfg.eval.memory_probe_tokens, maxlen)
    probe = [t for ws in windows.values() for w in ws for t in w.ids] or tokenizer("Once upon a time").input_ids
    probe = (probe * -(-size // len(probe)))[:size]  # without perplexity text, a phrase repeated: bytes are alike
    base_key = {"model": asdict(cfg.model), "mode": cfg.eval.mode, "chunk_size": cfg.eval.chunk_size,
                "batch_size": cfg.eval.batch_size, "seed": cfg.eval.seed}
    # task files (probe documents are cut with this tokenizer), written when a task is first measured
    probes = probe_tasks(cfg.eval.tasks.names, cfg.eval.tasks.limit_for)
    folder = functools.cache(lambda: str(prepare_probe_tasks(tokenizer, probes, maxlen, "eval.tasks.names")))
    results, memory = {}, {}
    for candidate in [BASELINE, *cfg.candidates]:
        label = candidate.label
        make = lambda c=candidate: make_cache(model, c.quantizer, **c.options)  # noqa: E731
        settings = make().settings()  # what the cache really uses, defaults filled in
        key = {**base_key, "settings": settings, **({} if shares_prefix(candidate) else {"prefix_sharing": False})}
        scorer = Scorer(model, make, cfg.eval.mode, cfg.eval.chunk_size, batch_size=cfg.eval.batch_size,
                        share_prefix=shares_prefix(candidate))
        memory[label] = {**store.get_or_compute(label, "memory", {**key, "probe": probe},
                                                lambda m=make: memory_probe(model, m, probe)),
                         "settings": settings}
        results[label] = {}
        for pset in cfg.eval.perplexity:
            metric = f"ppl/{pset.name}"
            results[label][metric] = store.get_or_compute(
                label, metric, {**key, "set": asdict(pset), "max_length": maxlen},
                lambda p=pset, s=scorer, lab=label: perplexity_samples(s, windows[p.name], desc=f"{lab} {p.name}"))
        for task in cfg.eval.tasks.names:
            results[label][f"task/{task}"] = store.get_or_compute(
                label, f"task/{task}", {**key, "task": task, "limit": cfg.eval.tasks.limit_for(task),
                                        "num_fewshot": cfg.eval.tasks.num_fewshot, "max_length": maxlen},
                lambda t=task, c=candidate: run_task(model, tokenizer, c, cfg, t, maxlen, folder()))
    return results, memory
