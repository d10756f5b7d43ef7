"""Planner timings: each command as a whole process (imports included), wall and CPU seconds and peak memory.

    .venv/bin/python reports/planner_speed/bench.py                      # this checkout, every command
    .venv/bin/python reports/planner_speed/bench.py --old /tmp/kvq_old   # also an older kvquant (its folder holds
                                                                         # kvquant/), where a case names it, and
                                                                         # whether the two print the same

Prints one markdown table row per command and checkout. A command still running after --timeout seconds is
killed and reported so.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLAN = [sys.executable, "-m", "kvquant.plan"]
L8 = ["--model", "llama-3.1-8b", "--context", "32768", "--gpu-memory", "80GB"]
#: (name, arguments, also run on --old)
CASES = [
    ("llama-3.1-8b 80GB (the report's command)", L8, True),
    ("llama-3.1-8b 80GB --tensor-parallel 8, fp16 int4 (docs/planner.md)",
     [*L8, "--cache", "fp16", "--cache", "int4", "--tensor-parallel", "8"], True),
    # the simulation-only planner took 1,345 s on this one, and was killed for memory (23 GB) on the next
    ("llama-3.1-8b 80GB --tensor-parallel 8, the 5 default settings", [*L8, "--tensor-parallel", "8"], False),
    ("mistral-7b-v0.1 (sliding only) 24GB: contexts to 2^30",
     ["--model", "mistral-7b-v0.1", "--context", "8192", "--gpu-memory", "24GB"], False),
    ("llama-3.1-8b --tensor-parallel 32, context 2^30, batch 10^6, 1 PiB",
     ["--model", "llama-3.1-8b", "--context", str(2**30), "--batch", "1000000", "--gpu-memory", str(2**50),
      "--tensor-parallel", "32"], False),
    ("gemma-2-9b, 12 settings (24 kinds of layer, the most one plan takes)",
     ["--model", "gemma-2-9b", "--context", "32768", "--gpu-memory", "80GB", "--shared-prefix", "8192",
      *[a for q in ("fp16", "bf16", "fp32", "int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2", "int4:group_size=128",
                    "int4:residual_length=0", "int2:group_size=64", "int8:key_group_size=64") for a in ("--cache", q)]],
     False),
    ("llama-3.1-8b, 65,536 sinks, 2^24-token residual, 65,536-token groups, eviction to 10^6 tokens",
     [*L8, "--cache", "int4:sink_tokens=65536,residual_length=16777216", "--cache", "int4:key_group_size=65536",
      "--cache", "int4:eviction=key_norm,window=1000000,budget=1000000",
      "--cache", "int4:eviction=sink_window,sink_tokens=4,window=1000000"], False),
    ("a config at every bound (1,024 layers, heads, KV heads; head_dim 4,096; 2^30 windows), context 2^30",
     ["--model", "{bounds}", "--context", str(2**30), "--weights", "1GB", "--gpu-memory", str(2**50)], False),
]
def kinds(entry, base: str = "quantizer: int4", count: int = 23) -> str:
    """A ``layers`` map of ``count`` one-layer entries (``entry(i)``: the options of layer ``i``) besides ``base``."""
    return "{%s, layers: {%s}}" % (base, ", ".join(f"{i}: {{{entry(i)}}}" for i in range(count)))


QUANTIZERS = ["fp16", "fp8_e4m3", "fp8_e5m2", "int2", "int8", "llamacpp_bf16", "llamacpp_f16", "llamacpp_f32",
              "llamacpp_iq4_nl", "llamacpp_q4_0", "llamacpp_q4_1", "llamacpp_q5_0", "llamacpp_q5_1", "llamacpp_q8_0",
              "sglang_mxfp8", "vllm_fp8", "vllm_fp8_per_token_head", "vllm_int4_per_token_head",
              "vllm_int8_per_token_head", "vllm_nvfp4", "vllm_turboquant_4bit_nc", "vllm_turboquant_k8v4"]
# section 3: layers maps of many kinds of layer (issue 36: about 2 s a kind)
CASES += [
    ("llama-3.1-8b 80GB, layers map: 4 kinds (int8, int2, group 64 besides int4)",
     [*L8, "--cache", "{quantizer: int4, layers: {0: {quantizer: int8}, 1: {quantizer: int2}, 2: {group_size: 64}}}"],
     True),
    ("llama-3.1-8b 80GB, layers map: 24 kinds (23 full-precision windows)",
     [*L8, "--cache", kinds(lambda i: f"residual_length: {i + 1}")], True),
    ("llama-3.1-8b 80GB, layers map: 23 kinds (every registered quantizer)",
     [*L8, "--cache", kinds(lambda i: f"quantizer: {QUANTIZERS[i]}", count=len(QUANTIZERS))], True),
    ("llama-3.1-8b 80GB, layers map: IQ4_NL, 23 rotation seeds",
     [*L8, "--cache", kinds(lambda i: f"rotation: hadamard, rotation_seed: {i + 1}", "quantizer: llamacpp_iq4_nl")],
     True),
    ("llama-3.1-8b 80GB, layers map: IQ4_NL, 24 kinds (23 full-precision windows)",
     [*L8, "--cache", kinds(lambda i: f"residual_length: {i + 1}", "quantizer: llamacpp_iq4_nl")], True),
    ("gemma-2-9b 80GB, layers map: IQ4_NL, 24 kinds (22 full-precision windows; answers checked on meta tensors)",
     ["--model", "gemma-2-9b", "--context", "32768", "--gpu-memory", "80GB",
      "--cache", kinds(lambda i: f"residual_length: {i + 1}", "quantizer: llamacpp_iq4_nl", count=22)], True),
    ("config at every bound but 1,024 layers of full attention, layers map: IQ4_NL, 24 kinds (meta tensors)",
     ["--model", "{bounds-full}", "--context", str(2**30), "--weights", "1GB", "--gpu-memory", str(2**50),
      "--cache", kinds(lambda i: f"residual_length: {i + 1}", "quantizer: llamacpp_iq4_nl")], False),
]
BOUNDS = ('{"model_type": "gemma2", "num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": '
          '1024, "head_dim": 4096, "hidden_size": 262144, "intermediate_size": 1048576, "vocab_size": 2097152, '
          '"sliding_window": 1073741824}')
BOUNDS_FULL = BOUNDS.replace('"gemma2"', '"llama"').replace(', "sliding_window": 1073741824', "")


def run(argv: list[str], cwd: Path, timeout: float) -> tuple[str, float, float, float, bytes]:
    """(outcome, wall s, CPU s, peak MiB, stdout) of one process (its own rusage, from wait4)."""
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.DEVNULL,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        outcome = None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if outcome is None and time.perf_counter() - start > timeout:
                proc.kill()
                outcome = f"killed after {timeout:.0f} s"
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        wall = time.perf_counter() - start
        out.seek(0)
        text = out.read()
    return outcome or f"exit {proc.returncode}", wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, help="a folder holding an older kvquant/ to time too")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--only", help="only the commands whose name contains this")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bounds, full = Path(tmp) / "config.json", Path(tmp) / "full" / "config.json"
        bounds.write_text(BOUNDS)
        full.parent.mkdir()
        full.write_text(BOUNDS_FULL)
        paths = {"{bounds}": str(bounds), "{bounds-full}": str(full)}
        print("| command | checkout | outcome | wall s | CPU s | peak MiB | same output |")
        print("|---|---|---|---:|---:|---:|---|")
        for name, argv, compare in CASES:
            if args.only and args.only not in name:
                continue
            argv = [paths.get(a, a) for a in argv]
            new = run([*PLAN, *argv], ROOT, args.timeout)
            rows = [("this", new)]
            if compare and args.old:
                rows.append(("old", run([*PLAN, *argv], args.old, args.timeout)))
            finished = all(r[0].startswith("exit") for _, r in rows)
            same = "" if len(rows) == 1 or not finished else ("yes" if rows[1][1][4] == new[4] else "NO")
            for which, (outcome, wall, cpu, peak, _) in rows:
                print(f"| {name} | {which} | {outcome} | {wall:.1f} | {cpu:.1f} | {peak:.0f} | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
