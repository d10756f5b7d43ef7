"""A run's plots as PNG bytes: quality vs bits per element (``plot.png``), a staged run's memory vs accuracy per
stage (``stages.png``) and the long-range probe's accuracy vs distance (``probe.png``); rendered from the typed
reports of :mod:`kvquant.runner.report_facts`."""

from __future__ import annotations

import io
import math

from kvquant.experiment.config import ExperimentConfig
from kvquant.runner.report_facts import CandidateReport, StageRow


def _pyplot():
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    """The figure, gridded and laid out, as PNG bytes (the figure is closed)."""
    plt = _pyplot()
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def _named_curve(ax, points: list[tuple[float, float, str]], label: str | None = None):
    """``(x, y, name)`` points joined in order, each annotated with its name; returns the line."""
    (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
    for x, y, name in points:
        ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    return line


def _accuracy_threshold(ax, cfg: ExperimentConfig) -> None:
    ax.axhline(cfg.gate.min_relative_accuracy, color="red", ls="--", lw=1,
               label=f"accuracy threshold {cfg.gate.min_relative_accuracy}")


def quality_plot(candidates: tuple[CandidateReport, ...], cfg: ExperimentConfig) -> bytes:
    """The PNG of relative score vs bits per element (one curve per gated accuracy or perplexity metric, with
    its paired intervals), thresholds drawn."""
    fig, ax = _pyplot().subplots(figsize=(7, 4.5))
    metrics = sorted({name for c in candidates for name, m in c.metrics.items()
                      if m.row.gated and not m.row.kind.by_value})
    for i, metric in enumerate(metrics):
        entries = sorted(((c.memory.bits_per_element, c.metrics[metric].row, c.label) for c in candidates
                          if metric in c.metrics), key=lambda entry: (entry[0], entry[2]))  # equal bits: by name
        pts = [(x, row.relative, name) for x, row, name in entries]
        line = _named_curve(ax, pts, label=metric)
        offset = (i - len(metrics) / 2) * 0.04  # side by side, so intervals do not hide each other
        ax.errorbar([x + offset for x, _, _ in entries], [row.relative for _, row, _ in entries],
                    yerr=[[_reach(row.relative - row.ci_low) for _, row, _ in entries],
                          [_reach(row.ci_high - row.relative) for _, row, _ in entries]],
                    fmt="none", ecolor=line.get_color(), alpha=0.5, capsize=2)
    _accuracy_threshold(ax, cfg)
    ax.axhline(1 / cfg.gate.max_perplexity_ratio, color="orange", ls=":", lw=1,
               label=f"perplexity threshold 1/{cfg.gate.max_perplexity_ratio}")
    ax.set_xlabel("bits per element (measured memory_report)")
    ax.set_ylabel("relative score, paired interval (1.0 = fp16 baseline)")
    ax.set_title(f"{cfg.name}: quality vs KV-cache size ({cfg.eval.mode} mode)")
    ax.legend(fontsize=7, loc="lower right")
    return _png(fig)


def stages_plot(rows: list[StageRow], cfg: ExperimentConfig) -> bytes:
    """KV bytes per request vs the lowest gated relative score, one point per stage, the threshold drawn."""
    fig, ax = _pyplot().subplots(figsize=(7, 4.5))
    _named_curve(ax, [(r.bytes / 2**20, r.worst, r.name) for r in rows])
    _accuracy_threshold(ax, cfg)
    ax.set_xlabel("KV MiB per request (measured)")
    ax.set_ylabel("lowest gated relative score")
    ax.set_title(f"{cfg.name}: stages")
    ax.legend(fontsize=7, loc="lower right")
    return _png(fig)


def probe_plot(curve: dict[str, dict[int, tuple[float, int]]], cfg: ExperimentConfig) -> bytes:
    """The PNG of probe accuracy vs distance, one line per setting (``curve``: :func:`kvquant.runner.report_facts.
    probe_curve`)."""
    fig, ax = _pyplot().subplots(figsize=(7, 4.5))
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


def _reach(x: float) -> float:
    """An error bar's length: none where the interval is unbounded (a studentized interval over too few windows)."""
    return max(x, 0) if math.isfinite(x) else 0.0
