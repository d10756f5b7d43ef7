"""Config loading and validation."""

from pathlib import Path

import numpy as np
import pytest

from kvquant.errors import ConfigError
from kvquant.experiment.binding import build
from kvquant.experiment.config import TaskSet, load_config

ROOT = Path(__file__).parents[1]
CONFIGS = sorted(ROOT.glob("configs/**/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT / "configs")) for p in CONFIGS])
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert (cfg.candidates or cfg.stages or cfg.search) and cfg.name


def test_shipped_configs_cover_the_quantizers():
    quantizers = {c.quantizer for p in CONFIGS for c in load_config(p).candidates}
    assert {"fp8_e4m3", "int8", "int4", "int2"} <= quantizers


def write(tmp_path, text):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return path


MINIMAL = """
candidates: [{quantizer: int4}]
eval: {perplexity: [{name: t, source: local:x.txt}]}
"""


def test_minimal_config_and_defaults(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.name == "exp" and cfg.gate.min_relative_accuracy == 0.97 and cfg.eval.mode == "simulated"
    assert cfg.candidates[0].label == "int4"


def test_unknown_key_names_key_and_file(tmp_path):
    path = write(tmp_path, MINIMAL + "gate: {min_relative_acuracy: 0.9}\n")
    with pytest.raises(ConfigError, match=r"exp\.yaml: unknown key gate\.min_relative_acuracy \(valid keys: min_rel"):
        load_config(path)


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match=r"eval\.seed must be int, got str 'abc'"):
        load_config(write(tmp_path, MINIMAL.replace("eval: {", "eval: {seed: abc, ")))
    with pytest.raises(ConfigError, match=r"eval\.mode must be one of \['simulated', 'streaming'\]"):
        load_config(write(tmp_path, MINIMAL.replace("eval: {", "eval: {mode: fast, ")))
    with pytest.raises(ConfigError, match=r"candidates\[0\]\.options must be a mapping"):
        load_config(write(tmp_path, MINIMAL.replace("{quantizer: int4}", "{quantizer: int4, options: 3}")))


def test_missing_and_inconsistent(tmp_path):
    with pytest.raises(ConfigError, match=r"candidates: at least one cache setting \(or a search\) is needed"):
        load_config(write(tmp_path, "eval: {perplexity: [{name: t, source: x.txt}]}"))
    with pytest.raises(ConfigError, match="nothing to measure"):
        load_config(write(tmp_path, "candidates: [{quantizer: int4}]"))
    with pytest.raises(ConfigError, match="names must be unique"):
        load_config(write(tmp_path, MINIMAL.replace("[{quantizer: int4}]", "[{quantizer: int4}, {quantizer: int4}]")))
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")


def test_set_overrides(tmp_path):
    path = write(tmp_path, MINIMAL)
    cfg = load_config(path, ["eval.seed=7", "candidates.0.options.group_size=64", "gate.decide_on=point",
                             "eval.tasks.names=[a, b]"])
    assert cfg.eval.seed == 7 and cfg.candidates[0].options == {"group_size": 64}
    assert cfg.gate.decide_on == "point" and cfg.eval.tasks.names == ["a", "b"]
    with pytest.raises(ConfigError, match="expects key=value"):
        load_config(path, ["eval.seed"])
    with pytest.raises(ConfigError, match="has no item 3"):
        load_config(path, ["candidates.3.quantizer=int8"])
    with pytest.raises(ConfigError, match="unknown key eval.sed"):
        load_config(path, ["eval.sed=3"])


def test_gate_names_must_be_measured_and_something_gated(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError, match=r"gate\.perplexity: 'tt' is not measured.*eval\.perplexity has: t$"):
        load_config(path, ["gate.perplexity=[tt]"])
    with pytest.raises(ConfigError, match=r"gate\.tasks: 'x' is not measured.*has: nothing"):
        load_config(path, ["gate.tasks=[x]"])
    with pytest.raises(ConfigError, match="nothing is gated"):
        load_config(path, ["gate.perplexity=[]"])
    assert load_config(path, ["gate.perplexity=[t]"]).gate.perplexity == ["t"]


@pytest.mark.parametrize("override, message", [
    ("eval.perplexity.0.limit=0", r"eval\.perplexity\[0\]\.limit must be >= 1 or null, got 0"),
    ("eval.perplexity.0.max_length=-1", r"eval\.perplexity\[0\]\.max_length must be >= 2, got -1"),
    ("gate.max_perplexity_ratio=.nan", r"gate\.max_perplexity_ratio must be a finite number, got nan"),
    ("gate.bootstrap=100001", r"gate\.bootstrap must be in 1\.\.100000"),
    ("eval.chunk_size=true", r"eval\.chunk_size must be int, got bool True"),
    ("eval.seed=1.0", r"eval\.seed must be int, got float 1\.0"),
    ("name=../x", r"name '\.\./x' must be a plain name"),
    ("model.device=banana", r"model\.device 'banana' is not a device"),
    ("eval.tasks.limits={a: 3}", r"eval\.tasks\.limits: 'a' is not among names \(none\)"),
])
def test_values_are_range_checked(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, MINIMAL), [override])


def test_set_through_a_scalar_is_an_error(tmp_path):
    path = write(tmp_path, MINIMAL + "gate: {bootstrap: 50}\n")
    with pytest.raises(ConfigError, match=r"--set gate\.bootstrap\.x: gate\.bootstrap is int 50, which has no key 'x'"):
        load_config(path, ["gate.bootstrap.x=1"])
    with pytest.raises(ConfigError, match=r"gate\.bootstrap is int 50, which has no key 'x'"):
        load_config(path, ["gate.bootstrap.x.y=1"])


@pytest.mark.parametrize("content, message", [
    (b"\x00\x01name: x", "a binary file"), ("name: caf\xe9".encode("latin-1"), "not UTF-8 text"),
    (b"- a\n", "must be a mapping of keys, got list"), (b"a: [", "not valid YAML"),
])
def test_unreadable_config_files(tmp_path, content, message):
    path = tmp_path / "exp.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


@pytest.mark.parametrize("options, message", [
    ({"limits": {"arc_easy": np.int64(20)}}, "limits.arc_easy must be an integer >= 1"),
    ({"num_fewshot": {"arc_easy": np.int64(2)}}, "num_fewshot.arc_easy must be an integer in 0..100"),
    ({"num_fewshot": np.int64(2)}, "num_fewshot must be an integer in 0..100"),
])
def test_numpy_integers_are_refused_where_python_builds_a_config(options, message):
    """A config built from Python, not YAML, can hold numpy integers: they would reach the result keys as strings and
    break config.resolved.yaml at the end of the run, so they are refused before anything runs."""
    with pytest.raises(ConfigError, match=message):
        build(TaskSet, {"names": ["arc_easy"], **options})
