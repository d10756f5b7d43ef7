"""Codebook levels fitted on the calibration split (kvquant/formats/fitted.py, kvquant/scoring/level_fit.py):
the weighted k-means against Lloyd's iteration written here, the centroid condition on data written here, the
``fitted_levels`` codec against the nearest level, its bits all-in, and the Fisher weights against gradients taken
here through another route (a zero added to every state the cache receives)."""

import json

import pytest
import torch
from transformers import DynamicCache

import kvquant
from kvquant.formats import ops
from kvquant.formats.fitted import weighted_kmeans
from kvquant.run import main
from kvquant.scoring.level_fit import fitted_levels


def reference_kmeans(values: list[float], weights: list[float], count: int) -> list[float]:
    """Lloyd's iteration in plain Python: levels evenly spaced from the smallest to the largest value; each value to
    the level it is nearest (a tie to the upper), each level to its cell's weighted mean, until no value moves."""
    low, high = min(values), max(values)
    levels = [low + (high - low) * i / (count - 1) for i in range(count)]
    cells = None
    while True:
        midpoints = [(a + b) / 2 for a, b in zip(levels, levels[1:])]
        assigned = [sum(v >= m for m in midpoints) for v in values]
        if assigned == cells:
            return levels
        cells = assigned
        for j in range(count):
            mass = sum(w for w, c in zip(weights, cells) if c == j)
            if mass > 0:
                levels[j] = sum(w * v for w, v, c in zip(weights, values, cells) if c == j) / mass


