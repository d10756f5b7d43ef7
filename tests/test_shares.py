"""A share of positions near 0 (``kl_tail/<set>``, ``top1/<set>``'s disagreement): the interval where no window
counted any position, by value against the exact bound written here, and the false pass at the limit that
``experiments/simulate_shares.py`` committed, with a small seeded run of its mechanism."""

import json
from pathlib import Path

import numpy as np
from scipy.stats import beta, binom

from conftest import experiment
from kvquant.experiment.metric import AGREEMENT, TAIL
from kvquant.runner.bootstrap import mean_interval
from kvquant.runner.gate import INCONCLUSIVE, PASS, judge, paired_interval
from kvquant.experiment.gate_config import GateConfig
from kvquant.experiment.results import MetricId, MetricRow

ROOT = Path(__file__).resolve().parents[1]


def row(kind, rows, limit):
    low, high = paired_interval(kind, None, rows, 1000, 0.95, 7)
    value = rows[:, 0].sum() / rows[:, 1].sum()
    return MetricRow("a", MetricId(kind.measures[0], "wikitext2"), value, kind.reference, len(rows), True, low, high,
                     float("nan"), 0.95)


def test_no_position_counted_is_bounded_by_the_windows_not_passed_at_zero():
    """96 windows of 511 positions with no position above the level had the interval [0, 0] and passed any limit
    (10% of draws at a limit of 0.01 where 97% of windows count none: experiments/simulate_shares.py). Now its
    upper end is the Clopper-Pearson bound of 0 windows of 96 counting any (0.0377): a 0.01 limit is not passed, a
    0.05 one is; top-1 agreement with every position agreeing, the mirror."""
    empty = np.array([[0.0, 511.0]] * 96)
    cp = beta.ppf(0.975, 1, 96)  # exact upper bound of a binomial share after 0 of 96
    tail = row(TAIL, empty, 0.01)
    assert tail.ci_low == 0.0 and abs(tail.ci_high - cp) < 1e-12, (tail.ci_low, tail.ci_high)
    assert judge(tail, GateConfig(max_kl_tail_share=0.01)).verdict == INCONCLUSIVE
    assert judge(tail, GateConfig(max_kl_tail_share=0.05)).verdict == PASS
    agree = row(AGREEMENT, np.array([[511.0, 511.0]] * 96), 0.99)
    assert abs(agree.ci_low - (1 - cp)) < 1e-12 and agree.ci_high == 1.0
    assert judge(agree, GateConfig(min_top1_agreement=0.99)).verdict == INCONCLUSIVE
    # one window counting one position: the studentized interval, untouched (infinite: 1 window of 96)
    one = empty.copy()
    one[5, 0] = 1
    assert row(TAIL, one, 0.01).ci_high == mean_interval(None, one, 1000, 0.95, 7)[1]


def test_committed_false_pass_at_the_limit_is_within_nominal_where_claimed():
    """experiments/simulate_shares.json: at every claimed setting and window count the share at the limit passes
    (KL tail share and top-1 agreement) within the 99.9% binomial range of nominal 2.5% over its draws; the
    settings said as a limit (``UNCLAIMED``) are beyond it at some count (were they not, the claim would widen)."""
    sim = experiment("simulate_shares")
    done = json.loads((ROOT / "experiments" / "simulate_shares.json").read_text())
    limit = binom.ppf(0.999, done["reps"], 0.025) / done["reps"]
    cells = done["results"]["cells"]
    assert sorted(cells) == sorted(sim.SETTINGS) and all(len(by_n) == len(sim.WINDOWS) for by_n in cells.values())
    for name, by_n in cells.items():
        worst = max(max(c["1.0"]["pass"], c["1.0"]["top1 pass"]) for c in by_n.values())
        assert (worst > limit) == (name in sim.UNCLAIMED), (name, worst, limit)


def test_a_small_run_reproduces_the_empty_windows_mechanism():
    """The script's cell, 300 draws, 96 windows of 511 positions, 98% of them counting none, the share at its limit
    0.005 (14% of draws count nothing): the gate's interval passes within the 99.9% binomial range of 2.5%, while
    the plain studentized interval (the mean's, [0, 0] on draws that counted nothing) passes beyond it on the same
    kind of draws."""
    sim = experiment("simulate_shares")
    setting = (511, 0.005, 20.0, 0.98)
    reps, allowed = 300, binom.ppf(0.999, 300, 0.025) / 300
    got = sim.cell(setting, 96, 1.0, reps, 1000, 11, np.random.default_rng(11))
    assert got["pass"] <= allowed and got["top1 pass"] <= allowed, got
    rng = np.random.default_rng(12)
    plain = sum(mean_interval(None, sim.windows(rng, 96, *setting), 1000, 0.95, r)[1] <= 0.005
                for r in range(reps)) / reps
    assert plain > allowed, plain
