"""experiments/bench_lowbit.py's stand-ins for calibration, by value (no timing is asserted): the candidates it
times are configs/smollm2-lowbit.yaml's, and a calibrated candidate's stand-in reaches its codecs (what they give
back differs from the same quantizer's without it, on the streams calibration sets), so the timed cost includes
what calibration adds."""

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


def stored(candidate: dict, states: torch.Tensor) -> list[torch.Tensor]:
    """What the candidate's key and value codecs give back for ``states`` (as keys and as values)."""
    options = {k: v for k, v in (candidate.get("options") or {}).items() if k not in CACHE_OPTIONS}
    out = []
    for codec in kvquant.get_quantizer(candidate["quantizer"], **options).codecs(states.shape[-1]):
        back = torch.empty_like(states)
        codec.decode_into(codec.encode(states), back)
        out.append(back)
    return out


def test_the_timed_candidates_are_the_configs_with_stand_ins_that_reach_the_codecs(script):
    spec = yaml.safe_load((ROOT / "configs" / "smollm2-lowbit.yaml").read_text())
    states = torch.randn(1, 3, 32, 64, generator=torch.Generator().manual_seed(1)) + 3.0
    timed = script.timed_candidates(spec)
    assert list(timed) == [c["name"] for c in spec["candidates"]]
    assert {c["calibrate"] for c in spec["candidates"] if c.get("calibrate")} == {"key_offset", "fisher_kmeans"}
    for candidate in spec["candidates"]:
        got = stored(timed[candidate["name"]], states)
        if candidate.get("calibrate"):
            plain = stored(candidate, states)
            changed = [not torch.equal(a, b) for a, b in zip(got, plain)]
            # a key offset is the keys' alone; fitted levels are both streams'
            assert changed == ([True, False] if candidate["calibrate"] == "key_offset" else [True, True]), \
                candidate["name"]
        else:
            assert timed[candidate["name"]] == candidate


def test_a_calibration_it_has_no_stand_in_for_is_refused_in_one_line(script):
    with pytest.raises(KVQuantError, match="no stand-in for calibrate: tensor"):
        script.calibrated_stand_in({"name": "x", "quantizer": "vllm_fp8", "calibrate": "tensor"}, 64)
