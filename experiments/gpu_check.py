"""kvquant on a CUDA GPU: the checks CPU-only CI cannot make, in one short run.

    python experiments/gpu_check.py --out reports/gpu_check       # about 7 minutes; --time-limit 480 by default

On random-init models of real shapes (SmolLM2-135M, a Llama-3-8B layer stack, Mistral's sliding window,
head_dim 80 and 256), in bfloat16 on the GPU, in this order (the most important first, so that a run stopped at
its time limit has measured them; ``--checks`` picks and orders, ``--skip`` leaves out):

1. **kernel_tests**: the Triton kernel's own tests (tests/test_triton_attend.py) compiled on the GPU instead of
   Triton's interpreter;
2. **memory** (no model): one cache per quantizer written to 4K, 16K and 32K tokens (chunks of 2,048, then
   single-token steps across growths of its pools), ``torch.cuda.memory_allocated`` deltas against
   ``memory_report()``'s ``stored_bytes + reserved_bytes`` (``tensor_bytes``), which must also equal the cache's
   own tensors exactly, and the reserved share within the growth policy's bound (experiments/gpu_memory.py);
3. **speed**: decode tokens/s over caches filled to 4K/16K/32K tokens x batch 1/16 (Llama-3-8B attention shape,
   4 layers), kvquant's caches eager and through ``enable_fused_decode`` (the Triton kernel reading the codes)
   against kvquant's fp16 cache and ``DynamicCache`` with SDPA, same run; issue 57's targets as verdicts: int4 g32
   at 16K x 16 at least 1.3x kvquant's fp16 and 1.0x ``DynamicCache``, fp8 at least 1.1x kvquant's fp16
   (experiments/gpu_speed.py);
4. **gated**: ``make run``'s config (configs/int4.yaml) run whole on the GPU, its verdicts and KL held against the
   committed CPU report, its wall time beside the CPU's (experiments/gpu_gated.py);
5. **codes**: K/V written to a cache on the GPU read back as on the CPU (same float32 tensors);
6. **fused**: decode logits through the Triton kernel against the same cache read through its dequantized copy
   (float32: equal to rounding; the kernel's calls counted, so a silent fallback shows);
7. **logits**: the fp16 quantizer's logits equal ``DynamicCache``'s bit for bit (chunked prefill + decode); each
   quantizer's logits differ from ``DynamicCache``'s, int2 more than int8, with the CPU's error (the same model in
   float32 on the CPU, same cache settings).

Each check has its own time limit and the run one in all (``--time-limit``): a check not started for lack of time,
or stopped part way, is named in the report. ``results.json`` and ``report.md`` (command, machine, date, seconds
per check) are written to ``--out`` after each check. Every check records its error instead of stopping the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from gpu_gated import GATED_CONFIG, GATED_CPU, gated_verdicts, run_gated
from gpu_memory import MEMORY_CONTEXTS, check_memory, failed, memory_markdown, memory_verdicts
from gpu_models import (FUSED, QUANTIZERS, build, check_codes, check_fused, check_logits, codes_verdicts,
                        fused_verdicts, logit_verdicts, shapes)
from gpu_speed import (SPEED_BATCHES, SPEED_CONTEXTS, TARGET_CACHES, check_speed, speed_factories, speed_markdown,
                       speed_memory_verdicts, speed_points, target_verdicts)

import kvquant
from kvquant.errors import KVQuantError, at_least, script_parser
from kvquant.exits import run_script
from kvquant.fs import output_dir, read_json, write_file
from kvquant.runner.report import environment

ROOT = Path(__file__).resolve().parents[1]


def run_kernel_tests(device, timeout: float) -> dict:
    """Check 1: tests/test_triton_attend.py compiled on the GPU (``KVQUANT_TEST_DEVICE``) instead of under Triton's
    interpreter: the kernel against float64 attention written in the test, over hand-built streams; stopped after
    ``timeout`` seconds."""
    env = dict(os.environ, KVQUANT_TEST_DEVICE=device)
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton_attend.py"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(timeout, 1))
    tail = (done.stdout + done.stderr).strip().splitlines()
    return {"returncode": done.returncode, "summary": tail[-1] if tail else "", "output_tail": "\n".join(tail[-60:])}


def verdicts(results: dict) -> list[str]:
    """The properties the checks stand for, each PASS/FAIL (the decode targets MET / NOT MET) with its numbers, in
    the default order of the checks."""
    lines = []
    if "kernel_tests" in results:
        t = results["kernel_tests"]
        lines.append(f"{'PASS' if t['returncode'] == 0 else 'FAIL'} tests/test_triton_attend.py compiled on the GPU: "
                     f"{t['summary']}")
    lines += memory_verdicts(results.get("memory", {}).get("rows", []))
    speed = results.get("speed", {"rows": []})
    failed(lines, "memory and speed", speed)
    if speed["rows"]:
        lines += target_verdicts(speed["rows"])
    lines += speed_memory_verdicts(speed["rows"])
    lines += gated_verdicts(results.get("gated", {}))
    return (lines + codes_verdicts(results.get("codes", {})) + fused_verdicts(results.get("fused", {}))
            + logit_verdicts(results.get("logits", {})))


def render(results: dict, args, command: str | None = None) -> str:
    env = results["environment"]
    lines = ["# kvquant on a GPU", "",
             f"- command: `{command or 'python ' + ' '.join(sys.argv)}`",
             f"- date: {env['date']}; git {env['git_commit']}",
             f"- machine: {env['machine']}; torch {env['torch']}, transformers {env['transformers']}",
             "- models: random-init; logit checks with residual_length 0 (every token read quantized), 600-token "
             "prompts (prefill in chunks of 256, the last 16 tokens one at a time), batch 2, float32 on both devices "
             "(identity also in bfloat16 on the GPU); memory and speed in bfloat16 with the quantizers' defaults",
             "", "## Checks", ""]
    for check, run in results.get("taken_from", {}).items():
        lines.append(f"- *{check}*: taken from an earlier run ({run}); this run did not repeat it")
    for check, why in results.get("not_run", {}).items():
        lines.append(f"- *{check}*: {why}")
    if results.get("seconds"):
        lines.append("- seconds per check: " + ", ".join(f"{k} {v}" for k, v in results["seconds"].items()))
    if results.get("taken_from") or results.get("not_run") or results.get("seconds"):
        lines.append("")
    lines += [f"- {v}" for v in verdicts(results)]
    lines += memory_markdown(results.get("memory", {}).get("rows", []))
    speed = results.get("speed", {"rows": []})
    if speed["rows"]:
        layers = shapes()[SPEED_SHAPE][1].num_hidden_layers
        lines += speed_markdown(speed["rows"], speed.get("steps", args.steps), layers)
    return "\n".join(lines) + "\n"


#: the shape the memory and speed checks use: Llama-3-8B's attention (32 heads, 8 KV heads of 128), 4 layers
SPEED_SHAPE = "llama3-8b-4layers"


def stage_kernel_tests(args, results, left):
    print("gpu_check: the Triton kernel's tests, compiled", flush=True)
    try:
        results["kernel_tests"] = run_kernel_tests(args.device, left())
    except Exception:  # noqa: BLE001 (a timeout included)
        results["kernel_tests"] = {"returncode": -1, "summary": traceback.format_exc(limit=2).splitlines()[-1]}


def stage_memory(args, results, left):
    print("gpu_check: memory against the allocator", flush=True)
    try:
        results["memory"] = check_memory(args.device, shapes()[SPEED_SHAPE][1], QUANTIZERS, args.memory_contexts,
                                         args.batch, in_time=lambda: left() > 0)
    except Exception:  # noqa: BLE001
        results["memory"] = {"rows": [], "error": traceback.format_exc(limit=4)}
    return results["memory"].pop("stopped", None)


def stage_speed(args, results, left):
    print("gpu_check: decode speed and the targets", flush=True)
    try:
        cls, config = shapes()[SPEED_SHAPE]
        model = build(cls, config, args.device, torch.bfloat16)
        fused = build(cls, config, args.device, torch.bfloat16)  # the same weights; decode steps read the codes
        fused.load_state_dict(model.state_dict())
        kvquant.enable_fused_decode(fused)
        names = None if args.speed_caches == "all" else TARGET_CACHES
        results["speed"] = check_speed(speed_factories(model, fused, config, QUANTIZERS, FUSED, names), config,
                                       speed_points(args.contexts, args.batches), args.steps, args.device,
                                       in_time=lambda: left() > 0)
        del model, fused
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        results["speed"] = {"rows": [], "error": traceback.format_exc(limit=4)}
    results["speed"]["steps"] = args.steps
    return results["speed"].pop("stopped", None)


def stage_gated(args, results, left):
    print(f"gpu_check: {args.gated_config} run whole on the GPU", flush=True)
    results["gated"] = run_gated(args.gated_config, args.gated_cpu_results, args.device, left, args.out, root=ROOT)


def stage_codes(args, results, left):
    print("gpu_check: codes", flush=True)
    results["codes"] = check_codes(args.device)


def per_shape(check, names, key):
    """A stage running ``check`` on each of ``names`` (shapes) while its time lasts; a shape's error recorded."""
    def stage(args, results, left):
        for name in names:
            if left() <= 0:
                return f"time limit, before {name}"
            print(f"gpu_check: {key} on {name}", flush=True)
            cls, config = shapes()[name]
            try:
                results[key][name] = check(name, cls, config, args.device)
            except Exception:  # noqa: BLE001
                results[key][name] = {"error": traceback.format_exc(limit=4)}
        return None
    return stage


