"""The experiment runner end to end on stories260K: report files, exit codes, resume."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvquant.runner import pipeline, preflight

from kvquant.experiment import provenance as provenance_module
from kvquant.experiment.config import load_config
from kvquant.errors import KVQuantError
from kvquant.run import ABOVE_RUNNER, main
from tiny_configs import TINY

ROOT = Path(__file__).parents[1]

SMALL = """
name: small
output_dir: {out}
candidates:
  - {{quantizer: int8, name: int8, options: {{group_size: 32, residual_length: 0}}}}
  - {{quantizer: int2, name: int2, options: {{residual_length: 0}}}}
eval:
  perplexity:
    - {{name: tinystories, source: local:text/tinystories/validation-first1000.jsonl, limit: 96, max_length: 128}}
    - {{name: wikitext2, source: local:text/wikitext-2-raw-v1/wiki.test.raw, layout: stream, limit: 3, max_length: 256}}
  tasks: {{names: [tinystories_lastword], limit: 30}}
gate: {{bootstrap: 1000, tasks: [], perplexity: [tinystories]}}   # 30 documents cannot show non-inferiority: the
# task is reported, not gated; 3 windows of wikitext2 decide nothing (a pass needs 96: kvquant.runner.counts)
"""


def write_config(tmp_path, text=SMALL):
    path = tmp_path / "small.yaml"
    path.write_text(text.format(out=tmp_path / "reports"))
    return path


@pytest.mark.slow
def test_end_to_end_report(tmp_path, capsys):
    code = main([str(write_config(tmp_path))])
    out_dir = tmp_path / "reports" / "small"
    results = json.loads((out_dir / "results.json").read_text())
    assert code == (0 if results["decision"] == "pass" else 1)
    assert results["decision"] == "pass" and results["chosen"] == "int8"
    by_name = {c["name"]: c for c in results["candidates"]}
    assert by_name["int8"]["passed"] and not by_name["int2"]["passed"]  # int2 loses too much
    for cand in results["candidates"]:
        assert cand["bits_per_element"] < 16 and 0 < cand["memory_ratio"] < 1
        assert set(cand["metrics"]) == {"ppl/tinystories", "ppl/wikitext2", "acc/tinystories_lastword",
                                        "kl/tinystories", "kl/wikitext2", "top1/tinystories", "top1/wikitext2"}
        for entry in cand["metrics"].values():
            assert {"value", "baseline", "relative", "threshold", "passed", "n"} <= set(entry)
    ppl = by_name["int2"]["metrics"]["ppl/tinystories"]
    assert ppl["value"] > ppl["baseline"] and ppl["n"] == 96 and ppl["tokens"] == ppl["baseline_tokens"]
    assert by_name["int2"]["metrics"]["acc/tinystories_lastword"]["n"] == 30
    for name in ("results.csv", "report.md", "plot.png", "config.resolved.yaml"):
        assert (out_dir / name).stat().st_size > 0
    report = (out_dir / "report.md").read_text()
    assert "Decision: PASS" in report and "python -m kvquant.run" in report
    printed = capsys.readouterr().out
    assert "kvquant: PASS" in printed and "report.md" in printed


def test_bad_config_exits_2_with_one_line(tmp_path):
    bad = write_config(tmp_path, SMALL.replace("gate: {{", "gate: {{threshold: 1, "))
    proc = subprocess.run([sys.executable, "-m", "kvquant.run", str(bad)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "unknown key gate.threshold" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("change, message", [
    ("local:text/tinystories/validation-first1000.jsonl", "local:text/missing.jsonl"),
    ("quantizer: int2", "quantizer: int3"),
])
def test_missing_data_or_bad_quantizer_exits_2(tmp_path, capsys, change, message):
    path = write_config(tmp_path, SMALL.replace(change, message))
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvquant: error:") and ("missing.jsonl" in err or "int3" in err)


@pytest.mark.slow
def test_killed_run_resumes_without_recomputing(tmp_path):
    path = write_config(tmp_path)
    partial = tmp_path / "reports" / "small" / "partial"
    proc = subprocess.Popen([sys.executable, "-m", "kvquant.run", str(path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and len(list(partial.glob("*/*.json"))) < 4:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = {p: p.stat().st_mtime_ns for p in partial.glob("*/*.json")}
    assert len(done) >= 4 and not (tmp_path / "reports" / "small" / "results.json").exists()
    assert main([str(path)]) in (0, 1)
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in done.items())  # finished results were not recomputed
    resumed = json.loads((tmp_path / "reports" / "small" / "results.json").read_text())
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    assert main([str(write_config(fresh_dir))]) in (0, 1)
    fresh = json.loads((fresh_dir / "reports" / "small" / "results.json").read_text())
    assert [c["metrics"] for c in resumed["candidates"]] == [c["metrics"] for c in fresh["candidates"]]




def read_report(out_dir):
    return json.loads((out_dir / "results.json").read_text())


def provenance(doc: dict) -> dict:
    """What results.json says of where its results came from, less the run's process count and seconds."""
    results = dict(doc["results"])
    seconds = results.pop("seconds")
    # wall-clock seconds to 0.1 s: a rerun that reuses almost everything can take under 0.05 s (0.0 once, in CI)
    assert results.pop("processes") == 1 and isinstance(seconds, float) and seconds >= 0
    return results


