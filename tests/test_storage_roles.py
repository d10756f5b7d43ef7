"""Storage roles (kvquant/formats/roles.py): each codec declares the role of every tensor it stores, so
``memory_report()`` and the planner file codes under ``payload_bytes``, every per-group metadata (scales, zero points,
minimums, shared exponents, norms) under ``scale_bytes`` and only states kept at the model's precision under
``full_precision_bytes``; a stored tensor of no declared role is refused at the first write; the fused kernels number
the stored forms from one Python enum.

The expected bytes come from each format's published layout (bits per element, block size, scale dtype), written
out below independently of the codecs, for states ``[1, HEADS, TOKENS, HEAD_DIM]`` in float16 with no residual
window and no sinks.
"""

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import kvquant
from kvquant.cache import build_cache, fused, triton_attend
from kvquant.formats.roles import StorageRole, StreamKind, check_roles
from kvquant.cache.streams import stream
from kvquant.errors import KVQuantError
from kvquant.planner.shapes import ModelShape, Planner
from kvquant.formats.quantizers import Codec, Quantizer
from kvquant.formats.research import Fp8Codec

HEADS, HEAD_DIM, TOKENS, LAYERS = 2, 64, 300, 2
DTYPE_BYTES = 2  # float16 states: what a full-precision token costs per element
CATEGORIES = ("payload_bytes", "scale_bytes", "full_precision_bytes")


@dataclass(frozen=True)
class Layout:
    """One stream's published layout at head_dim 64: ``bits`` of payload per element, ``meta`` bytes of metadata per
    quantized token and head, ``unit`` tokens quantized together (tokens of an incomplete unit stay full precision)."""

    bits: float
    meta: float
    unit: int = 1


def per_token(bits, meta):
    return (Layout(bits, meta), Layout(bits, meta))


INT_KEYS = 2 * 2 * HEAD_DIM  # per-channel fp16 scale and zero point, per group of tokens and head
LAYOUTS = {
    # fp8: one fp16 scale per token and head
    "fp8_e4m3": per_token(8, 2), "fp8_e5m2": per_token(8, 2),
    # KIVI-style integers: keys per channel over groups of 32 tokens (int8: 128), values per token over groups of
    # 32 channels (int8: 128, capped at head_dim: one group of 64); an fp16 scale and zero point per group
    "int2": (Layout(2, INT_KEYS / 32, 32), Layout(2, 2 * 2 * HEAD_DIM / 32)),
    "int4": (Layout(4, INT_KEYS / 32, 32), Layout(4, 2 * 2 * HEAD_DIM / 32)),
    "int8": (Layout(8, INT_KEYS / 128, 128), Layout(8, 2 * 2)),
    # llama.cpp's ggml blocks of 32: fp16 d (and m for q4_1/q5_1) per block; q5 blocks: 4 bytes of high bits
    "llamacpp_q8_0": per_token(8, 2 * HEAD_DIM / 32), "llamacpp_q4_0": per_token(4, 2 * HEAD_DIM / 32),
    "llamacpp_q4_1": per_token(4, 4 * HEAD_DIM / 32), "llamacpp_q5_0": per_token(5, 2 * HEAD_DIM / 32),
    "llamacpp_q5_1": per_token(5, 4 * HEAD_DIM / 32), "llamacpp_iq4_nl": per_token(4, 2 * HEAD_DIM / 32),
    "llamacpp_f16": per_token(16, 0), "llamacpp_bf16": per_token(16, 0), "llamacpp_f32": per_token(32, 0),
    # SGLang mxfp8: e4m3 codes, one e8m0 exponent byte per 32 channels
    "sglang_mxfp8": per_token(8, HEAD_DIM / 32),
    # vLLM: fp8 with the layer's static scale (nothing stored per token); per token and head an fp32 scale (int4:
    # the zero point in its low bits); nvfp4: e2m1 codes, one e4m3 scale per 16 channels
    "vllm_fp8": per_token(8, 0), "vllm_fp8_per_token_head": per_token(8, 4),
    "vllm_int8_per_token_head": per_token(8, 4), "vllm_int4_per_token_head": per_token(4, 4),
    "vllm_nvfp4": per_token(4, HEAD_DIM / 16),
    # TurboQuant: keys 4-bit Lloyd-Max codes and an fp16 norm (k8v4: bare e4m3), values 4-bit with fp16 scale and
    # minimum, per token and head
    "vllm_turboquant_4bit_nc": (Layout(4, 2), Layout(4, 4)),
    "vllm_turboquant_k8v4": (Layout(8, 0), Layout(4, 4)),
    # non-uniform codebooks (kvquant/formats/lowbit.py): 4-bit codes, one fp16 scale (RMS or largest |x|) per token
    # and head
    "lloyd_max": per_token(4, 2), "normal_float": per_token(4, 2), "fitted_levels": per_token(4, 2),
}
#: formats of required options, with the options written here: keys_values stores its keys as int4 stores its keys
#: and its values as vllm_nvfp4 stores its values, so each stream has its own format's layout
OPTIONS = {"keys_values": {"keys": {"quantizer": "int4"}, "values": {"quantizer": "vllm_nvfp4"}}}
LAYOUTS["keys_values"] = (LAYOUTS["int4"][0], LAYOUTS["vllm_nvfp4"][1])


