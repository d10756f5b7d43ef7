"""Prefix sharing measured on a real model: N requests share a P-token prefix, prefilled once into a quantized
cache and forked (``kvquant.cache.stack_rows``); each request then writes its own S tokens. Reports the bytes
stored, the bytes sharing saved (``memory_report()["shared_saved_bytes"]``), the planner's ``--shared-prefix``
figure for the same model and settings, and how far each row's logits are from that request run alone.

    python experiments/prefix_sharing.py --requests 8 --prefix 1024 --suffix 64
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pandas as pd
import torch

import kvquant
from kvquant.errors import at_least, script_parser
from kvquant.fs import output_dir, write_together
from kvquant.scoring import data
from kvquant.cache import stack_rows
from kvquant.experiment.config import load_config
from kvquant.scoring.models import load_model
from kvquant.planner.shapes import Planner, parse_setting, shape_from_config
from kvquant.runner.report import environment

SETTINGS = ["fp16", "fp8_e4m3:residual_length=0", "int4:group_size=32,residual_length=0",
            "int4:group_size=32,residual_length=128"]


@torch.inference_mode()
def measure(model, setting: dict, prefix: torch.Tensor, suffixes: torch.Tensor) -> dict:
    settings = dict(setting)
    shared = kvquant.make_cache(model, **settings)
    model(prefix, cache=shared)
    batch = stack_rows([(shared, 0)] * len(suffixes))
    logits = model(suffixes, cache=batch).logits
    report = batch.memory_report()
    alone_bytes, worst = 0, 0.0
    for r in range(len(suffixes)):
        alone = kvquant.make_cache(model, **settings)
        model(prefix, cache=alone)
        want = model(suffixes[r : r + 1], cache=alone).logits
        worst = max(worst, float((logits[r] - want[0]).abs().max()))
        alone_bytes += alone.memory_report()["total_bytes"]
    return {"stored_bytes": report["total_bytes"], "unshared_bytes": alone_bytes,
            "shared_saved_bytes": report["shared_saved_bytes"], "max_logit_diff_vs_alone": worst}


def main(argv=None) -> int:
    parser = script_parser("prefix_sharing", __doc__)
    parser.add_argument("--config", default="configs/int4.yaml", help="a config whose model and first perplexity "
                        "set are used (default: SmolLM2, WikiText-2)")
    parser.add_argument("--requests", type=at_least(1), default=8)
    parser.add_argument("--prefix", type=at_least(1), default=1024)
    parser.add_argument("--suffix", type=at_least(1), default=64)
    parser.add_argument("--cache", action="append", help=f"planner-style settings (default: {' '.join(SETTINGS)})")
    parser.add_argument("--out", type=Path, default=Path("reports/prefix_sharing"))
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    model, tokenizer = load_model(cfg.model)
    pset = cfg.eval.perplexity[0]
    ids = tokenizer("\n\n".join(data.load_rows(pset))).input_ids
    need = args.prefix + args.requests * args.suffix
    prefix = torch.tensor([ids[: args.prefix]])
    suffixes = torch.tensor(ids[args.prefix : need]).view(args.requests, args.suffix)  # different text per request
    planner_shape = shape_from_config(model.config, cfg.model.path)
    rows = []
    for text in args.cache or SETTINGS:
        setting = parse_setting(text)
        measured = measure(model, setting, prefix, suffixes)
        planned = (args.requests - 1) * int(Planner(planner_shape, setting, model.dtype)
                                            .memory(1, args.prefix)["shareable_bytes"])
        rows.append({"cache": text, **measured, "planner_saving_bytes": planned,
                     "agree": planned == measured["shared_saved_bytes"]})
        print(rows[-1], flush=True)
    frame = pd.DataFrame(rows)
    env = environment()
    command = "python experiments/prefix_sharing.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    csv = frame.to_csv(index=False)
    lines = [
        "# Prefix sharing, measured", "",
        f"- command: `{command}`",
        f"- model: `{cfg.model.path}` ({model.dtype}); {args.requests} requests share a {args.prefix}-token prefix "
        f"(WikiText-2 test), then each writes its own {args.suffix} tokens (the text that follows, different per "
        "request); the prefix is prefilled once into a 1-row cache and forked with `stack_rows`",
        f"- environment: {env['machine']}; torch {env['torch']}, transformers {env['transformers']}; git "
        f"{env['git_commit']}; {env['date']}",
        "- stored: `memory_report()['total_bytes']` of the forked batch (shared tensors counted once); unshared: the "
        "sum over the requests each run alone; saved: `shared_saved_bytes`; planner: `python -m kvquant.plan "
        f"--batch {args.requests} --shared-prefix {args.prefix}` arithmetic for this model (its `shareable_bytes` "
        "of a 1-row cache after the prefix, times requests - 1); logits: the largest |difference| of any forked "
        "row's logits from that request run alone", "",
        "| cache | stored bytes | unshared bytes | saved by sharing | planner's figure | agree | max logit diff |",
        "|---|---:|---:|---:|---:|---|---:|",
        *(f"| {r['cache']} | {r['stored_bytes']:,} | {r['unshared_bytes']:,} | {r['shared_saved_bytes']:,} | "
          f"{r['planner_saving_bytes']:,} | {'yes' if r['agree'] else 'NO'} | {r['max_logit_diff_vs_alone']:.2e} |"
          for r in rows),
        "", "stored + saved = unshared in every row (the same tensors, counted once). With a residual window the "
        "prefix's last full-precision tokens are copied into each request at its first write, so they are not "
        "shared.", ""]
    write_together(output_dir(args.out, "--out"), {"results.csv": csv, "report.md": "\n".join(lines)})
    print(f"report: {args.out / 'report.md'}")
    return 0 if all(r["agree"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
