"""Checks and messages the cache's entry points share: every bad argument is one :class:`KVQuantError` line."""

from __future__ import annotations

import math
import re

import torch

from kvquant.errors import KVQuantError, NonFiniteKVError, is_int

STATES = "[batch, heads, tokens, head_dim]"


def describe_value(value) -> str:
    """``value`` as an error message shows it, on one short line: its type and repr (a tensor's or array's shape)."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D tensor {tuple(value.shape)} of {value.dtype}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # numpy and the like
        return f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = re.sub(r"\s+", " ", repr(value))
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def check_layer_index(where: str, layer_idx, count: int) -> None:
    if type(layer_idx) is not int or not 0 <= layer_idx < count:  # bools, floats and tensors are no layer index
        raise KVQuantError(f"{where}: layer_idx must be an integer in 0-{count - 1} (the model's layers), got "
                           f"{describe_value(layer_idx)}")


def row_list(where: str, name: str, rows, count: int | None) -> list[int]:
    """``rows`` (a list or tuple of row numbers or a 1-D integer tensor) as a list of ints, each in ``[0, count)``
    (``count`` None: the cache's rows are not known yet, only negative rows are refused)."""
    valid = "a list of row numbers or a 1-D integer tensor"
    if isinstance(rows, torch.Tensor):
        if rows.dim() != 1 or rows.dtype == torch.bool or rows.is_floating_point() or rows.is_complex():
            raise KVQuantError(f"{where}: {name} must be {valid}, got {describe_value(rows)}")
        if rows.device.type == "meta":
            raise KVQuantError(f"{where}: {name} is a meta tensor, which holds no row numbers")
        rows = rows.tolist()
    elif isinstance(rows, (list, tuple, range)):
        bad = next((r for r in rows if not is_int(r)), rows)
        if bad is not rows:
            raise KVQuantError(f"{where}: {name} must be {valid}, got {describe_value(bad)} in {describe_value(rows)}")
        rows = [int(r) for r in rows]
    else:
        raise KVQuantError(f"{where}: {name} must be {valid}, got {describe_value(rows)}")
    if not rows:
        raise KVQuantError(f"{where}: {name} lists no rows; give at least one row number")
    bad = next((r for r in rows if r < 0 or (count is not None and r >= count)), None)
    if bad is not None:
        held = f"the cache holds rows 0-{count - 1}" if count else "rows are numbered from 0"
        raise KVQuantError(f"{where}: {name} names row {bad}; {held}")
    return rows


def fits(x: torch.Tensor, max_abs: float) -> bool:
    """Every element of ``x`` is finite and within ``±max_abs`` (one reduction; true for shapes-only tensors)."""
    if x.device.type == "meta" or not x.numel():  # shapes only (capacity planning): nothing to check
        return True
    amax = float(x.abs().amax())
    return math.isfinite(amax) and amax <= max_abs


def check_states(x: torch.Tensor, max_abs: float, name: str, max_abs_reason: str = (
        "its scales and zero points can hold (scale_dtype='float32' holds more)")) -> None:
    """Refuse states ``x`` that hold NaN/Inf or reach beyond ``±max_abs`` (``max_abs_reason``: what sets that
    bound, as the refusal says it)."""
    if fits(x, max_abs):
        return
    amax = float(x.abs().amax())
    if not torch.isfinite(x).all():
        raise NonFiniteKVError(
            f"{name} hold NaN or Inf; kvquant does not store non-finite states, since one of them would corrupt the "
            "scale of its whole group. Check the model's dtype (fp16 overflow) and inputs."
        )
    raise KVQuantError(f"{name} reach |x| = {amax:.4g}, beyond the ±{max_abs:.4g} {max_abs_reason}")