def test_resume_names_corrupt_partials_counts_reuse_and_keys_on_the_code(tmp_path, capsys, monkeypatch):
    path = write_config(tmp_path, TINY)
    out_dir = tmp_path / "reports" / "tiny"
    assert main([str(path)]) == 4  # TINY: 2 windows, too few documents to decide: inconclusive
    first = read_report(out_dir)
    assert provenance(first) == {"computed": 5, "reused_from_partial": 0, "set_aside": []}  # ppl, kl, memory
    for name in ("report.md", "config.resolved.yaml"):  # the three files describe the same run
        assert first["run_id"] in (out_dir / name).read_text()
    assert "5 measured in this run, 0 reused" in (out_dir / "report.md").read_text()
    victim = out_dir / "partial" / "int8" / "ppl__tinystories.json"
    victim.write_text(victim.read_text()[:40])  # a truncated write
    capsys.readouterr()
    assert main([str(path)]) == 4
    err = capsys.readouterr().err
    assert str(victim) in err and "moved to ppl__tinystories.json.corrupt and recomputed" in err
    second = read_report(out_dir)
    assert provenance(second) == {"computed": 1, "reused_from_partial": 4, "set_aside": ["int8/ppl__tinystories.json"]}
    assert [c["metrics"] for c in second["candidates"]] == [c["metrics"] for c in first["candidates"]]
    assert "1 measured in this run, 4 reused" in (out_dir / "report.md").read_text()
    real = provenance_module.code_version()
    monkeypatch.setattr(provenance_module, "code_version", lambda: {**real, "kvquant_source_sha256": "other-code"})
    assert main([str(path)]) == 4
    assert read_report(out_dir)["results"]["computed"] == 5  # results of other code are not reused


def test_a_perplexity_file_whose_text_changed_is_measured_again_not_reused(tmp_path):
    """A result is keyed by the very tokens it read: the same config over an edited text file recomputes (was:
    keyed by the file's name, so a report over new text showed the old text's numbers)."""
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"Once upon a time there was a cat number {i}."}) + "\n"
                            for i in range(4)))
    path = write_config(tmp_path, TINY.replace("local:text/tinystories/validation-first1000.jsonl", str(text)))
    out_dir = tmp_path / "reports" / "tiny"
    assert main([str(path)]) == 4  # a dozen tokens end inside the first key group: not exercised, inconclusive
    first = read_report(out_dir)
    text.write_text("".join(json.dumps({"text": f"The dog ran to the park {i} times and slept."}) + "\n"
                            for i in range(4)))
    main([str(path)])
    second = read_report(out_dir)
    assert provenance(second) == {"computed": 5, "reused_from_partial": 0, "set_aside": []}  # was: 2 reused
    assert second["candidates"][0]["metrics"]["ppl/tinystories"]["value"] != \
        first["candidates"][0]["metrics"]["ppl/tinystories"]["value"]


