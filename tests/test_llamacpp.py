"""llama.cpp's KV cache types (``kvquant/formats/llamacpp.py``) against references written from llama.cpp's C code.

The references (``tests/llamacpp_reference.py``) follow the C functions of the llama.cpp that llama-cpp-python 0.3.36
vendors, one block at a time with numpy float32 scalars: ``quantize_row_*_ref`` and ``dequantize_row_*``
(ggml/src/ggml-quants.c), x86's and ARM's ``quantize_row_q8_0`` (ggml-cpu/arch/*/quants.c), iq4_nl's
``quantize_row_iq4_nl_impl`` and ``best_index_int8``, ggml-cpu's fast Walsh-Hadamard transform (ggml-cpu/ops.cpp
``ggml_compute_forward_fwht``) and ``ggml_gen_hadamard``, and which head sizes are rotated by which block
(src/llama-kv-cache.cpp). They write ggml's block structs byte for byte, so codes, scales and layout are compared
exactly, and reads exactly too.
"""

import re

import numpy as np
import pytest
import torch
import transformers
import yaml

import kvquant
import kvquant.run
import kvquant.runner.pipeline
from kvquant import plan
from kvquant.formats import llamacpp
from kvquant.formats import llamacpp_gguf
from kvquant.cache import simulate_memory
from kvquant.errors import KVQuantError
from llamacpp_reference import (F32, KVALUES, gen_hadamard, ref_block, ref_dequantize, ref_fwht, ref_iq4_nl, ref_q8_0,
    ref_query_row, ref_symmetric, reference_attention, reference_spec, rotated)
from reference import FakeQuantReference

TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
#: head size -> (K block, V block) llama.cpp rotates with, worked out by hand from build_input_k_rot/v_rot
ROTATED = {64: (64, 64), 96: (None, None), 128: (128, 64), 160: (None, None), 192: (64, 64), 256: (256, 64),
           320: (64, 64), 384: (128, 64), 512: (512, 64)}
BITS = {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "iq4_nl": 4.5, "f16": 16.0, "bf16": 16.0,
        "f32": 32.0}

#: a block (Gaussian, found by search) whose q8_0 codes differ between x86's id = 127 / amax and ARM's 1 / d
Q8_ID_BLOCK = [
    2.9649009704589844, 2.703153610229492, 2.589904308319092, -2.0037219524383545, -3.3490943908691406,
    2.3068392276763916, -6.0204267501831055, -3.130267858505249, 8.315119743347168, -6.282598972320557,
    1.0561480522155762, 2.0189096927642822, -3.1115832328796387, 0.3326649069786072, 0.15279912948608398,
    -6.015461444854736, 5.209123611450195, -0.40990206599235535, 0.37558457255363464, 2.3998641967773438,
    -4.172413349151611, 5.721079349517822, -4.772845268249512, 1.8005180358886719, -0.8245852589607239,
    -3.537402868270874, 1.8532459735870361, 2.580209732055664, -3.687218427658081, -2.0692241191864014,
    -4.8335676193237305, 1.7579424381256104,
]
#: a block whose iq4_nl scale, rounded to fp16, differs between ggml's sums in element order and pairwise sums
IQ4_ORDER_BLOCK = [
    -1.5640254020690918, -0.5981162786483765, 1.4161107540130615, -0.37782567739486694, -0.33055251836776733,
    -0.007411103695631027, -0.3546362817287445, -0.029629020020365715, 0.6888951659202576, -0.6435962915420532,
    0.70223468542099, 1.3271136283874512, -1.3931694030761719, -0.5606873035430908, -1.1910619735717773,
    -0.3612566292285919, -0.7238016724586487, 1.1405556201934814, 0.5942923426628113, 0.9351563453674316,
    -1.4225915670394897, -0.09078133851289749, 0.26400041580200195, -0.5442217588424683, 1.9280779361724854,
    0.5931491851806641, 0.8719741702079773, -1.0937635898590088, 0.6533424854278564, 0.2600725293159485,
    -1.4193185567855835, -0.29704591631889343,
]


# --- states ------------------------------------------------------------------------------------------------


