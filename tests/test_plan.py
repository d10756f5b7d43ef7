"""The capacity planner: known figures, and agreement with what real caches store."""

import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import kvquant
from kvquant.plan import main
from kvquant.planner.shapes import KNOWN_MODELS, ModelShape, Planner, parse_bytes, parse_setting, shape_from_config
from kvquant.paths import resolve
from slow_cases import slow_where

GiB = 2**30


def plan_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama_2_70b_fp16_32k(capsys):
    out = plan_json(capsys, "--model", "llama-2-70b", "--context", "32768", "--batch", "1", "--cache", "fp16")
    assert out["kv_bytes"] == 10_737_418_240


def test_known_per_token_figures():
    gqa = ModelShape("gqa", [None] * 32, 8, 128, 7e9)
    fp16 = Planner(gqa, parse_setting("fp16"))
    assert fp16.kv_bytes(1, 1) == 131_072
    assert fp16.kv_bytes(1, 8192) == GiB
    mha = ModelShape("mha", [None] * 32, 32, 128, 7e9)
    assert Planner(mha, parse_setting("fp16")).kv_bytes(1, 32768) == 16 * GiB


def test_shared_prefix_saving(capsys):
    # 32 requests sharing an 8,192-token prefix at 128 KiB per token (Llama-3.1-8B in fp16)
    out = plan_json(capsys, "--model", "llama-3.1-8b", "--context", "8192", "--batch", "32", "--cache", "fp16",
                    "--shared-prefix", "8192")
    assert out["settings"][0]["shared_prefix_saving_bytes"] == 33_285_996_544 == 31 * GiB


def test_budget_answers_are_consistent(capsys):
    out = plan_json(capsys, "--model", "llama-3.1-8b", "--context", "32768", "--gpu-memory", "80GB")
    avail = out["available_for_kv_bytes"]
    shape = KNOWN_MODELS["llama-3.1-8b"]
    for row in out["settings"]:
        planner = Planner(shape, row["settings"])
        b, c = row["max_batch_at_context"], row["max_context_at_batch"]
        assert planner.kv_bytes(b, 32768) <= avail < planner.kv_bytes(b + 1, 32768)
        assert planner.kv_bytes(1, c) <= avail < planner.kv_bytes(1, c + 1)
    gains = {r["cache"]: r["gain_over_fp16"] for r in out["settings"]}
    assert gains["fp16"] == 1 and gains["int2"] > gains["int4"] > gains["int8"] > 1.8


def test_sliding_window_layers_stop_growing():
    shape = KNOWN_MODELS["mistral-7b-v0.1"]  # every layer slides over 4096 tokens
    planner = Planner(shape, parse_setting("fp16"))
    assert planner.kv_bytes(1, 100_000) == planner.kv_bytes(1, 10_000) == 32 * 8 * 128 * 2 * 2 * 4095


def real_caches():
    d = resolve("local:models/stories260K/hf")
    yield "stories260K", AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)
    for cls, extra in [("LlamaConfig", dict(num_key_value_heads=2)), ("Qwen2Config", dict(num_key_value_heads=1)),
                       ("MistralConfig", dict(num_key_value_heads=2, sliding_window=40)),
                       ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, sliding_window=40)),
                       ("GPTNeoXConfig", dict())]:
        torch.manual_seed(0)
        yield cls, AutoModelForCausalLM.from_config(getattr(transformers, cls)(**common, **extra))


@pytest.mark.parametrize("setting", slow_where(["fp32", "fp8_e4m3", "int8:group_size=32", "int4",
                                                 "int4:residual_length=16,sink_tokens=4", "int2:group_size=8",
                                                 "int4:group_size=32,pre_rope=true"],
                                                lambda setting: setting in ("fp32", "fp8_e4m3", "int8:group_size=32")))
def test_plan_equals_memory_report_of_a_filled_cache(setting):
    for name, model in real_caches():
        if "pre_rope" in setting and name == "GPTNeoXConfig":  # partial rotary: refused by make_cache
            continue
        shape = shape_from_config(model.config, name)
        settings = parse_setting(setting)
        planner = Planner(shape, settings, torch.float32)
        ids = torch.randint(0, 64, (2, 120), generator=torch.Generator().manual_seed(0))
        cache = kvquant.make_cache(model, **settings)
        with torch.no_grad():
            model(ids[:, :100], cache=cache, use_cache=True)  # a prompt, then token-by-token decoding
            for i in range(100, 120):
                model(ids[:, i : i + 1], cache=cache, use_cache=True)
        real = cache.memory_report()["total_bytes"]
        planned = planner.kv_bytes(2, 120)
        if not any(isinstance(w, int) for w in shape.layout):
            assert planned == real, name
        else:  # a sliding layer trims whole groups: within one group of tokens per layer
            unit = max(codec.tokens_per_unit for codec in cache.quantizer.codecs(shape.head_dim))
            per_token = Planner(shape, parse_setting("fp32"), torch.float32).kv_bytes(2, 1)
            assert abs(planned - real) <= unit * per_token, name


