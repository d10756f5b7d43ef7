"""Serving engines' KV formats (``kvquant/formats/vllm.py``, ``kvquant/formats/sglang.py``) against references written
here from the published formats.

The references compute with numpy float32 scalars per (token, head) or per block, and search the e2m1 grid by
distance, so they share no code with the quantizers. Codes, scales and dequantized states are compared exactly;
two places are compared to 1e-6 and say why. Shapes: head_dim 64, 80, 128 and 256 where a format allows it, and a
GQA model (4 query heads, 2 KV heads) with sliding windows, prompts shorter and longer than the window.
"""

import dataclasses
import math

import numpy as np
import pytest
import torch
import transformers

import kvquant
from kvquant.formats import engine_math
from kvquant.formats.quantizers import Alike
from kvquant.formats.sglang import Mxfp8Codec
from kvquant.formats.vllm import VllmFp8PerTokenHead
from kvquant.cache import simulate_memory
from kvquant.errors import KVQuantError
from reference import FakeQuantReference, Spec

HEAD_DIMS = [64, 80, 128, 256]
F32 = np.float32
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def states(d: int, heads: int = 3, tokens: int = 5, seed: int = 0, spread: float = 3.0) -> torch.Tensor:
    """``[2, heads, tokens, d]`` float32 states with an outlier channel and an all-zero token (scales floor)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, heads, tokens, d, generator=g) * spread
    x[0, 0, 0, 5] = 40.0
    x[1, 1, 2] = 0.0
    # rounding ties: int8 scale 127 / 127 = 1 puts 2.5, -3.5, ... on halves; min 0, max 15 does for uint4
    x[1, 0, 1] = 0.0
    x[1, 0, 1, :6] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5])
    x[1, 0, 3] = 1.0
    x[1, 0, 3, :6] = torch.tensor([0.0, 15.0, 2.5, 7.5, 0.5, 14.5])
    return x


def codec_pair(name: str, d: int, **options):
    return kvquant.get_quantizer(name, **options).codecs(d)


def decoded(codec, x):
    enc = codec.encode(x)
    out = torch.full_like(x, float("nan"))
    codec.decode_into(enc, out)
    return enc, out


def vectors(x: torch.Tensor):
    """Every (token, head) vector of ``x`` as float32 numpy, with its index."""
    flat = x.reshape(-1, x.shape[-1]).numpy().astype(F32)
    return list(enumerate(flat))


def half_away(v: float) -> float:
    return math.copysign(math.floor(abs(v) + 0.5), v)


def e4m3(values) -> np.ndarray:
    """float32 values cast to e4m3 saturating at ±448 (torch's round-half-even cast), back as float32."""
    t = torch.tensor(np.asarray(values, dtype=F32)).clamp(-448, 448)
    return t.to(torch.float8_e4m3fn).float().numpy()


def e2m1_nearest(v: float) -> float:
    """The e2m1 value nearest ``v`` (saturating at ±6), a tie to the even mantissa (even grid index); the sign is
    kept, so a small negative value rounds to -0 (code 8)."""
    m = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1[i] - m), i % 2))
    return math.copysign(E2M1[best], v)


# --- per token and head: int8 and fp8 (vLLM triton_reshape_and_cache_flash.py:168-283) ----------------------


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
def test_per_token_head_codes_scales_and_reads_equal_the_reference(d, fp8):
    x = states(d)
    codec, value_codec = codec_pair("vllm_fp8_per_token_head" if fp8 else "vllm_int8_per_token_head", d)
    assert codec == value_codec
    enc, out = decoded(codec, x)
    codes = enc["payload"].float().reshape(-1, d).numpy()
    scales = enc["scale"].reshape(-1).numpy()
    qmax = F32(448.0 if fp8 else 127.0)
    for i, v in vectors(x):
        scale = max(F32(np.abs(v).max()) / qmax, F32(1e-6))
        assert scales[i] == scale
        scaled = (v * (F32(1.0) / scale)).astype(F32)
        want = e4m3(scaled) if fp8 else np.array([min(max(half_away(q), -128), 127) for q in scaled], dtype=F32)
        assert np.array_equal(codes[i], want), i
        assert np.array_equal(out.reshape(-1, d)[i].numpy(), (want * scale).astype(F32))
    if not fp8:
        assert codes.min() >= -127 and codes.max() == 127  # the absolute maximum lands on 127; -128 never
    assert enc["payload"].dtype == (torch.float8_e4m3fn if fp8 else torch.int8) and enc["scale"].dtype == torch.float32