def states(d: int, heads: int = 2, tokens: int = 3, seed: int = 0) -> torch.Tensor:
    """``[2, heads, tokens, d]`` float32: Gaussian rows plus blocks that hit ggml's edge cases (rounding ties, the
    first of two equal magnitudes, an all-zero block with a -0, a constant block, an iq4_nl tie, a near-zero
    block)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, heads, tokens, d, generator=g) * 2.0
    specials = [
        [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5],  # q8_0: d = 1, ties
        [-8.0, 0.4, -0.6, -0.5, 0.5, 7.5, -7.5, 8.0],  # q4_0: d = 1, id = 1: truncation, not rounding
        [-5.0, 5.0, 2.5, -2.5, 1.25],  # first of equal magnitudes: the negative one
        [0.0, -0.0],  # all zero
        [-127.0, -93.5, 100.0, -4.5, 19.0],  # iq4_nl: d0 = 1, ties between table entries
    ]
    for i, values in enumerate(specials):
        row = x[1, 0, i % tokens]
        block = (i // tokens) % (d // 32)
        row[block * 32 : block * 32 + 32] = 0.0
        row[block * 32 : block * 32 + len(values)] = torch.tensor(values)
    x[1, 1, 0, :32] = 3.0  # constant block
    x[1, 1, 1, :32] = 1e-16  # below iq4_nl's GROUP_MAX_EPS
    return x


def rows(x: torch.Tensor):
    return x.reshape(-1, x.shape[-1]).numpy().astype(F32)


def encoded_and_read(codec, x):
    enc = codec.encode(x)
    out = torch.full_like(x, float("nan"))
    codec.decode_into(enc, out)
    return enc, out


def check_stream(kind, codec, x, block, cpu="x86"):
    """Stored bytes and read values of one stream equal the reference's, block by block."""
    enc, out = encoded_and_read(codec, x)
    stored = llamacpp.block_bytes(kind, enc).reshape(-1, x.shape[-1] // 32, llamacpp.BLOCK_BYTES[kind]).numpy()
    read = rows(out)
    for r, row in enumerate(rows(x)):
        y = rotated(row, block)
        values = []
        for b in range(len(row) // 32):
            expected, codes = ref_block(kind, y[b * 32 : b * 32 + 32], cpu)
            got = stored[r, b].tobytes()
            if codes is None:  # iq4_nl near-zero block: d = 0, codes whatever ggml's buffer held
                assert got[:2] == expected[:2]
            else:
                assert got == expected, (kind, r, b)
            values += ref_dequantize(kind, expected + got[len(expected):])
        assert np.array_equal(read[r], np.array(rotated(values, block), dtype=F32)), (kind, r)


# --- by value: every type, rotation on and off, head sizes 64/96/128/256 --------------------------------------


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("attn_rot", [None, False])
def test_stored_blocks_and_reads_equal_ggml(kind, d, attn_rot):
    key, value = kvquant.get_quantizer(f"llamacpp_{kind}", attn_rot=attn_rot).codecs(d)
    blocks = ROTATED[d] if attn_rot is None else (None, None)
    for codec, block, seed in ((key, blocks[0], 0), (value, blocks[1], 1)):
        assert getattr(codec, "block", None) == block
        check_stream(kind, codec, states(d, seed=seed), block)


@pytest.mark.parametrize("cpu", ["x86", "arm", "scalar"])
def test_q8_0_rounds_as_each_cpu_build_does(cpu):
    key, value = kvquant.get_quantizer("llamacpp_q8_0", cpu=cpu, attn_rot=False).codecs(64)
    check_stream("q8_0", key, states(64), None, cpu)
    enc = key.encode(torch.tensor([127.0, 2.5, -3.5, 0.5] + [0.0] * 28).view(1, 1, 1, 32))
    assert enc["payload"].flatten()[:4].tolist() == ([127, 2, -4, 0] if cpu != "scalar" else [127, 3, -4, 1])
    block = torch.tensor(Q8_ID_BLOCK).view(1, 1, 1, 32)
    check_stream("q8_0", key, block, None, cpu)
    assert key.encode(block)["payload"][0, 0, 0, 23] == (28 if cpu == "x86" else 27)


def test_iq4_nl_sums_its_fit_in_ggmls_order():
    block = torch.tensor(IQ4_ORDER_BLOCK).view(1, 1, 1, 32)
    key, _ = kvquant.get_quantizer("llamacpp_iq4_nl", attn_rot=False).codecs(32)
    check_stream("iq4_nl", key, block, None)
    values = torch.tensor([KVALUES[c] for c in ref_iq4_nl(block.flatten().numpy())[2]], dtype=torch.float32)
    w_q = block.flatten() ** 2 * values
    pairwise = ((w_q * block.flatten()).sum() / (w_q * values).sum()).half()
    assert key.encode(block)["scale"].flatten()[0] != pairwise  # the order of the sums shows in the fp16 scale


def test_the_edge_blocks_are_what_ggml_stores():
    """The references' answers on the hand-made blocks (so the states above do reach the edge cases)."""
    x = states(64)
    ties = x[1, 0, 0, :32].numpy().astype(F32)
    assert ref_q8_0(ties, "x86")[1][:7] == [127, 2, -4, 0, 0, 2, -126]
    assert ref_q8_0(ties, "scalar")[1][:7] == [127, 3, -4, 1, -1, 2, -127]
    trunc = x[1, 0, 1, :32].numpy().astype(F32)
    assert ref_symmetric(trunc, 8)[2][:8] == [0, 8, 7, 8, 9, 15, 1, 15]  # -7.5 + 8.5 truncated: 1 (rounding: 0)
    first = x[1, 0, 2, :32].numpy().astype(F32)
    assert ref_symmetric(first, 8)[0] == F32(5.0 / 8)  # max = -5 (the first), d = -5 / -8
    near_zero = x[1, 1, 1, :32].numpy().astype(F32)
    assert ref_iq4_nl(near_zero) == (F32(0), None, None)
    iq4 = x[1, 0, 1, 32:64].numpy().astype(F32)
    assert ref_iq4_nl(iq4)[2][:2] == [0, 2]  # -127 -> -127; -93.5, halfway between -104 and -83 -> -83


def test_rotation_follows_llama_cpp_head_sizes_and_types():
    q8 = kvquant.get_quantizer("llamacpp_q8_0")
    for d, blocks in ROTATED.items():
        assert q8.rotations(d) == blocks
        assert kvquant.get_quantizer("llamacpp_q8_0", attn_rot=False).rotations(d) == (None, None)
    mixed = kvquant.get_quantizer("llamacpp_q8_0", value_type="f16")
    assert mixed.rotations(128) == (128, None) and mixed.derived_settings(128)["value_type"] == "f16"
    assert kvquant.get_quantizer("llamacpp_f16", value_type="q4_0").rotations(256) == (None, 64)
    assert kvquant.get_quantizer("llamacpp_f16").rotations(128) == (None, None)
    assert kvquant.get_quantizer("llamacpp_q4_0", attn_rot=True).rotations(192) == (64, 64)


def test_the_transform_is_ggmls_orthonormal_walsh_hadamard_and_its_own_inverse():
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    for n in (64, 128, 256, 512):
        h = gen_hadamard(n)
        assert np.array_equal(h, h.T) and np.allclose(h.astype(np.float64) @ h, np.eye(n), atol=1e-6)
        got = llamacpp.fwht(x[:, :n], n)
        assert np.array_equal(got.numpy(), np.array([ref_fwht(r, n) for r in x[:, :n].numpy()], dtype=F32))
        assert np.allclose(got.numpy(), x[:, :n].numpy() @ h, atol=1e-5)
        assert torch.allclose(llamacpp.fwht(got, n), x[:, :n], atol=1e-5)
    two = llamacpp.fwht(x[:, :128], 64)
    assert torch.equal(two[:, 64:], llamacpp.fwht(x[:, 64:128], 64))  # consecutive blocks, each on its own


# --- K in a Llama-family GGUF's channel order ------------------------------------------------------------------


def convert_hf_to_gguf_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` of llama.cpp's convert_hf_to_gguf.py: each head's rows ``(2, D/2)`` -> ``(D/2, 2)``."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_gguf_order_is_the_permutation_a_llama_gguf_applies_to_k(d):
    rows_ = np.arange(3 * d)  # 3 KV heads' rows of k_proj, labelled by their transformers row
    gguf = convert_hf_to_gguf_permute(rows_, 3)
    order = llamacpp_gguf.gguf_order(d).numpy()
    for h in range(3):
        assert np.array_equal(gguf[h * d : (h + 1) * d], h * d + order)


@pytest.mark.parametrize("kind", ["q4_0", "q8_0", "iq4_nl"])
@pytest.mark.parametrize("d, attn_rot", [(64, False), (128, False), (128, None), (256, None), (96, None)])
def test_a_norm_layout_key_is_stored_and_read_in_gguf_order(kind, d, attn_rot):
    """rope_layout norm: K's blocks (and rotation) are those of the permuted row, which check_stream compares with
    ggml's references; the read and the converted query come back in the model's order. V is not permuted."""
    norm_key, norm_value = kvquant.get_quantizer(f"llamacpp_{kind}", attn_rot=attn_rot, rope_layout="norm").codecs(d)
    key, value = kvquant.get_quantizer(f"llamacpp_{kind}", attn_rot=attn_rot, rope_layout="neox").codecs(d)
    assert isinstance(norm_key, llamacpp_gguf.GgufOrderCodec) and norm_value == value
    x, order = states(d), llamacpp_gguf.gguf_order(d)
    blocks = ROTATED[d] if attn_rot is None else (None, None)
    check_stream(kind, key, x[..., order], blocks[0])
    enc, read = encoded_and_read(norm_key, x)
    want_enc, want_read = encoded_and_read(key, x[..., order])
    assert all(torch.equal(enc[role], want_enc[role]) for role in want_enc)
    assert torch.equal(read[..., order], want_read)
    q = torch.randn(1, 2, 5, d, generator=torch.Generator().manual_seed(d)) * 3
    assert torch.equal(norm_key.query(q)[..., order], key.query(q[..., order]))
    assert not torch.equal(norm_key.query(q), key.query(q))


def test_make_cache_takes_the_layout_from_the_model():
    def key_codec(cfg, **options):
        return kvquant.make_cache(cfg, "llamacpp_q4_0", **options).layers[0].quantizer.codecs(64)[0]

    llama = config(64, layers=1)
    gemma = transformers.Gemma3TextConfig(vocab_size=96, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    qwen = transformers.Qwen2Config(vocab_size=96, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1)
    assert isinstance(key_codec(llama), llamacpp_gguf.GgufOrderCodec)
    assert not isinstance(key_codec(gemma), llamacpp_gguf.GgufOrderCodec)
    assert not isinstance(key_codec(qwen), llamacpp_gguf.GgufOrderCodec)
    assert not isinstance(key_codec(llama, rope_layout="neox"), llamacpp_gguf.GgufOrderCodec)
    assert isinstance(key_codec(qwen, rope_layout="norm"), llamacpp_gguf.GgufOrderCodec)
    assert not isinstance(kvquant.get_quantizer("llamacpp_q4_0").codecs(64)[0], llamacpp_gguf.GgufOrderCodec)
    mixed = kvquant.make_cache(config(64), "int8", layers={1: {"quantizer": "llamacpp_q4_0"}})
    assert isinstance(mixed.layers[1].quantizer.codecs(64)[0], llamacpp_gguf.GgufOrderCodec)
    with pytest.raises(KVQuantError, match="rope_layout must be norm .*, got 'gpt'"):
        kvquant.get_quantizer("llamacpp_q4_0", rope_layout="gpt")


# --- the query as flash attention's K dot product reads it ---------------------------------------------------


@pytest.mark.parametrize("name, value_type, query_type", [
    ("llamacpp_q8_0", None, "q8_0"), ("llamacpp_q4_0", None, "q8_0"), ("llamacpp_q5_0", None, "q8_0"),
    ("llamacpp_iq4_nl", None, "q8_0"), ("llamacpp_q4_1", None, "q8_1"), ("llamacpp_q5_1", None, "q8_1"),
    ("llamacpp_f16", None, "f16"), ("llamacpp_f16", "q8_0", "f16-always"),
])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("n_rows", [3, 64])
def test_the_query_is_converted_to_ks_dot_product_type(name, value_type, query_type, d, n_rows):
    key, _ = kvquant.get_quantizer(name, value_type=value_type).codecs(d)
    q = torch.randn(1, 2, n_rows, d, generator=torch.Generator().manual_seed(d)) * 3
    got = rows(key.query(q))
    block = getattr(key, "block", None)
    kind, rows_seen = ("f16", 0) if query_type == "f16-always" else (query_type, n_rows)
    for r, row in enumerate(rows(q)):
        assert np.array_equal(got[r], np.array(ref_query_row(row, kind, block, rows_seen), dtype=F32)), r


def test_the_bf16_cache_reads_the_query_as_bf16():
    q = torch.randn(1, 1, 2, 64)
    assert torch.equal(kvquant.get_quantizer("llamacpp_bf16").codecs(64)[0].query(q), q.bfloat16().float())


@pytest.mark.parametrize("value_type, query_type", [(None, "f16"), ("f16", "f16"), ("q8_0", "f16-always"),
                                                    ("bf16", "f16-always")])
@pytest.mark.parametrize("n_rows", [3, 64])
def test_an_f32_cache_is_read_as_flash_attention_casts_it_to_f16(value_type, query_type, n_rows):
    """llama-graph.cpp casts an f32 K or V to f16 before flash attention: the states read back rounded to f16 (they
    are stored in 32 bits), and the query meets K as it meets an f16 K (llama.cpp's logits over an f32 cache equal
    those over an f16 cache bit for bit: reports/llamacpp-compare)."""
    key, value = kvquant.get_quantizer("llamacpp_f32", value_type=value_type).codecs(64)
    x = states(64) * 1e-3 + 1.0  # float32 values f16 cannot hold exactly
    _, read = encoded_and_read(key, x)
    assert torch.equal(read, x.half().float()) and not torch.equal(read, x)
    if value_type is None:
        assert torch.equal(encoded_and_read(value, x)[1], x.half().float())
        assert key.encode(x)["payload"].dtype == torch.float32  # 32 bits stored
    q = torch.randn(1, 2, n_rows, 64, generator=torch.Generator().manual_seed(n_rows)) * 3
    kind, rows_seen = ("f16", 0) if query_type == "f16-always" else (query_type, n_rows)
    for r, row in enumerate(rows(q)):
        assert np.array_equal(rows(key.query(q))[r], np.array(ref_query_row(row, kind, None, rows_seen), dtype=F32))
    with pytest.raises(KVQuantError, match="f32 cache, read by flash attention cast to f16"):
        kvquant.make_cache(config(64, layers=1), "llamacpp_f32").layers[0].update(x * 1e5, x, 0)


# --- bytes, error, through a model ----------------------------------------------------------------------------


def config(d: int, layers: int = 2):
    return transformers.LlamaConfig(vocab_size=96, hidden_size=4 * d, intermediate_size=64, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=d)


@pytest.mark.parametrize("kind", list(BITS))
def test_bits_per_element_as_llama_cpp_stores_them(kind):
    for d, attn_rot in ((64, None), (128, False), (256, None), (96, None)):
        cache = kvquant.make_cache(config(d), f"llamacpp_{kind}", attn_rot=attn_rot)
        x = states(d)
        for layer in range(2):
            cache.update(x, x, layer)
        assert cache.memory_report()["bits_per_element"] == BITS[kind]
        simulated = simulate_memory([None, None], {"quantizer": f"llamacpp_{kind}"}, batch=3, kv_heads=2,
                                    head_dim=d, tokens=100, dtype=torch.bfloat16)
        assert simulated["bits_per_element"] == BITS[kind]
    mixed = simulate_memory([None], {"quantizer": "llamacpp_q8_0", "value_type": "q4_0"}, batch=1, kv_heads=2,
                            head_dim=128, tokens=10)
    assert mixed["bits_per_element"] == (8.5 + 4.5) / 2


def test_sqnr_orders_the_types_as_their_bits_do_on_gaussian_data():
    x = torch.randn(4, 4, 64, 128, generator=torch.Generator().manual_seed(0))
    sqnr = {}
    for kind in TYPES:
        codec = kvquant.get_quantizer(f"llamacpp_{kind}", attn_rot=False).codecs(128)[0]
        sqnr[kind] = kvquant.formats.ops.sqnr_db(x, encoded_and_read(codec, x)[1])
    assert sqnr["q8_0"] > sqnr["q5_1"] >= sqnr["q5_0"] > sqnr["q4_1"] >= sqnr["q4_0"], sqnr
    assert sqnr["q8_0"] - sqnr["q4_0"] > 20, sqnr  # about 6 dB per bit


def test_rotation_lowers_q4_0_error_on_states_with_outlier_channels():
    x = torch.randn(2, 4, 64, 128, generator=torch.Generator().manual_seed(1))
    x[..., 5] *= 30
    x[..., 77] *= 20
    result = {}
    for attn_rot in (None, False):
        key, value = kvquant.get_quantizer("llamacpp_q4_0", attn_rot=attn_rot).codecs(128)
        result[attn_rot] = [kvquant.formats.ops.sqnr_db(x, encoded_and_read(c, x)[1]) for c in (key, value)]
    assert all(on > off + 3 for on, off in zip(result[None], result[False])), result


# --- refusals ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, options, d, message", [
    ("llamacpp_q4_0", {"key_type": "q2_K"}, 64, "key_type 'q2_K' is not a cache type llama.cpp allows"),
    ("llamacpp_q8_0", {"value_type": 8}, 64, "value_type 8 is not a cache type llama.cpp allows"),
    ("llamacpp_q4_0", {"attn_rot": True}, 96, "rotates only head sizes that are multiples of 64 .*, not head_dim 96"),
    ("llamacpp_f16", {"attn_rot": True}, 128, "rotates only quantized caches"),
    ("llamacpp_q4_0", {"attn_rot": "yes"}, 64, "attn_rot must be true, false or unset"),
    ("llamacpp_q8_0", {"cpu": "riscv"}, 64, "cpu must be one of x86, arm, scalar"),
    ("llamacpp_q5_0", {}, 80, r"head_dim 80 is not a multiple of 32 \(llama.cpp's q5_0 blocks of 32\)"),
])
def test_what_llama_cpp_does_not_allow_is_refused(name, options, d, message):
    with pytest.raises(KVQuantError, match=message):
        kvquant.get_quantizer(name, **options).codecs(d)


def test_an_unknown_llama_cpp_type_names_the_available_ones():
    with pytest.raises(KVQuantError, match="llamacpp_q4_0"):
        kvquant.make_cache(config(64), "llamacpp_q4_k")


@pytest.mark.parametrize("setting, needle", [
    ("llamacpp_q4_0:key_type=q3_K", "key_type 'q3_K' is not a cache type llama.cpp allows"),
    ("{quantizer: llamacpp_q4_0, attn_rot: true}", "not head_dim 96"),
])
def test_the_planner_refuses_in_one_line(tmp_path, capsys, setting, needle):
    model = tmp_path / "config.json"
    config(96).to_json_file(model)
    code = plan.main(["--model", str(model), "--context", "1024", "--cache", setting])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and needle in err[0], err


def test_states_beyond_what_the_fp16_scales_hold_are_refused_before_anything_is_stored():
    layer = kvquant.make_cache(config(64, layers=1), "llamacpp_q4_1", attn_rot=False).layers[0]
    with pytest.raises(KVQuantError, match=r"reach \|x\| = 1e\+05"):
        layer.update(torch.full((1, 2, 1, 64), 1e5), torch.zeros(1, 2, 1, 64))
    rotated_layer = kvquant.make_cache(config(64, layers=1), "llamacpp_q4_1").layers[0]
    x = torch.zeros(1, 2, 1, 64)
    x[..., :] = 60000.0  # within ±65504, but the rotated block's first element is 60000 * 64 / 8
    with pytest.raises(KVQuantError, match="rotated as llama.cpp rotates them"):
        rotated_layer.update(x, torch.zeros(1, 2, 1, 64))
    fine = torch.randn(1, 2, 3, 64)
    keys, _ = rotated_layer.update(fine, fine)
    assert keys.shape == (1, 2, 3, 64)  # nothing of the refused update was stored


# --- the query conversion reaches the model's attention --------------------------------------------------------


def fresh_model(d: int, attention: str = "sdpa"):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config(d), attn_implementation=attention).eval()


def teacher_forced(model, ids, cache):
    with torch.no_grad():
        out = [model(ids[:, :7], cache=cache, use_cache=True).logits]
        out += [model(ids[:, i : i + 1], cache=cache, use_cache=True).logits for i in range(7, ids.shape[1])]
    return torch.cat(out, 1)


@pytest.mark.parametrize("kind, d", [("q4_0", 64), ("q4_1", 96), ("q5_1", 96), ("iq4_nl", 128)])
def test_a_model_reads_the_stored_states_with_the_converted_query(kind, d):
    """Keys and values as the reference stores them, and the query as flash attention's K dot product reads it (in
    the model's channel order: the GGUF order of rope_layout norm is tested by value above, and against llama.cpp)."""
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(1))
    k_block, v_block = ROTATED[d]
    specs = reference_spec(kind, k_block), reference_spec(kind, v_block)
    model = fresh_model(d)
    ours = teacher_forced(model, ids, kvquant.make_cache(model, f"llamacpp_{kind}", rope_layout="neox"))
    assert model.config._attn_implementation == "kvquant_query_sdpa"  # make_cache enabled the conversion
    reference_model = fresh_model(d, reference_attention(llamacpp.VEC_DOT_TYPE[kind], k_block))
    reference = teacher_forced(reference_model, ids, FakeQuantReference(reference_model, *specs))
    unconverted = teacher_forced(fresh_model(d), ids, FakeQuantReference(fresh_model(d), *specs))
    assert torch.allclose(ours, reference, atol=1e-5, rtol=1e-5)
    assert (ours - unconverted).abs().max() > 1e-4  # the conversion changed what attention computed
    # another cache on the same model: no tag, the query goes through untouched
    assert torch.equal(teacher_forced(model, ids, kvquant.make_cache(model, "int4", residual_length=0)),
                       teacher_forced(fresh_model(d), ids, kvquant.make_cache(fresh_model(d), "int4",
                                                                               residual_length=0)))


def test_the_conversion_goes_behind_fused_decode_which_stays_on():
    from kvquant.cache.fused import is_fused

    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(2))
    model = fresh_model(64)
    kvquant.enable_fused_decode(model)
    ours = teacher_forced(model, ids, kvquant.make_cache(model, "llamacpp_q8_0", rope_layout="neox"))
    assert is_fused(model.config)
    reference_model = fresh_model(64, reference_attention("q8_0", 64))
    specs = reference_spec("q8_0", 64), reference_spec("q8_0", 64)
    assert torch.allclose(ours, teacher_forced(reference_model, ids, FakeQuantReference(reference_model, *specs)),
                          atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options, needle", [
    ({"attn_rot": True}, "rotates only head sizes that are multiples of 64 .*not head_dim 8"),
    ({"value_type": "q2_K"}, "value_type 'q2_K' is not a cache type llama.cpp allows"),
])
def test_the_runner_refuses_before_the_model_loads(tmp_path, capsys, monkeypatch, options, needle):
    def trap(*args, **kwargs):
        raise AssertionError("a model was loaded for a setting that should have been refused before")

    monkeypatch.setattr(kvquant.runner.pipeline, "load_model", trap)
    cfg = {"name": "llamacpp", "model": {"path": "local:models/stories260K/hf"}, "output_dir": str(tmp_path / "out"),
           "candidates": [{"quantizer": "llamacpp_q4_0", "name": "q4_0", "options": options}],
           "eval": {"perplexity": [{"name": "stories", "source": "local:text/tinystories/validation-first1000.jsonl",
                                    "limit": 4, "max_length": 64}]},
           "gate": {"perplexity": ["stories"], "bootstrap": 1000}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    code = kvquant.run.main([str(tmp_path / "c.yaml")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("kvquant: error: ") and re.search(needle, err[0]), err
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_run_states_no_rope_layout_against_the_model():
    """Issue 58: a run's ``rope_layout`` that contradicts the model's GGUF layout is refused (one line); the
    model's own, or none, is accepted, in a ``layers`` map too; other quantizers are not llama.cpp's and ignored."""
    llama = config(64, layers=1)
    qwen = transformers.Qwen2Config(vocab_size=96, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1)
    for model, own, other in ((llama, "norm", "neox"), (qwen, "neox", "norm")):
        llamacpp_gguf.check_rope_layout(model, "llamacpp_q4_0", {"rope_layout": own}, "c")
        llamacpp_gguf.check_rope_layout(model, "llamacpp_q4_0", {}, "c")
        llamacpp_gguf.check_rope_layout(model, "int4", {"layers": {0: {"quantizer": "int8"}}}, "c")
        with pytest.raises(KVQuantError, match=f"^c: rope_layout '{other}', but llama.cpp stores this model's K "
                                               f"\\('{model.model_type}'\\) in the '{own}' layout"):
            llamacpp_gguf.check_rope_layout(model, "llamacpp_q4_0", {"rope_layout": other}, "c")
        with pytest.raises(KVQuantError, match=f"^c: layers\\[1\\]: rope_layout '{other}'"):
            llamacpp_gguf.check_rope_layout(model, "int8", {"layers": {1: {"quantizer": "llamacpp_q8_0",
                                                                           "rope_layout": other}}}, "c")
