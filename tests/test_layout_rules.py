"""experiments/layout_rules.py: the package keeps docs/layout.md's rules but for the listed debts, the figures in
docs/layout.md are the command's, and each rule reports a deliberate breach in a small package made here."""

import re
from pathlib import Path

import pytest

from conftest import experiment

rules = experiment("layout_rules")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def package():
    return rules.structure(ROOT / "kvquant")


def test_the_package_breaks_no_rule_but_the_listed_debts_and_exceptions(package):
    problems = rules.judge(rules.breaches(package), {**rules.DEBTS, **rules.EXCEPTIONS})
    assert not problems, "\n".join(problems)


def test_docs_layout_holds_the_figures_the_command_renders(package):
    doc = ROOT / "docs" / "layout.md"
    assert rules.render(doc, rules.figures(package)) == doc.read_text(), (
        "docs/layout.md's figures are stale: python experiments/layout_rules.py --render")


def test_scoring_to_runner_import_lines_are_those_a_plain_text_search_finds(package):
    """An independent count: the lines of kvquant/scoring that begin a ``from kvquant.runner...`` import."""
    lines = {(p.relative_to(ROOT).as_posix(), n) for p in (ROOT / "kvquant" / "scoring").rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.match(r"\s*from kvquant\.runner(\.\w+)* import ", line)}
    edge = ("kvquant/scoring/", "kvquant/runner/")
    ties = package.rooms.edges[edge]["imports"] if package.rooms.has_edge(*edge) else []
    assert {(t.importer, t.line) for t in ties} == lines


FUNCTION = "def long():\n" + "    x = 1\n" * 59 + "    return x\n"  # 61 lines
FAKE = {
    "__init__.py": "",
    "a.py": "from pkg import b\n",
    "b.py": "import pkg.a\n",
    "low/__init__.py": "from pkg.low.base import Thing\n",
    "low/base.py": "A = B = C = 1\n\n\nclass Thing:\n    pass\n\n\ndef helper():\n    from pkg.high.top import X\n"
                   "    return X\n",
    "high/__init__.py": "",
    "high/top.py": "from pkg.low import Thing\nfrom ..low.base import A, B, C\n\nX = (Thing, A, B, C)\n",
    "big.py": "x = 1\n" * 501,
    "fits.py": "x = 1\n" * 500,
    "long.py": FUNCTION,
    "short.py": FUNCTION.replace("    x = 1\n", "", 1),
    "leak.py": "from transformers.cache_utils import _private_thing\nfrom lm_eval._cli.utils import helper\n"
               "from lm_eval.__main__ import cli_evaluate\n",
    "compat/__init__.py": "def size(model):\n    return getattr(model, '_tp_size', 1)\n\n\ndef rank(lm):\n"
                          "    lm._rank = 0\n",
    "user.py": "import pkg.run\n\n\ndef size(model):\n    return model._tp_size\n\n\ndef own(store):\n"
               "    return store._rank\n\n\ndef _rank():\n    return 0\n",
    "run.py": "def main():\n    return 0\n",
    "dup.py": "class Thing:\n    def helper(self):\n        pass\n\n\ndef _rank():\n    return 1\n\n\ndef main():\n"
              "    return 0\n",
    "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.fits import x\n",
}


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake") / "pkg"
    for name, text in FAKE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return rules.structure(root)


def test_imports_are_read_at_module_level_in_functions_under_type_checking_and_through_a_package_face(fake):
    got = {(t.importer, t.target, t.names, t.lazy, t.typing_only) for t in fake.imports}
    assert got == {
        ("pkg/a.py", "pkg/b.py", ("b",), False, False),
        ("pkg/b.py", "pkg/a.py", ("pkg.a",), False, False),
        ("pkg/low/__init__.py", "pkg/low/base.py", ("Thing",), False, False),
        ("pkg/low/base.py", "pkg/high/top.py", ("X",), True, False),
        ("pkg/high/top.py", "pkg/low/base.py", ("Thing",), False, False),  # through low/__init__.py
        ("pkg/high/top.py", "pkg/low/base.py", ("A", "B", "C"), False, False),  # relative
        ("pkg/user.py", "pkg/run.py", ("pkg.run",), False, False),
        ("pkg/typed.py", "pkg/fits.py", ("x",), False, True),
    }


