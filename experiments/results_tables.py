"""The tables of docs/results.md, generated from the committed ``reports/*/results.json`` (never retyped).

    python experiments/results_tables.py           # rewrite the tables in docs/results.md
    python experiments/results_tables.py --check   # exit 1 if docs/results.md is out of date

docs/results.md holds narrative around blocks ``<!-- results:NAME:begin -->`` ... ``<!-- results:NAME:end -->``;
only the text between the markers is rewritten. ``NAME`` is ``index`` (one row per report), a report directory
(``int4``, ``staged``, ...) or a benchmark with a results.json (``bench_scoring``, ``gpu_check``). A report with
no block yet gets one appended at the end of the file; a block naming no report is an error. Standard library
only (no torch, no kvquant import), so it runs in a second.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- results:(?P<name>[\w.+=-]+):begin -->\n.*?<!-- results:(?P=name):end -->", re.S)


def table(header: list[str], rows: list[list[str]], align: str = "") -> str:
    """A markdown table; ``align``: one letter per column, ``r`` right-aligned, anything else left."""
    align = align.ljust(len(header), "l")
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def num(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def thousands(x: float) -> str:
    return f"{round(x):,}"


def config_path(command: str) -> str | None:
    """The config a ``python -m kvquant.run CONFIG ...`` command names."""
    parts = command.split()
    return parts[3] if len(parts) > 3 and parts[:3] == ["python", "-m", "kvquant.run"] else None


def gated_metrics(report: dict) -> list[str]:
    seen = []
    for cand in report["candidates"]:
        for metric, res in cand["metrics"].items():
            if res["gated"] and metric not in seen:
                seen.append(metric)
    return seen


def index_block(reports: dict[str, dict]) -> str:
    rows = []
    for name, rep in reports.items():
        env = rep["environment"]
        cfg = config_path(rep["command"])
        exists = "yes" if cfg and (ROOT / cfg).is_file() else "**no**"
        chosen = f"`{rep['chosen']}`" if rep["chosen"] else "—"
        rows.append([f"[`{name}`](../reports/{name}/report.md)", f"`{cfg}`", exists,
                     f"`{rep['config']['model']['path']}`", env["git_commit"][:7], env["date"][:10],
                     rep["decision"].upper(), chosen])
    return table(["report", "config recorded", "config in tree", "model", "commit", "date", "decision", "chosen"], rows)


def report_block(name: str, rep: dict) -> str:
    cfg, env = rep["config"], rep["environment"]
    gate = cfg["gate"]
    basis = {"point": "point estimate (the old rule: not a test)", "lower_bound": "lower bound (the old rule)"}.get(
        gate["decide_on"], f"paired {gate['confidence']:.0%} interval: pass / fail / inconclusive")
    mode = rep["mode"] + (f", chunk {rep['chunk_size']}" if rep["mode"] == "streaming" else "")
    metrics = gated_metrics(rep)
    first = rep["candidates"][0]["metrics"]
    baseline = ", ".join(f"{m} {first[m]['baseline']:.4g} (n {first[m]['n']})" for m in metrics)
    lines = [f"`{rep['command']}` — git {env['git_commit'][:7]}, {env['date'][:10]}; `{cfg['model']['path']}` "
             f"({cfg['model']['dtype']}), {mode}; gate: accuracy ≥ {gate['min_relative_accuracy']}, perplexity ≤ "
             f"{gate['max_perplexity_ratio']}x, on the {basis}."
             f" **Decision: {rep['decision'].upper()}**" + (f" (`{rep['chosen']}`)" if rep["chosen"] else "") + ".",
             "", f"Baseline (fp16 quantizer): {baseline}.", ""]
    long = next((c["memory"]["long"]["tokens"] for c in rep["candidates"] if "long" in c["memory"]), None)
    header = ["candidate", "bits/element", "memory vs fp16", *([f"at {long:,} tokens"] if long else []),
              *[f"{m}" for m in metrics], "verdict"]
    rows = []
    for cand in rep["candidates"]:
        cells = [f"`{cand['name']}`", num(cand["bits_per_element"]), num(cand["memory_ratio"])]
        if long:
            cells.append(num(cand.get("memory_ratio_long")))
        for m in metrics:
            res = cand["metrics"].get(m)
            cell = num(res.get("statistic", res["relative"])) if res else "—"
            cells.append(f"**{cell}**" if res and not res["passed"] else cell)
        cells.append(cand.get("verdict", "pass" if cand["passed"] else "fail"))
        rows.append(cells)
    lines.append(table(header, rows, "lrr" + "r" * (len(metrics) + bool(long)) + "l"))
    lines += ["", "Gated metrics as relative scores (candidate/baseline; baseline/candidate for perplexity); "
              "**bold**: not passed. Bits/element and memory measured at "
              f"{cfg['eval']['memory_probe_tokens']} tokens."]
    if rep.get("search"):
        lines += ["", *search_lines(rep["search"])]
    if rep.get("staged"):
        lines += ["", *staged_lines(rep)]
    return "\n".join(lines)


def search_lines(search: dict) -> list[str]:
    cal = search["calibration"]
    windows = ", ".join(f"{k} windows {a}-{b - 1}" for k, (a, b) in cal["windows"].items())
    ladder = ", ".join(f"`{r['name']}` ({r['bits_per_element']:.3f})" for r in search["ladder"])
    budget = search.get("max_bits")
    if budget is not None:  # the last map within the budget, whether or not it passes calibration
        target = f"budget {budget} bits/element"
        found = (f"step {search['step']} of {search['steps']}, which "
                 f"{'passes' if search['found'] else 'fails'} calibration")
    else:
        target = (f"calibration target perplexity ≤ {cal['max_perplexity_ratio']}x"
                  + (f", KL ≤ {cal['max_kl_divergence']} nats/token" if "max_kl_divergence" in cal else "")
                  + (f", top-1 agreement ≥ {cal['min_top1_agreement']}" if "min_top1_agreement" in cal else ""))
        found = f"step {search['step']} of {search['steps']}" if search["found"] else "none passes calibration"
    rows = [[str(c["step"]), num(c["bits_per_element"]), "yes" if c["passed"] else "no",
             ", ".join(f"{m} {v:.4f}" if m.startswith("kl/") else f"{m} {v:.3f}" for m, v in c["metrics"].items())]
            for c in search["checked"]]
    return [f"Search `{search['name']}`: ladder {ladder} (bits/element); calibration on {windows}"
            f"{' and task documents' if cal.get('tasks_gated') else ''}; {target}; map: {found}.", "",
            table(["step", "bits/element", "passed calibration",
                   "calibration relative scores" + (" (KL: nats/token)" if "max_kl_divergence" in cal else "")],
                  rows, "rrl")]


def staged_lines(rep: dict) -> list[str]:
    staged = rep["staged"]
    budget = staged["budget_bytes"]
    passed = {c["name"]: c["passed"] for c in rep["candidates"]}
    rows = []
    for label, res in staged["serving"].items():
        own, shared = res["own_bytes_per_request"], res["shared_bytes"]
        batch = max(int((budget - shared) // own), 0) if own > 0 else 0
        gate = "—" if label == "baseline" else ("pass" if passed[label] else "**fail**")
        sharing = "—" if label == "baseline" else ("yes" if staged["prefix_sharing"][label] else "no")
        rows.append([f"`{label}`", sharing, thousands(res["kv_bytes_per_request"]), str(batch),
                     f"{res['p50_ms']:,.0f} / {res['p99_ms']:,.0f}", gate])
    shape = staged["shape"]
    return [f"Serving shape: {shape['requests']} requests sharing a {shape['prefix']:,}-token prefix, "
            f"{shape['suffix']} tokens each, {shape['decode_steps']} decode steps; budget {shape['memory_budget']}. "
            "First failing stage: "
            f"`{staged['first_failing'] or 'none'}`.", "",
            table(["stage", "prefix sharing", "KV bytes/request", f"max batch at {shape['memory_budget']}",
                   "decode p50 / p99 ms", "gate"], rows, "llrrrl")]


def bench_scoring_block(rep: dict) -> str:
    args = rep["args"]
    rows = [[r["quantizer"], json.dumps(r["options"]) if r["options"] else "—", str(r["requests"]),
             f"{r['old_tokens_per_s']:.1f}", f"{r['new_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
             f"{r['max_abs_loglikelihood_diff']:.2g}"] for r in rep["rows"]]
    return (f"`{args['model']}`, {args['limit']} documents per task, batch {args['batch_size']}, chunk "
            f"{args['chunk_size']}, {args['threads']} torch thread(s).\n\n"
            + table(["quantizer", "options", "requests", "one at a time, tokens/s", "batched + forked, tokens/s",
                     "speed-up", "largest Δ log-likelihood"], rows, "llrrrrr"))


def gpu_check_block(rep: dict) -> str:
    env = rep["environment"]
    rows = [[r["cache"], f"{r['context']:,}", str(r["batch"]), f"{r['steps_per_s']:.1f}",
             f"{r['speed_vs_kvquant_fp16']:.2f}", f"{r['allocated_vs_dynamic']:.3f}",
             f"{r['allocated_bytes'] / r['reported_bytes']:.3f}"] for r in rep["speed"]["rows"]
            if "speed_vs_kvquant_fp16" in r and "allocated_vs_dynamic" in r]  # measured rows, beside their baselines
    return (f"{env['machine']}; torch {env['torch']}, git {env['git_commit'][:7]}, {env['date'][:10]}.\n\n"
            + table(["cache", "context", "batch", "decode steps/s", "speed vs kvquant fp16",
                     "allocated vs DynamicCache", "allocated / memory_report()"], rows, "lrrrrrr"))


#: The three real models side by side: per family, the reports whose candidates it takes, the first report holding a
#: name winning (Qwen2.5: the 96-window sweep before the 12-window screen; Gemma 3: the 96-window decision first).
FAMILIES = (("SmolLM2", ("smollm2-sweep", "smollm2-engines")), ("Gemma 3", ("gemma3-decide", "gemma3-270m")),
            ("Qwen2.5", ("qwen2.5-sweep", "qwen2.5-screen")))


def kl_cell(metric: dict | None) -> str:
    if not metric:
        return "—"
    return f"{metric['value']:.4f} [{metric['ci_low']:.4f}, {metric['ci_high']:.4f}] (n {metric['n']})"


def family_settings(runs: dict[str, dict], names: tuple[str, ...]) -> dict[str, tuple[str, dict]]:
    """A family's candidates by name: (report, candidate), the first of ``names`` holding the name."""
    found = {}
    for name in names:
        for cand in runs.get(name, {}).get("candidates", []):
            found.setdefault(cand["name"], (name, cand))
    return found


