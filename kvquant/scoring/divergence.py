"""How far a candidate's next-token distributions are from the baseline's: per-position KL divergence and top-1
agreement, computed while both score the same windows, a few at a time (never a run's logits in memory)."""

from __future__ import annotations

import torch

from kvquant.errors import InternalError
from kvquant.scoring import windowed
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
                desc: str | None = None, keep: windowed.Keep | None = None) -> list[dict]:
    """:func:`divergence_samples` of every candidate scorer against one baseline pass: windows go through the
    baseline a few at a time (a group: a batch of the baseline's, :func:`~kvquant.scoring.windowed.pass_groups`, of
    runs of as many consecutive windows as :data:`DISTRIBUTION_ELEMENTS` log-probabilities per scorer allow at once:
    two scorers' worth, never a run's logits), then through each candidate, and the baseline is scored once for all
    of them. Each group goes through ``keep`` (:func:`~kvquant.scoring.windowed.in_groups`: a group kept from an
    interrupted pass is not scored again). Under several processes each compares the windows it scored (the scorers
    share requests out alike) and each group's comparisons are gathered."""
    longest = max((len(w.ids) - w.score_from for w in windows), default=1)
    groups = windowed.pass_groups(baseline, windows, max(1, DISTRIBUTION_ELEMENTS // (longest * baseline.vocab)))
    parts = windowed.in_groups(windows, groups, lambda ws: _group(baseline, candidates, ws), keep, desc,
                               baseline.processes.is_main_process)
    return [windowed.join_groups([part[c] for part in parts], groups, ("kl", "top1", "tokens", "nll"))
            for c in range(len(candidates))]


def _group(baseline: Scorer, candidates: list[Scorer], windows: list[Window]) -> list[dict]:
    """One group of :func:`divergences`: per candidate, per window of ``windows``, its KL, top-1, tokens and nll,
    with what the candidate read and the lengths it scored in the group."""
    scorers = [baseline, *candidates]
    for scorer in scorers:
        scorer.distributions = True
    found: list[dict[int, tuple[list[float], int, int, float]]] = [{} for _ in candidates]
    requests = windowed.requests(windows)
    before = [windowed.tallies(c) for c in candidates]
    try:
        reference = baseline.score_many(requests, local=True)
        for own, candidate in zip(found, candidates):
            for i, (ref, got) in enumerate(zip(reference, candidate.score_many(requests, local=True))):
                if (ref is None) != (got is None):
                    raise InternalError("the baseline and a candidate scorer shared their requests out differently")
                if ref is not None:
                    own[i] = (*_compare(ref.distribution, got.distribution), float(-got.logprobs.double().sum()))
    finally:
        for scorer in scorers:
            scorer.distributions = False
    out = []
    for own, candidate, since in zip(found, candidates, before):
        for part in candidate.processes.gather(own):
            own.update(part)
        kl, top1, tokens, nll = zip(*(own[i] for i in range(len(requests)))) if requests else ((),) * 4
        out.append({"kl": list(kl), "top1": list(top1), "tokens": list(tokens), "nll": list(nll),
                    **windowed.tallies_since(candidate, since)})
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
