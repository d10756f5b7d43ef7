"""The fewest documents a bootstrap interval decides with (issue 53 item 3). See ``docs/gate.md``.

kvquant's intervals over documents or windows (a perplexity set's perplexity ratio, KL and top-1; a position
bucket's KL and top-1; the trend of KL per doubling of the position) are percentile bootstraps, and over few
documents they are too narrow: ``experiments/simulate_counts.py`` measured how often each end misses the true
value, for per-document spreads taken from the committed long reports. The counts below are where each end's miss
comes within ``BOUND`` of nominal. Below its count a verdict that rests on that end is **too few documents**:
never a pass or a fail, and, like inconclusive, never a pass for the candidate.

A verdict reads one end of the interval: a pass the end toward the threshold on the good side, a fail the other.
The losses are skewed toward bad documents (a few windows diverge much more than the rest), and a percentile
bootstrap misses most on that side, which is the end a pass reads; so a pass needs more documents than a fail.
The accuracy interval (a score interval for paired 0/1 answers) and the flip rate's exact interval are not
bootstraps: their error is simulated on their own (``experiments/simulate_gate.py``) and they have no count here.

The gate holds position buckets (long contexts) and trends to these counts. A perplexity set's windows are not held
to them yet: the same simulation says a pass over fewer than 96 windows is too optimistic there too, and the fix
that would need fewer (a skew-correcting interval) is the next step (docs/gate.md).
"""

from __future__ import annotations

from kvquant.runner.results import ACCURACY, AGREEMENT, DIVERGENCE, FLIPS, PERPLEXITY

TOO_FEW = "too few documents"

#: From ``experiments/simulate_counts.py`` (seed 20261207, 4,000 draws per cell; ``docs/gate.md``): a mean over
#: documents (windows, or documents in a position bucket) decides a fail from :data:`MIN_FAIL` documents and a pass
#: from :data:`MIN_PASS`; the trend per doubling decides either way from :data:`MIN_TREND`.
MIN_FAIL = 12
MIN_PASS = 96
MIN_TREND = 32


def needed(kind: str, verdict: str) -> int | None:
    """The fewest documents that decide ``verdict`` (``pass`` or ``fail``) on a metric ``kind``, None where its
    interval is no bootstrap (accuracy, flips) or the verdict decides nothing."""
    if kind in (ACCURACY, FLIPS) or kind not in (PERPLEXITY, DIVERGENCE, AGREEMENT):
        return None
    return {"pass": MIN_PASS, "fail": MIN_FAIL}.get(verdict)


def fewest(kind: str) -> int | None:
    """Below this many documents nothing about a ``kind`` is decided (its smallest count), None without one."""
    return None if needed(kind, "fail") is None else min(MIN_FAIL, MIN_PASS)


def settle(kind: str, verdict: str, n: int) -> tuple[str, int | None]:
    """``verdict`` as ``n`` documents can decide it: ``(verdict, None)``, or ``(TOO_FEW, documents needed)`` where
    ``n`` is below the count of the end it reads (below the smaller count: whatever the verdict)."""
    small = fewest(kind)
    need = small if small is not None and n < small else needed(kind, verdict)
    return (TOO_FEW, need) if need is not None and n < need else (verdict, None)


def too_few(n: int, need: int) -> str:
    """The verdict as a report writes it: ``too few documents (n = 3 of the 20 needed)``."""
    return f"{TOO_FEW} (n = {n} of the {need} needed)"


def count_warnings(cfg) -> list[str]:
    """What a config's counts cannot decide, said before the run starts: long documents fewer than a position
    bucket needs. A warning, not a refusal: such a row is judged "too few documents" and cannot pass, but the run
    still shows what its other metrics decide (and a small config still exercises the pipeline)."""
    gate, out = cfg.gate, []
    long = cfg.eval.long_context
    if long is not None and (gate.max_kl_divergence is not None or gate.min_top1_agreement is not None) \
            and long.documents < MIN_PASS:
        what = "no position bucket" if long.documents < MIN_FAIL else "a bucket's fail only"
        out.append(f"eval.long_context.documents: {long.documents} documents decide {what} (a fail needs "
                   f"{MIN_FAIL}, a pass {MIN_PASS}; docs/gate.md)")
    return out
