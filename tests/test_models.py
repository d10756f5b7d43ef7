"""Loading models: a GGUF file is converted once into a cached directory whose model equals the GGUF's; a model whose
weights (or baseline scores) are not finite is refused in one line, never scored."""

import shutil
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvquant.run
import kvquant.runner.pipeline
import kvquant.scoring.models
from kvquant.experiment.model_config import ModelConfig
from kvquant.errors import KVQuantError
from kvquant.scoring.models import check_model, load_model
from kvquant.paths import resolve
from refusals import PROGRESS, error_line, one_line
from tiny_configs import MODEL, tiny_run

GGUF_DIR = "local:models/stories260K"
GGUF = "stories260K.gguf"
DIGEST16 = "270cba1bd5109f42"  # first 16 hex digits of the file's sha256 (shared/data/README.md)
HF_TOKENIZER = "local:models/stories260K/hf"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path))
    return tmp_path / "models"


def test_gguf_is_converted_once_and_its_copy_equals_the_gguf(cache, capsys):
    spec = ModelConfig(path=GGUF_DIR, gguf_file=GGUF, tokenizer=HF_TOKENIZER)
    model, tokenizer = load_model(spec)
    assert "converting" in capsys.readouterr().err
    assert [p.name for p in cache.iterdir()] == [DIGEST16]  # atomically: no temp directory left
    again, _ = load_model(spec)
    assert "converting" not in capsys.readouterr().err
    reference = AutoModelForCausalLM.from_pretrained(resolve(GGUF_DIR), gguf_file=GGUF, pad_token_id=None).eval()
    ids = tokenizer("Once upon a time, there was a little girl", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = reference(ids).logits
        assert torch.equal(model(ids).logits, expected) and torch.equal(again(ids).logits, expected)
    assert check_model(spec).max_position_embeddings == reference.config.max_position_embeddings


def test_gguf_tokenizer_is_loaded_with_gguf_file_and_kept_with_the_copy(cache, monkeypatch):
    calls = []
    real = AutoTokenizer.from_pretrained.__func__

    def recording(cls, source, *args, **kwargs):
        calls.append((str(source), kwargs.get("gguf_file")))
        if kwargs.pop("gguf_file", None):  # stories260K's own GGUF tokenizer does not load; stand in for it
            source = resolve(HF_TOKENIZER)
        return real(cls, source, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(recording))
    _, tokenizer = load_model(ModelConfig(path=GGUF_DIR, gguf_file=GGUF))
    assert calls[0] == (resolve(GGUF_DIR), GGUF)
    assert tokenizer("Once upon a time").input_ids[0] == 1
    calls.clear()
    load_model(ModelConfig(path=GGUF_DIR, gguf_file=GGUF))
    assert calls == [(str(cache / DIGEST16), None)]  # the converted copy holds the tokenizer


def test_a_gguf_tokenizer_that_does_not_load_is_one_clear_error(cache):
    spec = ModelConfig(path=GGUF_DIR, gguf_file=GGUF)
    for call in (check_model, load_model):
        with pytest.raises(KVQuantError, match=r"tokenizer of .*stories260K.gguf .*set model.tokenizer"):
            call(spec)
    # nothing converted for a model that cannot be used (the private cache folder itself may exist, empty)
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize("spec, message", [
    (ModelConfig(path="/nonexistent/model"), "model.path: '/nonexistent/model' does not exist"),
    (ModelConfig(path=GGUF_DIR, gguf_file="nope.gguf"), "model.gguf_file: .*nope.gguf does not exist"),
    (ModelConfig(path=GGUF_DIR), "holds no config.json"),
    (ModelConfig(tokenizer="/nonexistent/tokenizer"), "model.tokenizer: '/nonexistent/tokenizer' does not exist"),
])
def test_check_model_names_what_is_missing(spec, message):
    with pytest.raises(KVQuantError, match=message):
        check_model(spec)


@pytest.mark.parametrize("error", [MemoryError, torch.cuda.OutOfMemoryError])
def test_running_out_of_memory_while_loading_is_not_called_bad_input(monkeypatch, error):
    """A model the machine cannot hold is no bad config: the error goes up as it is (exit 3, with a traceback),
    where a model transformers cannot read is one line (exit 2)."""
    def fail(*args, **kwargs):
        raise error("out of memory")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fail)
    with pytest.raises(error):
        load_model(ModelConfig(path="local:models/stories260K/hf"))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: (_ for _ in ()).throw(OSError("no")))
    with pytest.raises(KVQuantError, match="cannot load model"):
        load_model(ModelConfig(path="local:models/stories260K/hf"))


