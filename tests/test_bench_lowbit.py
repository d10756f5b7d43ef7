"""experiments/bench_lowbit.py's stand-ins for calibration, by value (no timing is asserted): every candidate of
configs/smollm2-lowbit.yaml builds, and a calibrated candidate's stand-in reaches its codec (the keys it stores
differ from the same quantizer's without it), so the timed cost includes what calibration adds."""

from pathlib import Path

import pytest
import torch
import yaml

import kvquant
from kvquant.errors import KVQuantError
from kvquant.formats.quantizers import CACHE_OPTIONS
from tests.conftest import experiment

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    return experiment("bench_lowbit")


def stored_keys(candidate: dict, keys: torch.Tensor) -> torch.Tensor:
    options = {k: v for k, v in (candidate.get("options") or {}).items() if k not in CACHE_OPTIONS}
    key_codec, _ = kvquant.get_quantizer(candidate["quantizer"], **options).codecs(keys.shape[-1])
    out = torch.empty_like(keys)
    key_codec.decode_into(key_codec.encode(keys), out)
    return out


def test_every_candidate_builds_and_a_stand_in_reaches_the_codec(script):
    spec = yaml.safe_load((ROOT / "configs" / "smollm2-lowbit.yaml").read_text())
    keys = torch.randn(1, 3, 32, 64, generator=torch.Generator().manual_seed(1)) + 3.0
    calibrated = [c for c in spec["candidates"] if c.get("calibrate")]
    assert {c["calibrate"] for c in calibrated} == {"key_offset", "fisher_kmeans"}
    for candidate in spec["candidates"]:
        stood = script.calibrated_stand_in(candidate, 64)
        stored_keys(stood, keys)  # builds and codes
        if candidate.get("calibrate"):
            plain = stored_keys({**candidate, "options": candidate.get("options")}, keys)
            assert not torch.equal(stored_keys(stood, keys), plain), candidate["name"]
        else:
            assert stood == candidate


def test_a_calibration_it_has_no_stand_in_for_is_refused_in_one_line(script):
    with pytest.raises(KVQuantError, match="no stand-in for calibrate: tensor"):
        script.calibrated_stand_in({"name": "x", "quantizer": "vllm_fp8", "calibrate": "tensor"}, 64)
