"""Sequential documents, by simulation: repeated looks at a growing set of paired documents must not inflate the
chance of a wrong PASS above the configured error, and a candidate equal to the baseline is eventually PASSed.

Synthetic paired per-document outcomes (0/1, as lm-eval scores accuracy): the baseline is right with
probability 0.5, the candidate disagrees on a few documents (as a quantized cache does), the disagreements
set its true accuracy ratio. Each repetition runs the gate's own procedure: judge after ``limit`` documents,
then after every look of :func:`kvquant.experiment.gate_config.looks` while the verdict is inconclusive.
"""

import dataclasses

import numpy as np
import pytest
from scipy.stats import binom

from kvquant.experiment.gate_config import GateConfig
from kvquant.runner.gate import FAIL, INCONCLUSIVE, PASS, paired_interval, judge
from kvquant.experiment.gate_config import look_confidence, looks
from kvquant.experiment.results import MetricId, MetricRow, RunPlan

SEED = 20261202
BASE_RIGHT = 0.5


def paired(n: int, lost: float, gained: float, rng) -> tuple[np.ndarray, np.ndarray]:
    """``n`` documents: P(baseline right, candidate wrong) = ``lost``, P(wrong, right) = ``gained``."""
    u = rng.random(n)
    base = (u < BASE_RIGHT).astype(float)
    cand = base.copy()
    cand[u < lost] = 0  # of the baseline's right answers (u < 0.5), these are lost
    cand[(u >= BASE_RIGHT) & (u < BASE_RIGHT + gained)] = 1
    return base, cand


def sequential_verdict(base, cand, policy: GateConfig, limit: int, seed: int, widen: bool = True) -> tuple[str, int]:
    """The verdict and documents used by the gate's looks over these documents (``widen=False``: every look at
    the plain confidence, the naive procedure whose error the looks inflate)."""
    counts = looks(limit, policy.max_documents)
    confidence = look_confidence(policy, len(counts)) if widen else policy.confidence
    for n in counts:
        low, high = paired_interval("accuracy", base[:n], cand[:n], policy.bootstrap, confidence, seed)
        row = MetricRow("c", MetricId("acc", "task"), cand[:n].mean(), base[:n].mean(), n, True, low, high)
        verdict = judge(row, policy).verdict
        if verdict != INCONCLUSIVE:
            return verdict, n
    return INCONCLUSIVE, counts[-1]


def simulate(lost, gained, policy, limit, reps, widen=True):
    rng = np.random.default_rng(SEED)
    out = []
    for rep in range(reps):
        base, cand = paired(policy.max_documents, lost, gained, rng)
        out.append(sequential_verdict(base, cand, policy, limit, SEED + rep, widen))
    return out


@pytest.mark.slow
def test_a_candidate_at_the_threshold_passes_at_most_at_the_error_rate():
    """True ratio exactly 0.97 (the worst case for a wrong pass): at most (1 - confidence) / 2 = 2.5% may
    pass. 1,000 repetitions, 5 looks (100..1,600 documents); the bound checked is that the observed count is
    within the 99.9% binomial range of a 2.5% rate, and the naive procedure (95% at every look) errs more."""
    policy = GateConfig(min_relative_accuracy=0.97, max_documents=1600, bootstrap=400)
    lost = 0.04
    gained = lost - (1 - 0.97) * BASE_RIGHT  # candidate right with probability 0.485: ratio 0.97
    reps = 1000
    verdicts = [v for v, _ in simulate(lost, gained, policy, 100, reps)]
    wrong = verdicts.count(PASS)
    allowed = (1 - policy.confidence) / 2
    assert wrong <= binom.ppf(0.999, reps, allowed), f"{wrong} wrong passes in {reps}"
    naive = [v for v, _ in simulate(lost, gained, policy, 100, reps, widen=False)].count(PASS)
    assert naive > wrong  # the looks do inflate the error without the widening: the test can see it


def test_rare_disagreements_do_not_make_a_wrong_pass_likely():
    """Found in review: a good quantizer flips few documents, and a normal-theory interval shrank to nothing
    there (no flip in 100 documents gave [1, 1], 26% wrong passes over the looks). True ratio 0.97, the
    candidate only ever loses answers (1.5% of documents): 500 repetitions over the looks."""
    policy = GateConfig(min_relative_accuracy=0.97, max_documents=1600, bootstrap=400)
    reps = 500
    wrong = [v for v, _ in simulate(0.015, 0.0, policy, 100, reps)].count(PASS)
    assert wrong <= binom.ppf(0.999, reps, (1 - policy.confidence) / 2), f"{wrong} wrong passes in {reps}"


def test_a_candidate_clearly_below_fails_and_never_passes():
    policy = GateConfig(min_relative_accuracy=0.97, max_documents=1600, bootstrap=400)
    verdicts = [v for v, _ in simulate(0.08, 0.0, policy, 100, 200)]  # ratio 0.84
    assert verdicts.count(PASS) == 0 and verdicts.count(FAIL) >= 190


