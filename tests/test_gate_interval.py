"""The accuracy interval (issue 53 item 1): its error at the margin by simulation through kvquant's own function, a
0-flip pass the old interval gave, and its ends against a score statistic written here from scratch.

Paired 0/1 outcomes are drawn as their four counts (both right, only the baseline, only the candidate, neither);
the full grid, the old interval beside this one and the power are ``experiments/simulate_gate.py`` (docs/gate.md).
"""

import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar
from scipy.stats import norm

from kvquant.runner.gate import FAIL, INCONCLUSIVE, PASS, judge, paired_interval
from kvquant.runner.paired import paired_ratio_bounds
from kvquant.experiment.gate_config import look_confidence, looks
from kvquant.experiment.gate_config import GateConfig
from kvquant.experiment.results import ACCURACY, MetricId, MetricRow

MARGIN, SEED = 0.97, 20261206
SIX_LOOKS = look_confidence(GateConfig(), 6)  # 99.17%: each look of a 6-look plan


def cells(acc, ratio, gained):
    lost = (1 - ratio) * acc + gained
    return np.array([acc - lost, lost, gained, 1 - acc - gained])


def bound(rate, reps):
    """The nominal rate plus 3 Monte-Carlo standard errors."""
    return rate + 3 * math.sqrt(rate * (1 - rate) / reps)


@pytest.mark.parametrize("gained", [0.0, 0.02], ids=["one way", "two way"])
@pytest.mark.parametrize("acc", [0.2, 0.5, 0.85])
def test_one_look_errs_at_most_at_its_nominal_rate(acc, gained):
    """True ratio exactly 0.97: a pass at one look errs at most (1 - confidence) / 2, at 95% and at a 6-look plan's
    99.17%, from 50 to 2,000 documents (4,000 draws per cell; the old interval erred 6.9% at 100 documents and
    accuracy 0.85 with every flip a loss)."""
    rng, reps = np.random.default_rng([SEED, int(acc * 100), int(gained * 100)]), 4000
    for n in (50, 100, 200, 400, 2000):
        tables = rng.multinomial(n, cells(acc, MARGIN, gained), size=reps)
        for confidence in (0.95, SIX_LOOKS):
            low, _ = paired_ratio_bounds(*tables.T, confidence)
            rate = np.mean(low >= MARGIN)
            assert rate <= bound((1 - confidence) / 2, reps), (n, confidence, rate)


@pytest.mark.parametrize("gained", [0.0, 0.02], ids=["one way", "two way"])
@pytest.mark.parametrize("acc", [0.2, 0.85])
def test_the_whole_sequential_plan_errs_at_most_at_its_nominal_rate(acc, gained):
    """Six looks (50 to 1,600 documents, each at look_confidence), stopping at a pass or a fail: at most 2.5%
    wrong passes over the whole plan at a true ratio of 0.97 (3,000 draws)."""
    rng, reps = np.random.default_rng([SEED, 6, int(acc * 100), int(gained * 100)]), 3000
    counts = looks(50, 1600)
    confidence = look_confidence(GateConfig(max_documents=1600), len(counts))
    steps = [rng.multinomial(m - k, cells(acc, MARGIN, gained), size=reps) for k, m in zip([0, *counts[:-1]], counts)]
    passed, open_ = np.zeros(reps, dtype=bool), np.ones(reps, dtype=bool)
    for tables in np.cumsum(steps, axis=0):
        low, high = paired_ratio_bounds(*tables.T, confidence)
        passed |= open_ & (low >= MARGIN)
        open_ &= (low < MARGIN) & (high >= MARGIN)
    assert np.mean(passed) <= bound(0.025, reps)