def expected(name: str, sinks: int = 0, residual: int = 0) -> dict[str, int]:
    """The three categories after writing TOKENS tokens to each of LAYERS layers, from :data:`LAYOUTS`."""
    if name == "fp16":  # the baseline keeps every token at the model's precision
        return {"payload_bytes": 0, "scale_bytes": 0,
                "full_precision_bytes": LAYERS * 2 * TOKENS * HEADS * HEAD_DIM * DTYPE_BYTES}
    out = dict.fromkeys(CATEGORIES, 0)
    for layout in LAYOUTS[name]:
        quantized = (TOKENS - sinks - residual) // layout.unit * layout.unit
        out["payload_bytes"] += LAYERS * int(quantized * HEADS * HEAD_DIM * layout.bits / 8)
        out["scale_bytes"] += LAYERS * int(quantized * HEADS * layout.meta)
        out["full_precision_bytes"] += LAYERS * (TOKENS - quantized) * HEADS * HEAD_DIM * DTYPE_BYTES
    return out


def written_report(name: str, **settings) -> dict:
    cache = build_cache([None] * LAYERS, name, head_dim=HEAD_DIM,
                        **{"residual_length": 0, **OPTIONS.get(name, {}), **settings})
    torch.manual_seed(0)
    for layer in cache.layers:
        keys, values = (torch.randn(1, HEADS, TOKENS, HEAD_DIM, dtype=torch.float16) for _ in range(2))
        layer.update(keys, values)
    return cache.memory_report()


def planned(name: str, **settings) -> dict:
    shape = ModelShape("roles", [None] * LAYERS, HEADS, HEAD_DIM, 0.0)
    return Planner(shape, {"quantizer": name, "residual_length": 0, **OPTIONS.get(name, {}), **settings},
                   torch.float16).memory(1, TOKENS)


def test_every_format_has_a_published_layout_here():
    assert set(kvquant.available_quantizers()) == {"fp16", *LAYOUTS}


@pytest.mark.parametrize("name", kvquant.available_quantizers())
def test_memory_report_files_each_stored_tensor_by_its_role(name):
    """Payload and metadata bytes as the format's layout gives them; nothing quantized counted as full precision
    (only the int formats' keys of an incomplete group of tokens, and the fp16 baseline, are)."""
    report = written_report(name)
    assert {key: report[key] for key in CATEGORIES} == expected(name)
    assert report["total_bytes"] == sum(expected(name).values())


@pytest.mark.parametrize("name", kvquant.available_quantizers())
def test_the_planner_files_the_bytes_as_the_cache_does(name):
    report, plan = written_report(name), planned(name)
    assert {key: plan[key] for key in CATEGORIES} == {key: report[key] for key in CATEGORIES} == expected(name)


