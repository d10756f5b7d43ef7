"""The cache formats against extreme values: static scales that are not finite and positive in float32, size options
of the cache (sinks, residual window, groups, eviction) far beyond any model, and states of large finite magnitude in
every registered format. Every refusal is one :class:`KVQuantError` line, raised before anything is stored or
allocated (through the runner: exit 2 before the model loads); every state a format accepts reads back finite.
"""

import itertools

import pytest
import torch
import yaml

import kvquant
import kvquant.run
from kvquant import KVQuantError
from kvquant.cache import build_cache, simulate_memory
from kvquant.formats.quantizers import MAX_TOKENS
from refusals import error_line, one_line
from tiny_configs import MODEL, STORIES
from slow_cases import slow_where

F32_MAX = torch.finfo(torch.float32).max

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


BAD_SCALES = [
    ("vllm_fp8", {"k_scale": 1e300}, "k_scale 1e+300 is inf in float32"),
    ("vllm_fp8", {"v_scale": 1e-50}, "v_scale 1e-50 is 0 in float32"),
    ("vllm_fp8", {"k_scale": [1.0, 1e39]}, "k_scale 1e+39 is inf in float32"),
    ("vllm_fp8", {"k_scale": 10**400}, "k_scale of about 401 digits is inf"),  # no float holds it (was: OverflowError)
    ("vllm_fp8", {"v_scale": [0.5, -(10**400)]}, "v_scale must be a positive number"),
    ("vllm_nvfp4", {"k_scale": 1e300}, "k_scale 1e+300 is inf in float32"),
    ("vllm_nvfp4", {"v_scale": 1e-300}, "v_scale 1e-300 is 0 in float32"),
    ("vllm_nvfp4", {"k_scale": 1e-39}, "k_scale 1e-39 has 1 / k_scale = inf in float32"),  # it divides
]


@pytest.mark.parametrize("name, options, needle", BAD_SCALES, ids=[f"{c[0]}-{c[2][:16]}" for c in BAD_SCALES])
def test_scales_not_finite_and_positive_in_float32_are_refused_when_built(model, name, options, needle):
    """k_scale 1e300 passed (finite as a Python float) and was inf in the float32 the format computes in: wrong
    logits on short steps (issue 36). Refused by the quantizer, by make_cache, and by the layers option."""
    with pytest.raises(KVQuantError) as err:
        kvquant.get_quantizer(name, **options)
    assert needle in one_line(err) and name in one_line(err)
    with pytest.raises(KVQuantError, match="float32|positive number"):
        kvquant.make_cache(model, name, **options)
    with pytest.raises(KVQuantError, match=r"layers\['0'\]"):
        kvquant.make_cache(model, name, layers={"0": options})


@pytest.mark.parametrize("name, options", [("vllm_fp8", {"k_scale": 3e38, "v_scale": [1e-40] * 4}),
                                           ("vllm_nvfp4", {"k_scale": 3e38, "v_scale": 2.95e-39})])
def test_extreme_scales_that_hold_in_float32_read_back_finite(name, options):
    """The boundaries that are accepted (largest float32, a subnormal; nvfp4: its reciprocal within float32)."""
    layer = build_cache([None], name, head_dim=64, **options).layers[0]
    x = torch.randn(2, 4, 5, 64, generator=torch.Generator().manual_seed(0)) * 100
    keys, values = layer.update(x, x)
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()


def run_config(tmp_path, quantizer: str, options: dict) -> list:
    doc = {"name": "extreme", "output_dir": str(tmp_path / "reports"), "model": {"path": MODEL},
           "candidates": [{"quantizer": quantizer, "name": "c", "options": options}],
           "eval": {"perplexity": [{"name": "s", "source": STORIES, "limit": 2, "max_length": 64}]},
           "gate": {"bootstrap": 1000}}
    path = tmp_path / "extreme.yaml"
    path.write_text(yaml.safe_dump(doc))
    return [str(path)]