@dataclass(frozen=True)
class Stage:
    """One check: ``run(args, results, left)`` (``left()``: its seconds left; returns a note where it stopped part
    way), about how long it takes and its own time limit, in seconds. The expectations are guesses for an H100
    but the kernel tests' (111 s on an H200, 2026-12-04), to be replaced by the ``seconds`` a run records."""
    run: Callable
    expected_s: float
    limit_s: float


#: check name -> stage, in the default order: what issue 57 must show first, then the checks run before
STAGES = {"kernel_tests": Stage(stage_kernel_tests, 120, 240), "memory": Stage(stage_memory, 45, 120),
          "speed": Stage(stage_speed, 120, 200), "gated": Stage(stage_gated, 180, 300),
          "codes": Stage(stage_codes, 15, 60),
          "fused": Stage(per_shape(check_fused, ("smollm2-135m", "mistral-sliding256", "head_dim80", "head_dim256"),
                                   "fused"), 120, 240),
          "logits": Stage(per_shape(check_logits, tuple(shapes()), "logits"), 240, 400)}
#: the run's time limit by default: one device lease is 15 minutes in all, start-up and transfers included
TIME_LIMIT = 480


def plan_line(checks, stages=STAGES, time_limit=TIME_LIMIT) -> str:
    """What the run will try, and about how long it takes."""
    expected = sum(stages[c].expected_s for c in checks)
    return (f"gpu_check: {', '.join(checks)}: about {expected:.0f} s expected in all ({expected / 60:.1f} min), "
            f"at most {time_limit} s (--time-limit; checks that do not fit are named in the report)")


