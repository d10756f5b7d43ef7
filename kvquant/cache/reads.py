"""What attention really read from a cache: of the keys (and values) each query read, how many were stored
quantized. A gate may only trust an accuracy whose requests read quantized K/V, and a cache hides quantization
in its full-precision parts: sink tokens, the residual window and a key group not yet whole (a 40-token request
through 128-token key groups reads every key unquantized).

Counting is per layer, per row and per query, causally: a forward that writes ``n`` tokens after ``p`` read ones
counts, for its ``j``-th query, the first ``p + j + 1`` tokens the layer returns (what a causal mask lets it
read; a sliding window's mask shows a query fewer, so its share is counted over what the layer keeps). Padding
is neither a query nor a read token. Evicted tokens are not read, so they count as neither.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: A run of the tokens a layer returns in order: (stored quantized?, how many).
Run = tuple[bool, int]


def last_runs(runs: list[Run], m: int) -> list[Run]:
    """The last ``m`` tokens of ``runs`` (``m <= `` their total), as runs."""
    out: list[Run] = []
    for flag, length in reversed(runs):
        if m <= 0:
            break
        take = min(length, m)
        if take:
            out.append((flag, take))
        m -= take
    return out[::-1]


def _ramp_sum(upper: int, start: int, length: int) -> int:
    """``sum(clamp(x - start, 0, length) for x in range(upper + 1))``: how many tokens of a run at
    ``[start, start + length)`` the prefixes of lengths ``0..upper`` hold, together."""
    k = min(upper, start + length) - start
    if k <= 0:
        return 0
    return k * (k + 1) // 2 + max(upper - start - length, 0) * length


def causal_counts(runs: list[Run], queries: int) -> tuple[int, int]:
    """``(quantized, read)`` token reads of ``queries`` queries, the last ``queries`` of the tokens in ``runs``:
    query ``j`` (of ``0..queries-1``) reads the first ``m - queries + j + 1`` of the ``m`` tokens."""
    m = sum(length for _, length in runs)
    if queries <= 0 or m == 0:
        return 0, 0
    queries = min(queries, m)
    low, high = m - queries + 1, m  # prefix lengths read
    read = (low + high) * queries // 2
    quantized, start = 0, 0
    for flag, length in runs:
        if flag:
            quantized += _ramp_sum(high, start, length) - _ramp_sum(low - 1, start, length)
        start += length
    return quantized, read


@dataclass
class Reads:
    """Token reads by attention, summed over layers, rows, queries and every cache that shares this counter."""

    keys_quantized: int = 0
    keys: int = 0
    values_quantized: int = 0
    values: int = 0

    def count(self, name: str, runs: list[Run], queries: int) -> None:
        """Add the reads of ``queries`` queries of one row over ``runs`` (``name``: ``keys`` or ``values``)."""
        quantized, read = causal_counts(runs, queries)
        setattr(self, f"{name}_quantized", getattr(self, f"{name}_quantized") + quantized)
        setattr(self, name, getattr(self, name) + read)

    def add(self, other: Reads) -> Reads:
        return Reads(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values())))

    def share(self, name: str) -> float:
        """Quantized share of the ``keys`` or ``values`` read (nan when nothing was read)."""
        total = getattr(self, name)
        return getattr(self, f"{name}_quantized") / total if total else float("nan")

    @property
    def quantized_share(self) -> float:
        """The smaller of the key and value shares: how much of what attention read went through the quantizer."""
        keys, values = self.share("keys"), self.share("values")
        return float("nan") if keys != keys or values != values else min(keys, values)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)
