"""How the divergence grows with position, on long documents (issue 40 item 1; the runner's gate does not read it
yet).

    python experiments/long_divergence.py configs/smollm2-long.yaml --out reports/smollm2-long

The config's model, candidates (baseline: fp16 through the same cache), ``eval.chunk_size``, ``eval.batch_size``
and its first perplexity set (a ``stream`` set: the text joined and cut into non-overlapping windows of
``max_length`` tokens, ``limit`` of them) are used as a run would; every window is fed through every cache chunk by
chunk, and each candidate's per-position KL divergence and top-1 agreement against the baseline are bucketed by
position with intervals over documents and a trend test (:mod:`kvquant.runner.positions`).

``--max-kl-divergence NATS`` also states each candidate's longest context whose every bucket's mean KL is shown at
or below NATS (the gate's rule); ``--render-only`` renders the report again from ``OUT/results.json`` without
measuring (the measuring code may have changed since: the documents' keys hold its version).

Resumable: each document's numbers are kept in ``OUT/documents/doc-N.json`` (with the inputs they came from; a file
of other inputs is set aside as ``doc-N.json.old``, never overwritten, and measured again), so an interrupted run
goes on where it stopped. Each file is signed under this
user's key (:mod:`kvquant.signing`, as partial results are): one of this run's inputs whose signature does not verify
(edited by hand, written by another user or machine, or by a version before signed documents, as the committed
``reports/*/documents`` were) is never reused: it is set aside (``doc-N.json.unsigned``, beside it, never
overwriting an earlier one), said so, and measured again, so the report never rests on numbers nobody measured here.
Writes ``OUT/results.json`` and ``OUT/report.md`` (command, machine, date), and ``OUT/kl.png`` (each candidate's mean
KL per position bucket with its interval, against the bucket's end).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from kvquant.errors import KVQuantError, script_parser
from kvquant.exits import run_script
from kvquant.fs import output_dir, read_file, real_dir, set_aside, write_file, write_together
from kvquant.experiment.config import load_config
from kvquant.runner.counts import TOO_FEW, settled_verdict, too_few
from kvquant.runner.gate import FAIL, INCONCLUSIVE, PASS, longest_passing
from kvquant.runner.positions import EDGES, bucket_means, buckets, trend, trend_verdict
from kvquant.experiment.results import DIVERGENCE
from kvquant.experiment.provenance import code_version
from kvquant.runner.report import environment
from kvquant.runner.report_plots import _png, _pyplot
from kvquant.scoring.data import windows
from kvquant.scoring.longctx import position_divergences
from kvquant.scoring.models import load_model, load_tokenizer
from kvquant.scoring.scorer import Scorer
from kvquant.scoring.session import BASELINE
from kvquant.signing import DOCUMENT_DOMAIN, signed_json, why_unverified


def inputs(cfg, window) -> dict:
    """What one document's numbers depend on (a partial file of other inputs is not reused)."""
    return {"model": cfg.model.path, "gguf": cfg.model.gguf_file, "dtype": cfg.model.dtype,
            "chunk_size": cfg.eval.chunk_size, "candidates": [c.label for c in cfg.candidates],
            "settings": [repr(c.spec) for c in cfg.candidates], "tokens": window.ids, "code": code_version()}


