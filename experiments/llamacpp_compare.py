"""llama.cpp itself against kvquant's emulation of its KV cache types (issue 37, item 2):

    python experiments/llamacpp_compare.py --model smollm2 --out reports/llamacpp-compare/smollm2

runs the same GGUF and the same WikiText-2 windows through llama.cpp (llama-cpp-python, ``pip install -e
".[llamacpp]"``) with each cache type, rotation on and off, and through kvquant's ``llamacpp_*`` quantizers, and
prints each side's per-token KL divergence and top-1 agreement against its own f16 cache, side by side, with 95%
intervals (a paired bootstrap over 32-token blocks), and whether the target holds: kvquant's KL within +-20% of
llama.cpp's (or overlapping intervals) wherever llama.cpp's is at least 1e-3, the same order of types, rotation's
effect in the same direction. kvquant's model multiplies the GGUF's weights as llama.cpp's CPU backend does
(activations quantized to the weight's dot-product type, ``kvquant/formats/llamacpp_gguf.py``) unless ``--matmul
float32``. The logic is in ``kvquant/integrations/llamacpp_engine.py`` and ``kvquant/integrations/llamacpp_compare.py``.

Exit 0 when the target holds, 1 when it does not, 2 bad input (one line: a type llama.cpp does not allow, rotation
at a head size llama.cpp cannot rotate, no llama_cpp package), 3 an internal error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvquant.errors import OneLineParser, parse_args
from kvquant.exits import run_guarded
from kvquant.fs import output_dir, real_dir, write_together
from kvquant.integrations.llamacpp_compare import MATMULS, compare, to_json
from kvquant.integrations.llamacpp_engine import MODELS, QUANTIZED, Setting

PROG = "llamacpp_compare"


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(PROG, prog="python experiments/llamacpp_compare.py", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help=f"{' or '.join(MODELS)}, or a .gguf file")
    p.add_argument("--windows", type=int, default=6, help="WikiText-2 test windows (default 6)")
    p.add_argument("--length", type=int, default=512, help="tokens per window, llama.cpp's n_ctx (default 512)")
    p.add_argument("--types", default=",".join(QUANTIZED), help=f"cache types, K and V alike (default "
                   f"{','.join(QUANTIZED)})")
    p.add_argument("--rotation", default="on,off", help="on (llama.cpp's default), off (LLAMA_ATTN_ROT_DISABLE=1) "
                   "or both (default on,off)")
    p.add_argument("--matmul", default="llamacpp", choices=MATMULS, help="kvquant's matmuls over the GGUF's "
                   "weights: llama.cpp's (activations quantized to the weight's dot-product type, default) or "
                   "float32 (transformers')")
    p.add_argument("--rope-layout", choices=["norm", "neox"], help="K's channel order on kvquant's side (default: "
                   "the model's, as make_cache decides: norm for a Llama-family GGUF)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's and torch's threads (default 2)")
    p.add_argument("--out", type=Path, help="directory for results.json and table.md; each finished window is kept in "
                   "its windows/ folder, so a rerun after an interruption resumes at the next window")
    return p


def settings(types: str, rotation: str) -> list[Setting]:
    from kvquant.errors import KVQuantError

    turns = {"on": True, "off": False}
    chosen = [t.strip() for t in rotation.split(",") if t.strip()]
    bad = [t for t in chosen if t not in turns]
    if bad or not chosen:
        raise KVQuantError(f"--rotation {rotation!r}: on, off or on,off")
    return [Setting(kind.strip(), turns[t]) for t in chosen for kind in types.split(",") if kind.strip()]


def run(args: argparse.Namespace) -> int:
    from kvquant.errors import check_int

    check_int("--windows", args.windows, minimum=1, maximum=1000)
    check_int("--length", args.length, minimum=32, maximum=32768)
    check_int("--threads", args.threads, minimum=1, maximum=256)
    chosen = settings(args.types, args.rotation)
    out = output_dir(args.out, "--out") if args.out else None
    result = compare(args.model, args.windows, args.length, chosen, args.threads, args.matmul, args.rope_layout,
                     progress=lambda message: print(message, file=sys.stderr, flush=True),
                     saved=real_dir(out / "windows", "--out") if out else None)
    print(result["text"])
    if out:
        write_together(out, {"results.json": json.dumps(to_json(result), indent=1) + "\n",
                             "table.md": result["text"] + "\n"})
    return 0 if "target: met" in result["text"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(parser(), argv)
    if isinstance(args, int):
        return args
    return run_guarded(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
