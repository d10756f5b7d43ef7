"""Prefix sharing: rows forked from one prefilled row store the prefix's quantized units once (the same tensors),
compute what each row computes alone, and the bytes saved equal the planner's ``--shared-prefix`` figure."""

import pytest
import torch
import transformers

import kvquant
from kvquant.cache import stack_rows
from kvquant.planner.shapes import Planner, shape_from_config

ROWS, PREFIX, SUFFIX = 4, 37, 9


def model_of():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(torch.float64)


SETTINGS = [{"quantizer": "int4", "group_size": 8, "residual_length": 5, "sink_tokens": 2},
            {"quantizer": "fp8_e4m3", "residual_length": 0},
            {"quantizer": "int2", "group_size": 4, "residual_length": 0, "rotation": "hadamard"},
            {"quantizer": "fp16"}]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s["quantizer"])
def test_forked_rows_share_the_prefix_and_compute_what_each_row_computes_alone(settings):
    model = model_of()
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 64, (1, PREFIX), generator=gen)
    suffixes = torch.randint(0, 64, (ROWS, SUFFIX), generator=gen)
    shared = kvquant.make_cache(model, **settings)
    with torch.no_grad():
        model(prefix, cache=shared)
        shareable = shared.memory_report()["shareable_bytes"]
        batch = stack_rows([(shared, 0)] * ROWS)
        logits = [model(suffixes[:, :4], cache=batch).logits]  # a chunk, then token by token
        for i in range(4, SUFFIX):
            logits.append(model(suffixes[:, i : i + 1], cache=batch).logits)
        logits = torch.cat(logits, dim=1)
        alone_bytes = 0
        for r in range(ROWS):
            alone = kvquant.make_cache(model, **settings)
            model(prefix, cache=alone)
            want = torch.cat([model(suffixes[r : r + 1, :4], cache=alone).logits] +
                             [model(suffixes[r : r + 1, i : i + 1], cache=alone).logits for i in range(4, SUFFIX)], 1)
            assert torch.allclose(logits[r], want[0], rtol=0, atol=1e-12), f"row {r}"
            alone_bytes += alone.memory_report()["total_bytes"]
    report = batch.memory_report()
    assert shareable > 0
    assert report["shared_saved_bytes"] == (ROWS - 1) * shareable
    assert report["total_bytes"] == alone_bytes - (ROWS - 1) * shareable
    # the units really are stored once: every row's prefix units are the first row's slots
    k = batch.layers[0].k
    prefix_units = shared.layers[0].k.units[0]
    assert prefix_units > 0
    assert all(torch.equal(k.table[r, :prefix_units], k.table[0, :prefix_units]) for r in range(ROWS))
    # the planner's --shared-prefix figure (its arithmetic, at this model's float64 states) is what was measured
    planner = Planner(shape_from_config(model.config, "tiny"), settings, torch.float64)
    assert (ROWS - 1) * planner.memory(1, PREFIX)["shareable_bytes"] == report["shared_saved_bytes"]


def test_many_forks_merge_segments_and_still_read_what_was_written():
    """Beam search forks every step: reads stay exact and forking leaks no storage."""
    model = model_of()
    ids = torch.randint(0, 64, (1, 60), generator=torch.Generator().manual_seed(6))
    forked = kvquant.make_cache(model, "int4", group_size=4, residual_length=0)
    plain = kvquant.make_cache(model, "int4", group_size=4, residual_length=0)
    with torch.no_grad():
        model(ids[:, :10], cache=forked)
        model(ids[:, :10], cache=plain)
        for i in range(10, 60):
            forked.fork([0, 0])
            forked.fork([1])
            a = model(ids[:, i : i + 1], cache=forked).logits
            b = model(ids[:, i : i + 1], cache=plain).logits
            assert torch.equal(a, b), i
    assert forked.layers[0].v.top == plain.layers[0].v.top  # no slot is left behind by the forks
    assert forked.memory_report()["total_bytes"] == plain.memory_report()["total_bytes"]
