"""A run's ``report.md``: the decision and how to reproduce it, the candidates, every metric's verdict, the
divergence from the baseline, the long-range probe, calibrated scales, a search's steps and map, a staged run's
stages; rendered from the typed :class:`~kvquant.experiment.results.RunResult` and the reports of
:mod:`kvquant.runner.report_facts`.
"""

from __future__ import annotations

from kvquant.experiment.metric import AGREEMENT, DIVERGENCE, METRICS
from kvquant.experiment.config import ExperimentConfig
from kvquant.runner.gate import TOO_FEW, duration, verdict_text
from kvquant.experiment.gate_config import looks
from kvquant.runner.report_facts import CandidateReport, MetricReport, StageRow, probe_curve, stage_rows
from kvquant.runner.report_lengths import lengths_section
from kvquant.experiment.results import LONG_CONTEXT, Memory, MetricId, RunResult, SearchSummary, Staged, bucket_end


def markdown(run: RunResult, candidates: tuple[CandidateReport, ...], run_id: str, env: dict[str, str]) -> str:
    """``report.md`` of ``run`` (``candidates``: :func:`kvquant.runner.report_facts.candidate_reports` of it; ``env``:
    :func:`kvquant.runner.report.environment`, as results.json records it)."""
    baseline = run.results["baseline"].memory
    curve = probe_curve(run.rows)
    lines = [*_header(run, run_id, env), "", *_candidates_section(candidates, baseline),
             *_metrics_section(candidates, baseline), *_divergence_table(candidates), *_flips_table(candidates),
             "![quality vs bits](plot.png)", ""]
    if curve:
        lines += probe_table(curve)
    lines += lengths_section(run)
    if run.calibration:
        lines += _calibration_section(run.calibration)
    if run.search:
        lines += _search_section(run.search)
    if run.staged:
        lines += _stages_section(run.staged, stage_rows(run, candidates))
    return "\n".join(lines)


def _gate_line(cfg: ExperimentConfig) -> str:
    gate = cfg.gate
    limits = [phrase for m in METRICS if (phrase := m.limit_phrase(getattr(gate, m.threshold_key)))]
    if gate.decide_on == "point":
        how = ("**decided on the point estimate alone (`decide_on: point`): not a statistical test**; "
               f"{gate.confidence:.0%} paired bootstrap intervals are shown")
    else:
        how = (f"paired non-inferiority: pass when the {gate.confidence:.0%} paired interval (accuracy: the score "
               f"interval of the paired ratio; windows: a studentized bootstrap of {gate.bootstrap} resamples, none "
               "decided by fewer than docs/gate.md's counts) clears the threshold, fail when it lies beyond it, "
               "else inconclusive")
    if gate.max_documents:
        plans = "; ".join(f"{task} after {', '.join(map(str, looks(cfg.eval.tasks.limit_for(task), cap)))}"
                          for task, cap in ((t, gate.max_documents) for t in cfg.gated_tasks()))
        how += (f"; sequential documents while a verdict is open, looks planned per task ({plans} documents), each "
                "look's interval widened for the looks planned (the confidence beside each row) so that all together "
                f"keep the error at {1 - gate.confidence:.0%}")
    return (", ".join(limits) + f"; {how}; a gated metric counts only where at least {gate.min_quantized_share:.0%} "
            "of the keys and of the values attention read were quantized (else: not exercised)")


def _replanned_line(replanned: dict) -> str:
    """The header's line on a plan changed after the data (``--replan``): the error over every look taken."""
    changes = "; then ".join(replanned["changes"])
    if replanned["error"] is None:
        return (f"- **plan changed after the data** ({changes}): the looks taken under the plan record set aside "
                f"are unknown, so a wrong pass's chance is unknown, not the {replanned['nominal']:.1%} this plan "
                "alone keeps")
    return (f"- **plan changed after the data** ({replanned['plans']} plans: {changes}): a wrong pass has up to "
            f"{replanned['error']:.1%} chance over the {replanned['looks']} looks of {replanned['metric']} taken under "
            f"them (union bound; one-sided), not the {replanned['nominal']:.1%} each plan alone keeps")


