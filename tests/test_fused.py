"""Fused decode (kvquant/cache/fused.py, the C++ attend_into kernel): attention over the stored codes equals eager
attention over the dequantized copy of the same cache.

Tolerance: 2e-5 absolute for float32 (both accumulate in fp32 in different orders over at most a few hundred
tokens; values are O(1)); bfloat16 outputs within one bfloat16 step (2**-7 relative) of the float64 reference.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import kvquant
from kvquant.formats import kernels
from kvquant.cache import build_cache, fused

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernel (a compiler)")

QUANTIZERS = {
    "int4-channel-keys": ("int4", {"group_size": 16}),
    "int2-token-keys": ("int2", {"group_size": 16, "key_axis": "token"}),
    "int8": ("int8", {"group_size": 16}),
    "k8v4": ("int4", {"key_bits": 8, "group_size": 16}),
    "fp8_e4m3": ("fp8_e4m3", {}),
    "fp8_e5m2-tensor": ("fp8_e5m2", {"granularity": "tensor"}),
    "fp16": ("fp16", {}),
}


def reference(query, keys, values, mask, scaling):
    """Eager attention in float64 over dequantized ``[B, H, L, D]`` keys/values; ``mask`` ``[B, n, L]`` bool."""
    groups = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(groups, 1)
    v = values.double().repeat_interleave(groups, 1)
    scores = query.double() @ k.transpose(2, 3) * scaling
    scores = scores.masked_fill(~mask[:, None], -math.inf)
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return weights @ v


def layer_step(name, options, *, head_dim, heads=2, groups=1, batch=3, prompt=45, step=1, padded=False,
               dtype=torch.float32, window=None, seed=0):
    """A one-layer cache written with a prompt, then a ``step``-token update answered by placeholders; returns the
    query, the placeholders, the model-style mask and the dequantized keys/values of the non-fused path."""
    gen = torch.Generator().manual_seed(seed)
    cache = build_cache([window], name, residual_length=options.pop("residual_length", 0),
                        sink_tokens=options.pop("sink_tokens", 0), head_dim=head_dim, **options)
    layer = cache.layers[0]
    total = prompt + step
    mask = torch.ones(batch, total, dtype=torch.long)
    if padded:  # row 1 left-padded by 7, row 2 by 20
        mask[1, :7] = 0
        mask[2, :20] = 0
        cache.set_padding(mask)

    def states(n):
        return torch.randn(batch, heads, n, head_dim, generator=gen).to(dtype) * 2

    layer.update(states(prompt), states(prompt))
    layer.fused = True
    k_new, v_new = states(step), states(step)
    with fused.reading_codes():  # as kvquant's attention module hooks say while a fused model runs
        kph, vph = layer.update(k_new, v_new)
    assert hasattr(kph, "_kvquant_pending") and vph._kvquant_pending is kph._kvquant_pending, \
        "the short step was not answered by placeholders"
    assert kph.stride() == (0, 0, 0, 0) and bool(kph.isnan().all()), "a placeholder holds memory or numbers"
    pending = kph._kvquant_pending
    keys, values = pending.materialize(k_new)
    kv_len = keys.shape[2]
    # the model's mask: causal over the returned window, padding hidden, sliding window by position
    first = total - kv_len
    qpos = torch.arange(total - step, total)[:, None]
    kpos = torch.arange(first, total)[None, :]
    allowed = (kpos <= qpos)
    if window is not None:
        allowed &= kpos > qpos - window
    allowed = allowed[None].expand(batch, -1, -1) & mask[:, first:].bool()[:, None, :]
    query = torch.randn(batch, heads * groups, step, head_dim, generator=gen).to(dtype)
    return query, kph, vph, allowed, keys, values


def run_fused(query, kph, vph, allowed, groups, scaling):
    module = SimpleNamespace(num_key_value_groups=groups, training=False, is_causal=True)
    out, _ = fused.attention(module, query, kph, vph, allowed[:, None], scaling=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
def test_fused_step_equals_eager_attention_over_the_dequantized_cache(quantizer, head_dim, groups, padded,
                                                                      monkeypatch):
    calls = []
    original = kernels.attend_into
    monkeypatch.setattr(kernels, "attend_into", lambda *a: calls.append(1) or original(*a))
    name, options = QUANTIZERS[quantizer]
    query, kph, vph, allowed, keys, values = layer_step(name, dict(options), head_dim=head_dim, groups=groups,
                                                        padded=padded)
    scaling = head_dim**-0.5
    got = run_fused(query, kph, vph, allowed, groups, scaling)
    want = reference(query, keys, values, allowed, scaling)
    assert calls, "the kernel did not run"
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("case", ["sinks-residual", "chunk", "chunk-padded", "sliding", "sliding-chunk", "bf16"])
def test_fused_edges(case):
    kwargs = {"head_dim": 80, "groups": 2}
    options = {"group_size": 16, "residual_length": 0}
    if case == "sinks-residual":
        options.update(residual_length=10, sink_tokens=4)
    if case.startswith("chunk"):
        kwargs.update(step=5, padded=case.endswith("padded"))
    if case.startswith("sliding"):
        kwargs.update(window=24, step=3 if case.endswith("chunk") else 1, padded=True)
    if case == "bf16":
        kwargs.update(dtype=torch.bfloat16, padded=True)
    query, kph, vph, allowed, keys, values = layer_step("int4", options, **kwargs)
    scaling = 80**-0.5
    got = run_fused(query, kph, vph, allowed, 2, scaling)
    want = reference(query, keys, values, allowed, scaling)
    if case == "bf16":
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, atol=2**-7 * float(want.abs().max()), rtol=0)
    else:
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)


def test_a_mask_with_holes_reads_the_dequantized_copy(monkeypatch):
    monkeypatch.setattr(kernels, "attend_into", lambda *a: pytest.fail("the kernel ran on a mask with holes"))
    query, kph, vph, allowed, keys, values = layer_step("int4", {"group_size": 16}, head_dim=64)
    allowed = allowed.clone()
    allowed[:, :, 10] = False  # a hole: no contiguous range
    got = run_fused(query, kph, vph, allowed, 1, 0.125)
    torch.testing.assert_close(got.double(), reference(query, keys, values, allowed, 0.125), atol=2e-5, rtol=0)


def test_fused_int2_reads_the_codes_not_the_states():
    """The kernel's output is attention over the quantized K/V: far from attention over what was written."""
    torch.manual_seed(0)
    cache = build_cache([None], "int2", group_size=16, residual_length=0, head_dim=64)
    layer = cache.layers[0]
    k, v = torch.randn(1, 2, 64, 64), torch.randn(1, 2, 64, 64)
    layer.update(k[:, :, :63], v[:, :, :63])
    layer.fused = True
    with fused.reading_codes():
        kph, vph = layer.update(k[:, :, 63:], v[:, :, 63:])
    query = torch.randn(1, 2, 1, 64)
    everything = torch.ones(1, 1, 64, dtype=torch.bool)
    got = run_fused(query, kph, vph, everything, 1, 0.125)
    exact = reference(query, k, v, everything, 0.125)
    keys, values = kph._kvquant_pending.materialize(k)
    assert not torch.allclose(got.double(), exact, atol=1e-2)
    torch.testing.assert_close(got.double(), reference(query, keys, values, everything, 0.125), atol=2e-5, rtol=0)