def test_the_levels_are_the_weighted_means_of_their_cells():
    """Worked by hand: from [-1, 0, 1] (midpoints -0.5, 0.5) the cells are {-1, -0.8}, {-0.1, 0, 0.1}, {0.9, 1};
    their weighted means -3.4/4, 0.1/4 and 1.9/2 leave every value in its cell (midpoints -0.4125, 0.4875)."""
    values = torch.tensor([-1.0, -0.8, -0.1, 0.0, 0.1, 0.9, 1.0], dtype=torch.float64)
    weights = torch.tensor([1.0, 3.0, 1.0, 1.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    assert weighted_kmeans(values, weights, 3).tolist() == pytest.approx([-0.85, 0.025, 0.95], abs=1e-15)
    # alike weights: the plain means
    assert weighted_kmeans(values, torch.ones(7), 3).tolist() == pytest.approx([-0.9, 0.0, 0.95], abs=1e-15)


def test_the_weighted_kmeans_equals_lloyds_iteration_written_here():
    generator = torch.Generator().manual_seed(5)
    values = torch.cat([torch.randn(300, generator=generator) * 0.2 - 0.5, torch.rand(200, generator=generator)])
    weights = torch.rand(500, generator=generator) ** 4  # uneven: a few values weigh most
    for count in (2, 4, 8):
        got = weighted_kmeans(values, weights, count)
        want = reference_kmeans(values.double().tolist(), weights.double().tolist(), count)
        assert got.tolist() == pytest.approx(want, abs=1e-12), count
        assert bool((got[1:] > got[:-1]).all())
        # the centroid condition, each cell found again from the levels
        cells = torch.searchsorted((got[:-1] + got[1:]) / 2, values.double(), right=True)
        for j in range(count):
            inside = cells == j
            mean = (weights.double()[inside] * values.double()[inside]).sum() / weights.double()[inside].sum()
            assert float(got[j]) == pytest.approx(float(mean), abs=1e-12)
    # the weights move the levels: unweighted, they are elsewhere
    assert not torch.allclose(weighted_kmeans(values, torch.ones(500), 4), weighted_kmeans(values, weights, 4))


@pytest.mark.parametrize("values, weights, message", [
    ([0.0, 1.0], [1.0], "2 values and 1 weights"),
    ([0.0, 1.0], [0.0, 0.0], "every weight is 0"),
    ([0.0, float("nan")], [1.0, 1.0], "must be finite"),
    ([0.0, 1.0], [1.0, -1.0], "weights at least 0"),
])
def test_bad_kmeans_inputs_are_refused(values, weights, message):
    with pytest.raises(kvquant.KVQuantError, match=message):
        weighted_kmeans(torch.tensor(values), torch.tensor(weights), 2)


KEY_LEVELS = [-0.8, -0.1, 0.3, 1.0]
VALUE_LEVELS = [-1.0, -0.7, -0.4, -0.1, 0.05, 0.3, 0.6, 0.9]


def test_the_codec_reads_the_nearest_given_level_times_the_largest_value():
    quantizer = kvquant.get_quantizer("fitted_levels", key_bits=2, value_bits=3, key_levels=KEY_LEVELS,
                                      value_levels=VALUE_LEVELS)
    x = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    for codec, levels in zip(quantizer.codecs(8), (KEY_LEVELS, VALUE_LEVELS)):
        s = x.abs().amax(-1, keepdim=True).half().float()
        u = x / s
        want = torch.tensor(levels)[(u.unsqueeze(-1) - torch.tensor(levels)).abs().argmin(-1)] * s
        out = torch.empty_like(x)
        codec.decode_into(codec.encode(x), out)
        assert torch.equal(out, want)
    # not given: the normal-float levels (normal_float's codec without its rotation)
    plain = kvquant.get_quantizer("fitted_levels").codecs(8)[0]
    assert torch.equal(plain.levels, kvquant.formats.lowbit.normal_float(4).float())


@pytest.mark.parametrize("options, message", [
    ({"key_levels": [-1.0, 0.0, 1.0]}, "key_levels must be 16 increasing numbers in [-1, 1]"),
    ({"key_bits": 2, "key_levels": [-1.0, 0.5, 0.2, 1.0]}, "key_levels must be 4 increasing numbers"),
    ({"value_bits": 2, "value_levels": [-1.0, 0.0, 0.5, 1.5]}, "value_levels must be 4 increasing numbers"),
    ({"value_bits": 2, "value_levels": "-1 0 0.5 1"}, "value_levels must be 4 increasing numbers"),
])
def test_bad_levels_are_one_line(options, message):
    with pytest.raises(kvquant.KVQuantError, match=message.replace("[", r"\[").replace("]", r"\]")):
        kvquant.get_quantizer("fitted_levels", **options)


def test_the_levels_count_under_host_bytes_and_the_bits_are_the_codes_and_scale(model, story_ids):
    """Per layer ``2**key_bits + 2**value_bits`` float32 levels on the host, beside what any cache keeps there;
    per element ``bits + 16 / D`` (one fp16 scale per token and head)."""
    layers = model.config.num_hidden_layers
    levels = {str(i): {"key_levels": KEY_LEVELS, "value_levels": VALUE_LEVELS} for i in range(layers)}
    fitted = kvquant.make_cache(model, "fitted_levels", key_bits=2, value_bits=3, layers=levels, residual_length=0)
    bare = kvquant.make_cache(model, "fp16")
    with torch.no_grad():
        for cache in (fitted, bare):
            model(story_ids[:, :64], cache=cache, use_cache=True)
    report, base = fitted.memory_report(), bare.memory_report()
    assert report["host_bytes"] - base["host_bytes"] == layers * (4 + 8) * 4
    head_dim = model.config.head_dim
    assert report["bits_per_element"] == pytest.approx((2 + 3) / 2 + 16 / head_dim)


class Perturbed(DynamicCache):
    """Adds a zero that requires grad to every state it receives: the loss's gradient w.r.t. that zero is its
    gradient w.r.t. the state, taken without the code under test."""

    def __init__(self, model):
        super().__init__(config=model.config)
        self.zeros = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        zeros = [torch.zeros_like(key_states, requires_grad=True), torch.zeros_like(value_states, requires_grad=True)]
        self.zeros.append((layer_idx, key_states.detach(), value_states.detach(), *zeros))
        return super().update(key_states + zeros[0], value_states + zeros[1], layer_idx, *args, **kwargs)


def reference_levels(model, windows, rotation, fisher: bool) -> dict[int, dict[str, list[float]]]:
    """Per layer and stream: Lloyd's iteration (above) on ``x / fp16(max|x|)`` per token and head, weighted by
    ``(g s)^2`` (g: the mean next-token loss's gradient, through :class:`Perturbed`) or alike."""
    samples = {}
    for ids in windows:
        cache, tokens = Perturbed(model), torch.tensor([ids])
        logits = model(tokens, cache=cache, use_cache=True).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), tokens[0, 1:])
        grads = torch.autograd.grad(loss, [z for entry in cache.zeros for z in entry[3:]])
        for i, (layer, keys, values, *_) in enumerate(cache.zeros):
            for role, x, g in (("key", keys, grads[2 * i]), ("value", values, grads[2 * i + 1])):
                if rotation is not None:
                    x, g = x.double() @ rotation, g.double() @ rotation
                s = x.abs().amax(-1, keepdim=True).half().float()
                weight = (g * s) ** 2 if fisher else torch.ones_like(x)
                parts = samples.setdefault((layer, role), ([], []))
                parts[0].extend((x / s).reshape(-1).tolist())
                parts[1].extend(weight.reshape(-1).tolist())
    return {layer: {f"{role}_levels": reference_kmeans(*samples[layer, role], 4 if role == "key" else 8)
                    for role in ("key", "value")} for layer in sorted({layer for layer, _ in samples})}


