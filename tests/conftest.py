import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvquant.paths import resolve
from kvquant.experiment.config import load_config
from refusals import make_refusal_env

# Poison unwritten memory for the whole session: torch.empty (and new_empty) return NaN for floats and 255 for
# uint8, so a cache that hands attention memory nobody wrote fails loudly instead of by chance.
torch.utils.deterministic.fill_uninitialized_memory = True
torch.use_deterministic_algorithms(True, warn_only=True)

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
    import kvquant.runner.pipeline

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))

    def trap(*args, **kwargs):
        raise AssertionError("a model was loaded for an input that should have been refused before")

    monkeypatch.setattr(kvquant.runner.pipeline, "load_model", trap)
    monkeypatch.setattr(kvquant.scoring.lm_eval_model, "load_model", trap)


@pytest.fixture
def lm_eval_trapped(monkeypatch, tmp_path):
    """No model may load and lm-eval's own CLI may not start; GGUF conversions would go to a throwaway cache."""
    import kvquant.runner.pipeline
    import kvquant.scoring.lm_eval_model
    import kvquant.scoring.models

    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])

    def trap(*args, **kwargs):
        raise AssertionError("reached a model load (or lm-eval's CLI) for an input that should have been refused")

    for module in (kvquant.scoring.models, kvquant.scoring.lm_eval_model, kvquant.runner.pipeline):
        monkeypatch.setattr(module, "load_model", trap)
    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", trap)


@pytest.fixture(scope="module")
def refusal_env(tmp_path_factory):
    """A finished report, the config that targets it and files of bad input (tests/refusals.py's
    ``make_refusal_env``), once per test file."""
    return make_refusal_env(tmp_path_factory.mktemp("refusals"))


#: a run of int8 on two tinystories windows (no tasks), as :func:`run_yaml` writes it
RUN_YAML = {
    "name": "tiny-int8",
    "model": {"path": MODEL},
    "candidates": [{"quantizer": "int8", "name": "int8", "options": {"group_size": 32, "residual_length": 0}}],
    "eval": {"perplexity": [{"name": "tinystories", "source": STORIES, "limit": 2, "max_length": 64}],
             "memory_probe_tokens": 64},
}


@pytest.fixture
def run_yaml(tmp_path, monkeypatch) -> Path:
    """:data:`RUN_YAML` written to a file (reports under ``tmp_path/reports``), and a private cache for the signing
    key."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump({**RUN_YAML, "output_dir": str(tmp_path / "reports")}))
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """PyTorch on one thread for a test file, as the planner runs its writes: tests that run the cache code on small
    CPU tensors, whose ops split over threads wait for each other on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