def tiny_llama(head_dim=80, groups=2):
    config = LlamaConfig(vocab_size=97, hidden_size=4 * head_dim, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4 // groups, head_dim=head_dim,
                         max_position_embeddings=256)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_models_built_from_one_config_object_each_read_the_codes(monkeypatch):
    """``LlamaForCausalLM(config)`` keeps the config object itself, so a second model built from it finds the config
    already switched to kvquant's attention. Each model's decode steps must still run the kernel (failed before: the
    second ``enable_fused_decode`` returned early and left the model's attention modules unhooked, so its steps read
    the dequantized copy without a word; found on a GPU by experiments/gpu_check.py)."""
    config = LlamaConfig(vocab_size=97, hidden_size=320, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=80, max_position_embeddings=256)
    ids = torch.randint(3, 97, (1, 33), generator=torch.Generator().manual_seed(4))
    calls, kernel = [], fused.attend_codes
    monkeypatch.setattr(fused, "attend_codes", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        assert model.config is config
        kvquant.enable_fused_decode(model)
        cache = kvquant.make_cache(model, "int4", group_size=16, residual_length=0)
        calls.clear()
        with torch.no_grad():
            model(ids[:, :32], cache=cache)  # prefill: the attention the model had before (not kvquant's again)
            fused_logits = model(ids[:, 32:], cache=cache).logits
        assert len(calls) == config.num_hidden_layers, f"model {seed}: the kernel ran {len(calls)} times"
        copy = kvquant.make_cache(model, "int4", group_size=16, residual_length=0)
        with torch.no_grad(), fused.reading_codes(False):
            model(ids[:, :32], cache=copy)
            torch.testing.assert_close(model(ids[:, 32:], cache=copy).logits, fused_logits, atol=2e-5, rtol=0)


@pytest.mark.parametrize("name,options", [("fp16", {}), ("int4", {"group_size": 16, "residual_length": 8})])
def test_generate_with_fused_decode_equals_generate_without(name, options):
    """A padded batch through generate: same tokens, logits equal within float rounding (the identity cache and a
    residual window keep every token's stored form independent of the attention arithmetic)."""
    ids = torch.randint(3, 97, (3, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :12] = 0
    outs = []
    for on in (False, True):
        model = tiny_llama()
        if on:
            kvquant.enable_fused_decode(model)
        cache = kvquant.make_cache(model, name, **options).set_padding(mask)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=12, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        outs.append((out.sequences, torch.stack(out.logits)))
        if on:
            assert all(layer.fused for layer in cache.layers)
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-4, rtol=0)


def test_enable_fused_decode_keeps_the_previous_attention_for_prefill():
    model = tiny_llama()
    ids = torch.randint(3, 97, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids).logits
        kvquant.enable_fused_decode(model)
        after = model(ids).logits
    assert fused.is_fused(model.config)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)