def documents(right: int, n: int, lost: int = 0, gained: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-document outcomes of ``n`` documents: the baseline right on ``right``, the candidate losing ``lost``
    of them and gaining ``gained`` of the others."""
    base = np.zeros(n)
    base[:right] = 1
    cand = base.copy()
    cand[:lost] = 0
    cand[right : right + gained] = 1
    return base, cand


def verdict(base, cand, confidence):
    low, high = paired_interval(ACCURACY, base, cand, 1000, confidence, seed=0)
    row = MetricRow("c", MetricId("acc", "task"), cand.mean(), base.mean(), len(base), True, low, high)
    return judge(row, GateConfig(min_relative_accuracy=MARGIN)).verdict


@pytest.mark.parametrize("right, n, confidence", [
    (170, 200, SIX_LOOKS),  # 0 flips at 200 documents, accuracy 0.85, one look of a 6-look plan
    (129, 200, SIX_LOOKS),  # the committed example: int8 on PIQA (acc_norm 0.645) in reports/smollm2-decide
    (85, 100, 0.95),        # 0 flips at 100 documents, accuracy 0.85, one 95% look
])
def test_no_flip_is_not_a_pass_where_an_exact_bound_is_below_the_margin(right, n, confidence):
    """No document flipped. Given the baseline's answers, the candidate's losses among its ``right`` right answers
    are binomial, and the ratio is at least 1 - their rate; the exact (Clopper-Pearson) bound on that rate leaves
    the ratio's lower end below 0.97 here (0.968, 0.958, 0.958), so no honest interval passes. The old interval
    (Dirichlet posterior with half counts) passed all three (lower ends 0.979, 0.972, 0.975)."""
    exact = ((1 - confidence) / 2) ** (1 / right)  # 1 - the exact upper bound of the loss rate: 0 of right lost
    assert exact < MARGIN
    assert verdict(*documents(right, n), confidence) == INCONCLUSIVE


def test_no_flip_passes_where_the_exact_bound_clears_the_margin():
    """0 of 170 right answers lost shows the loss rate below 2.2% (exact one-sided 2.5%), so the ratio above 0.978:
    a pass at one 95% look is sound, and the score interval (lower end 0.972) gives it; 500 documents at accuracy
    0.5 without a flip too."""
    assert 0.025 ** (1 / 170) > MARGIN
    assert verdict(*documents(170, 200), 0.95) == PASS
    assert verdict(*documents(250, 500), 0.95) == PASS
    assert verdict(*documents(170, 200, lost=10), 0.95) == FAIL


def reference_score(a, b, c, d, theta, toward):
    """The continuity-corrected score statistic, written from its definition: the four cells fitted by maximum
    likelihood under ``both + gained = theta (both + lost)`` (numerically, over the share of ``both``), and the
    per-document contribution's standard deviation under that fit."""
    n = a + b + c + d

    def fitted(p11):  # p00 = d / n at the constrained fit (its Lagrange condition); p10 and p01 from the constraint
        p10 = (1 - d / n - theta * p11) / (1 + theta)  # with p01 = theta p10 - (1 - theta) p11, the four sum to 1
        return p11, p10, theta * p10 - (1 - theta) * p11

    def nll(p11):
        p11_, p10, p01 = fitted(p11)
        if min(p11_, p10, p01) < 0:
            return 1e300  # outside the constraint's cells
        return -sum(k * math.log(p) for k, p in ((a, p11_), (b, p10), (c, p01)) if k)

    found = minimize_scalar(nll, bounds=(0, (1 - d / n) / theta), method="bounded", options={"xatol": 1e-12})
    p11, p10, p01 = fitted(found.x)
    variance = (1 - theta) ** 2 * p11 + p01 + theta ** 2 * p10
    return (a + c - theta * (a + b) - toward * 0.5) / math.sqrt(n * variance)


@pytest.mark.parametrize("table", [(100, 5, 2, 50), (30, 7, 3, 60), (80, 1, 6, 13), (170, 0, 0, 30),
                                   (1000, 40, 35, 400)])
def test_the_ends_are_where_the_score_statistic_meets_the_normal_quantile(table):
    """Each end of the 95% interval is the ratio at which the score statistic (fitted here numerically) equals
    the normal quantile: +1.96 at the lower end, -1.96 at the upper."""
    low, high = (float(x) for x in paired_ratio_bounds(*table, 0.95))
    assert low < (table[0] + table[2]) / (table[0] + table[1]) < high
    assert reference_score(*table, low, 1) == pytest.approx(norm.ppf(0.975), abs=1e-4)
    assert reference_score(*table, high, -1) == pytest.approx(-norm.ppf(0.975), abs=1e-4)


def test_no_ratio_without_a_right_baseline_answer():
    assert all(math.isnan(float(x)) for x in paired_ratio_bounds(0, 0, 3, 47, 0.95))
    low, high = paired_ratio_bounds(0, 3, 0, 47, 0.95)  # the candidate never right: nothing excludes 0
    assert float(low) == 0 and reference_score(0, 3, 0, 47, float(high), -1) == pytest.approx(-norm.ppf(0.975),
                                                                                              abs=1e-4)


def test_rejudge_accuracy_pairs_each_documents_answers_across_looks(tmp_path, capsys):
    """experiments/rejudge_accuracy.py: the baseline's and a candidate's answers, first result then looks in order,
    paired per document and judged with today's interval at the row's own confidence."""
    import json

    from conftest import experiment

    rejudge = experiment("rejudge_accuracy")
    partial = tmp_path / "carried"
    answers = {"baseline": ([1] * 150 + [0] * 50, [1] * 100 + [0] * 100), "int8": ([1] * 150 + [0] * 50,
                                                                              [1] * 100 + [0] * 100)}
    for label, (first, look) in answers.items():
        (partial / label).mkdir(parents=True)
        (partial / label / "task__piqa.json").write_text(json.dumps({"result": {"acc_norm": first}}))
        (partial / label / "task__piqa@200-400.json").write_text(json.dumps({"result": {"acc_norm": look}}))
    row = {"kind": "accuracy", "gated": True, "n": 400, "confidence": 0.99167, "threshold": 0.97, "ci_low": 0.972,
           "ci_high": 1.03, "verdict": "pass"}
    (tmp_path / "results.json").write_text(json.dumps({"candidates": [{"name": "int8",
                                                                        "metrics": {"acc_norm/piqa": row}}]}))
    rows = rejudge.rejudged(tmp_path, partial)
    low, high = (float(x) for x in paired_ratio_bounds(250, 0, 0, 150, 0.99167))
    assert low < 0.97 < high  # 250 right answers, none flipped: not enough at a 6-look plan's confidence
    assert rows[2] == f"| int8 | acc_norm/piqa | 400 | 0 | 0 | [0.9720, 1.0300] pass | [{low:.4f}, {high:.4f}] " \
                      "**inconclusive** |"


@pytest.mark.parametrize("odd", ["answers_not_0_1", "answer_nan", "n_negative", "n_float", "confidence_1",
                                 "results_a_list", "no_candidates", "results_fifo", "partial_bad_json",
                                 "candidate_folder_symlink", "no_gated_row", "no_answers_here"])
def test_rejudge_accuracy_refuses_a_hostile_report_in_one_line(tmp_path, capsys, odd):
    """A results.json or partial answers no run writes: one line and exit 2, never exit 3, a hang on a FIFO, or a
    silent verdict (answers of 2 or NaN were counted as "neither"; n = -5 paired all but the last 5)."""
    import json
    import os

    from conftest import experiment

    rejudge = experiment("rejudge_accuracy")
    partial = tmp_path / "partial"
    row = {"kind": "accuracy", "gated": True, "n": 4, "confidence": 0.95, "threshold": 0.97, "ci_low": 0.5,
           "ci_high": 1.2, "verdict": "inconclusive"}
    doc = {"candidates": [{"name": "int8", "metrics": {"acc/piqa": row}}]}
    answers = {"baseline": [1, 1, 0, 1], "int8": [1, 0, 0, 1]}
    if odd == "answers_not_0_1":
        answers["int8"] = [2, 2, 2, 2]
    elif odd == "answer_nan":
        answers["int8"] = [float("nan"), 1, 0, 1]
    elif odd == "n_negative":
        row["n"] = -5
    elif odd == "n_float":
        row["n"] = 2.5
    elif odd == "confidence_1":
        row["confidence"] = 1.0
    elif odd == "results_a_list":
        doc = [doc]
    elif odd == "no_candidates":
        doc = {}
    elif odd == "no_gated_row":  # probe 58 (r08): an empty table and exit 0, read as "nothing changed"
        row["gated"] = False
    elif odd == "no_answers_here":  # probe 58 (r10): every row left out, then the same empty table and exit 0
        answers = {}
    for label, got in answers.items():
        (partial / label).mkdir(parents=True)
        (partial / label / "task__piqa.json").write_text(json.dumps({"result": {"acc": got}}))
    if odd == "results_fifo":
        os.mkfifo(tmp_path / "results.json")
    else:
        (tmp_path / "results.json").write_text(json.dumps(doc))
    if odd == "partial_bad_json":
        (partial / "int8" / "task__piqa.json").write_text("{")
    elif odd == "candidate_folder_symlink":
        (partial / "int8" / "task__piqa.json").unlink()
        (partial / "int8").rmdir()
        (partial / "int8").symlink_to(partial / "baseline")
    from kvquant.exits import run_script

    assert run_script("rejudge_accuracy", lambda: rejudge.main([str(tmp_path)])) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("rejudge_accuracy: error: "), err


@pytest.mark.parametrize("args, needle", [
    ((100, -1, 2, 50, 0.95), "lost must count documents .*got -1$"),
    ((100, 5, 2.5, 50, 0.95), "gained must count documents .*got 2.5"),
    ((10, 30, 30, -40, 0.95), "neither must count documents .*got -40$"),  # flips beyond the 30 documents
    ((float("nan"), 5, 2, 50, 0.95), "both must count documents .*got nan$"),
    (([100, 0], [5, 0], [2, 0], [50, 0], 0.95), "a table of 0 documents has no interval"),
    ((0, 0, 0, 0, 0.95), "a table of 0 documents"),
    ((100, 5, 2, 50, 0), "confidence must be a number in \\(0, 1\\), got 0"),
    ((100, 5, 2, 50, 1.0), "confidence must be a number in \\(0, 1\\), got 1.0"),
    ((100, 5, 2, 50, -0.5), "confidence must be"),
    ((100, 5, 2, 50, "0.95"), "confidence must be"),
    (([100, 90], [5, 4, 3], 2, 50, 0.95), "counts must be numbers or arrays of one shape"),
])
def test_bad_counts_or_confidence_are_one_clear_error(args, needle):
    """Issue 58: direct calls with counts no table holds, or a confidence outside (0, 1), were a traceback deep
    inside (NormalDist, a shape mismatch) or a wrong interval (a negative count read as documents)."""
    with pytest.raises(ValueError, match=f"^paired_ratio_bounds: {needle}"):
        paired_ratio_bounds(*args)