RUN_CASES = [
    ("vllm_fp8", {"k_scale": 1e300}, "k_scale 1e+300 is inf in float32"),
    ("vllm_nvfp4", {"v_scale": 1e-300}, "v_scale 1e-300 is 0 in float32"),
    ("int4", {"sink_tokens": 10**12}, f"sink_tokens must be an integer in 0-{MAX_TOKENS}"),
    ("int4", {"residual_length": 10**12}, "residual_length must be an integer in 0-"),
    ("int4", {"group_size": 10**12}, "group_size must be an integer in 1-"),
    ("int4", {"layers": {"0": {"sink_tokens": 10**12}}}, "sink_tokens must be an integer in 0-"),
    ("int4", {"eviction": "sink_window", "sink_tokens": 4, "window": 10**12}, "window must be an integer in 1-"),
    ("int4", {"eviction": "key_norm", "window": 256, "budget": 10**12}, "budget must be an integer in 1-"),
    # within the bound but beyond the toy model's 512 positions: refused only by make_cache, after loading, before
    ("int4", {"sink_tokens": 513}, "sink_tokens 513 is beyond the model's 512 positions"),
    ("int4", {"layers": {"0": {"sink_tokens": 513}}}, "sink_tokens 513 is beyond the model's 512 positions"),
]


@pytest.mark.parametrize("quantizer, options, needle", RUN_CASES, ids=[c[2][:24] for c in RUN_CASES])
def test_runner_refuses_before_the_model_loads(tmp_path, capsys, no_model_load, quantizer, options, needle):
    """sink_tokens 10**12 passed the pre-load checks (shapes only, no allocation) and then asked for 128 TB: exit
    3 after the model loaded. Now exit 2 with one line, before it loads, and nothing written."""
    error_line(kvquant.run.main(run_config(tmp_path, quantizer, options)), capsys.readouterr().err, needle)
    assert not (tmp_path / "reports" / "extreme").exists() or not any((tmp_path / "reports" / "extreme").iterdir())


SIZES = [
    ({"sink_tokens": 10**12}, "sink_tokens must be an integer in 0-"),
    ({"sink_tokens": MAX_TOKENS}, "sink_tokens 16777216 is beyond the model's 512 positions"),
    ({"sink_tokens": 513}, "sink_tokens 513 is beyond the model's 512 positions"),
    ({"layers": {"1-2": {"sink_tokens": 600}}}, r"layers\['1-2'\]: sink_tokens 600 is beyond the model's 512"),
    ({"residual_length": MAX_TOKENS + 1}, "residual_length must be an integer in 0-16777216"),
    ({"layers": {"3": {"residual_length": 10**12}}}, r"layers\['3'\].residual_length must be an integer in 0-"),
    ({"group_size": MAX_TOKENS + 1}, "group_size must be an integer in 1-16777216"),
    ({"key_group_size": 10**30}, "key_group_size must be an integer in 1-"),
    ({"eviction": "window", "window": 10**12}, "window must be an integer in 1-16777216"),
    ({"eviction": "key_norm", "window": 300, "budget": MAX_TOKENS + 1}, "budget must be an integer in 1-"),
]


@pytest.mark.parametrize("options, needle", SIZES, ids=[c[1][:30] for c in SIZES])
def test_size_options_are_bounded_before_anything_is_allocated(model, monkeypatch, options, needle):
    """make_cache(model, sink_tokens=10**12) was accepted and the first forward asked for 128 TB (a raw
    RuntimeError). Every size option is bounded by MAX_TOKENS, and sinks (allocated up front) by the model's
    context, when the cache is made."""
    monkeypatch.setattr(torch.Tensor, "new_zeros", lambda *a, **k: pytest.fail("allocated before refusing"))
    with pytest.raises(KVQuantError, match=needle) as err:
        kvquant.make_cache(model, "int4", **options)
    one_line(err)


