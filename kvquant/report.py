"""Writing a run's report: results.json, results.csv, report.md, plot.png and config.resolved.yaml in
``reports/<name>/``.

All five are rendered first and then moved into place together, and share a run id, so they always describe
the same run; nothing is written into the directory before that.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import io
import os
import platform
import subprocess
import uuid
from importlib import metadata
from pathlib import Path

import yaml

import numpy as np
import pandas as pd

from .config import ExperimentConfig
from .errors import ERROR_LOG
from .fs import write_together
from .gate import looks, quantile_interval
from .results import (AGREEMENT, DIVERGENCE, LONG_CONTEXT, PERPLEXITY, Memory, MetricRow, RunResult, Serving, Verdict)
from .signing import signed_json
from .tasks import probe_distance
from .paths import PROJECT_ROOT


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


#: Every file a run may leave in its report directory (besides ``partial/``): what a run does not regenerate
#: is removed, so nothing there describes an earlier run.
REPORT_FILES = frozenset({"results.json", "results.csv", "report.md", "plot.png", "config.resolved.yaml",
                          "searched.yaml", "stages.png", "probe.png", "DEPLOY.md", "kv_cache_scheme.json",
                          "kv_scales.safetensors", ERROR_LOG})

#: Modules that only orchestrate, check or render (runner, gate, planner, report, CLI): they run afresh
#: every time and decide no measured value, so a change to them keeps finished results reusable.
NOT_MEASURING = frozenset({"run.py", "store.py", "report.py", "gate.py", "plan.py", "planner.py", "errors.py",
                           "lm_eval.py", "config.py", "results.py", "search.py", "deploy.py", "export.py",
                           "deploy_read.py", "signing.py"})


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, str]:
    """What measured a result: kvquant's version and a hash of the sources that compute results (every ``*.py``
    but :data:`NOT_MEASURING`, and ``csrc/*``), and the versions of torch, transformers and lm-eval. Part of
    every resume key, so results of other code are recomputed."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.glob("csrc/*")]):
        if path.name in NOT_MEASURING:
            continue
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return {"kvquant": _version("kvquant"), "kvquant_source_sha256": digest.hexdigest()[:16],
            **{pkg: _version(pkg) for pkg in ("torch", "transformers", "lm_eval")}}


def environment() -> dict[str, str]:
    versions = {pkg: _version(pkg) for pkg in ("kvquant", "torch", "transformers", "lm_eval", "datasets")}
    versions["kvquant_source_sha256"] = code_version()["kvquant_source_sha256"]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                               capture_output=True, text=True).stdout.strip()
        commit += " (with uncommitted changes)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    return {"python": platform.python_version(), **versions, "git_commit": commit,
            "machine": f"{platform.platform()}, {device}",
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def _metric_entry(verdict: Verdict, run: RunResult) -> dict:
    row, results = verdict.row, run.results
    outcomes = results[row.candidate][row.metric]
    entry = {"kind": row.kind, "value": row.value, "baseline": row.baseline, "relative": row.relative,
             "statistic": row.statistic, "ci_low": row.ci_low, "ci_high": row.ci_high, "confidence": row.confidence,
             "threshold": verdict.threshold, "gated": row.gated, "verdict": verdict.verdict,
             "point_estimate_only": verdict.point, "more_documents": verdict.more, "passed": verdict.passed,
             "n": row.n, "quantized_share": row.quantized_share}
    exercise = outcomes.exercise
    if exercise is not None:
        entry.update(key_share=exercise.reads.share("keys"), value_share=exercise.reads.share("values"),
                     reads=exercise.reads.to_dict(), median_length=exercise.length_quantile(0.5),
                     p90_length=exercise.length_quantile(0.9), bits_per_element_at_median=exercise.bits_per_element)
    if row.kind == PERPLEXITY:
        base = results["baseline"][row.metric]
        entry.update(nll_sum=float(np.sum(outcomes.scores)), tokens=int(np.sum(outcomes.tokens)),
                     baseline_nll_sum=float(np.sum(base.scores)), baseline_tokens=int(np.sum(base.tokens)))
    if row.kind == DIVERGENCE:
        cfg = run.config
        for name, q in (("median", 0.5), ("p99", 0.99)):
            low, high = quantile_interval(outcomes.per_token, q, cfg.gate.bootstrap, cfg.gate.confidence,
                                          cfg.eval.seed)
            entry[name] = float(np.quantile(np.concatenate(outcomes.per_token), q))
            entry[f"{name}_ci"] = [low, high]
    return entry


def _memory_entry(memory: Memory) -> dict:
    return {**memory.measured, "long": memory.long}


def _candidate_entry(candidate, run: RunResult) -> dict:
    memory = run.results[candidate.label].memory
    verdicts = [v for v in run.decision.verdicts if v.row.candidate == candidate.label]
    return {"name": candidate.label, "settings": memory.settings, "bits_per_element": memory.bits_per_element,
            "memory_ratio": memory.measured["ratio"], "memory_ratio_long": memory.long["ratio"],
            "bits_per_element_long": memory.long["bits_per_element"], "memory": _memory_entry(memory),
            "passed": run.decision.passed[candidate.label], "verdict": run.decision.statuses[candidate.label],
            "metrics": {v.row.metric.name: _metric_entry(v, run) for v in verdicts}}


def document(run: RunResult, run_id: str) -> dict:
    """What results.json holds: the decision, every candidate's settings, memory and metrics, provenance."""
    cfg, decision, provenance = run.config, run.decision, run.provenance
    baseline = run.results["baseline"].memory
    return {
        "run_id": run_id, "decision": decision.decision, "chosen": decision.chosen, "reason": decision.reason,
        "decide_on": cfg.gate.decide_on, "mode": cfg.eval.mode,
        "chunk_size": cfg.eval.chunk_size if cfg.eval.mode == "streaming" else None,
        "command": run.command, "environment": environment(), "config": cfg.to_dict(),
        "results": {"computed": provenance.computed, "reused_from_partial": provenance.reused,
                    "set_aside": list(provenance.set_aside), "processes": provenance.processes,
                    "seconds": provenance.seconds},
        "warnings": list(provenance.warnings),
        "baseline": {"settings": baseline.settings, "memory": _memory_entry(baseline)},
        "candidates": [_candidate_entry(c, run) for c in run.candidates],
        **({"plan": {**dataclasses.asdict(run.plan), "steps": run.plan.steps()}} if run.plan else {}),
        **({"calibration": run.calibration} if run.calibration else {}),
        **({"search": run.search.to_dict()} if run.search else {}),
        **({"staged": run.staged.to_dict()} if run.staged else {}),
    }


def write(out_dir: Path, run: RunResult) -> dict[str, Path]:
    """Render one run's report files together (``results.json``, ``results.csv``, ``report.md``, plots,
    ``config.resolved.yaml``, a search's ``searched.yaml``) into ``out_dir``, and remove what an earlier run
    left there that this one does not regenerate."""
    cfg, run_id = run.config, uuid.uuid4().hex[:12]
    doc = document(run, run_id)
    candidates = doc["candidates"]
    frame = pd.DataFrame([{"candidate": c["name"], "bits_per_element": c["bits_per_element"],
                           "memory_ratio": c["memory_ratio"], "metric": m, **e}
                          for c in candidates for m, e in c["metrics"].items()])
    resolved = (f"# run {run_id}: the config of the run that results.json and report.md describe\n"
                + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    curve = _probe_curve(run.rows)
    files = {"results.json": signed_json(doc), "results.csv": frame.to_csv(index=False),
             "plot.png": _plot(candidates, cfg), "config.resolved.yaml": resolved,
             "report.md": _markdown(doc, frame, cfg, curve)}
    if run.search:  # the map found, as a config that evaluates it alone (no search) on the same data
        found = next(c for c in run.candidates if c.label == run.search.name)
        rerun = {**cfg.to_dict(), "name": f"{cfg.name}-{found.label}", "candidates": [dataclasses.asdict(found)],
                 "search": None}
        files["searched.yaml"] = (f"# the per-layer map searched by run {run_id}; rerun with\n# python -m kvquant.run "
                                  f"{out_dir / 'searched.yaml'}\n" + yaml.safe_dump(rerun, sort_keys=False))
    if run.staged:
        files["stages.png"] = _stages_plot(doc, cfg)
    if curve:
        files["probe.png"] = _probe_plot(curve, cfg)
    write_together(out_dir, files)
    for name in REPORT_FILES - set(files):  # an earlier run's, which this report does not describe
        (out_dir / name).unlink(missing_ok=True)
    return {"report": out_dir / "report.md", "json": out_dir / "results.json", "plot": out_dir / "plot.png"}


def _probe_curve(rows: list[MetricRow]) -> dict[str, dict[int, tuple[float, int]]]:
    """``{candidate or "baseline": {distance: (acc, n)}}`` of the long-range probe tasks (``passkey_<D>``)."""
    curve: dict[str, dict[int, tuple[float, int]]] = {}
    for row in rows:
        distance = probe_distance(row.metric.source)
        if row.metric.measure == "acc" and distance is not None:
            curve.setdefault("baseline", {})[distance] = (row.baseline, row.n)
            curve.setdefault(row.candidate, {})[distance] = (row.value, row.n)
    return curve


def _probe_plot(curve: dict[str, dict[int, tuple[float, int]]], cfg: ExperimentConfig) -> bytes:
    """The PNG of probe accuracy vs distance, one line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curve.items():
        xs = sorted(points)
        ax.plot(xs, [points[x][0] for x in xs], "o-", label=name, lw=2.5 if name == "baseline" else 1.5,
                color="black" if name == "baseline" else None)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("distance to the pass key (tokens)")
    ax.set_ylabel("accuracy (pass key retrieved)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"{cfg.name}: long-range probe ({cfg.eval.mode} mode)")
    ax.legend(fontsize=8, loc="lower left")
    return _png(fig)


def _png(fig) -> bytes:
    """The figure, gridded and laid out, as PNG bytes (the figure is closed)."""
    import matplotlib.pyplot as plt

    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def _probe_table(curve: dict[str, dict[int, tuple[float, int]]]) -> list[str]:
    names = list(curve)
    distances = sorted({d for points in curve.values() for d in points})
    lines = ["## Long-range probe", "", "Accuracy of pass-key retrieval by distance (`kvquant.probe`): correct / n, "
             "with its 95% Wilson interval.", "",
             "| distance | " + " | ".join(names) + " |", "|---:|" + "---|" * len(names)]
    for d in distances:
        cells = []
        for name in names:
            if d not in curve[name]:
                cells.append("")
                continue
            acc, n = curve[name][d]
            k = round(acc * n)
            low, high = wilson_interval(k, n)
            cells.append(f"{k}/{n} [{low:.2f}, {high:.2f}]")
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return [*lines, "", "![long-range probe](probe.png)", ""]


def wilson_interval(k: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of ``k`` successes in ``n`` trials."""
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return ci.low, ci.high


def _plot(candidates: list[dict], cfg: ExperimentConfig) -> bytes:
    """The PNG of relative score vs bits per element, thresholds drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    metrics = sorted({m for c in candidates for m, e in c["metrics"].items()
                      if e["gated"] and e["kind"] not in (DIVERGENCE, AGREEMENT)})
    for i, metric in enumerate(metrics):
        entries = sorted(((c["bits_per_element"], c["metrics"][metric], c["name"]) for c in candidates
                          if metric in c["metrics"]), key=lambda entry: (entry[0], entry[2]))  # equal bits: by name
        pts = [(x, e["relative"], name) for x, e, name in entries]
        line = _named_curve(ax, pts, label=metric)
        offset = (i - len(metrics) / 2) * 0.04  # side by side, so intervals do not hide each other
        ax.errorbar([x + offset for x, _, _ in entries], [e["relative"] for _, e, _ in entries],
                    yerr=[[max(e["relative"] - e["ci_low"], 0) for _, e, _ in entries],
                          [max(e["ci_high"] - e["relative"], 0) for _, e, _ in entries]],
                    fmt="none", ecolor=line.get_color(), alpha=0.5, capsize=2)
    _accuracy_threshold(ax, cfg)
    ax.axhline(1 / cfg.gate.max_perplexity_ratio, color="orange", ls=":", lw=1,
               label=f"perplexity threshold 1/{cfg.gate.max_perplexity_ratio}")
    ax.set_xlabel("bits per element (measured memory_report)")
    ax.set_ylabel("relative score, paired interval (1.0 = fp16 baseline)")
    ax.set_title(f"{cfg.name}: quality vs KV-cache size ({cfg.eval.mode} mode)")
    ax.legend(fontsize=7, loc="lower right")
    return _png(fig)


def _named_curve(ax, points: list[tuple[float, float, str]], label: str | None = None):
    """``(x, y, name)`` points joined in order, each annotated with its name; returns the line."""
    (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
    for x, y, name in points:
        ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    return line


def _accuracy_threshold(ax, cfg: ExperimentConfig) -> None:
    ax.axhline(cfg.gate.min_relative_accuracy, color="red", ls="--", lw=1,
               label=f"accuracy threshold {cfg.gate.min_relative_accuracy}")


def _gate_line(cfg: ExperimentConfig) -> str:
    gate = cfg.gate
    limits = [f"accuracy ratio >= {gate.min_relative_accuracy}", f"perplexity ratio <= {gate.max_perplexity_ratio}",
              *([f"mean KL divergence <= {gate.max_kl_divergence} nats/token"] if gate.max_kl_divergence else []),
              *([f"top-1 agreement >= {gate.min_top1_agreement}"] if gate.min_top1_agreement else [])]
    if gate.decide_on == "point":
        how = ("**decided on the point estimate alone (`decide_on: point`): not a statistical test**; "
               f"{gate.confidence:.0%} paired bootstrap intervals are shown")
    else:
        how = (f"paired non-inferiority: pass when the {gate.confidence:.0%} paired interval (accuracy: Dirichlet "
               f"posterior of the paired outcomes; windows: {gate.bootstrap} bootstrap resamples) clears the "
               "threshold, fail when it lies beyond it, else inconclusive")
    if gate.max_documents:
        plans = "; ".join(f"{task} after {', '.join(map(str, looks(cfg.eval.tasks.limit_for(task), cap)))}"
                          for task, cap in ((t, gate.max_documents) for t in cfg.gated_tasks()))
        how += (f"; sequential documents while a verdict is open, looks planned per task ({plans} documents), each "
                "look's interval widened for the looks planned (the confidence beside each row) so that all together "
                f"keep the error at {1 - gate.confidence:.0%}")
    return (", ".join(limits) + f"; {how}; a gated metric counts only where at least {gate.min_quantized_share:.0%} "
            "of the keys and of the values attention read were quantized (else: not exercised)")


def _header(doc: dict, cfg: ExperimentConfig) -> list[str]:
    """The decision and everything needed to reproduce the run: command, model, mode, gate, environment."""
    env = doc["environment"]
    mode = f"{cfg.eval.mode}" + (f" (chunk size {cfg.eval.chunk_size})" if cfg.eval.mode == "streaming" else "")
    return [
        f"# kvquant report: {cfg.name}",
        "",
        f"**Decision: {doc['decision'].upper()}** — {doc['reason']}.",
        "",
        f"- command: `{doc['command']}`",
        f"- model: `{cfg.model.path}` ({cfg.model.dtype}); evaluation mode: {mode}; seed {cfg.eval.seed}",
        f"- gate: {_gate_line(cfg)}",
        *([f"- steps: {'; '.join(doc['plan']['steps'])}"] if "plan" in doc else []),
        f"- every number below was measured with attention reading the quantized K/V ({mode} mode); the baseline "
        "is the fp16 identity quantizer through the same cache code",
        f"- environment: {env['machine']}; python {env['python']}, torch {env['torch']}, transformers "
        f"{env['transformers']}, lm_eval {env['lm_eval']}, kvquant {env['kvquant']} (measuring "
        f"sources {env['kvquant_source_sha256']}); git {env['git_commit']}; {env['date']}",
        f"- run {doc['run_id']} (also in results.json and config.resolved.yaml); results: "
        f"{doc['results']['computed']} measured in this run, {doc['results']['reused_from_partial']} reused from "
        f"partial/ (same inputs, same code version); {doc['results']['processes']} process(es), "
        f"{doc['results']['seconds']} s"
        + (f"; unreadable partial results set aside and recomputed: {', '.join(doc['results']['set_aside'])}"
           if doc["results"]["set_aside"] else ""),
        *(f"- warning: {w}" for w in doc["warnings"]),
    ]


def _span(entry: dict, role: str) -> str:
    """The smallest and largest of a calibrated candidate's ``role`` scales, over layers and heads."""
    values = [v for own in entry["layers"].values() for v in (own[role] if isinstance(own[role], list)
                                                               else [own[role]])]
    return f"{min(values):.4g}..{max(values):.4g}"


def _calibration_section(calibration: dict) -> list[str]:
    """Each calibrated candidate's static scales: their range over layers (and KV heads), per layer in
    results.json."""
    lines = ["## Calibrated scales", "", "| candidate | granularity | windows | k_scale min..max | v_scale min..max |",
             "|---|---|---:|---|---|"]
    for label, entry in calibration.items():
        lines.append(f"| {label} | {entry['granularity']} | {entry['windows']} | {_span(entry, 'k_scale')} | "
                     f"{_span(entry, 'v_scale')} |")
    lines += ["", "Scales are amax / divisor of the keys and values observed on the calibration split (windows after "
              "each gated perplexity set's evaluation windows; llm-compressor's minmax observer); every layer's "
              "scales are in results.json (`calibration`).", ""]
    for label, entry in calibration.items():
        if entry["saturating"]:
            lines += [f"<details><summary>{label}: {len(entry['saturating'])} layer streams saturate at their "
                      "calibrated scale on the calibration split</summary>", "",
                      *(f"- {message}" for message in entry["saturating"]), "", "</details>", ""]
    return lines


def _markdown(doc: dict, frame: pd.DataFrame, cfg: ExperimentConfig, curve: dict) -> str:
    lines = [
        *_header(doc, cfg),
        "",
        "## Candidates",
        "",
        f"| candidate | settings | bits/element | memory vs fp16 | memory vs fp16 at {LONG_CONTEXT:,} tokens | "
        "verdict |",
        "|---|---|---:|---:|---:|---|",
    ]
    for c in doc["candidates"]:
        settings = ", ".join(f"{k}={v}" if k != "layers" else f"layers=({len(v)} ranges, in results.json)"
                             for k, v in c["settings"].items())
        lines.append(f"| {c['name']} | {settings} | {c['bits_per_element']:.2f} | {c['memory_ratio']:.3f} | "
                     f"{c['memory_ratio_long']:.3f} | {c['verdict'].upper()} |")
    mem = doc["baseline"]["memory"]
    lines += ["", f"Bits/element and memory vs fp16: measured by `memory_report()` after {mem['tokens']} tokens "
              "through the model (payload, scales and full-precision tokens, all counted; the gate's 'cheapest' "
              f"uses these bits); at {LONG_CONTEXT:,} tokens: the same cache code run on shape-only tensors of this "
              f"model's layers, states in the model's dtype (fp16 takes {mem['long']['fp16_bytes'] / 2**20:.1f} MiB "
              "per sequence there). The baseline "
              f"holds {mem['bits_per_element']:.0f} bits/element (the model's dtype).", "", "## Metrics", "",
              "| candidate | metric | value | baseline | statistic | interval | threshold | verdict | quantized "
              "share | median / p90 tokens | bits at median | n |",
              "|---|---|---:|---:|---:|---|---:|---|---:|---|---:|---:|"]
    for _, r in frame.iterrows():
        verdict = r.verdict.upper() if r.gated else "not gated"
        if r.point_estimate_only and r.gated:
            verdict += " (point estimate)"
        if isinstance(r.more_documents, (int, float)) and r.more_documents == r.more_documents:
            verdict += f", ~{int(r.more_documents):,} more to decide"
        share = f"{r.quantized_share:.1%}" if r.quantized_share == r.quantized_share else "-"
        lengths = (f"{r.median_length:.0f} / {r.p90_length:.0f}" if "median_length" in r and
                   r.median_length == r.median_length else "-")
        bits = (f"{r.bits_per_element_at_median:.2f}" if "bits_per_element_at_median" in r and
                r.bits_per_element_at_median == r.bits_per_element_at_median else "-")
        threshold = f"{r.threshold:.4f}" if r.threshold == r.threshold else "-"
        lines.append(f"| {r.candidate} | {r.metric} | {r.value:.4f} | {r.baseline:.4f} | {r.statistic:.4f} | "
                     f"[{r.ci_low:.4f}, {r.ci_high:.4f}] ({r.confidence:.1%}) | {threshold} | {verdict} | {share} | "
                     f"{lengths} | {bits} | {r.n} |")
    lines += ["", "Statistic: the relative score (candidate / baseline accuracy, baseline / candidate perplexity; "
              "1.0 = no loss), or the value of `kl/` (mean KL divergence of the candidate's next-token distribution "
              "from the baseline's, nats per position) and `top1/` (share of positions whose most likely token is "
              "the baseline's). Interval: paired bootstrap over documents (tasks) or windows (perplexity sets), at "
              "the confidence shown. Quantized share: of the keys and of the values attention read (per query, "
              "causally, over every layer), the smaller share stored quantized; bits at median: the cache's bits "
              "per element at the median request length (the bits column of the candidates is at "
              f"{mem['tokens']} tokens). Perplexity rows: summed NLL and token counts are in results.json.", ""]
    lines += _divergence_table(doc)
    lines += ["![quality vs bits](plot.png)", ""]
    if curve:
        lines += _probe_table(curve)
    if "calibration" in doc:
        lines += _calibration_section(doc["calibration"])
    if "search" in doc:
        lines += _search_section(doc["search"])
    if "staged" in doc:
        lines += _stages_section(doc)
    return "\n".join(lines)


def _divergence_table(doc: dict) -> list[str]:
    rows = [(c["name"], name.split("/", 1)[1], e, c["metrics"].get(f"top1/{name.split('/', 1)[1]}"))
            for c in doc["candidates"] for name, e in c["metrics"].items() if e["kind"] == DIVERGENCE]
    if not rows:
        return []
    lines = ["## Divergence from the baseline", "", "Per position, KL(baseline || candidate) of the next-token "
             "distributions (nats), with paired bootstrap intervals over windows; top-1: positions whose most likely "
             "token is unchanged.", "", "| candidate | set | mean KL | median KL | p99 KL | top-1 agreement |",
             "|---|---|---|---|---|---|"]
    for name, pset, e, top in rows:
        cell = lambda v, ci: f"{v:.5f} [{ci[0]:.5f}, {ci[1]:.5f}]"  # noqa: E731
        agreement = f"{top['value']:.4f} [{top['ci_low']:.4f}, {top['ci_high']:.4f}]" if top else "-"
        lines.append(f"| {name} | {pset} | {cell(e['value'], (e['ci_low'], e['ci_high']))} | "
                     f"{cell(e['median'], e['median_ci'])} | {cell(e['p99'], e['p99_ci'])} | {agreement} |")
    return [*lines, ""]


def _search_section(search: dict) -> list[str]:
    cal = search["calibration"]
    split = "; ".join([*(f"{name}: windows {a}-{b - 1}" for name, (a, b) in cal["windows"].items()),
                       *(f"{task}: documents {a}-{b - 1}" for task, (a, b) in cal["documents"].items())])
    gated = "the gated perplexity sets and tasks" if cal["tasks_gated"] else "the gated perplexity sets alone"
    if search.get("max_bits") is not None:
        outcome = (f"Budget: {search['max_bits']:g} bits/element; step {search['step']} of {search['steps']} is the "
                   f"last map within it, and it {'passes' if search['found'] else 'fails'} the gate on the "
                   "calibration split (the evaluation split decides)")
    else:
        outcome = (f"step {search['step']} of {search['steps']} is the first map that passes the gate on the "
                   "calibration split" if search["found"] else
                   f"no map passes the gate on the calibration split, not even step {search['steps']} (every "
                   "layer at the top rung); that map is evaluated")
    lines = ["", "## Per-layer search", "",
             f"Calibration split (held apart from evaluation, which reads the documents and windows before these): "
             f"{split}. Ladder, cheapest first: "
             + ", ".join(f"{r['name']} ({r['bits_per_element']:.3f} bits/element)" for r in search["ladder"])
             + f". Loss with every layer at the top rung: {search['reference_loss']:.4f} nats/token. "
             "On the calibration "
             f"split a map passes when {gated} meet the gate, perplexity ratio at most "
             f"{cal['max_perplexity_ratio']:g}"
             + (f", mean KL divergence at most {cal['max_kl_divergence']:g} nats/token"
                if cal.get("max_kl_divergence") is not None else "")
             + (f", top-1 agreement at least {cal['min_top1_agreement']:g}"
                if cal.get("min_top1_agreement") is not None else "")
             + f". {outcome}; "
             f"it is evaluated as candidate `{search['name']}` above, and `searched.yaml` reruns it alone.", "",
             "| step | bits/element | passes on calibration | gated relative scores"
             + (" (KL: nats/token)" if "max_kl_divergence" in cal else "") + " |", "|---:|---:|---|---|"]
    for c in search["checked"]:
        scores = ", ".join(f"{m} {v:.4f}" for m, v in c["metrics"].items())
        lines.append(f"| {c['step']} | {c['bits_per_element']:.3f} | {'yes' if c['passed'] else 'no'} | {scores} |")
    names = [r["name"] for r in search["ladder"]]
    lines += ["", "| layer | rung | " + " | ".join(f"loss increase at {n}" for n in names[:-1]) + " |",
              "|---:|---|" + "---:|" * (len(names) - 1)]
    for layer, rung in search["map"].items():
        lines.append(f"| {layer} | {rung} | "
                     + " | ".join(f"{v:+.4f}" for v in search["sensitivity"][layer][:-1]) + " |")
    return lines + [""]


def _stage_rows(doc: dict) -> list[dict]:
    """Per stage (the baseline first): serving figures, the lowest gated relative score, pass/fail."""
    staged = doc["staged"]
    by_name = {c["name"]: c for c in doc["candidates"]}
    out = []
    for name in ["baseline", *staged["stages"]]:
        serving = staged["serving"][name]
        c = by_name.get(name)
        gated = [e["relative"] for e in c["metrics"].values() if e["gated"]] if c else [1.0]
        out.append({"name": name, "bytes": serving["kv_bytes_per_request"],
                    "max_batch": Serving.from_dict(serving).max_batch(staged["budget_bytes"]),
                    "p50": serving["p50_ms"], "p99": serving["p99_ms"], "worst": min(gated),
                    "passed": c["passed"] if c else True,
                    "sharing": staged["prefix_sharing"].get(name, False)})
    return out


def _stages_section(doc: dict) -> list[str]:
    staged = doc["staged"]
    serving = staged["shape"]
    first = staged["first_failing"]
    lines = ["", "## Stages", "",
             f"Serving shape: {serving['requests']} requests sharing a {serving['prefix']}-token prefix, "
             f"{serving['suffix']} tokens each of their own, then {serving['decode_steps']} greedy decoding steps of "
             "the batch; KV bytes "
             "per request from `memory_report()` at the end (a prefix stored once is divided among the requests); "
             f"max batch: requests whose KV fits {serving['memory_budget']} ({staged['budget_bytes']:,} bytes: the "
             "shared prefix once, then each request's own bytes); step latency on this machine. Worst relative: the "
             "lowest gated relative score. " + (f"The first stage that does not pass is **{first}**." if first else
                                                "Every stage passes."), "",
             "| stage | prefix sharing | KV bytes/request | max batch | decode p50 ms | decode p99 ms | worst relative "
             "| passed |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in _stage_rows(doc):
        mark = " (first not passing)" if r["name"] == first else ""
        lines.append(f"| {r['name']}{mark} | {'yes' if r['sharing'] else 'no'} | {r['bytes']:,.0f} | "
                     f"{r['max_batch']:,} | {r['p50']:.1f} | {r['p99']:.1f} | {r['worst']:.4f} | "
                     f"{'yes' if r['passed'] else 'no'} |")
    return lines + ["", "![memory vs accuracy per stage](stages.png)", ""]


def _stages_plot(doc: dict, cfg: ExperimentConfig) -> bytes:
    """KV bytes per request vs the lowest gated relative score, one point per stage, the threshold drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _stage_rows(doc)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _named_curve(ax, [(r["bytes"] / 2**20, r["worst"], r["name"]) for r in rows])
    _accuracy_threshold(ax, cfg)
    ax.set_xlabel("KV MiB per request (measured)")
    ax.set_ylabel("lowest gated relative score")
    ax.set_title(f"{cfg.name}: stages")
    ax.legend(fontsize=7, loc="lower right")
    return _png(fig)
