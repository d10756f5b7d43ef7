"""One answer per engine format (issue 53, item 4): llama.cpp's q8_0 through every path kvquant measures it by
(the public ``make_cache``, the runner's gate with calibration in the run, the per-layer search, the long-context
script and a where-analysis variant set per layer, and the llama.cpp comparison's verdict) gives the KL divergence
from the model's own computation (float32, kvquant's fp16 cache) that a forward through ``make_cache`` gives on the
same tokens, computed here by hand. docs/quantizers.md (What an engine format's KL means) says why that number.

The model: two random Llama layers of head_dim 64 (llama.cpp's blocks of 32 and its rotation need it; stories260K's
heads are 8 wide) on stories260K's tokenizer, saved so that the runner and the scripts load it as a user's model."""

import contextlib
import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers
import yaml

import kvquant
from kvquant.paths import resolve
from kvquant.run import main
from kvquant.experiment.config import load_config
from kvquant.scoring import data
from kvquant.scoring.models import load_tokenizer
from tests.conftest import experiment

FORMAT = "llamacpp_q8_0"
TEXT = "local:text/tinystories/validation-first1000.jsonl"
PPL = {"name": "tinystories", "source": TEXT, "layout": "stream", "limit": 1, "max_length": 128}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A model folder (weights and tokenizer) and the model loaded from it."""
    folder = tmp_path_factory.mktemp("engine-model")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      initializer_range=0.1, max_position_embeddings=512)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(resolve("local:models/stories260K/hf")).save_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, model


def by_hand(model, ids: list[int], quantizer: str = FORMAT) -> float:
    """Mean over the positions of ``ids`` (each predicting the next token) of KL(fp16 cache || ``quantizer``),
    one forward each through the public ``make_cache``."""
    with torch.no_grad():
        logits = [model(torch.tensor([ids]), cache=kvquant.make_cache(model, name), use_cache=True).logits[0, :-1]
                  for name in ("fp16", quantizer)]
    p, q = (x.double().log_softmax(-1) for x in logits)
    return float((p.exp() * (p - q)).sum(-1).mean())


def windows(config_path, pset: int = 0, limit: int | None = None) -> list[list[int]]:
    cfg = load_config(config_path)
    spec = cfg.eval.perplexity[pset]
    spec = dataclasses.replace(spec, limit=limit) if limit else spec
    return [w.ids for w in data.windows(spec, load_tokenizer(cfg.model), 2048, data.load_rows(spec))]


def write(path, doc) -> str:
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_every_path_gives_the_make_cache_kl(saved, tmp_path):
    folder, model = saved
    model_section = {"path": str(folder), "dtype": "float32", "device": "cpu"}

    # the runner's gate, in a run that also calibrates another candidate's scales
    run_cfg = write(tmp_path / "run.yaml", {
        "name": "engine", "output_dir": str(tmp_path / "out"), "model": model_section,
        "candidates": [{"quantizer": FORMAT, "name": "q8"},
                       {"quantizer": "vllm_fp8", "name": "fp8-cal", "calibrate": "tensor"}],
        "calibration": {"windows": 1},
        "eval": {"perplexity": [PPL]}, "gate": {"bootstrap": 1000}})
    (ids,) = windows(run_cfg)
    want = by_hand(model, ids)
    assert 1e-5 < want < 1e-2  # a loss to compare, of q8_0's size on a real model
    assert main([run_cfg]) in (0, 1, 4)
    doc = json.loads((tmp_path / "out" / "engine" / "results.json").read_text())
    assert "fp8-cal" in doc["calibration"]
    gated = {c["name"]: c for c in doc["candidates"]}["q8"]["metrics"]["kl/tinystories"]
    assert gated["value"] == pytest.approx(want, rel=1e-6)

    # the search: a budget that only the all-q8_0 map meets, checked on the calibration window
    search_cfg = write(tmp_path / "search.yaml", {
        "name": "searched", "output_dir": str(tmp_path / "out"), "model": model_section,
        "eval": {"perplexity": [PPL]},
        "gate": {"bootstrap": 1000, "max_kl_divergence": 1.0, "tasks": []},
        "search": {"name": "mixed", "windows": 1, "documents": 0, "max_bits": 9,
                   "ladder": [{"quantizer": FORMAT, "name": "q8"}, {"quantizer": "fp16", "name": "full"}]}})
    (_, calibration) = windows(search_cfg, limit=2)
    assert main([search_cfg]) in (0, 1, 4)
    found = json.loads((tmp_path / "out" / "searched" / "results.json").read_text())["search"]
    all_q8 = next(c for c in found["checked"] if c["step"] == 0)
    assert all_q8["metrics"]["kl/tinystories"] == pytest.approx(by_hand(model, calibration), rel=1e-6)

    # long contexts (fed 32 tokens at a time) and a where-analysis variant (the format set per layer)
    long_cfg = write(tmp_path / "long.yaml", {
        "name": "long", "model": model_section,
        "candidates": [{"quantizer": FORMAT, "name": "q8"},
                       {"quantizer": "fp16", "name": "q8-per-layer", "options": {"layers": {"0-1": {
                           "quantizer": FORMAT}}}}],
        "eval": {"mode": "streaming", "chunk_size": 32, "perplexity": [PPL]}})
    experiment("long_divergence").main([long_cfg, "--out", str(tmp_path / "long")])
    kept = json.loads((tmp_path / "long" / "documents" / "doc-0.json").read_text())["result"]
    for label in ("q8", "q8-per-layer"):
        assert np.mean(kept[label]["kl"]) == pytest.approx(want, rel=1e-3), label


def test_the_llama_cpp_comparison_states_the_same_verdict_beside_the_engines_own(saved):
    """kvquant/integrations/llamacpp_engine.measure_engines: each side against its own f16 cache (the engine's number,
    what issue 37 compares), and beside it the verdict: make_cache's KL from the model's own computation, measured with
    float32 matmuls even while kvquant's engine side runs with llama.cpp's (here: every linear layer's input rounded to
    multiples of 1/16, a step function as llama.cpp's quantized activations are: a small change upstream moves inputs
    across a step)."""
    from kvquant.integrations import llamacpp_engine as engine_module
    from kvquant.integrations.llamacpp_engine import Setting

    _, model = saved
    ids = [1, *range(20, 147)]

    class FakeEngine:  # llama.cpp: the model's own logits, a little off for a quantized cache
        def logits(self, got, setting):
            with torch.no_grad():
                out = model(torch.tensor([got])).logits[0].float()
            return out if setting is None else out + 0.01 * torch.cos(out)

    @contextlib.contextmanager
    def rounded():
        handles = [m.register_forward_pre_hook(lambda mod, args: ((args[0] * 16).round() / 16,))
                   for m in model.modules() if isinstance(m, torch.nn.Linear)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    found = engine_module.measure_engines(FakeEngine(), model, [ids], [Setting("q8_0", True)], emulated=rounded)
    sides = found["q8_0 rot on"]
    verdict = float(np.mean(sides["verdict"]["kl"][0]))
    assert verdict == pytest.approx(by_hand(model, ids), rel=1e-6)
    engine_own = float(np.mean(sides["kvquant"]["kl"][0]))
    assert engine_own > 3 * verdict  # the rounded matmuls amplify the engine's own number, not the verdict
    # llama.cpp against the model's own computation, its f16 cache's beside it
    f16 = float(np.mean(found[engine_module.F16_LABEL]["llamacpp_model"]["kl"][0]))
    assert f16 == pytest.approx(0.0, abs=1e-9) and float(np.mean(sides["llamacpp_model"]["kl"][0])) > 0
