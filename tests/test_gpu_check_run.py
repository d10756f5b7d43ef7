"""experiments/gpu_check.py as a whole, the parts a CPU can run: the checks run in order within their own time
limits and the run's (a fake clock), results.json written after each, what was left out named; the expected time
printed; and what it refuses (no CUDA device, an earlier results.json or the gated run's CPU report it cannot read)
as one line and exit 2 with nothing written."""

import argparse
import json

import pytest

from kvquant.exits import run_script
from refusals import error_line
from tests.conftest import experiment

ENV = {"date": "2026-12-06T11:00:00", "git_commit": "abc", "machine": "test machine", "torch": "t",
       "transformers": "x"}


@pytest.fixture(scope="module")
def gpu_check():
    return experiment("gpu_check")


def test_checks_run_in_order_within_their_limits_and_the_run_keeps_what_it_measured(gpu_check, tmp_path):
    now = [0.0]
    seen = {}

    def first(args, results, left):
        seen["first"] = [left()]
        now[0] += 120
        seen["first"].append(left())
        results["codes"] = {"fp16": {"error": "Traceback\nRuntimeError: first's row"}}

    def second(args, results, left):
        seen["written"] = json.loads((tmp_path / "results.json").read_text())["codes"]  # after the first check
        seen["second"] = left()
        now[0] += 185
        return "stopped before its last shape"

    def third(args, results, left):
        raise AssertionError("not to be started: no time left")

    stages = {"a": gpu_check.Stage(first, 100, 150), "b": gpu_check.Stage(second, 200, 250),
              "c": gpu_check.Stage(third, 40, 60)}
    results = {"command": "python experiments/gpu_check.py", "environment": ENV}
    gpu_check.run_stages(argparse.Namespace(steps=32), results, tmp_path, ["a", "b", "c"], stages, time_limit=300,
                         clock=lambda: now[0])
    assert seen == {"first": [150, 30], "written": {"fp16": {"error": "Traceback\nRuntimeError: first's row"}},
                    "second": 180}  # b's own limit 250, but the run's 300 - 120 left
    assert results["seconds"] == {"a": 120.0, "b": 185.0}
    assert results["not_run"] == {"b": "stopped after 185 s of its 180 s: stopped before its last shape",
                                  "c": "not started: 0 s of the run's 300 s left, about 40 s expected"}
    assert json.loads((tmp_path / "results.json").read_text()) == results
    report = (tmp_path / "report.md").read_text()
    assert "- *c*: not started: 0 s of the run's 300 s left, about 40 s expected\n" in report
    assert "- seconds per check: a 120.0, b 185.0\n" in report
    assert "- FAIL codes fp16: RuntimeError: first's row\n" in report


def test_a_check_starts_with_a_quarter_of_its_expected_time_left(gpu_check, tmp_path):
    now, ran = [0.0], []

    def stage(name, took):
        def run(args, results, left):
            ran.append((name, left()))
            now[0] += took
        return run

    stages = {"a": gpu_check.Stage(stage("a", 70), 60, 100), "b": gpu_check.Stage(stage("b", 1), 100, 100),
              "c": gpu_check.Stage(stage("c", 1), 200, 100)}
    results = {"command": "x", "environment": ENV}
    gpu_check.run_stages(argparse.Namespace(steps=32), results, tmp_path, ["a", "b", "c"], stages, time_limit=100,
                         clock=lambda: now[0])
    assert ran == [("a", 100), ("b", 30)]  # 30 s left >= 100 / 4; then 29 s < 200 / 4
    assert list(results["not_run"]) == ["c"]


def test_the_plan_line_adds_the_expected_seconds_of_the_checks_chosen(gpu_check):
    stages = gpu_check.STAGES
    assert list(stages) == ["kernel_tests", "memory", "speed", "gated", "codes", "fused", "logits"]
    expected = sum(stages[c].expected_s for c in ("kernel_tests", "memory", "speed", "gated"))
    line = gpu_check.plan_line(["kernel_tests", "memory", "speed", "gated"], time_limit=480)
    assert line == (f"gpu_check: kernel_tests, memory, speed, gated: about {expected:.0f} s expected in all "
                    f"({expected / 60:.1f} min), at most 480 s (--time-limit; checks that do not fit are named in the "
                    "report)")
    # the default run: what issue 57 must show fits the default time limit by its expectations
    assert expected <= gpu_check.TIME_LIMIT


def refused(gpu_check, capsys, argv) -> str:
    code = run_script("gpu_check", lambda: gpu_check.main(argv))
    out = capsys.readouterr()
    assert out.out == "", out
    return error_line(code, out.err, prog="gpu_check")


def test_no_cuda_device_is_one_line_and_exit_2_with_nothing_written(gpu_check, capsys, tmp_path, monkeypatch):
    """It was ``sys.exit("gpu_check: no CUDA device here")``: exit 1, which a caller reads as a failed check."""
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    err = refused(gpu_check, capsys, ["--out", str(tmp_path / "out")])
    assert err == ("gpu_check: error: --device cuda: no CUDA device here; gpu_check measures on a GPU (--render "
                   "rewrites report.md from an earlier results.json without one)")
    assert "no CUDA device here" in refused(gpu_check, capsys, ["--device", "cpu", "--out", str(tmp_path / "out")])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("planted, needle", [("{not json", "is not a JSON file this command reads"),
                                             ("[1, 2]", "holds a JSON list"),
                                             ("{}", "is not a results.json gpu_check writes")])
def test_an_earlier_results_json_it_cannot_read_is_refused_before_any_work(gpu_check, capsys, tmp_path, monkeypatch,
                                                                           planted, needle):
    """--keep-from read its JSON with json.loads(path.read_text()): a file that is not JSON was exit 3 (a traceback
    in a log), after the CUDA check; now kvquant.fs.read_json, as --render: one line, exit 2, nothing written."""
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    (tmp_path / "earlier.json").write_text(planted)
    err = refused(gpu_check, capsys, ["--keep-from", str(tmp_path / "earlier.json"), "--out", str(tmp_path / "out")])
    assert err.startswith(f"gpu_check: error: --keep-from: {tmp_path / 'earlier.json'} ") and needle in err, err
    err = refused(gpu_check, capsys, ["--gated-cpu", str(tmp_path / "earlier.json"), "--out", str(tmp_path / "out")])
    assert err.startswith(f"gpu_check: error: --gated-cpu: {tmp_path / 'earlier.json'} ") and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.json"]
