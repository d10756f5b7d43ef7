"""experiments/gpu_check.py's whole gated run (check 8): ``make run``'s config (configs/int4.yaml: int4 KV on
SmolLM2-135M-Instruct) run by ``python -m kvquant.run`` on the GPU into a scratch folder, its wall time taken, and
its results held against the committed CPU report's (reports/int4/results.json): the decision, each candidate's
verdict and each metric's verdict equal, each KL divergence within :data:`KL_SHARE` of the CPU's interval
half-width, and the two wall times side by side. :func:`compare_gated` is pure (tests/test_gpu_check_gated.py)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from kvquant.fs import read_json, write_file

GATED_CONFIG = Path("configs/int4.yaml")
GATED_CPU = Path("reports/int4/results.json")
#: a GPU run's KL divergence may differ from the CPU's by at most this share of the CPU's 95% interval half-width:
#: the two differ only in float32 rounding order (a code flipped at a rounding boundary), which must stay far inside
#: what the sampling of windows leaves open (reports/int4: 0.0157, interval 0.0141..0.0172, so 3.1e-4)
KL_SHARE = 0.2


def compare_gated(gpu: dict, cpu: dict, kl_share: float = KL_SHARE) -> list[dict]:
    """Rows ``{what, cpu, gpu, ok, rule}`` holding a GPU run's results.json against the CPU's: the decision; per
    CPU candidate its verdict, each metric's verdict, and for each KL divergence (``kind`` divergence) its value
    within ``kl_share`` of the CPU's interval half-width; a candidate only one side has is a row that is not ok."""
    rows = [row("decision", cpu.get("decision"), gpu.get("decision"))]
    ours = {c["name"]: c for c in gpu.get("candidates", [])}
    for c in cpu.get("candidates", []):
        g = ours.pop(c["name"], None)
        rows.append(row(f"{c['name']} verdict", c.get("verdict"), None if g is None else g.get("verdict")))
        for metric, m in sorted(c.get("metrics", {}).items()):
            gm = {} if g is None else g.get("metrics", {}).get(metric, {})
            rows.append(row(f"{c['name']} {metric} verdict", m.get("verdict"), gm.get("verdict")))
            if m.get("kind") == "divergence":
                tolerance = kl_share * (m["ci_high"] - m["ci_low"]) / 2
                value = gm.get("value")
                rows.append({"what": f"{c['name']} {metric} value", "cpu": m["value"], "gpu": value,
                             "ok": value is not None and abs(value - m["value"]) <= tolerance,
                             "rule": f"within {tolerance:.2e} ({kl_share} x the CPU's interval half-width)"})
    rows += [row(f"{name} verdict", None, g.get("verdict")) for name, g in ours.items()]
    return rows


def row(what: str, cpu, gpu) -> dict:
    """A row of :func:`compare_gated` that asks for equality (a value missing on either side is not ok)."""
    return {"what": what, "cpu": cpu, "gpu": gpu, "ok": cpu is not None and cpu == gpu, "rule": "equal"}


def seconds(gpu: dict, cpu: dict) -> dict:
    """Each run's own wall-clock seconds (model load to gate, ``results.seconds``) and where the CPU's was taken."""
    env = cpu.get("environment", {})
    return {"gpu_s": gpu.get("results", {}).get("seconds"), "cpu_s": cpu.get("results", {}).get("seconds"),
            "cpu_machine": env.get("machine"), "cpu_date": env.get("date"), "cpu_commit": env.get("git_commit")}


def run_gated(config: Path, cpu: dict, device: str, left: Callable[[], float], out: Path, sets=(),
              root: Path = Path()) -> dict:
    """``python -m kvquant.run CONFIG --set model.device=DEVICE --set output_dir=SCRATCH`` (and ``sets``) from
    ``root``, stopped when ``left()`` seconds have passed; its model converted (a GGUF, once) and loaded before, on
    the CPU and untimed, so that the timed run reads the converted copy as any later run does. The run's
    results.json and report.md are copied to ``out`` as gated-results.json and gated-report.md, and compared with
    ``cpu`` (a results.json)."""
    from kvquant.experiment.config import load_config
    from kvquant.scoring.models import load_model

    sets, config = [f"model.device={device}", *sets], Path(config).resolve()
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check-gated-"))
    command = [sys.executable, "-m", "kvquant.run", str(config)]
    for s in [*sets, f"output_dir={scratch}"]:
        command += ["--set", s]
    done = {"command": " ".join(["python", *command[1:]])}
    try:
        cfg = load_config(config, sets)
        start = time.perf_counter()
        load_model(dataclasses.replace(cfg.model, device="cpu"))
        done["prepare_s"] = time.perf_counter() - start
        start, timeout = time.perf_counter(), max(left(), 1)
        ran = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout)
        done.update(wall_s=time.perf_counter() - start, returncode=ran.returncode,
                    output_tail="\n".join((ran.stdout + ran.stderr).strip().splitlines()[-20:]))
        report = scratch / cfg.name
        gpu = read_json(report / "results.json", "the gated run")
        for name in ("results.json", "report.md"):
            write_file(out / f"gated-{name}", (report / name).read_bytes())
        done.update(rows=compare_gated(gpu, cpu), seconds=seconds(gpu, cpu),
                    computed=gpu.get("results", {}).get("computed"),
                    reused=gpu.get("results", {}).get("reused_from_partial"))
    except subprocess.TimeoutExpired:
        done["error"] = f"the gated run did not finish in {timeout:.0f} s (its stage's time limit)"
    except Exception:  # noqa: BLE001 (recorded, the run goes on)
        done["error"] = traceback.format_exc(limit=4) + done.get("output_tail", "")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return done


def gated_verdicts(g: dict) -> list[str]:
    """PASS / FAIL per compared row of the gated run, and a NOTE with the two wall times."""
    if not g:
        return []
    if "error" in g:
        return [f"FAIL gated run on the GPU ({g.get('command', '')}): {g['error'].strip().splitlines()[-1]}"]
    lines = [f"{'PASS' if r['ok'] else 'FAIL'} gated run on the GPU: {r['what']} {r['gpu']} (CPU {r['cpu']}; "
             f"{r['rule']})" for r in g["rows"]]
    s = g["seconds"]
    lines.append(f"NOTE gated run `{g['command']}` (exit {g['returncode']}): GPU {s['gpu_s']} s model load to "
                 f"gate ({g['wall_s']:.1f} s the whole command, {g['prepare_s']:.1f} s converting and loading the "
                 f"model before it, untimed), CPU {s['cpu_s']} s ({s['cpu_machine']}, {s['cpu_date']}, git "
                 f"{s['cpu_commit']}); {g['computed']} results measured, {g['reused']} reused")
    return lines