# --- a model whose weights hold NaN/Inf outside the K/V path: refused when it loads, never scored ---------


def broken_model(directory: Path, weight: str, value: float) -> Path:
    """A copy of the toy model with one element of ``weight`` set to ``value``."""
    shutil.copytree(resolve(MODEL), directory)
    weights = load_file(directory / "model.safetensors")
    weights[weight].view(-1)[7] = value
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


WEIGHTS = [("model.layers.2.mlp.down_proj.weight", float("nan")), ("model.layers.0.mlp.up_proj.weight", float("inf")),
           ("model.norm.weight", float("-inf")), ("model.embed_tokens.weight", float("nan"))]


@pytest.mark.parametrize("weight, value", WEIGHTS, ids=["mlp-nan", "mlp-inf", "norm-neg-inf", "embedding-nan"])
def test_load_model_refuses_non_finite_weights(tmp_path, weight, value):
    from kvquant.experiment.model_config import ModelConfig

    path = broken_model(tmp_path / "broken", weight, value)
    with pytest.raises(KVQuantError) as info:
        kvquant.scoring.models.load_model(ModelConfig(path=str(path), device="cpu"))
    message = one_line(info)
    assert str(path) in message and weight in message and "NaN or Inf" in message, message


CONFIG = tiny_run("broken", "int4", tasks_limit=5, bootstrap=1000)
#: what the run prints before a refusal that comes after the model loaded: progress bars, the config's warnings
STARTED = (*PROGRESS, "kvquant: warning: ")


def run_config(tmp_path: Path, model_path: str, *overrides: str) -> int:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "model": {"path": model_path, "device": "cpu"},
                                   "output_dir": str(tmp_path / "reports")}))
    return kvquant.run.main([str(cfg), *(a for o in overrides for a in ("--set", o))])


def test_run_refuses_a_model_with_nan_weights(tmp_path, capsys, monkeypatch):
    """Was: a NaN baseline and "FAIL: int4 ..." (exit 1)."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    path = broken_model(tmp_path / "broken", "model.layers.1.mlp.gate_proj.weight", float("nan"))
    line = error_line(run_config(tmp_path, str(path)), capsys.readouterr().err, str(path), besides=STARTED)
    assert "model.layers.1.mlp.gate_proj.weight" in line


@pytest.mark.parametrize("overrides, metric", [
    ((), "perplexity 'tinystories'"),
    (("eval.perplexity=[]", "gate.perplexity=[]"), "task 'tinystories_lastword'"),
], ids=["perplexity", "task"])
def test_run_refuses_a_non_finite_baseline(tmp_path, capsys, monkeypatch, overrides, metric):
    """Scores that are not finite through the identity cache (here: the final norm poisoned after the load check,
    so keys and values stay finite) mean the model is broken, not the quantizer. Was: "FAIL: int4 ..." (exit 1)."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    real = kvquant.scoring.models.load_model

    def poisoned(spec):
        model, tokenizer = real(spec)
        with torch.no_grad():
            model.model.norm.weight[0] = float("nan")
        return model, tokenizer

    monkeypatch.setattr(kvquant.runner.pipeline, "load_model", poisoned)
    line = error_line(run_config(tmp_path, MODEL, *overrides), capsys.readouterr().err, MODEL, besides=STARTED)
    assert "identity cache" in line and metric in line, line