def test_a_candidate_that_quantizes_nothing_is_named_in_a_warning(tmp_path, capsys):
    """A residual window longer than every sequence keeps all K/V at full precision: its metrics are not
    exercised (it used to pass the gate), and the report says that its scores are no evidence about quantization."""
    path = write_config(tmp_path, TINY)
    assert main([str(path), "--set", "candidates.0.options.residual_length=100000"]) == 4  # inconclusive
    doc = read_report(tmp_path / "reports" / "tiny")
    assert doc["candidates"][0]["verdict"] == "not exercised"
    assert doc["candidates"][0]["metrics"]["ppl/tinystories"]["quantized_share"] == 0
    assert "int8 holds 32.00 bits/element, no fewer than the baseline" in capsys.readouterr().err
    assert "no fewer than the baseline" in (tmp_path / "reports" / "tiny" / "report.md").read_text()


def test_a_busy_report_directory_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys):
    path = write_config(tmp_path, TINY)
    out_dir = tmp_path / "reports" / "tiny"
    out_dir.mkdir(parents=True)
    hold = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode()); print('held', flush=True); "
            "time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(out_dir / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main([str(path)]) == 2
        assert f"is in use by another run (process {holder.pid}" in capsys.readouterr().err
        assert sorted(p.name for p in out_dir.iterdir()) == [".lock"]
    finally:
        holder.kill()
        holder.wait()
    assert main([str(path)]) == 4  # its process is gone: the lock is taken over
    assert "taking over" in capsys.readouterr().err and not (out_dir / ".lock").exists()


def test_internal_error_is_one_line_and_a_log_in_the_report_dir(tmp_path, capsys, monkeypatch):
    def boom(spec):
        raise RuntimeError("boom")

    monkeypatch.setattr(pipeline, "load_model", boom)
    assert main([str(write_config(tmp_path, TINY))]) == 3
    err = capsys.readouterr().err
    log = tmp_path / "reports" / "tiny" / "error.log"
    lines = [line for line in err.strip().splitlines() if not line.startswith("kvquant: warning: ")]  # the config's
    assert len(lines) == 1 and "internal error (RuntimeError: boom)" in err and str(log) in err  # (2 windows: too few)
    assert "Traceback" not in err and "Traceback" in log.read_text()
    assert not (log.parent / ".lock").exists()


def test_interrupt_exits_130_and_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    def interrupted(spec):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "load_model", interrupted)
    assert main([str(write_config(tmp_path, TINY))]) == 130
    assert "interrupted" in capsys.readouterr().err and not (tmp_path / "reports" / "tiny").exists()


def test_a_model_past_its_trained_context_is_warned(tmp_path, capsys):
    cfg = load_config(write_config(tmp_path, TINY), ["model.max_length=2048", "eval.perplexity.0.max_length=4096"])
    _, _, warnings = preflight.preflight(cfg, ABOVE_RUNNER)
    assert "model.max_length 2048 is past the model's trained context (512 positions)" in warnings[0]
    assert "max_length 4096 is cut to the model's 2048 tokens" in warnings[1]
    assert capsys.readouterr().err == ""  # said when the run starts, so that a refusal after preflight is one line
    preflight.say(warnings)
    assert "kvquant: warning: model.max_length 2048" in capsys.readouterr().err


EVICTING = ("candidates.0.options={group_size: 32, residual_length: 0, eviction: sink_window, sink_tokens: 4, "
            "window: 64}")


def test_eviction_needs_streaming_and_a_chunk_wider_than_its_window_is_warned(tmp_path):
    """The settings that evict are found from their typed cache spec: refused in simulated mode (one forward reads
    every token), and in streaming mode a chunk wider than the window is named with both numbers."""
    path = write_config(tmp_path, TINY)
    with pytest.raises(KVQuantError, match=r"^int8: eviction acts between forwards"):
        preflight.preflight(load_config(path, [EVICTING]), ABOVE_RUNNER)
    _, _, warnings = preflight.preflight(load_config(path, [EVICTING, "eval.mode=streaming", "eval.chunk_size=100"]),
                                         ABOVE_RUNNER)
    few = "eval.perplexity tinystories: 2 windows decide nothing"  # TINY's windows (kvquant.runner.counts)
    assert [w for w in warnings if not w.startswith(few)] == [
        "int8: eval.chunk_size 100 is above its window 64: a chunk reads up to chunk_size - 1 tokens beyond the window"]
    _, _, warnings = preflight.preflight(load_config(path, [EVICTING, "eval.mode=streaming", "eval.chunk_size=64"]),
                                         ABOVE_RUNNER)
    assert [w for w in warnings if not w.startswith(few)] == []


