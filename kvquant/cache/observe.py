"""A cache that watches: a ``DynamicCache`` that hands every layer's new key and value states (post-RoPE, as a
serving engine's cache receives them) to a callback before storing them, for calibrating static scales."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicCache


class ObservingCache(DynamicCache):
    """``seen(layer_idx, keys, values)`` with each update's new states ``[B, H, T, D]``, then stored unchanged."""

    def __init__(self, model, seen: Callable[[int, torch.Tensor, torch.Tensor], None]):
        super().__init__(config=model.config)
        self.seen = seen

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.seen(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