def measure(cfg, args) -> list[dict]:
    """Per document: ``{candidate label: {"kl": [...], "top1": [...]}}``, measured or read from ``documents/``."""
    tokenizer = load_tokenizer(cfg.model)
    docs = windows(cfg.eval.perplexity[0], tokenizer)
    # committed (reports/**/partial/ is ignored): a long run goes on next sitting
    partial = real_dir(output_dir(args.out, "--out") / "documents", "--out")
    scorers: dict[str, Scorer] = {}  # made once the first document needs measuring (the model loads then)

    def make(label: str, spec) -> Scorer:
        if label not in scorers:
            model = next(iter(scorers.values())).model if scorers else load_model(cfg.model)[0]
            scorers[label] = Scorer(model, spec, mode="streaming", chunk_size=cfg.eval.chunk_size,
                                    batch_size=cfg.eval.batch_size)
        return scorers[label]

    out = []
    for d, window in enumerate(docs):
        path, key = partial / f"doc-{d}.json", inputs(cfg, window)
        kept = kept_document(path)
        if kept is not None:
            why = why_unverified(kept, DOCUMENT_DOMAIN) if kept.get("inputs") == key else "it is of other inputs"
            if why is None:
                out.append(kept["result"])
                continue
            aside = set_aside(path, ".unsigned" if kept.get("inputs") == key else ".old")
            print(f"long_divergence: {path} is not reused: {why}; moved to {aside.name} and measured again",
                  flush=True)
        start = time.perf_counter()
        got = position_divergences(make("baseline", BASELINE.spec), [make(c.label, c.spec) for c in cfg.candidates],
                                   [window.ids],
                                   desc=f"document {d + 1}/{len(docs)}")
        result = {c.label: {"kl": [float(f"{x:.6g}") for x in g["kl"][0]], "top1": g["top1"][0],
                            "keys_quantized": g["reads"]["keys_quantized"], "keys": g["reads"]["keys"]}
                  for c, g in zip(cfg.candidates, got)}
        result["_seconds"] = time.perf_counter() - start
        write_file(path, signed_json({"inputs": key, "result": result}, DOCUMENT_DOMAIN, indent=None))
        print(f"long_divergence: document {d + 1}/{len(docs)} ({len(window.ids)} tokens) in "
              f"{result['_seconds']:.0f} s", flush=True)
        out.append(result)
    return out


def summarise(cfg, per_doc: list[dict], edges) -> dict:
    out = {}
    for c in cfg.candidates:
        kl = [d[c.label]["kl"] for d in per_doc]
        top1 = [d[c.label]["top1"] for d in per_doc]
        t = trend(kl, edges)
        out[c.label] = {"kl": [vars(b) for b in buckets(kl, edges)], "top1": [vars(b) for b in buckets(top1, edges)],
                        "trend": vars(t), "per_document_kl": bucket_means(kl, edges).tolist(),
                        "quantized_key_share": sum(d[c.label]["keys_quantized"] for d in per_doc)
                        / max(1, sum(d[c.label]["keys"] for d in per_doc))}
    return out


def refit(out: Path, earlier: dict) -> dict:
    """:func:`summarise` again, by today's code, from the documents of the report ``earlier`` (its results.json)
    kept in ``out/documents/``: every one of its documents, each holding every one of its candidates."""
    labels, edges = list(earlier["candidates"]), tuple(earlier.get("edges") or ())
    per_doc = []
    for d in range(int(earlier.get("documents", 0))):
        kept = kept_document(out / "documents" / f"doc-{d}.json")
        got = None if kept is None else kept["result"]
        if not (isinstance(got, dict) and all(isinstance(got.get(label), dict) and
                                              {"kl", "top1", "keys_quantized", "keys"} <= set(got[label])
                                              for label in labels)):
            raise KVQuantError(f"--refit: {out / 'documents' / f'doc-{d}.json'} is missing or does not hold every "
                               f"candidate of {out / 'results.json'}; nothing written")
        per_doc.append(got)
    if not per_doc or len(edges) < 2:
        raise KVQuantError(f"--refit: {out / 'results.json'} names no documents or position edges; nothing written")
    cfg = SimpleNamespace(candidates=[SimpleNamespace(label=label) for label in labels])
    return summarise(cfg, per_doc, edges)


def bucket_verdict(k: dict, limit: float) -> tuple[str, int | None]:
    """A bucket's KL verdict at ``limit`` (the gate's rule on its 95% interval), or too few documents to decide it
    (:func:`kvquant.runner.counts.settled_verdict`): ``(verdict, documents needed or None)``."""
    verdict = PASS if k["high"] <= limit else FAIL if k["low"] > limit else INCONCLUSIVE
    return settled_verdict(DIVERGENCE, verdict, k["documents"])


def length_verdicts(doc: dict, limit: float) -> dict[str, str]:
    """Per candidate, the longest context whose every position bucket's mean KL is shown at or below ``limit``
    (the gate's rule, :func:`kvquant.runner.gate.longest_passing`, on the buckets' 95% intervals; a bucket of too
    few documents decides nothing)."""
    out = {}
    for label, r in doc["candidates"].items():
        judged = [(k["stop"], k["documents"], *bucket_verdict(k, limit)) for k in r["kl"]]
        short = min(((n, need) for _, n, v, need in judged if v == TOO_FEW), default=None)
        found = longest_passing([(stop, {"kl": v}) for stop, _, v, _ in judged])
        out[label] = dataclasses.replace(found, shortfall=short).describe()
    return out