def test_a_step_that_records_attentions_reads_the_copy_and_returns_the_weights():
    """With eager attention and ``output_attentions``, a decode step returns the weights the model computes over
    the dequantized cache, as without fused decode (the kernel computes none)."""
    ids = torch.randint(3, 97, (1, 21), generator=torch.Generator().manual_seed(3))
    steps = []
    for on in (False, True):
        model = tiny_llama()
        model.set_attn_implementation("eager")
        if on:
            kvquant.enable_fused_decode(model)
        cache = kvquant.make_cache(model, "int4", group_size=16, residual_length=0)
        with torch.no_grad():
            model(ids[:, :20], cache=cache)
            steps.append(model(ids[:, 20:], cache=cache, output_attentions=True).attentions)
    assert len(steps[1]) == 2 and all(a is not None for a in steps[1])
    for got, want in zip(steps[1], steps[0]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


STORIES = "/work/shared/data/models/stories260K/hf"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("declared", [False, True])
def test_left_padded_short_prompt_without_declared_padding(attn, declared, model):
    """A 9-token left-padded prompt (a step the kernel could take) then token by token: fused equals unfused on
    the real positions. Without declared padding the padding queries read no key; eager attention averages every
    value there (and those outputs become the next layer's stored padding K/V), so such a step reads the copy.
    Failed before: 0.32 off with eager and undeclared padding."""
    path = model.name_or_path
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 512, (2, 30), generator=gen)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :3] = 0
    outs = []
    for on in (False, True):
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()
        if on:
            kvquant.enable_fused_decode(m)
        cache = kvquant.make_cache(m, "int4", group_size=8, residual_length=0)
        if declared:
            cache.set_padding(mask)
        with torch.no_grad():
            logits = [m(ids[:, :9], attention_mask=mask[:, :9], cache=cache).logits]
            for i in range(9, 30):
                logits.append(m(ids[:, i : i + 1], attention_mask=mask[:, : i + 1], cache=cache).logits)
        outs.append(torch.cat(logits, 1)[mask.bool()])
    # every token is quantized on write, so float rounding of one path can flip a later code (1.6e-4 seen)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-3, rtol=0)