def test_a_candidate_equal_to_the_baseline_is_eventually_passed():
    """Equal accuracy, 8% of the documents flipping either way: undecidable at 100 documents, PASSed by the
    budget in nearly every repetition."""
    policy = GateConfig(min_relative_accuracy=0.97, max_documents=12800, bootstrap=400)
    outcomes = simulate(0.04, 0.04, policy, 100, 200)
    verdicts = [v for v, _ in outcomes]
    assert verdicts.count(FAIL) == 0
    assert verdicts.count(PASS) >= 196
    assert np.median([n for v, n in outcomes if v == PASS]) > 100  # it took more than the first look


class FakeTokenizer:
    def __call__(self, text):
        return type("Encoded", (), {"input_ids": [1, 2, 3]})()


class FakeSession:
    """Measures synthetic paired outcomes of one task: documents ``[0, limit)`` then every range the split adds,
    recording which (label, range) it was asked to score."""

    def __init__(self, cfg, outcomes: dict[str, np.ndarray]):
        from kvquant.scoring.parallel import ONE

        self.cfg, self.outcomes, self.tokenizer, self.maxlen = cfg, outcomes, FakeTokenizer(), 64
        self.processes = ONE
        self.scored: list[tuple[str, int, int]] = []

    def measure(self, candidate, split, label=None, tasks=True, probe=None):
        from kvquant.experiment.results import Measured, Memory, Outcomes

        label = label or candidate.label
        task = self.cfg.eval.tasks.names[0]
        parts = [range(self.cfg.eval.tasks.limit), *split.more.get(task, ())]
        for part in parts:
            if (label, part.start, part.stop) not in self.scored:
                self.scored.append((label, part.start, part.stop))
        scores = np.concatenate([self.outcomes[label][p.start : p.stop] for p in parts])
        metric = MetricId("acc", task)
        return Measured(label, (Outcomes(metric, tuple(scores)),), Memory({}, {"bits_per_element": 4.0}))


@pytest.mark.parametrize("task, sizes", [("task", {"task": 500}), ("passkey_256", {})])
def test_the_runner_adds_documents_only_where_a_verdict_is_open(monkeypatch, task, sizes):
    """Looks planned at 100, 200, 400 and 800 documents; the task ends at 500: the nearly equal candidate is
    scored while it is open, to the task's end; the clearly worse one fails at the first look and gets no more
    documents; the baseline is scored on every document a candidate is. A generated task's size (what is written)
    is no size to run out of, so it is not among the sizes the report states "left" from."""
    from kvquant.runner import judging
    from kvquant.experiment.config import load_config
    from kvquant.runner.gate import decide, metric_rows
    from kvquant.scoring.session import BASELINE, evaluation_split

    rng = np.random.default_rng(SEED)
    base, equal = paired(500, 0.0, 0.0, rng)
    equal[rng.random(500) < 0.01] = 0  # a few lost answers: open at 100 documents, shown fine later
    worse = base * (rng.random(500) < 0.6)
    import yaml

    text = yaml.safe_dump({"name": "seq", "candidates": [{"quantizer": "int8", "name": "equal"},
                                                         {"quantizer": "int2", "name": "worse"}],
                           "eval": {"tasks": {"names": [task], "limit": 100}},
                           "gate": {"tasks": [task], "max_documents": 800}})
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    cfg = load_config(f.name)
    session = FakeSession(cfg, {"baseline": base, "equal": equal, "worse": worse})
    monkeypatch.setattr(judging, "task_size", lambda s, task: 500)
    first = {c.label: session.measure(c, evaluation_split(cfg, None, 64, {}))
             for c in [BASELINE, *cfg.candidates]}
    results, sizes_seen = judging.add_documents(session, list(cfg.candidates), {}, first,
                                                {"equal": 8.0, "worse": 2.0}, judging.planned_looks(cfg))
    assert sizes_seen == sizes
    ranges = {(label, a, b) for label, a, b in session.scored}
    assert ("worse", 100, 200) not in ranges  # failed at the first look
    assert {("equal", 100, 200), ("baseline", 100, 200)} <= ranges
    assert max(b for _, _, b in ranges) <= 500  # never beyond the task
    table = metric_rows(cfg, results, ["equal", "worse"], planned_looks=judging.planned_looks(cfg))
    decision = decide(table, {"equal": 8.0, "worse": 2.0}, cfg.gate)
    assert decision.statuses["worse"] == FAIL
    # equal: open at every look, so scored to the task's end (500), not to max_documents (800)
    assert sorted(ranges) == [("baseline", 0, 100), ("baseline", 100, 200), ("baseline", 200, 400),
                              ("baseline", 400, 500), ("equal", 0, 100), ("equal", 100, 200), ("equal", 200, 400),
                              ("equal", 400, 500), ("worse", 0, 100)]
    assert results["equal"][MetricId("acc", task)].n == 500 and results["worse"][MetricId("acc", task)].n == 100
    assert decision.statuses["worse"] == FAIL and decision.statuses["equal"] != FAIL
    assert judging.planned_looks(cfg) == {task: 4}  # 100, 200, 400, 800 planned: the widening counts all of them