def side_by_side_block(runs: dict[str, dict]) -> str:
    """Per setting measured on at least two families under one name and one quantizer: bits/element and the KL
    divergence from each model's own fp16 cache on WikiText-2, with its interval, windows and KL verdict."""
    families = [(label, family_settings(runs, names)) for label, names in FAMILIES]
    order = list(dict.fromkeys(n for _, found in families for n in found))
    rows = []
    for setting in order:
        cells = [(label, found.get(setting)) for label, found in families]
        quantizers = {c["settings"].get("quantizer") for _, hit in cells if hit for c in [hit[1]]}
        measured = [hit for _, hit in cells if hit and hit[1]["metrics"].get("kl/wikitext2")]
        if len(measured) < 2 or len(quantizers) != 1 or setting == "fp16":
            continue  # one family only, or the same name for different formats: not comparable
        kls = [hit[1]["metrics"].get("kl/wikitext2") if hit else None for _, hit in cells]
        bits = " / ".join(num(hit[1]["bits_per_element"], 2) if hit else "—" for _, hit in cells)
        links = ", ".join(f"[`{hit[0]}`](../reports/{hit[0]}/report.md)" for _, hit in cells if hit)
        rows.append([f"`{setting}`", bits, *map(kl_cell, kls), *(k["verdict"] if k else "—" for k in kls), links])
    labels = [label for label, _ in FAMILIES]
    header = ["setting", "bits/element " + " / ".join(labels), *(f"KL {x} [95%]" for x in labels),
              *(f"KL verdict {x}" for x in labels), "reports"]
    gate = runs[FAMILIES[1][1][-1]]["config"]
    return (f"KL divergence from each model's own fp16 cache, nats per position on WikiText-2 (512-token windows; "
            f"gate {gate['gate']['max_kl_divergence']}; n: windows); bits/element at "
            f"{gate['eval']['memory_probe_tokens']} tokens. A setting is listed where two families or more measured "
            "it under one name and one format.\n\n" + table(header, rows, "lrllllll"))


