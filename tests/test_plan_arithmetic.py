"""The planner's arithmetic equals kvquant's cache code run in full: every storage rule (sinks, residual windows,
units, sliding windows, eviction, per-layer settings) at every token count around its edges, the largest context
it finds equals a search that simulated every probe, zeros on the CPU store what meta tensors store, and the plans
docs/planner.md shows come out as shown."""

import json
import re
from pathlib import Path

import pytest
import torch

from kvquant import plan
from kvquant.cache.build import build_cache, simulate_memory
from kvquant.cache.layer import KVQuantLayer
from kvquant.cache.memory import summarize
from kvquant.formats.quantizers import available_quantizers
from kvquant.planner import cost as plan_cost

ROOT = Path(__file__).parents[1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# the arithmetic equals kvquant's cache code run in full (simulate_memory), for every storage rule
H, D = 2, 64

LAYOUTS = {"full": [None] * 3, "sliding": [10, 10, None], "hybrid-shared": [None, 24, "shared", None],
           "window-1": [1, None]}

SETTINGS = [
    {"quantizer": "fp16"}, {"quantizer": "int8"}, {"quantizer": "fp8_e5m2"},
    {"quantizer": "int4", "group_size": 8, "residual_length": 3, "sink_tokens": 2},
    {"quantizer": "int2", "key_group_size": 16, "value_group_size": 8, "residual_length": 0},
    {"quantizer": "int8", "key_axis": "token", "value_axis": "channel", "group_size": 4, "residual_length": 5},
    {"quantizer": "int4", "rotation": "hadamard", "scale_dtype": "float32", "residual_length": 7, "group_size": 12},
    {"quantizer": "fp8_e4m3", "granularity": "tensor", "sink_tokens": 3},
    {"quantizer": "int4", "group_size": 8, "residual_length": 4,
     "layers": {"0": {"quantizer": "int8", "group_size": 6, "residual_length": 2}, "1": {"quantizer": "fp16"}}},
    {"quantizer": "int4", "group_size": 8, "residual_length": 4, "eviction": "window", "window": 20},
    {"quantizer": "int4", "group_size": 8, "residual_length": 4, "sink_tokens": 3, "eviction": "sink_window",
     "window": 17},
    {"quantizer": "int4", "group_size": 8, "residual_length": 4, "eviction": "key_norm", "window": 12, "budget": 9},
    {"quantizer": "int2", "key_group_size": 6, "value_group_size": 4, "residual_length": 1, "sink_tokens": 2,
     "eviction": "key_norm", "window": 8, "budget": 5},
]

TOKENS = [1, 2, 3, 5, 8, 9, 10, 11, 12, 13, 17, 20, 21, 24, 25, 31, 33, 40, 47, 64, 97, 130, 257]


#: Token counts at which the arithmetic is also checked against ``simulate_memory`` (meta tensors)
META_TOKENS = [21, 257]


def planner(layout, settings):
    from kvquant.planner.shapes import ModelShape, Planner

    return Planner(ModelShape("t", layout, H, D, 1e6), settings, torch.float16)


def cache_code(layout, settings, tokens: int, batch: int = 2) -> dict:
    """``simulate_memory``'s report by the same cache code, each layer written with zeros on the CPU (Python meta
    kernels take some 50 times longer at these sizes): ``memory_report()`` after ``tokens`` tokens, ``batch`` rows."""
    settings = dict(settings)
    cache = build_cache(layout, settings.pop("quantizer"), head_dim=D, **settings)
    parts = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, KVQuantLayer):
            states = torch.zeros(1, H, tokens, D, dtype=torch.float16)
            layer.update(states, states)
            memory = layer.memory()  # stored bytes, what the planner counts (one row's reserved bytes say nothing of B)
            parts[i] = {key: memory[key] * batch for key in plan_cost.MEMORY_KEYS}
    return summarize(parts, tokens)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items())[:60])
