"""Hostile planner inputs (issue 36): vLLM's tensor-parallel rules, bounded and consistent model shapes and sizes,
and no input whose work grows with its sizes; the planner's arithmetic equals kvquant's cache code run in full.

Refusals run in-process through ``kvquant.plan.main(argv)``: exit 2 with one line naming the value and its bound.
The work a plan does is bounded by counting what goes through the cache code (``KVQuantLayer.update``: calls and
tokens, and on which device), not by timing it; the timings are in reports/planner_speed.
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from kvquant import plan

from kvquant.formats import ops

from kvquant.planner import cost as plan_cost
from kvquant.cache.build import build_cache, simulate_memory
from kvquant.cache.layer import KVQuantLayer
from kvquant.cache.memory import summarize
from kvquant.formats.quantizers import available_quantizers

ROOT = Path(__file__).parents[1]
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_size": 64, "intermediate_size": 128, "vocab_size": 100}
MISTRAL = {**LLAMA, "model_type": "mistral", "sliding_window": 40}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """PyTorch on one thread for this file, as the planner runs its writes: the references below run the cache code
    on small CPU tensors, whose ops split over threads wait for each other on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_refused(capsys, argv: list[str], needle: str) -> None:
    code = plan.main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, (code, captured.err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("kvquant: error: "), captured.err
    assert needle in lines[0], (needle, lines[0])
    assert not captured.out and "Traceback" not in captured.err


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


def every_quantizer() -> str:
    """int4, and each other registered quantizer on one layer."""
    others = [name for name in available_quantizers() if name != "int4"]
    return kinds_map(lambda i: f"quantizer: {others[i]}", count=len(others))


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


def test_zeros_store_what_meta_tensors_store(monkeypatch):
    """The planner writes zeros on the CPU up to plan_cost.CPU_ELEMENTS and meta tensors beyond: every registered
    quantizer, a rotation, and every storage rule store the same bytes either way (or are refused alike), 200 tokens
    being past every window and unit here."""
    from kvquant.errors import KVQuantError

    def both(layout, settings):
        out = []
        for elements in (1 << 30, 0):
            monkeypatch.setattr(plan_cost, "CPU_ELEMENTS", elements)
            try:
                out.append(plan_cost.written(layout, settings, H, D, torch.float16, 200))
            except KVQuantError as err:
                out.append(str(err))
        return out

    cases = [([None], {"quantizer": name}) for name in available_quantizers()]
    cases += [([None], {"quantizer": name, "rotation": "hadamard", "rotation_seed": 3})
              for name in ("int4", "llamacpp_q4_0")]
    cases += [(LAYOUTS["hybrid-shared"], settings) for settings in SETTINGS]
    for layout, settings in cases:
        on_cpu, on_meta = both(layout, settings)
        assert on_cpu == on_meta, settings
        stored = len(layout) - layout.count("shared")
        assert isinstance(on_cpu, str) or len(on_cpu) == stored and all(sum(m.values()) for m in on_cpu.values())


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
        for setting in ("int4:rotation=hadamard", "{quantizer: int4, layers: {1: {rotation: hadamard}}}"):
            assert_refused(capsys, ["--model", str(config), "--context", "100", "--cache", setting],
                           f"rotation: the planner takes a Hadamard rotation up to head_dim 512, this model's is "
                           f"{head_dim:,}")
    assert not built
    ops._hadamard_block.cache_clear()
    config.write_text(json.dumps({**LLAMA, "num_hidden_layers": 64, "head_dim": 512}))
    seeds = kinds_map(lambda i: f"rotation_seed: {i + 1}", count=64, base="quantizer: int4, rotation: hadamard")
    assert plan.main(["--model", str(config), "--context", "100", "--cache", seeds, "--cache", "int4", "--json"]) == 0
    assert built == [512]
    rotated, int4 = json.loads(capsys.readouterr().out)["settings"]
    assert rotated["kv_bytes"] == int4["kv_bytes"] > 0  # a rotation stores what its quantizer does


# the arithmetic equals kvquant's cache code run in full (simulate_memory), for every storage rule
H, D = 2, 64
LAYOUTS = {"full": [None] * 3, "sliding": [10, 10, None], "hybrid-shared": [None, 24, "shared", None],
           "window-1": [1, None]}
SETTINGS = [
    {"quantizer": "fp16"}, {"quantizer": "int8"}, {"quantizer": "fp8_e5m2"},
    {"quantizer": "int4", "group_size": 8, "residual_length": 3, "sink_tokens": 2},
    {"quantizer": "int2", "key_group_size": 16, "value_group_size": 8, "residual_length": 0},
    {"quantizer": "int8", "key_axis": "token", "value_axis": "channel", "group_size": 4, "residual_length": 5},
    {"quantizer": "int4", "rotation": "hadamard", "scale_dtype": "float32", "residual_length": 7, "group_size": 12},
    {"quantizer": "fp8_e4m3", "granularity": "tensor", "sink_tokens": 3},
    {"quantizer": "int4", "group_size": 8, "residual_length": 4,
     "layers": {"0": {"quantizer": "int8", "group_size": 6, "residual_length": 2}, "1": {"quantizer": "fp16"}}},
    {"quantizer": "int4", "group_size": 8, "residual_length": 4, "eviction": "window", "window": 20},
    {"quantizer": "int4", "group_size": 8, "residual_length": 4, "sink_tokens": 3, "eviction": "sink_window",
     "window": 17},
    {"quantizer": "int4", "group_size": 8, "residual_length": 4, "eviction": "key_norm", "window": 12, "budget": 9},
    {"quantizer": "int2", "key_group_size": 6, "value_group_size": 4, "residual_length": 1, "sink_tokens": 2,
     "eviction": "key_norm", "window": 8, "budget": 5},
]
TOKENS = [1, 2, 3, 5, 8, 9, 10, 11, 12, 13, 17, 20, 21, 24, 25, 31, 33, 40, 47, 64, 97, 130, 257]


#: Token counts at which the arithmetic is also checked against ``simulate_memory`` (meta tensors)
META_TOKENS = [21, 257]


def planner(layout, settings):
    from kvquant.planner.shapes import ModelShape, Planner

    return Planner(ModelShape("t", layout, H, D, 1e6), settings, torch.float16)


def cache_code(layout, settings, tokens: int, batch: int = 2) -> dict:
    """``simulate_memory``'s report by the same cache code, each layer written with zeros on the CPU (Python meta
    kernels take some 50 times longer at these sizes): ``memory_report()`` after ``tokens`` tokens, ``batch`` rows."""
    settings = dict(settings)
    cache = build_cache(layout, settings.pop("quantizer"), head_dim=D, **settings)
    parts = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, KVQuantLayer):
            states = torch.zeros(1, H, tokens, D, dtype=torch.float16)
            layer.update(states, states)
            memory = layer.memory()  # stored bytes, what the planner counts (one row's reserved bytes say nothing of B)
            parts[i] = {key: memory[key] * batch for key in plan_cost.MEMORY_KEYS}
    return summarize(parts, tokens)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items())[:60])
