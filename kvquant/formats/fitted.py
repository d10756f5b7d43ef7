"""Codebook levels fitted to data (issue 56): KVQuant's non-uniform codes (Hooper et al. 2024, "nuqX").

- :func:`weighted_kmeans`: the ``count`` levels of a one-dimensional weighted k-means (Lloyd's iteration: a cell
  ends at the midpoint between neighbouring levels, each level moves to the weighted mean of its cell).
- :class:`FittedLevels`, registered ``fitted_levels``: :class:`kvquant.formats.lowbit.CodebookCodec` on
  ``x / max|x|`` per token and head with levels given per stream (``key_levels``, ``value_levels``; per layer
  through ``layers``), which ``calibrate: kmeans`` or ``calibrate: fisher_kmeans`` fits on the calibration split
  (:mod:`kvquant.scoring.level_fit`). Levels count under ``host_bytes`` (float32, ``2**bits`` per stream and
  layer), as every codebook's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvquant.errors import KVQuantError
from kvquant.formats.lowbit import CodebookCodec, CodebookQuantizer, normal_float
from kvquant.formats.quantizers import register_quantizer, short_repr

#: Lloyd's iteration stops when no value changes cell, or after this many steps.
ITERATIONS = 1_000


def weighted_kmeans(values: torch.Tensor, weights: torch.Tensor, count: int) -> torch.Tensor:
    """``[count]`` float64, increasing: the levels of a weighted k-means of ``values`` ``[N]`` with ``weights``
    ``[N]`` (>= 0, some > 0). Start: ``count`` levels evenly spaced from the smallest to the largest value; then,
    alternately, each value goes to the cell of its nearest level (cells end at the midpoints between neighbouring
    levels; a value on a midpoint goes to the upper cell, as :class:`~kvquant.formats.lowbit.CodebookCodec` codes
    it) and each level with weight in its cell moves to the weighted mean of that cell (one with none stays), until
    no value changes cell (at most :data:`ITERATIONS` steps). A level stays inside its cell, so the levels stay
    increasing. Sums in float64."""
    values, weights = values.reshape(-1).double(), weights.reshape(-1).double()
    if values.numel() != weights.numel() or not values.numel():
        raise KVQuantError(f"weighted_kmeans: {values.numel()} values and {weights.numel()} weights; give as many "
                           "of each, at least one")
    if not bool(torch.isfinite(values).all() & torch.isfinite(weights).all() & (weights >= 0).all()):
        raise KVQuantError("weighted_kmeans: values and weights must be finite, weights at least 0")
    if not float(weights.sum()) > 0:
        raise KVQuantError("weighted_kmeans: every weight is 0, so no level can be fitted")
    low, high = float(values.min()), float(values.max())
    levels, cells = torch.linspace(low, high, count, dtype=torch.float64), None
    for _ in range(ITERATIONS):
        assigned = torch.searchsorted((levels[:-1] + levels[1:]) / 2, values, right=True)
        if cells is not None and torch.equal(assigned, cells):
            break
        cells = assigned
        mass = torch.zeros(count, dtype=torch.float64).index_add_(0, cells, weights)
        moment = torch.zeros(count, dtype=torch.float64).index_add_(0, cells, weights * values)
        levels = torch.where(mass > 0, moment / mass.clamp(min=torch.finfo(torch.float64).tiny), levels)
        levels = levels.clamp(low, high)  # a mean's rounding stays within the values
    return levels


@register_quantizer("fitted_levels")
@dataclass(frozen=True)
class FittedLevels(CodebookQuantizer):
    """Levels fitted to data on ``x / max|x|`` per token and head (levels in [-1, 1], increasing): ``key_levels``
    and ``value_levels``, ``2**key_bits`` and ``2**value_bits`` numbers (per layer through ``layers``, or fitted by
    ``calibrate``; not given: :func:`~kvquant.formats.lowbit.normal_float`'s, what ``normal_float`` without its
    rotation stores). KVQuant quantizes in the model's basis: no rotation by default. Bits per element
    ``bits + 16 / D`` (fp16 scale)."""

    statistic = "absmax"
    rotation: str | None = dataclasses.field(default=None, kw_only=True)
    key_levels: tuple | None = dataclasses.field(default=None, kw_only=True)
    value_levels: tuple | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        for field, bits in (("key_levels", self.key_bits), ("value_levels", self.value_bits)):
            object.__setattr__(self, field, self._checked(field, getattr(self, field), bits))

    def _checked(self, field: str, value, bits: int) -> tuple | None:
        """``value`` as a tuple of floats (lists from YAML, kept hashable), or a one-line refusal."""
        if value is None:
            return None
        numbers = isinstance(value, (list, tuple)) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and -1 <= v <= 1 for v in value)
        if not numbers or len(value) != 2**bits or any(a >= b for a, b in zip(value, value[1:])):
            raise KVQuantError(f"{self.name}: {field} must be {2**bits} increasing numbers in [-1, 1] (one per "
                               f"{bits}-bit code), got {short_repr(value)}")
        return tuple(float(v) for v in value)

    def _codecs(self, head_dim):
        return tuple(CodebookCodec((normal_float(bits) if levels is None else torch.tensor(levels)).float(), bits,
                                   self.statistic, self._scale_dtype())
                     for levels, bits in ((self.key_levels, self.key_bits), (self.value_levels, self.value_bits)))
