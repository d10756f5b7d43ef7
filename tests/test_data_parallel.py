"""lm-eval's data-parallel protocol in the ``kvquant`` model: two processes (torchrun, gloo on the CPU) score the
same documents as one, value for value.

Both runs use one thread per process (torchrun's default), so each request is computed with the same float
summation order and, with ``--batch_size 1``, in the same batch shape: the log-likelihoods must be equal exactly.
(Batches of several rows differ between the split and the whole run in which rows share a batch, which moves
log-likelihoods by float rounding.)"""

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvquant.paths import resolve

MODEL = resolve("local:models/stories260K/hf")
ARGS = ["--model", "kvquant", "--model_args", f"pretrained={MODEL},quantizer=int4,residual_length=0",
        "--tasks", "tinystories_lastword", "--limit", "12", "--batch_size", "1", "--log_samples", "--seed", "0"]


def samples(out_dir) -> dict:
    (path,) = glob.glob(f"{out_dir}/**/samples_*.jsonl", recursive=True)
    with open(path, encoding="utf-8") as f:
        return {row["doc_id"]: row for row in map(json.loads, f)}


def launch(command: list[str], out_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([*command, *ARGS, "--output_path", str(out_dir)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_two_processes_score_what_one_process_scores(tmp_path):
    launch([sys.executable, "-m", "kvquant.lm_eval"], tmp_path / "one")
    proc = launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "kvquant.lm_eval"],
                  tmp_path / "two")
    assert "on rank 1" in proc.stderr  # the second process took its share
    one, two = samples(tmp_path / "one"), samples(tmp_path / "two")
    assert sorted(one) == sorted(two) == list(range(12))
    for doc in one:
        assert one[doc]["resps"] == two[doc]["resps"], doc
        assert one[doc]["acc"] == two[doc]["acc"]


def test_device_map_with_several_processes_is_refused(monkeypatch, model, tokenizer):
    from kvquant.errors import KVQuantError
    from kvquant.scoring.lm_eval_model import KVQuantLM

    from kvquant.scoring.parallel import Processes

    monkeypatch.setattr("kvquant.scoring.parallel.current", lambda: Processes(rank=1, world=2))
    with pytest.raises(KVQuantError, match="device_map"):
        KVQuantLM(model, tokenizer=tokenizer, device_map="auto")
    lm = KVQuantLM(model, tokenizer=tokenizer)
    assert (lm.rank, lm.world_size) == (1, 2)


# The runner under several processes: each scores its share of every measurement and all gather the scores; process
# 0 writes. Few-shot tasks (arc_easy) check that every process builds the requests one process builds; the gated
# task's sequential looks (8 documents, then 16 while inconclusive) that all processes take the same steps.
RUN_CONFIG = {
    "name": "dp",
    "candidates": [{"quantizer": "int4", "name": "int4", "options": {"group_size": 32, "residual_length": 0}}],
    "eval": {
        "mode": "streaming", "chunk_size": 64, "batch_size": 1,
        "perplexity": [{"name": "tinystories", "source": "local:text/tinystories/validation-first1000.jsonl",
                        "limit": 6, "max_length": 128}],
        "tasks": {"names": ["tinystories_lastword", "arc_easy"], "limit": 8, "num_fewshot": {"arc_easy": 1}},
    },
    "gate": {"bootstrap": 1000, "tasks": ["tinystories_lastword"], "perplexity": [], "max_documents": 16},
}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]


def run_config(tmp_path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**RUN_CONFIG, "output_dir": str(tmp_path / name)}))
    return path