def test_the_arithmetic_equals_the_cache_code(layout, settings):
    """Every token count, below, at and past sinks, residual windows, units, sliding windows and eviction
    capacities: the whole report (per layer too), at batch 2; on meta tensors as well at :data:`META_TOKENS`."""
    from kvquant.errors import KVQuantError

    try:
        mine = planner(layout, settings)
    except KVQuantError as err:  # e.g. sinks on a sliding-window layer: make_cache refuses the same
        with pytest.raises(KVQuantError, match=re.escape(str(err))):
            simulate_memory(layout, settings, batch=2, kv_heads=H, head_dim=D, tokens=1)
        return
    for n in TOKENS:
        real = cache_code(layout, settings, n)
        if n in META_TOKENS:
            assert json.dumps(simulate_memory(layout, settings, batch=2, kv_heads=H, head_dim=D, tokens=n),
                              sort_keys=True) == json.dumps(real, sort_keys=True), n
        # as JSON: a window of one token holds nothing, and its ratio to fp16 is NaN (never equal to itself)
        assert json.dumps(mine.memory(2, n), sort_keys=True) == json.dumps(real, sort_keys=True), n
        assert mine.kv_bytes(2, n) == real["total_bytes"], n


def simulated_max_context(layout, settings, batch, available):
    """The planner's search before issue 36, each probe a full run of the cache code (the reference for the
    answers)."""
    def fits(n):
        return cache_code(layout, settings, n, batch)["total_bytes"] <= available

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@pytest.mark.parametrize("layout, settings", [
    (LAYOUTS["full"], {"quantizer": "int4", "group_size": 8, "residual_length": 5, "sink_tokens": 2}),
    (LAYOUTS["full"], {"quantizer": "int2", "key_group_size": 16, "value_group_size": 8, "residual_length": 0}),
    (LAYOUTS["hybrid-shared"], {"quantizer": "int8", "group_size": 16, "residual_length": 3}),
    (LAYOUTS["full"], {"quantizer": "int4", "group_size": 8, "residual_length": 4, "sink_tokens": 3,
                       "eviction": "sink_window", "window": 1500}),
], ids=["int4-sinks", "int2-residual-0", "int8-hybrid", "int4-sink-window"])
@pytest.mark.parametrize("available", [9_999, 123_457, 600_001])
def test_the_largest_context_is_the_simulated_searchs(layout, settings, available):
    """Largest contexts of a few hundred to a few thousand tokens, where the bytes dip at every quantized unit:
    the same answer as the search that simulated every probe."""
    assert planner(layout, settings).max_context(3, available) == simulated_max_context(layout, settings, 3,
                                                                                       available)