@pytest.mark.parametrize("name", ["vllm_turboquant_4bit_nc", "sglang_mxfp8", "llamacpp_q4_1", "lloyd_max"])
def test_sinks_and_the_residual_window_are_the_full_precision_bytes(name):
    settings = {"sink_tokens": 4, "residual_length": 16}
    report, plan = written_report(name, **settings), planned(name, **settings)
    want = expected(name, sinks=4, residual=16)
    assert want["full_precision_bytes"] == LAYERS * 2 * 20 * HEADS * HEAD_DIM * DTYPE_BYTES
    assert {key: report[key] for key in CATEGORIES} == {key: plan[key] for key in CATEGORIES} == want


# -- a codec that does not declare a stored tensor ---------------------------------------------------------------
@dataclass(frozen=True)
class UndeclaredCodec(Fp8Codec):
    """fp8 codes plus a tensor ``mystery`` whose role nobody declared."""

    def encode(self, x):
        return {**super().encode(x), "mystery": x[..., :1].clone()}

    def decode_into(self, enc, out):
        super().decode_into({key: enc[key] for key in ("payload", "scale")}, out)


@dataclass(frozen=True)
class Undeclared(Quantizer):
    name = "undeclared"

    def _codecs(self, head_dim):
        codec = UndeclaredCodec(torch.float8_e4m3fn, "token")
        return codec, codec


def test_a_stored_tensor_of_no_declared_role_is_refused_at_the_first_write():
    cache = build_cache([None], Undeclared(), residual_length=0, head_dim=HEAD_DIM)
    states = torch.randn(1, HEADS, 8, HEAD_DIM)
    with pytest.raises(KVQuantError, match=r"UndeclaredCodec stores a tensor 'mystery' whose storage role it does "
                                           r"not declare \(declared: 'payload', 'scale'\)") as err:
        cache.layers[0].update(states, states)
    assert "\n" not in str(err.value)
    assert not cache.layers[0].k.pool  # nothing was encoded into the pool


def test_a_codec_declaring_no_roles_is_refused_too():
    class Bare(Codec):
        def encode(self, x):
            return {"payload": x.clone()}

    with pytest.raises(KVQuantError, match=r"Bare stores a tensor 'payload' .*\(declared: none\)"):
        check_roles(Bare(), {"payload": torch.zeros(1)})


def test_every_declared_role_is_a_storage_role():
    for name in kvquant.available_quantizers():
        for codec in kvquant.get_quantizer(name, **OPTIONS.get(name, {})).codecs(HEAD_DIM):
            assert codec.roles and all(isinstance(role, StorageRole) for role in codec.roles.values()), name


# -- the kernels' stream kinds ---------------------------------------------------------------------------------
def test_the_cpp_kernel_numbers_the_stream_kinds_as_python_does():
    source = (Path(kvquant.__file__).parent / "formats" / "csrc" / "dequant.cpp").read_text()
    body = re.search(r"enum Kind : int64_t \{([^}]*)\};", source).group(1)
    cpp = {name: int(value) for name, value in re.findall(r"KIND_(\w+) = (\d+)", body)}
    assert cpp == {kind.name: kind.value for kind in StreamKind}


@pytest.mark.parametrize("name, options, kind", [
    ("int4", {}, StreamKind.INT), ("fp8_e4m3", {}, StreamKind.FP8_E4M3), ("fp8_e5m2", {}, StreamKind.FP8_E5M2),
    ("fp16", {}, StreamKind.FULL)])
def test_both_kernels_are_handed_the_stream_kind_numbers(name, options, kind):
    """What the C++ kernel's and the Triton kernel's launchers pass as a stream's kind, for stores of each form."""
    cache = build_cache([None], name, residual_length=0, head_dim=HEAD_DIM, **options)
    states = torch.randn(1, HEADS, 64, HEAD_DIM)
    cache.layers[0].update(states, states)
    store = cache.layers[0].k
    s = stream(store, [store.stored_tokens(0)])
    assert fused._args(s)[1][0] == kind
    assert triton_attend._stream_args(s, torch.float32, HEAD_DIM, HEADS, 1, torch.device("cpu"))[1][0] == kind
