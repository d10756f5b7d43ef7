"""The processes of one data-parallel run must run the same thing and find each other: ranks whose config, code, data,
model files or lm-eval flags differ are refused before the model loads and store nothing; a process whose process 0
never comes gives up in one line (and ends on SIGTERM while it waits); launcher variables that are not numbers are
one line, not an internal error."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import kvquant.run
from kvquant import lm_eval as lm_eval_cli
from kvquant.errors import KVQuantError
from kvquant.paths import resolve
from kvquant.scoring import parallel
from refusals import error_line
from tiny_configs import MODEL, write_run

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


class Ranks(parallel.Processes):
    """Process 0 of two, whose peer gathered ``theirs`` (a change of this process's parts)."""

    def __init__(self, change: dict):
        super().__init__(rank=0, world=2)
        object.__setattr__(self, "change", change)

    def gather(self, obj):
        return [obj, {**obj, **self.change}]

    def broadcast(self, obj):
        return obj


@pytest.mark.parametrize("part", ["config", "code", "data", "model files"])
def test_ranks_that_disagree_on_config_code_data_or_model_are_refused_before_the_model_loads(
        tmp_path, capsys, monkeypatch, no_model_load, part):
    """int8 on one rank and int4 on the other (same candidate name) blended their scores into one result, stored
    as signed int8 results that a later correct run reused."""
    monkeypatch.setattr(parallel, "current", lambda: Ranks({part: "0123456789abcdef"}))
    code = kvquant.run.main([str(write_run(tmp_path))])
    error_line(code, capsys.readouterr().err, f"process 1 differs from process 0 in its {part}", "nothing was measured")
    assert not (tmp_path / "reports").exists()


def test_lm_eval_ranks_that_run_other_flags_are_refused_before_the_model_loads(capsys, monkeypatch, no_model_load):
    """``torchrun -m kvquant.lm_eval --model kvquant``: ranks with other model_args (another quantizer) or tasks
    would score their shares of other things and rank 0 would gather them into one table."""
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    monkeypatch.setattr(parallel, "current", lambda: Ranks({"command": "0123456789abcdef"}))
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={resolve(MODEL)},quantizer=int4",
                             "--tasks", "tinystories_lastword", "--limit", "2"])
    error_line(code, capsys.readouterr().err, "process 1 differs from process 0 in its command")


def test_ranks_that_agree_go_on():
    parts = {"config": "a", "code": "b"}
    parallel.agree(Ranks({}), parts)
    parallel.agree(parallel.ONE, parts)
    with pytest.raises(KVQuantError, match="in its data"):
        parallel.agree(Ranks({"data": "x"}), parts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_real_ranks_with_int8_and_int4_under_one_name_store_nothing(tmp_path):
    """Two processes of one run (as ``torchrun`` starts them, each on its own machine with its
    own config copy), int8 on rank 0 and int4 on rank 1 under the same candidate name."""
    port, procs = free_port(), []
    for rank, quantizer in enumerate(["int8", "int4"]):
        config = write_run(tmp_path, f"rank{rank}.yaml", candidates=[{"quantizer": quantizer, "name": "q"}])
        env = {**os.environ, **OFFLINE, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "kvquant.run", str(config)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        error_line(proc.returncode, err, "process 1 differs from process 0 in its config")
    assert not (tmp_path / "reports").exists(), "a result was stored"


def distributed_env(monkeypatch, **values: str) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


# WORLD_SIZE=2 RANK=1 with no process 0 waited for it forever, deaf to SIGTERM
def test_process_without_process_0_gives_up_in_one_line(tmp_path, monkeypatch, capsys, no_model_load):
    distributed_env(monkeypatch, WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()), KVQUANT_RENDEZVOUS_S="1")
    began = time.monotonic()
    code = kvquant.run.main([str(write_run(tmp_path))])
    assert time.monotonic() - began < 30
    line = error_line(code, capsys.readouterr().err)
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


# WORLD_SIZE=abc was an internal error (ValueError, exit 3)
@pytest.mark.parametrize("name, value", [("WORLD_SIZE", "abc"), ("RANK", "one"), ("LOCAL_RANK", "-1"),
                                         ("LOCAL_WORLD_SIZE", "x")])
def test_launcher_variables_that_are_not_numbers(name, value, tmp_path, monkeypatch, capsys, no_model_load):
    distributed_env(monkeypatch, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()))
    monkeypatch.setenv(name, value)
    line = error_line(kvquant.run.main([str(write_run(tmp_path))]), capsys.readouterr().err)
    assert f"${name} is {value!r}, not a whole number" in line
    assert not torch.distributed.is_initialized()
