"""Divergence by position (kvquant/scoring/longctx.py) against an independent computation written here: the
baseline through transformers' own ``DynamicCache`` and each candidate through ``kvquant.make_cache``, fed the
same chunks, every position's logits kept whole, KL by ``torch.nn.functional.kl_div`` and agreement by argmax.

Tolerance: 1e-9 nats on KL where a document is scored alone (the same forwards, the same float64 formula up to
summation order); batched rows of different lengths move the logits by float noise of batched matmuls (1e-4).
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import kvquant
from kvquant.errors import KVQuantError
from kvquant.scoring.longctx import position_divergences
from kvquant.scoring.scorer import Scorer

CHUNK = 48
SETTINGS = {"int8": {"group_size": 32, "residual_length": 0}, "int2": {"group_size": 32, "residual_length": 0}}


@pytest.fixture(scope="module")
def documents(tokenizer, stories):
    """Three real documents of different lengths (several chunks each; 2 tokens: one position)."""
    ids = [tokenizer(s).input_ids for s in stories[:40]]
    joined = [t for doc in ids for t in doc]
    return [joined[:301], joined[400:555], joined[700:702]]


def scorers(model, batch_size=1):
    baseline = Scorer(model, kvquant.CacheSpec.of("fp16"), mode="streaming", chunk_size=CHUNK, batch_size=batch_size)
    return baseline, [Scorer(model, kvquant.CacheSpec.of(q, dict(o)), mode="streaming", chunk_size=CHUNK,
                             batch_size=batch_size) for q, o in SETTINGS.items()]


@torch.inference_mode()
def chunked_logits(model, cache, doc: list[int]) -> torch.Tensor:
    """``[len(doc) - 1, vocab]``: the logits at every position, the document fed CHUNK tokens at a time."""
    ids = torch.tensor([doc[:-1]])
    return torch.cat([model(ids[:, i : i + CHUNK], cache=cache, use_cache=True).logits[0].float()
                      for i in range(0, ids.shape[1], CHUNK)])


def independent(model, doc: list[int]):
    """Per candidate of SETTINGS: (KL per position, top-1 agreement per position), computed without kvquant's
    scorer."""
    p = chunked_logits(model, DynamicCache(config=model.config), doc).double().log_softmax(-1)
    out = []
    for q, options in SETTINGS.items():
        logq = chunked_logits(model, kvquant.make_cache(model, q, **options), doc).double().log_softmax(-1)
        kl = F.kl_div(logq, p, log_target=True, reduction="none").sum(-1)
        out.append((kl, (logq.argmax(-1) == p.argmax(-1)).int()))
    return out


def test_each_position_equals_the_independent_computation(model, documents):
    base, candidates = scorers(model)
    got = position_divergences(base, candidates, documents)
    for d, doc in enumerate(documents):
        for (kl, top1), result in zip(independent(model, doc), got):
            assert len(result["kl"][d]) == len(doc) - 1
            torch.testing.assert_close(torch.tensor(result["kl"][d], dtype=torch.float64), kl, atol=1e-9, rtol=0)
            assert result["top1"][d] == top1.tolist()
    # the quantized K/V were read: int2 diverges, more than int8, and both reads were quantized
    int8, int2 = (torch.tensor([x for doc in r["kl"] for x in doc]).mean() for r in got)
    assert 0 < int8 < int2
    assert all(r["reads"]["keys_quantized"] > 0 for r in got)


def test_what_attention_read_is_kept_per_chunk(model, documents):
    """Per chunk of positions, what each candidate's attention read: every query of a chunk starting at ``s``
    reads ``s + j + 1`` keys in each layer, the chunks add up to the whole, and with a residual window as long as
    a chunk nothing the first chunk's queries read is quantized (the long-context gate counts a bucket's exercise
    from its chunks)."""
    doc = documents[0]
    base = Scorer(model, kvquant.CacheSpec.of("fp16"), mode="streaming", chunk_size=CHUNK)
    windowed = Scorer(model, kvquant.CacheSpec.of("int2", {"group_size": 8, "residual_length": CHUNK}),
                      mode="streaming", chunk_size=CHUNK)
    got, = position_divergences(base, [windowed], [doc])
    layers = model.config.num_hidden_layers
    assert [c[0] for c in got["chunk_reads"]] == list(range(0, len(doc) - 1, CHUNK))
    for start, stop, reads in got["chunk_reads"]:
        queries = min(stop, len(doc) - 1) - start
        assert stop == start + CHUNK and reads["keys"] == layers * sum(start + j + 1 for j in range(queries))
    assert got["chunk_reads"][0][2]["keys_quantized"] == got["chunk_reads"][0][2]["values_quantized"] == 0
    assert all(c[2]["keys_quantized"] > 0 for c in got["chunk_reads"][2:])
    for name in got["reads"]:
        assert sum(c[2][name] for c in got["chunk_reads"]) == got["reads"][name]


def test_batched_rows_of_different_lengths_equal_each_document_alone(model, documents):
    alone = position_divergences(*scorers(model, batch_size=1), documents)
    batched = position_divergences(*scorers(model, batch_size=3), documents)
    for a, b in zip(alone, batched):
        assert [len(x) for x in a["kl"]] == [len(x) for x in b["kl"]] == [len(d) - 1 for d in documents]
        for x, y in zip(a["kl"], b["kl"]):
            torch.testing.assert_close(torch.tensor(y), torch.tensor(x), atol=1e-4, rtol=1e-3)


def test_bad_inputs_are_one_line_errors(model, documents):
    base, candidates = scorers(model)
    with pytest.raises(KVQuantError, match="at least 2 tokens"):
        position_divergences(base, candidates, [documents[0], [5]])
    other = Scorer(model, kvquant.CacheSpec.of("int8"), mode="streaming", chunk_size=CHUNK + 1)
    with pytest.raises(KVQuantError, match="one chunk_size"):
        position_divergences(base, [other], documents)
