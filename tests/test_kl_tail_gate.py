"""The KL tail share gated end to end (``gate.max_kl_tail_share``, ``kl_tail/<set>``: the share of positions whose
KL divergence from the baseline exceeds ``gate.kl_tail_nats``): a run over stored results (``tests/test_render.py``'s
pattern, nothing measured) where about one position in 63 is above the level passes a 5% limit and one where about
ten in 63 are fails it; the value results.json states is the share counted here by hand."""

import json

import pytest
import yaml

from tiny_configs import MODEL, STORIES
from kvquant.run import main
from test_render import READS, here, memory, setup  # noqa: F401 (``here``: the offline environment, autouse)

WINDOWS, TOKENS = 96, 63  # a pass on a mean over windows needs 96 (kvquant.runner.counts.MIN_PASS)
PPL, KL = "ppl/tinystories", "kl/tinystories"


def judged(tmp_path, above: list[int]) -> tuple[int, dict, dict]:
    """The run of one int4 candidate on 96 tinystories windows, gated on perplexity (the same NLL for both) and on
    at most 5% of positions above 0.25 nats, window ``i`` holding ``above[i]`` positions at 0.5 nats and the rest
    at 0.001."""
    doc = {"name": "tiny", "output_dir": str(tmp_path / "reports"), "model": {"path": MODEL},
           "candidates": [{"quantizer": "int4", "name": "int4", "options": {"residual_length": 0}}],
           "eval": {"perplexity": [{"name": "tinystories", "source": STORIES, "limit": WINDOWS, "max_length": 64}]},
           "gate": {"perplexity": ["tinystories"], "max_kl_tail_share": 0.05, "kl_tail_nats": 0.25}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(doc))
    ppl = {"nll": [100.0] * WINDOWS, "tokens": [TOKENS] * WINDOWS, "reads": READS, "lengths": [64] * WINDOWS}
    kl = [[0.5] * k + [0.001] * (TOKENS - k) for k in above]
    results = {("baseline", "memory"): memory(32.0), ("int4", "memory"): memory(6.5), ("baseline", PPL): ppl,
               ("int4", PPL): ppl, ("int4", KL): {**ppl, "kl": kl, "top1": [TOKENS] * WINDOWS}}
    path, _ = setup(tmp_path, results)
    code = main([str(path)])
    out = json.loads((tmp_path / "reports" / "tiny" / "results.json").read_text())
    assert out["results"]["computed"] == 0  # every result was stored
    return code, out, out["candidates"][0]["metrics"]["kl_tail/tinystories"]


def test_kl_tail_share_passes_where_one_position_in_63_is_above_the_level(tmp_path):
    code, doc, row = judged(tmp_path, [0, 1, 2] * (WINDOWS // 3))
    assert row["value"] == pytest.approx(96 / (96 * 63))  # 1 position in 63: 0.01587
    assert row["kind"] == "tail" and row["gated"] and row["threshold"] == 0.05 and row["n"] == WINDOWS
    assert row["ci_high"] <= 0.05 and row["verdict"] == "pass" and row["passed"] is True
    assert doc["decision"] == "pass" and code == 0
    text = (tmp_path / "reports" / "tiny" / "report.md").read_text()
    assert "KL tail share <= 0.05" in text and "| int4 | kl_tail/tinystories |" in text


def test_kl_tail_share_fails_where_ten_positions_in_63_are_above_the_level(tmp_path):
    code, doc, row = judged(tmp_path, [9, 10, 11] * (WINDOWS // 3))
    assert row["value"] == pytest.approx(10 / 63)  # 0.15873
    assert row["ci_low"] > 0.05 and row["verdict"] == "fail" and row["passed"] is False
    assert doc["decision"] == "fail" and code == 1 and "kl_tail/tinystories" in doc["reason"]