def test_each_task_is_gated_on_its_standard_metric():
    """acc_norm for hellaswag and piqa (as their literature reports), acc elsewhere; both are reported."""
    from types import SimpleNamespace

    from kvquant.experiment.config import Candidate
    from kvquant.experiment.gate_config import GateConfig
    from kvquant.runner.gate import metric_rows
    from kvquant.experiment.results import Measured, task_outcomes
    from kvquant.scoring.tasks import gated_metric

    outcome = {"acc": [1, 0, 1, 1], "acc_norm": [1, 1, 0, 1]}
    tasks = ("hellaswag", "lambada_openai", "piqa_local")  # the offline copy is gated as its task (was: on acc)
    measured = [o for task in tasks for o in task_outcomes(task, outcome, gated_metric(task))]
    results = {label: Measured(label, tuple(measured)) for label in ("baseline", "int4")}
    cfg = SimpleNamespace(candidates=[Candidate(quantizer="int4", name="int4")], gate=GateConfig(bootstrap=10),
                          eval=SimpleNamespace(seed=0))
    rows = metric_rows(cfg, results, [c.label for c in cfg.candidates])
    assert {row.metric.name for row in rows} == {f"{m}/{t}" for m in ("acc", "acc_norm") for t in tasks}
    gated = {row.metric.name for row in rows if row.gated}
    assert gated == {"acc_norm/hellaswag", "acc/lambada_openai", "acc_norm/piqa_local"}


@pytest.mark.slow
def test_results_are_not_reused_for_other_weights_or_edited_task_documents(tmp_path, monkeypatch):
    """The same config over a data directory whose model weights and task stories changed reused every result
    (the key held the model's path and the task's name only)."""
    import shutil

    from kvquant.paths import data_dir

    real = data_dir()
    root = tmp_path / "data"
    shutil.copytree(real / "models/stories260K", root / "models/stories260K")
    (root / "text/tinystories").mkdir(parents=True)
    stories = real / "text/tinystories/validation-first1000.jsonl"
    shutil.copy(stories, root / "text/tinystories/validation-first1000.jsonl")
    monkeypatch.setenv("KVQUANT_DATA", str(root))
    path = write_config(tmp_path, TINY.replace("gate: {{bootstrap: 1000}}", "  tasks: {{names: [tinystories_lastword], "
                                               "limit: 5}}\ngate: {{bootstrap: 1000}}"))
    out_dir = tmp_path / "reports" / "tiny"
    main([str(path)])
    assert read_report(out_dir)["results"]["computed"] == 7  # baseline: ppl, task, memory; int8: also kl
    from safetensors.torch import load_file, save_file
    weights_file = root / "models/stories260K/hf/model.safetensors"
    weights = load_file(weights_file)
    weights["model.layers.0.mlp.up_proj.weight"] *= 0.5
    save_file(weights, weights_file, metadata={"format": "pt"})
    main([str(path)])
    assert provenance(read_report(out_dir)) == {"computed": 7, "reused_from_partial": 0, "set_aside": []}
    lines = (root / "text/tinystories/validation-first1000.jsonl").read_text().splitlines()
    lines[600] = json.dumps({"text": "Once upon a time there was a zebra. The zebra ate grass with the other zebra."})
    (root / "text/tinystories/validation-first1000.jsonl").write_text("\n".join(lines) + "\n")
    main([str(path), "--set", "eval.perplexity=[]", "--set", "gate.perplexity=[]"])
    assert read_report(out_dir)["results"]["computed"] >= 2  # the task is measured again over the edited stories


def test_the_model_digest_changes_with_its_config_tokenizer_or_weights(model, tokenizer):
    """Task results were reused after tokenizer.json or config.json changed (the key held a digest of the weights
    only)."""
    import copy

    import torch

    from kvquant.scoring.session import weights_digest

    base = weights_digest(model, tokenizer)
    assert weights_digest(model, tokenizer) == base
    other = copy.deepcopy(model)
    other.config.rope_theta = 10.0
    assert weights_digest(other, tokenizer) != base
    edited = copy.deepcopy(tokenizer)
    edited.add_tokens(["zebra-token"])
    assert weights_digest(model, edited) != base
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters())[0, 0] += 1.0
    assert weights_digest(other, tokenizer) != base


