"""experiments/gpu_check.py's decode speed check and issue 57's targets, the parts a CPU can run: the ratio table and
the MET / NOT MET verdicts over fabricated rows (every ratio worked out here by hand), the order of the points, and
the measurement itself on a tiny model (caches filled to the context, decoded through, bytes and rates recorded)."""

import pytest
import torch
import transformers

import kvquant
from tests.conftest import experiment


@pytest.fixture(scope="module")
def speed():
    return experiment("gpu_speed")


def rows_at(context, batch, **steps_per_s):
    """Fabricated rows: one per cache (``kvquant_int4_fused=21`` is ``kvquant-int4-fused``)."""
    names = {"DynamicCache_no_cudnn": "DynamicCache-no-cudnn", "kvquant_fp8_e4m3": "kvquant-fp8_e4m3",
             "kvquant_fp8_e4m3_fused": "kvquant-fp8_e4m3-fused"}
    return [{"cache": names.get(k, k.replace("_", "-")), "context": context, "batch": batch, "steps_per_s": v,
             "allocated_bytes": 1, "reported_bytes": 1} for k, v in steps_per_s.items()]


TARGET_ROWS = rows_at(16384, 16, DynamicCache=10.0, DynamicCache_no_cudnn=20.0, kvquant_fp16=15.0,
                      kvquant_fp16_fused=12.0, kvquant_int4=14.0, kvquant_int4_fused=21.0, kvquant_fp8_e4m3=16.0,
                      kvquant_fp8_e4m3_fused=17.0)


def test_targets_take_the_fastest_candidate_over_the_fastest_baseline(speed):
    lines = speed.target_verdicts(TARGET_ROWS)
    # int4: 21 (fused) / 15 (fp16 eager) = 1.40 >= 1.3; 21 / 20 (DynamicCache without cuDNN) = 1.05 >= 1.0;
    # fp8: 17 (fused) / 15 = 1.133 >= 1.1. Tokens/s: steps/s x batch 16.
    assert lines == [
        "MET target int4 g32 / kvquant fp16 >= 1.3x at 16384 tokens x batch 16: 1.40x (kvquant-int4-fused 336.0 "
        "tokens/s, kvquant-fp16 240.0; each side the faster of kvquant-int4, kvquant-int4-fused and of kvquant-fp16, "
        "kvquant-fp16-fused)",
        "MET target int4 g32 / DynamicCache >= 1.0x at 16384 tokens x batch 16: 1.05x (kvquant-int4-fused 336.0 "
        "tokens/s, DynamicCache-no-cudnn 320.0; each side the faster of kvquant-int4, kvquant-int4-fused and of "
        "DynamicCache, DynamicCache-no-cudnn)",
        "MET target fp8 e4m3 / kvquant fp16 >= 1.1x at 16384 tokens x batch 16: 1.13x (kvquant-fp8_e4m3-fused 272.0 "
        "tokens/s, kvquant-fp16 240.0; each side the faster of kvquant-fp8_e4m3, kvquant-fp8_e4m3-fused and of "
        "kvquant-fp16, kvquant-fp16-fused)"]


def test_targets_not_met_below_their_ratio_and_not_measured_without_a_row(speed):
    slower = [dict(r, steps_per_s=19.0) if r["cache"] == "kvquant-int4-fused" else r for r in TARGET_ROWS]
    slower = [r for r in slower if r["cache"] != "kvquant-fp8_e4m3-fused"]
    lines = speed.target_verdicts(slower)
    assert [line.split(" target")[0] for line in lines] == ["NOT MET"] * 3
    assert ": 1.27x (kvquant-int4-fused 304.0 tokens/s, kvquant-fp16 240.0" in lines[0]  # 19 / 15
    assert ": 0.95x (kvquant-int4-fused 304.0 tokens/s, DynamicCache-no-cudnn 320.0" in lines[1]  # 19 / 20
    assert ": 1.07x (kvquant-fp8_e4m3 256.0 tokens/s, kvquant-fp16 240.0" in lines[2]  # 16 / 15 < 1.1, the eager row
    # a failed row counts as unmeasured; with no fp16 row at all the kvquant-fp16 targets cannot be judged
    failed = [dict(r, error="Traceback\nRuntimeError: boom") if r["cache"].startswith("kvquant-fp16") else r
              for r in TARGET_ROWS]
    for r in failed:
        if "error" in r:
            del r["steps_per_s"]
    assert [line.split(" target")[0] for line in speed.target_verdicts(failed)] == ["NOT MEASURED", "MET",
                                                                                      "NOT MEASURED"]


