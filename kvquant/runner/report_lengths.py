"""The long-context part of a report (issue 40): per candidate the longest context its long-context metrics show
it safe at (:func:`kvquant.runner.gate.length_verdicts`), the KL divergence and top-1 agreement per position bucket
of ``eval.long_context``, the needle tasks by length, and ``lengths.png`` (each metric against length, with
intervals, one line per candidate). Rendered from the gate's verdicts; nothing here decides a value.
"""

from __future__ import annotations

import dataclasses
import math

from kvquant.experiment.metric import ACCURACY, DIVERGENCE, METRICS
from kvquant.runner.gate import judge, length_verdicts, metric_length, needles_at_chance, is_gated_metric, verdict_text
from kvquant.runner.report_plots import _png, _pyplot
from kvquant.experiment.results import RunResult, Verdict, bucket_end
from kvquant.scoring.needles import needle_chance
from kvquant.experiment.long_config import needle_task


def _at_chance(run: RunResult) -> frozenset[str]:
    return needles_at_chance(run.results["baseline"], run.config.gate)


def long_verdicts(run: RunResult) -> list[Verdict]:
    """Every long-context row of the run the length verdict judges, judged as it judges them (as if gated); the
    needle tasks the baseline is not shown above chance on keep their verdict (not gated)."""
    policy, at_chance = run.config.gate, _at_chance(run)
    return [judge(dataclasses.replace(v.row, gated=True), policy)
            if not v.row.gated and v.row.metric.source not in at_chance and is_gated_metric(v.row.metric, policy) else v
            for v in run.decision.verdicts if metric_length(v.row.metric) is not None]


def lengths_document(run: RunResult) -> dict:
    """What results.json records of the long-context verdicts: per candidate the length verdict, and the needle
    tasks left out because the baseline is not shown above chance."""
    at_chance = _at_chance(run)
    found = length_verdicts(run.rows, run.config.gate, at_chance)
    return {"min_context": run.config.gate.min_context,
            "candidates": {label: {"passes_up_to": v.passes_up_to, "fails_from": v.fails_from,
                                   "inconclusive": list(v.inconclusive), "not_exercised": list(v.not_exercised),
                                   "summary": v.describe()} for label, v in found.items()},
            "baseline_at_chance": sorted(at_chance)}


def _cell(v: Verdict, digits: int) -> str:
    row = v.row
    value = row.statistic
    shown = "" if v.verdict == "not gated" else f" {verdict_text(v)}"
    return f"{value:.{digits}f} [{row.ci_low:.{digits}f}, {row.ci_high:.{digits}f}]{shown}"


def _table(title: str, verdicts: list[Verdict], column, digits: int) -> list[str]:
    """One row per candidate, one column per ``column(verdict)`` (sorted), each cell a value, interval, verdict."""
    if not verdicts:
        return []
    columns = sorted({column(v) for v in verdicts}, key=lambda c: (c[0], c[1]))
    labels = list(dict.fromkeys(v.row.candidate for v in verdicts))
    cells = {(v.row.candidate, column(v)): _cell(v, digits) for v in verdicts}
    return [title, "", "| candidate | " + " | ".join(c[1] for c in columns) + " |",
            "|---|" + "---|" * len(columns),
            *(f"| {label} | " + " | ".join(cells.get((label, c), "-") for c in columns) + " |" for label in labels), ""]


