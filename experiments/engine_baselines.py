"""Why an engine format has two KL divergences (issue 53, item 4): the same GGUF and the same WikiText-2 windows
through kvquant with float32 matmuls (the model's own computation), kvquant with llama.cpp's quantized matmuls
(:func:`kvquant.formats.llamacpp_matmuls.emulate_matmuls`) and llama.cpp itself (flash attention on with whole-window
ubatches, the tiled path; on with ubatches of 32, the path a decode takes; off), each with its 16-bit cache and a
quantized one, and the mean per-token KL divergence of every pair that matters:

    python experiments/engine_baselines.py --model smollm2 --types q8_0 --out reports/engine-baselines/smollm2

Exit 0 when measured, 2 on bad input (one line). Needs llama-cpp-python (``pip install -e ".[llamacpp]"``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from kvquant.errors import script_parser
from kvquant.exits import run_script

PROG = "engine_baselines"


def parser() -> argparse.ArgumentParser:
    p = script_parser(PROG, __doc__)
    p.add_argument("--model", default="smollm2", help="smollm2 or gemma3 (kvquant.integrations.llamacpp_engine)")
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--types", default="q8_0", help="quantized llama.cpp cache types (K and V alike)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="directory for results.json and table.md")
    return p


def kvquant_logits(model, ids: list[int], name: str) -> torch.Tensor:
    from kvquant.cache import make_cache

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), cache=make_cache(model, name), use_cache=True)
    return out.logits[0].float()


def runs(types: list[str]) -> dict[str, tuple[str, dict]]:
    """label -> (side, what): ``kvquant`` (quantizer name), ``emulated`` (the same with llama.cpp's matmuls),
    ``llamacpp`` (cache type, ubatch, flash attention)."""
    out = {"f32 fp16": ("kvquant", {"name": "fp16"}), "emul llamacpp_f16": ("emulated", {"name": "llamacpp_f16"}),
           "llama f16 fa ub512": ("llamacpp", {"kind": "f16", "ubatch": 512, "flash": True}),
           "llama f16 fa ub32": ("llamacpp", {"kind": "f16", "ubatch": 32, "flash": True}),
           "llama f16 nofa ub512": ("llamacpp", {"kind": "f16", "ubatch": 512, "flash": False})}
    for t in types:
        out[f"f32 llamacpp_{t}"] = ("kvquant", {"name": f"llamacpp_{t}"})
        out[f"emul llamacpp_{t}"] = ("emulated", {"name": f"llamacpp_{t}"})
        out[f"llama {t} fa ub512"] = ("llamacpp", {"kind": t, "ubatch": 512, "flash": True})
        out[f"llama {t} fa ub32"] = ("llamacpp", {"kind": t, "ubatch": 32, "flash": True})
    return out


def pairs(types: list[str]) -> list[tuple[str, str, str]]:
    """(reference, other, what it shows)."""
    out = [("f32 fp16", "emul llamacpp_f16", "the engine's 16-bit run, emulated"),
           ("f32 fp16", "llama f16 fa ub512", "llama.cpp's f16 (flash attention, whole-window ubatch)"),
           ("f32 fp16", "llama f16 fa ub32", "llama.cpp's f16 (flash attention, ubatches of 32: fp16 V sums)"),
           ("f32 fp16", "llama f16 nofa ub512", "llama.cpp's f16 without flash attention"),
           ("emul llamacpp_f16", "llama f16 fa ub512", "emulation against llama.cpp, both f16"),
           ("llama f16 fa ub512", "llama f16 fa ub32", "llama.cpp f16: ubatch 512 against 32"),
           ("llama f16 fa ub512", "llama f16 nofa ub512", "llama.cpp f16: flash attention on against off")]
    for t in types:
        out += [("f32 fp16", f"f32 llamacpp_{t}", f"{t} against the model's own computation (make_cache path)"),
                ("emul llamacpp_f16", f"emul llamacpp_{t}", f"{t} against llamacpp_f16, emulated matmuls "
                 "(llamacpp-compare's kvquant side)"),
                ("llama f16 fa ub512", f"llama {t} fa ub512", f"{t} in llama.cpp against its f16 (llamacpp-compare)"),
                ("llama f16 fa ub32", f"llama {t} fa ub32", f"{t} in llama.cpp against its f16, ubatches of 32"),
                ("f32 fp16", f"emul llamacpp_{t}", f"{t} emulated engine against the model's own computation"),
                ("f32 fp16", f"llama {t} fa ub512", f"{t} in llama.cpp against the model's own computation"),
                ("f32 fp16", f"llama {t} fa ub32", f"{t} in llama.cpp (ubatch 32) against the model's own "
                 "computation")]
    return out


def run(args) -> int:
    from kvquant.formats.llamacpp_matmuls import emulate_matmuls
    from kvquant.integrations import llamacpp_engine as le
    from kvquant.scoring.models import load_model, load_tokenizer

    from kvquant.errors import KVQuantError, check_int
    from kvquant.fs import output_dir, write_together

    check_int("--windows", args.windows, minimum=1, maximum=1000)
    check_int("--length", args.length, minimum=64, maximum=32768)
    check_int("--threads", args.threads, minimum=1, maximum=256)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    if not types:
        raise KVQuantError(f"--types {args.types!r} names no cache type (e.g. q8_0 or q8_0,q4_0)")
    torch.set_num_threads(args.threads)
    spec, gguf = le.model_spec(args.model)
    meta = le.gguf_metadata(gguf)
    le.check_cache_types([le.Setting(t, True) for t in types], meta["head_dim"])  # before anything loads
    out = output_dir(args.out, "--out") if args.out else None  # checked before the measurement, written after it
    le.import_llama_cpp()
    engine = le.Engine(gguf, args.threads)
    model, _ = load_model(spec)
    ids = le.token_windows(load_tokenizer(spec), meta, args.windows, args.length)
    plan, wanted = runs(types), pairs(types)
    kl = {(a, b): [] for a, b, _ in wanted}
    for w, window in enumerate(ids, 1):
        logits = {}
        for label, (side, what) in plan.items():
            if side == "llamacpp":
                setting = None if what["kind"] == "f16" else le.Setting(what["kind"], True)
                logits[label] = engine.logits(window, setting, what["ubatch"], what["flash"])[:-1]
        for label, (side, what) in plan.items():
            if side == "kvquant":
                logits[label] = kvquant_logits(model, window, what["name"])[:-1]
        handles = emulate_matmuls(model, gguf)
        try:
            for label, (side, what) in plan.items():
                if side == "emulated":
                    logits[label] = kvquant_logits(model, window, what["name"])[:-1]
        finally:
            for h in handles:
                h.remove()
        for a, b, _ in wanted:
            kl[a, b].append(le.divergence(logits[a], logits[b])[0])
        print(f"window {w}/{len(ids)}: " + ", ".join(f"{b} | {a}: {kl[a, b][-1].mean():.5f}" for a, b, _ in wanted),
              file=sys.stderr, flush=True)
    engine.close()
    rows = []
    for a, b, what in wanted:
        per_window = [float(k.mean()) for k in kl[a, b]]
        values = np.concatenate(kl[a, b])
        rows.append({"reference": a, "other": b, "what": what, "kl": float(values.mean()), "per_window": per_window})
    lines = ["| reference | other | mean KL | per window | what it shows |", "|---|---|---:|---|---|"]
    lines += [f"| {r['reference']} | {r['other']} | {r['kl']:.5f} | "
              f"{', '.join(f'{v:.4f}' for v in r['per_window'])} | {r['what']} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if out is not None:
        write_together(out, {"results.json": json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                          "rows": rows}, indent=1) + "\n", "table.md": text + "\n"})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_script(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