def test_task_pace_sums_each_tasks_looks_for_the_candidate_and_the_baseline():
    """Seconds per document of a gated task: the candidate's and the baseline's time over every look, divided by
    the documents scored; a task missing either's time, and ungated rows, are left out."""
    from kvquant.runner.judging import task_pace

    def row(candidate, source, gated=True, n=40):
        return MetricRow(candidate, MetricId("acc", source), 0.5, 0.5, n, gated)

    seconds = {("int8", "task/arc"): 6.0, ("int8", "task/arc@20-40"): 10.0, ("baseline", "task/arc"): 4.0,
               ("baseline", "task/arc@20-40"): 8.0, ("baseline", "ppl/wiki"): 99.0, ("int8", "task/arc_e"): 1.0,
               ("int4", "task/piqa"): 3.0}
    table = [row("int8", "arc"), row("int8", "arc_e"), row("int4", "piqa"), row("int2", "arc", gated=False)]
    assert task_pace(seconds, table) == {("int8", "arc"): pytest.approx((6 + 10 + 4 + 8) / 40)}


def test_a_sequential_gate_writes_a_probe_tasks_documents_to_its_last_look(tiny_config):
    """passkey_256 gated from 20 documents with looks to 100: 100 are written (before: 50, so looks stopped at 50,
    and the size read back was whatever the shared task folder held); the task's size is that count, without
    reading the folder."""
    from types import SimpleNamespace

    from kvquant.scoring.session import probe_counts, task_size

    cfg = tiny_config("probe-looks", candidates=[{"quantizer": "int8"}],
                      eval={"tasks": {"names": ["passkey_256", "needle_single_256"], "limit": 20}},
                      gate={"tasks": ["passkey_256"], "max_documents": 100})
    assert probe_counts(cfg) == {"passkey_256": 100, "needle_single_256": 20}
    # a search that calibrates on perplexity windows alone keeps the looks' count (before: 20, its limit)
    searched = tiny_config("probe-looks-search", eval={
        "tasks": {"names": ["passkey_256"], "limit": 20},
        "perplexity": [{"name": "tinystories", "source": "local:text/tinystories/validation-first1000.jsonl",
                        "limit": 2, "max_length": 128}]},
        gate={"tasks": ["passkey_256"], "perplexity": ["tinystories"], "max_documents": 100},
        search={"ladder": [{"quantizer": "int2"}, {"quantizer": "int8"}], "documents": 0})
    assert probe_counts(searched) == {"passkey_256": 100}

    def no_folder():
        raise AssertionError("a probe task's size is not read from the task folder")

    session = SimpleNamespace(cfg=cfg, folder=no_folder)
    assert (task_size(session, "passkey_256"), task_size(session, "needle_single_256")) == (100, 20)


class TwoTaskSession(FakeSession):
    """:class:`FakeSession` over every task of the config: ``outcomes[label][task]``; records (label, task, a, b)."""

    def measure(self, candidate, split, label=None, tasks=True, probe=None):
        from kvquant.experiment.results import Measured, Memory, Outcomes

        label, found = label or candidate.label, []
        for task in self.cfg.eval.tasks.names:
            parts = [range(self.cfg.eval.tasks.limit), *split.more.get(task, ())]
            self.scored += [(label, task, p.start, p.stop) for p in parts
                            if (label, task, p.start, p.stop) not in self.scored]
            scores = np.concatenate([self.outcomes[label][task][p.start : p.stop] for p in parts])
            found.append(Outcomes(MetricId("acc", task), tuple(scores)))
        bits = 16.0 if label == "baseline" else 4.0
        return Measured(label, tuple(found), Memory({}, {"bits_per_element": bits, "tokens": 64}))


