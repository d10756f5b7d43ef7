"""experiments/bench_prefill.py on stories260K, by value (no timing is asserted): the chunked prefill gives a plain
forward's logits, the fp16 identity cache gives DynamicCache's bit for bit and int4 does not (read quantized), the
ratios are paired by round, and a quick run writes the report with a memory row per length."""

import json

import pytest
import torch

from tests.conftest import MODEL, experiment



@pytest.fixture(scope="module")
def script():
    return experiment("bench_prefill")


def test_chunked_prefill_reads_the_cache_and_only_the_identity_is_exact(script, model, tokenizer):
    ids = script.context(tokenizer, 96)
    assert ids.shape == (1, 96)
    with torch.inference_mode():
        plain = model(ids).logits[0]  # no cache: every position in one forward
    got = script.prefill(model, script.new_cache(model, "DynamicCache"), ids, 32)
    assert got.shape == (3, plain.shape[-1])
    torch.testing.assert_close(got, plain[[31, 63, 95]], rtol=1e-4, atol=1e-4)
    every = script.prefill(model, script.new_cache(model, "DynamicCache"), ids, None, logits="all")
    torch.testing.assert_close(every, plain[[95]], rtol=1e-4, atol=1e-4)

    checked = script.check(model, ids, ["DynamicCache", "fp16", "int4-g32"], 32, "last")
    assert checked["fp16"]["bit_exact"] and checked["fp16"]["max_abs_logit_diff"] == 0
    assert checked["fp16"]["stored_bytes"] == checked["DynamicCache"]["stored_bytes"]
    int4 = checked["int4-g32"]
    assert not int4["bit_exact"] and int4["max_abs_logit_diff"] > 1e-3
    assert int4["keys_read_quantized_share"] == 1.0 and int4["values_read_quantized_share"] == 1.0
    assert int4["stored_bytes"] < checked["DynamicCache"]["stored_bytes"] / 3


def test_ratios_pair_rounds_and_doubling_divides_by_the_half_length(script):
    base = {"wall": [1.0, 2.0, 4.0], "cpu": [1.0, 1.0, 1.0], "update": [0.1, 0.2, 0.4]}
    out = script.ratios({"DynamicCache": base, "int4-g32": {"wall": [1.5, 2.0, 8.0], "cpu": [1.1, 1.2, 1.3],
                                                            "update": [0.3, 0.2, 0.8]}})
    assert out["int4-g32"]["wall_ratio"] == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert out["int4-g32"]["cpu_ratio"]["median"] == pytest.approx(1.2)
    assert out["int4-g32"]["wall"]["median"] == 2.0 and out["int4-g32"]["update_share"]["median"] == 0.1
    assert out["DynamicCache"]["wall_ratio"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    rows = [{"setting": "s", "mode": "chunked", "length": n, "peak_growth_bytes": b}
            for n, b in ((100, 10), (200, 20), (400, 80))]
    assert [(f["length"], f["factor"]) for f in script.doubling(rows)] == [(200, 2.0), (400, 4.0)]


def test_quick_run_writes_the_ratio_and_memory_per_length(script, tmp_path):
    doc = script.main(["--quick", "--model", MODEL, "--gguf-file", "", "--settings", "fp16", "int4-g32",
                       "--modes", "chunked", "--memory-settings", "int4-g32", "--out", str(tmp_path)])
    assert torch.is_grad_enabled()  # autograd off for the script's call only (it leaked into later tests)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["time"]["chunked"]["check"] == doc["time"]["chunked"]["check"]
    timing = saved["time"]["chunked"]["timing"]
    assert set(timing) == {"DynamicCache", "fp16", "int4-g32"}
    assert all(len(t["seconds"]["wall"]) == 2 and t["wall_ratio"]["median"] > 0 for t in timing.values())
    assert all(0 < t["update_share"]["median"] < 1 for t in timing.values())
    assert saved["time"]["chunked"]["check"]["fp16"]["bit_exact"]
    assert not saved["time"]["chunked"]["check"]["int4-g32"]["bit_exact"]
    memory = saved["memory"]
    assert [(r["setting"], r["length"]) for r in memory] == [("int4-g32", n) for n in (64, 128, 256)]
    stored = [r["stored_bytes"] for r in memory]
    assert stored[1] == 2 * stored[0] and stored[2] == 2 * stored[1]  # whole 32-token units, all quantized
    assert all(r["peak_growth_bytes"] >= 0 and r["baseline_bytes"] > 0 for r in memory)
    report = (tmp_path / "report.md").read_text()
    assert "/ DynamicCache" in report and "peak growth MB at 256" in report
