"""lm-eval's data-parallel protocol in the ``kvquant`` model: two processes (torchrun, gloo on the CPU) score the
same documents as one, value for value.

Both runs use one thread per process (torchrun's default), so each request is computed with the same float
summation order and, with ``--batch_size 1``, in the same batch shape: the log-likelihoods must be equal exactly.
(Batches of several rows differ between the split and the whole run in which rows share a batch, which moves
log-likelihoods by float rounding.)"""

import glob
import json
import os
import subprocess
import sys

import pytest

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
    from kvquant.lm_eval_model import KVQuantLM

    class TwoProcesses:
        process_index, num_processes = 1, 2
        device = __import__("torch").device("cpu")

    monkeypatch.setattr("kvquant.lm_eval_model.processes", lambda: TwoProcesses())
    with pytest.raises(KVQuantError, match="device_map"):
        KVQuantLM(model, tokenizer=tokenizer, device_map="auto")
    lm = KVQuantLM(model, tokenizer=tokenizer)
    assert (lm.rank, lm.world_size) == (1, 2)