def test_size_options_at_their_bounds_still_work(model):
    """The largest sinks the model's context holds, and the documented maximum of the other sizes, are kept."""
    cache = kvquant.make_cache(model, "int4", sink_tokens=512, residual_length=MAX_TOKENS, group_size=MAX_TOKENS)
    x = torch.randn(1, 4, 9, 8, generator=torch.Generator().manual_seed(0))
    keys, _ = cache.update(x, x, 0)
    assert torch.equal(keys, x)  # sinks and the residual window keep full precision
    cache = kvquant.make_cache(model, "int4", eviction="key_norm", window=MAX_TOKENS, budget=MAX_TOKENS)
    assert cache.layers[0].capacity == 2 * MAX_TOKENS


def test_simulate_memory_bounds_sinks_by_the_context_it_is_given():
    """The planner's and the runner's pre-load checks simulate the cache on shapes: given the model's context, they
    refuse the sinks make_cache would refuse once the model has loaded."""
    def simulate(context=None, **settings):
        return simulate_memory([None], {"quantizer": "int4", "residual_length": 0, **settings}, batch=1, kv_heads=1,
                               head_dim=8, tokens=64, context=context)

    with pytest.raises(KVQuantError, match="sink_tokens 600 is beyond the model's 512 positions"):
        simulate(512, sink_tokens=600)
    with pytest.raises(KVQuantError, match="settings: context is not an option"):
        simulate_memory([None], {"quantizer": "int4", "context": 10**12}, batch=1, kv_heads=1, head_dim=8, tokens=1)
    assert simulate(512, sink_tokens=512)["total_bytes"] > simulate(512)["total_bytes"]


def test_sliding_windows_of_a_layout_must_be_positive():
    with pytest.raises(KVQuantError, match="layout: layer 1 has sliding window 0"):
        build_cache([None, 0], "int4")
    with pytest.raises(KVQuantError, match="layout: layer 0 has sliding window -4"):
        build_cache([-4], "fp16")


MAGNITUDES = (1e4, 6e4, 65504.0, 1e6, 1e19, 1e30, 1e37, 3e38, F32_MAX)


