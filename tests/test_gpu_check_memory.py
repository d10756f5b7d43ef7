"""experiments/gpu_check.py's memory check, the part a CPU can run: one growing cache per quantizer measured at
several contexts and after decode steps (a fake allocator here: the CPU has no allocator statistics), memory_report's
stored + reserved bytes equal to the cache's tensors the script walks itself, and the verdicts it renders."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "experiments" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_memory_rows_on_the_cpu_equal_the_caches_tensors(gpu_check, monkeypatch):
    monkeypatch.setattr(gpu_check, "QUANTIZERS", {k: gpu_check.QUANTIZERS[k] for k in ("fp16", "int4")})
    rows = gpu_check.check_memory("cpu", contexts=(512, 1100), batch=2, steps=100, layers=1,
                                  allocated=lambda: 0)["rows"]
    assert [(r["cache"], r["tokens"], r["point"]) for r in rows] == [
        (f"kvquant-{q}", n, p) for q in ("fp16", "int4") for n, p in ((512, "prefill"), (1100, "prefill"),
                                                                     (1200, "+100 steps"))]
    for r in rows:
        assert r["stored_bytes"] + r["reserved_bytes"] == r["tensor_bytes"] == r["held_bytes"], r
    grown = [r for r in rows if r["point"] != "prefill"]
    assert all(r["reserved_bytes"] > 0 for r in grown)  # the steps left capacity held for growth
    lines = gpu_check.memory_verdicts(rows)
    exact = [line for line in lines if "the cache's tensors" in line]
    assert len(exact) == len(rows) and all(line.startswith("PASS") for line in exact)
    allocator = [line for line in lines if "the allocator grew" in line]
    assert len(allocator) == len(rows) and all(line.startswith("FAIL") for line in allocator)  # the fake's zero
    bounded = [line for line in lines if "CHUNK_TOKENS" in line]
    assert bounded and all(line.startswith("PASS") for line in bounded)


def test_memory_verdicts_fail_where_the_allocator_or_the_bound_disagrees(gpu_check):
    row = {"cache": "kvquant-int4", "tokens": 16384, "point": "prefill", "batch": 4, "chunk_tokens": 256,
           "stored_bytes": 1000, "reserved_bytes": 10, "tensor_bytes": 1010, "held_bytes": 1010, "host_bytes": 0,
           "allocated_bytes": 1020}
    assert [line[:4] for line in gpu_check.memory_verdicts([row])] == ["PASS", "PASS", "PASS"]
    old = dict(row, reserved_bytes=220, tensor_bytes=1220, held_bytes=1220, allocated_bytes=1221)  # 1.25x growth
    assert [line[:4] for line in gpu_check.memory_verdicts([old])] == ["PASS", "PASS", "FAIL"]
    unreported = dict(row, held_bytes=1220, allocated_bytes=1220)  # tensors the report does not count
    assert [line[:4] for line in gpu_check.memory_verdicts([unreported])] == ["FAIL", "FAIL", "PASS"]
