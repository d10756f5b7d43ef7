"""``python -m kvquant.run configs/int4.yaml``: may I ship this KV-cache quantization for this model?

Measures the fp16 baseline (the identity quantizer, through the same cache code) and every candidate on the
same model, token windows and task documents, with the quantized K/V read by attention; gates the result and
writes ``reports/<name>/``. Exit code: 0 when the gate passes, 1 when it fails, 2 for a bad config or missing
data. Every finished (candidate, metric) result is saved at once, so an interrupted run resumes where it
stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import yaml

from . import data, report
from .cache import make_cache
from .config import Candidate, ExperimentConfig, load_config
from .errors import KVQuantError
from .evaluate import Scorer, memory_probe, perplexity_samples
from .gate import ACCURACY, PERPLEXITY, MetricRow, bootstrap_interval, decide
from .models import load_model, max_length
from .paths import resolve
from .quantizers import get_quantizer

BASELINE = Candidate(quantizer="fp16", name="baseline")


class ResultStore:
    """One JSON file per (candidate, metric), written atomically, reused only when its inputs are unchanged."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, candidate: str, metric: str) -> Path:
        return self.directory / candidate / (metric.replace("/", "__") + ".json")

    def get_or_compute(self, candidate: str, metric: str, key: dict, compute):
        path = self._path(candidate, metric)
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
        if path.exists():
            saved = json.loads(path.read_text())
            if saved.get("key") == digest:
                return saved["result"]
        result = compute()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": digest, "inputs": key, "result": result}))
        os.replace(tmp, path)
        return result


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_task(model, tokenizer, candidate: Candidate, cfg: ExperimentConfig, task: str, maxlen: int) -> dict:
    """Accuracy of one lm-eval task through the candidate's cache, with per-document outcomes."""
    import lm_eval

    from .lm_eval_model import KVQuantLM
    from .tasks import resolve_task, task_manager

    lm = KVQuantLM(model, tokenizer=tokenizer, quantizer=candidate.quantizer, mode=cfg.eval.mode,
                   chunk_size=cfg.eval.chunk_size, max_length=maxlen, **candidate.options)
    name = resolve_task(task)
    seed = cfg.eval.seed
    out = lm_eval.simple_evaluate(model=lm, tasks=[name], num_fewshot=cfg.eval.tasks.num_fewshot,
                                  limit=cfg.eval.tasks.limit_for(task), task_manager=task_manager(), log_samples=True,
                                  bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed,
                                  torch_random_seed=seed, fewshot_random_seed=seed, verbosity="ERROR")
    samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
    metrics = [m for m in ("acc", "acc_norm") if f"{m},none" in out["results"][name]]
    return {"task": name, **{m: [float(s[m]) for s in samples] for m in metrics}}


def measure(cfg: ExperimentConfig, model, tokenizer, store: ResultStore) -> tuple[dict, dict]:
    """Results of the baseline and every candidate: {label: {metric: result}} and {label: memory report}."""
    maxlen = max_length(model, cfg.model)
    windows = {p.name: data.windows(p, tokenizer, maxlen) for p in cfg.eval.perplexity}
    probe = [t for ws in windows.values() for w in ws for t in w.ids] or tokenizer("Once upon a time").input_ids
    probe = probe[: min(cfg.eval.memory_probe_tokens, maxlen)]
    base_key = {"model": asdict(cfg.model), "mode": cfg.eval.mode, "chunk_size": cfg.eval.chunk_size,
                "seed": cfg.eval.seed}
    results, memory = {}, {}
    for candidate in [BASELINE, *cfg.candidates]:
        label = candidate.label
        make = lambda c=candidate: make_cache(model, c.quantizer, **c.options)  # noqa: E731
        settings = make().settings()  # bad quantizer settings fail here, before any measurement
        key = {**base_key, "quantizer": candidate.quantizer, "options": candidate.options}
        scorer = Scorer(model, make, cfg.eval.mode, cfg.eval.chunk_size)
        memory[label] = {**store.get_or_compute(label, "memory", {**key, "probe": probe},
                                                lambda: memory_probe(model, make, probe)),
                         "settings": settings}
        results[label] = {}
        for pset in cfg.eval.perplexity:
            metric = f"ppl/{pset.name}"
            results[label][metric] = store.get_or_compute(
                label, metric, {**key, "set": asdict(pset), "max_length": maxlen},
                lambda p=pset: perplexity_samples(scorer, windows[p.name], desc=f"{label} {p.name}"))
        for task in cfg.eval.tasks.names:
            results[label][f"task/{task}"] = store.get_or_compute(
                label, f"task/{task}", {**key, "task": task, "limit": cfg.eval.tasks.limit_for(task),
                                        "num_fewshot": cfg.eval.tasks.num_fewshot, "max_length": maxlen},
                lambda t=task, c=candidate: run_task(model, tokenizer, c, cfg, t, maxlen))
    return results, memory