def extreme_states(kind: str, magnitude: float, dtype: torch.dtype, head_dim: int, tokens: int = 6):
    """``[1, 2, tokens, head_dim]`` states of ``dtype`` reaching ``magnitude`` (clamped to the dtype's range)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, tokens, head_dim, generator=gen, dtype=torch.float64)
    if kind == "scaled":
        x = x / x.abs().amax() * magnitude
    elif kind == "spike":  # one channel of every token far out, the others O(1)
        x[..., 3] = magnitude
    elif kind == "constant":
        x = torch.full_like(x, magnitude)
    else:  # alternating signs: the widest range a group can have
        x = torch.full_like(x, magnitude)
        x[..., ::2] *= -1
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def head_dims_for(name: str, options: dict) -> list[int]:
    """Head dims the format can store of 64 and 128 (every format stores both today), else of some others."""
    def stores(head_dim: int) -> bool:
        try:
            kvquant.get_quantizer(name, **options).codecs(head_dim)
        except KVQuantError:
            return False
        return True

    found = [d for d in (64, 128) if stores(d)] or [d for d in (80, 96, 256) if stores(d)][:1]
    assert found, f"{name} stores none of the head dims tried"
    return found


#: the options of a format that has required ones, plain and rotated (keys_values: a rotation is each inner one's)
REQUIRED = {"keys_values": (
    {"keys": {"quantizer": "vllm_turboquant_4bit_nc"}, "values": {"quantizer": "int4"}},
    {"keys": {"quantizer": "int4", "rotation": "hadamard"}, "values": {"quantizer": "llamacpp_q4_0",
                                                                      "rotation": "hadamard"}})}


def variants() -> list:
    out = []
    for name in kvquant.available_quantizers():
        out += [(name, options) for options in REQUIRED.get(name, ({}, {"rotation": "hadamard"}))]
    return out + [("int4", {"scale_dtype": "float32"}), ("fp8_e4m3", {"scale_dtype": "float32"}),
                  ("vllm_fp8", {"k_scale": 1e36, "v_scale": 1e-30}),
                  ("vllm_nvfp4", {"k_scale": 1e36, "v_scale": 1e-30}),
                  ("lloyd_max", {"outliers": 1, "scale_dtype": "float32"}),
                  ("normal_float", {"key_offset": [3.0] * 64, "outliers": 2})]


VARIANTS = variants()


@pytest.mark.parametrize("dtype", slow_where(DTYPES, lambda dtype: dtype == torch.bfloat16), ids=str)
@pytest.mark.parametrize("name, options", VARIANTS, ids=[f"{n}-{'-'.join(map(str, o.values()))}" for n, o in VARIANTS])
def test_every_format_reads_large_states_back_finite_or_refuses_them_on_arrival(name, options, dtype):
    """States of 1e6 (TurboQuant: fp16 scale, minimum and key norm overflowed) or 3e38 (int4 per token-head: the
    range overflowed float32) came back from update() as NaN/Inf. Each format, rotated or not, in each dtype, at
    each magnitude: the states read back finite, or the update is refused with one KVQuantError line and nothing is
    stored (the layer then takes ordinary states as if the refused update had never been made)."""
    for head_dim, magnitude, kind in itertools.product(head_dims_for(name, options), MAGNITUDES,
                                                       ("scaled", "spike", "constant", "alternating")):
        if magnitude <= torch.finfo(dtype).max:
            layer = build_cache([None], name, residual_length=0, head_dim=head_dim, **options).layers[0]
            x = extreme_states(kind, magnitude, dtype, head_dim)
            where = f"{kind} states of {magnitude:g} in {dtype}, head_dim {head_dim}"
            try:
                keys, values = layer.update(x, x.clone())
            except KVQuantError as err:
                assert "\n" not in str(err), where
                assert layer.cumulative_length == 0 and (layer.k is None or layer.k.stored_tokens(0) == 0), where
                ordinary = extreme_states("scaled", 1.0, dtype, head_dim)
                keys, values = layer.update(ordinary, ordinary)
                assert layer.cumulative_length == ordinary.shape[2], where
            assert torch.isfinite(keys).all() and torch.isfinite(values).all(), f"{name} {options}: {where}"


def test_turboquant_and_int4_per_token_head_refuse_what_they_turned_into_nan():
    """The states that came back NaN, by value: TurboQuant at 1e6 (fp16 minimum and key norm), int4 per token-head
    at 3e38 in float32 (its range) and at 1e4 in float16 (vLLM's unnormalized Hadamard transform overflows fp16)."""
    cases = [("vllm_turboquant_k8v4", 1e6, torch.float32, "values reach"),
             ("vllm_turboquant_4bit_nc", 6e4, torch.float32, "keys reach a norm of"),
             ("vllm_int4_per_token_head", 3e38, torch.float32, "keys reach |x| = 3e+38"),
             ("vllm_int4_per_token_head", 1e4, torch.float16, "Hadamard")]
    for name, magnitude, dtype, needle in cases:
        layer = build_cache([None], name, residual_length=0, head_dim=64).layers[0]
        with pytest.raises(KVQuantError) as err:
            layer.update(*(extreme_states("scaled", magnitude, dtype, 64) for _ in range(2)))
        assert needle in one_line(err), (name, str(err.value))
        assert layer.cumulative_length == 0


def test_states_the_engine_formats_hold_are_not_refused():
    """Large but representable states still go through: TurboQuant values up to fp16's maximum, keys whose norm is
    within it, int4 per token-head in float16 while its rotation fits."""
    for name, magnitude, dtype in [("vllm_turboquant_k8v4", 65504.0, torch.float32),
                                   ("vllm_turboquant_4bit_nc", 8000.0, torch.float32),
                                   ("vllm_int4_per_token_head", 1000.0, torch.float16),
                                   ("vllm_int4_per_token_head", 1e34, torch.float32)]:
        layer = build_cache([None], name, residual_length=0, head_dim=64).layers[0]
        x = extreme_states("scaled", magnitude, dtype, 64)
        keys, values = layer.update(x, x)
        assert torch.isfinite(keys).all() and torch.isfinite(values).all(), name
        assert float(values.float().abs().amax()) > magnitude / 10, name  # (k8v4's keys saturate at 448)