def start(command: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(command: list[str]) -> subprocess.CompletedProcess:
    proc = start(command)
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def partial_results(report_dir: Path) -> dict[str, dict]:
    return {str(p.relative_to(report_dir)): json.loads(p.read_text())
            for p in sorted((report_dir / "partial").glob("*/*.json"))}


def rank_pid(launcher: int, rank: int) -> int | None:
    """The process id of the worker of ``rank`` that the launcher ``launcher`` started."""
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for child in (task / "children").read_text().split():
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                return int(child)
    return None


@pytest.mark.slow
def test_two_processes_run_what_one_runs_survive_an_interrupted_rank_and_resume_with_one(tmp_path):
    one = finish([sys.executable, "-m", "kvquant.run", str(run_config(tmp_path, "one"))])
    assert one.returncode in (0, 1, 4), one.stderr[-3000:]
    reference = partial_results(tmp_path / "one" / "dp")
    # baseline and int4: perplexity, two tasks and the look at documents 8-15, memory; int4's KL divergence
    assert len(reference) == 11 and "partial/int4/task__tinystories_lastword@8-16.json" in reference

    # two processes; process 1 is interrupted once some results are finished
    config = run_config(tmp_path, "two")
    report_dir = tmp_path / "two" / "dp"
    launcher = start([*TORCHRUN, "-m", "kvquant.run", str(config)])
    deadline = time.time() + 600
    while time.time() < deadline and len(list(report_dir.glob("partial/*/*.json"))) < 3:
        time.sleep(0.05)
    os.kill(rank_pid(launcher.pid, 1), signal.SIGINT)
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode != 0, err[-3000:]  # the whole run ended
    kept = partial_results(report_dir)
    assert 3 <= len(kept) < 11 and not (report_dir / "results.json").exists()
    assert not (report_dir / ".lock").exists()
    assert "exitcode  : 130" in err  # the interrupted process's own code, in the launcher's summary
    assert all(kept[name]["result"] == reference[name]["result"] for name in kept)
    mtimes = {name: (report_dir / name).stat().st_mtime_ns for name in kept}

    # resumed with two processes: the finished results are reused, the rest scored as one process scores them
    resumed = finish([*TORCHRUN, "-m", "kvquant.run", str(config)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]  # done: the decision is printed and in results.json
    assert f"kvquant: {json.loads((tmp_path / 'one' / 'dp' / 'results.json').read_text())['decision'].upper()}:" \
        in resumed.stdout
    assert all((report_dir / name).stat().st_mtime_ns == mtime for name, mtime in mtimes.items())
    two = partial_results(report_dir)
    assert two.keys() == reference.keys()
    for name in reference:  # per-document outcomes and log-likelihoods, value for value
        assert two[name]["result"] == reference[name]["result"], name
    doc = json.loads((report_dir / "results.json").read_text())
    fresh = json.loads((tmp_path / "one" / "dp" / "results.json").read_text())["results"]
    # (a sequential look measures the baseline and int4 again, reusing every result they already have)
    reads = fresh["reused_from_partial"]
    assert doc["results"]["processes"] == 2 and doc["results"]["computed"] == 11 - len(kept)
    assert doc["results"]["reused_from_partial"] == reads + len(kept)
    assert untimed(report_dir / "results.csv") == untimed(tmp_path / "one" / "dp" / "results.csv")

    # and again with one process: every result the two processes measured is reused
    again = finish([sys.executable, "-m", "kvquant.run", str(config)])
    assert again.returncode == one.returncode, again.stderr[-3000:]
    doc = json.loads((report_dir / "results.json").read_text())
    assert doc["results"]["processes"] == 1 and doc["results"]["computed"] == 0
    assert doc["results"]["reused_from_partial"] == reads + 11


@pytest.mark.parametrize("world, change, message", [
    (9, None, "9 processes, and no measurement has more than 8 windows or documents"),
    (2, {"device_map": "auto"}, "model.device_map shards one model over devices, and 2 data-parallel processes"),
    (1, {"device_map": "cuda:3"}, "model.device_map is 'cuda:3', but torch sees no GPU"),
])
def test_bad_process_counts_and_device_maps_are_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, world,
                                                                                change, message):
    from kvquant import run
    from kvquant.runner import pipeline
    from kvquant.scoring import parallel
    from kvquant.scoring.parallel import Processes

    config = {**RUN_CONFIG, "output_dir": str(tmp_path), **({"model": change} if change else {})}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setattr(parallel, "current", lambda: Processes(rank=0, world=world))
    monkeypatch.setattr(pipeline, "load_model", lambda spec: pytest.fail("the model was loaded"))
    assert run.main([str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "dp").exists()


def untimed(path: Path) -> list[dict]:
    """A results.csv without its time estimate (``more_seconds``: each run's own pace, not a measured value)."""
    return pd.read_csv(path, dtype=str, keep_default_na=False).drop(columns=["more_seconds"]).to_dict("records")