def test_the_ratio_table_has_every_point_ascending_with_each_targets_ratio(speed):
    rows = TARGET_ROWS + rows_at(4096, 1, DynamicCache=50.0, kvquant_fp16=40.0, kvquant_int4_fused=60.0)
    table = speed.ratio_table(rows)
    assert [(p["context"], p["batch"]) for p in table] == [(4096, 1), (16384, 16)]
    small = table[0]["ratios"]
    assert small["int4 g32 / kvquant fp16"]["ratio"] == pytest.approx(60 / 40)
    assert small["int4 g32 / DynamicCache"]["ratio"] == pytest.approx(60 / 50)
    assert small["int4 g32 / DynamicCache"]["candidate_tokens_per_s"] == 60.0  # batch 1
    assert small["fp8 e4m3 / kvquant fp16"] is None  # no fp8 row there
    big = table[1]["ratios"]
    assert big["int4 g32 / kvquant fp16"] == {"ratio": pytest.approx(21 / 15), "candidate": "kvquant-int4-fused",
                                              "baseline": "kvquant-fp16", "candidate_tokens_per_s": 21 * 16,
                                              "baseline_tokens_per_s": 15 * 16}
    markdown = "\n".join(speed.speed_markdown(rows, 32, 4))
    assert "| 4096 | 1 | 1.50x (int4-fused) | 1.20x (int4-fused) |  |" in markdown
    assert "| 16384 | 16 | 1.40x (int4-fused) | 1.05x (int4-fused) | 1.13x (fp8_e4m3-fused) |" in markdown


def test_the_targets_point_is_measured_first(speed):
    assert speed.speed_points() == [(16384, 16), (4096, 1), (4096, 16), (16384, 1), (32768, 1), (32768, 16)]
    assert speed.speed_points((2048, 512), (3, 1)) == [(512, 1), (512, 3), (2048, 1), (2048, 3)]


CONFIG = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_the_speed_check_decodes_each_cache_filled_to_its_context(speed):
    """On the CPU with a tiny model: every target cache filled to the context and decoded 4 + ``steps`` tokens
    through the model (the caches' lengths show it), DynamicCache's bytes those of its K/V, kvquant's report equal to
    its tensors, tokens/s batch x steps/s, the ratios against the rows they name; a stop at the time limit."""
    models = experiment("gpu_models")
    model = models.build(transformers.LlamaForCausalLM, CONFIG, "cpu", torch.bfloat16)
    fused = models.build(transformers.LlamaForCausalLM, CONFIG, "cpu", torch.bfloat16)
    kvquant.enable_fused_decode(fused)
    factories = speed.speed_factories(model, fused, CONFIG, models.QUANTIZERS, models.FUSED, speed.TARGET_CACHES)
    assert sorted(factories) == sorted(speed.TARGET_CACHES)
    made = []

    def keep(make):
        return lambda: made.append(make()) or made[-1]

    factories = {k: (runner, keep(make), backends) for k, (runner, make, backends) in factories.items()}
    clock = iter(range(100))
    done = speed.check_speed(factories, CONFIG, [(70, 2), (40, 1)], steps=3, device="cpu",
                             allocated=lambda: 1000 * next(clock), in_time=lambda: len(made) == 0)
    rows = done["rows"]
    assert done["stopped"] == "time limit, before 40 x 1"
    assert [r["cache"] for r in rows] == list(factories) and all("error" not in r for r in rows)
    assert [c.get_seq_length() for c in made] == [70 + 4 + 3] * len(factories)
    by = {r["cache"]: r for r in rows}
    assert by["DynamicCache"]["reported_bytes"] == 2 * 2 * 2 * 2 * 2 * 70 * 16  # K+V, bf16, layers, batch, heads
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(2 * r["steps_per_s"]) and r["allocated_bytes"] == 1000
        assert r["speed_vs_kvquant_fp16"] == pytest.approx(r["steps_per_s"] / by["kvquant-fp16"]["steps_per_s"])
        assert r["speed_vs_dynamic"] == pytest.approx(r["steps_per_s"] / by["DynamicCache"]["steps_per_s"])
        if r["cache"].startswith("kvquant-"):
            assert r["tensor_bytes"] == r["held_bytes"] > 0
    # fp8 stores a byte per element and its scales; int4 keeps these 70 tokens in its 128-token residual window
    assert by["kvquant-fp8_e4m3"]["reported_bytes"] < by["kvquant-int4"]["reported_bytes"] == by["kvquant-fp16"][
        "reported_bytes"] == by["DynamicCache"]["reported_bytes"]
