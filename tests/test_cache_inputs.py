"""Bad input to the public cache API: every bad argument to ``make_cache`` / ``get_quantizer`` and to the cache's
methods (``update``, ``fork``, ``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``,
``get_seq_length``, ``set_padding``, ``stack_rows``) is a :class:`KVQuantError` with one line naming the argument,
the value received and what is valid (never a raw torch error, never silently dropped data), and a rejected call
leaves the cache as it was. A cache made for a model refuses states of another shape; a cache made for fused decode
and read by a plain model reads what the plain cache reads."""

import math
import re

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import kvquant
import kvquant.formats.kernels
from kvquant import KVQuantError, NonFiniteKVError
from kvquant.cache import stack_rows
from kvquant.cache.build import written_shapes
from kvquant.paths import resolve
from kvquant.experiment.config import PerplexitySet
from kvquant.experiment.gate_config import GateConfig
from kvquant.experiment.model_config import ModelConfig
from kvquant.scoring.scorer import Scorer
from refusals import one_line, snapshot
from tiny_configs import MODEL

LAYERS, HEADS, HEAD_DIM = 5, 4, 8  # stories260K


def states(batch=1, heads=HEADS, tokens=5, head_dim=HEAD_DIM, dtype=torch.float32, seed=0):
    return torch.randn(batch, heads, tokens, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fresh(model):
    return kvquant.make_cache(model, "int4", residual_length=0)


def written(model, batch=2):
    """A cache every layer of which has stored 5 tokens of ``batch`` rows."""
    cache = fresh(model)
    for layer in range(LAYERS):
        cache.update(states(batch), states(batch, seed=1), layer)
    return cache


HALF = torch.ones(1, HEADS, 5, HEAD_DIM, dtype=torch.float16)


#: (label, keys, values, layer_idx, match); states written before (``first``) are on the same layer
UPDATE = [
    ("tokens differ", states(tokens=5), states(tokens=7), 0, r"keys have 5 tokens, values 7; .*same tokens"),
    ("batch differs (fewer values)", states(2), states(1), 0, r"keys have 2 rows, values 1"),
    ("batch differs (more values)", states(2), states(3), 0, r"keys have 2 rows, values 3"),
    ("empty batch", states(0), states(0), 0, r"keys have 0 rows"),
    ("3-D states", states()[0], states()[0], 0,
     r"keys have 3 dimensions \(4, 5, 8\).*\[batch, heads, tokens, head_dim\]"),
    ("5-D states", states()[None], states()[None], 0, r"keys have 5 dimensions .*\[batch, heads, tokens, head_dim\]"),
    ("2-D values", states(), states()[0, 0], 0, r"values have 2 dimensions"),
    ("integer states", states().long(), states().long(), 0, r"keys are torch.int64; .*floating-point"),
    ("bool states", states() > 0, states() > 0, 0, r"keys are torch.bool; .*floating-point"),
    ("complex states", states().to(torch.complex64), states().to(torch.complex64), 0, r"keys are torch.complex64"),
    ("dtypes differ", states(), states(dtype=torch.float16), 0, r"keys are torch.float32, values torch.float16"),
    ("devices differ", states(), states().to("meta"), 0, r"keys are on cpu, values on meta"),
    ("list keys", states().tolist(), states(), 0, r"keys must be a torch.Tensor .*got list"),
    ("numpy values", states(), states().numpy(), 0, r"values must be a torch.Tensor .*got ndarray"),
    ("None states", None, None, 0, r"keys must be a torch.Tensor .*got NoneType"),
    ("layer beyond the model", states(), states(), LAYERS, r"layer_idx must be an integer in 0-4 .*got int 5"),
    ("negative layer", states(), states(), -1, r"layer_idx must be an integer in 0-4 .*got int -1"),
    ("float layer", states(), states(), 1.0, r"layer_idx must be an integer in 0-4 .*got float 1.0"),
    ("str layer", states(), states(), "0", r"layer_idx must be an integer in 0-4 .*got str '0'"),
    ("bool layer", states(), states(), True, r"layer_idx must be an integer in 0-4 .*got bool True"),
    ("tensor layer", states(), states(), torch.tensor(0), r"layer_idx must be an integer in 0-4 .*got a 0-D tensor"),
]


@pytest.mark.parametrize("label,keys,values,layer,match", UPDATE, ids=[case[0] for case in UPDATE])
def test_update_rejects_bad_states_and_layers(model, label, keys, values, layer, match):
    cache = fresh(model)
    with pytest.raises(KVQuantError, match=match) as err:
        cache.update(keys, values, layer)
    one_line(err)
    assert not any(layer.is_initialized for layer in cache.layers)  # nothing was stored, no layout fixed


#: (label, keys, values, match) of a second update of layer 0 after ``states(2)``
CHANGED = [
    ("heads change", states(2, heads=8), states(2, heads=8), r"keys have 8 heads, this layer stores 4"),
    ("key head_dim changes", states(2, head_dim=16), states(2), r"keys have head_dim 16, this layer stores 8"),
    ("value head_dim changes", states(2), states(2, head_dim=4), r"values have head_dim 4, this layer stores 8"),
    ("tokens differ", states(2, tokens=3), states(2, tokens=4), r"keys have 3 tokens, values 4"),
    ("dtype changes", states(2, dtype=torch.float16), states(2, dtype=torch.float16),
     r"keys are torch.float16, this layer stores torch.float32"),
    ("device changes", states(2).to("meta"), states(2).to("meta"), r"keys are on meta, this layer stores them on cpu"),
]


@pytest.mark.parametrize("label,keys,values,match", CHANGED, ids=[case[0] for case in CHANGED])
def test_update_rejects_a_layout_that_changes_between_updates(model, label, keys, values, match):
    cache, before = fresh(model), fresh(model)
    cache.update(states(2), states(2, seed=1), 0)
    before.update(states(2), states(2, seed=1), 0)
    with pytest.raises(KVQuantError, match=match) as err:
        cache.update(keys, values, 0)
    assert one_line(err).startswith("update(layer_idx=0): ")
    # the rejected update stored nothing: the next valid one returns what it returns on an untouched cache
    good = states(2, tokens=3, seed=2), states(2, tokens=3, seed=3)
    for got, want in zip(cache.update(*good, 0), before.update(*good, 0)):
        assert torch.equal(got, want)
    assert cache.get_seq_length() == 8


def test_tokens_mismatch_no_longer_drops_values_and_a_valid_update_still_works(model):
    cache = fresh(model)
    with pytest.raises(KVQuantError, match=r"update\(layer_idx=0\): keys have 5 tokens, values 7; keys and values "
                                           "must hold the same tokens"):
        cache.update(states(tokens=5), states(tokens=7, seed=1), 0)  # used to store 5 values, silently
    keys, values = cache.update(states(tokens=7), states(tokens=7, seed=1), 0)
    ref_keys, ref_values = fresh(model).update(states(tokens=7), states(tokens=7, seed=1), 0)
    assert keys.shape == values.shape == (1, HEADS, 7, HEAD_DIM)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
    assert cache.get_seq_length() == 7
    # non-finite states keep their own error (a KVQuantError too)
    with pytest.raises(NonFiniteKVError, match="NaN or Inf"):
        cache.update(states() * float("nan"), states(), 1)


def test_update_of_a_layer_that_stores_nothing_is_a_kvquant_error(model):
    cache = fresh(model)
    cache.layers[1] = kvquant.cache.DummyLayer()  # as for a layer that reuses another layer's KV
    with pytest.raises(KVQuantError, match=r"layer_idx 1 .*reuses another layer's KV"):
        cache.update(states(), states(), 1)


#: (label, rows, match) against a cache of 2 rows
BAD_ROWS = [
    ("row too large", [0, 5], r"names row 5; the cache holds rows 0-1"),
    ("negative row", [-1], r"names row -1; the cache holds rows 0-1"),
    ("float row", [0.5], r"float 0.5"),
    ("bool rows", [True, False], r"bool True"),
    ("nested list", [[0, 1]], r"list \[0, 1\]"),
    ("empty list", [], r"no rows"),
    ("empty tensor", torch.tensor([], dtype=torch.long), r"no rows"),
    ("2-D tensor", torch.tensor([[0, 1]]), r"2-D tensor"),
    ("float tensor", torch.tensor([0.0, 1.0]), r"torch.float32"),
    ("bool tensor", torch.tensor([True, False]), r"torch.bool"),
    ("a string", "01", r"got str '01'"),
    ("a bare int", 1, r"got int 1"),
    ("None", None, r"got NoneType"),
]

BAD_BEAMS = [
    ("row too large", torch.tensor([0, 5]), r"names row 5; the cache holds rows 0-1"),
    ("negative row", torch.tensor([-1, 0]), r"names row -1; the cache holds rows 0-1"),
    ("float tensor", torch.tensor([0.0, 1.0]), r"torch.float32"),
    ("2-D tensor", torch.tensor([[0, 1]]), r"2-D tensor"),
    ("empty tensor", torch.tensor([], dtype=torch.long), r"no rows"),
    ("list out of range", [0, 2], r"names row 2; the cache holds rows 0-1"),
    ("nested list", [[0, 1]], r"list \[0, 1\]"),
    ("meta tensor", torch.tensor([0, 1], device="meta"), r"meta tensor, which holds no row numbers"),
]


@pytest.mark.parametrize("call,name,rows,match", [("fork", "rows", *case[1:]) for case in BAD_ROWS]
                         + [("reorder_cache", "beam_idx", *case[1:]) for case in BAD_BEAMS],
                         ids=[f"fork-{case[0]}" for case in BAD_ROWS] + [f"reorder-{case[0]}" for case in BAD_BEAMS])
def test_fork_and_reorder_cache_reject_bad_rows(model, call, name, rows, match):
    cache = written(model)
    with pytest.raises(KVQuantError, match=f"{call}: {name} .*" + match) as err:
        getattr(cache, call)(rows)
    one_line(err)
    assert cache.rows() == 2 and all(layer.batch == 2 for layer in cache.layers)  # nothing changed


def test_a_valid_reorder_still_works_after_a_rejected_one(model):
    cache, ref = written(model), written(model)
    with pytest.raises(KVQuantError):
        cache.reorder_cache(torch.tensor([1, 2]))
    cache.reorder_cache(torch.tensor([1, 1, 0]))
    ref.fork([1, 1, 0])
    for got, want in zip(cache.update(states(3), states(3, seed=1), 0), ref.update(states(3), states(3, seed=1), 0)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("indices,match", [(torch.tensor([5]), r"2 rows: index 5 is out of bounds"),
                                           (torch.tensor([0.5]), "float"), ("0", "str")])
def test_batch_select_indices_rejects_bad_indices(model, indices, match):
    cache = written(model)
    with pytest.raises(KVQuantError, match="batch_select_indices: indices .*" + match):
        cache.batch_select_indices(indices)
    assert cache.rows() == 2


@pytest.mark.parametrize("repeats,match", [(0, "int 0"), (-1, "int -1"), (True, "bool True"), (1.5, "float 1.5"),
                                           ("2", "str '2'")])
def test_batch_repeat_interleave_rejects_bad_repeats(model, repeats, match):
    cache = written(model)
    with pytest.raises(KVQuantError, match=f"batch_repeat_interleave: repeats must be an integer >= 1, got {match}"):
        cache.batch_repeat_interleave(repeats)
    assert cache.rows() == 2


@pytest.mark.parametrize("layer,match", [(LAYERS, "int 5"), (-1, "int -1"), (True, "bool True"), (1.0, "float 1.0"),
                                         ("0", "str '0'"), (None, "NoneType None")])
def test_get_seq_length_rejects_bad_layers(model, layer, match):
    with pytest.raises(KVQuantError, match=f"get_seq_length: layer_idx must be an integer in 0-4 .*got {match}"):
        written(model).get_seq_length(layer)


@pytest.mark.parametrize("mask,match", [
    (torch.tensor([[0.0, float("-inf")] + [0.0] * 4] * 2), r"0 \(padding\) and 1"),  # an additive mask: inverted
    (torch.tensor([[2, 1, 1, 1, 1, 1]] * 2), r"0 \(padding\) and 1"),
    (torch.tensor([[0.5] * 6] * 2), r"0 \(padding\) and 1"),
    (torch.ones(2, 6, dtype=torch.complex64), r"torch.complex64"),
    (torch.ones(2, 6, dtype=torch.long, device="meta"), r"meta tensor"),
], ids=["additive", "two", "half", "complex", "meta"])
def test_set_padding_rejects_masks_that_are_not_zero_one(model, mask, match):
    cache = written(model)
    with pytest.raises(KVQuantError, match="set_padding: attention_mask .*" + match):
        cache.set_padding(mask)
    assert cache.padding.mask is None


def test_set_padding_rejects_a_mask_of_no_rows(model):
    with pytest.raises(KVQuantError, match=r"set_padding: attention_mask has 0 rows"):
        fresh(model).set_padding(torch.ones(0, 4))


def test_stack_rows_rejects_bad_sources(model):
    cache, empty = written(model), fresh(model)
    cases = [
        ([(cache, True)], r"sources\[0\]: row must be an integer >= 0, got bool True"),
        ([(cache, 0.5)], r"sources\[0\]: row must be an integer >= 0, got float 0.5"),
        ([(cache, 0), (cache, "1")], r"sources\[1\]: row must be an integer >= 0, got str '1'"),
        ([(empty, -1)], r"sources\[0\]: row must be an integer >= 0, got int -1"),
        ([cache], r"sources\[0\] must be a \(cache, row\) pair, got KVQuantCache"),
        ([(cache,)], r"sources\[0\] must be a \(cache, row\) pair, got tuple of 1"),
        ([(cache, 0, 1)], r"sources\[0\] must be a \(cache, row\) pair, got tuple of 3"),
        (cache, r"sources must be a list of \(cache, row\) pairs, got KVQuantCache"),
        ((cache, 0), r"sources\[0\] must be a \(cache, row\) pair, got KVQuantCache"),
    ]
    for sources, match in cases:
        with pytest.raises(KVQuantError, match="stack_rows: " + match):
            stack_rows(sources)
    assert stack_rows([(cache, 1), (empty, 0)]).rows() == 2  # valid sources still stack


@pytest.mark.parametrize("options,match", [
    ({"head_dim": 8}, r"make_cache: head_dim is not an option, it is read from model_or_config; the options: budget, "
                      r"eviction, layers, pre_rope, residual_length"),
    ({"layout": [None]}, r"make_cache: layout is not an option"),
    ({"residual_lenght": 0}, r"quantizer 'int4' has no option 'residual_lenght'; its options: .*group_size.*; the "
                             r"cache's: budget, eviction, layers, pre_rope, residual_length, sink_tokens, window"),
], ids=["head_dim", "layout", "typo of a cache option"])
def test_make_cache_rejects_bad_options(model, options, match):
    with pytest.raises(KVQuantError, match=match) as err:
        kvquant.make_cache(model, "int4", **options)
    one_line(err)


@pytest.mark.parametrize("kind", ["config class", "model class", "a dict"])
def test_make_cache_rejects_what_is_no_model_or_config_instance(model, kind):
    target = {"config class": type(model.config), "model class": type(model), "a dict": model.config.to_dict()}[kind]
    match = {"config class": "got the class LlamaConfig", "model class": "got the class LlamaForCausalLM",
             "a dict": "got dict {"}[kind]
    with pytest.raises(KVQuantError, match=f"model_or_config must be a transformers model or config instance, {match}"):
        kvquant.make_cache(target, "int4")


def test_a_broken_invariant_is_an_internal_error_exit_3_not_bad_input(model, capsys, tmp_path, monkeypatch):
    """Was: ``KVQuantError("internal error ...")``, which the commands report as bad input (exit 2)."""
    import tempfile

    from kvquant.errors import EXIT_INTERNAL, InternalError
    from kvquant.exits import run_guarded

    cache = written(model)
    cache.layers[0].k.evicted[1] += 1  # what a bookkeeping bug would leave behind
    with pytest.raises(InternalError, match=r"row 1 stores .* tokens") as info:
        cache.layers[0]._check()
    assert not isinstance(info.value, KVQuantError)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the traceback goes (was left in /tmp each run)
    assert run_guarded("kvquant", lambda: cache.layers[0]._check()) == EXIT_INTERNAL
    assert "internal error (InternalError: row 1" in capsys.readouterr().err
    [log] = tmp_path.glob("kvquant-error-*.log")
    assert "InternalError: row 1 stores" in log.read_text()


@pytest.fixture(scope="module")
def stories_config():
    return AutoConfig.from_pretrained(resolve(MODEL))


API_CASES = [
    ("unknown-quantizer", lambda c: kvquant.get_quantizer("int3"), "'int3'"),
    ("group-size-bool", lambda c: kvquant.get_quantizer("int4", group_size=True), "group_size"),
    ("key-bits-float", lambda c: kvquant.get_quantizer("int4", key_bits=4.0), "key_bits"),
    ("key-bits-3", lambda c: kvquant.get_quantizer("int4", key_bits=3), "key_bits"),
    ("group-size-0", lambda c: kvquant.get_quantizer("int4", group_size=0), "group_size"),
    ("unknown-option", lambda c: kvquant.get_quantizer("int4", gruop_size=32), "'gruop_size'"),
    ("fp8-granularity", lambda c: kvquant.get_quantizer("fp8_e4m3", granularity="channel"), "granularity"),
    ("scale-dtype", lambda c: kvquant.get_quantizer("int4", scale_dtype="float64"), "scale_dtype"),
    ("quantizer-none", lambda c: kvquant.make_cache(c, None), "None"),
    ("residual-negative", lambda c: kvquant.make_cache(c, "int4", residual_length=-1), "residual_length"),
    ("residual-bool", lambda c: kvquant.make_cache(c, "int4", residual_length=True), "residual_length"),
    ("sinks-float", lambda c: kvquant.make_cache(c, "int4", sink_tokens=1.5), "sink_tokens"),
    ("not-a-model", lambda c: kvquant.make_cache("gpt2", "int4"), "str"),
    ("model-config-device", lambda c: ModelConfig(device="banana"), "device 'banana'"),
    ("gate-nan", lambda c: GateConfig(max_perplexity_ratio=math.nan), "max_perplexity_ratio"),
    ("perplexity-limit-0", lambda c: PerplexitySet(name="t", source="x.txt", limit=0), "limit must be >= 1"),
]


@pytest.mark.parametrize("call, needle", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_refuses(refusal_env, stories_config, call, needle):
    before = snapshot(refusal_env["finished"])
    with pytest.raises(KVQuantError) as info:
        call(stories_config)
    assert needle in one_line(info), info.value
    assert snapshot(refusal_env["finished"]) == before


@pytest.mark.parametrize("mode, chunk_size, needle", [("stream", 64, "stream"), ("streaming", 0, "chunk_size")],
                         ids=["mode-typo", "chunk-size-0"])
def test_api_scorer_refuses(model, mode, chunk_size, needle):
    with pytest.raises(KVQuantError, match=needle):
        Scorer(model, kvquant.CacheSpec.of("int4"), mode, chunk_size)


def test_api_works_under_autograd(model, story_ids, monkeypatch):
    """The eager dequantization path (every GPU, fp16 models, KVQUANT_KERNELS=0) outside torch.no_grad()."""
    monkeypatch.setattr(kvquant.formats.kernels, "usable", lambda out: False)
    cache = kvquant.make_cache(model, "int4")
    out = model(story_ids, cache=cache, use_cache=True)
    assert torch.isfinite(out.logits).all()


SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)

LLAMA = dict(hidden_size=256, num_key_value_heads=2, head_dim=64)


def tiny(config_class: str = "LlamaConfig", **options) -> torch.nn.Module:
    """A small random decoder (a Llama of 2 KV heads of head_dim 64 by default)."""
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SMALL, **(LLAMA if config_class == "LlamaConfig" else {}),
                                                     **options})
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def llama():
    return tiny()