def _rendered_line(rendered: dict, command: str, env: dict[str, str]) -> str:
    """The header's line on a report rendered from stored results (``--render-only``): which code measured them,
    which judged and rendered them, when, with what command, from where, and the looks not stored."""
    code, judged = rendered["measured_by"], rendered["judged_by"]
    commit = f"; the report it replaced names git {code['git_commit']}" if code.get("git_commit") else ""
    vouched = (f", {rendered['vouched']} of them signed elsewhere and vouched for by naming the folder"
               if rendered["vouched"] else "")
    missing = (f"; not stored yet, so judged at the look before (the run without --render-only takes them): "
               f"{', '.join(rendered['not_stored'])}"
               if rendered["not_stored"] else "")
    return (f"- **rendered from stored results, no model loaded**: measured by code with measuring sources "
            f"{code['kvquant_source_sha256']} (kvquant {code['kvquant']}, torch {code['torch']}, transformers "
            f"{code['transformers']}, lm_eval {code['lm_eval']}){commit}; judged and rendered by git "
            f"{judged['git_commit']} (measuring sources {judged['kvquant_source_sha256']}) on {env['date']} with "
            f"`{command}`; {rendered['results']} stored results read from `{rendered['from']}`{vouched}{missing}")


def _header(run: RunResult, run_id: str, env: dict[str, str]) -> list[str]:
    """The decision and everything needed to reproduce the run: command, model, mode, gate, environment."""
    cfg, decision, provenance = run.config, run.decision, run.provenance
    mode = f"{cfg.eval.mode}" + (f" (chunk size {cfg.eval.chunk_size})" if cfg.eval.mode == "streaming" else "")
    return [
        f"# kvquant report: {cfg.name}",
        "",
        f"**Decision: {decision.decision.upper()}** — {decision.reason}.",
        "",
        f"- command: `{run.command}`",
        f"- model: `{cfg.model.path}` ({cfg.model.dtype}); evaluation mode: {mode}; seed {cfg.eval.seed}",
        f"- gate: {_gate_line(cfg)}",
        *([f"- steps: {'; '.join(run.plan.steps())}"] if run.plan else []),
        *([_replanned_line(run.replanned)] if run.replanned else []),
        f"- every number below was measured with attention reading the quantized K/V ({mode} mode); the baseline "
        "is the fp16 identity quantizer through the same cache code",
        f"- environment: {env['machine']}; python {env['python']}, torch {env['torch']}, transformers "
        f"{env['transformers']}, lm_eval {env['lm_eval']}, "
        + "".join(f"{pkg} {env[pkg]}, " for pkg in ("tokenizers", "gguf") if pkg in env)  # (older results lack them)
        + f"kvquant {env['kvquant']} (measuring sources {env['kvquant_source_sha256']}); git {env['git_commit']}; "
        f"{env['date']}",
        _rendered_line(provenance.rendered, run.command, env) if provenance.rendered else
        f"- run {run_id} (also in results.json and config.resolved.yaml); results: "
        f"{provenance.computed} measured in this run, {provenance.reused} reused from "
        f"partial/ (same inputs, same code version); {provenance.processes} process(es), "
        f"{provenance.seconds} s"
        + (f"; unreadable partial results set aside and recomputed: {', '.join(provenance.set_aside)}"
           if provenance.set_aside else ""),
        *(f"- warning: {w}" for w in provenance.warnings),
    ]


def _settings(memory: Memory) -> str:
    """A candidate's settings in one cell (a per-layer map: how many ranges it has)."""
    return ", ".join(f"{k}={v}" if k != "layers" else f"layers=({len(v)} ranges, in results.json)"
                     for k, v in memory.settings.items())


