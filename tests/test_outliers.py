"""The outlier-layer rule (kvquant/runner/outliers.py, issue 55), against statistics worked out by hand."""

import math

import numpy as np
import pytest

from kvquant.runner.outliers import FACTOR, layer_statistics, margin, median, outlier_table, outliers


def test_a_layer_is_an_outlier_above_factor_times_the_median():
    # median of 1, 1, 2, 3, 90: 2; above 8 x 2 = 16: the 90 only
    assert outliers([1.0, 90.0, 2.0, 3.0, 1.0]) == [1]
    # exactly 8 x the median is not above it
    assert outliers([2.0, 16.0, 2.0]) == [] and outliers([2.0, 16.01, 2.0]) == [1]
    # an even count: the median is the mean of the two middle values, (2 + 4) / 2 = 3, so above 24
    assert median([1.0, 2.0, 4.0, 100.0]) == 3.0 and outliers([1.0, 2.0, 4.0, 100.0]) == [3]
    assert outliers([1.0, 2.0, 4.0, 24.0]) == []
    # another factor
    assert outliers([1.0, 90.0, 2.0, 3.0, 1.0], factor=1.2) == [1, 3]
    assert outliers([0.0, 0.0, 0.0]) == [] and FACTOR == 8.0


def test_the_margin_is_the_range_of_factors_that_find_the_same_layers():
    values = [1.0, 1.0, 2.0, 5.0, 30.0, 60.0]  # median 3.5
    low, high = margin(values)
    assert outliers(values) == [4, 5]
    assert (low, high) == pytest.approx((30 / 3.5, 5 / 3.5))
    for factor in (high, (low + high) / 2, low - 1e-9):  # any factor in [high, low) finds the same layers
        assert outliers(values, factor) == [4, 5]
    assert outliers(values, low) == [5] and outliers(values, high - 1e-9) == [3, 4, 5]
    assert math.isnan(margin([1.0, 1.0])[0])  # no outlier: no lower end


def test_layer_statistics_norm_and_max_by_hand():
    # two layers of 2 KV heads x 3 channels
    a = np.array([[3.0, 4.0, 0.0], [0.0, 0.0, -12.0]])
    b = np.array([[1.0, -2.0, 2.0], [0.0, 0.0, 0.0]])
    norm = layer_statistics([a, b], "norm")
    assert norm[0].value == pytest.approx(13.0) and norm[0].heads == pytest.approx((5.0, 12.0))
    assert norm[0].channel == (1, 2) and norm[0].largest == -12.0
    assert norm[1].value == pytest.approx(3.0) and norm[1].heads == pytest.approx((3.0, 0.0))
    assert norm[1].channel == (0, 1) and norm[1].largest == -2.0  # the first of equal magnitudes
    peak = layer_statistics([a, b], "max")
    assert [s.value for s in peak] == [12.0, 2.0] and peak[0].heads == (4.0, 12.0)
    with pytest.raises(ValueError, match="norm or max"):
        layer_statistics([a], "mean")
    with pytest.raises(ValueError, match=r"\[kv_heads, head_dim\]"):
        layer_statistics([a.reshape(-1)], "norm")


def test_the_table_lists_the_outlier_layers_only():
    layers = [np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]]), np.array([[-40.0, 0.0]]), np.array([[1.0, 0.0]])]
    rows = outlier_table(layer_statistics(layers, "max"))  # median 1: layer 2 at 40x
    assert rows[2:] == ["| 2 | 40.0 | 40.0 | 40.0 | -40.0 at (0, 0) |"]


def test_the_calibration_statistic_is_the_keys_mean_per_channel(model, story_ids):
    """``key_means`` (kvquant/scoring/calibrate.py: experiments/outlier_layers.py's statistic, a key offset's value)
    over two windows against the keys a ``DynamicCache`` stored
    for each, averaged over every token by hand."""
    import torch
    from transformers import DynamicCache

    from kvquant.scoring.calibrate import key_means

    windows = [story_ids[0, :50].tolist(), story_ids[0, 50:130].tolist()]
    got = key_means(model, windows)
    stored = []
    for ids in windows:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.tensor([ids]), cache=cache, use_cache=True)
        stored.append([layer.keys[0].double() for layer in cache.layers])  # [H, T, D]
    layers = model.config.num_hidden_layers
    assert len(got) == layers
    for i in range(layers):
        keys = torch.cat([s[i] for s in stored], dim=1)  # [H, 130, D]
        assert got[i].dtype == torch.float64
        np.testing.assert_allclose(got[i].numpy(), keys.mean(1).numpy(), rtol=1e-12, atol=1e-12)


def test_the_weights_statistic_reads_the_key_bias_or_says_there_is_none(model):
    import torch
    import transformers

    from conftest import experiment

    script = experiment("outlier_layers")
    assert script.key_biases(model) is None  # stories260K is a Llama: no key-projection bias
    config = transformers.Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_hidden_layers=2, vocab_size=50)
    torch.manual_seed(0)
    qwen = transformers.Qwen2ForCausalLM(config).eval()
    for layer in qwen.model.layers:
        layer.self_attn.k_proj.bias.data.normal_()  # initialized to 0: a distinct value per channel instead
    got = script.key_biases(qwen)
    for i, layer in enumerate(qwen.model.layers):  # head_dim 32 / 4 = 8; 2 KV heads
        bias = layer.self_attn.k_proj.bias.detach().double().numpy()
        assert np.array_equal(got[i], bias.reshape(2, 8)) and got[i][1, 0] == bias[8] != 0


@pytest.mark.parametrize("extra", [[], ["--factor", "inf"]])
def test_outlier_layers_refuses_before_writing_or_loading(tmp_path, capsys, monkeypatch, extra):
    """Probe 56: a config without a calibration split was exit 3 (an AttributeError) after the model loaded and
    --out was made, and --factor inf was taken; one line, exit 2, no folder made, no model loaded."""
    from conftest import experiment
    from tiny_configs import TINY
    from kvquant.exits import run_script
    import kvquant.scoring.models

    def trap(*args, **kwargs):
        raise AssertionError("the model was loaded for arguments that should have been refused")

    monkeypatch.setattr(kvquant.scoring.models, "load_model", trap)
    script = experiment("outlier_layers")
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.format(out=tmp_path / "reports") if not extra else
                      TINY.format(out=tmp_path / "reports") + "calibration: {windows: 2}\n")
    def call():
        try:
            return script.main([str(config), "--out", str(tmp_path / "out"), *extra])
        except SystemExit as stop:  # an argument refused by the parser
            return stop.code

    code = run_script("outlier_layers", call)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("outlier_layers: error: "), err
    assert ("calibration" in err[0]) if not extra else ("finite number above 1, got inf" in err[0])
    assert not (tmp_path / "out").exists()