def lengths_section(run: RunResult) -> list[str]:
    """``report.md``'s long-context section (nothing without long-context metrics)."""
    cfg, verdicts = run.config, long_verdicts(run)
    if not verdicts:
        return []
    doc = lengths_document(run)
    gate = (f"every long-context metric up to {cfg.gate.min_context:,} tokens is gated (`gate.min_context`); longer "
            "ones are judged here and reported" if cfg.gate.min_context else
            "reported, not gated (no `gate.min_context`): the decision above does not read them")
    lines = ["## Long context", "", f"The longest context each candidate is shown safe at: every long-context "
             f"metric judged at each length as the gate judges (same thresholds and confidence); {gate}.", "",
             "| candidate | longest context |", "|---|---|",
             *(f"| {label} | {v['summary']} |" for label, v in doc["candidates"].items()), ""]
    for source in doc["baseline_at_chance"]:
        lines.append(f"- {source}: the baseline is not shown above chance ({needle_chance(source):.2f}) here, so it "
                     "says nothing of a cache: left out of the verdicts, not gated.")
    lines += [""] if doc["baseline_at_chance"] else []
    long = cfg.eval.long_context
    if long is not None:
        edges = dict(zip(long.lengths, [0, *long.lengths[:-1]]))
        where = (f" ({long.documents} documents of {long.lengths[-1]:,} tokens from {long.text}, fed "
                 f"{cfg.eval.chunk_size} tokens at a time; nats per position, {cfg.gate.confidence:.0%} bootstrap "
                 "interval over documents)")
        for i, kind in enumerate(m for m in METRICS if m.bucketed):  # the first table says where the documents are
            lines += _table(f"### {kind.title} by position{where if i == 0 else ''}",
                            [v for v in verdicts if v.row.kind is kind],
                            lambda v: (bucket_end(v.row.metric), f"{edges[bucket_end(v.row.metric)]}-"
                                       f"{bucket_end(v.row.metric)}"), kind.digits)
    needles = [v for v in verdicts if v.row.kind is ACCURACY]
    lines += _table("### Needles (accuracy relative to the baseline's)", needles,
                    lambda v: (metric_length(v.row.metric), v.row.metric.source), ACCURACY.digits)
    return [*lines, "![metrics by length](lengths.png)", ""]


def lengths_plot(run: RunResult) -> bytes | None:
    """``lengths.png``: each long-context metric against length (log scale), with its interval, one line per
    candidate (None without long-context metrics)."""
    at_chance = _at_chance(run)
    verdicts = [v for v in long_verdicts(run) if v.row.kind in (DIVERGENCE, ACCURACY)
                and v.row.metric.source not in at_chance]
    if not verdicts:
        return None

    def panel_of(v: Verdict) -> str:  # KL, or the needle's kind
        return DIVERGENCE.kind if v.row.kind is DIVERGENCE else needle_task(v.row.metric.source)[0]

    panels = sorted({panel_of(v) for v in verdicts})
    fig, axes = _pyplot().subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        own = [v for v in verdicts if panel_of(v) == panel]
        for label in dict.fromkeys(v.row.candidate for v in own):
            points = [(x, v, v.row.statistic)
                      for x, v in sorted(((metric_length(v.row.metric), v) for v in own if v.row.candidate == label),
                                         key=lambda p: p[0])]
            points = [(x, v, y) for x, v, y in points if math.isfinite(y)]  # a baseline at 0: no ratio to draw
            xs, ys = [x for x, _, _ in points], [y for _, _, y in points]
            # the accuracy ratio's interval need not hold its point (0 of n against some): bars never negative
            low = [max(y - v.row.ci_low, 0) if math.isfinite(v.row.ci_low) else 0 for _, v, y in points]
            high = [max(v.row.ci_high - y, 0) if math.isfinite(v.row.ci_high) else 0 for _, v, y in points]
            ax.errorbar(xs, ys, yerr=[low, high], fmt="o-", capsize=3, label=label)
        if panel == DIVERGENCE.kind:
            ax.set_yscale("log")
            if run.config.gate.max_kl_divergence:
                ax.axhline(run.config.gate.max_kl_divergence, color="red", ls="--", lw=1, label="threshold")
        elif run.config.gate.min_relative_accuracy:
            ax.axhline(run.config.gate.min_relative_accuracy, color="red", ls="--", lw=1, label="threshold")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("position bucket end / needle length (tokens)")
        ax.set_ylabel("mean KL divergence (nats)" if panel == DIVERGENCE.kind else f"needle_{panel}: accuracy ratio")
        ax.legend(fontsize=7)
    fig.suptitle(f"{run.config.name}: long context")
    return _png(fig)
