"""The comparison of llama.cpp with kvquant's emulation (:mod:`kvquant.integrations.llamacpp_engine` runs both): per
cache type
and rotation, each side's mean per-token KL divergence from its own f16 cache with a 95% interval, the ratio
kvquant / llama.cpp with its interval, top-1 agreement, and the target of issue 37: wherever llama.cpp's KL is at
least 1e-3, kvquant's within +-20% of it or the two intervals overlapping; the same order of types; rotation's
effect in the same direction. Beside them, each against the model's own computation: llama.cpp's setting, each
engine's f16 cache, and the verdict ``make_cache`` gives (docs/quantizers.md: what an engine format's KL means).

Intervals: a bootstrap over blocks of 32 consecutive positions (inside a window), resampled with replacement, the
same resamples for both sides and every setting (so the ratio's interval is paired). Blocks, not single tokens,
because neighbouring positions' KL divergences are correlated; blocks, not windows, so that one window still shows
a spread. Both sides see the same windows, so the spread that windows share cancels in the ratio.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from dataclasses import dataclass

import numpy as np
import torch

from kvquant.errors import KVQuantError
from kvquant.integrations.llamacpp_engine import (F16_LABEL, MODEL_SIDES, SIDES, Engine, Setting, check_cache_types,
    gguf_metadata, import_llama_cpp, measure_engines, model_spec, same_tokens, token_windows)

#: how kvquant's side multiplies the GGUF's weights: llama.cpp's quantized activations, or float32 (transformers)
MATMULS = ("llamacpp", "float32")


def block_sums(per_window: list[np.ndarray], block: int) -> np.ndarray:
    """``[blocks, 2]``: (sum, positions) of consecutive runs of ``block`` positions inside each window."""
    rows = [(float(np.sum(w[i : i + block])), len(w[i : i + block]))
            for w in per_window for i in range(0, len(w), block)]
    return np.array(rows, dtype=float)


@dataclass(frozen=True)
class Row:
    """One setting on both sides: mean KL and its interval per side (:data:`SIDES`, each against its own f16 cache,
    and :data:`MODEL_SIDES`, against the model's own computation), the ratio kvquant / llama.cpp and its interval,
    top-1 agreement per side."""

    setting: Setting
    kl: dict[str, tuple[float, float, float]]
    ratio: tuple[float, float, float]
    top1: dict[str, float]

    @property
    def gated(self) -> bool:
        """Whether the target applies: llama.cpp's KL is at least 1e-3."""
        return self.kl["llamacpp"][0] >= 1e-3

    @property
    def within(self) -> bool:
        """kvquant's KL within +-20% of llama.cpp's, or the two 95% intervals overlap."""
        (_, a_low, a_high), (_, b_low, b_high) = self.kl["llamacpp"], self.kl["kvquant"]
        return 0.8 <= self.ratio[0] <= 1.2 or (a_low <= b_high and b_low <= a_high)


def _interval(draws: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1 - confidence) / 2
    low, high = np.quantile(draws, [alpha, 1 - alpha])
    return float(low), float(high)


def rows_with_draws(found: dict, settings: list[Setting], block: int = 32, iters: int = 2000, seed: int = 0,
                    confidence: float = 0.95) -> tuple[list[Row], dict[str, np.ndarray]]:
    """The rows, and every (label, side)'s bootstrap draws of the mean KL: blocks of ``block`` consecutive
    positions resampled with replacement, the same resamples for both sides and every setting (paired)."""
    sums = {(s.label, side): block_sums(found[s.label][side]["kl"], block) for s in settings
            for side in (*SIDES, *MODEL_SIDES)}
    n = len(next(iter(sums.values())))
    idx = np.random.default_rng(seed).integers(0, n, size=(iters, n))
    draws = {key: v[idx, 0].sum(1) / v[idx, 1].sum(1) for key, v in sums.items()}
    rows = []
    for s in settings:
        kl = {side: (float(sums[s.label, side][:, 0].sum() / sums[s.label, side][:, 1].sum()),
                     *_interval(draws[s.label, side], confidence)) for side in (*SIDES, *MODEL_SIDES)}
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = draws[s.label, "kvquant"] / draws[s.label, "llamacpp"]
            ratio = kl["kvquant"][0] / kl["llamacpp"][0] if kl["llamacpp"][0] else float("nan")
        top1 = {side: float(np.concatenate(found[s.label][side]["top1"]).mean()) for side in (*SIDES, *MODEL_SIDES)}
        rows.append(Row(s, kl, (ratio, *_interval(ratios, confidence)), top1))
    return rows, {f"{label}|{side}": d for (label, side), d in draws.items()}


def order_check(rows: list[Row], draws: dict[str, np.ndarray], rotation: bool) -> dict[str, object]:
    """The types ordered by KL on each side (at one rotation), and the pairs the two sides order differently,
    each with whether llama.cpp itself separates them (the 95% interval of its difference excludes 0)."""
    mine = [r for r in rows if r.setting.rotation == rotation]
    orders = {side: [r.setting.kind for r in sorted(mine, key=lambda r: r.kl[side][0])] for side in SIDES}
    swapped = []
    for i, a in enumerate(mine):
        for b in mine[i + 1:]:
            signs = [np.sign(a.kl[side][0] - b.kl[side][0]) for side in SIDES]
            if signs[0] != signs[1]:
                diff = draws[f"{a.setting.label}|llamacpp"] - draws[f"{b.setting.label}|llamacpp"]
                low, high = _interval(diff, 0.95)
                swapped.append({"pair": (a.setting.kind, b.setting.kind), "llamacpp_separates": low > 0 or high < 0})
    return {"orders": orders, "swapped": swapped, "same": not swapped,
            "same_where_llamacpp_separates": not any(p["llamacpp_separates"] for p in swapped)}


def rotation_check(rows: list[Row]) -> dict[str, dict[str, float]]:
    """Per type measured with rotation on and off: KL(on) - KL(off) on each side."""
    by = {(r.setting.kind, r.setting.rotation): r for r in rows}
    return {kind: {side: by[kind, True].kl[side][0] - by[kind, False].kl[side][0] for side in SIDES}
            for kind, rotation in by if rotation and (kind, False) in by}


def fmt(value: float) -> str:
    return f"{value:.4f}" if value >= 1e-3 else f"{value:.2e}"


def table(rows: list[Row]) -> str:
    """The side-by-side markdown table: each side against its own f16 cache (the target's columns), then against
    the model's own computation (llama.cpp's setting, and kvquant's verdict: docs/quantizers.md)."""
    lines = ["| type | rotation | llama.cpp KL [95% CI] | kvquant KL [95% CI] | kvquant / llama.cpp [95% CI] "
             "| top-1 llama.cpp | top-1 kvquant | target | llama.cpp KL from the model [95% CI] "
             "| verdict KL (make_cache) [95% CI] |", "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        kl = [f"{fmt(m)} [{fmt(lo)}, {fmt(hi)}]" for m, lo, hi in (r.kl[side] for side in (*SIDES, *MODEL_SIDES))]
        verdict = ("met" if r.within else "**missed**") if r.gated else "n/a (KL < 1e-3)"
        lines.append(f"| {r.setting.kind} | {'on' if r.setting.rotation else 'off'} | {kl[0]} | {kl[1]} | "
                     f"{r.ratio[0]:.3f} [{r.ratio[1]:.3f}, {r.ratio[2]:.3f}] | {r.top1['llamacpp']:.3f} | "
                     f"{r.top1['kvquant']:.3f} | {verdict} | {kl[2]} | {kl[3]} |")
    return "\n".join(lines)


def f16_offsets(found: dict) -> dict[str, float]:
    """Each engine's own f16 cache against the model's own computation, mean KL: llama.cpp's and kvquant's
    emulation of it."""
    return {side: float(np.concatenate(measured["kl"]).mean()) for side, measured in found[F16_LABEL].items()}


def verdicts(rows: list[Row], draws: dict[str, np.ndarray]) -> dict[str, object]:
    """The target's three parts: every gated row within, the same order of types (per rotation), rotation's effect
    in the same direction (per type)."""
    orders = {("on" if rot else "off"): order_check(rows, draws, rot)
              for rot in sorted({r.setting.rotation for r in rows}, reverse=True)}
    rotation = rotation_check(rows)
    return {"within": all(r.within for r in rows if r.gated), "orders": orders, "rotation": rotation,
            "rotation_same_direction": all(np.sign(d["llamacpp"]) == np.sign(d["kvquant"]) for d in rotation.values())}


def _swap(pair: dict) -> str:
    noise = "llama.cpp separates them" if pair["llamacpp_separates"] else "within llama.cpp's noise"
    return f"{'/'.join(pair['pair'])} ({noise})"


def summary_text(rows: list[Row], checks: dict[str, object], offsets: dict[str, float]) -> str:
    """The table and the target's verdicts, as printed."""
    out = [table(rows), "",
           f"each engine's f16 cache against the model's own computation: llama.cpp {fmt(offsets['llamacpp_model'])}, "
           f"kvquant's emulation {fmt(offsets['kvquant_model'])} (the verdict on a type is its KL from the model's "
           "own computation: docs/quantizers.md)"]
    for rot, check in checks["orders"].items():
        out.append(f"order of types, rotation {rot}: llama.cpp {' < '.join(check['orders']['llamacpp'])}; "
                   f"kvquant {' < '.join(check['orders']['kvquant'])}: "
                   + ("same" if check["same"] else "differs in " + ", ".join(map(_swap, check["swapped"]))))
    for kind, d in checks["rotation"].items():
        out.append(f"rotation on - off, {kind}: llama.cpp {d['llamacpp']:+.4f}, kvquant {d['kvquant']:+.4f}")
    holds = checks["within"] and checks["rotation_same_direction"] and all(
        c["same"] for c in checks["orders"].values())
    out.append(f"target: {'met' if holds else 'not met'} (within +-20% or overlapping: "
               f"{'yes' if checks['within'] else 'no'}; same order: "
               f"{'yes' if all(c['same'] for c in checks['orders'].values()) else 'no'}; rotation's direction: "
               f"{'same' if checks['rotation_same_direction'] else 'differs'})")
    return "\n".join(out)


def compare(model: str, windows: int, length: int, settings: list[Setting], threads: int = 2,
            matmul: str = "llamacpp", rope_layout: str | None = None,
            progress=lambda message: None, saved: Path | None = None) -> dict[str, object]:
    """The whole comparison: refusals first (a setting llama.cpp does not allow, a missing ``llama_cpp``, before
    any model loads), then llama.cpp's model, kvquant's tokenizer and windows, kvquant's model (its matmuls as
    ``matmul`` says: :mod:`kvquant.formats.llamacpp_matmuls`), both sides. ``rope_layout``: K's channel order on
    kvquant's side
    (None: the model's, as ``make_cache`` decides; ``neox`` with ``matmul="float32"`` is the cache-only emulation).
    ``saved``: a folder keeping each finished window (an interrupted comparison resumes at the next one)."""
    from kvquant.formats.llamacpp_matmuls import emulate_matmuls
    from kvquant.scoring.models import load_model, load_tokenizer

    if matmul not in MATMULS:
        raise KVQuantError(f"--matmul {matmul!r}: {' or '.join(MATMULS)}")
    spec, gguf = model_spec(model)
    meta = gguf_metadata(gguf)
    check_cache_types(settings, meta["head_dim"])
    import_llama_cpp()
    torch.set_num_threads(threads)
    engine = Engine(gguf, threads)
    try:
        tokenizer = load_tokenizer(spec)
        ids = token_windows(tokenizer, meta, windows, length)
        if len(ids) < windows:
            raise KVQuantError(f"WikiText-2 holds {len(ids)} windows of {length} tokens, fewer than {windows}")
        agree = same_tokens(engine, tokenizer, tokenizer.decode(ids[0][1:]))
        loaded, _ = load_model(spec)

        @contextlib.contextmanager
        def emulating_matmuls():  # kvquant's engine side only: the verdict is measured with the model's own matmuls
            handles = emulate_matmuls(loaded, gguf) if matmul == "llamacpp" else []
            try:
                yield
            finally:
                for handle in handles:
                    handle.remove()

        start = time.perf_counter()
        from kvquant.experiment.provenance import code_version

        inputs = f"{gguf}|{Path(gguf).stat().st_size}|{matmul}|{threads}|{code_version()}"
        found = measure_engines(engine, loaded, ids, settings, progress, saved=saved, inputs=inputs,
                                emulated=emulating_matmuls, **({"rope_layout": rope_layout} if rope_layout else {}))
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    rows, draws = rows_with_draws(found, settings)
    checks = verdicts(rows, draws)
    offsets = f16_offsets(found)
    return {"rows": rows, "checks": checks, "text": summary_text(rows, checks, offsets), "found": found,
            "meta": {"model": model, "gguf": str(gguf), **meta, "windows": windows, "length": length,
                     "f16_against_the_model": offsets,
                     "threads": threads, "matmul": matmul, "rope_layout": rope_layout or "the model's",
                     "same_tokenization": agree, "seconds": round(seconds, 1)}}


def to_json(result: dict[str, object], block: int = 32) -> dict[str, object]:
    """What :func:`compare` found, as JSON: the rows, the checks, and per (setting, side) the block sums of KL and
    of top-1 agreement (enough to recompute every figure)."""
    rows = [{"type": r.setting.kind, "rotation": r.setting.rotation, "kl": r.kl, "ratio": r.ratio, "top1": r.top1,
             "gated": r.gated, "within": r.within} for r in result["rows"]]
    blocks = {label: {side: {key: block_sums([np.asarray(w, dtype=float) for w in values[key]], block).tolist()
                             for key in ("kl", "top1")} for side, values in sides.items()}
              for label, sides in result["found"].items()}
    return {"meta": result["meta"], "rows": rows, "checks": result["checks"], "block": block, "blocks": blocks}
