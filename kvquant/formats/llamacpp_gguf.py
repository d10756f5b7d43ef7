"""What llama.cpp does with a GGUF model that transformers does not, emulated on the transformers model: the two
causes of the differences between llama.cpp's KL divergences and kvquant's cache-only emulation
(``reports/llamacpp-compare``).

**K's channel order.** A Llama-family GGUF (llama.cpp's RoPE type NORM: :data:`NORM_ROPE_MODELS`) stores each Q and
K head with the two channels RoPE rotates together adjacent: ``convert_hf_to_gguf.py`` permutes the Q/K weights and
transformers' GGUF loader permutes them back (``LlamaTensorProcessor._reverse_permute_weights``). So llama.cpp's K
blocks of 32 (and its Hadamard rotation) see channels ``0, D/2, 1, D/2 + 1, ...`` of the model's head
(:func:`gguf_order`), not ``0, 1, 2, ...``. Unrotated q4_0 K on SmolLM2 costs 0.143 nats in llama.cpp, 0.080 in
the model's order and 0.151 in llama.cpp's. ``rope_layout: norm`` on a ``llamacpp_*`` quantizer stores K in that
order (:class:`GgufOrderCodec`); ``make_cache(model, ...)`` sets it from the model's type (:func:`model_options`).
V is stored as the model computes it (its weights are not permuted): V alone matches to 1%.

**The matmuls.** transformers dequantizes a GGUF's weights to float32 and multiplies float32 activations, while
llama.cpp's CPU backend converts the activations to the weight's dot-product type first
(``ggml-cpu/ggml-cpu.c:1328-1371``, ``from_float`` of ``type_traits_cpu[type].vec_dot_type``, ``:215-410``): q8_0 for
Q4_0, Q5_0, Q8_0 and IQ4_NL weights, q8_1 for Q4_1 and Q5_1, q8_K for the K-quants, f16 / bf16 for F16 / BF16. That
rounding is a step function: a small change upstream (a KV cache rounded to bf16 or q8_0) moves some activations
across a step, which costs far more than the change itself. On SmolLM2 a bf16 cache's KL divergence from the f16
cache is 0.0039 in llama.cpp and 0.00004 in kvquant with float32 matmuls, 0.0036 with :func:`emulate_matmuls`.

The values (``ggml_vec_dot_*`` are integer sums times the two scales, so the dot product of dequantized rows in
float32): q8_0 / q8_1 as :func:`kvquant.formats.llamacpp.quantize_q8` stores them (``d = amax / 127`` in fp16, codes of
``x * 127 / amax`` rounded to even on x86: ``arch/x86/quants.c``, and the same in the repacked weights'
``ggml_quantize_mat_q8_0_4x8``, ``arch/x86/repack.cpp:178-286``); q8_K per 256: ``iscale = -127 / max`` (``max``
the first element of largest magnitude, with its sign), codes ``nearest_int(iscale x)`` at most 127, ``d = 1 /
iscale`` in float32 (``ggml-quants.c:2768-2805``; x86 uses that reference, ``arch/x86/quants.c:505-507``).
Not reproduced: q8_1's ``s = fp16(d * sum q)`` (q4_1/q5_1's dot product adds ``m * s`` with ``s`` rounded to fp16),
the float32 order of the sums, and which of two equal magnitudes of opposite sign the AVX2 repacked q8_K picks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvquant.formats import ops
from kvquant.errors import KVQuantError
from kvquant.formats.llamacpp import BLOCK, _signed_absmax, quantize_q8
from kvquant.formats.quantizers import WrappingCodec

# --------------------------------------------------------------------------------------------------
# K's channel order

#: transformers model types whose GGUF stores each Q and K head with RoPE's pairs adjacent (llama.cpp's RoPE type
#: NORM: ``convert_hf_to_gguf.py`` permutes their Q/K weights, transformers' GGUF loader permutes them back)
NORM_ROPE_MODELS = ("llama", "mistral", "mixtral", "granite", "granitemoe")


def gguf_order(head_dim: int) -> torch.Tensor:
    """Channel ``j`` of a K head as llama.cpp stores it for a RoPE-NORM GGUF is the model's channel ``order[j]``:
    ``0, D/2, 1, D/2 + 1, ...`` (the pairs RoPE rotates together, adjacent)."""
    half = torch.arange(head_dim // 2)
    return torch.stack([half, half + head_dim // 2], -1).flatten()


@dataclass(frozen=True)
class GgufOrderCodec(WrappingCodec):
    """K in llama.cpp's channel order (:func:`gguf_order`) around ``inner``: its blocks of 32 and its rotation see
    the channels llama.cpp's do; read back, and the query converted, in the model's order."""

    head_dim: int

    def _orders(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        order = gguf_order(self.head_dim).to(device)
        return order, torch.argsort(order)

    def check(self, x, name):
        self.inner.check(x[..., self._orders(x.device)[0]], name)

    def encode(self, x):
        return self.inner.encode(x[..., self._orders(x.device)[0]])

    def decode_into(self, enc, out):
        work = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        self.inner.decode_into(enc, work)
        ops.store_clamped(out, work[..., self._orders(out.device)[1]])

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """The query as llama.cpp's K dot product reads it (``inner.query`` in llama.cpp's order), float32."""
        order, back = self._orders(q.device)
        return self.inner.query(q[..., order])[..., back]


def rope_layout_of(model_or_config) -> str:
    """``norm`` for a model whose GGUF interleaves Q/K heads (:data:`NORM_ROPE_MODELS`), else ``neox``."""
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return "norm" if getattr(text, "model_type", None) in NORM_ROPE_MODELS else "neox"


def _with_layout(quantizer, options: dict, layout: str) -> dict:
    if isinstance(quantizer, str) and quantizer.startswith("llamacpp_") and "rope_layout" not in options:
        return {**options, "rope_layout": layout}
    return options


def check_rope_layout(model_config, quantizer, options: dict, where: str) -> None:
    """A run's llama.cpp setting (``quantizer`` with ``options``, and those its ``layers`` map names) states no
    ``rope_layout`` other than the model's (:func:`rope_layout_of`): K stored in an order llama.cpp does not use for
    this model would be measured, and the report and DEPLOY.md would stand for llama.cpp's cache all the same (one
    line naming ``where``). The cache-only emulation of :mod:`kvquant.integrations.llamacpp_compare` states it
    through ``make_cache`` instead."""
    layout = rope_layout_of(model_config)
    layers = options.get("layers")
    named = [(where, quantizer, options)] + [
        (f"{where}: layers[{key!r}]", value.get("quantizer"), value)
        for key, value in (layers.items() if isinstance(layers, dict) else ()) if isinstance(value, dict)]
    for at, name, given in named:
        stated = given.get("rope_layout")
        if isinstance(name, str) and name.startswith("llamacpp_") and stated is not None and stated != layout:
            kind = getattr(model_config, "model_type", None)
            raise KVQuantError(f"{at}: rope_layout {stated!r}, but llama.cpp stores this model's K ({kind!r}) in "
                               f"the {layout!r} layout, so the run would measure a cache llama.cpp never holds; "
                               "remove rope_layout (the model's is used)")


def model_options(model_or_config, quantizer, options: dict) -> dict:
    """``make_cache`` options with every llama.cpp quantizer's ``rope_layout`` (the cache's and those a ``layers``
    map names) taken from the model where not given."""
    layout = rope_layout_of(model_or_config)
    options = _with_layout(quantizer, options, layout)
    layers = options.get("layers")
    if isinstance(layers, dict):
        layers = {key: _with_layout(value.get("quantizer"), value, layout) if isinstance(value, dict) else value
                  for key, value in layers.items()}
        options = {**options, "layers": layers}
    return options


# --------------------------------------------------------------------------------------------------
# The matmuls

#: GGUF weight type -> what its CPU matmul converts the activations to (``type_traits_cpu[...].vec_dot_type``)
ACTIVATION_TYPE = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q4_0": "q8_0", "Q5_0": "q8_0", "Q8_0": "q8_0",
                   "IQ4_NL": "q8_0", "Q4_1": "q8_1", "Q5_1": "q8_1", "Q2_K": "q8_K", "Q3_K": "q8_K",
                   "Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K", "IQ4_XS": "q8_K"}
QK_K = 256


def quantize_q8_k(x: torch.Tensor) -> torch.Tensor:
    """``quantize_row_q8_K_ref`` then ``code * d``: ``x`` ``[..., D]`` (D a multiple of 256), float32."""
    blocks = x.float().unflatten(-1, (-1, QK_K))
    amax, top = _signed_absmax(blocks)
    iscale = torch.where(amax > 0, -127.0 / top, torch.zeros_like(top))
    codes = torch.round(iscale * blocks).clamp(max=127)  # nearest_int: + 1.5 * 2^23, ties to even
    d = torch.where(amax > 0, 1.0 / iscale, torch.zeros_like(iscale))
    return (codes * d).flatten(-2)


def activations(x: torch.Tensor, kind: str, cpu: str = "x86") -> torch.Tensor:
    """``x`` ``[..., D]`` as the matmul reads it after converting it to ``kind`` (:data:`ACTIVATION_TYPE`'s
    values), in ``x``'s dtype."""
    if kind in ("q8_0", "q8_1"):
        d, _, codes = quantize_q8(x.float().unflatten(-1, (-1, BLOCK)), cpu)
        out = (codes.float() * d.float()).flatten(-2)
    elif kind == "q8_K":
        out = quantize_q8_k(x)
    elif kind in ("f16", "bf16"):
        out = x.to(torch.float16 if kind == "f16" else torch.bfloat16).float()
    else:
        return x
    return out.to(x.dtype)