def curves(doc: dict) -> dict[str, tuple[list[int], list[float], list[float], list[float]]]:
    """Per candidate, what ``kl.png`` draws: ``(bucket ends, mean KL, interval low, interval high)``."""
    return {label: tuple([k[f] for k in r["kl"]] for f in ("stop", "mean", "low", "high"))
            for label, r in doc["candidates"].items()}


def plot(doc: dict) -> bytes:
    """``kl.png``: mean KL per position bucket (log scale) against the bucket's end, with its 95% interval, one
    line per candidate, and the limit of ``--max-kl-divergence`` when given."""
    fig, ax = _pyplot().subplots(figsize=(7, 4.5))
    for label, (ends, mean, low, high) in curves(doc).items():
        below = [max(m - lo, 0) if math.isfinite(lo) else 0 for m, lo in zip(mean, low)]  # unbounded: no bar
        above = [max(hi - m, 0) if math.isfinite(hi) else 0 for m, hi in zip(mean, high)]
        ax.errorbar(ends, mean, yerr=[below, above], fmt="o-", capsize=3, label=label)
    if doc.get("max_kl_divergence") is not None:
        ax.axhline(doc["max_kl_divergence"], color="red", ls="--", lw=1, label="limit")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("position bucket end (tokens)")
    ax.set_ylabel("mean KL divergence from the baseline (nats)")
    ax.set_title(f"{doc['documents']} windows of up to {doc['max_length']} tokens")
    ax.legend(fontsize=7)
    return _png(fig)


def write(out: Path, doc: dict) -> None:
    """``results.json``, ``report.md`` and ``kl.png`` under ``out``, written together (a symlink at any of them is
    replaced, never followed); the report is printed too."""
    text = render(doc)
    write_together(output_dir(out, "--out"), {"results.json": json.dumps(doc, indent=1), "report.md": text,
                                              "kl.png": plot(doc)})
    print(text)