# --- int4 per token and head: rotation, uint4, zero point in the scale (int4_per_token_head.py) -----------------


def rotation_reference(d: int) -> tuple[np.ndarray, int]:
    """``R`` with ``rht(x) = x @ R.T`` (block-diagonal ``H_b diag(s)``), and b."""
    b = d & -d
    g = torch.Generator(device="cpu").manual_seed(0x9E3779B9)
    signs = (2.0 * torch.bernoulli(torch.full((b,), 0.5), generator=g) - 1.0).numpy()
    h = np.array([[1.0]])
    while h.shape[0] < b:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return np.kron(np.eye(d // b), h * signs[None, :]), b


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_int4_per_token_head_equals_the_reference(d):
    # integer states: every sum of the Hadamard butterfly is exact in float32, so the rotation is exact here too
    x = torch.randint(-60, 61, (2, 3, 5, d)).float()
    x[1, 1, 2] = 0.0
    codec, _ = codec_pair("vllm_int4_per_token_head", d)
    enc, out = decoded(codec, x)
    rotation, b = rotation_reference(d)
    payload = enc["payload"].reshape(-1, d // 2).numpy()
    bits = enc["scale"].reshape(-1).view(torch.int32).numpy()
    for i, v in vectors(x):
        y = (rotation @ v.astype(np.float64)).astype(F32)
        low, high = y.min(), y.max()
        scale = max((high - low) / F32(15.0), F32(1e-6))
        zero = min(max(half_away(-low / scale), 0), 15)
        q = np.array([min(max(half_away(F32(t * (F32(1.0) / scale)) + F32(zero)), 0), 15) for t in y], dtype=np.uint8)
        assert np.array_equal(payload[i], q[0::2] | (q[1::2] << 4)), i  # element 2i in the low nibble
        stored = int(np.array([scale], dtype=F32).view(np.int32)[0])
        assert bits[i] == (stored & ~0xF) | int(zero)  # the zero point in the scale's 4 low mantissa bits
        effective = np.array([stored & ~0xF], dtype=np.int32).view(F32)[0]
        back = rotation.T @ ((q.astype(F32) - F32(zero)) * effective).astype(np.float64) / b
        # the read rotates back with the float32 butterfly, the reference in float64: equal to float32 rounding
        assert np.allclose(out.reshape(-1, d)[i].numpy(), back, rtol=1e-6, atol=1e-6 * (np.abs(back).max() + 1e-30))
    assert enc["payload"].dtype == torch.uint8


# --- static fp8 (vLLM fp8 with checkpoint scales; quant_utils.cuh scaled_vec_conversion) -------------------------


def test_static_fp8_per_tensor_and_per_head_equal_the_reference_and_scale_one_saturates():
    x = states(128, heads=2) * 10  # |x| up to ~400, the outlier 400
    x[0, 1, 3, 7] = 700.0
    for scales in (1.0, 0.5, [0.9, 2.0]):
        codec, _ = codec_pair("vllm_fp8", 128, k_scale=scales, v_scale=scales)
        enc, out = decoded(codec, x)
        per_head = np.broadcast_to(np.asarray(scales, dtype=F32).reshape(1, -1, 1, 1), (1, 2, 1, 1))
        want = e4m3((x.numpy() / per_head).astype(F32))
        assert np.array_equal(enc["payload"].float().numpy(), want)
        assert np.array_equal(out.numpy(), (want * per_head).astype(F32))
    codec, _ = codec_pair("vllm_fp8", 128)  # no checkpoint scales: vLLM runs at 1.0, and 700 saturates at 448
    _, out = decoded(codec, x)
    assert out[0, 1, 3, 7] == 448.0
    with pytest.raises(KVQuantError, match="3 per-head scales for a layer of 2 KV heads"):
        codec_pair("vllm_fp8", 128, k_scale=[1.0, 1.0, 1.0])[0].encode(x)


# --- nvfp4 (nvfp4_kv_cache_kernels.cu): e2m1 in blocks of 16, e4m3 block scales, a global scale ---------------


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("global_scale", [1.0, 0.004])
def test_nvfp4_equals_the_reference(d, global_scale):
    x = states(d, tokens=4)
    codec, _ = codec_pair("vllm_nvfp4", d, k_scale=global_scale)
    enc, out = decoded(codec, x)
    payload = enc["payload"].reshape(-1, d // 2).numpy()
    block_scales = enc["scale"].float().reshape(-1, d // 16).numpy()
    g = F32(global_scale)
    for i, v in vectors(x):
        want, codes = [], []
        for j, block in enumerate(v.reshape(-1, 16)):
            sf = e4m3([(F32(1.0) / g) * (F32(np.abs(block).max()) * (F32(1.0) / F32(6.0)))])[0]
            assert block_scales[i, j] == sf
            factor = F32(sf * (F32(1.0) / (F32(1.0) / g)))
            out_scale = F32(1.0) / factor if factor != 0 else F32(0.0)
            values = [e2m1_nearest(float(F32(t * out_scale))) for t in block]
            codes += [E2M1.index(abs(val)) | (8 if math.copysign(1, val) < 0 else 0) for val in values]
            want += [F32(val) * sf * g for val in values]
        codes = np.array(codes, dtype=np.uint8)
        assert np.array_equal(payload[i], codes[0::2] | (codes[1::2] << 4)), i  # signs and both nibbles
        assert np.array_equal(out.reshape(-1, d)[i].numpy(), np.array(want, dtype=F32)), i


def test_e2m1_rounds_half_to_even_and_saturates():
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -100.0, 0.2, 2.6])
    got = engine_math.e2m1_values(engine_math.e2m1_codes(grid))
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -6.0, 0.0, 3.0]
    assert [e2m1_nearest(float(v)) for v in grid] == got.tolist()
    assert engine_math.e2m1_codes(torch.tensor([-0.1, 0.1])).tolist() == [8, 0]  # -0 keeps its sign bit


# --- SGLang mxfp8 (mxfp8_quant.py:19-60): e4m3 in blocks of 32, e8m0 scale ----------------------------------


@pytest.mark.parametrize("d", [64, 128, 256])
def test_mxfp8_equals_the_reference(d):
    x = states(d)
    codec, _ = codec_pair("sglang_mxfp8", d)
    enc, out = decoded(codec, x)
    exponents = enc["exponent"].reshape(-1, d // 32).numpy()
    for i, v in vectors(x):
        want = []
        for j, block in enumerate(v.reshape(-1, 32)):
            amax = max(F32(np.abs(block).max()), F32(1e-30))
            e = min(max(math.ceil(math.log2(F32(amax / F32(448.0)))) + 127, 0), 254)
            assert exponents[i, j] == e
            want += list(e4m3((block / F32(2.0 ** (e - 127))).astype(F32)) * F32(2.0 ** (e - 127)))
        assert np.array_equal(out.reshape(-1, d)[i].numpy(), np.array(want, dtype=F32)), i
    assert enc["exponent"].dtype == torch.uint8


# --- TurboQuant (turboquant/, triton_turboquant_store.py, triton_turboquant_decode.py) ----------------------

#: vLLM's 4-bit centroids for head_dim 128 (fp32 hex), from running vLLM 0.33.0's solve_lloyd_max(128, 4)
CENTROIDS_128_4BIT = ["0x1.73f75cp-7", "0x1.190ab2p-5", "0x1.dba1c2p-5", "0x1.5533e4p-4", "0x1.c6d056p-4",
                      "0x1.24de2ep-3", "0x1.766dcep-3", "0x1.ee5988p-3"]


def test_lloyd_max_centroids_are_vllms_and_scale_with_the_head_dim():
    positive = [float.fromhex(h) for h in CENTROIDS_128_4BIT]
    assert engine_math.lloyd_max_centroids(128, 4).tolist() == [-c for c in positive[::-1]] + positive
    # N(0, 1/d): the d = 256 centroids are the d = 64 ones halved, exactly (both solves run the same steps)
    assert torch.equal(engine_math.lloyd_max_centroids(256, 4) * 2, engine_math.lloyd_max_centroids(64, 4))


def uint4_minmax_reference(v: np.ndarray):
    low, high = F32(v.min()), F32(v.max())
    scale = (high - low) / F32(15.0)
    scale = scale if scale > F32(1e-8) else F32(1e-8)
    q = np.array([min(max(math.trunc(float(F32((t - low) / scale) + F32(0.5))), 0), 15) for t in v], dtype=np.uint8)
    read = (q.astype(F32) * F32(np.float16(scale)) + F32(np.float16(low))).astype(F32)
    return q, np.float16(scale), np.float16(low), read


@pytest.mark.parametrize("d", [64, 128, 256])
def test_turboquant_presets_equal_the_reference(d):
    x = states(d)
    keys8, values = codec_pair("vllm_turboquant_k8v4", d)
    keys_mse, values_nc = codec_pair("vllm_turboquant_4bit_nc", d)
    assert values == values_nc
    enc_v, out_v = decoded(values, x)
    for i, v in vectors(x):
        q, scale, low, read = uint4_minmax_reference(v)
        assert np.array_equal(enc_v["payload"].reshape(-1, d // 2).numpy()[i], q[0::2] | (q[1::2] << 4))
        assert enc_v["scale"].reshape(-1).numpy()[i] == scale and enc_v["minimum"].reshape(-1).numpy()[i] == low
        assert np.array_equal(out_v.reshape(-1, d)[i].numpy(), read)
    _, out_k8 = decoded(keys8, x)  # e4m3 with no scale: 40 keeps its code, nothing is scaled
    assert np.array_equal(out_k8.numpy(), e4m3(x.numpy()))
    enc_k, out_k = decoded(keys_mse, x)
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    rotation = torch.tensor(h / math.sqrt(d), dtype=torch.float32)
    centroids = engine_math.lloyd_max_centroids(d, 4)
    midpoints = ((centroids[:-1] + centroids[1:]) / 2).numpy()
    flat = x.reshape(-1, d)
    norms = flat.norm(dim=-1, keepdim=True)
    rotated = ((flat / (norms + 1e-8)) @ rotation).numpy()
    for i in range(flat.shape[0]):
        codes = np.searchsorted(midpoints, rotated[i], side="right")  # midpoints at or below: ties go up
        assert np.array_equal(enc_k["payload"].reshape(-1, d // 2).numpy()[i], codes[0::2] | (codes[1::2] << 4)), i
        c = centroids.numpy()[codes].astype(np.float64)
        want = float(np.float16(norms[i, 0].item())) * c / math.sqrt((c * c).sum() + 1e-16) @ (h / math.sqrt(d))
        # float32 read (one matmul) against this float64 one: equal to float32 rounding
        assert np.allclose(out_k.reshape(-1, d)[i].numpy(), want, rtol=1e-6, atol=1e-6 * np.abs(want).max()), i


# --- bits per element, head_dim rules, bad options ---------------------------------------------------------

CLOSED_FORM = {  # bits per element as each engine stores keys and values, at head_dim d
    "vllm_fp8": lambda d: 8.0,
    "vllm_fp8_per_token_head": lambda d: 8 + 32 / d,
    "vllm_int8_per_token_head": lambda d: 8 + 32 / d,
    "vllm_int4_per_token_head": lambda d: 4 + 32 / d,
    "vllm_nvfp4": lambda d: 4.5,
    "vllm_turboquant_k8v4": lambda d: (8 + 4 + 32 / d) / 2,
    "vllm_turboquant_4bit_nc": lambda d: (4 + 16 / d + 4 + 32 / d) / 2,
    "sglang_mxfp8": lambda d: 8.25,
}


def config(d: int, layers: int = 2, **extra):
    return transformers.LlamaConfig(vocab_size=96, hidden_size=4 * d, intermediate_size=64, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=d, **extra)


@pytest.mark.parametrize("name", CLOSED_FORM)
def test_bits_per_element_in_memory_report_and_planner_equal_the_closed_form(name):
    for d in (64, 128, 256):
        cache = kvquant.make_cache(config(d), name, residual_length=0)
        x = states(d, heads=2, tokens=7)
        for layer in range(2):
            cache.update(x, x, layer)
        assert cache.memory_report()["bits_per_element"] == pytest.approx(CLOSED_FORM[name](d), rel=1e-12)
        simulated = simulate_memory([None, None], {"quantizer": name, "residual_length": 0}, batch=3, kv_heads=2,
                                    head_dim=d, tokens=100, dtype=torch.bfloat16)
        assert simulated["bits_per_element"] == pytest.approx(CLOSED_FORM[name](d), rel=1e-12)
    assert CLOSED_FORM["vllm_turboquant_k8v4"](128) == 6.125 and CLOSED_FORM["vllm_turboquant_4bit_nc"](128) == 4.1875


@pytest.mark.parametrize("name, d, message", [
    ("sglang_mxfp8", 80, "head_dim 80 is not a multiple of 32"),
    ("vllm_turboquant_4bit_nc", 80, "head_dim 80 is not a power of two"),
    ("vllm_nvfp4", 72, "head_dim 72 is not a multiple of 16"),
    ("vllm_int4_per_token_head", 63, r"head_dim 63 is not a multiple of 2 \(two codes per byte\)"),
    ("vllm_turboquant_k8v4", 63, r"head_dim 63 is not a multiple of 2 \(two value codes per byte\)"),
])
def test_head_dims_a_format_cannot_store_are_refused(name, d, message):
    with pytest.raises(KVQuantError, match=message):
        codec_pair(name, d)


def test_a_format_codec_that_binds_like_a_method_is_still_called_bare():
    """From Python 3.14 a ``functools.partial`` class attribute binds to the instance as a method does (as a plain
    function always has): ``Alike`` must call its ``codec`` without the quantizer as a first argument."""

    @dataclasses.dataclass(frozen=True)
    class Bare(Alike):
        name = "bare"

        def codec():  # a method descriptor taking no argument: called with self, it raises TypeError
            return Mxfp8Codec()

    assert Bare().codecs(64) == (Mxfp8Codec(), Mxfp8Codec())


@pytest.mark.parametrize("options, message", [
    ({"k_scale": 0.0}, "k_scale must be a positive number"),
    ({"v_scale": [1.0, float("nan")]}, "v_scale must be a positive number"),
    ({"k_scale": "1"}, "k_scale must be a positive number"),
])
def test_bad_static_scales_are_refused(options, message):
    with pytest.raises(KVQuantError, match=message):
        kvquant.get_quantizer("vllm_fp8", **options)


def test_an_unknown_engine_format_names_the_available_ones():
    with pytest.raises(KVQuantError, match="vllm_int8_per_token_head"):
        kvquant.make_cache(config(64), "vllm_int9_per_token_head")


# --- through a model: attention reads the engine's stored K/V -------------------------------------------


def reference_spec(name: str, role: int) -> Spec:
    """A fake-quant reference of the format for one stream, built from this file's per-vector references."""
    def per_vector(fn):
        def apply(body: torch.Tensor) -> torch.Tensor:
            flat = body.reshape(-1, body.shape[-1]).numpy().astype(F32)
            return torch.tensor(np.stack([fn(v) for v in flat])).reshape(body.shape) if len(flat) else body
        return Spec("fn", fn=apply)

    if name == "vllm_int8_per_token_head":
        def int8(v):
            scale = max(F32(np.abs(v).max()) / F32(127.0), F32(1e-6))
            q = np.array([min(max(half_away(t), -128), 127) for t in (v * (F32(1.0) / scale)).astype(F32)], dtype=F32)
            return (q * scale).astype(F32)
        return per_vector(int8)
    if name == "vllm_turboquant_k8v4":
        return Spec("fn", fn=lambda body: torch.tensor(e4m3(body.numpy()))) if role == 0 else \
            per_vector(lambda v: uint4_minmax_reference(v)[3])
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["vllm_int8_per_token_head", "vllm_turboquant_k8v4"])
@pytest.mark.parametrize("prompt", [5, 40])
def test_a_gqa_sliding_window_model_reads_what_the_reference_stores(name, prompt):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=96, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=24)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 96, (1, prompt + 6))

    def logits(cache):
        with torch.no_grad():
            out = [model(ids[:, :prompt], cache=cache, use_cache=True).logits]
            out += [model(ids[:, i : i + 1], cache=cache, use_cache=True).logits for i in range(prompt, ids.shape[1])]
        return torch.cat(out, 1)

    ours = logits(kvquant.make_cache(model, name, residual_length=0))
    reference = logits(FakeQuantReference(model, reference_spec(name, 0), reference_spec(name, 1)))
    plain = logits(kvquant.make_cache(model, "fp16"))
    assert torch.allclose(ours, reference, atol=1e-5, rtol=1e-5)  # two fp32 attention passes: rounding apart
    assert (ours - plain).abs().max() > 1e-4  # attention read the quantized states


def test_every_engine_format_says_how_its_engine_runs_it_and_research_formats_do_not():
    """``export`` writes a format's flags from its class: every vLLM/SGLang format names its engine and its
    ``--kv-cache-dtype`` value; kvquant's own formats name none, nor does a subclass of an engine format that
    does not name them itself (it may store something else)."""
    from kvquant.integrations.deploy import serving_of

    flags = {n: serving_of(n) for n in kvquant.available_quantizers() if serving_of(n)}
    assert set(flags) == {n for n in kvquant.available_quantizers() if n.startswith(("vllm_", "sglang_"))}
    assert len(flags) == 8 and serving_of("int4") is None and serving_of(None) is None
    for name, serving in flags.items():
        assert serving.engine == ("vLLM" if name.startswith("vllm_") else "SGLang") and name.endswith(serving.flag)
        assert serving.needs

    @kvquant.register_quantizer("my_fp8_variant")
    @dataclasses.dataclass(frozen=True)
    class MyVariant(VllmFp8PerTokenHead):
        """A research variant of an engine format."""

    try:
        assert serving_of("my_fp8_variant") is None
    finally:
        del kvquant.formats.quantizers.QUANTIZERS.classes["my_fp8_variant"]


def test_every_registered_quantizer_is_itself_a_frozen_dataclass():
    """Not only through its base: a subclass that is not a dataclass itself lets an instance's class attributes
    (``serving``, ``codec``) be shadowed by assignment."""
    from kvquant.formats.quantizers import QUANTIZERS

    for name, cls in QUANTIZERS.classes.items():
        params = cls.__dict__.get("__dataclass_params__")
        assert params is not None and params.frozen, name
    with pytest.raises(dataclasses.FrozenInstanceError):
        kvquant.get_quantizer("vllm_fp8_per_token_head").serving = None
