"""The fewest documents (windows) an interval decides with (issue 53 item 3). See ``docs/gate.md``.

Every interval of kvquant over documents or windows is a bootstrap: a perplexity set's perplexity ratio, KL and
top-1 over windows and a position bucket's KL and top-1 over documents are the studentized bootstrap of a mean
(:mod:`kvquant.runner.bootstrap`), and so is the trend of KL per doubling of the position's, of a ratio mapped to a
slope (:mod:`kvquant.runner.positions`). Over few documents each is too narrow: ``experiments/simulate_windows.py``
(the means) and ``experiments/simulate_trend.py`` (the trend) measured how often each end misses the true value,
for per-window spreads taken from the committed reports and skewed parametric ones. The counts below are where
each end's miss comes within the simulations' bound of nominal. Below its count a verdict that rests on that end
is **too few documents**: never a pass or a fail, and, like inconclusive, never a pass for the candidate.

A verdict reads one end of the interval: a pass the end toward the threshold on the good side, a fail the other.
The losses are skewed toward bad windows, and an interval misses most on that side, the end a pass reads; so a pass
needs more documents than a fail. The accuracy interval (a score interval for paired 0/1 answers) and the flip
rate's exact interval are not bootstraps: their error is simulated on their own (``experiments/simulate_gate.py``)
and they have no count here.
"""

from __future__ import annotations

from kvquant.experiment.metric import Metric, divergence_limits

TOO_FEW = "too few documents"

#: From ``experiments/simulate_windows.py`` (seed 20261208, 2,000 draws per cell; ``docs/gate.md``): the studentized
#: bootstrap of a mean over windows (a perplexity set) or documents (a position bucket) decides a pass from
#: :data:`MIN_PASS` (lognormal sigma 0.5 and gamma 2 spreads need it; the committed SmolLM2 windows 12) and a fail
#: from :data:`MIN_FAIL`: its lower end stays within the bound at every n of the grid, and 4 is the fewest windows
#: whose 95% interval can be bounded (over n windows a resample repeats one window with chance n^(1-n), and its
#: t is infinite: 11% at 3 windows, beyond the 2.5% each end reads; 1.6% at 4).
MIN_FAIL = 4
MIN_PASS = 96
#: From ``experiments/simulate_trend.py`` (seed 20261209, 2,000 draws per cell, 500 resamples; ``docs/gate.md``): the
#: trend per doubling (a quasi-Poisson fit, studentized bootstrap over documents) says *grows* from
#: :data:`MIN_TREND_GROWS` documents (its lower end misses 3.55-5.65% at 4-64 documents for the committed Gemma 3
#: documents with their trend shuffled away, 3.55-4.25% for exponential per-position KL) and *shrinks* from
#: :data:`MIN_TREND_SHRINKS` (its upper end: 3.55-3.75% at 12-24, gamma): from there every generator's miss at that
#: end is within 3.5%. Below :data:`MIN_TREND` it says nothing.
MIN_TREND_GROWS = 96
MIN_TREND_SHRINKS = 32
MIN_TREND = min(MIN_TREND_GROWS, MIN_TREND_SHRINKS)


def fewest_documents(kind: Metric | str, verdict: str) -> int | None:
    """The fewest documents that decide ``verdict`` (``pass`` or ``fail``) on a metric ``kind``, None where its
    interval is no bootstrap (accuracy, flips: :attr:`~kvquant.experiment.metric.Metric.is_bootstrap`) or the verdict
    decides nothing."""
    if not Metric.of(kind).is_bootstrap:
        return None
    return {"pass": MIN_PASS, "fail": MIN_FAIL}.get(verdict)


def fewest(kind: Metric | str) -> int | None:
    """Below this many documents nothing about a ``kind`` is decided (its smallest count), None without one."""
    return None if fewest_documents(kind, "fail") is None else min(MIN_FAIL, MIN_PASS)


def settled_verdict(kind: Metric | str, verdict: str, n: int) -> tuple[str, int | None]:
    """``verdict`` as ``n`` documents can decide it: ``(verdict, None)``, or ``(TOO_FEW, documents needed)`` where
    ``n`` is below the count of the end it reads (below the smaller count: whatever the verdict)."""
    small = fewest(kind)
    need = small if small is not None and n < small else fewest_documents(kind, verdict)
    return (TOO_FEW, need) if need is not None and n < need else (verdict, None)


def too_few(n: int, need: int) -> str:
    """The verdict as a report writes it: ``too few documents (n = 3 of the 20 needed)``."""
    return f"{TOO_FEW} (n = {n} of the {need} needed)"


def count_warnings(cfg) -> list[str]:
    """What a config's counts cannot decide, said before the run starts: a gated perplexity set's windows or the
    long documents fewer than a pass needs. A warning, not a refusal: such a row is judged "too few documents" and
    cannot pass, but the run still shows what its other metrics decide (and a small config still exercises the
    pipeline)."""
    gate, out = cfg.gate, []
    for spec in cfg.eval.perplexity:
        if (gate.perplexity is None or spec.name in gate.perplexity) and spec.limit is not None \
                and spec.limit < MIN_PASS:
            out.append(f"eval.perplexity {spec.name}: {spec.limit} windows {_decide(spec.limit)}")
    long = cfg.eval.long_context
    if long is not None and divergence_limits(gate, bucketed=True) and long.documents < MIN_PASS:
        out.append(f"eval.long_context.documents: {long.documents} documents {_decide(long.documents)}")
    return out


def _decide(n: int) -> str:
    what = "nothing" if n < MIN_FAIL else "a fail only"
    return f"decide {what} (a fail needs {MIN_FAIL}, a pass {MIN_PASS}; docs/gate.md)"
