"""The low-bit frontier per model family (issue 56): bits per element all-in against KL divergence from the fp16
cache, with each setting's paired interval and verdict, from committed reports (nothing is measured).

    python experiments/frontier.py [--out reports/frontier] [--family LABEL=REPORT[,REPORT...] ...]

A family's settings come from its reports in the order given, the first report holding a setting's name winning
(stage 2's 96 windows before the 12-window screen). Only settings of one family's reports are compared with each
other: they share windows, chunking and baseline; families differ in all three. A setting is on the frontier when no
other setting of its family has at most its bits and a lower KL (point estimates: the frontier is a description;
what is decided is each setting's verdict). Writes ``frontier.md`` (a table per family) and ``frontier.png`` (one
panel per family, KL on a log scale, intervals as bars, decided passes filled).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import io

from kvquant.errors import KVQuantError, script_parser
from kvquant.exits import run_script
from kvquant.fs import output_dir, write_together

ROOT = Path(__file__).resolve().parents[1]
#: The low-bit reports of each family (issue 56's stage 2 first, then its screen; then per-layer searches' maps and
#: 8-bit settings decided, measured on the screen's windows or on 96, of which the screen's 12 are the first).
FAMILIES = {"SmolLM2-135M": ("reports/smollm2-lowbit", "reports/smollm2-lowbit-screen",
                             "reports/smollm2-lowbit-search", "reports/smollm2-mixed-prerope",
                             "reports/smollm2-mixed-6bit"),
            "Gemma 3 270M": ("reports/gemma3-lowbit", "reports/gemma3-lowbit-screen", "reports/gemma3-decide"),
            "Qwen2.5-0.5B": ("reports/qwen2.5-lowbit", "reports/qwen2.5-lowbit-screen", "reports/qwen2.5-mixed")}
METRIC = "kl/wikitext2"
#: What a report's verdict needs said beside it, wherever the frontier quotes it
CAVEATS = {"smollm2-mixed-6bit": "the search's second map judged on the same 96 windows as its first: the chance that "
                                 "either passed falsely is 5%, and split 1.25% each the verdict is inconclusive "
                                 "(docs/results.md#smollm2-mixed-6bit)"}


def settings(reports: list[Path]) -> list[dict]:
    """One row per setting of the reports that exist: name, bits, KL with its interval and windows, verdict, report."""
    rows, seen = [], set()
    for report in reports:
        path = report / "results.json"
        if not path.is_file():
            continue
        for cand in json.loads(path.read_text())["candidates"]:
            kl = cand["metrics"].get(METRIC)
            if cand["name"] in seen or not kl:
                continue
            seen.add(cand["name"])
            rows.append({"name": cand["name"], "bits": cand["bits_per_element"], "kl": kl["value"],
                         "low": kl["ci_low"], "high": kl["ci_high"], "n": kl["n"], "verdict": kl["verdict"],
                         "report": report.name})
    return rows


def on_frontier(rows: list[dict]) -> list[dict]:
    """``rows`` with ``frontier``: no other row has at most its bits and a lower KL."""
    return [{**r, "frontier": not any(o is not r and o["bits"] <= r["bits"] and o["kl"] < r["kl"] for o in rows)}
            for r in rows]


def table(label: str, rows: list[dict]) -> list[str]:
    lines = [f"### {label}", "", "| setting | bits/element | KL [95%] | windows | verdict | on the frontier | report |",
             "| --- | ---: | --- | ---: | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["bits"], r["kl"])):
        lines.append(f"| `{r['name']}` | {r['bits']:.3f} | {r['kl']:.4f} [{r['low']:.4f}, {r['high']:.4f}] | {r['n']} "
                     f"| {r['verdict']}{' (*)' if r['report'] in CAVEATS else ''} | {'yes' if r['frontier'] else ''} "
                     f"| `{r['report']}` |")
    notes = [f"(*) `{report}`: {CAVEATS[report]}." for report in sorted({r["report"] for r in rows} & CAVEATS.keys())]
    return [*lines, *([""] + notes if notes else []), ""]


def plot(families: dict[str, list[dict]], threshold: float) -> bytes:
    """One panel per family: PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(families), figsize=(5.5 * len(families), 4.5), squeeze=False)
    for ax, (label, rows) in zip(axes[0], families.items()):
        for r in rows:
            low, high = max(r["kl"] - r["low"], 0.0), max(r["high"] - r["kl"], 0.0)
            ax.errorbar([r["bits"]], [r["kl"]], yerr=[[low], [high]], fmt="o", capsize=3,
                        mfc=None if r["verdict"] == "pass" else "white", color="C0" if r["frontier"] else "0.55")
            ax.annotate(r["name"], (r["bits"], r["kl"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        edge = sorted((r for r in rows if r["frontier"]), key=lambda r: r["bits"])
        ax.plot([r["bits"] for r in edge], [r["kl"] for r in edge], "-", color="C0", lw=1)
        ax.axhline(threshold, color="C3", ls="--", lw=1)
        ax.set(title=label, xlabel="bits per element, all-in", ylabel="KL from fp16, nats/position", yscale="log")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = script_parser("frontier", __doc__)
    parser.add_argument("--out", type=Path, default=Path("reports/frontier"))
    parser.add_argument("--family", action="append", default=[], metavar="LABEL=REPORT[,REPORT...]",
                        help="a family and its reports, stage 2 first (default: the three low-bit families)")
    parser.add_argument("--threshold", type=float, default=0.01, help="the gate's KL bound drawn on the plots")
    args = parser.parse_args(argv)
    if any("=" not in f for f in args.family):
        raise KVQuantError("--family must be LABEL=REPORT[,REPORT...]")
    chosen = {k: v.split(",") for k, v in (f.split("=", 1) for f in args.family)} or FAMILIES
    families = {label: on_frontier(settings([ROOT / p for p in paths])) for label, paths in chosen.items()}
    families = {label: rows for label, rows in families.items() if rows}
    if not families:
        raise KVQuantError(f"no report with {METRIC} among {', '.join(p for v in chosen.values() for p in v)}")
    command = " ".join(["python experiments/frontier.py", *(argv if argv is not None else sys.argv[1:])])
    lines = ["# The low-bit frontier per family (issue 56)", "",
             f"`{command}`, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, from the committed reports named per "
             "row (nothing measured here). KL from each model's fp16 cache on WikiText-2, nats per position, paired "
             f"95% interval; the gate's bound {args.threshold}. Within a family the settings share windows and "
             "baseline; across families they do not (each report's header says which).", "",
             "![frontier](frontier.png)", ""]
    for label, rows in families.items():
        lines += table(label, rows)
    write_together(output_dir(args.out, "--out"), {"frontier.md": "\n".join(lines),
                                                   "frontier.png": plot(families, args.threshold)})
    print(f"frontier: {', '.join(f'{k} ({len(v)} settings)' for k, v in families.items())} -> {args.out}")


if __name__ == "__main__":
    sys.exit(run_script("frontier", main))
