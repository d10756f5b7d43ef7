"""``calibrate: key_bias`` (kvquant/scoring/calibrate.py, issue 56): each layer's ``k_proj`` bias as its
``key_offset``, read from the weights, for keys stored before RoPE, on a tiny random Qwen2 (2 layers, 2 KV heads of
head_dim 16) whose ``k_proj`` bias is 50 or 60 on a few channels (Qwen2.5's kind of outlier).

- Through ``kvquant.run`` without a ``calibration:`` split, on a text with no window beyond the evaluated ones: the
  layers map equals the model's biases exactly, the report shows them, no calibration window is read, and a model
  whose bias changed (same output folder) gets its new bias (the stored observation is keyed by the weights).
- The cache those offsets give (Lloyd-Max 4-bit, pre-RoPE) returns the keys of a reference written here (the
  ``k_proj`` output minus the bias, through the codec's own encode and decode, plus the bias, rotated by
  transformers' RoPE) and logits far closer to the model's than without the offset.
- Refused in one line before the model loads: without ``pre_rope``, on a model without the bias; another
  calibration still needs its split.
"""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
import transformers
import yaml
from transformers import DynamicCache
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

import kvquant
import kvquant.scoring.calibrate
from kvquant.experiment.config import load_config
from kvquant.paths import resolve
from kvquant.run import ABOVE_RUNNER, main
from kvquant.runner.expected import Expected
from kvquant.runner.preflight import context_length, preflight
from kvquant.scoring.calibrate import with_calibration
from kvquant.scoring.models import check_model

TOKENIZER = "local:models/stories260K/hf"
STORIES = "local:text/tinystories/validation-first1000.jsonl"
EVALUATED = 3  # the text holds these rows only: no window is left beyond the evaluated ones
OUTLIERS = [5, 12, 21]  # k_proj channels of bias 50 (layer 0), 60 (layer 1): KV head 0's 5 and 12, KV head 1's 5
LLOYD = {"key_bits": 4, "value_bits": 4, "residual_length": 0}


def biased_qwen(seed: int) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512, initializer_range=0.1)
    model = transformers.Qwen2ForCausalLM(config).eval()
    for i, layer in enumerate(model.model.layers):
        bias = layer.self_attn.k_proj.bias
        bias.data = torch.randn(bias.shape) * 0.5
        bias.data[OUTLIERS] = 50.0 + 10 * i
    return model


def save(model, folder) -> None:
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(resolve(TOKENIZER)).save_pretrained(folder)


