"""Which layers' keys carry outliers, found automatically (issue 55): from the weights and from calibration.

    python experiments/outlier_layers.py configs/qwen2.5-sweep.yaml --out reports/qwen2.5-outliers

- **From the weights**: each layer's key-projection bias (``self_attn.k_proj.bias``, ``[kv_heads * head_dim]``), its
  norm per layer and per KV head; a model whose key projection has no bias (Llama, Gemma) has no statistic here.
- **From calibration**: the config's calibration split (``calibration.windows`` windows after what evaluation
  reads of its gated perplexity set, as a calibrated candidate observes them: :func:`kvquant.runner.search.
  calibration_windows`), one forward each; every layer's post-RoPE keys as the cache receives them
  (:class:`kvquant.cache.ObservingCache`) averaged per (KV head, channel) over all tokens; the layer's statistic is
  the largest absolute mean.

Both go through one rule (:func:`kvquant.runner.outliers.outliers`: above 8 times the median layer). Writes
``OUT/results.json`` (every layer's statistics) and ``OUT/report.md`` (command, machine, date).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvquant.errors import KVQuantError, script_parser
from kvquant.exits import run_script
from kvquant.fs import output_dir, write_together
from kvquant.experiment.config import load_config
from kvquant.runner.outliers import FACTOR, layer_statistics, margin, median, outlier_table, outliers
from kvquant.runner.report import environment
from kvquant.scoring.calibrate import calibration_windows, key_means


def key_biases(model) -> list[np.ndarray] | None:
    """Per layer ``[kv_heads, head_dim]``: the key projection's bias, or None where the model's has none."""
    layers = [m for name, m in model.named_modules() if name.endswith("self_attn.k_proj")]
    if not layers or any(m.bias is None for m in layers):
        return None
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return [m.bias.detach().double().reshape(-1, head_dim).numpy() for m in layers]


def section(title: str, what: str, stats, factor: float) -> tuple[list[str], dict]:
    """A report section and its JSON for one statistic."""
    values = [s.value for s in stats]
    found, (low, high) = outliers(values, factor), margin(values, factor)
    lines = [f"## {title}", "", what, "",
             f"Median over the {len(values)} layers {median(values):.2f}; outlier layers (above {factor:g} x the "
             f"median): **{', '.join(map(str, found)) or 'none'}**. The same layers for any factor from "
             f"{high:.1f} to {low:.1f} (the highest other layer and the lowest outlier, over the median).", ""]
    lines += (outlier_table(stats, factor) if found else []) + ["", "Every layer, over the median: "
                                                                + ", ".join(f"{i}: {v / median(values):.1f}"
                                                                            for i, v in enumerate(values)), ""]
    return lines, {"outliers": found, "median": median(values), "margin": [high, low],
                   "layers": [{"value": s.value, "heads": s.heads, "channel": s.channel, "largest": s.largest}
                              for s in stats]}


@torch.no_grad()
def main(argv=None):
    from kvquant.scoring.data import load_rows
    from kvquant.scoring.models import load_model

    parser = script_parser("outlier_layers", __doc__)
    parser.add_argument("config", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--factor", type=float, default=FACTOR, help=f"the rule's factor (default {FACTOR:g})")
    args = parser.parse_args(argv)
    if not 1 < args.factor < math.inf:
        parser.error(f"--factor must be a finite number above 1, got {args.factor}")
    cfg = load_config(args.config, [])
    if cfg.calibration is None:  # before anything is written or loaded
        raise KVQuantError(f"{args.config}: no calibration split to read the keys on; add calibration: {{windows: 8}} "
                           "(windows after each gated perplexity set's limit)")
    out = output_dir(args.out, "--out")
    model, tokenizer = load_model(cfg.model)
    rows = {p.name: load_rows(p) for p in cfg.eval.perplexity}
    maxlen = max(p.max_length for p in cfg.eval.perplexity)
    found = calibration_windows(cfg, tokenizer, maxlen, rows, cfg.calibration.windows, "outlier_layers")
    windows = [w.ids for _, ws in found.values() for w in ws]
    if not windows:
        raise KVQuantError(f"{args.config}: no calibration windows")
    start = time.perf_counter()
    means = [mean.numpy() for mean in key_means(model, windows).values()]
    seconds = time.perf_counter() - start
    env = environment()
    doc = {"command": "python " + " ".join(sys.argv), "environment": env, "model": cfg.model.path,
           "factor": args.factor, "calibration": {"windows": len(windows), "tokens": sum(map(len, windows)),
                                                  "first": {name: s for name, (s, _) in found.items()},
                                                  "seconds": round(seconds, 1)}}
    lines = [f"# Outlier layers: {cfg.name}", "", f"- command: `{doc['command']}`",
             f"- date: {env['date']}; git {env['git_commit']}; measuring sources {env['kvquant_source_sha256']}",
             f"- machine: {env['machine']}; torch {env['torch']}, transformers {env['transformers']}",
             f"- model: {cfg.model.path} ({cfg.model.gguf_file or 'no GGUF'}), {cfg.model.dtype}",
             f"- rule (kvquant/runner/outliers.py): a layer is an outlier layer when its statistic is above "
             f"{args.factor:g} times the median over the model's layers", ""]
    biases = key_biases(model)
    if biases is None:
        lines += ["## From the weights", "", "The model's key projection has no bias.", ""]
    else:
        text, doc["bias"] = section("From the weights: the key-projection bias", "Per layer, the L2 norm of "
                                    "`self_attn.k_proj.bias` (per KV head beside it).",
                                    layer_statistics(biases, "norm"), args.factor)
        lines += text
    text, doc["calibration"]["keys"] = section(
        "From calibration: the keys' mean per channel",
        f"Per layer, the largest absolute mean of a post-RoPE key channel (per KV head beside it) over "
        f"{len(windows)} calibration windows ({doc['calibration']['tokens']:,} tokens; the windows after the "
        f"evaluation reads of {', '.join(found)}), {seconds:.0f} s.", layer_statistics(means, "max"), args.factor)
    lines += text
    if biases is not None:
        same = doc["bias"]["outliers"] == doc["calibration"]["keys"]["outliers"]
        lines += ["## Both", "", "The two statistics find " + ("the same layers." if same else
                  f"different layers: weights {doc['bias']['outliers']}, calibration "
                  f"{doc['calibration']['keys']['outliers']}."), ""]
    write_together(out, {"results.json": json.dumps(doc, indent=1) + "\n", "report.md": "\n".join(lines)})
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(run_script("outlier_layers", main))