def answers(size: int, right: int, lost: list[int], gained: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A baseline right on its first ``right`` of ``size`` documents, and a candidate that loses ``lost`` and gains
    ``gained`` (document numbers) from it."""
    base = (np.arange(size) < right).astype(float)
    other = base.copy()
    other[lost], other[gained] = 0.0, 1.0
    return base, other


def two_tasks(tmp_path, monkeypatch, candidates: dict[str, str], staged: bool = False, **gate):
    """A config of two gated tasks, 'short' (200 documents) and 'long' (800), looks at 100, 200, 400 and 800
    documents, ``candidates`` (name: quantizer; ``staged``: as a staged run's stages, in order) and more ``gate``
    settings."""
    import yaml

    from kvquant.experiment.config import load_config
    from kvquant.runner import judging

    path = tmp_path / "seq.yaml"
    settings = [{"quantizer": q, "name": name} for name, q in candidates.items()]
    tasks = {"tasks": {"names": ["short", "long"], "limit": 100}}
    text = {"mode": "streaming", "perplexity": [  # a staged run's serving shape cuts its requests from a text
        {"name": "text", "source": "local:text/tinystories/validation-first1000.jsonl", "limit": 2}]}
    path.write_text(yaml.safe_dump({
        "name": "seq", **({"stages": settings} if staged else {"candidates": settings}),
        "eval": {**tasks, **(text if staged else {})},
        "gate": {"tasks": ["short", "long"], "max_documents": 800, **gate}}))
    monkeypatch.setattr(judging, "task_size", lambda s, task: {"short": 200, "long": 800}[task])
    return load_config(path)


def staged_looks(tmp_path, monkeypatch, quantizers: dict[str, str], scores: dict, bits: dict[str, float]):
    """Stages ``quantizers`` (name: quantizer, in order) over :func:`two_tasks` answering ``scores`` (label: task:
    answers), their looks taken by ``add_documents``. Returns the candidates' config (same split), the staged
    config, the session, the results, task sizes and the most documents each (label, task) was scored on."""
    from kvquant.runner import judging
    from kvquant.scoring.session import BASELINE, evaluation_split

    plain = two_tasks(tmp_path, monkeypatch, quantizers)
    split = evaluation_split(plain, None, 64, {})  # the staged config's text is never read here
    monkeypatch.setattr(judging, "evaluation_split", lambda *args: split)
    cfg = two_tasks(tmp_path, monkeypatch, quantizers, staged=True)
    session = TwoTaskSession(cfg, scores)
    first = {c.label: session.measure(c, split) for c in [BASELINE, *cfg.stages]}
    results, sizes = judging.add_documents(session, list(cfg.stages), {}, first, bits, judging.planned_looks(cfg))
    scored = {(label, task): max(b for who, t, _, b in session.scored if (who, t) == (label, task))
              for label in quantizers for task in ("short", "long")}
    return plain, cfg, session, results, sizes, scored


def test_a_candidate_open_on_a_task_with_no_look_left_gets_no_more_documents_elsewhere(monkeypatch, tmp_path):
    """Task 'short' has 200 documents, 'long' 800; looks at 100, 200, 400, 800. 'stuck' is open on 'short' when
    its documents run out, so it can never pass: no more documents on 'long' for it (they could only make it fail).
    Before, it was scored on 'long' to 800. 'open', which passes 'short', goes on (and the baseline with it). The
    report's row says why: 'long' not looked at further for 'stuck'."""

    from kvquant.runner import judging
    from kvquant.scoring.session import BASELINE, evaluation_split

    base_short, stuck_short = answers(200, 120, [10, 50, 110], [150])
    base_long, stuck_long = answers(800, 480, [20, 300], [130, 600])
    _, open_long = answers(800, 480, [30, 90, 250, 410, 700], [140])
    _, open_short = answers(200, 120, [], list(range(120, 135)))  # 15 gained: passes 'short'
    cfg = two_tasks(tmp_path, monkeypatch, {"stuck": "int4", "open": "int8"})
    session = TwoTaskSession(cfg, {"baseline": {"short": base_short, "long": base_long},
                                   "stuck": {"short": stuck_short, "long": stuck_long},
                                   "open": {"short": open_short, "long": open_long}})
    first = {c.label: session.measure(c, evaluation_split(cfg, None, 64, {})) for c in [BASELINE, *cfg.candidates]}
    bits = {"stuck": 5.0, "open": 8.0}
    results, sizes = judging.add_documents(session, list(cfg.candidates), {}, first, bits, judging.planned_looks(cfg))
    scored = {(label, task): max(b for who, t, _, b in session.scored if (who, t) == (label, task))
              for label in ("baseline", "stuck", "open") for task in ("short", "long")}
    assert scored[("stuck", "short")] == 200 and scored[("stuck", "long")] == 200  # not 800
    assert scored[("open", "long")] > 200 and scored[("baseline", "long")] == scored[("open", "long")]
    plan = RunPlan(candidates=("stuck", "open"), looks=judging.planned_looks(cfg))
    table, decision, _ = judging.judge_run(cfg, plan, list(cfg.candidates), results, [], {}, sizes)
    verdicts = {(v.row.candidate, v.row.metric.source): v for v in decision.verdicts}
    assert verdicts[("stuck", "short")].verdict == verdicts[("stuck", "long")].verdict == INCONCLUSIVE  # premise
    assert verdicts[("stuck", "short")].note == "its last look: every document the task has (200)"
    note = "not looked at further: short is open at its last look (200 documents), so none can make this pass"
    assert verdicts[("stuck", "long")].note == note and decision.chosen == "open"
    assert all(v.note is None for v in decision.verdicts if v.row.candidate == "open")
    assert judging.planned_looks(cfg) == {"short": 4, "long": 4}  # the widening still counts every look planned


def test_a_staged_run_takes_no_looks_for_stages_after_one_that_cannot_pass(monkeypatch, tmp_path):
    """Stages a, b, c in order; b fails at the first look, so the answer is a stage before it whatever c scores:
    c, open on both tasks, gets no more documents (before, it was scored to 200 on both, until 'short' ran out), and
    its rows say why; a, before b, still gets its looks."""
    from kvquant.runner import judging
    from kvquant.scoring.session import BASELINE, evaluation_split

    base_short, a_short = answers(200, 120, [], list(range(120, 135)))  # 15 gained: a passes 'short'
    base_long, a_long = answers(800, 480, [30, 90, 250, 410, 700], [140])  # open on 'long'
    _, b_short = answers(200, 120, list(range(0, 60, 2)), [])  # 30 of the first 100 lost: fails at once
    _, c_short = answers(200, 120, [10, 50], [150])
    _, c_long = answers(800, 480, [20, 300], [130, 600])
    bits = {"a": 8.0, "b": 2.0, "c": 4.0}
    plain, cfg, session, results, sizes, scored = staged_looks(
        tmp_path, monkeypatch, {"a": "int8", "b": "int2", "c": "int4"},
        {"baseline": {"short": base_short, "long": base_long}, "a": {"short": a_short, "long": a_long},
         "b": {"short": b_short, "long": base_long}, "c": {"short": c_short, "long": c_long}}, bits)
    stages = list(cfg.stages)
    assert scored[("c", "short")] == scored[("c", "long")] == scored[("b", "long")] == 100
    assert scored[("a", "long")] == 800
    plan = RunPlan(candidates=("a", "b", "c"), looks=judging.planned_looks(cfg), staged=True)
    _, decision, _ = judging.judge_run(cfg, plan, stages, results, [], {}, sizes)
    verdicts = {(v.row.candidate, v.row.metric.source): v for v in decision.verdicts}
    assert decision.statuses["b"] == FAIL and verdicts[("c", "long")].verdict == INCONCLUSIVE  # premise
    note = "not looked at further: an earlier stage, b, cannot pass, so this stage cannot be the answer"
    assert [v.note for v in decision.verdicts if v.row.candidate == "c" and v.verdict == INCONCLUSIVE] == \
        [note] * sum(v.verdict == INCONCLUSIVE for v in decision.verdicts if v.row.candidate == "c") != []
    assert all(v.note is None for v in decision.verdicts if v.row.candidate in ("a", "b"))
    once = two_tasks(tmp_path, monkeypatch, {"a": "int8", "b": "int2", "c": "int4"}, staged=True, max_documents=None)
    _, decision, _ = judging.judge_run(once, RunPlan(candidates=("a", "b", "c"), staged=True), list(once.stages),
                                       results, [], {}, sizes)
    assert all(v.note is None for v in decision.verdicts)  # a run without looks: none were left out
    # candidates, not stages: the same answers keep c's looks (no order makes b's failure decide anything)
    session.cfg, session.scored = plain, []
    split = evaluation_split(plain, None, 64, {})
    first = {c.label: session.measure(c, split) for c in [BASELINE, *plain.candidates]}
    judging.add_documents(session, list(plain.candidates), {}, first, bits, judging.planned_looks(plain))
    assert max(b for who, t, _, b in session.scored if (who, t) == ("c", "long")) > 100


def test_a_stage_open_at_its_last_look_stops_the_looks_of_the_stages_after_it(monkeypatch, tmp_path):
    """Stages a, b, c; b has not failed but is open on 'short' when its 200 documents run out (its last look), so
    it cannot pass and the answer is a stage before it: c, open on 'long', is scored to 200 there (the look that
    ran 'short' out), not on to 800; a, before b, still gets its looks. Review: stopping only after a stage that
    fails left this case untested."""
    from kvquant.runner import judging

    base_short, a_short = answers(200, 120, [], list(range(120, 135)))  # a and c pass 'short'
    base_long, a_long = answers(800, 480, [30, 90, 250, 410, 700], [140])  # a open on 'long'
    _, b_short = answers(200, 120, [10, 50, 110], [150])  # open on 'short' at its last look
    _, c_long = answers(800, 480, [20, 300], [130, 600])  # open on 'long'
    _, cfg, _, results, sizes, scored = staged_looks(
        tmp_path, monkeypatch, {"a": "int8", "b": "int4", "c": "int2"},
        {"baseline": {"short": base_short, "long": base_long}, "a": {"short": a_short, "long": a_long},
         "b": {"short": b_short, "long": base_long}, "c": {"short": a_short, "long": c_long}},
        {"a": 8.0, "b": 4.0, "c": 2.0})
    stages = list(cfg.stages)
    assert scored[("b", "short")] == scored[("c", "long")] == 200 and scored[("a", "long")] == 800
    plan = RunPlan(candidates=("a", "b", "c"), looks=judging.planned_looks(cfg), staged=True)
    _, decision, _ = judging.judge_run(cfg, plan, stages, results, [], {}, sizes)
    verdicts = {(v.row.candidate, v.row.metric.source): v for v in decision.verdicts}
    assert decision.statuses["b"] != FAIL and verdicts[("b", "short")].verdict == INCONCLUSIVE  # premise
    assert verdicts[("c", "long")].verdict == INCONCLUSIVE and verdicts[("c", "long")].note == \
        "not looked at further: an earlier stage, b, cannot pass, so this stage cannot be the answer"


def test_stages_after_the_first_that_cannot_pass_say_so_whatever_stops_it():
    """Review: stages a, b, c, d, e; b is open at its last look (not failed), d fails. c, d and e come after b, the
    first that cannot pass: the open rows of c and e name b (not d, the last); d, shown to fail, gets no note; a,
    before b, none. Only failures counted, c would have no note."""
    from kvquant.runner.gate import GateConfig, decide
    from kvquant.runner.judging import halt_notes, stages_beyond

    assert stages_beyond(("a", "b", "c", "d", "e"), {"b", "d"}) == {"c": "b", "d": "b", "e": "b"}
    assert stages_beyond(("a", "b"), set()) == {} and stages_beyond((), {"a"}) == {}

    def row(candidate, task, n, low=0.95, high=1.02):
        return MetricRow(candidate, MetricId("acc", task), 0.5, 0.5, n, True, low, high)

    policy = GateConfig(min_relative_accuracy=0.97, max_documents=1600)
    ends = {"short": (200, "every document the task has (200)")}
    rows = [row("a", "short", 100), row("a", "long", 100), row("b", "short", 200), row("b", "long", 200),
            row("c", "short", 100), row("c", "long", 100), row("d", "short", 100, 0.80, 0.90),
            row("d", "long", 100), row("e", "long", 100)]
    bits = dict.fromkeys("abcde", 4.0)
    decision = decide(rows, bits, policy, annotate=halt_notes(ends, True, ("a", "b", "c", "d", "e")))
    notes = {(v.row.candidate, v.row.metric.source): v.note for v in decision.verdicts}
    after = "not looked at further: an earlier stage, b, cannot pass, so this stage cannot be the answer"
    assert notes[("c", "short")] == notes[("c", "long")] == notes[("e", "long")] == after
    assert notes[("b", "short")] == "its last look: every document the task has (200)"
    assert notes[("d", "long")] is None and decision.statuses["d"] == FAIL
    assert notes[("a", "short")] is None and notes[("a", "long")] is None


def test_a_task_is_at_its_last_look_by_the_candidates_own_documents_not_the_baselines():
    """Found in review of the first version, which judged a task's end by the baseline's documents: another
    candidate's looks (or a render whose candidate's last look is not stored) leave a candidate's paired row
    shorter than the baseline, and that candidate still has looks to take. A row at its last look says what ends
    it: the plan or the task (review: the first version guessed from the row's estimate). A candidate shown to fail
    gets no such note (it is not looked at further for that)."""
    from kvquant.runner.gate import GateConfig, decide
    from kvquant.runner.judging import halt_notes, open_at_last_look

    def row(candidate, task, n, low=0.95, high=1.02):
        return MetricRow(candidate, MetricId("acc", task), 0.5, 0.5, n, True, low, high)

    policy = GateConfig(min_relative_accuracy=0.97, max_documents=1600)
    ends = {"short": (200, "every document the task has (200)"),
            "long": (1600, "the plan's last (gate.max_documents = 1,600)")}
    rows = [row("behind", "short", 100), row("behind", "long", 100), row("done", "short", 200),
            row("done", "long", 400), row("capped", "long", 1600), row("capped", "short", 100),
            row("level", "short", 200, 0.94, 1.0),  # its estimate, 0.97, sits on the threshold: no "more"
            row("failing", "short", 200), row("failing", "long", 400, 0.80, 0.90)]
    bits = {"behind": 4.0, "done": 5.0, "capped": 6.0, "level": 7.5, "failing": 3.0}
    decision = decide(rows, bits, policy, sizes={"short": 200}, annotate=halt_notes(ends, True, ()))
    assert set(open_at_last_look(decision.verdicts, ends)) == {"done", "capped", "level", "failing"}
    notes = {(v.row.candidate, v.row.metric.source): v.note for v in decision.verdicts}
    assert notes[("behind", "short")] is None and notes[("behind", "long")] is None
    assert notes[("done", "short")] == notes[("level", "short")] == "its last look: every document the task has (200)"
    assert notes[("done", "long")] == ("not looked at further: short is open at its last look (200 documents), so "
                                       "none can make this pass")
    assert decision.decision == INCONCLUSIVE and notes[("done", "long")] in decision.reason  # the verdict line too
    assert notes[("capped", "long")] == "its last look: the plan's last (gate.max_documents = 1,600)"
    assert notes[("capped", "short")].startswith("not looked at further: long is open at its last look (1,600")
    assert notes[("failing", "short")] is None and decision.statuses["failing"] == FAIL
    assert decide(rows, bits, policy).verdicts == \
        [dataclasses.replace(v, note=None, left=None) for v in decision.verdicts]  # no ends: no notes


def test_a_candidate_with_a_metric_not_exercised_says_why_its_open_tasks_were_not_looked_at_further():
    """A sequential run gives no more documents to a candidate with a metric not exercised (more cannot make it
    pass): its open task rows say so (before, they only read "~N more would decide it", as if the run could have
    taken them); a run without looks, and a candidate shown to fail, get no such note."""
    from kvquant.runner.gate import NOT_EXERCISED, GateConfig, decide
    from kvquant.runner.judging import halt_notes

    def row(candidate, task, low=0.95, high=1.02, share=1.0):
        return MetricRow(candidate, MetricId("acc", task), 0.5, 0.5, 200, True, low, high, share)

    policy = GateConfig(min_relative_accuracy=0.97, max_documents=1600)
    rows = [row("idle", "short", share=0.5), row("idle", "long"), row("open", "short"), row("open", "long"),
            row("failing", "short", share=0.5), row("failing", "long", 0.80, 0.90), row("failing", "mid")]
    bits = {"idle": 4.0, "open": 5.0, "failing": 3.0}
    decision = decide(rows, bits, policy, annotate=halt_notes({}, True, ()))
    verdicts = {(v.row.candidate, v.row.metric.source): v for v in decision.verdicts}
    assert verdicts[("idle", "short")].verdict == NOT_EXERCISED and verdicts[("idle", "short")].note is None
    note = "not looked at further: acc/short is not exercised, so none can make this pass"
    assert verdicts[("idle", "long")].verdict == INCONCLUSIVE and verdicts[("idle", "long")].note == note
    assert all(verdicts[("open", t)].note is None for t in ("short", "long"))
    assert decision.statuses["failing"] == FAIL and verdicts[("failing", "short")].note is None
    assert verdicts[("failing", "mid")].verdict == INCONCLUSIVE and verdicts[("failing", "mid")].note is None
    once = decide(rows, bits, GateConfig(min_relative_accuracy=0.97), annotate=halt_notes({}, False, ()))
    assert all(v.note is None for v in once.verdicts)


def test_last_looks_name_the_plan_or_the_tasks_end_and_wait_for_the_baseline(tiny_config):
    """Review: a task of 300 documents with looks to 200 ends at the plan's last look, not the task's end; a
    generated task too (a larger gate.max_documents writes more), unless the config's cap on what it writes comes
    first; a task whose baseline stops short of its last look (a render's look not stored) has no end yet, even
    where its interval would be (the baseline scoring nothing right gives none at any look)."""
    from kvquant.experiment.results import Measured, Outcomes
    from kvquant.runner.judging import last_looks
    from kvquant.scoring.tasks import MAX_PROBE_DOCUMENTS

    def baseline(short: int, passkey: int) -> Measured:
        return Measured("baseline", (Outcomes(MetricId("acc", "tinystories_lastword"), (0.0,) * short),
                                     Outcomes(MetricId("acc", "passkey_256"), (1.0,) * passkey)))

    cfg = tiny_config("ends", candidates=[{"quantizer": "int8"}],
                      eval={"tasks": {"names": ["tinystories_lastword", "passkey_256"], "limit": 20}},
                      gate={"tasks": ["tinystories_lastword", "passkey_256"], "max_documents": 200})
    plan = (200, "the plan's last (gate.max_documents = 200)")
    assert last_looks(cfg, {"tinystories_lastword": 300}, baseline(200, 200)) == \
        {"tinystories_lastword": plan, "passkey_256": plan}
    assert last_looks(cfg, {"tinystories_lastword": 150}, baseline(150, 200))["tinystories_lastword"] == \
        (150, "every document the task has (150)")
    assert last_looks(cfg, {"tinystories_lastword": 300}, baseline(100, 160)) == {}
    big = tiny_config("ends-big", candidates=[{"quantizer": "int8"}],
                      eval={"tasks": {"names": ["passkey_256"], "limit": 20}},
                      gate={"tasks": ["passkey_256"], "max_documents": 2 * MAX_PROBE_DOCUMENTS})
    assert last_looks(big, {}, baseline(0, MAX_PROBE_DOCUMENTS)) == \
        {"passkey_256": (MAX_PROBE_DOCUMENTS, f"every document the config writes ({MAX_PROBE_DOCUMENTS:,})")}


class RenderedSession(TwoTaskSession):
    """A render's session (:class:`kvquant.runner.render.Replay`): ``missing`` (label, task) looks from document
    ``start`` on are not stored, so that candidate's row stops short of the baseline's."""

    def __init__(self, cfg, outcomes, missing: dict[tuple[str, str], int]):
        super().__init__(cfg, outcomes)
        self.missing, self.not_stored = missing, {}

    def measure(self, candidate, split, label=None, tasks=True, probe=None):
        label = label or candidate.label
        for task, parts in split.more.items():
            cut = [r for r in parts if r.start >= self.missing.get((label, task), 10**9)]
            if cut:
                self.not_stored[label, task] = cut[0]
        more = {t: tuple(r for r in parts if r.start < self.missing.get((label, t), 10**9))
                for t, parts in split.more.items()}
        return super().measure(candidate, dataclasses.replace(split, more=more), label, tasks, probe)


def test_a_candidate_whose_last_look_is_not_stored_is_not_halted_by_the_baselines(monkeypatch, tmp_path):
    """Review (a mutant that judged a task's end by the baseline's documents passed the tests above): 'stuck''s
    look 100-199 on 'short' is not stored, the baseline's is, so its 'short' row stops at 100 with looks still to
    take; it is not halted, and its 'long' looks go on (the run would still seek its 'short' look)."""

    from kvquant.runner import judging
    from kvquant.scoring.session import BASELINE, evaluation_split

    base_short, stuck_short = answers(200, 120, [10, 50, 110], [150])
    base_long, stuck_long = answers(800, 480, [20, 300], [130, 600])
    cfg = two_tasks(tmp_path, monkeypatch, {"stuck": "int4"})
    session = RenderedSession(cfg, {"baseline": {"short": base_short, "long": base_long},
                                    "stuck": {"short": stuck_short, "long": stuck_long}}, {("stuck", "short"): 100})
    first = {c.label: session.measure(c, evaluation_split(cfg, None, 64, {})) for c in [BASELINE, *cfg.candidates]}
    results, _ = judging.add_documents(session, list(cfg.candidates), {}, first, {"stuck": 5.0},
                                       judging.planned_looks(cfg))
    short = MetricId("acc", "short")
    assert results["stuck"][short].n == 100 and results["baseline"][short].n == 200
    assert results["stuck"][MetricId("acc", "long")].n > 200  # judged by the baseline's documents: halted at 200


def test_a_render_keeps_the_note_of_a_row_that_takes_no_more_looks():
    """A row that takes no more looks keeps its note in a render even where the baseline's next look of its task
    (another candidate's) is not stored: the run would not seek it for this candidate."""
    from types import SimpleNamespace

    from kvquant.experiment.results import Verdict
    from kvquant.runner.render import Replay

    def verdict(candidate, note=None):
        row = MetricRow(candidate, MetricId("acc", "long"), 0.5, 0.5, 200, True, 0.95, 1.02)
        return Verdict(row, 0.97, 0.99, INCONCLUSIVE, note=note)

    verdicts = [verdict("halted", "not looked at further: ..."), verdict("open")]
    replay = SimpleNamespace(not_stored={("baseline", "long"): range(200, 400)})
    notes = [v.note for v in Replay.with_unstored_looks(replay, verdicts, {"halted": INCONCLUSIVE,
                                                                           "open": INCONCLUSIVE})]
    assert notes == ["not looked at further: ...",
                     "documents 200-399 not stored yet; the run without --render-only takes them"]


@pytest.mark.parametrize("missing", [("stuck", "long"), ("baseline", "long")])
def test_a_render_names_a_look_it_lacks_though_the_candidate_stops_in_that_look(monkeypatch, tmp_path, missing):
    """Review: 'stuck' reaches the end of 'short' (open) in the same look as 'long' 100-199, which is not stored
    for it (or for the baseline): the run took that look (it then fails 'long'), so the render names it, on the
    row, on its flip-rate row (which counts the documents both have) and in the verdict line, instead of saying it
    was not looked at further; with 'long''s look stored, the row is judged at 200."""
    import functools

    from kvquant.runner import judging
    from kvquant.runner.render import Replay
    from kvquant.scoring.session import BASELINE, evaluation_split

    base_short, stuck_short = answers(200, 120, [10, 50, 110], [150])
    base_long, stuck_long = answers(800, 480, [20, 60, 300], [])
    stuck_long[100:200] = 0.0  # loses all of 100-199 that the baseline has right
    cfg = two_tasks(tmp_path, monkeypatch, {"stuck": "int4"}, max_flip_rate=0.05)
    outcomes = {"baseline": {"short": base_short, "long": base_long}, "stuck": {"short": stuck_short,
                                                                                "long": stuck_long}}

    def judged(lacking):
        session = RenderedSession(cfg, outcomes, lacking)
        first = {c.label: session.measure(c, evaluation_split(cfg, None, 64, {})) for c in [BASELINE,
                                                                                           *cfg.candidates]}
        results, sizes = judging.add_documents(session, list(cfg.candidates), {}, first, {"stuck": 5.0},
                                               judging.planned_looks(cfg))
        plan = RunPlan(candidates=("stuck",), looks=judging.planned_looks(cfg))
        _, decision, _ = judging.judge_run(cfg, plan, list(cfg.candidates), results, [], {}, sizes,
                                           functools.partial(Replay.with_unstored_looks, session))
        return {v.row.metric.name: (v.verdict, v.note) for v in decision.verdicts}, decision.reason

    assert judged({})[0]["acc/long"][0] == FAIL  # the run's own verdict
    rows, reason = judged({missing: 100})
    assert rows["acc/short"] == (INCONCLUSIVE, "its last look: every document the task has (200)")
    lacking = "documents 100-199 not stored yet; the run without --render-only takes them"
    assert rows["acc/long"] == rows["flips/long"] == (INCONCLUSIVE, lacking)
    assert lacking in reason and "not looked at further" not in reason