def table(cfg: ExperimentConfig, results: dict) -> list[MetricRow]:
    """One row per candidate x metric, with paired bootstrap intervals of the relative score."""
    gate = cfg.gate
    rows = []
    base = results[BASELINE.label]
    for candidate in cfg.candidates:
        label = candidate.label
        for metric, res in results[label].items():
            ref = base[metric]
            if metric.startswith("ppl/"):
                name = metric[4:]
                b, c = np.column_stack([ref["nll"], ref["tokens"]]), np.column_stack([res["nll"], res["tokens"]])
                entries = [(metric, PERPLEXITY, float(np.exp(c[:, 0].sum() / c[:, 1].sum())),
                            float(np.exp(b[:, 0].sum() / b[:, 1].sum())), len(b), b, c,
                            gate.perplexity is None or name in gate.perplexity)]
            else:
                name = metric[5:]
                entries = [(f"{m}/{name}", ACCURACY, float(np.mean(res[m])), float(np.mean(ref[m])), len(ref[m]),
                            np.array(ref[m]), np.array(res[m]), m == "acc" and (gate.tasks is None or name in gate.tasks))
                           for m in ("acc", "acc_norm") if m in res]
            for metric_name, kind, value, baseline, n, b, c, gated in entries:
                low, high = bootstrap_interval(kind, b, c, gate.bootstrap, gate.confidence, cfg.eval.seed)
                rows.append(MetricRow(label, metric_name, kind, value, baseline, n, gated, low, high))
    return rows


def preflight(cfg: ExperimentConfig) -> None:
    """Fail on missing data or bad quantizer settings before loading anything heavy."""
    for pset in cfg.eval.perplexity:
        if pset.source and not pset.hub:
            resolve(pset.source)
    for candidate in cfg.candidates:
        options = {k: v for k, v in candidate.options.items() if k not in ("residual_length", "sink_tokens")}
        get_quantizer(candidate.quantizer, **options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvquant.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="experiment YAML, e.g. configs/int4.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set eval.tasks.limit=50 (repeatable)")
    args = parser.parse_args(argv)
    command = "python -m kvquant.run " + shlex.join(sys.argv[1:] if argv is None else argv)
    out_dir = None
    try:
        cfg = load_config(args.config, args.overrides)
        out_dir = Path(cfg.output_dir) / cfg.name
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.resolved.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        preflight(cfg)
        seed_everything(cfg.eval.seed)
        model, tokenizer = load_model(cfg.model)
        results, memory = measure(cfg, model, tokenizer, ResultStore(out_dir / "partial"))
    except KVQuantError as err:
        print(f"kvquant: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        where = f" in {out_dir / 'partial'}" if out_dir else ""
        print(f"\nkvquant: interrupted; finished results are kept{where}; run the same command to resume",
              file=sys.stderr)
        return 130
    rows = table(cfg, results)
    bits = {c.label: memory[c.label]["bits_per_element"] for c in cfg.candidates}
    decision = decide(rows, bits, cfg.gate)
    paths = report.write(out_dir, cfg, rows, decision, memory, results, command)
    verdict = "PASS" if decision.decision == "pass" else "FAIL"
    print(f"\nkvquant: {verdict}: {decision.reason}")
    print(f"kvquant: report: {paths['report']} (also results.json, results.csv, {paths['plot'].name})")
    return 0 if decision.decision == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
