"""Top-1 agreement gated end to end (``gate.min_top1_agreement``, the ``agreement`` kind of
:mod:`kvquant.experiment.metric`): a run over stored results (``tests/test_render.py``'s pattern, nothing measured)
where the candidate's next-token argmax agrees with the baseline's on nearly every position passes, and one where it
agrees on about four positions in five fails; the value results.json states is the share computed here by hand."""

import json

import numpy as np
import pytest
import yaml

from tiny_configs import MODEL, STORIES
from kvquant.run import main
from test_render import READS, here, memory, setup  # noqa: F401 (``here``: the offline environment, autouse)

WINDOWS, TOKENS = 96, 63  # a pass on a mean over windows needs 96 (kvquant.runner.counts.MIN_PASS)
PPL, KL = "ppl/tinystories", "kl/tinystories"


def config(tmp_path, agreement: float) -> None:
    """stories260K's config with one int4 candidate, 96 tinystories windows gated on perplexity and on top-1
    agreement of at least ``agreement``, no task (written where :func:`test_render.setup` reads it)."""
    doc = {"name": "tiny", "output_dir": str(tmp_path / "reports"), "model": {"path": MODEL},
           "candidates": [{"quantizer": "int4", "name": "int4", "options": {"residual_length": 0}}],
           "eval": {"perplexity": [{"name": "tinystories", "source": STORIES, "limit": WINDOWS, "max_length": 64}]},
           "gate": {"perplexity": ["tinystories"], "min_top1_agreement": agreement}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(doc))


def stored(top1: list[int]) -> dict:
    """The run's results, synthetic: the same NLL for both (the perplexity ratio is 1), KL 0.001 nats per position,
    and ``top1`` positions of each window's 63 keeping the baseline's most likely token."""
    ppl = {"nll": [100.0] * WINDOWS, "tokens": [TOKENS] * WINDOWS, "reads": READS, "lengths": [64] * WINDOWS}
    return {("baseline", "memory"): memory(32.0), ("int4", "memory"): memory(6.5),
            ("baseline", PPL): ppl, ("int4", PPL): ppl,
            ("int4", KL): {**ppl, "kl": [[0.001] * TOKENS] * WINDOWS, "top1": top1}}


def judged(tmp_path, agreement: float, top1: list[int]) -> tuple[int, dict, dict]:
    config(tmp_path, agreement)
    path, _ = setup(tmp_path, stored(top1))
    code = main([str(path)])
    doc = json.loads((tmp_path / "reports" / "tiny" / "results.json").read_text())
    assert doc["results"]["computed"] == 0  # every result was stored
    return code, doc, doc["candidates"][0]["metrics"]["top1/tinystories"]


def test_top1_agreement_passes_where_nearly_every_position_agrees(tmp_path):
    top1 = [63, 62] * (WINDOWS // 2)  # 93 + 93 / 2 = 62.5 of 63 per window
    code, doc, row = judged(tmp_path, 0.95, top1)
    assert row["value"] == pytest.approx((63 * 48 + 62 * 48) / (63 * 96))  # 0.99206
    assert row["kind"] == "agreement" and row["gated"] and row["threshold"] == 0.95
    assert row["ci_low"] >= 0.95 and row["verdict"] == "pass" and row["passed"] is True
    assert doc["decision"] == "pass" and doc["chosen"] == "int4" and code == 0
    assert "top-1 agreement >= 0.95" in (tmp_path / "reports" / "tiny" / "report.md").read_text()


def test_top1_agreement_fails_where_one_position_in_five_changes(tmp_path):
    top1 = list(np.tile([50, 51, 52], WINDOWS // 3))  # 51 of 63 per window on average
    code, doc, row = judged(tmp_path, 0.9, [int(t) for t in top1])
    assert row["value"] == pytest.approx(51 / 63)  # 0.80952
    assert row["ci_high"] < 0.9 and row["verdict"] == "fail" and row["passed"] is False
    assert doc["decision"] == "fail" and code == 1
    assert "top1/tinystories" in doc["reason"]