@pytest.mark.parametrize("shape, what", [((1, 2, 4, 32), "head_dim 32"), ((1, 3, 4, 64), "3 heads"),
                                         ((1, 1, 4, 64), "1 heads")])
@pytest.mark.parametrize("quantizer", ["int4", "llamacpp_q4_0", "fp16"])
def test_first_update_of_another_shape_is_refused(llama, shape, what, quantizer):
    cache = kvquant.make_cache(llama, quantizer)
    states = torch.randn(shape)
    with pytest.raises(KVQuantError, match=rf"update\(layer_idx=1\): keys have shape {re.escape(str(shape))}.*{what}.*"
                                           r"layer 1 of the model .* writes \[batch, 2, tokens, 64\]"):
        cache.update(states, states, 1)
    assert not cache.layers[1].is_initialized  # nothing stored


def test_values_of_another_shape_are_refused_too(llama):
    cache = kvquant.make_cache(llama, "int4")
    with pytest.raises(KVQuantError, match=r"values have shape \(1, 2, 4, 32\)"):
        cache.update(torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 32), 0)


def test_the_model_own_shapes_pass_and_its_forward_runs(llama):
    cache = kvquant.make_cache(llama, "int4", residual_length=0)
    assert [layer.expected for layer in cache.layers] == [((2, 64), (2, 64))] * 2
    with torch.no_grad():
        logits = llama(torch.randint(0, 100, (2, 40)), cache=cache, use_cache=True).logits
    assert torch.isfinite(logits).all() and cache.get_seq_length() == 40
    other = tiny(num_key_value_heads=4)  # a cache made for one model, given to another: refused at its first write
    with pytest.raises(KVQuantError, match=r"layer_idx=0\): keys have shape \(1, 4, 5, 64\)"):
        other(torch.randint(0, 100, (1, 5)), cache=kvquant.make_cache(llama, "int4"), use_cache=True)


