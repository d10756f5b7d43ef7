"""What llama.cpp does with a GGUF model that transformers does not, emulated on the transformers model: the two
causes of the differences between llama.cpp's KL divergences and kvquant's cache-only emulation
(``reports/llamacpp-compare``), K's channel order (here) and the matmuls (:mod:`kvquant.formats.llamacpp_matmuls`).

**K's channel order.** A Llama-family GGUF (llama.cpp's RoPE type NORM: :data:`NORM_ROPE_MODELS`) stores each Q and
K head with the two channels RoPE rotates together adjacent: ``convert_hf_to_gguf.py`` permutes the Q/K weights and
transformers' GGUF loader permutes them back (``LlamaTensorProcessor._reverse_permute_weights``). So llama.cpp's K
blocks of 32 (and its Hadamard rotation) see channels ``0, D/2, 1, D/2 + 1, ...`` of the model's head
(:func:`gguf_order`), not ``0, 1, 2, ...``. Unrotated q4_0 K on SmolLM2 costs 0.143 nats in llama.cpp, 0.080 in
the model's order and 0.151 in llama.cpp's. ``rope_layout: norm`` on a ``llamacpp_*`` quantizer stores K in that
order (:class:`GgufOrderCodec`); ``make_cache(model, ...)`` sets it from the model's type (:func:`rope_layout_of`,
through :meth:`~kvquant.formats.llamacpp.LlamaCppQuantizer.for_model`).
V is stored as the model computes it (its weights are not permuted): V alone matches to 1%.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvquant.errors import KVQuantError
from kvquant.formats import ops
from kvquant.formats.quantizers import WrappingCodec

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


def check_rope_layout(model_config, quantizer, options: dict, where: str) -> None:
    """A run's llama.cpp setting (``quantizer`` with ``options``, those its ``layers`` map names, and the inner
    ``keys``/``values`` of a ``keys_values`` among them) states no
    ``rope_layout`` other than the model's (:func:`rope_layout_of`): K stored in an order llama.cpp does not use for
    this model would be measured, and the report and DEPLOY.md would stand for llama.cpp's cache all the same (one
    line naming ``where``). The cache-only emulation of :mod:`kvquant.integrations.llamacpp_compare` states it
    through ``make_cache`` instead."""
    layout = rope_layout_of(model_config)
    layers = options.get("layers")
    named = [(where, quantizer, options)] + [
        (f"{where}: layers[{key!r}]", value.get("quantizer"), value)
        for key, value in (layers.items() if isinstance(layers, dict) else ()) if isinstance(value, dict)]
    named += [(f"{at}: {stream}", inner.get("quantizer"), inner) for at, _, given in list(named)
              for stream in ("keys", "values") if isinstance(inner := given.get(stream), dict)]  # keys_values' own
    for at, name, given in named:
        stated = given.get("rope_layout")
        if isinstance(name, str) and name.startswith("llamacpp_") and stated is not None and stated != layout:
            kind = getattr(model_config, "model_type", None)
            raise KVQuantError(f"{at}: rope_layout {stated!r}, but llama.cpp stores this model's K ({kind!r}) in "
                               f"the {layout!r} layout, so the run would measure a cache llama.cpp never holds; "
                               "remove rope_layout (the model's is used)")
