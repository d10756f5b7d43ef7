"""How far a candidate's next-token distributions are from the baseline's: per-position KL divergence and top-1
agreement, computed while both score the same windows, a few at a time (never a run's logits in memory)."""

from __future__ import annotations

import torch
from tqdm import tqdm

from kvquant.errors import InternalError
from kvquant.scoring.data import Window
from kvquant.scoring.scorer import SOFTMAX_ROWS, Scorer

#: Scored positions x vocabulary entries held at once per scorer while comparing distributions (float32: 1 GiB).
DISTRIBUTION_ELEMENTS = 2**28


def divergence_samples(baseline: Scorer, candidate: Scorer, windows: list[Window], desc: str | None = None) -> dict:
    """Per window: the per-token KL divergence ``KL(baseline || candidate)`` of the next-token distributions (nats,
    ``kl[w][t]``), how many positions keep the baseline's most likely token (``top1``), the positions (``tokens``)
    and the candidate's summed negative log-likelihood of the window's tokens (``nll``: its perplexity, from the
    same scoring). :func:`divergences` of one candidate."""
    return divergences(baseline, [candidate], windows, desc)[0]


def divergences(baseline: Scorer, candidates: list[Scorer], windows: list[Window],
                desc: str | None = None) -> list[dict]:
    """:func:`divergence_samples` of every candidate scorer against one baseline pass: windows go through the
    baseline a few at a time, then through each candidate, so at most :data:`DISTRIBUTION_ELEMENTS` log-probabilities
    per scorer are held at once (two scorers' worth: never a run's logits), and the baseline is scored once for all
    of them. Under several processes each compares the windows it scored (the scorers share requests out alike) and
    only the comparisons are gathered."""
    scorers = [baseline, *candidates]
    for scorer in scorers:
        scorer.distributions = True
    found: list[dict[int, tuple[list[float], int, int, float]]] = [{} for _ in candidates]
    requests = [(w.ids[: w.score_from], w.ids[w.score_from :]) for w in windows]
    try:
        longest = max((len(c) for _, c in requests), default=1)
        step = max(1, DISTRIBUTION_ELEMENTS // (longest * baseline.vocab))
        for start in tqdm(range(0, len(requests), step), desc=desc, leave=False,
                          disable=desc is None or not baseline.processes.main):
            group = requests[start : start + step]
            reference = baseline.score_many(group, local=True)
            for own, candidate in zip(found, candidates):
                for i, (ref, got) in enumerate(zip(reference, candidate.score_many(group, local=True)), start):
                    if (ref is None) != (got is None):
                        raise InternalError("the baseline and a candidate scorer shared their requests out differently")
                    if ref is not None:
                        own[i] = (*_compare(ref.distribution, got.distribution), float(-got.logprobs.double().sum()))
    finally:
        for scorer in scorers:
            scorer.distributions = False
    out = []
    for own, candidate in zip(found, candidates):
        for part in candidate.processes.gather(own):
            own.update(part)
        kl, top1, tokens, nll = zip(*(own[i] for i in range(len(requests)))) if requests else ((),) * 4
        out.append({"kl": list(kl), "top1": list(top1), "tokens": list(tokens), "nll": list(nll),
                    "reads": candidate.reads.to_dict(), "lengths": candidate.lengths})
    return out


def _compare(reference: torch.Tensor, got: torch.Tensor) -> tuple[list[float], int, int]:
    """Per-position KL divergence of ``got`` from ``reference`` (logits ``[positions, vocab]``), how many positions
    keep the reference's most likely token, and the positions."""
    kl, top1 = position_terms(reference, got)
    return kl, sum(top1), len(kl)


def position_terms(reference: torch.Tensor, got: torch.Tensor) -> tuple[list[float], list[int]]:
    """Per position of logits ``[positions, vocab]``: ``KL(softmax(reference) || softmax(got))`` in nats (float64),
    and 1 where ``got``'s most likely token is ``reference``'s (else 0); :data:`SOFTMAX_ROWS` positions at a time."""
    kl, top1 = [], []
    for ref, new in zip(reference.split(SOFTMAX_ROWS), got.split(SOFTMAX_ROWS)):
        p = ref.double().log_softmax(-1)
        q = new.double().log_softmax(-1)
        terms = torch.where(torch.isinf(p), 0.0, p.exp() * (p - q))  # 0 log 0 = 0
        kl += terms.sum(-1).clamp(min=0).tolist()  # >= 0 in exact arithmetic; rounding may dip below
        top1 += (p.argmax(-1) == q.argmax(-1)).int().tolist()
    return kl, top1