def int4_model(fused_decode: bool):
    """:func:`tiny_llama`, with fused decode on or off, and an int4 cache for it (groups of 16, every token read
    quantized)."""
    model = tiny_llama()
    if fused_decode:
        kvquant.enable_fused_decode(model)
    return model, kvquant.make_cache(model, "int4", group_size=16, residual_length=0)


def test_gradients_flow_through_a_fused_step():
    """The kernels compute no gradients: a step recorded by autograd reads the copy (failed before: no gradient)."""
    grads = []
    for on in (False, True):
        model, cache = int4_model(fused_decode=on)
        ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            model(ids[:, :32], cache=cache)
        model(ids[:, 32:], cache=cache).logits.sum().backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad)
    assert grads[1] is not None
    torch.testing.assert_close(grads[1], grads[0], atol=1e-4, rtol=1e-4)


def test_a_fused_cache_read_by_another_attention_reads_the_dequantized_copy():
    """Undoing fused decode (or lending the cache to an unfused model) cannot compute silently wrong numbers: only
    kvquant's attention gets placeholders, any other the dequantized copy (failed before: logits 0.156 off, finite;
    then a broadcast NaN, which the next layer refused, but a one-layer model turned into NaN logits: issue 36,
    tests/test_cache_inputs.py)."""
    ids = torch.randint(3, 97, (1, 33), generator=torch.Generator().manual_seed(4))
    logits = []
    for on in (True, False):
        model, cache = int4_model(fused_decode=on)
        with torch.no_grad():
            model(ids[:, :32], cache=cache)
            model.set_attn_implementation("sdpa")
            logits.append(model(ids[:, 32:], cache=cache).logits)
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)


def test_values_changed_before_attention_are_refused():
    query, kph, vph, allowed, _, values = layer_step("int4", {"group_size": 16}, head_dim=64)
    with pytest.raises(kvquant.KVQuantError, match="changes the keys or values"):
        run_fused(query, kph, values, allowed, 1, 0.125)


def test_a_block_mask_reads_the_copy(monkeypatch):
    """flex attention's masks are not tensors: such calls read the copy (failed before: AttributeError)."""
    monkeypatch.setattr(kernels, "attend_into", lambda *a: pytest.fail("the kernel ran on a block mask"))
    _, kph, _, _, _, _ = layer_step("int4", {"group_size": 16}, head_dim=64)
    assert kph._kvquant_pending.ranges(object(), 1) is None


def test_unverified_model_types_are_refused():
    from transformers import FalconConfig

    model = AutoModelForCausalLM.from_config(FalconConfig(vocab_size=64, hidden_size=32, num_attention_heads=4,
                                                          num_hidden_layers=1))
    with pytest.raises(kvquant.KVQuantError, match="verified for model types"):
        kvquant.enable_fused_decode(model)
    assert not fused.is_fused(model.config)


@pytest.mark.parametrize("break_it, message", [
    (lambda k, ko: ko.__setitem__(2, 0), "group"),                       # a group of 0 channels (was SIGFPE)
    (lambda k, ko: k.__setitem__(7, k[7][:1]), "per-row counts"),       # skip for one row of three (read past it)
    (lambda k, ko: k[3].fill_(10**6), "names slot"),                    # a slot beyond the pool
])
def test_the_kernel_refuses_inconsistent_arguments(break_it, message):
    query, kph, vph, allowed, _, _ = layer_step("int4", {"group_size": 16, "key_axis": "token"}, head_dim=64)
    pending = kph._kvquant_pending
    k, ko = fused._args(fused.stream(pending.keys, pending.counts))
    v, vo = fused._args(fused.stream(pending.values, pending.counts))
    k = [t.clone() for t in k]
    break_it(k, ko)
    lo, hi = pending.ranges(allowed[:, None], 1)
    with pytest.raises(RuntimeError, match=message):
        kernels.attend_into(query, k, ko, v, vo, lo, hi, 0.125, torch.empty_like(query))
