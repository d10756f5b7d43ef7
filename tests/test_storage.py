"""The batched store on its own (no model): rows of different lengths written in chunks read back exactly what
each row wrote, each row's units equal that row encoded alone, and all rows are encoded in one codec call."""

import pytest
import torch

import kvquant
from kvquant.cache import Store

HEADS, HEAD_DIM = 2, 8


def codecs(name, **options):
    return kvquant.get_quantizer(name, **options).codecs(HEAD_DIM)


def chunks(seed, rows, steps):
    """Per step ``[rows, H, n, D]`` states and per-row counts of real tokens (the rest zeros), varying by row."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in steps:
        x = torch.randn(rows, HEADS, n, HEAD_DIM, generator=gen)
        counts = torch.randint(0, n + 1, (rows,), generator=gen).tolist()
        for r, c in enumerate(counts):
            x[r, :, c:] = 0
        out.append((x, counts))
    return out


@pytest.mark.parametrize("sinks, residual", [(0, 0), (3, 0), (0, 5), (2, 7)])
def test_identity_rows_read_back_exactly_what_each_wrote(sinks, residual):
    rows, steps = 4, [9, 1, 1, 17, 4, 1]
    key_codec, _ = codecs("fp16")
    store = Store(key_codec, sinks, residual, torch.zeros(rows, HEADS, 0, HEAD_DIM), rows)
    written = [torch.zeros(HEADS, 0, HEAD_DIM) for _ in range(rows)]
    for x, counts in chunks(1, rows, steps):
        store.append(x, counts)
        for r, c in enumerate(counts):
            written[r] = torch.cat([written[r], x[r, :, :c]], dim=1)
        most = max(w.shape[1] for w in written)
        real = torch.zeros(rows, most + 2, dtype=torch.bool)  # right-aligned, two padding positions in front
        for r, w in enumerate(written):
            real[r, most + 2 - w.shape[1] :] = True
        out = torch.full((rows, HEADS, most + 2, HEAD_DIM), float("nan"))
        store.read(out, real, [w.shape[1] for w in written])
        for r, w in enumerate(written):
            assert torch.equal(out[r, :, most + 2 - w.shape[1] :], w)
            assert torch.equal(out[r, :, : most + 2 - w.shape[1]], torch.zeros_like(out[r, :, : most + 2 - w.shape[1]]))
            assert store.n_sinks[r] == min(sinks, w.shape[1])
            assert store.stored_tokens(r) == w.shape[1]


@pytest.mark.parametrize("name, options", [("int4", {"group_size": 4}), ("int8", {}), ("fp8_e4m3", {}),
                                           ("int2", {"group_size": 4})])
def test_each_row_is_encoded_as_alone_and_all_rows_in_one_call(name, options, monkeypatch):
    rows = 5
    key_codec, value_codec = codecs(name, **options)
    for codec in (key_codec, value_codec):
        calls = []
        encode = type(codec).encode
        monkeypatch.setattr(type(codec), "encode", lambda self, x, encode=encode, calls=calls: calls.append(x.shape) or
                            encode(self, x))
        store = Store(codec, 0, 0, torch.zeros(rows, HEADS, 0, HEAD_DIM), rows)
        written = [torch.zeros(HEADS, 0, HEAD_DIM) for _ in range(rows)]
        for x, counts in chunks(2, rows, [7, 3, 1, 12]):
            before = len(calls)
            store.append(x, counts)
            assert len(calls) - before <= 1  # one codec call for every row of the update
            for r, c in enumerate(counts):
                written[r] = torch.cat([written[r], x[r, :, :c]], dim=1)
        monkeypatch.undo()
        for r, w in enumerate(written):
            whole = w.shape[1] // store.unit * store.unit
            assert store.units[r] * store.unit == whole and store.n_tail[r] == w.shape[1] - whole
            if not whole:
                continue
            # alone: the row's flushes as they happened are whole units, so encoding them at once gives the
            # same units for per-unit scales (the fp8 per-tensor scale is per write, not checked here)
            alone = codec.encode(w[None, :, :whole])
            for role, p in store.pool.items():
                mine = p[store.table[r, : store.units[r]]]
                assert torch.equal(mine, alone[role][0].transpose(0, 1)), (name, role, r)


def test_an_update_of_no_tokens_stores_nothing_and_returns_what_is_held():
    model_config = __import__("transformers").LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
                                                         head_dim=8, num_hidden_layers=1, vocab_size=8)
    cache = kvquant.make_cache(model_config, "int4", group_size=4, residual_length=0)
    x = torch.randn(2, 2, 6, 8)
    cache.set_padding(torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]))
    keys, values = cache.update(x, x, 0)
    again, _ = cache.update(x[:, :, :0], x[:, :, :0], 0)
    assert torch.equal(again, keys) and cache.get_seq_length() == 6
