"""experiments/gpu_check.py's memory check, the part a CPU can run: one growing cache per quantizer measured at
several contexts and after decode steps (a fake allocator here: the CPU has no allocator statistics), memory_report's
stored + reserved bytes equal to the cache's tensors the script walks itself, and the verdicts it renders."""

import pytest

from tests.conftest import experiment


@pytest.fixture(scope="module")
def gpu_check():
    return experiment("gpu_memory")


@pytest.fixture(scope="module")
def llama():
    """The Llama-3-8B attention shape gpu_check's memory check uses."""
    return experiment("gpu_models").shapes()["llama3-8b-4layers"][1]


def test_memory_rows_on_the_cpu_equal_the_caches_tensors(gpu_check, llama):
    quantizers = {"fp16": ("fp16", {}), "int4": ("int4", {})}
    rows = gpu_check.check_memory("cpu", llama, quantizers, contexts=(512, 1100), batch=2, steps=100, layers=1,
                                  allocated=lambda: 0)["rows"]
    assert [(r["cache"], r["tokens"], r["point"]) for r in rows] == [
        (f"kvquant-{q}", n, p) for q in ("fp16", "int4") for n, p in ((512, "prefill"), (1100, "prefill"),
                                                                     (1200, "+100 steps"))]
    for r in rows:
        assert r["stored_bytes"] + r["reserved_bytes"] == r["tensor_bytes"] == r["held_bytes"], r
    # the identity stores bfloat16 K and V: 2 bytes x 2 tensors x batch x 8 heads x 128 per token, one layer
    assert [r["stored_bytes"] for r in rows[:3]] == [2 * 2 * 2 * 8 * 128 * n for n in (512, 1100, 1200)]
    grown = [r for r in rows if r["point"] != "prefill"]
    assert all(r["reserved_bytes"] > 0 for r in grown)  # the steps left capacity held for growth
    lines = gpu_check.memory_verdicts(rows)
    exact = [line for line in lines if "the cache's tensors" in line]
    assert len(exact) == len(rows) and all(line.startswith("PASS") for line in exact)
    allocator = [line for line in lines if "the allocator grew" in line]
    assert len(allocator) == len(rows) and all(line.startswith("FAIL") for line in allocator)  # the fake's zero
    bounded = [line for line in lines if "CHUNK_TOKENS" in line]
    assert bounded and all(line.startswith("PASS") for line in bounded)


def test_the_memory_check_stops_at_its_time_limit_and_says_where(gpu_check, llama):
    """A run stopped at its time limit keeps the rows it measured and names the quantizer it did not start."""
    asked = []
    quantizers = {"fp16": ("fp16", {}), "int8": ("int8", {}), "int4": ("int4", {})}
    done = gpu_check.check_memory("cpu", llama, quantizers, contexts=(300,), batch=1, steps=2, layers=1,
                                  allocated=lambda: 0, in_time=lambda: asked.append(1) or len(asked) <= 2)
    assert [(r["cache"], r["tokens"]) for r in done["rows"]] == [("kvquant-fp16", 300), ("kvquant-fp16", 302),
                                                                 ("kvquant-int8", 300), ("kvquant-int8", 302)]
    assert done["stopped"] == "time limit, before kvquant-int4" and len(asked) == 3


def test_memory_verdicts_fail_where_the_allocator_or_the_bound_disagrees(gpu_check):
    row = {"cache": "kvquant-int4", "tokens": 16384, "point": "prefill", "batch": 4, "chunk_tokens": 256,
           "stored_bytes": 1000, "reserved_bytes": 10, "tensor_bytes": 1010, "held_bytes": 1010, "host_bytes": 0,
           "allocated_bytes": 1020}
    assert [line[:4] for line in gpu_check.memory_verdicts([row])] == ["PASS", "PASS", "PASS"]
    old = dict(row, reserved_bytes=220, tensor_bytes=1220, held_bytes=1220, allocated_bytes=1221)  # 1.25x growth
    assert [line[:4] for line in gpu_check.memory_verdicts([old])] == ["PASS", "PASS", "FAIL"]
    unreported = dict(row, held_bytes=1220, allocated_bytes=1220)  # tensors the report does not count
    assert [line[:4] for line in gpu_check.memory_verdicts([unreported])] == ["FAIL", "FAIL", "PASS"]