def documented_tables() -> list[tuple[list[str], list[str]]]:
    """The tables docs/planner.md shows, each with the command above it: (argv, table rows)."""
    text = (ROOT / "docs" / "planner.md").read_text(encoding="utf-8")
    found = []
    for command, table in re.findall(r"```bash\n\.venv/bin/python -m kvquant\.plan ([^\n]+)\n```\n\n```\n(.*?)```",
                                     text, re.S):
        found.append((command.split(), [line for line in table.splitlines()[1:] if line.strip()]))
    return found


def test_the_documented_plans_are_unchanged(capsys):
    """The worked examples of docs/planner.md (computed by the simulation-only planner) come out as shown."""
    tables = documented_tables()
    assert len(tables) == 2 and any("--tensor-parallel" in argv for argv, _ in tables)
    for argv, rows in tables:
        assert plan.main(argv) == 0
        out = capsys.readouterr().out.splitlines()
        for row in rows:
            assert row in out, (argv, row)


@pytest.mark.parametrize("value", ["false", "False", "true", "TRUE"])
def test_a_key_value_cache_option_reads_booleans(capsys, value):
    """``llamacpp_q4_0:attn_rot=false`` was refused as "got 'false'": the key=value form read no booleans."""
    assert plan.main(["--model", "llama-3.1-8b", "--context", "64", "--cache", f"llamacpp_q4_0:attn_rot={value}"]) == 0
    assert "llamacpp_q4_0" in capsys.readouterr().out


def test_an_unknown_cache_setting_lists_each_valid_one_once():
    """Probe 58 (l15): the refusal listed fp16 twice (a full-precision name and the identity quantizer)."""
    from kvquant.errors import KVQuantError
    from kvquant.planner.shapes import parse_setting

    with pytest.raises(KVQuantError) as refused:
        parse_setting("int3")
    listed = str(refused.value).split("use one of ")[1].split(", ")
    assert listed.count("fp16") == 1 and len(listed) == len(set(listed)) and {"bf16", "fp32", "int4"} <= set(listed)