def test_floors_put_the_room_that_imports_more_names_above(fake):
    """high/ takes 4 names from low/, low/ 1 from high/: high/ stands above, and low/ -> high/ runs back up."""
    assert fake.floors["pkg/high/"] == fake.floors["pkg/low/"] + 1
    assert ("pkg/low/", "pkg/high/") in fake.upward and ("pkg/high/", "pkg/low/") not in fake.upward
    assert fake.floors["pkg/typed.py"] == 2 and fake.floors["pkg/fits.py"] == 1


def test_each_deliberate_breach_is_reported(fake):
    found = {b.key: b.size for b in rules.breaches(fake)}
    assert found == {
        ("cycle", "pkg/a.py pkg/b.py"): 2,
        ("cycle", "pkg/high/top.py pkg/low/base.py"): 2,
        ("upward import", "pkg/a.py -> pkg/b.py"): 1,  # a loop of equals: the first by name stands lower
        ("upward import", "pkg/low/ -> pkg/high/"): 1,
        ("module size", "pkg/big.py"): 501,
        ("function size", "pkg/long.py:long"): 61,
        ("private symbol", "pkg/leak.py:1 transformers.cache_utils._private_thing"): 1,
        ("private symbol", "pkg/leak.py:2 lm_eval._cli.utils.helper"): 1,
        ("private symbol", "pkg/user.py:5 _tp_size"): 1,  # a name compat/ wraps; _rank is pkg's own
        ("command imported", "pkg/user.py:1 pkg/run.py"): 1,
        ("transformers.cache_utils outside cache/", "pkg/leak.py:1"): 1,
        ("name defined twice", "Thing"): 2,
        ("name defined twice", "long"): 2,  # long.py's and short.py's
        ("name defined twice", "size"): 2,  # compat/'s and user.py's
    }


def test_a_public_name_defined_at_the_top_of_two_modules_is_a_breach_unless_it_is_a_listed_protocol(fake, monkeypatch):
    """``Thing`` is a class in low/base.py and in dup.py; dup.py's method ``helper`` (a function in low/base.py), its
    private ``_rank`` (also user.py's) and ``main`` (also run.py's: a protocol name) are no breach."""
    found = {b.key: b for b in rules.breaches(fake)}
    twice = found["name defined twice", "Thing"]
    assert (twice.size, twice.detail) == (2, "pkg/dup.py:1, pkg/low/base.py:4")
    assert {key[1] for key in found if key[0] == "name defined twice"} == {"Thing", "long", "size"}
    assert rules.judge(list(found.values()), {k: b.size for k, b in found.items() if k[1] != "Thing"}) == [
        "name defined twice: Thing (2): pkg/dup.py:1, pkg/low/base.py:4"]
    monkeypatch.setattr(rules, "PROTOCOL_NAMES", {})
    again = {b.key: b.detail for b in rules.breaches(fake)}
    assert set(again) - set(found) == {("name defined twice", "main")}
    assert again["name defined twice", "main"] == "pkg/dup.py:10, pkg/run.py:1"