def test_config_without_kv_heads_or_head_dim(tmp_path, capsys):
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
           "intermediate_size": 128, "vocab_size": 100}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = plan_json(capsys, "--model", str(path), "--context", "10", "--cache", "fp16")
    assert (out["kv_heads"], out["head_dim"]) == (4, 16)  # MHA, hidden / heads
    assert out["kv_bytes"] == 2 * 2 * 4 * 16 * 2 * 10


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model", "--context", "10"], "unknown model"),
    (["--model", "llama-2-7b", "--context", "-5"], "--context must be"),
    (["--model", "llama-2-7b", "--context", "10", "--batch", "0"], "--batch must be"),
    (["--model", "llama-2-70b", "--context", "10", "--gpu-memory", "80GB"], "does not cover the weights"),
    (["--model", "llama-2-7b", "--context", "10", "--gpu-memory", "lots"], "cannot read 'lots'"),
    (["--model", "llama-2-7b", "--context", "10", "--cache", "int3"], "unknown cache setting"),
    (["--model", "llama-2-7b", "--context", "10", "--cache", "int4:group_size=3"], "group_size 3 does not divide"),
    (["--model", "llama-3.1-8b", "--context", "10", "--tensor-parallel", "3"], "not divide the 32 attention"),
    (["--model", "llama-3.1-8b", "--context", "10", "--tensor-parallel", "0"], "--tensor-parallel must be"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("80GiB") == 80 * GiB and parse_bytes("1024") == 1024


def test_human_output(capsys):
    assert main(["--model", "llama-3.1-8b", "--context", "32768", "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "GiB = 2^30 B, GB = 10^9 B" in out and "max batch @context" in out and "int4" in out


def test_a_long_cache_mapping_is_numbered_and_spelled_under_the_table(capsys):
    mapping = "{quantizer: int4, group_size: 32, residual_length: 0, layers: {0-3: {quantizer: int8}}}"
    assert main(["--model", "llama-3.1-8b", "--context", "1024", "--cache", mapping, "--cache", "int4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith(("[1]  ", "int4  "))]
    assert len(rows) == 2 and all(len(line) < 100 for line in rows)
    assert f"[1] {mapping}" in lines


@pytest.mark.parametrize("ranks, heads_per_gpu", [(2, 4), (8, 1), (16, 1)])
def test_tensor_parallel_answers_per_gpu(capsys, ranks, heads_per_gpu):
    """Llama-3.1-8B (8 KV heads, 128 KiB per token in fp16) over N GPUs as vLLM splits it: 8/N heads per GPU, or one
    head replicated when N > 8; the weights split N ways; every per-GPU figure from that GPU's share."""
    whole = plan_json(capsys, "--model", "llama-3.1-8b", "--context", "32768", "--cache", "fp16", "--cache", "int4")
    out = plan_json(capsys, "--model", "llama-3.1-8b", "--context", "32768", "--cache", "fp16", "--cache", "int4",
                    "--tensor-parallel", str(ranks))
    assert (out["tensor_parallel"], out["kv_heads"], out["kv_heads_per_gpu"]) == (ranks, 8, heads_per_gpu)
    for mine, all_ in zip(out["settings"], whole["settings"]):
        assert mine["kv_bytes"] * 8 == all_["kv_bytes"] * heads_per_gpu
    assert out["settings"][0]["kv_bytes"] == heads_per_gpu * 32 * 128 * 2 * 2 * 32768
    assert out["weights_bytes"] == pytest.approx(whole["weights_bytes"] / ranks, rel=1e-9)


def test_tensor_parallel_budget_is_one_gpus(capsys):
    """--gpu-memory is one GPU's and holds that GPU's half of the weights (a small budget keeps the search short)."""
    out = plan_json(capsys, "--model", "llama-3.1-8b", "--context", "4096", "--cache", "fp16", "--gpu-memory",
                    "9.5GB", "--tensor-parallel", "2")
    assert out["available_for_kv_bytes"] == 9_500_000_000 - out["weights_bytes"] - 950_000_000
    fits = out["settings"][0]["max_context_at_batch"]
    assert fits * 4 * 32 * 128 * 2 * 2 <= out["available_for_kv_bytes"] < (fits + 1) * 4 * 32 * 128 * 2 * 2