def _candidates_section(candidates: tuple[CandidateReport, ...], baseline: Memory) -> list[str]:
    """Each candidate's settings, bits per element, memory vs fp16 (measured and at a long context), verdict."""
    lines = ["## Candidates", "",
             f"| candidate | settings | bits/element | memory vs fp16 | memory vs fp16 at {LONG_CONTEXT:,} tokens | "
             "verdict |", "|---|---|---:|---:|---:|---|"]
    for c in candidates:
        lines.append(f"| {c.label} | {_settings(c.memory)} | {c.memory.bits_per_element:.2f} | "
                     f"{c.memory.measured['ratio']:.3f} | {c.memory.long['ratio']:.3f} | {c.status.upper()} |")
    measured = baseline.measured
    return lines + [
        "", f"Bits/element and memory vs fp16: measured by `memory_report()` after {measured['tokens']} tokens "
        "through the model (payload, scales and full-precision tokens, all counted; the gate's 'cheapest' "
        f"uses these bits); at {LONG_CONTEXT:,} tokens: the same cache code run on shape-only tensors of this "
        f"model's layers, states in the model's dtype (fp16 takes {baseline.long['fp16_bytes'] / 2**20:.1f} MiB "
        "per sequence there). The baseline "
        f"holds {baseline.bits_per_element:.0f} bits/element (the model's dtype).", ""]


def _verdict_cell(m: MetricReport) -> str:
    """The verdict as the metrics table states it: gated or not, point estimate, documents still needed."""
    row, verdict = m.row, m.verdict
    if verdict.verdict == TOO_FEW and row.gated:
        return verdict_text(verdict)  # "too few documents (n = 3 of the 12 needed)": as inconclusive, not a pass
    text = verdict.verdict.upper() if row.gated else "not gated"
    if verdict.point and row.gated:
        text += " (point estimate)"
    if verdict.more is not None:
        text += f", ~{int(verdict.more):,} more to decide"
        if verdict.more_seconds is not None:
            text += f" (~{duration(verdict.more_seconds)})"
        if verdict.beyond_task:
            text += f", more than the {verdict.left:,} the task has left"
    return text + (f"; {verdict.note}" if verdict.note else "")


def _number(value: float, spec: str) -> str:
    """``value`` in ``spec``, or ``-`` where it is nan (not counted, or no threshold)."""
    return format(value, spec) if value == value else "-"


def _metric_line(label: str, name: str, m: MetricReport) -> str:
    row = m.row
    median, p90 = m.length(0.5), m.length(0.9)
    lengths = f"{median:.0f} / {p90:.0f}" if median == median else "-"
    return (f"| {label} | {name} | {row.value:.4f} | {row.baseline:.4f} | {row.statistic:.4f} | "
            f"[{row.ci_low:.4f}, {row.ci_high:.4f}] ({row.confidence:.1%}) | {_number(m.verdict.threshold, '.4f')} | "
            f"{_verdict_cell(m)} | {_number(row.quantized_share, '.1%')} | {lengths} | "
            f"{_number(m.bits_at_median, '.2f')} | {row.n} |")


def _metrics_section(candidates: tuple[CandidateReport, ...], baseline: Memory) -> list[str]:
    """Every candidate x metric: value, baseline, statistic, interval, threshold, verdict, what was exercised."""
    lines = ["## Metrics", "",
             "| candidate | metric | value | baseline | statistic | interval | threshold | verdict | quantized "
             "share | median / p90 tokens | bits at median | n |",
             "|---|---|---:|---:|---:|---|---:|---|---:|---|---:|---:|"]
    lines += [_metric_line(c.label, name, m) for c in candidates for name, m in c.metrics.items()]
    return lines + [
        "", "Statistic: the relative score (candidate / baseline accuracy, baseline / candidate perplexity; "
        "1.0 = no loss), or the value of "
        + " and ".join(f"`{m.measures[0]}/` ({m.explained})" for m in METRICS if m.by_value)
        + ". Interval: the paired score interval (tasks) or the paired studentized "
        "bootstrap over windows (perplexity sets), at the confidence shown. Quantized share: of the keys and of "
        "the values attention read (per query, causally, over every layer), the smaller share stored quantized; "
        "bits at median: the cache's bits per element at the median request length (the bits column of the "
        f"candidates is at {baseline.measured['tokens']} tokens). Perplexity rows: summed NLL and token counts "
        "are in results.json.",
        ""]


