"""Codebook levels fitted on the calibration split: KVQuant's sensitivity-weighted non-uniform codes (Hooper et al.
2024, "nuqX") for :class:`kvquant.formats.fitted.FittedLevels` (``calibrate: fisher_kmeans``), and the same
k-means unweighted (``calibrate: kmeans``).

Per calibration window, one forward through a cache that hands each layer's new keys and values to this module
(the post-RoPE keys the cache stores) and, for ``fisher_kmeans``, one backward pass of the window's mean next-token
loss to those states: ``g = dL/dx``. Each state is put where the quantizer's codebook codes it (rotated where the
quantizer rotates, the gradient rotated alike, ``dL/dy = g R`` for ``y = x R``) and normalized as the codec
normalizes it, ``u = x / s`` with ``s`` the vector's largest ``|x|`` as stored. Per layer, for keys and values
apart, the levels are the weighted k-means (:func:`kvquant.formats.fitted.weighted_kmeans`) of every ``u`` with
weight ``(g s)^2``: the diagonal Fisher information of the state times ``s^2``, since an error ``e`` in ``u`` is an
error ``s e`` in ``x``, so the weighted sum is the Fisher-weighted squared error of the states KVQuant minimizes.
``kmeans`` weighs every ``u`` alike (no backward pass).

What KVQuant does that this does not: its keys are quantized per channel before RoPE with a zero point (kvquant's
cache receives keys after RoPE, and the codebook codec normalizes per token and head, symmetrically), outliers are
left out of the k-means (a quantizer with ``outliers`` or ``key_offset`` is refused here), and Q-Norm's
re-centring of the levels is not applied.
"""

from __future__ import annotations

import torch

from kvquant.cache import ObservingCache
from kvquant.formats import ops
from kvquant.formats.fitted import weighted_kmeans
from kvquant.formats.lowbit import CodebookCodec
from kvquant.formats.quantizers import Codec, Quantizer, RotatedCodec


def window_states(model, ids: list[int], fisher: bool) -> list[tuple[int, torch.Tensor, torch.Tensor,
                                                                        torch.Tensor | None, torch.Tensor | None]]:
    """Per layer of one forward over ``ids``: ``(layer, keys, values, dL/dkeys, dL/dvalues)``, states ``[1, H, T, D]``
    as the cache receives them (detached); the gradients of the mean next-token loss (one backward pass) where
    ``fisher``, else None."""
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    cache = ObservingCache(model, lambda layer, keys, values: seen.append((layer, keys, values)))
    tokens = torch.tensor([ids], device=model.get_input_embeddings().weight.device)
    if not fisher:
        with torch.inference_mode():
            model(tokens, cache=cache, use_cache=True)
        return [(layer, k, v, None, None) for layer, k, v in seen]
    with torch.inference_mode(False), torch.enable_grad():
        embeds = model.get_input_embeddings()(tokens).detach().requires_grad_()  # the states' graph, not the weights'
        loss = model(inputs_embeds=embeds, labels=tokens, cache=cache, use_cache=True).loss
        states = [t for _, k, v in seen for t in (k, v)]
        grads = torch.autograd.grad(loss, states, allow_unused=True)
    grads = [torch.zeros_like(s) if g is None else g for s, g in zip(states, grads)]  # a state the loss ignores
    return [(layer, k.detach(), v.detach(), grads[2 * i], grads[2 * i + 1]) for i, (layer, k, v) in enumerate(seen)]


def normalized(codec: Codec, x: torch.Tensor, grad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u, weight)``, each ``[N]`` float32: states ``x`` ``[..., D]`` as ``codec``'s codebook codes them (rotated
    first where it rotates) and each one's weight, ``(g s)^2`` with ``g`` the gradient ``grad`` in the same basis,
    or 1 without a gradient."""
    if isinstance(codec, RotatedCodec):
        x, grad = ops.rotate(x, codec.matrix), None if grad is None else ops.rotate(grad, codec.matrix)
        codec = codec.inner
    if not isinstance(codec, CodebookCodec):
        raise TypeError(f"levels are fitted for a codebook codec, got {type(codec).__name__}")
    u, scale = codec.normalized(x)
    weight = torch.ones_like(u) if grad is None else (grad.float() * scale.float()).square()
    return u.reshape(-1), weight.reshape(-1)


def fitted_levels(model, windows: list[list[int]], quantizer: Quantizer,
                  fisher: bool) -> dict[int, dict[str, list[float]]]:
    """Per layer: ``key_levels`` and ``value_levels`` (``2**key_bits`` and ``2**value_bits`` increasing numbers),
    the weighted k-means of the calibration states ``quantizer``'s codebooks code, over one forward (and, where
    ``fisher``, one backward pass) per window of token ids (module docstring)."""
    samples: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for ids in windows:
        for layer, keys, values, key_grad, value_grad in window_states(model, ids, fisher):
            codecs = quantizer.codecs(keys.shape[-1])
            for role, codec, x, grad in (("key", codecs[0], keys, key_grad), ("value", codecs[1], values, value_grad)):
                samples.setdefault((layer, role), []).append(normalized(codec, x, grad))
    bits = {"key": quantizer.key_bits, "value": quantizer.value_bits}
    out: dict[int, dict[str, list[float]]] = {}
    for (layer, role), parts in sorted(samples.items()):
        u, weight = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        out.setdefault(layer, {})[f"{role}_levels"] = clamped_kmeans_levels(u, weight, 2 ** bits[role])
    return out


def clamped_kmeans_levels(u: torch.Tensor, weight: torch.Tensor, count: int) -> list[float]:
    """The weighted k-means of ``u`` ``[N]`` with ``weight`` ``[N]``, clamped to [-1, 1]: ``u = x / s`` passes 1
    where the stored scale ``s`` is ``max|x|`` rounded down (fp16: by up to 2^-11), and a level beyond 1 codes
    nothing better than 1 does (the quantizer holds levels to [-1, 1])."""
    return weighted_kmeans(u.cpu(), weight.cpu(), count).clamp(-1, 1).tolist()
