"""A key offset calibrated on the split held apart from evaluation (``calibrate: key_offset``,
kvquant/scoring/calibrate.py): the runner's offsets against the keys' mean recomputed here from the states a plain
DynamicCache stores, read from the calibration windows only, and measured (numbers that differ from the same
quantizer without it)."""

import json

import pytest
import torch
from transformers import DynamicCache

from kvquant.experiment.config import CALIBRATE
from kvquant.paths import resolve
from kvquant.run import main
from kvquant.scoring.calibrate import CALIBRATIONS

EVALUATED, CALIBRATED = 3, 2  # rows 0-2 are evaluated, rows 3-4 the calibration windows (documents layout)
CONFIG = """
name: offset
output_dir: {out}
candidates:
  - {{quantizer: lloyd_max, name: calibrated, calibrate: key_offset, options: {{key_bits: 2}}}}
  - {{quantizer: lloyd_max, name: plain, options: {{key_bits: 2}}}}
calibration: {{windows: {calibrated}}}
eval:
  perplexity:
    - {{name: stories, source: {text}, limit: {evaluated}, max_length: 64}}
  memory_probe_tokens: 64
gate: {{bootstrap: 1000}}
"""


def stories(count: int) -> list[str]:
    with open(resolve("local:text/tinystories/validation-first1000.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["text"] for line, _ in zip(f, range(count))]


def write_config(tmp_path, rows: list[str], out) -> str:
    text = tmp_path / "stories.jsonl"
    text.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    path = tmp_path / "offset.yaml"
    path.write_text(CONFIG.format(out=out, text=text, evaluated=EVALUATED, calibrated=CALIBRATED))
    return str(path)


def reference_offsets(model, tokenizer, rows: list[str]) -> dict[int, torch.Tensor]:
    """Per layer ``[kv_heads, head_dim]``: the mean of the keys a DynamicCache holds after each calibration row's
    forward (cut at max_length as evaluation cuts it), over every token of those rows, in float64."""
    keys: dict[int, list[torch.Tensor]] = {}
    for row in rows[EVALUATED:EVALUATED + CALIBRATED]:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.tensor([tokenizer(row).input_ids[:64]]), cache=cache, use_cache=True)
        for layer, entry in enumerate(cache.layers):
            keys.setdefault(layer, []).append(entry.keys[0].double())  # [H, T, D]
    return {layer: torch.cat(parts, dim=1).mean(1) for layer, parts in keys.items()}


def run(path: str, out) -> dict:
    assert main([path]) in (0, 1, 4)
    return json.loads((out / "offset" / "results.json").read_text())


def offsets(doc: dict) -> dict[int, torch.Tensor]:
    return {int(layer): torch.tensor(own["key_offset"], dtype=torch.float64)
            for layer, own in doc["calibration"]["calibrated"]["layers"].items()}


def test_the_runner_measures_with_the_keys_mean_on_the_calibration_windows(tmp_path, model, tokenizer):
    rows = stories(EVALUATED + CALIBRATED)
    out = tmp_path / "reports"
    doc = run(write_config(tmp_path, rows, out), out)
    want = reference_offsets(model, tokenizer, rows)
    got = offsets(doc)
    assert sorted(got) == list(range(model.config.num_hidden_layers))
    for layer, mean in got.items():
        assert mean.shape == (model.config.num_key_value_heads, model.config.head_dim)
        assert torch.allclose(mean, want[layer], rtol=1e-12, atol=1e-12), layer
    largest = {layer: float(mean.abs().max()) for layer, mean in want.items()}
    assert max(largest.values()) > 10  # stories260K's keys have a mean (its largest channel's beyond 10)
    entry = doc["calibration"]["calibrated"]
    assert entry["granularity"] == "key_offset" and entry["windows"] == CALIBRATED
    assert entry["tokens"] == sum(min(64, len(tokenizer(row).input_ids)) for row in rows[EVALUATED:])
    # the gate measured these offsets, layer by layer, and the quantizer without them measures otherwise
    candidates = {c["name"]: c for c in doc["candidates"]}
    measured = candidates["calibrated"]["settings"]["layers"]  # "0-0": layer 0's settings
    assert {int(k.split("-")[0]): v["key_offset"] for k, v in measured.items()} == \
        {int(k): v["key_offset"] for k, v in entry["layers"].items()}
    assert "layers" not in candidates["plain"]["settings"]
    values = {name: {m: c["metrics"][m]["value"] for m in c["metrics"]} for name, c in candidates.items()}
    assert values["calibrated"].keys() == values["plain"].keys() and values["calibrated"]
    assert all(values["calibrated"][m] != values["plain"][m] for m in values["plain"]), values
    # 2-bit keys whose vectors no longer carry the offset in their RMS lose less (KL 1.85 against 2.84 nats)
    assert values["calibrated"]["kl/stories"] < values["plain"]["kl/stories"], values
    report = (out / "offset" / "report.md").read_text()
    assert "## Calibrated key offsets" in report and "## Calibrated scales" not in report
    top = max(largest, key=largest.get)
    assert (f"| calibrated | {CALIBRATED} | {entry['tokens']:,} | {min(largest.values()):.4g}..{largest[top]:.4g} | "
            f"{top} |") in report


def test_the_offset_reads_the_calibration_windows_only(tmp_path, model, tokenizer):
    """An evaluation row changed: the same offsets; a calibration row changed (same output folder, so the stored
    observation would be reused if its key did not hold the windows): the keys' mean of the new rows."""
    rows = stories(EVALUATED + CALIBRATED)
    out = tmp_path / "reports"
    first = offsets(run(write_config(tmp_path, rows, out), out))
    evaluation = [rows[0], rows[2], rows[1], *rows[EVALUATED:]]  # the evaluation windows swapped
    assert evaluation[EVALUATED:] == rows[EVALUATED:] and evaluation[:EVALUATED] != rows[:EVALUATED]
    again = offsets(run(write_config(tmp_path, evaluation, out), out))
    assert all(torch.equal(first[layer], again[layer]) for layer in first)
    calibration = [*rows[:EVALUATED], rows[EVALUATED + 1], stories(EVALUATED + CALIBRATED + 1)[-1]]  # one new
    moved = offsets(run(write_config(tmp_path, calibration, out), out))
    want = reference_offsets(model, tokenizer, calibration)
    for layer, mean in moved.items():
        assert not torch.allclose(mean, first[layer]), layer
        assert torch.allclose(mean, want[layer], rtol=1e-12, atol=1e-12), layer


def test_every_calibrate_value_has_its_calibration():
    assert set(CALIBRATIONS) == set(CALIBRATE)


@pytest.mark.parametrize("candidate, message", [
    ("{quantizer: int4, name: calibrated, calibrate: key_offset}",
     "candidates[0] (calibrated): calibrate: 'int4' has no key offset (key_offset) to calibrate; these have: "
     "fitted_levels, lloyd_max, normal_float"),
    ("{quantizer: lloyd_max, name: calibrated, calibrate: key_offset, options: {key_offset: [0, 0, 0, 0, 0, 0, 0, 0]}}",
     "candidates[0] (calibrated): calibrate sets key_offset per layer; remove options.key_offset"),
    ("{quantizer: lloyd_max, name: calibrated, calibrate: key_offset, options: {layers: {0: {key_bits: 3}}}}",
     "candidates[0] (calibrated): calibrate sets key_offset per layer; remove options.layers"),
    ("{quantizer: lloyd_max, name: calibrated, calibrate: keys}",
     "calibrate must be one of ['tensor', 'head', 'key_offset', 'kmeans', 'fisher_kmeans', 'key_bias'] or null, got "
     "'keys'"),
    ("{quantizer: vllm_fp8, name: calibrated, calibrate: key_offset}",
     "calibrate: 'vllm_fp8' has no key offset (key_offset) to calibrate"),
    ("{quantizer: lloyd_max, name: calibrated, calibrate: head}",
     "calibrate: 'lloyd_max' has no static scales (k_scale, v_scale) to calibrate; these have: vllm_fp8, vllm_nvfp4"),
    # calibration observes post-RoPE keys: a pre-RoPE cache would quantize other keys than those it was fitted on
    ("{quantizer: lloyd_max, name: calibrated, calibrate: key_offset, options: {pre_rope: true}}",
     "candidates[0] (calibrated): calibrate: key_offset observes the keys after RoPE (as an engine's cache receives "
     "them), and pre_rope stores them before it: what it would fit is not what the cache quantizes; drop one"),
    ("{quantizer: fitted_levels, name: calibrated, calibrate: fisher_kmeans, options: {pre_rope: true}}",
     "calibrate: fisher_kmeans observes the keys after RoPE"),
    # codebook levels (tests/test_fitted_levels.py)
    ("{quantizer: lloyd_max, name: calibrated, calibrate: fisher_kmeans}",
     "calibrate: 'lloyd_max' has no fitted levels (key_levels, value_levels) to calibrate; these have: "
     "fitted_levels"),
    ("{quantizer: fitted_levels, name: calibrated, calibrate: kmeans, options: {outliers: 1}}",
     "candidates[0] (calibrated): calibrate: kmeans fits levels to the states a codebook codes, and "
     "options.outliers changes them (not supported yet); drop it"),
    ("{quantizer: fitted_levels, name: calibrated, calibrate: kmeans, options: {key_bits: 2, "
     "key_levels: [-1, 0, 0.5, 1]}}",
     "candidates[0] (calibrated): calibrate sets key_levels and value_levels per layer; remove options.key_levels"),
])
def test_a_calibration_the_quantizer_cannot_take_is_one_line_before_the_model_loads(tmp_path, capsys, no_model_load,
                                                                                    candidate, message):
    path = write_config(tmp_path, stories(EVALUATED + CALIBRATED), tmp_path / "reports")
    text = open(path).read()
    start = text.index("  - {quantizer: lloyd_max, name: calibrated")
    end = text.index("\n", start)
    (tmp_path / "bad.yaml").write_text(text[:start] + "  - " + candidate + text[end:])
    assert main([str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "reports").exists()
