"""Writing a run's report: results.json, results.csv, report.md, plot.png and config.resolved.yaml in
``reports/<name>/``.

All five are rendered first and then moved into place together, and share a run id, so they always describe
the same run; nothing is written into the directory before that. This module holds the on-disk document
(``results.json``, and ``results.csv`` from it), its environment and :func:`write`; ``report.md`` is
:mod:`kvquant.runner.report_markdown`'s and the plots :mod:`kvquant.runner.report_plots`', both rendered from the typed
:class:`~kvquant.experiment.results.RunResult` and :mod:`kvquant.runner.report_facts` (which ``results.json`` is built
from too).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import uuid
from pathlib import Path

import yaml

import numpy as np
import pandas as pd

from kvquant.errors import ERROR_LOG, script_parser
from kvquant.fs import output_dir, write_together
from kvquant.runner.report_facts import CandidateReport, MetricReport, candidate_reports, probe_curve, stage_rows
from kvquant.runner.report_markdown import markdown
from kvquant.runner.report_lengths import lengths_document, lengths_plot, long_verdicts
from kvquant.runner.report_plots import probe_plot, quality_plot, stages_plot
from kvquant.experiment import provenance
from kvquant.experiment.provenance import commit_provenance, version_of
from kvquant.experiment.results import Memory, RunResult
from kvquant.signing import json_form, signed_json

#: Every file a run may leave in its report directory (besides ``partial/``): what a run does not regenerate
#: is removed, so nothing there describes an earlier run.
REPORT_FILES = frozenset({"results.json", "results.csv", "report.md", "plot.png", "config.resolved.yaml",
                          "searched.yaml", "stages.png", "probe.png", "lengths.png", "DEPLOY.md",
                          "kv_cache_scheme.json", "kv_scales.safetensors", ERROR_LOG})

def benchmark_lines(doc: dict, title: str) -> list[str]:
    """A benchmark report's head: its ``title``, then its provenance (markdown list items): its ``command``, the
    date and commit and the machine of its ``environment`` (:func:`environment`), its ``args.threads`` and the
    ``load`` average at its start and end, and the model of its ``args`` (float32 on the CPU)."""
    env, a = doc["environment"], doc["args"]
    return [f"# {title}", "", f"- command: `{doc['command']}`", f"- date: {env['date']}; git {env['git_commit']}",
            f"- machine: {env['machine']}; torch {env['torch']}, transformers {env['transformers']}; "
            f"{doc['args']['threads']} torch thread(s); load average (1 min) {doc['load'][0]:.2f} at the start, "
            f"{doc['load'][1]:.2f} at the end", f"- model {a['model']} {a['gguf_file'] or ''} (float32, CPU)"]


def benchmark_parser(name: str, description: str):
    """A benchmark script's argument parser (usage errors one line, exit 2), with the model options every
    benchmark on a real model takes."""
    parser = script_parser(name, description)
    parser.add_argument("--model", default="local:models/smollm2-135m-instruct")
    parser.add_argument("--gguf-file", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    return parser


def benchmark_end(lines: list[str], doc: dict) -> str:
    """A benchmark report's text: ``lines``, then a pointer to hand-written notes where ``doc`` has them."""
    if doc.get("notes"):
        lines = [*lines, "", "Hand-written notes on a run (the date they name): [NOTES.md](NOTES.md)."]
    return "\n".join(lines) + "\n"


def benchmark_start(args):
    """A benchmark's start: torch's threads set from ``args.threads`` (None: torch's own, recorded back), the load
    average now, and the model ``args.model`` / ``args.gguf_file`` (float32, CPU): ``(model, tokenizer, load)``."""
    import torch

    from kvquant.experiment.model_config import ModelConfig
    from kvquant.scoring.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    load = os.getloadavg()[0]
    model, tokenizer = load_model(ModelConfig(path=args.model, gguf_file=args.gguf_file or None, dtype="float32",
                                              device="cpu"))
    return model, tokenizer, load


def benchmark_doc(script: str, argv, args, load: float, **fields) -> dict:
    """A benchmark's document: its command (``script`` with ``argv``, else this process's), environment, ``args``,
    ``fields`` and the load average at its start and now."""
    import sys

    return {"command": "python " + " ".join(sys.argv if argv is None else [script, *argv]),
            "environment": environment(),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            **fields, "load": [load, os.getloadavg()[0]]}