def run_stages(args, results, out: Path, checks, stages=STAGES, time_limit=TIME_LIMIT, clock=time.monotonic):
    """Each of ``checks`` in order within its own time limit and the run's; one the run's time left is under a
    quarter of its expectation is not started. results.json and report.md are written after each, so a run
    stopped at its time limit keeps what it measured; ``results["not_run"]`` says what was left out, and why."""
    start = clock()
    for name in checks:
        stage, run_left = stages[name], time_limit - (clock() - start)
        if run_left < stage.expected_s / 4:
            results.setdefault("not_run", {})[name] = (f"not started: {max(run_left, 0):.0f} s of the run's "
                                                       f"{time_limit} s left, about {stage.expected_s:.0f} s expected")
        else:
            began, own = clock(), min(stage.limit_s, run_left)
            note = stage.run(args, results, lambda began=began, own=own: own - (clock() - began))
            took = clock() - began
            results.setdefault("seconds", {})[name] = round(took, 1)
            if note:
                results.setdefault("not_run", {})[name] = f"stopped after {took:.0f} s of its {own:.0f} s: {note}"
        write_file(out / "results.json", json.dumps(results, indent=1))
        write_file(out / "report.md", render(results, args, results["command"]))


def read_results(path: Path, what: str) -> dict:
    """An earlier run's results.json (one line and exit 2 where it is not one)."""
    results = read_json(path, what)
    if not isinstance(results.get("environment"), dict):
        raise KVQuantError(f"{what}: {path} is not a results.json gpu_check writes")
    return results


