"""``python -m kvquant.plan``'s input: sizes and memory on the command line, vLLM's tensor-parallel rules, model
shapes given by hand that are out of bounds or inconsistent, cache settings it cannot plan. Each refusal is one line
and exit 2 naming the value and its bound (run in-process through ``kvquant.plan.main(argv)``). No input makes a
plan's work grow with its sizes: what goes through the cache code (``KVQuantLayer.update``: calls and tokens, and on
which device) is counted, not timed (the timings are in reports/planner_speed); the fused CPU kernel is never
built."""

import dataclasses
import json
import re

import pytest
import torch

import kvquant.formats.kernels
from kvquant import plan
from kvquant.cache.layer import KVQuantLayer
from kvquant.formats import ops
from kvquant.formats.quantizers import available_quantizers
from refusals import error_line, fill, snapshot

pytestmark = pytest.mark.usefixtures("one_torch_thread")


LLAMA_ARGS = ["--model", "llama-3.1-8b", "--context", "1024"]

PLAN_CASES = [
    ("reserve-negative", [*LLAMA_ARGS, "--gpu-memory", "80GB", "--reserve=-50%"], "--reserve: '-50%'"),
    ("reserve-100", [*LLAMA_ARGS, "--gpu-memory", "80GB", "--reserve", "100%"], "--reserve: '100%'"),
    ("reserve-text", [*LLAMA_ARGS, "--gpu-memory", "80GB", "--reserve", "abc%"], "--reserve: 'abc%'"),
    ("reserve-as-flag", [*LLAMA_ARGS, "--gpu-memory", "80GB", "--reserve", "-50%"], "--reserve"),
    ("gpu-memory-two-dots", [*LLAMA_ARGS, "--gpu-memory", "1.2.3GB"], "--gpu-memory: cannot read '1.2.3GB'"),
    ("gpu-memory-negative", [*LLAMA_ARGS, "--gpu-memory=-5GB"], "--gpu-memory: cannot read '-5GB'"),
    ("gpu-memory-unit", [*LLAMA_ARGS, "--gpu-memory", "80GBs"], "cannot read '80GBs'"),
    ("gpu-memory-too-small", [*LLAMA_ARGS, "--gpu-memory", "1GB"], "does not cover the weights"),
    ("weights-text", [*LLAMA_ARGS, "--gpu-memory", "80GB", "--weights", "heavy"], "--weights: cannot read 'heavy'"),
    ("context-text", ["--model", "llama-3.1-8b", "--context", "long"], "--context: invalid int value: 'long'"),
    ("context-zero", ["--model", "llama-3.1-8b", "--context", "0"], "--context must be between 1"),
    ("batch-zero", [*LLAMA_ARGS, "--batch", "0"], "--batch must be between 1"),
    ("shared-prefix-negative", [*LLAMA_ARGS, "--shared-prefix", "-1"], "--shared-prefix must be between 0"),
    ("cache-typo", [*LLAMA_ARGS, "--cache", "int3"], "unknown cache setting 'int3'"),
    ("cache-option-text", [*LLAMA_ARGS, "--cache", "int4:group_size=abc"], "group_size"),
    ("cache-option-float", [*LLAMA_ARGS, "--cache", "int4:key_bits=4.0"], "key_bits"),
    ("cache-option-misfit", [*LLAMA_ARGS, "--cache", "int4:group_size=3"], "group_size 3"),
    ("cache-option-unknown", [*LLAMA_ARGS, "--cache", "int4:gruop_size=3"], "'gruop_size'"),
    ("cache-option-no-value", [*LLAMA_ARGS, "--cache", "int4:group_size"], "options are key=value"),
    ("cache-fp16-options", [*LLAMA_ARGS, "--cache", "fp16:group_size=32"], "fp16 takes no options"),
    ("cache-residual-negative", [*LLAMA_ARGS, "--cache", "int4:residual_length=-1"], "residual_length"),
    ("cache-pre-rope-number", [*LLAMA_ARGS, "--cache", "int4:pre_rope=5"], "pre_rope must be true or false"),
    ("cache-pre-rope-eviction", [*LLAMA_ARGS, "--cache", "int4:pre_rope=true,eviction=sink_window,window=64,"
                                 "sink_tokens=4,residual_length=0"], "pre_rope is not supported with an eviction"),
    ("dtype-choice", [*LLAMA_ARGS, "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    ("model-unknown", ["--model", "no-such-model", "--context", "10"], "unknown model 'no-such-model'"),
    ("model-json-list", ["--model", "{files}/list_config.json", "--context", "10"], "list_config.json"),
    ("model-json-binary", ["--model", "{files}/binary_config.json", "--context", "10"], "binary_config.json"),
    ("model-no-heads", ["--model", "{files}/no_heads.json", "--context", "10"], "num_attention_heads"),
    ("model-zero-heads", ["--model", "{files}/zero_heads.json", "--context", "10"], "zero_heads.json"),
]


@pytest.mark.parametrize("argv, needle", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_planner_refuses(refusal_env, capsys, argv, needle):
    before = snapshot(refusal_env["finished"])
    code = plan.main(fill(argv, refusal_env))
    captured = capsys.readouterr()
    error_line(code, captured.err, needle, out=captured.out)
    assert snapshot(refusal_env["finished"]) == before


LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_size": 64, "intermediate_size": 128, "vocab_size": 100}

MISTRAL = {**LLAMA, "model_type": "mistral", "sliding_window": 40}


def assert_refused(capsys, argv: list[str], needle: str) -> str:
    """The planner refuses ``argv`` with one line holding ``needle`` and prints nothing else; returns the line."""
    code = plan.main(argv)
    captured = capsys.readouterr()
    line = error_line(code, captured.err, needle)
    assert not captured.out, captured.out
    return line


# --tensor-parallel: vLLM refuses a size that does not divide the attention heads (ModelConfig.
# verify_with_parallel_config), and KV heads and size must divide one another (QKVParallelLinear)
TP_CASES = [
    ("llama-64-over-32-heads", "llama-3.1-8b", "64", "--tensor-parallel 64 does not divide the 32 attention heads"),
    ("llama-1e9", "llama-3.1-8b", "1000000000", "--tensor-parallel 1000000000 does not divide the 32 attention"),
    ("gemma-32-over-16-heads", "gemma-2-9b", "32", "--tensor-parallel 32 does not divide the 16 attention heads"),
    ("qwen-56-over-28-heads", "qwen2.5-7b", "56", "does not divide the 28 attention heads of qwen2.5-7b"),
    ("llama-2-70b-128", "llama-2-70b", "128", "--tensor-parallel 128 does not divide the 64 attention heads"),
]


@pytest.mark.parametrize("model, ranks, needle", [c[1:] for c in TP_CASES], ids=[c[0] for c in TP_CASES])
def test_tensor_parallel_must_divide_the_attention_heads(capsys, model, ranks, needle):
    assert_refused(capsys, ["--model", model, "--context", "10", "--cache", "fp16", "--tensor-parallel", ranks],
                   needle)


def test_tensor_parallel_from_a_config_divides_its_heads(tmp_path, capsys):
    """12 heads, 4 KV heads: 24 GPUs would each hold half a head (refused); 6 split neither count of KV heads
    (refused by the KV rule); 12 holds one head each, each KV head replicated on 3 GPUs."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA, "num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 96}))
    base = ["--model", str(config), "--context", "100", "--cache", "fp16"]
    assert_refused(capsys, [*base, "--tensor-parallel", "24"], "does not divide the 12 attention heads")
    assert_refused(capsys, [*base, "--tensor-parallel", "6"],
                   "does not split 4 KV heads: one must divide the other (vLLM's rule); use one of 1, 2, 4, 12")
    assert plan.main([*base, "--tensor-parallel", "12"]) == 0
    out = capsys.readouterr().out
    assert "per GPU of 12 (tensor parallel): 1 KV head each, each head replicated on 3 GPUs" in out
    # 2 layers x 1 head x head_dim 8 x keys and values x 2 bytes x 100 tokens
    assert re.search(rf"\nfp16 +{2 * 1 * 8 * 2 * 2 * 100:,} ", out), out


# model shapes given by hand: a config file (or a directory holding one) with a size out of bounds or inconsistent
CONFIG_CASES = [
    ("layers-1e8", {"num_hidden_layers": 100_000_000},
     "num_hidden_layers must be an integer <= 1024, got int 100000000"),
    ("layers-1025", {"num_hidden_layers": 1025}, "num_hidden_layers must be an integer <= 1024"),
    ("vocab-negative", {"vocab_size": -10**15}, "vocab_size must be an integer >= 1, got int -1000000000000000"),
    ("vocab-1e9", {"vocab_size": 10**9}, "vocab_size must be an integer <= 2097152"),
    ("kv-heads-over-heads", {"num_key_value_heads": 8}, "num_key_value_heads 8 does not divide num_attention_heads 4"),
    ("kv-heads-not-dividing", {"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads"),
    ("heads-4096", {"num_attention_heads": 4096, "num_key_value_heads": 4096, "hidden_size": 4096},
     "num_attention_heads must be an integer <= 1024"),
    ("head-dim-1e6", {"head_dim": 10**6}, "head_dim must be an integer <= 4096"),
    ("hidden-1e7", {"hidden_size": 10**7}, "hidden_size must be an integer <= 262144"),
    ("hidden-not-split-by-heads", {"hidden_size": 66}, "hidden_size 66 is not a multiple of num_attention_heads 4"),
    ("intermediate-negative", {"intermediate_size": -1}, "intermediate_size must be an integer >= 1"),
    ("experts-zero", {"num_local_experts": 0}, "num_local_experts must be an integer >= 1"),
    ("window-zero", {**MISTRAL, "sliding_window": 0}, "sliding_window must be an integer >= 1, got int 0"),
    ("window-negative", {**MISTRAL, "sliding_window": -5}, "sliding_window must be an integer >= 1, got int -5"),
    ("window-2e9", {**MISTRAL, "sliding_window": 2**31}, "sliding_window must be an integer <= 1073741824"),
]


@pytest.mark.parametrize("where", ["file", "directory"])
@pytest.mark.parametrize("override, needle", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_config_sizes_are_bounded_and_consistent(tmp_path, capsys, where, override, needle):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, **override}))
    model = folder / "config.json" if where == "file" else folder
    assert_refused(capsys, ["--model", str(model), "--context", "10", "--cache", "fp16"], needle)


def test_a_window_transformers_reads_from_layer_types_is_bounded_too():
    """Windows reach the planner through transformers' layer types as well: the shape's own check (the API path,
    no file) refuses a non-positive one."""
    from transformers import MistralConfig

    from kvquant.errors import KVQuantError
    from kvquant.planner.shapes import shape_from_config

    config = MistralConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"}, sliding_window=8)
    config.sliding_window = 0  # set after construction, as a hub config could arrive
    with pytest.raises(KVQuantError, match="sliding_window must be an integer >= 1, got int 0"):
        shape_from_config(config, "m")


# sizes on the command line
SIZE_CASES = [
    ("gpu-memory-400-digits", ["--gpu-memory", "9" * 400 + "GB"], "--gpu-memory: '999"),
    ("gpu-memory-2-PiB", ["--gpu-memory", str(2**51)],
     "over the largest size the planner takes, 1,125,899,906,842,624"),
    ("weights-1e8-TB", ["--weights", "100000000TB"], "--weights: '100000000TB' is over the largest size"),
    ("cache-17-times", ["--cache", "fp16"] * 17, "--cache is given 17 times, over the 16 one plan takes"),
    ("sinks-65537", ["--cache", "int4:sink_tokens=65537"], "sink_tokens must be <= 65,536 for the planner"),
    ("token-group-1e6", ["--cache", "int4:key_group_size=1000000"], "units span 1,000,000 tokens"),
    ("token-groups-lcm", ["--cache", "{quantizer: int4, value_axis: channel, key_group_size: 1024, "
                                     "value_group_size: 1023}"], "units span 1,047,552 tokens"),
    # each kind of layer is no longer written on its own: an importance policy's window is still checked for each
    ("importance-window", ["--cache", "{quantizer: int4, eviction: key_norm, window: 200, budget: 50, "
                                      "layers: {0: {residual_length: 190}}}"],
     "eviction 'key_norm': window 200 must cover residual_length 190 plus a quantized unit (32 tokens) - 1 = 221"),
    ("layer-kinds-25", ["--cache", "{quantizer: int4, layers: {%s}}" % ", ".join(
        f"{i}: {{key_group_size: {i + 1}}}" for i in range(24))], "25 kinds of layer"),
]


@pytest.mark.parametrize("extra, needle", [c[1:] for c in SIZE_CASES], ids=[c[0] for c in SIZE_CASES])
def test_sizes_on_the_command_line_are_bounded(capsys, extra, needle):
    assert_refused(capsys, ["--model", "llama-2-7b", "--context", "10", *extra], needle)


def test_layer_kinds_are_counted_over_all_settings(capsys):
    """24 kinds in all: two settings of 13 kinds each are refused at the second."""
    def kinds(start):
        return "{quantizer: int4, layers: {%s}}" % ", ".join(f"{i}: {{key_group_size: {start + i}}}" for i in range(12))

    assert_refused(capsys, ["--model", "llama-2-7b", "--context", "10", "--cache", kinds(1), "--cache", kinds(100)],
                   "13 kinds of layer (quantizer and options, window, sinks) in this setting, over the 11 left of "
                   "the 24")


# no input makes a plan's work grow with its sizes: what goes through the cache code is counted
MAX_UPDATES = 2 * (24 + 2)  # per kind of layer (24 in all, +2 for the fp16 reference): a probe and a simulation

MAX_TOKENS_PER_UPDATE = 2 * 65_536  # a simulation (<= VERIFY_TOKENS) or a probe (sinks <= 65,536, + residual, units)


@pytest.fixture
def updates(monkeypatch):
    """Tokens of every ``KVQuantLayer.update`` call; too many calls or tokens stop the plan at once (the planner
    before issue 36 wrote up to 2^30 tokens per call, some 60 calls per setting)."""
    calls = []
    original = KVQuantLayer.update

    def counting(self, key_states, value_states, *args, **kwargs):
        calls.append(key_states.shape[2])
        assert len(calls) <= MAX_UPDATES and calls[-1] <= MAX_TOKENS_PER_UPDATE, (len(calls), calls[-1])
        return original(self, key_states, value_states, *args, **kwargs)

    monkeypatch.setattr(KVQuantLayer, "update", counting)
    return calls


def at_the_bounds(tmp_path) -> str:
    """A config at every maximum: 1,024 layers alternating 2^30-token sliding windows and full attention, 1,024
    heads and KV heads of 4,096 channels, hidden 262,144, MLP 1,048,576, vocabulary 2,097,152."""
    config = {"model_type": "gemma2", "num_hidden_layers": 1024, "num_attention_heads": 1024,
              "num_key_value_heads": 1024, "head_dim": 4096, "hidden_size": 262_144, "intermediate_size": 1 << 20,
              "vocab_size": 1 << 21, "sliding_window": 1 << 30, "max_position_embeddings": 1 << 30}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


MIXED = ("{quantizer: int4, layers: {0-3: {quantizer: int8}, 4: {quantizer: int2, group_size: 64}, "
         "31: {quantizer: fp16}}}")

EXTREME = [
    ("tp8-80GB", ["--model", "llama-3.1-8b", "--context", "32768", "--gpu-memory", "80GB", "--tensor-parallel", "8"]),
    ("tp32-1PiB", ["--model", "llama-3.1-8b", "--context", str(2**30), "--batch", "1000000", "--gpu-memory",
                   str(2**50), "--tensor-parallel", "32"]),
    ("sliding-only-prefix", ["--model", "mistral-7b-v0.1", "--context", "1000000", "--gpu-memory", "80GB",
                             "--shared-prefix", "500000", "--batch", "7"]),
    ("config-at-the-bounds", ["--model", "{bounds}", "--context", str(2**30), "--weights", "1GB", "--gpu-memory",
                              str(2**50), "--cache", "fp16", "--cache", "int2"]),
    ("gemma-24-kinds", ["--model", "gemma-2-9b", "--context", "32768", "--gpu-memory", "80GB", "--shared-prefix",
                        "8192", *[a for q in ("fp16", "bf16", "fp32", "int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2",
                                              "int4:group_size=128", "int4:residual_length=0", "int2:group_size=64",
                                              "int8:key_group_size=64") for a in ("--cache", q)]]),
    ("sixteen-settings", ["--model", "llama-3.1-8b", "--context", "32768", "--batch", "64", "--gpu-memory", "141GB",
                          "--shared-prefix", "16384", "--cache", "int4:sink_tokens=65536", "--cache", MIXED,
                          "--cache", "int4:eviction=key_norm,window=1000000,budget=1000000",
                          "--cache", "int4:eviction=sink_window,sink_tokens=4,window=100000",
                          "--cache", "int8:key_group_size=128,value_group_size=64,residual_length=0",
                          "--cache", "fp8_e4m3:granularity=tensor", "--cache", "int4:rotation=hadamard",
                          *[a for q in ("fp16", "bf16", "fp32", "int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2",
                                        "int4:group_size=128") for a in ("--cache", q)]]),
]


@pytest.mark.parametrize("argv", [c[1] for c in EXTREME], ids=[c[0] for c in EXTREME])
def test_extreme_valid_inputs_do_bounded_work(tmp_path, capsys, updates, argv):
    code = plan.main([a.replace("{bounds}", at_the_bounds(tmp_path)) if a == "{bounds}" else a for a in argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    assert updates and len(updates) <= MAX_UPDATES and max(updates) <= MAX_TOKENS_PER_UPDATE
    assert "max context @batch" in captured.out


def kinds_map(entry, count: int = 23, base: str = "quantizer: int4") -> str:
    """A ``layers`` map of ``count`` one-layer entries, ``entry(i)`` the options of layer ``i``."""
    return "{%s, layers: {%s}}" % (base, ", ".join(f"{i}: {{{entry(i)}}}" for i in range(count)))


#: the options a quantizer needs, beside its name in a layers entry
REQUIRED = {"keys_values": ", keys: {quantizer: int8}, values: {quantizer: fp8_e4m3}"}


def every_quantizer() -> str:
    """int4, and each other registered quantizer on one layer."""
    others = [name for name in available_quantizers() if name != "int4"]
    return kinds_map(lambda i: f"quantizer: {others[i]}{REQUIRED.get(others[i], '')}", count=len(others))


# 24 kinds of layer: 23 full-precision windows besides the default, or 23 rotation seeds besides 0 (the same bytes);
# every registered quantizer
MANY_KINDS = {
    "windows": lambda: kinds_map(lambda i: f"residual_length: {i + 1}"),
    "rotation-seeds": lambda: kinds_map(lambda i: f"rotation_seed: {i + 1}",
                                        base="quantizer: int4, rotation: hadamard"),
    "quantizers": every_quantizer,
}


@pytest.mark.parametrize("kinds", MANY_KINDS)
def test_kinds_of_layer_share_their_quantizers_write(monkeypatch, kinds):
    """Each kind of layer was written through the cache code on meta tensors twice (to read its costs, and to
    check the answer): about 2 s a kind on a loaded machine, 50 s for 23 kinds. A layer's units cost what its
    quantizer stores whatever its windows, sinks, eviction or rotation seed, so each quantizer is written once (on
    zeros on the CPU at these shapes: Python meta kernels run ~50 times slower, and the first imports
    torch._dynamo), and the answer is checked by one write per kind that stores different bytes."""
    from kvquant.planner.shapes import KNOWN_MODELS, Planner, parse_setting

    writes = []
    original = KVQuantLayer.update

    def counting(self, key_states, value_states, *args, **kwargs):
        writes.append((self.quantizer, self.residual_length, key_states.device.type))
        return original(self, key_states, value_states, *args, **kwargs)

    monkeypatch.setattr(KVQuantLayer, "update", counting)
    text = MANY_KINDS[kinds]()  # every quantizer is registered by now
    settings = parse_setting(text)
    planner = Planner(KNOWN_MODELS["llama-3.1-8b"], settings, torch.float16)
    quantizers = {dataclasses.replace(q, rotation_seed=0) for q, _, _ in writes}
    names = {options.get("quantizer", settings["quantizer"]) for options in settings["layers"].values()}
    assert len(writes) == len(quantizers) == len(names | {settings["quantizer"]})
    probes = len(writes)
    planner.verify(planner.max_context(1, 55_940_000_000))
    stores = {(dataclasses.replace(q, rotation_seed=0), residual) for q, residual, _ in writes[probes:]}
    assert len(writes) - probes == len(stores) == (24 if "residual_length" in text else probes)
    assert {device for _, _, device in writes} == {"cpu"}


def test_an_iq4_nl_block_on_meta_tensors_takes_a_few_ops():
    """llama.cpp's IQ4_NL fits its scale by sums taken element by element (ggml's order: 5 ops per element of a block
    of 32). On meta tensors each op runs a Python kernel, so the planner's every write of it cost ~0.3 s (24 kinds
    of it: 12 s); shapes have no order to keep. Same shapes and dtypes as on real data."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvquant.formats.llamacpp import quantize_iq4_nl

    class Counting(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counting.ops += 1
            return func(*args, **(kwargs or {}))

    real = torch.randn(1, 8, 3, 4, 32)
    with Counting():
        shapes = quantize_iq4_nl(real.to("meta"))
    assert Counting.ops < 100
    for on_meta, on_cpu in zip(shapes, quantize_iq4_nl(real), strict=True):
        assert on_meta is on_cpu is None or (on_meta.shape, on_meta.dtype) == (on_cpu.shape, on_cpu.dtype)


def test_a_rotation_at_a_large_head_dim_is_refused_before_any_matrix_is_built(tmp_path, monkeypatch, capsys):
    """A rotation's head_dim x head_dim matrix is built for every layers entry and every layer written (and read
    whole at each write): at head_dim 4,096 a plan with a few rotation seeds ran for minutes. Up to 512 it is
    planned, its Hadamard block built once (a layers map of 64 seeds built 64 x 7 of them)."""
    import scipy.linalg

    built, hadamard = [], scipy.linalg.hadamard
    monkeypatch.setattr(scipy.linalg, "hadamard", lambda n: built.append(n) or hadamard(n))
    config = tmp_path / "config.json"
    for head_dim in (4096, 1024):
        config.write_text(json.dumps({**LLAMA, "head_dim": head_dim}))
        for setting in ("int4:rotation=hadamard", "{quantizer: int4, layers: {1: {rotation: hadamard}}}",
                        # rotated by the quantizer's default, or inside a keys/values mix (before: built, not refused)
                        "lloyd_max", "{quantizer: int4, layers: {1: {quantizer: normal_float}}}",
                        "{quantizer: keys_values, keys: {quantizer: int4, rotation: hadamard}, "
                        "values: {quantizer: int4}}",
                        "{quantizer: int4, layers: {0: {quantizer: keys_values, keys: {quantizer: int4}, "
                        "values: {quantizer: lloyd_max}}}}"):
            assert_refused(capsys, ["--model", str(config), "--context", "100", "--cache", setting],
                           f"rotation: the planner takes a Hadamard rotation up to head_dim 512, this model's is "
                           f"{head_dim:,}")
    assert not built
    for setting in ("{quantizer: lloyd_max, rotation: null}",  # no rotation: planned, nothing built
                    "{quantizer: lloyd_max, rotation: null, layers: {0: {key_bits: 3}}}",
                    "{quantizer: normal_float, rotation: null, layers: {1: {residual_length: 0}}}"):
        assert plan.main(["--model", str(config), "--context", "100", "--cache", setting, "--json"]) == 0, setting
    capsys.readouterr()
    assert not built
    ops._hadamard_block.cache_clear()
    config.write_text(json.dumps({**LLAMA, "num_hidden_layers": 64, "head_dim": 512}))
    seeds = kinds_map(lambda i: f"rotation_seed: {i + 1}", count=64, base="quantizer: int4, rotation: hadamard")
    assert plan.main(["--model", str(config), "--context", "100", "--cache", seeds, "--cache", "int4", "--json"]) == 0
    assert built == [512]
    rotated, int4 = json.loads(capsys.readouterr().out)["settings"]
    assert rotated["kv_bytes"] == int4["kv_bytes"] > 0  # a rotation stores what its quantizer does


@pytest.mark.parametrize("value", ["false", "False", "true", "TRUE"])
def test_a_key_value_cache_option_reads_booleans(capsys, value):
    """``llamacpp_q4_0:attn_rot=false`` was refused as "got 'false'": the key=value form read no booleans."""
    assert plan.main(["--model", "llama-3.1-8b", "--context", "64", "--cache", f"llamacpp_q4_0:attn_rot={value}"]) == 0
    assert "llamacpp_q4_0" in capsys.readouterr().out


def test_an_unknown_cache_setting_lists_each_valid_one_once():
    """The refusal listed fp16 twice (a full-precision name and the identity quantizer)."""
    from kvquant.errors import KVQuantError
    from kvquant.planner.shapes import parse_setting

    with pytest.raises(KVQuantError) as refused:
        parse_setting("int3")
    listed = str(refused.value).split("use one of ")[1].split(", ")
    assert listed.count("fp16") == 1 and len(listed) == len(set(listed)) and {"bf16", "fp32", "int4"} <= set(listed)


# the planner compiled the fused CPU dequantization kernel (30-60 s on a fresh machine) for its writes on zeros
def test_planner_never_builds_the_fused_kernel(tmp_path, monkeypatch, capsys):
    calls = []

    def trap():
        calls.append(1)
        raise AssertionError("the planner asked for the fused CPU kernel")

    monkeypatch.setattr(kvquant.formats.kernels, "_extension", trap)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000, "max_position_embeddings": 4096}))
    assert plan.main(["--model", str(model), "--context", "4096", "--cache", "int4"]) == 0, capsys.readouterr().err
    assert "int4" in capsys.readouterr().out
    assert calls == []
    with pytest.raises(AssertionError, match="fused CPU kernel"):  # outside the planner it is asked for again
        kvquant.formats.kernels.usable(torch.empty(1, 2, 8, 64))


# a --model name too long for the file system was an internal error (OSError ENAMETOOLONG, exit 3)
def test_planner_model_name_too_long_for_the_file_system(capsys):
    model = "x" * 5000
    line = assert_refused(capsys, ["--model", model, "--context", "4096"], "File name too long")
    assert line.startswith(f"kvquant: error: --model {model[:60]!r}...") and "(5,000 characters)" in line
    assert "File name too long" in line and len(line) < 400


# per-head static scales are per model; under --tensor-parallel 2 they were checked against one GPU's KV heads
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
    assert_refused(capsys, [*argv, "--cache", per_head.replace("0.2]", "0.2, 0.3]")],
                   "k_scale has 3 per-head scales for a model of 2 KV heads")
