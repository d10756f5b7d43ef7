import importlib.util
import json
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvquant.paths import resolve
from kvquant.experiment.config import load_config

# Poison unwritten memory for the whole session: torch.empty (and new_empty) return NaN for floats and 255 for
# uint8, so a cache that hands attention memory nobody wrote fails loudly instead of by chance.
torch.utils.deterministic.fill_uninitialized_memory = True
torch.use_deterministic_algorithms(True, warn_only=True)

SLOW = [line for line in (Path(__file__).parent / "slow.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")]


def pytest_collection_modifyitems(items):
    """Mark ``slow`` the tests tests/slow.txt names (``make test`` leaves them out, ``make test-slow`` runs them)."""
    for item in items:
        if any(fnmatchcase(item.nodeid, pattern) for pattern in SLOW):
            item.add_marker(pytest.mark.slow)


def experiment(name: str):
    """``experiments/<name>.py`` loaded as a module (the scripts are not a package), for tests of its functions."""
    path = Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where its dataclasses look up their module's names
    sys.path.insert(0, str(path.parent))  # a script imports its siblings by name, as when run (its folder first)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


MODEL = "local:models/stories260K/hf"
STORIES = "local:text/tinystories/validation-first1000.jsonl"


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    """``tiny_config(name, **sections)``: an experiment config on stories260K with these sections, written to a
    fresh folder and loaded."""
    def make(name: str, **sections):
        path = tmp_path_factory.mktemp("cfg") / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"name": name, "model": {"path": MODEL}, **sections}))
        return load_config(path)
    return make


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve(MODEL))


@pytest.fixture(scope="session")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(resolve(MODEL), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def stories():
    with open(resolve(STORIES), encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="session")
def story_ids(tokenizer, stories):
    """One real story of a few hundred tokens, ``[1, T]`` with BOS."""
    ids = next(tokenizer(s).input_ids for s in stories if 300 <= len(tokenizer(s).input_ids) <= 512)
    return torch.tensor([ids])


@pytest.fixture(scope="session")
def real_kv(model, story_ids):
    """The keys and values of every layer of stories260K after the first 320 tokens of :func:`story_ids`:
    ``[(keys, values)]``, each ``[1, 4, 320, 8]``."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(story_ids[:, :320], cache=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.fixture
def no_model_load(monkeypatch, tmp_path):
    """Inputs that must be refused before a model loads: loading one fails the test. kvquant's private cache (the
    signing key, GGUF conversions) goes to a throwaway folder."""
    import kvquant.scoring.lm_eval_model
    import kvquant.run

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))

    def trap(*args, **kwargs):
        raise AssertionError("a model was loaded for an input that should have been refused before")

    monkeypatch.setattr(kvquant.run, "load_model", trap)
    monkeypatch.setattr(kvquant.scoring.lm_eval_model, "load_model", trap)
