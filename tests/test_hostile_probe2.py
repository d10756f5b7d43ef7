"""Hostile inputs found by the second blind probe of issue 36 (/tmp/probe2): each gets one clear line and exit 2
before a model loads (or the right behaviour), never a hang, a traceback or a silently wrong measurement."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import kvquant.cache.kernels
import kvquant.run
from kvquant import plan
from kvquant.experiment.model_config import ModelConfig
from kvquant.errors import KVQuantError
from kvquant.packaged import PACKAGES

MODEL = "local:models/stories260K/hf"
STORIES = "local:text/tinystories/validation-first1000.jsonl"
GEMMA = next(iter(PACKAGES.values()))

BASE = {
    "name": "probe2",
    "model": {"path": MODEL, "device": "cpu"},
    "candidates": [{"quantizer": "int8", "options": {"group_size": 8, "residual_length": 0}}],
    "eval": {"mode": "simulated", "batch_size": 2,
             "perplexity": [{"name": "ts", "source": STORIES, "limit": 2, "max_length": 64}]},
    "gate": {"perplexity": ["ts"]},
}


@pytest.fixture
def no_load(monkeypatch):
    """``load_model`` booby-trapped: a refusal must come before any model loads."""
    def trap(*args, **kwargs):
        raise AssertionError("the model loaded before the refusal")

    monkeypatch.setattr(kvquant.run, "load_model", trap)


def run_config(tmp_path: Path, **sections) -> list[str]:
    """argv for the runner on the base config with ``sections`` replaced (output under ``tmp_path``)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "output_dir": str(tmp_path / "out"), **sections}))
    return [str(cfg)]


def one_line(capsys, prog: str = "kvquant") -> str:
    """The single line the entry point wrote to stderr (asserts there is exactly one, an error line)."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), lines
    return lines[0]


# R52: a package: model's gguf_file escaping the verified folder measured another file under the package's name
@pytest.mark.parametrize("gguf_file", ["../../../../probe2/x.gguf", "other.gguf", f"./{GEMMA.file}"])
def test_package_gguf_file_must_be_the_packages_file(gguf_file, tmp_path, capsys, no_load):
    with pytest.raises(KVQuantError, match="gguf_file: under package:"):
        ModelConfig(path=f"package:{GEMMA.name}", gguf_file=gguf_file)
    model = {"path": f"package:{GEMMA.name}", "gguf_file": gguf_file, "tokenizer": MODEL, "device": "cpu"}
    assert kvquant.run.main(run_config(tmp_path, model=model)) == 2
    line = one_line(capsys)
    assert "model.gguf_file" in line and GEMMA.file in line and gguf_file in line
    assert not (tmp_path / "out").exists()


def test_package_gguf_file_may_be_the_packages_file_or_absent():
    assert ModelConfig(path=f"package:{GEMMA.name}", gguf_file=GEMMA.file).gguf_file == GEMMA.file
    assert ModelConfig(path=f"package:{GEMMA.name}").gguf_file is None
    assert ModelConfig(path="/some/folder", gguf_file="../x.gguf").gguf_file == "../x.gguf"  # not a package


# P23: the planner compiled the fused CPU dequantization kernel (30-60 s on a fresh machine) for its writes on zeros
def test_planner_never_builds_the_fused_kernel(tmp_path, monkeypatch, capsys):
    calls = []

    def trap():
        calls.append(1)
        raise AssertionError("the planner asked for the fused CPU kernel")

    monkeypatch.setattr(kvquant.cache.kernels, "_extension", trap)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000, "max_position_embeddings": 4096}))
    assert plan.main(["--model", str(model), "--context", "4096", "--cache", "int4"]) == 0, capsys.readouterr().err
    assert "int4" in capsys.readouterr().out
    assert calls == []
    with pytest.raises(AssertionError, match="fused CPU kernel"):  # outside the planner it is asked for again
        kvquant.cache.kernels.usable(torch.empty(1, 2, 8, 64))


# R10: calibration.windows had no bound (10**9 calibrated on the whole rest of the text, >300 s after loading)
CALIBRATING = {"candidates": [{"quantizer": "vllm_fp8", "calibrate": "tensor"}],
               "gate": {"max_perplexity_ratio": 1.05, "perplexity": ["ts"]}}


def test_calibration_windows_bounded_like_search_windows(tmp_path, capsys, no_load):
    argv = run_config(tmp_path, **CALIBRATING, calibration={"windows": 10**9})
    assert kvquant.run.main(argv) == 2
    assert "calibration.windows must be in 1..100000, got 1000000000" in one_line(capsys)


def test_calibration_windows_beyond_the_text_refused_before_loading(tmp_path, capsys, no_load):
    argv = run_config(tmp_path, **CALIBRATING, calibration={"windows": 100_000})
    assert kvquant.run.main(argv) == 2
    line = one_line(capsys)
    assert "calibration.windows: 100,000 asked, but perplexity set 'ts' holds only" in line
    held = int(line.split("holds only ")[1].split(" windows")[0].replace(",", ""))
    assert 0 < held < 100_000 and f"at most {held:,}" in line
    assert not (tmp_path / "out").exists()


def free_port() -> int:
    """A TCP port nothing listens on (just released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed_env(monkeypatch, **values: str) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


# R46: WORLD_SIZE=2 RANK=1 with no process 0 waited for it forever, deaf to SIGTERM
def test_process_without_process_0_gives_up_in_one_line(tmp_path, monkeypatch, capsys, no_load):
    distributed_env(monkeypatch, WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()), KVQUANT_RENDEZVOUS_S="1")
    began = time.monotonic()
    assert kvquant.run.main(run_config(tmp_path)) == 2
    assert time.monotonic() - began < 30
    line = one_line(capsys)
    assert "process 1 waited 1 s for process 0 at 127.0.0.1:" in line and "KVQUANT_RENDEZVOUS_S" in line
    assert not torch.distributed.is_initialized()


