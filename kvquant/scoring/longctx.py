"""Divergence by position on long documents: where in a long context a quantized cache starts to lose.

:func:`position_divergences` feeds each document through the baseline's cache and every candidate's cache in
lockstep, ``chunk_size`` tokens at a time (streaming: each chunk's attention reads what the cache stored for the
earlier ones, quantized), and after each chunk compares every candidate's next-token distributions with the
baseline's at each position of that chunk. Only the per-position numbers are kept, so at most one chunk's logits
per scorer are held at any time: a 32K-token document of Gemma 3 (262,144 entries per distribution) would be
34 GB of float32 logits whole, one 512-token chunk is 0.5 GB.

Position ``p`` (0-based) is the distribution after reading tokens ``0..p``, which predicts token ``p + 1``; a
document of ``L`` tokens has positions ``0..L-2``. :mod:`kvquant.runner.positions` buckets them by position.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from kvquant.cache.reads import Reads
from kvquant.errors import InternalError, KVQuantError
from kvquant.scoring.divergence import position_terms
from kvquant.scoring.scorer import Scorer, _Batch


def position_divergences(baseline: Scorer, candidates: list[Scorer], documents: list[list[int]],
                         desc: str | None = None) -> list[dict]:
    """Per candidate: ``{"kl": [[float] per position] per document, "top1": [[0/1] per position] per document,
    "reads": ..., "lengths": ..., "chunk_reads": [[start, stop, reads] per chunk of positions]}``,
    ``KL(baseline || candidate)`` in nats and whether the candidate's most likely next token is the baseline's,
    at every position of every document (documents of at least 2 tokens; batched
    ``baseline.batch_size`` rows at a time by the scorers' own limit on logits per forward). All scorers must
    share one model and ``chunk_size``. Under several processes each scores its share of the documents and the
    comparisons are gathered."""
    scorers = [baseline, *candidates]
    if any(s.model is not baseline.model or s.chunk_size != baseline.chunk_size for s in candidates):
        raise KVQuantError("position divergences compare scorers of one model and one chunk_size")
    if any(len(d) < 2 for d in documents):
        raise KVQuantError("every document needs at least 2 tokens (one position to compare)")
    order = sorted(range(len(documents)), key=lambda i: -len(documents[i]))  # longest first: the peak at once
    rows = baseline.rows_per_batch(baseline.chunk_size)
    batches = baseline.processes.share([order[i : i + rows] for i in range(0, len(order), rows)])
    found: list[dict[int, tuple[list[float], list[int]]]] = [{} for _ in candidates]
    chunks: list[dict[int, Reads]] = [{} for _ in candidates]  # per candidate: chunk start -> what it read there
    with torch.inference_mode():
        quiet = desc is None or not baseline.processes.is_main_process
        for batch in tqdm(batches, desc=desc, leave=False, disable=quiet):
            for own, terms in zip(found, _lockstep(scorers, [documents[i] for i in batch], chunks)):
                own.update(zip(batch, terms))
    out = []
    for own, read, candidate in zip(found, chunks, candidates):
        for part in candidate.processes.gather(own):
            own.update(part)
        if len(own) != len(documents):
            raise InternalError("a document's position divergences went missing between processes")
        summed: dict[int, Reads] = {}
        for part in candidate.processes.gather(read) if candidate.processes.world > 1 else [read]:
            for start, r in part.items():
                summed[start] = summed.get(start, Reads()).add(r)
        size = baseline.chunk_size
        out.append({"kl": [own[i][0] for i in range(len(documents))],
                    "top1": [own[i][1] for i in range(len(documents))],
                    "reads": candidate.reads.to_dict(), "lengths": [len(d) for d in documents],
                    "chunk_reads": [[start, start + size, summed[start].to_dict()] for start in sorted(summed)]})
    return out


def _lockstep(scorers: list[Scorer], docs: list[list[int]],
              chunks: list[dict[int, Reads]]) -> list[list[tuple[list[float], list[int]]]]:
    """One batch of documents through every scorer's own cache, chunk by chunk: per candidate (``scorers[1:]``),
    per document, its (KL, top-1) per position; ``chunks[c]`` gains, per chunk start, what candidate ``c``'s
    attention read in that chunk (the queries of positions ``start .. start + chunk_size - 1``). Rows shorter than
    the batch's longest are padded after their tokens (no position of padding is compared)."""
    for scorer in scorers:
        scorer.lengths += [len(d) for d in docs]
    runners = [_Batch(s.model, s._new_cache(), len(docs)) for s in scorers]
    terms: list[list[tuple[list[float], list[int]]]] = [[([], []) for _ in docs] for _ in scorers[1:]]
    size, longest = scorers[0].chunk_size, max(map(len, docs))
    for start in range(0, longest - 1, size):  # the last token is never read: it has no next token to predict
        tokens = [d[start : min(start + size, len(d) - 1)] for d in docs]
        counts = [len(t) for t in tokens]
        keep = [[True] * n for n in counts]
        reference = runners[0].step(tokens, keep).float()
        for own, runner, scorer, read in zip(terms, runners[1:], scorers[1:], chunks):
            before = Reads(**scorer.reads.to_dict())
            got = runner.step(tokens, keep).float()
            now = Reads(**scorer.reads.to_dict())
            delta = Reads(*(a - b for a, b in zip(now.to_dict().values(), before.to_dict().values())))
            read[start] = read.get(start, Reads()).add(delta)
            for (kl, top1), ref, new in zip(own, reference.split(counts), got.split(counts)):
                k, t = position_terms(ref, new)
                kl += k
                top1 += t
    return terms