def biases(model) -> dict[int, torch.Tensor]:
    """Per layer ``[kv_heads, head_dim]``: the ``k_proj`` bias, as the test reads it."""
    return {i: layer.self_attn.k_proj.bias.detach().reshape(2, 16) for i, layer in enumerate(model.model.layers)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen")
    save(biased_qwen(0), path)
    return path


@pytest.fixture(scope="module")
def tiny(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def write_config(tmp_path, model_path, candidate: dict, **sections) -> str:
    with open(resolve(STORIES), encoding="utf-8") as f:
        rows = [json.loads(line)["text"] for line, _ in zip(f, range(EVALUATED))]
    text = tmp_path / "stories.jsonl"
    text.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    path = tmp_path / "bias.yaml"
    path.write_text(yaml.safe_dump({
        "name": "bias", "output_dir": str(tmp_path / "reports"),
        "model": {"path": str(model_path), "dtype": "float32", "device": "cpu"},
        "candidates": [candidate, {"quantizer": "lloyd_max", "name": "plain", "options": {**LLOYD, "pre_rope": True}}],
        "eval": {"perplexity": [{"name": "stories", "source": str(text), "limit": EVALUATED, "max_length": 64}],
                 "memory_probe_tokens": 64},
        "gate": {"bootstrap": 1000}, **sections}))
    return str(path)


BIAS = {"quantizer": "lloyd_max", "name": "bias", "calibrate": "key_bias", "options": {**LLOYD, "pre_rope": True}}


def offsets(doc: dict) -> dict[int, torch.Tensor]:
    return {int(layer): torch.tensor(own["key_offset"])
            for layer, own in doc["calibration"]["bias"]["layers"].items()}


def window_trap(*args, **kwargs):
    raise AssertionError("calibration windows were read")


@pytest.fixture
def no_window_read(monkeypatch):
    monkeypatch.setattr(kvquant.scoring.calibrate, "calibration_windows", window_trap)


def run(tmp_path, model_path) -> dict:
    """results.json of the run of a key_bias candidate and the same cache without it (no calibration split), its
    report in ``tmp_path / "reports"``, no calibration window read."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
        patch.setattr(kvquant.scoring.calibrate, "calibration_windows", window_trap)
        assert main([write_config(tmp_path, model_path, BIAS)]) in (0, 1, 4)
    return json.loads((tmp_path / "reports" / "bias" / "results.json").read_text())


@pytest.fixture(scope="module")
def ran(folder, tmp_path_factory):
    """The run on the biased model: results.json, the report and the folder it ran in."""
    tmp_path = tmp_path_factory.mktemp("run")
    doc = run(tmp_path, folder)
    return doc, (tmp_path / "reports" / "bias" / "report.md").read_text(), tmp_path


def test_the_run_takes_each_layers_k_proj_bias_exactly(ran, tiny):
    doc, report, _ = ran
    want = biases(tiny)
    got = offsets(doc)
    assert sorted(got) == [0, 1]
    assert all(torch.equal(got[layer], want[layer]) for layer in want)
    assert [float(bias.abs().max()) for bias in want.values()] == [50.0, 60.0]  # the outliers are in it
    entry = doc["calibration"]["bias"]
    assert (entry["granularity"], entry["windows"], entry["tokens"]) == ("key_bias", 0, 0)
    # the gate measured these offsets, pre-RoPE, and the same cache without them measures otherwise
    candidates = {c["name"]: c for c in doc["candidates"]}
    measured = {int(k): torch.tensor(v["key_offset"]) for k, v in candidates["bias"]["settings"]["layers"].items()}
    assert measured.keys() == got.keys() and all(torch.equal(measured[layer], got[layer]) for layer in got)
    kl = {name: c["metrics"]["kl/stories"]["value"] for name, c in candidates.items()}
    assert kl["bias"] < kl["plain"], kl
    largest = {layer: float(bias.abs().max()) for layer, bias in want.items()}
    top = max(largest, key=largest.get)
    assert "## Key offsets from the k_proj bias" in report and "## Calibrated key offsets" not in report
    assert f"| bias | {min(largest.values()):.4g}..{largest[top]:.4g} | {top} |" in report


def test_another_models_weights_give_its_own_bias(ran):
    """Into the first run's output folder, whose stored observation would be reused if its key did not hold the
    weights: the new model's bias."""
    first, _, tmp_path = ran
    moved = biased_qwen(1)
    save(moved, tmp_path / "moved")
    again = offsets(run(tmp_path, tmp_path / "moved"))
    assert all(torch.equal(again[layer], bias) and not torch.equal(bias, offsets(first)[layer])
               for layer, bias in biases(moved).items())


def test_the_observation_is_keyed_by_the_model_and_its_weights_as_adopt_rebuilds_it(folder, tiny, tmp_path):
    """What the run asks its store for (no tokenizer, no text: nothing to cut windows from) is the key
    ``kvquant.adopt`` rebuilds without the model (:class:`kvquant.runner.expected.Expected`): no windows in it."""
    cfg = load_config(write_config(tmp_path, folder, BIAS))
    asked = []

    class Store:
        def get_or_compute(self, candidate, metric, key, compute):
            asked.append((candidate, metric, key))
            return compute()

    session = SimpleNamespace(cfg=cfg, model=tiny, tokenizer=None, maxlen=64, weights="digest", store=Store(),
                              processes=SimpleNamespace(is_main_process=True, broadcast=lambda x: x))
    measured, summary = with_calibration(session, cfg.candidates[0], rows={})
    assert [(label, metric) for label, metric, _ in asked] == [("bias", "calibration")]
    key = asked[0][2]
    assert key == {"model": dataclasses.asdict(cfg.model), "weights": "digest", "calibrate": "key_bias"}
    model_config = check_model(cfg.model)
    assert Expected(cfg, model_config, context_length(cfg, model_config)).difference("bias", "calibration", key) is None
    assert measured.options["layers"] == summary["layers"] and measured.calibrate is None


def logits_and_keys(model, cache, ids, steps=(24, 1, 1, 10)) -> tuple[torch.Tensor, dict, dict]:
    """Logits of every position fed in chunks of ``steps``; per layer the keys the cache returned on the last
    update ``[1, H, T, D]`` and the ``k_proj`` output of every token ``[1, H, T, D]`` (the keys before RoPE)."""
    returned, before = {}, {}
    hooks = [layer.self_attn.k_proj.register_forward_hook(
        lambda module, args, out, i=i: before.setdefault(i, []).append(out.detach().unflatten(-1, (2, 16))))
        for i, layer in enumerate(model.model.layers)]
    update = cache.update

    def recording(key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = update(key_states, value_states, layer_idx, *args, **kwargs)
        returned[layer_idx] = keys.clone()
        return keys, values

    cache.update = recording
    out, fed = [], 0
    try:
        with torch.no_grad():
            for n in steps:
                out.append(model(ids[:, fed:fed + n], cache=cache, use_cache=True).logits[0])
                fed += n
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(out), returned, {i: torch.cat(parts, 1).transpose(1, 2) for i, parts in before.items()}


def kl(got: torch.Tensor, want: torch.Tensor) -> float:
    """Mean over positions of KL(model || cache), nats."""
    return float(torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                            reduction="batchmean"))


def test_the_offsets_give_the_reference_keys_and_logits_closer_to_the_model(ran, tiny, monkeypatch):
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)  # unwritten memory: NaN
    ids = torch.randint(0, 512, (1, 36), generator=torch.Generator().manual_seed(2))
    layers = ran[0]["calibration"]["bias"]["layers"]  # the run's offsets, as results.json holds them
    want, _, _ = logits_and_keys(tiny, DynamicCache(config=tiny.config), ids)
    got, returned, before = logits_and_keys(tiny, kvquant.make_cache(tiny, "lloyd_max", pre_rope=True, layers=layers,
                                                                     **LLOYD), ids)
    plain, _, _ = logits_and_keys(tiny, kvquant.make_cache(tiny, "lloyd_max", pre_rope=True, **LLOYD), ids)
    codec = kvquant.get_quantizer("lloyd_max", key_bits=4, value_bits=4).codecs(16)[0]  # rotated, no offset
    cos, sin = tiny.model.rotary_emb(before[0], torch.arange(ids.shape[1])[None])
    for layer, keys in before.items():
        bias = biases(tiny)[layer][None, :, None]
        read = torch.empty_like(keys)
        codec.decode_into(codec.encode(keys - bias), read)
        reference = apply_rotary_pos_emb(keys, read + bias, cos, sin)[1]
        # the cache takes RoPE off the keys the model hands it and puts it back on read, in float32 (not bit for bit
        # the k_proj output): the same codes, the keys within float32 rounding; float32's spacing below |k| = 64 is
        # 3.8e-6 (1.9e-6 measured, at |k| up to 61); a code one level off would move a key by 0.03 or more here
        # (the smallest level spacing, 0.26, times the smallest scale, 0.49, spread by the rotation over 16 channels)
        assert float((returned[layer] - reference).abs().max()) < 1e-5, layer
        assert float((returned[layer] - apply_rotary_pos_emb(keys, keys, cos, sin)[1]).abs().max()) > 0.01
    # measured: KL 0.0062 nats with the offsets against 0.22 without (35x); a margin of 8x asserted
    assert kl(got, want) * 8 < kl(plain, want), (kl(got, want), kl(plain, want))


@pytest.mark.parametrize("change, message", [
    ({"options": LLOYD},
     "candidates[0] (bias): calibrate: key_bias removes each layer's k_proj bias, a constant on the keys only before "
     "RoPE (after it, RoPE turns the bias by each token's position); set options.pre_rope: true"),
    ({"model": {"path": TOKENIZER}},
     "bias: calibrate: key_bias reads each layer's k_proj bias, and this 'llama' model has none in layer 0 (5 of 5 "
     "layers without one); use calibrate: key_offset (the keys' mean after RoPE) instead"),
    ({"calibrate": "key_offset", "options": LLOYD},
     "candidates[0] (bias): calibrate needs a calibration split held apart from evaluation"),
])
def test_refusals_are_one_line_before_the_model_loads(folder, tmp_path, capsys, no_model_load, change, message):
    candidate = {**BIAS, **{k: v for k, v in change.items() if k != "model"}}
    path = write_config(tmp_path, folder, candidate)
    if "model" in change:
        text = yaml.safe_load(open(path))
        text["model"] = change["model"]
        open(path, "w").write(yaml.safe_dump(text))
    assert main([path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "reports").exists()


def test_no_calibration_window_is_needed_or_read(folder, tmp_path, no_model_load, no_window_read):
    """Preflight clears key_bias on a text that holds no window beyond the evaluated ones, with or without a
    ``calibration:`` section (which then asks for windows nothing reads); key_offset on it is refused."""
    for sections in ({}, {"calibration": {"windows": 4}}):
        plan, _, _ = preflight(load_config(write_config(tmp_path, folder, BIAS, **sections)), ABOVE_RUNNER)
        assert plan.calibrate == ("bias",)
    offset = {**BIAS, "calibrate": "key_offset", "options": LLOYD}
    with pytest.raises(AssertionError, match="calibration windows were read"):  # the trap: key_offset reads them
        preflight(load_config(write_config(tmp_path, folder, offset, calibration={"windows": 4})), ABOVE_RUNNER)