def test_a_listed_debt_passes_only_at_its_size_and_must_go_when_it_is_gone(fake):
    found = rules.breaches(fake)
    listed = {b.key: b.size for b in found}
    assert rules.judge(found, listed) == []
    unlisted = rules.judge(found, {k: v for k, v in listed.items() if k[0] != "module size"})
    assert unlisted == ["module size: pkg/big.py (501)"]
    grown = rules.judge(found, {**listed, ("module size", "pkg/big.py"): 500})
    assert grown == ["module size: pkg/big.py grew from 500 to 501"]
    shrunk = rules.judge(found, {**listed, ("module size", "pkg/big.py"): 502})
    assert shrunk == ["listed at 502 but now 501 (lower the list): module size: pkg/big.py"]
    gone = rules.judge(found, {**listed, ("cycle", "pkg/x.py pkg/y.py"): 2})
    assert gone == ["listed but gone (remove it from the list): cycle: pkg/x.py pkg/y.py"]


def test_check_exits_1_naming_each_breach_of_a_package(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rules, "ROOT", tmp_path)
    (tmp_path / "kvquant").mkdir()
    (tmp_path / "kvquant" / "__init__.py").write_text("x = 1\n" * 501)
    assert rules.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "module size: kvquant/__init__.py (501)" in out
    for rule, where in {**rules.DEBTS, **rules.EXCEPTIONS}:  # none of them is in this package
        assert f"listed but gone (remove it from the list): {rule}: {where}" in out


TRACED = {
    "__init__.py": "",
    "low/__init__.py": "from pkg.low.store import keep\n",
    "low/store.py": "def keep(value, other=None):\n    return [value]\n",
    "high/__init__.py": "",
    "high/use.py": "from pkg.low import keep\nfrom pkg import mid\n\n\nclass Runner:\n"
                   "    def go(self, setting, unrelated):\n"  # line 6
                   "        local = setting.name\n"
                   "        self.step(local)\n"  # 8
                   "        mid.relay(x=local)\n"  # 9
                   "        keep(unrelated)\n"
                   "        return len(setting)\n\n"
                   "    def step(self, value):\n"
                   "        return keep(value, other=1)\n\n\n"  # 14
                   "def back(items):\n    return items\n",
    "mid.py": "def relay(x):\n    from pkg.high.use import back\n\n    box = []\n    box.append(x)\n"
              "    back(box)\n"  # 6
              "    return x.method(x)\n",  # 7
}


def test_a_trace_follows_the_parameter_through_a_package_face_a_method_and_a_container_and_counts_the_climb(
        tmp_path):
    tracer = experiment("layout_trace")
    root = tmp_path / "pkg"
    for name, text in TRACED.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    found = rules.structure(root)
    assert found.floors["pkg/high/"] > found.floors["pkg/mid.py"]  # mid's import of high/ is the lazy one
    got = tracer.trace(found, "pkg/high/use.py:Runner.go", "setting")
    assert [(s.caller, s.line, s.callee, s.param) for s in got.steps] == [
        ("pkg/high/use.py:Runner.go", 8, "pkg/high/use.py:Runner.step", "value"),
        ("pkg/high/use.py:Runner.go", 9, "pkg/mid.py:relay", "x"),
        ("pkg/high/use.py:Runner.step", 14, "pkg/low/store.py:keep", "value"),  # through low/__init__.py
        ("pkg/mid.py:relay", 6, "pkg/high/use.py:back", "items"),  # in the list it was appended to
    ]
    assert got.lost == ["pkg/mid.py:7 x.method"]
    text = tracer.report(found, got)
    assert text.splitlines()[-3] == "files visited: 3; call sites followed: 4; back up a floor: 1"
    assert "pkg/mid.py:relay:6 -> pkg/high/use.py:back (items), floor 1 -> 2  BACK UP" in text


@pytest.mark.parametrize("argv", [["--package", "/nonexistent/kvquant"], ["--render", "--package", "."], ["--bogus"]])
def test_bad_arguments_are_one_line_and_exit_2(argv, capsys):
    """Probe 56: a bad --package printed argparse's usage line and the error (two lines)."""
    with pytest.raises(SystemExit) as stop:
        rules.main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stop.value.code == 2 and len(err) == 1 and err[0].startswith("layout_rules: error: "), err