def test_process_waiting_for_process_0_ends_on_sigterm():
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "KVQUANT_RENDEZVOUS_S": "120"}
    code = "import sys; from kvquant.scoring import parallel; print('waiting', flush=True); parallel.start(cpu=True)"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "waiting"
    time.sleep(2)
    assert proc.poll() is None  # still waiting for process 0
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=10) != 0
    finally:
        proc.kill()


# R47: WORLD_SIZE=abc was an internal error (ValueError, exit 3)
@pytest.mark.parametrize("name, value", [("WORLD_SIZE", "abc"), ("RANK", "one"), ("LOCAL_RANK", "-1"),
                                         ("LOCAL_WORLD_SIZE", "x")])
def test_launcher_variables_that_are_not_numbers(name, value, tmp_path, monkeypatch, capsys, no_load):
    distributed_env(monkeypatch, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()))
    monkeypatch.setenv(name, value)
    assert kvquant.run.main(run_config(tmp_path)) == 2
    line = one_line(capsys)
    assert f"${name} is {value!r}, not a whole number" in line
    assert not torch.distributed.is_initialized()


# P90: a --model name too long for the file system was an internal error (OSError ENAMETOOLONG, exit 3)
def test_planner_model_name_too_long_for_the_file_system(capsys):
    model = "x" * 5000
    assert plan.main(["--model", model, "--context", "4096"]) == 2
    line = one_line(capsys, "kvquant")
    assert line.startswith(f"kvquant: error: --model {model[:60]!r}...") and "(5,000 characters)" in line
    assert "File name too long" in line and len(line) < 400


# P86: per-head static scales are per model; under --tensor-parallel 2 they were checked against one GPU's KV heads
def test_planner_per_head_scales_are_per_model_under_tensor_parallel(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000, "max_position_embeddings": 4096}))
    argv = ["--model", str(model), "--context", "4096", "--tensor-parallel", "2", "--json"]
    per_head = "{quantizer: vllm_fp8, k_scale: [0.1, 0.2], v_scale: [0.1, 0.2]}"
    assert plan.main([*argv, "--cache", per_head, "--cache", "vllm_fp8"]) == 0, capsys.readouterr().err
    rows = json.loads(capsys.readouterr().out)["settings"]
    assert rows[0]["kv_bytes"] == rows[1]["kv_bytes"] > 0  # a scale's value never changes the bytes
    assert plan.main([*argv, "--cache", per_head.replace("0.2]", "0.2, 0.3]")]) == 2
    assert "k_scale has 3 per-head scales for a model of 2 KV heads" in one_line(capsys, "kvquant")


# R22: kvquant's own get_task_dict call printed lm-eval's DeprecationWarning before a refusal's one line
def test_lm_eval_task_lookup_prints_no_deprecation_warning():
    import warnings

    from kvquant.scoring.tasks import task_dir

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = kvquant.run.lm_eval_task("tinystories_lastword", task_dir())
    assert task is not None
    assert not [w for w in caught if "get_task_dict" in str(w.message)], [str(w.message) for w in caught]


# R22, the rest: the few-shot check's token counts logged transformers' "Token indices sequence length is longer
# than the specified maximum sequence length" before the refusal's one line (and, in a long pytest run, through a
# handler whose stream an earlier test had closed: 189 lines of "--- Logging error ---")
def test_the_few_shot_token_count_logs_no_sequence_length_warning():
    import logging

    from transformers import AutoTokenizer

    from kvquant.scoring.fewshot import counter
    from kvquant.paths import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve(MODEL))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.tokenization_utils_base")
    logger.addHandler(handler)
    try:
        long_text = "one two three " * (tokenizer.model_max_length + 50)
        counts = counter(tokenizer)([long_text, "one"])
    finally:
        logger.removeHandler(handler)
    assert counts[0] > tokenizer.model_max_length and counts[1] == len(tokenizer("one").input_ids)
    assert not [r for r in records if "sequence length" in r.getMessage()], [r.getMessage() for r in records]


# `python -m kvquant.plan ... --json | head`: the reader left before the plan was written; that was "internal error
# (BrokenPipeError ...); please report it", exit 3. Now silent, exit 141 as a shell reports SIGPIPE's writer.
def test_a_reader_that_leaves_early_is_no_internal_error():
    proc = subprocess.Popen([sys.executable, "-m", "kvquant.plan", "--model", "llama-2-7b", "--context", "4096",
                             "--cache", "fp16", "--cache", "int8", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the plan is written: its first write meets a closed pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, err
    assert err == ""