def test_the_arithmetic_equals_the_cache_code(layout, settings):
    """Every token count, below, at and past sinks, residual windows, units, sliding windows and eviction
    capacities: the whole report (per layer too), at batch 2; on meta tensors as well at :data:`META_TOKENS`."""
    from kvquant.errors import KVQuantError

    try:
        mine = planner(layout, settings)
    except KVQuantError as err:  # e.g. sinks on a sliding-window layer: make_cache refuses the same
        with pytest.raises(KVQuantError, match=re.escape(str(err))):
            simulate_memory(layout, settings, batch=2, kv_heads=H, head_dim=D, tokens=1)
        return
    for n in TOKENS:
        real = cache_code(layout, settings, n)
        if n in META_TOKENS:
            assert json.dumps(simulate_memory(layout, settings, batch=2, kv_heads=H, head_dim=D, tokens=n),
                              sort_keys=True) == json.dumps(real, sort_keys=True), n
        # as JSON: a window of one token holds nothing, and its ratio to fp16 is NaN (never equal to itself)
        assert json.dumps(mine.memory(2, n), sort_keys=True) == json.dumps(real, sort_keys=True), n
        assert mine.kv_bytes(2, n) == real["total_bytes"], n


def simulated_max_context(layout, settings, batch, available):
    """The planner's search before issue 36, each probe a full run of the cache code (the reference for the
    answers)."""
    def fits(n):
        return cache_code(layout, settings, n, batch)["total_bytes"] <= available

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@pytest.mark.parametrize("layout, settings", [
    (LAYOUTS["full"], {"quantizer": "int4", "group_size": 8, "residual_length": 5, "sink_tokens": 2}),
    (LAYOUTS["full"], {"quantizer": "int2", "key_group_size": 16, "value_group_size": 8, "residual_length": 0}),
    (LAYOUTS["hybrid-shared"], {"quantizer": "int8", "group_size": 16, "residual_length": 3}),
    (LAYOUTS["full"], {"quantizer": "int4", "group_size": 8, "residual_length": 4, "sink_tokens": 3,
                       "eviction": "sink_window", "window": 1500}),
], ids=["int4-sinks", "int2-residual-0", "int8-hybrid", "int4-sink-window"])
@pytest.mark.parametrize("available", [9_999, 123_457, 600_001])
def test_the_largest_context_is_the_simulated_searchs(layout, settings, available):
    """Largest contexts of a few hundred to a few thousand tokens, where the bytes dip at every quantized unit:
    the same answer as the search that simulated every probe."""
    assert planner(layout, settings).max_context(3, available) == simulated_max_context(layout, settings, 3,
                                                                                       available)


def test_zeros_store_what_meta_tensors_store(monkeypatch):
    """The planner writes zeros on the CPU up to plan_cost.CPU_ELEMENTS and meta tensors beyond: every registered
    quantizer, a rotation, and every storage rule store the same bytes either way (or are refused alike), 200 tokens
    being past every window and unit here."""
    from kvquant.errors import KVQuantError

    def both(layout, settings):
        out = []
        for elements in (1 << 30, 0):
            monkeypatch.setattr(plan_cost, "CPU_ELEMENTS", elements)
            try:
                out.append(plan_cost.memory_after_write(layout, settings, H, D, torch.float16, 200))
            except KVQuantError as err:
                out.append(str(err))
        return out

    cases = [([None], {"quantizer": name}) for name in available_quantizers()]
    cases += [([None], {"quantizer": name, "rotation": "hadamard", "rotation_seed": 3})
              for name in ("int4", "llamacpp_q4_0")]
    cases += [(LAYOUTS["hybrid-shared"], settings) for settings in SETTINGS]
    for layout, settings in cases:
        on_cpu, on_meta = both(layout, settings)
        assert on_cpu == on_meta, settings
        stored = len(layout) - layout.count("shared")
        assert isinstance(on_cpu, str) or len(on_cpu) == stored and all(sum(m.values()) for m in on_cpu.values())


def documented_tables() -> list[tuple[list[str], list[str]]]:
    """The tables docs/planner.md shows, each with the command above it: (argv, table rows)."""
    text = (ROOT / "docs" / "planner.md").read_text(encoding="utf-8")
    found = []
    for command, table in re.findall(r"```bash\n\.venv/bin/python -m kvquant\.plan ([^\n]+)\n```\n\n```\n(.*?)```",
                                     text, re.S):
        found.append((command.split(), [line for line in table.splitlines()[1:] if line.strip()]))
    return found


def test_the_documented_plans_are_unchanged(capsys):
    """The worked examples of docs/planner.md (computed by the simulation-only planner) come out as shown."""
    tables = documented_tables()
    assert len(tables) == 2 and any("--tensor-parallel" in argv for argv, _ in tables)
    for argv, rows in tables:
        assert plan.main(argv) == 0
        out = capsys.readouterr().out.splitlines()
        for row in rows:
            assert row in out, (argv, row)