def test_the_model_digest_is_the_same_for_the_same_model_in_another_folder(model, tokenizer, tmp_path):
    """CI found it (stop 61): the digest held the config's ``_name_or_path``, so the same stories260K read from
    ``/check/work/shared/data`` keyed its results apart from ``/work/shared/data``; nothing measured on one machine
    was reused on another, and the tests keyed by this machine's digest failed there."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import MODEL
    from kvquant.paths import resolve
    from kvquant.scoring.session import weights_digest

    moved = tmp_path / "elsewhere" / "stories260K"
    shutil.copytree(resolve(MODEL), moved)
    there = AutoModelForCausalLM.from_pretrained(moved, dtype=torch.float32).eval()
    assert there.config._name_or_path != model.config._name_or_path
    assert weights_digest(there, AutoTokenizer.from_pretrained(moved)) == weights_digest(model, tokenizer)


def test_the_model_digest_does_not_follow_the_thread_count(tokenizer):
    """Qwen2.5's results were keyed as another model's under OMP_NUM_THREADS=1 (a dry run's "0 of 21 reused"): the
    digest held each tensor's sum, whose rounding follows how many threads add it up (three digests at 1, 2 and 4
    threads); results measured on a machine of other cores never travelled. A model with tensors large enough for
    torch to split their sums; a change of one bit in one weight still changes it."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvquant.scoring.session import weights_digest

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    threads = torch.get_num_threads()
    try:
        digests = set()
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            digests.add(weights_digest(model, tokenizer))
    finally:
        torch.set_num_threads(threads)
    assert len(digests) == 1
    flipped = copy.deepcopy(model)
    with torch.no_grad():
        weight = flipped.model.embed_tokens.weight
        weight.view(-1).view(torch.int32)[12345] ^= 1  # the last bit of one of 2 million floats
    assert weights_digest(flipped, tokenizer) != digests.pop()


@pytest.mark.parametrize("path, want", [
    ("configs/int4.yaml", {"candidates": ("int4-g32",), "calibrate": (), "search": None,
                           "staged": False, "looks": {}}),
    ("configs/smollm2-fp8-calibrated.yaml", {"calibrate": ("vllm-fp8-calibrated-tensor", "vllm-fp8-calibrated-head"),
                                             "search": None}),
    ("configs/smollm2-engine-search.yaml", {"candidates": ("vllm-turboquant_k8v4", "vllm-turboquant_k8v4-default",
                                                           "k8v4-skip-layers"),
                                            "search": "k8v4-skip-layers"}),
    ("configs/smollm2-sweep.yaml", {"looks": {"arc_easy": 3, "hellaswag": 3, "lambada_openai": 3, "piqa": 3}}),
    ("configs/staged.yaml", {"staged": True, "search": None}),
])
def test_preflight_plans_the_steps_a_config_asks_for(path, want):
    plan = preflight.plan_steps(load_config(path))
    assert {key: getattr(plan, key) for key in want} == want
    steps = plan.steps()
    gate = "gate (the last stage before the first that does not pass)" if plan.staged else "gate"
    assert steps[-2:] == [gate, "report"]
    assert any(s.startswith("search a per-layer map") for s in steps) is (plan.search is not None)
    assert any(s.startswith("calibrate per-layer options") for s in steps) is bool(plan.calibrate)


def test_the_runner_takes_the_plans_steps_not_the_configs(tmp_path, monkeypatch):
    """A plan that leaves a candidate out: the runner measures only what the plan lists, and the report shows the
    plan's steps."""
    text = TINY.replace("candidates:\n",
                        "candidates:\n  - {{quantizer: int4, name: int4, options: {{residual_length: 0}}}}\n")
    planned = preflight.plan_steps
    monkeypatch.setattr(preflight, "plan_steps", lambda cfg: dataclasses.replace(planned(cfg), candidates=("int8",)))
    assert main([str(write_config(tmp_path, text))]) == 4
    doc = read_report(tmp_path / "reports" / "tiny")
    assert [c["name"] for c in doc["candidates"]] == ["int8"]
    assert doc["plan"]["candidates"] == ["int8"]
    assert doc["plan"]["steps"] == ["measure the baseline and int8 on the evaluation split", "gate", "report"]
    assert ("- steps: measure the baseline and int8 on the evaluation split; gate; report"
            in (tmp_path / "reports" / "tiny" / "report.md").read_text())
