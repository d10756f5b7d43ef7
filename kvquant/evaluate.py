"""Scoring text through a quantized cache: every log-probability here comes from attention reading the
quantized K/V, in one of two modes (see ``../shared/docs/measurement.md``):

- ``simulated``: one forward pass over the whole sequence with a fresh cache; K/V are quantized as they are
  written and attention reads the dequantized states in the same pass (as in KIVI/KVQuant's perplexity: the
  last token is written too, so its key shares its group's scale).
- ``streaming``: the context is fed ``chunk_size`` tokens at a time, then the scored tokens, each chunk
  attending to what the cache stored for the earlier ones (``chunk_size=1`` is token-by-token decoding).

Requests are scored in batches of up to ``batch_size`` rows. Each row is its own sequence: the cache stores rows
apart and is told which positions are padding (``KVQuantCache.set_padding``), so a row in a batch computes what
it computes alone (up to float noise of batched matmuls). In streaming mode, requests that share a context (the
choices of a multiple-choice question) prefill it once; the cache is then forked into one row per continuation
(``KVQuantCache.fork``), which is exactly what each would have stored after the same context chunks. Simulated
mode writes context and continuation in one pass, so it has nothing to share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .cache import KVQuantCache
from .data import Window
from .errors import KVQuantError

MODES = ("simulated", "streaming")


def check_mode(mode, chunk_size) -> None:
    """One-line errors for an evaluation mode or chunk size that cannot be honoured."""
    if mode not in MODES:
        raise KVQuantError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise KVQuantError(f"chunk_size must be an integer >= 1, got {type(chunk_size).__name__} {chunk_size!r}")


@dataclass
class Scored:
    """Log-probabilities ``[n]`` of the scored tokens and whether each was the greedy choice."""

    logprobs: torch.Tensor
    greedy: torch.Tensor


@dataclass
class _Row:
    """What one batch row feeds after the fork: ``chunks`` of tokens, and from which fed position on (counted
    over the concatenated chunks) the logits predict ``targets``."""

    chunks: list[list[int]]
    score_from: int
    targets: list[int]


def _chunks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


class _Batch:
    """Feeds rows of different lengths through one cache, one step at a time, padding what a row does not fill.

    Padding only ever comes before all of a row's real tokens or after them, never between two of them: a
    sliding-window mask counts positions, padding included, so padding inside a row would shrink its window."""

    def __init__(self, model, cache: KVQuantCache, rows: int):
        self.model, self.cache = model, cache
        self.device = model.get_input_embeddings().weight.device
        self.masks: list[torch.Tensor] = []  # [rows, width] per step

    def step(self, tokens: list[list[int]], logits: bool, pad_first: bool = False) -> torch.Tensor | None:
        """Feed ``tokens[r]`` to row ``r`` (maybe none), padded after them (before with ``pad_first``); logits
        ``[rows, width, vocab]`` with each row's tokens first, when asked."""
        width = max(map(len, tokens))
        if width == 0:
            return None
        pads = [[0] * (width - len(t)) for t in tokens]
        ids = torch.tensor([p + t if pad_first else t + p for t, p in zip(tokens, pads)])
        real = [[0] * len(p) + [1] * len(t) if pad_first else [1] * len(t) + [0] * len(p) for t, p in zip(tokens, pads)]
        self.masks.append(torch.tensor(real))
        mask = torch.cat(self.masks, dim=1)
        padded = not bool(mask.all())
        if padded:
            self.cache.set_padding(mask)
        positions = (mask.cumsum(1) - 1).clamp(min=0)[:, -width:]  # each row counts its own real tokens
        out = self.model(ids.to(self.device), cache=self.cache, use_cache=True,
                         attention_mask=mask.to(self.device) if padded else None,
                         position_ids=positions.to(self.device) if padded else None,
                         logits_to_keep=0 if logits else 1)
        return out.logits if logits else None

    def fork(self, rows: list[int]) -> None:
        self.cache.fork(rows)
        self.masks = [m[rows] for m in self.masks]


