"""Config loading and validation."""

from pathlib import Path

import pytest

from kvquant.config import ConfigError, load_config

CONFIGS = sorted(Path(__file__).parents[1].glob("configs/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.candidates and cfg.name == path.stem


def test_shipped_configs_cover_the_quantizers():
    names = {p.stem for p in CONFIGS}
    assert {"fp8", "int8", "int4", "int2", "sweep"} <= names


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
    with pytest.raises(ConfigError, match="missing key candidates"):
        load_config(write(tmp_path, "eval: {perplexity: [{name: t}]}"))
    with pytest.raises(ConfigError, match="nothing to measure"):
        load_config(write(tmp_path, "candidates: [{quantizer: int4}]"))
    with pytest.raises(ConfigError, match="names must be unique"):
        load_config(write(tmp_path, MINIMAL.replace("[{quantizer: int4}]", "[{quantizer: int4}, {quantizer: int4}]")))
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")


def test_set_overrides(tmp_path):
    path = write(tmp_path, MINIMAL)
    cfg = load_config(path, ["eval.seed=7", "candidates.0.options.group_size=64", "gate.decide_on=lower_bound",
                             "eval.tasks.names=[a, b]"])
    assert cfg.eval.seed == 7 and cfg.candidates[0].options == {"group_size": 64}
    assert cfg.gate.decide_on == "lower_bound" and cfg.eval.tasks.names == ["a", "b"]
    with pytest.raises(ConfigError, match="expects key=value"):
        load_config(path, ["eval.seed"])
    with pytest.raises(ConfigError, match="has no item 3"):
        load_config(path, ["candidates.3.quantizer=int8"])
    with pytest.raises(ConfigError, match="unknown key eval.sed"):
        load_config(path, ["eval.sed=3"])
