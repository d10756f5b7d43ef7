"""Scoring text through a quantized cache: every log-probability here comes from attention reading the
quantized K/V, in one of two modes (see ``../shared/docs/measurement.md``):

- ``simulated``: one forward pass over the whole sequence with a fresh cache; K/V are quantized as they are
  written and attention reads the dequantized states in the same pass (as in KIVI/KVQuant's perplexity: the
  last token is written too, so its key shares its group's scale).
- ``streaming``: the context is fed ``chunk_size`` tokens at a time, then the scored tokens, each chunk
  attending to what the cache stored for the earlier ones (``chunk_size=1`` is token-by-token decoding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .cache import KVQuantCache
from .data import Window


@dataclass
class Scored:
    """Log-probabilities ``[n]`` of the scored tokens and whether each was the greedy choice."""

    logprobs: torch.Tensor
    greedy: torch.Tensor


class Scorer:
    """Scores token sequences with ``model``, reading K/V through a fresh ``make_cache()`` per sequence."""

    def __init__(self, model, make_cache: Callable[[], KVQuantCache], mode: str = "simulated", chunk_size: int = 64):
        if mode not in ("simulated", "streaming"):
            raise ValueError(f"mode must be 'simulated' or 'streaming', got {mode!r}")
        self.model, self.make_cache, self.mode, self.chunk_size = model, make_cache, mode, chunk_size

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @torch.inference_mode()
    def score(self, ids: list[int], score_from: int) -> Scored:
        """Score ``ids[score_from:]`` given everything before them (``1 <= score_from < len(ids)``)."""
        cache = self.make_cache()
        if self.mode == "simulated":
            inputs = torch.tensor([ids], device=self.device)
            bounds = [0, inputs.shape[1]]
        else:  # chunks of the context, then chunks of the scored part, so no chunk straddles the boundary
            inputs = torch.tensor([ids[:-1]], device=self.device)
            context_end = score_from - 1
            bounds = sorted({*range(0, context_end, self.chunk_size), *range(context_end, inputs.shape[1], self.chunk_size),
                             inputs.shape[1]})
        logits = [
            self.model(inputs[:, a:b], cache=cache, use_cache=True).logits[0] for a, b in zip(bounds, bounds[1:])
        ]
        logits = torch.cat(logits)[score_from - 1 : len(ids) - 1].float()
        targets = torch.tensor(ids[score_from:], device=logits.device)
        logprobs = logits.log_softmax(-1).gather(1, targets[:, None])[:, 0]
        return Scored(logprobs.cpu(), (logits.argmax(-1) == targets).cpu())


def perplexity_samples(scorer: Scorer, windows: list[Window], desc: str = "perplexity") -> dict[str, list[float]]:
    """Per-window summed negative log-likelihood and predicted-token count."""
    nll, tokens = [], []
    for w in tqdm(windows, desc=desc, leave=False):
        scored = scorer.score(w.ids, w.score_from)
        nll.append(float(-scored.logprobs.double().sum()))
        tokens.append(len(scored.logprobs))
    return {"nll": nll, "tokens": tokens}


@torch.inference_mode()
def memory_probe(model, make_cache: Callable[[], KVQuantCache], ids: list[int]) -> dict[str, float]:
    """``memory_report()`` of a cache after ``ids`` went through it."""
    cache = make_cache()
    device = model.get_input_embeddings().weight.device
    model(torch.tensor([ids], device=device), cache=cache, use_cache=True)
    return cache.memory_report()