@pytest.mark.parametrize("rotation", [None, "hadamard"])
def test_fisher_levels_weigh_each_state_by_its_squared_gradient(model, story_ids, rotation):
    windows = [story_ids[0, :40].tolist(), story_ids[0, 40:72].tolist()]
    quantizer = kvquant.get_quantizer("fitted_levels", key_bits=2, value_bits=3, rotation=rotation)
    matrix = None if rotation is None else ops.hadamard_rotation(model.config.head_dim, 0)
    got = fitted_levels(model, windows, quantizer, fisher=True)
    unweighted = fitted_levels(model, windows, quantizer, fisher=False)
    for fitted, fisher in ((got, True), (unweighted, False)):
        want = reference_levels(model, windows, matrix, fisher=fisher)
        assert sorted(fitted) == sorted(want) == list(range(model.config.num_hidden_layers))
        for layer in want:
            for role in ("key_levels", "value_levels"):
                assert fitted[layer][role] == pytest.approx(want[layer][role], abs=1e-6), (fisher, layer, role)
    assert any(unweighted[layer]["key_levels"] != pytest.approx(got[layer]["key_levels"], abs=1e-3) for layer in got)
    assert all(p.grad is None for p in model.parameters())  # the weights' gradients are not taken


RUN = """
name: levels
output_dir: {out}
candidates:
  - {{quantizer: fitted_levels, name: fisher, calibrate: fisher_kmeans, options: {{key_bits: 2, value_bits: 2}}}}
  - {{quantizer: fitted_levels, name: normal, options: {{key_bits: 2, value_bits: 2}}}}
calibration: {{windows: 2}}
eval:
  perplexity:
    - {{name: stories, source: local:text/tinystories/validation-first1000.jsonl, limit: 3, max_length: 48}}
  memory_probe_tokens: 48
gate: {{bootstrap: 1000}}
"""


def test_the_runner_measures_with_levels_fitted_on_the_calibration_windows(tmp_path, model, tokenizer, stories):
    """Stories 3 and 4 (after the 3 evaluated) are the calibration split: the levels the run stored and measured
    with are those fitted on them (the fitting itself: the tests above), and the normal-float levels measure
    otherwise."""
    path = tmp_path / "levels.yaml"
    path.write_text(RUN.format(out=tmp_path / "reports"))
    assert main([str(path)]) in (0, 1, 4)
    doc = json.loads((tmp_path / "reports" / "levels" / "results.json").read_text())
    windows = [tokenizer(text).input_ids[:48] for text in stories[3:5]]
    quantizer = kvquant.get_quantizer("fitted_levels", key_bits=2, value_bits=2)
    want = fitted_levels(model, windows, quantizer, fisher=True)
    entry = doc["calibration"]["fisher"]
    assert entry["granularity"] == "fisher_kmeans" and entry["tokens"] == sum(map(len, windows))
    for layer, levels in want.items():
        for role in ("key_levels", "value_levels"):
            assert entry["layers"][str(layer)][role] == pytest.approx(levels[role], abs=1e-9), (layer, role)
    candidates = {c["name"]: c for c in doc["candidates"]}
    measured = candidates["fisher"]["settings"]["layers"]  # "0-0": layer 0's settings
    assert {int(k.split("-")[0]): v["key_levels"] for k, v in measured.items()} == \
        {int(k): v["key_levels"] for k, v in entry["layers"].items()}
    kl = {name: c["metrics"]["kl/stories"]["value"] for name, c in candidates.items()}
    assert kl["fisher"] != kl["normal"], kl
    report = (tmp_path / "reports" / "levels" / "report.md").read_text()
    first = " ".join(f"{v:+.3f}" for v in entry["layers"]["0"]["key_levels"])
    assert "## Calibrated levels" in report and f"| fisher | fisher_kmeans | 2 | {entry['tokens']:,} | {first} |" \
        in report


def test_levels_fitted_where_the_fp16_scale_rounds_down_stay_within_one():
    """SmolLM2's layer 16 keys (configs/smollm2-lowbit-calibrated.yaml) fitted a top level of 1.0000659, which the
    quantizer refused: ``max|x|`` rounded down to fp16 leaves ``x / s`` above 1."""
    from kvquant.scoring.level_fit import clamped_kmeans_levels

    codec = kvquant.get_quantizer("fitted_levels", key_bits=2).codecs(4)[0]
    u, _ = codec.normalized(torch.tensor([[[[1.0004, 0.2, -0.3, -1.0004]]]]))
    assert float(u.max()) > 1 and float(u.min()) < -1  # fp16(1.0004) is 1.0
    fitted = clamped_kmeans_levels(u.reshape(-1), torch.ones(4), 4)
    assert fitted == pytest.approx([-1.0, -0.3, 0.2, 1.0], abs=1e-6)
    kvquant.get_quantizer("fitted_levels", key_bits=2, key_levels=fitted)  # accepted