def write_benchmark(out: Path, doc: dict, render) -> None:
    """A benchmark's ``results.json`` (``doc``, noting whether hand-written ``NOTES.md`` sit beside it) and its
    ``report.md`` (``render(doc)``, also printed) into ``out`` (:func:`kvquant.fs.output_dir`), written together:
    a symlink at either is replaced, never followed, and another user's file there is refused."""
    out = output_dir(out, "--out")
    doc["notes"] = (out / "NOTES.md").exists()
    text = render(doc)
    write_together(out, {"results.json": json.dumps(doc, indent=1) + "\n", "report.md": text})
    print(text)


#: The packages whose versions a report names: those that measure, and those that read the data and turn a GGUF into
#: the model measured (tokenizers and gguf are not pinned; a report says which ran)
REPORTED_PACKAGES = ("kvquant", "torch", "transformers", "lm_eval", "datasets", "tokenizers", "gguf")


def environment() -> dict[str, str]:
    versions = {pkg: version_of(pkg) for pkg in REPORTED_PACKAGES}
    versions["kvquant_source_sha256"] = provenance.code_version()["kvquant_source_sha256"]
    commit = commit_provenance(versions["kvquant_source_sha256"])  # the commit only where it holds those sources
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    return {"python": platform.python_version(), **versions, "git_commit": commit,
            "machine": f"{platform.platform()}, {device}",
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def _metric_entry(m: MetricReport) -> dict:
    """A metric as results.json records it: the gate's row and verdict, what attention read, the summed NLL and
    tokens of both (a metric paired with the baseline's windows: perplexity), the quantiles of per-position values
    (KL divergence)."""
    row, verdict, outcomes = m.row, m.verdict, m.outcomes
    entry = {"kind": row.kind.kind, "value": row.value, "baseline": row.baseline, "relative": row.relative,
             "statistic": row.statistic, "ci_low": row.ci_low, "ci_high": row.ci_high, "confidence": row.confidence,
             "threshold": verdict.threshold, "gated": row.gated, "verdict": verdict.verdict,
             "point_estimate_only": verdict.point, "more_documents": verdict.more,
             "more_seconds": verdict.more_seconds, "documents_left": verdict.left, "passed": verdict.passed,
             "n": row.n, "quantized_share": row.quantized_share, **({"note": verdict.note} if verdict.note else {})}
    exercise = outcomes.exercise
    if exercise is not None:
        entry.update(key_share=exercise.reads.share("keys"), value_share=exercise.reads.share("values"),
                     reads=exercise.reads.to_dict(), median_length=m.length(0.5), p90_length=m.length(0.9),
                     bits_per_element_at_median=m.bits_at_median)
    if m.baseline is not None:
        entry.update(nll_sum=float(np.sum(outcomes.scores)), tokens=int(np.sum(outcomes.tokens)),
                     baseline_nll_sum=float(np.sum(m.baseline.scores)), baseline_tokens=int(np.sum(m.baseline.tokens)))
    for name, quantile in m.quantiles:
        entry[name] = quantile.value
        entry[f"{name}_ci"] = [quantile.low, quantile.high]
    return entry


def _memory_entry(memory: Memory) -> dict:
    return {**memory.measured, "long": memory.long}


def _candidate_entry(c: CandidateReport) -> dict:
    memory = c.memory
    return {"name": c.label, "settings": memory.settings, "bits_per_element": memory.bits_per_element,
            "memory_ratio": memory.measured["ratio"], "memory_ratio_long": memory.long["ratio"],
            "bits_per_element_long": memory.long["bits_per_element"], "memory": _memory_entry(memory),
            "passed": c.passed, "verdict": c.status,
            "metrics": {name: _metric_entry(m) for name, m in c.metrics.items()}}


def document(run: RunResult, run_id: str, env: dict[str, str] | None = None,
             candidates: tuple[CandidateReport, ...] | None = None) -> dict:
    """What results.json holds: the decision, every candidate's settings, memory and metrics, provenance
    (``env``: :func:`environment`, taken now when not given; ``candidates``: :func:`~kvquant.runner.report_facts.
    candidate_reports` of ``run``, computed when not given)."""
    cfg, decision, provenance = run.config, run.decision, run.provenance
    baseline = run.results["baseline"].memory
    candidates = candidate_reports(run) if candidates is None else candidates
    return {
        "run_id": run_id, "decision": decision.decision, "chosen": decision.chosen, "reason": decision.reason,
        "decide_on": cfg.gate.decide_on, "mode": cfg.eval.mode,
        "chunk_size": cfg.eval.chunk_size if cfg.eval.mode == "streaming" else None,
        "command": run.command, "environment": environment() if env is None else env, "config": cfg.to_dict(),
        "results": {"computed": provenance.computed, "reused_from_partial": provenance.reused,
                    "set_aside": list(provenance.set_aside), "processes": provenance.processes,
                    "seconds": provenance.seconds},
        "warnings": list(provenance.warnings),
        **({"rendered": provenance.rendered} if provenance.rendered else {}),
        "baseline": {"settings": baseline.settings, "memory": _memory_entry(baseline)},
        "candidates": [_candidate_entry(c) for c in candidates],
        **({"plan": {**dataclasses.asdict(run.plan), "steps": run.plan.steps()}} if run.plan else {}),
        **({"replanned": run.replanned} if run.replanned else {}),
        **({"calibration": run.calibration} if run.calibration else {}),
        **({"search": run.search.to_dict()} if run.search else {}),
        **({"staged": run.staged.to_dict()} if run.staged else {}),
        **({"long_context": lengths_document(run)} if long_verdicts(run) else {}),
    }


def _csv(doc: dict) -> str:
    """results.csv: one row per candidate x metric, results.json's metric entries flattened."""
    frame = pd.DataFrame([{"candidate": c["name"], "bits_per_element": c["bits_per_element"],
                           "memory_ratio": c["memory_ratio"], "metric": m, **e}
                          for c in doc["candidates"] for m, e in c["metrics"].items()])
    return frame.to_csv(index=False)


def _searched_yaml(run: RunResult, run_id: str, out_dir: Path) -> str:
    """searched.yaml: the map a search found, as a config that evaluates it alone (no search) on the same data."""
    cfg = run.config
    found = next(c for c in run.candidates if c.label == run.search.name)
    rerun = {**cfg.to_dict(), "name": f"{cfg.name}-{found.label}", "candidates": [dataclasses.asdict(found)],
             "search": None}
    return (f"# the per-layer map searched by run {run_id}; rerun with\n# python -m kvquant.run "
            f"{out_dir / 'searched.yaml'}\n" + yaml.safe_dump(rerun, sort_keys=False))


def render(out_dir: Path, run: RunResult, run_id: str,
           env: dict[str, str]) -> tuple[dict[str, str | bytes], dict]:
    """Every report file of ``run`` by name, as text or bytes (``out_dir``: where they will be, which
    searched.yaml names), and the document results.json holds as a reader parses it back
    (:func:`kvquant.signing.json_form`, without its signature)."""
    cfg = run.config
    candidates = candidate_reports(run)
    doc = document(run, run_id, env, candidates)
    written = json_form(doc)
    curve = probe_curve(run.rows)
    files = {"results.json": signed_json(written), "results.csv": _csv(doc),
             "plot.png": quality_plot(candidates, cfg),
             "config.resolved.yaml": (f"# run {run_id}: the config of the run that results.json and report.md "
                                      "describe\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False)),
             "report.md": markdown(run, candidates, run_id, env)}
    if run.search:
        files["searched.yaml"] = _searched_yaml(run, run_id, out_dir)
    if run.staged:
        files["stages.png"] = stages_plot(stage_rows(run, candidates), cfg)
    if curve:
        files["probe.png"] = probe_plot(curve, cfg)
    lengths = lengths_plot(run)
    if lengths is not None:
        files["lengths.png"] = lengths
    return files, written


def write(out_dir: Path, run: RunResult) -> tuple[dict[str, Path], dict]:
    """Render one run's report files together (``results.json``, ``results.csv``, ``report.md``, plots,
    ``config.resolved.yaml``, a search's ``searched.yaml``) into ``out_dir``, and remove what an earlier run
    left there that this one does not regenerate. Returns their paths and the document results.json holds, as a
    reader parses it (what the runner deploys: :func:`kvquant.integrations.deploy.deploy_beside`)."""
    files, written = render(out_dir, run, uuid.uuid4().hex[:12], environment())
    write_together(out_dir, files)
    for name in REPORT_FILES - set(files):  # an earlier run's, which this report does not describe
        (out_dir / name).unlink(missing_ok=True)
    return {"report": out_dir / "report.md", "json": out_dir / "results.json", "plot": out_dir / "plot.png"}, written
