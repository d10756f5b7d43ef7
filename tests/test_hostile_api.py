"""Hostile inputs to the public cache API: every bad input is a KVQuantError with one line naming the argument,
the value received and what is valid (never a raw torch error, never silently dropped data), and a rejected call
leaves the cache as it was."""

import pytest
import torch

import kvquant
from kvquant import KVQuantError, NonFiniteKVError
from kvquant.cache import stack_rows

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


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# --- update ---------------------------------------------------------------------------------------------------

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


# --- fork / reorder_cache / batch_select_indices / batch_repeat_interleave ---------------------------------------

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


# --- get_seq_length / set_padding / stack_rows --------------------------------------------------------------------

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


# --- make_cache -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options,match", [
    ({"head_dim": 8}, r"make_cache: head_dim is not an option, it is read from model_or_config; the options: budget, "
                      r"eviction, layers, residual_length"),
    ({"layout": [None]}, r"make_cache: layout is not an option"),
    ({"residual_lenght": 0}, r"quantizer 'int4' has no option 'residual_lenght'; its options: .*group_size.*; the "
                             r"cache's: budget, eviction, layers, residual_length, sink_tokens, window"),
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


def test_a_broken_invariant_is_an_internal_error_exit_3_not_bad_input(model, capsys):
    """Was: ``KVQuantError("internal error ...")``, which the commands report as bad input (exit 2)."""
    from kvquant.errors import EXIT_INTERNAL, InternalError
    from kvquant.exits import guarded

    cache = written(model)
    cache.layers[0].k.evicted[1] += 1  # what a bookkeeping bug would leave behind
    with pytest.raises(InternalError, match=r"row 1 stores .* tokens") as info:
        cache.layers[0]._check()
    assert not isinstance(info.value, KVQuantError)
    assert guarded("kvquant", lambda: cache.layers[0]._check()) == EXIT_INTERNAL
    assert "internal error (InternalError: row 1" in capsys.readouterr().err