def test_layers_of_several_shapes_each_checked_against_their_own():
    """Gemma 4's full-attention layers have a head_dim and KV heads of their own (transformers' per-layer config);
    with attention_k_eq_v they have no v_proj (values are the keys), so only their keys' shape is read."""
    model = tiny("Gemma4TextConfig", num_key_value_heads=2, head_dim=16,
                 global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                 num_hidden_layers=6, hidden_size_per_layer_input=8, vocab_size_per_layer_input=100)
    shapes = written_shapes(model)
    kinds = model.config.layer_types
    assert {kinds[i]: shapes[i] for i in range(6)} == {"sliding_attention": ((2, 16), (2, 16)),
                                                       "full_attention": ((1, 32), None)}
    with torch.no_grad():  # its own forward passes the checks
        model(torch.randint(0, 100, (1, 12)), cache=kvquant.make_cache(model, "int8"), use_cache=True)
    full = kinds.index("full_attention")
    with pytest.raises(KVQuantError, match=rf"layer {full} of the model .* writes \[batch, 1, tokens, 32\]"):
        kvquant.make_cache(model, "int8").update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), full)


@pytest.mark.parametrize("config_class, options", [
    ("FalconConfig", dict(multi_query=True)),  # fused QKV (and 1 KV head where get_head_shapes reads 4): not read
    ("MiMoV2FlashConfig", dict(num_key_value_heads=2, head_dim=24, v_head_dim=16)),  # keys, values of two sizes
])
def test_models_whose_shapes_are_not_read_are_not_checked(config_class, options):
    """Where the config and the layer's own projections do not both give the shape, nothing is checked (a config
    can say otherwise than the model writes: Falcon's multi_query), so the model's own forward still runs."""
    model = tiny(config_class, **options)
    assert written_shapes(model) == {}
    with torch.no_grad():
        logits = model(torch.randint(0, 100, (1, 9)), cache=kvquant.make_cache(model, "int8"), use_cache=True).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("options, field, count", [(dict(k_scale=[1.0, 2.0, 3.0]), "k_scale", 3),
                                                   (dict(v_scale=[0.5]), "v_scale", 1),
                                                   (dict(layers={1: {"k_scale": [1.0] * 4}}), "k_scale", 4)])