class Scorer:
    """Scores token sequences with ``model``, reading K/V through a fresh ``make_cache()`` per batch."""

    def __init__(self, model, make_cache: Callable[[], KVQuantCache], mode: str = "simulated", chunk_size: int = 64,
                 batch_size: int = 1, share_prefix: bool = True):
        check_mode(mode, chunk_size)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise KVQuantError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.model, self.make_cache, self.mode, self.chunk_size = model, make_cache, mode, chunk_size
        self.batch_size, self.share_prefix = batch_size, share_prefix

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def score(self, ids: list[int], score_from: int) -> Scored:
        """Score ``ids[score_from:]`` given everything before them (``1 <= score_from < len(ids)``)."""
        return self.score_many([(ids[:score_from], ids[score_from:])])[0]

    def _plan(self, context: list[int], continuation: list[int]) -> tuple[list[list[int]], _Row]:
        """(prefix chunks shared by requests with this context, the request's own row)."""
        if self.mode == "simulated":
            ids = context + continuation
            return [], _Row([ids], len(context) - 1, continuation)
        scored = context[-1:] + continuation[:-1]
        return _chunks(context[:-1], self.chunk_size), _Row(_chunks(scored, self.chunk_size), 0, continuation)

    @torch.inference_mode()
    def score_many(self, requests: list[tuple[list[int], list[int]]], desc: str | None = None) -> list[Scored]:
        """Score each ``(context, continuation)`` (both non-empty token lists); results in request order."""
        for context, continuation in requests:
            if not context or not continuation:
                raise KVQuantError("every scored request needs at least one context and one continuation token")
        share = self.share_prefix and self.mode == "streaming"
        groups: dict[tuple, list[int]] = {}
        for i, (context, _) in enumerate(requests):
            groups.setdefault(tuple(context) if share else (i,), []).append(i)
        # longest first: the first batch shows the memory peak at once; similar lengths share batches
        order = sorted(groups.values(), key=lambda idx: -len(requests[idx[0]][0]) - len(requests[idx[0]][1]))
        # A batch holds either context groups whose shared prefix is one chunk at most (fed in one step, padded
        # in front), or a single group (its prefix fed chunk by chunk, unpadded): see _Batch.
        batches, current = [], []
        for members in order:
            members = sorted(members, key=lambda i: -len(requests[i][1]))
            alone = len(self._plan(*requests[members[0]])[0]) > 1
            for start in range(0, len(members), self.batch_size):
                part = members[start : start + self.batch_size]
                if current and (alone or sum(map(len, current)) + len(part) > self.batch_size):
                    batches.append(current)
                    current = []
                current.append(part)
                if alone:
                    batches.append(current)
                    current = []
        if current:
            batches.append(current)
        results: list[Scored | None] = [None] * len(requests)
        with tqdm(total=len(requests), desc=desc, leave=False, disable=desc is None) as bar:
            for batch in batches:
                for i, scored in zip([i for part in batch for i in part], self._score_batch(requests, batch)):
                    results[i] = scored
                bar.update(sum(map(len, batch)))
        return results

    def _score_batch(self, requests, batch: list[list[int]]) -> list[Scored]:
        """One batch: each part is a list of requests sharing a prefix (one prefix row, one row per request)."""
        prefixes = [self._plan(*requests[part[0]])[0] for part in batch]
        rows = [self._plan(*requests[i])[1] for part in batch for i in part]
        runner = _Batch(self.model, self.make_cache(), len(batch))
        for step in range(max(map(len, prefixes))):  # one step, or one unpadded row (see score_many)
            runner.step([p[step] if step < len(p) else [] for p in prefixes], logits=False, pad_first=True)
        runner.fork([g for g, part in enumerate(batch) for _ in part])
        logits: list[list[torch.Tensor]] = [[] for _ in rows]
        for step in range(max(len(r.chunks) for r in rows)):
            tokens = [r.chunks[step] if step < len(r.chunks) else [] for r in rows]
            out = runner.step(tokens, logits=True)
            for r, t in enumerate(tokens):
                logits[r].append(out[r, : len(t)])
        scored = []
        for row, parts in zip(rows, logits):
            row_logits = torch.cat(parts)[row.score_from : row.score_from + len(row.targets)].float()
            targets = torch.tensor(row.targets, device=row_logits.device)
            logprobs = row_logits.log_softmax(-1).gather(1, targets[:, None])[:, 0]
            scored.append(Scored(logprobs.cpu(), (row_logits.argmax(-1) == targets).cpu()))
        return scored


def perplexity_samples(scorer: Scorer, windows: list[Window], desc: str = "perplexity") -> dict[str, list[float]]:
    """Per-window summed negative log-likelihood and predicted-token count."""
    scored = scorer.score_many([(w.ids[: w.score_from], w.ids[w.score_from :]) for w in windows], desc=desc)
    return {"nll": [float(-s.logprobs.double().sum()) for s in scored], "tokens": [len(s.logprobs) for s in scored]}


@torch.inference_mode()
def memory_probe(model, make_cache: Callable[[], KVQuantCache], ids: list[int]) -> dict[str, float]:
    """``memory_report()`` of a cache after ``ids`` went through it."""
    cache = make_cache()
    device = model.get_input_embeddings().weight.device
    model(torch.tensor([ids], device=device), cache=cache, use_cache=True)
    return cache.memory_report()