def main(argv=None):
    parser = script_parser("gpu_check", __doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", type=at_least(1), nargs="+", default=list(SPEED_CONTEXTS),
                        help="contexts the speed check fills its caches to")
    parser.add_argument("--batches", type=at_least(1), nargs="+", default=list(SPEED_BATCHES),
                        help="batches the speed check decodes")
    parser.add_argument("--speed-caches", choices=("targets", "all"), default="targets",
                        help="the caches the targets read (default), or every quantizer eager and fused")
    parser.add_argument("--memory-contexts", type=at_least(1), nargs="+", default=list(MEMORY_CONTEXTS),
                        help="contexts --checks memory measures its growing caches at")
    parser.add_argument("--batch", type=at_least(1), default=4, help="the batch of --checks memory")
    parser.add_argument("--steps", type=at_least(1), default=32, help="timed decode steps per speed row")
    parser.add_argument("--checks", nargs="+", choices=list(STAGES), default=list(STAGES),
                        help="which checks to run, in this order (default: all, in the order listed)")
    parser.add_argument("--skip", nargs="+", choices=list(STAGES), default=[], help="checks to leave out")
    parser.add_argument("--time-limit", type=at_least(1), default=TIME_LIMIT,
                        help=f"seconds for the whole run (default {TIME_LIMIT}); each check also has its own")
    parser.add_argument("--gated-config", type=Path, default=ROOT / GATED_CONFIG, help="the gated run's config")
    parser.add_argument("--gated-cpu", type=Path, default=ROOT / GATED_CPU,
                        help="the CPU run's results.json the gated run is held against")
    parser.add_argument("--keep-from", type=Path, help="an earlier run's results.json: the checks not run now are "
                        "taken from it, and the report says so (one lease may not fit every check)")
    parser.add_argument("--out", type=Path, default=Path("reports/gpu_check"))
    parser.add_argument("--render", action="store_true", help="rewrite report.md from --out's results.json only")
    args = parser.parse_args(argv)
    if args.render:
        results = read_results(args.out / "results.json", "--render")
        write_file(output_dir(args.out, "--out") / "report.md", render(results, args, results.get("command")))
        return
    checks = [c for c in args.checks if c not in args.skip]
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        raise KVQuantError(f"--device {args.device}: no CUDA device here; gpu_check measures on a GPU (--render "
                           "rewrites report.md from an earlier results.json without one)")
    earlier = read_results(args.keep_from, "--keep-from") if args.keep_from else {}
    if "gated" in checks:
        args.gated_cpu_results = read_results(args.gated_cpu, "--gated-cpu")
    results = {"command": f"python {' '.join(sys.argv)}", "environment": environment(), "logits": {}, "fused": {},
               "codes": {}, "memory": {"rows": []}, "speed": {"rows": []}}
    for check in STAGES:
        if check not in checks and check in earlier:
            results[check] = earlier[check]
            env = earlier["environment"]
            results.setdefault("taken_from", {})[check] = f"{env.get('date')}, git {env.get('git_commit')}"
    out = output_dir(args.out, "--out")
    print(plan_line(checks, time_limit=args.time_limit), flush=True)
    run_stages(args, results, out, checks, time_limit=args.time_limit)
    print((out / "report.md").read_text())


if __name__ == "__main__":
    sys.exit(run_script("gpu_check", main))