def test_vllm_fp8_per_head_scales_of_another_count_refused_by_make_cache(llama, options, field, count):
    layer = 1 if "layers" in options else 0
    with pytest.raises(KVQuantError, match=rf"make_cache: layer {layer}: vllm_fp8: {field} has {count} per-head "
                                           r"scales for a layer of 2 KV heads"):
        kvquant.make_cache(llama, "vllm_fp8", **options)


def test_vllm_fp8_per_head_scales_of_the_right_count_store_per_head(llama):
    cache = kvquant.make_cache(llama, "vllm_fp8", k_scale=[1.0, 0.25], v_scale=0.5)
    keys = torch.full((1, 2, 3, 64), 120.0)
    out, _ = cache.update(keys, keys, 0)
    assert (out[0, 0] == 120.0).all() and (out[0, 1] == 112.0).all()  # head 1: 480 saturates at 448, times 0.25


def tiny_llama(layers: int):
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("how", ["another model", "fused decode undone"])
def test_a_cache_made_for_fused_decode_read_by_a_plain_model_equals_the_plain_cache(layers, how):
    """A cache made for fused decode and read by a plain one-layer model gave NaN logits and token 0 with no error
    (the placeholders' NaN reached the logits: no next layer refused them). Placeholders now go only to kvquant's
    attention: any other reads the dequantized cache, so the logits equal those of a cache made for the plain
    model."""
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(4))
    fused_model, plain = tiny_llama(layers), tiny_llama(layers)
    kvquant.enable_fused_decode(fused_model)
    cache = kvquant.make_cache(fused_model, "int4", group_size=16, residual_length=0)
    reference = kvquant.make_cache(plain, "int4", group_size=16, residual_length=0)
    if how == "fused decode undone":
        fused_model.set_attn_implementation("sdpa")
        plain = fused_model
    with torch.no_grad():
        for model_cache in (cache, reference):
            plain(ids[:, :20], cache=model_cache)
        got = [plain(ids[:, i : i + 1], cache=cache).logits for i in range(20, 24)]
        want = [plain(ids[:, i : i + 1], cache=reference).logits for i in range(20, 24)]
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_a_fused_model_still_reads_the_codes(monkeypatch):
    """The fix does not switch fused decode off: a fused model's decode steps still run the kernel, and agree with
    the plain cache within float rounding."""
    from kvquant.formats import kernels

    if not kernels.available():
        pytest.skip("needs the C++ kernel (a compiler)")
    calls = []
    kernel = kernels.attend_into
    monkeypatch.setattr(kernels, "attend_into", lambda *a: calls.append(1) or kernel(*a))
    ids = torch.randint(3, 97, (1, 21), generator=torch.Generator().manual_seed(5))
    logits = []
    for on in (False, True):
        model = tiny_llama(1)
        if on:
            kvquant.enable_fused_decode(model)
        cache = kvquant.make_cache(model, "int4", group_size=16, residual_length=0)
        with torch.no_grad():
            model(ids[:, :20], cache=cache)
            logits.append(model(ids[:, 20:], cache=cache).logits)
    assert calls and math.isfinite(float(logits[1].abs().max()))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