def weight_types(gguf_path: Path, modules: list[str]) -> dict[str, str]:
    """The GGUF type of each of ``modules`` (transformers' names of the model's linear layers), found through gguf's
    tensor name map (``lm_head``: ``output``, else the tied ``token_embd``)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    archs = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in archs:
        raise KVQuantError(f"{gguf_path}: architecture {arch!r} is not one gguf knows")
    names = gguf.get_tensor_name_map(archs[arch], reader.fields[f"{arch}.block_count"].contents())
    found = {}
    for module in modules:
        tensor = names.get_name(module)
        if tensor == "output" and "output.weight" not in types:
            tensor = "token_embd"
        if tensor is None or f"{tensor}.weight" not in types:
            raise KVQuantError(f"{gguf_path}: no tensor for the model's {module} (looked for {tensor}.weight)")
        found[module] = types[f"{tensor}.weight"]
    return found


def emulate_matmuls(model, gguf_path: Path, cpu: str = "x86") -> list:
    """Quantize the input of every linear layer of ``model`` (loaded from ``gguf_path``) as llama.cpp's CPU matmul
    over that layer's GGUF weight does; returns the hooks' handles (``.remove()`` undoes it)."""
    linear = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    weights = weight_types(gguf_path, list(linear))
    kinds = {name: ACTIVATION_TYPE.get(kind) for name, kind in weights.items()}
    unknown = sorted({weights[name] for name, kind in kinds.items() if kind is None})
    if unknown:
        raise KVQuantError(f"{gguf_path}: weight types {', '.join(unknown)}: their CPU matmul is not emulated")
    handles = []
    for name, module in linear.items():
        block = {"q8_K": QK_K, "q8_0": BLOCK, "q8_1": BLOCK}.get(kinds[name], 1)
        if module.in_features % block:
            raise KVQuantError(f"{name}: {module.in_features} inputs are not blocks of {block} ({kinds[name]})")
        handles.append(module.register_forward_pre_hook(
            lambda mod, args, kind=kinds[name]: (activations(args[0], kind, cpu), *args[1:])))
    return handles