def blocks() -> dict[str, str]:
    """Every block's text, from the committed results.json files."""
    runs, out = {}, {}
    for path in sorted((ROOT / "reports").glob("*/results.json")):
        rep = json.loads(path.read_text())
        name = path.parent.name
        if "decision" in rep:
            runs[name] = rep
            out[name] = report_block(name, rep)
        elif name == "bench_scoring":
            out[name] = bench_scoring_block(rep)
        elif name == "gpu_check":
            out[name] = gpu_check_block(rep)
    if FAMILIES[1][1][-1] in runs:
        out["three-families"] = side_by_side_block(runs)
    return {"index": index_block(runs), **out}


def render(text: str, generated: dict[str, str]) -> str:
    found = [m.group("name") for m in BLOCK.finditer(text)]
    unknown = [n for n in found if n not in generated]
    if unknown:
        raise SystemExit(f"results_tables: docs/results.md has a block for {unknown[0]!r}, which no results.json makes")
    text = BLOCK.sub(lambda m: wrap(m.group("name"), generated[m.group("name")]), text)
    missing = [n for n in generated if n not in found]
    for name in missing:
        text = text.rstrip("\n") + f"\n\n## {name}\n\n{wrap(name, generated[name])}\n"
    return text


def wrap(name: str, body: str) -> str:
    return f"<!-- results:{name}:begin -->\n{body}\n<!-- results:{name}:end -->"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is out of date")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "results.md")
    args = parser.parse_args(argv)
    old = args.doc.read_text()
    new = render(old, blocks())
    if args.check:
        if new != old:
            print(f"results_tables: {args.doc} is out of date; run python experiments/results_tables.py",
                  file=sys.stderr)
            return 1
        print(f"results_tables: {args.doc} is up to date")
        return 0
    if new != old:
        args.doc.write_text(new)
    print(f"results_tables: {'wrote' if new != old else 'unchanged'} {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