def _interval(value: float, low: float, high: float, digits: int) -> str:
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def _divergence_table(candidates: tuple[CandidateReport, ...]) -> list[str]:
    """Per candidate and perplexity set: mean, median and p99 KL divergence, and top-1 agreement."""
    rows = [(c, m) for c in candidates for m in c.metrics.values()
            if m.row.kind is DIVERGENCE and bucket_end(m.row.metric) is None]  # buckets: the long-context section
    if not rows:
        return []
    lines = ["## Divergence from the baseline", "", "Per position, KL(baseline || candidate) of the next-token "
             "distributions (nats), with paired studentized bootstrap intervals over windows; top-1: positions whose "
             "most likely token is unchanged.", "",
             "| candidate | set | mean KL | median KL | p99 KL | top-1 agreement |", "|---|---|---|---|---|---|"]
    for c, m in rows:
        source = m.row.metric.source
        top = c.metric(MetricId(AGREEMENT.measures[0], source))
        agreement = _interval(top.row.value, top.row.ci_low, top.row.ci_high, 4) if top else "-"
        quantiles = [_interval(q.value, q.low, q.high, 5) for _, q in m.quantiles]
        lines.append(f"| {c.label} | {source} | {_interval(m.row.value, m.row.ci_low, m.row.ci_high, 5)} | "
                     + " | ".join(quantiles) + f" | {agreement} |")
    return [*lines, ""]


def _flips_table(candidates: tuple[CandidateReport, ...]) -> list[str]:
    """Per candidate and task: the documents whose answer went from right to wrong and from wrong to right."""
    rows = [(c.label, name, m.flips) for c in candidates for name, m in c.metrics.items() if m.flips is not None]
    if not rows:
        return []

    def share(k: int, n: int, interval: tuple[float, float]) -> str:
        return f"{k} ({k / n:.1%} [{interval[0]:.1%}, {interval[1]:.1%}])" if n else "-"

    lines = ["## Flips", "", "Documents the candidate answers differently from the baseline, paired by document: "
             "the same accuracy can hide answers changed both ways. Shares with exact (Clopper-Pearson) intervals "
             "at the gate's confidence; gated (the `flips/` rows above) where `gate.max_flip_rate` is set.", "",
             "| candidate | metric | n | right to wrong | wrong to right | flip rate |", "|---|---|---:|---|---|---|"]
    for label, name, f in rows:
        lines.append(f"| {label} | {name} | {f.n} | {share(f.right_to_wrong, f.n, f.right_to_wrong_interval)} | "
                     f"{share(f.wrong_to_right, f.n, f.wrong_to_right_interval)} | "
                     f"{share(f.right_to_wrong + f.wrong_to_right, f.n, f.rate_interval)} |")
    return [*lines, ""]


