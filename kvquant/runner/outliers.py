"""Which layers' keys carry outliers (issue 55): the layers a per-token cache format pays for, found from the weights
(the key projection's bias) or from calibration (each key channel's mean over calibration tokens), by one rule.

**The rule.** A layer is an *outlier layer* when its statistic exceeds :data:`FACTOR` times the median of that
statistic over the model's layers (:func:`outliers`). The median, because it is what an ordinary layer looks like
whatever a few layers do; a factor, because the statistics are magnitudes whose scale differs from model to model.

**The statistics** (one number per layer, :func:`layer_statistics`):

- *from the weights*: the norm of the layer's key-projection bias (all KV heads), ``[kv_heads * head_dim]``. Qwen2's
  ``k_proj`` has a bias; a bias is a constant offset on every token's key before RoPE.
- *from calibration*: the largest absolute per-channel mean of the post-RoPE keys (what the cache stores) over the
  calibration tokens, ``[kv_heads, head_dim]`` per layer. RoPE turns a constant offset in a fast-rotating channel
  pair into an oscillation whose mean is near zero, so what remains is the offset in the slow channels: the part a
  per-token scale cannot absorb and a per-channel one (KIVI's key groups) can.

**Why 8.** On Qwen2.5-Coder-0.5B-Instruct the bias norms over the median are 33.2, 23.6, 19.3 and 12.6 (layers 0,
8, 1, 2), then 4.6, 2.9, 1.8 (layers 4, 3, 6) and every other layer 0.6-1.2: the widest gap on a log scale lies
between 4.6 and 12.6, and 8 sits near its geometric middle (7.6), so any factor from 4.6 to 12.6 finds the same
four layers (``reports/qwen2.5-outliers``). The calibration statistic at the same factor finds layers 0, 1 and 8
(12.2, 13.2 and 17.6 x its median; the slow channels' means there are the bias entries themselves, -145, +158,
-210) but not layer 2 (5.5 x): layer 2's bias is spread over more channels (its largest entry 66). No factor is
wide of both: 5 finds 0, 1, 2 and 8 from both statistics, with layer 4's bias at 4.6 x and layer 2's mean at 5.5 x
on either side of it. One model sets the factor: a model whose layers spread more evenly may need another, which
is why :func:`margin` reports how far the nearest layer on either side sits from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: a layer is an outlier layer above this many times the median layer (module docstring: why 8)
FACTOR = 8.0


def median(values: Sequence[float]) -> float:
    """The median (of an even count: the mean of the two middle values)."""
    if not len(values):
        raise ValueError("the median of no values")
    return float(np.median(np.asarray(values, dtype=np.float64)))


def outliers(values: Sequence[float], factor: float = FACTOR) -> list[int]:
    """The indices (layers) whose value is above ``factor`` times the median of ``values``, in order; none where
    the median is 0 and every value is 0."""
    middle = median(values)
    return [i for i, v in enumerate(values) if v > factor * middle]


def margin(values: Sequence[float], factor: float = FACTOR) -> tuple[float, float]:
    """``(lowest outlier, highest other)``, each over the median: the range of factors that find the same layers is
    ``[highest other, lowest outlier)`` (nan where a side is empty)."""
    middle = median(values)
    found = set(outliers(values, factor))
    ratios = [v / middle if middle else float("inf") for v in values]
    low = min((r for i, r in enumerate(ratios) if i in found), default=float("nan"))
    high = max((r for i, r in enumerate(ratios) if i not in found), default=float("nan"))
    return low, high


@dataclass(frozen=True)
class LayerStatistic:
    """One layer's statistic and where it sits: ``value`` (the layer's), ``heads`` (the same statistic per KV head)
    and ``channel`` (``(kv head, channel)`` of the largest absolute entry) and that entry."""

    value: float
    heads: tuple[float, ...]
    channel: tuple[int, int]
    largest: float


def layer_statistics(per_layer: Sequence[np.ndarray], kind: str) -> list[LayerStatistic]:
    """Per layer, from ``[kv_heads, head_dim]`` arrays: ``kind`` ``norm`` (the bias statistic: the layer's L2 norm,
    and each head's) or ``max`` (the calibration statistic: the largest absolute entry, and each head's)."""
    if kind not in ("norm", "max"):
        raise ValueError(f"kind {kind!r}: norm or max")
    out = []
    for x in per_layer:
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2:
            raise ValueError(f"a layer's array is [kv_heads, head_dim], got shape {x.shape}")
        head, channel = np.unravel_index(int(np.argmax(np.abs(x))), x.shape)
        if kind == "norm":
            value, heads = float(np.linalg.norm(x)), tuple(float(v) for v in np.linalg.norm(x, axis=1))
        else:
            value, heads = float(np.abs(x).max()), tuple(float(v) for v in np.abs(x).max(axis=1))
        out.append(LayerStatistic(value, heads, (int(head), int(channel)), float(x[head, channel])))
    return out


def outlier_table(stats: Sequence[LayerStatistic], factor: float = FACTOR) -> list[str]:
    """Markdown rows for the outlier layers: layer, statistic, times the median, each head's, the largest entry."""
    values = [s.value for s in stats]
    middle = median(values)
    rows = ["| layer | statistic | x median | per KV head | largest entry (head, channel) |",
            "|---:|---:|---:|---|---|"]
    for i in outliers(values, factor):
        s = stats[i]
        heads = ", ".join(f"{h:.1f}" for h in s.heads)
        rows.append(f"| {i} | {s.value:.1f} | {s.value / middle:.1f} | {heads} | {s.largest:+.1f} at "
                    f"({s.channel[0]}, {s.channel[1]}) |")
    return rows