def kept_document(path: Path) -> dict | None:
    """A finished document's file ``{"inputs", "result"}`` as an earlier sitting wrote it, None where there is
    none; a symlink, FIFO or a file that is not such an object is refused with one line (never followed)."""
    try:
        doc = json.loads(read_file(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise KVQuantError(f"{path}: not a document file this script writes ({getattr(err, 'strerror', None) or err}"
                           "); move it away to measure that document again") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("result"), dict):
        raise KVQuantError(f"{path}: not a document file this script writes; move it away to measure that document "
                           "again")
    return doc


def render(doc: dict) -> str:
    env = doc["environment"]
    fitted = f"fitted again at {doc['refit']}" if doc.get("refit") else "at the measuring commit"
    lines = ["# KL divergence by position", "", f"- command: `{doc['command']}`",
             *([f"- rendered again (nothing measured): `{doc['rendered']}`"] if doc.get("rendered") else []),
             f"- date: {env['date']}; git {env['git_commit']}; measuring sources {env['kvquant_source_sha256']}",
             f"- machine: {env['machine']}; torch {env['torch']}, transformers {env['transformers']}",
             f"- documents: {doc['documents']} windows of up to {doc['max_length']} tokens ({doc['source']}), fed "
             f"{doc['chunk_size']} tokens at a time; {doc['seconds']:.0f} s of measuring in all (sittings added up)",
             "- statistic: per bucket, the mean over documents of each document's mean KL (nats) over its positions "
             "there, 95% bootstrap interval over documents; trend: the factor by which KL grows per doubling of the "
             f"position (kvquant.runner.positions.trend {fitted}), with its interval; a bucket or trend over "
             "fewer documents than its interval needs (docs/gate.md: too few documents) decides nothing",
             ""]
    if doc.get("max_kl_divergence") is not None:
        limit = doc["max_kl_divergence"]
        lines += [f"Longest context shown safe at mean KL <= {limit} nats per position (every bucket up to it, 95% "
                  "interval; the gate's rule):", "", "| candidate | longest context |", "|---|---|",
                  *(f"| {label} | {text} |" for label, text in length_verdicts(doc, limit).items()), ""]
    lines += ["![mean KL by position bucket, 95% intervals](kl.png)", ""]
    limit = doc.get("max_kl_divergence")
    for label, r in doc["candidates"].items():
        t = r["trend"]  # judged again: the counts may be newer than the measurement
        lines += [f"## {label}", "", f"Trend: x{t['factor']:.3f} per doubling [{t['low']:.3f}, {t['high']:.3f}]: "
                  f"**{trend_verdict(t['low'], t['high'], doc['documents'])}**; quantized share of keys read "
                  f"{r['quantized_key_share']:.3f}.", "",
                  "| positions | documents | mean KL | 95% interval | top-1 agreement | 95% interval |"
                  + (f" KL <= {limit} |" if limit is not None else ""),
                  "|---|---:|---:|---|---:|---|" + ("---|" if limit is not None else "")]
        for k, a in zip(r["kl"], r["top1"]):
            verdict, need = bucket_verdict(k, limit) if limit is not None else (None, None)
            shown = "" if verdict is None else f" {too_few(k['documents'], need) if need else verdict} |"
            lines.append(f"| {k['start']}-{k['stop']} | {k['documents']} | {k['mean']:.5f} | "
                         f"[{k['low']:.5f}, {k['high']:.5f}] | {a['mean']:.4f} | [{a['low']:.4f}, {a['high']:.4f}] |"
                         + shown)
        lines.append("")
    return "\n".join(lines)


@torch.no_grad()  # for this call only: a caller (a test) keeps its autograd
def main(argv=None):
    parser = script_parser("long_divergence", __doc__)
    parser.add_argument("config", type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="as kvquant.run's --set")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-kl-divergence", type=float, default=None, metavar="NATS",
                        help="also state each candidate's longest context whose buckets' KL is shown at or below this")
    parser.add_argument("--render-only", action="store_true",
                        help="measure nothing: render OUT/report.md again from OUT/results.json (e.g. with another "
                             "--max-kl-divergence), keeping its command and environment")
    parser.add_argument("--refit", action="store_true",
                        help="with --render-only: the buckets and trend fitted again by today's code from the "
                             "per-position numbers in OUT/documents/doc-N.json (you vouch for those files: they are "
                             "read, not verified)")
    args = parser.parse_args(argv)
    limit = args.max_kl_divergence
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        parser.error(f"--max-kl-divergence must be a finite number of nats above 0, got {limit}")
    if args.render_only:
        try:
            earlier = json.loads(read_file(args.out / "results.json"))
        except FileNotFoundError:
            parser.error(f"--render-only: {args.out / 'results.json'} does not exist; measure first (without it)")
        except (OSError, ValueError) as err:
            raise KVQuantError(f"--render-only: {args.out / 'results.json'} is not a results.json this script writes "
                               f"({getattr(err, 'strerror', None) or err})") from None
        if not isinstance(earlier, dict) or not isinstance(earlier.get("candidates"), dict):
            raise KVQuantError(f"--render-only: {args.out / 'results.json'} is not a results.json this script writes")
        doc = {**earlier, "max_kl_divergence": args.max_kl_divergence, "rendered": "python " + " ".join(sys.argv)}
        if args.refit:
            env = environment()
            doc["candidates"] = refit(args.out, earlier)
            doc["refit"] = f"git {str(env.get('git_commit'))[:12]}, {env.get('date')}"
        write(args.out, doc)
        return
    if args.refit:
        parser.error("--refit goes with --render-only")
    cfg = load_config(args.config, args.set)
    per_doc = measure(cfg, args)
    spec = cfg.eval.perplexity[0]
    edges = tuple(e for e in EDGES if e < spec.max_length) + (spec.max_length,)
    doc = {"command": "python " + " ".join(sys.argv), "environment": environment(), "documents": len(per_doc),
           "max_length": spec.max_length, "source": spec.source or spec.hub, "chunk_size": cfg.eval.chunk_size,
           "seconds": sum(d["_seconds"] for d in per_doc), "edges": list(edges),
           "candidates": summarise(cfg, per_doc, edges), "max_kl_divergence": args.max_kl_divergence}
    write(args.out, doc)


if __name__ == "__main__":
    sys.exit(run_script("long_divergence", main))