def wilson_interval(k: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of ``k`` successes in ``n`` trials."""
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return ci.low, ci.high


def _probe_cell(point: tuple[float, int] | None) -> str:
    if point is None:
        return ""
    acc, n = point
    k = round(acc * n)
    low, high = wilson_interval(k, n)
    return f"{k}/{n} [{low:.2f}, {high:.2f}]"


def probe_table(curve: dict[str, dict[int, tuple[float, int]]]) -> list[str]:
    """The long-range probe's accuracy by distance, per setting (``curve``: :func:`kvquant.runner.report_facts.
    probe_curve`), with Wilson intervals."""
    names = list(curve)
    distances = sorted({d for points in curve.values() for d in points})
    lines = ["## Long-range probe", "", "Accuracy of pass-key retrieval by distance (`kvquant.scoring.passkey`): "
             "correct / n, with its 95% Wilson interval.", "",
             "| distance | " + " | ".join(names) + " |", "|---:|" + "---|" * len(names)]
    for d in distances:
        lines.append(f"| {d} | " + " | ".join(_probe_cell(curve[name].get(d)) for name in names) + " |")
    return [*lines, "", "![long-range probe](probe.png)", ""]


def _span(entry: dict, role: str) -> str:
    """The smallest and largest of a calibrated candidate's ``role`` scales, over layers and heads."""
    values = [v for own in entry["layers"].values() for v in (own[role] if isinstance(own[role], list)
                                                               else [own[role]])]
    return f"{min(values):.4g}..{max(values):.4g}"


def _calibration_section(calibration: dict) -> list[str]:
    """Each calibrated candidate's static scales, key offsets or levels, a table for each kind (every layer's in
    results.json)."""
    grouped: dict = {}
    for label, entry in calibration.items():
        grouped.setdefault(SECTIONS.get(entry["granularity"], _scales_section), {})[label] = entry
    return [line for section, entries in grouped.items() for line in section(entries)]


def _table(title: str, columns: list[str], row, note: str, calibration: dict) -> list[str]:
    """A section: ``title``, a table of ``columns`` (the first left-aligned text, numbers where a column's name says
    so) with ``row(label, entry)`` per candidate, then ``note``."""
    align = "|".join("---:" if c in ("windows", "tokens", "largest in layer") else "---" for c in columns)
    return [f"## {title}", "", f"| {' | '.join(columns)} |", f"|{align}|",
            *(f"| {' | '.join(row(label, entry))} |" for label, entry in calibration.items()), "", note, ""]


def _levels_row(label: str, entry: dict) -> list[str]:
    first = entry["layers"][min(entry["layers"], key=int)]
    return [label, entry["granularity"], str(entry["windows"]), f"{entry['tokens']:,}",
            *(" ".join(f"{v:+.3f}" for v in first[f"{role}_levels"]) for role in ("key", "value"))]


def _levels_section(calibration: dict) -> list[str]:
    """Each candidate's fitted levels: layer 0's, every layer's in results.json."""
    return _table("Calibrated levels", ["candidate", "calibrate", "windows", "tokens", "layer 0 key levels",
                                        "layer 0 value levels"], _levels_row,
                  "Levels per layer for keys and values apart, on x / max|x| per token and head: a k-means of the "
                  "calibration split's states, each weighted by its Fisher information (squared gradient of the "
                  "loss, times the vector's scale squared) for `fisher_kmeans`, alike for `kmeans` "
                  "(docs/quantizers.md); every layer's are in results.json (`calibration`).", calibration)


def _largest_offsets(entry: dict) -> list[str]:
    """The range over layers of a layer's largest |key offset|, and the layer of the largest."""
    largest = {layer: max(abs(v) for row in own["key_offset"] for v in row) for layer, own in entry["layers"].items()}
    top = max(largest, key=largest.get)
    return [f"{min(largest.values()):.4g}..{largest[top]:.4g}", top]


def _offsets_row(label: str, entry: dict) -> list[str]:
    return [label, str(entry["windows"]), f"{entry['tokens']:,}", *_largest_offsets(entry)]


def _offsets_section(calibration: dict) -> list[str]:
    """Each candidate's key offsets: the largest |offset| of each layer, its range over layers and where the
    largest is."""
    return _table("Calibrated key offsets", ["candidate", "windows", "tokens", "largest absolute offset per layer, "
                                             "min..max", "largest in layer"], _offsets_row,
                  "A layer's key offset is the post-RoPE keys' mean per KV head and channel over the tokens of the "
                  "calibration split (windows after each gated perplexity set's evaluation windows), subtracted from "
                  "every key before it is quantized and added back on read; every layer's is in results.json "
                  "(`calibration`).", calibration)


def _bias_section(calibration: dict) -> list[str]:
    """Each ``key_bias`` candidate's key offsets (read from the weights: no windows), as :func:`_offsets_section`."""
    return _table("Key offsets from the k_proj bias", ["candidate", "largest absolute offset per layer, min..max",
                                                       "largest in layer"],
                  lambda label, entry: [label, *_largest_offsets(entry)],
                  "A layer's key offset is its k_proj bias per KV head and channel, read from the weights (no "
                  "calibration windows): before RoPE every key is W x + b, so a pre-RoPE cache subtracts b from "
                  "every key before it is quantized and adds it back before RoPE is put back on; every layer's is in "
                  "results.json (`calibration`).", calibration)


def _scales_section(calibration: dict) -> list[str]:
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


#: The report section of each kind of calibration (``granularity``); static scales where not named.
SECTIONS = {"key_offset": _offsets_section, "key_bias": _bias_section, "kmeans": _levels_section,
            "fisher_kmeans": _levels_section}


def _search_outcome(search: SearchSummary) -> str:
    """Which map the search chose, and whether it passes on the calibration split."""
    if search.max_bits is not None:
        return (f"Budget: {search.max_bits:g} bits/element; step {search.step} of {search.steps} is the "
                f"last map within it, and it {'passes' if search.found else 'fails'} the gate on the "
                "calibration split (the evaluation split decides)")
    if search.found:
        return f"step {search.step} of {search.steps} is the first map that passes the gate on the calibration split"
    return (f"no map passes the gate on the calibration split, not even step {search.steps} (every "
            "layer at the top rung); that map is evaluated")


def _search_intro(search: SearchSummary) -> str:
    """The calibration split, the ladder, the calibration gate and the outcome, in one paragraph."""
    cal = search.calibration
    split = "; ".join([*(f"{name}: windows {a}-{b - 1}" for name, (a, b) in cal["windows"].items()),
                       *(f"{task}: documents {a}-{b - 1}" for task, (a, b) in cal["documents"].items())])
    gated = "the gated perplexity sets and tasks" if cal["tasks_gated"] else "the gated perplexity sets alone"
    return (f"Calibration split (held apart from evaluation, which reads the documents and windows before these): "
            f"{split}. Ladder, cheapest first: "
            + ", ".join(f"{r['name']} ({r['bits_per_element']:.3f} bits/element)" for r in search.ladder)
            + f". Loss with every layer at the top rung: {search.reference_loss:.4f} nats/token. "
            "On the calibration "
            f"split a map passes when {gated} meet the gate, perplexity ratio at most "
            f"{cal['max_perplexity_ratio']:g}"
            + "".join(f", {m.limit_phrase(cal[m.threshold_key], words=True)}" for m in METRICS
                      if m.reference is not None and cal.get(m.threshold_key) is not None)
            + f". {_search_outcome(search)}; "
            f"it is evaluated as candidate `{search.name}` above, and `searched.yaml` reruns it alone.")


def _search_section(search: SearchSummary) -> list[str]:
    """The search's calibration and outcome, every map checked, and each layer's rung and sensitivity."""
    lines = ["", "## Per-layer search", "", _search_intro(search), "",
             "| step | bits/element | passes on calibration | gated relative scores"
             + (" (KL: nats/token)" if "max_kl_divergence" in search.calibration else "") + " |",
             "|---:|---:|---|---|"]
    for c in search.checked:
        scores = ", ".join(f"{m} {v:.4f}" for m, v in c["metrics"].items())
        lines.append(f"| {c['step']} | {c['bits_per_element']:.3f} | {'yes' if c['passed'] else 'no'} | {scores} |")
    names = [r["name"] for r in search.ladder]
    lines += ["", "| layer | rung | " + " | ".join(f"loss increase at {n}" for n in names[:-1]) + " |",
              "|---:|---|" + "---:|" * (len(names) - 1)]
    for layer, rung in search.map.items():
        lines.append(f"| {layer} | {rung} | "
                     + " | ".join(f"{v:+.4f}" for v in search.sensitivity[layer][:-1]) + " |")
    return lines + [""]


def _stages_section(staged: Staged, rows: list[StageRow]) -> list[str]:
    """The serving shape, then per stage: KV bytes per request, max batch, decode latency, worst relative score."""
    shape, first = staged.shape, staged.first_failing
    lines = ["", "## Stages", "",
             f"Serving shape: {shape['requests']} requests sharing a {shape['prefix']}-token prefix, "
             f"{shape['suffix']} tokens each of their own, then {shape['decode_steps']} greedy decoding steps of "
             "the batch; KV bytes "
             "per request from `memory_report()` at the end (a prefix stored once is divided among the requests); "
             f"max batch: requests whose KV fits {shape['memory_budget']} ({staged.budget_bytes:,} bytes: the "
             "shared prefix once, then each request's own bytes); step latency on this machine. Worst relative: the "
             "lowest gated relative score. " + (f"The first stage that does not pass is **{first}**." if first else
                                                "Every stage passes."), "",
             "| stage | prefix sharing | KV bytes/request | max batch | decode p50 ms | decode p99 ms | worst relative "
             "| passed |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        mark = " (first not passing)" if r.name == first else ""
        lines.append(f"| {r.name}{mark} | {'yes' if r.sharing else 'no'} | {r.bytes:,.0f} | "
                     f"{r.max_batch:,} | {r.p50:.1f} | {r.p99:.1f} | {r.worst:.4f} | "
                     f"{'yes' if r.passed else 'no'} |")
    return lines + ["", "![memory vs accuracy per stage](stages.png)", ""]
