"""Which positions of each batch row are padding (never stored), declared by :meth:`KVQuantCache.set_padding`."""

from __future__ import annotations

import torch

from kvquant.errors import KVQuantError


class Padding:
    """Which positions of each batch row hold real tokens; the rest is padding, which a cache never stores.

    ``mask`` ``[B, T]`` bool covers the positions declared so far (:meth:`KVQuantCache.set_padding`); positions
    beyond it are real. One object is shared by all layers of a cache.
    """

    #: Ranges whose spans and real positions are kept worked out (every layer of a forward asks the same one or two:
    #: full and sliding layers); older ones are dropped, so a long decode does not keep one per step.
    KEPT = 4

    def __init__(self):
        self.mask: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor | None:
        return self._mask

    @mask.setter
    def mask(self, value: torch.Tensor | None) -> None:
        self._mask = value
        self._spans: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}  # every layer asks the same
        self._reals: dict[tuple[int, int, int], torch.Tensor] = {}

    def spans(self, start: int, stop: int, batch: int) -> list[tuple[int, int, int]]:
        """Per row ``(count, first, last)``: real tokens among positions ``[start, stop)``, and the bounds (from
        ``start``) of the block they span; ``count == last - first`` when they are one block (padding only in
        front or behind). Worked out once per mask and range, since all layers of a forward ask the same."""
        key = (start, stop, batch)
        if self.mask is None or stop <= start:
            return [(max(stop - start, 0), 0, max(stop - start, 0))] * batch
        if key not in self._spans:
            real = self.real(start, stop, batch)
            counts = real.sum(1).tolist()
            ends = torch.where(real.any(1), real.int().argmax(1), 0).tolist()  # first real position
            lasts = torch.where(real.any(1), real.shape[1] - real.flip(1).int().argmax(1), 0).tolist()
            if len(self._spans) >= self.KEPT:
                del self._spans[next(iter(self._spans))]
            self._spans[key] = list(zip(counts, ends, lasts))
        return self._spans[key]

    def declare(self, attention_mask: torch.Tensor, written: int, rows: int | None) -> None:
        """Take the mask of ``rows`` rows (None: not yet known); it must cover the ``written`` positions and agree
        with what was declared for them."""
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise KVQuantError(f"set_padding needs the [batch, tokens] attention mask, got {shape}")
        if attention_mask.is_complex():
            raise KVQuantError(f"set_padding: attention_mask is {attention_mask.dtype}; it must hold 0 (padding) and 1 "
                               "(a real token), as bool, integers or floats")
        if not attention_mask.shape[0]:
            raise KVQuantError(f"set_padding: attention_mask has 0 rows {tuple(attention_mask.shape)}; it needs one "
                               "row per batch row")
        if attention_mask.device.type == "meta":
            raise KVQuantError("set_padding: attention_mask is a meta tensor, which holds no mask values")
        values = attention_mask.detach().to("cpu")
        if values.dtype != torch.bool:
            odd = values[(values != 0) & (values != 1)]
            if len(odd):
                raise KVQuantError(f"set_padding: attention_mask holds {odd[0].item()!r}; it must hold only 0 "
                                   "(padding) and 1 (a real token), not an additive mask (0 / -inf)")
        mask = values.bool()
        rows = rows if rows is not None else (self.mask.shape[0] if self.mask is not None else None)
        if rows is not None and mask.shape[0] != rows:
            raise KVQuantError(f"set_padding: the mask has {mask.shape[0]} rows, the cache {rows}")
        if mask.shape[1] < written:
            raise KVQuantError(f"set_padding: the mask covers {mask.shape[1]} positions, the cache has written "
                               f"{written}; pass the whole attention mask (past and new positions)")
        if not torch.equal(mask[:, :written], self.real(0, written, mask.shape[0])):
            raise KVQuantError("set_padding: the mask disagrees with positions this cache has already stored")
        self.mask = mask

    def real(self, start: int, stop: int, batch: int) -> torch.Tensor:
        """``[batch, stop - start]`` bool: which of these positions are real tokens. A mask of B rows read for
        ``k * B`` rows is first expanded as ``generate`` expands its inputs for beams or several returned
        sequences (each row repeated ``k`` times)."""
        if self.mask is not None and self.mask.shape[0] != batch:
            if batch % self.mask.shape[0]:
                raise KVQuantError(f"set_padding described {self.mask.shape[0]} rows, the model wrote {batch}")
            self.mask = self.mask.repeat_interleave(batch // self.mask.shape[0], dim=0)
        key = (start, stop, batch)
        if key in self._reals:  # every layer of a forward asks the same (callers only read it)
            return self._reals[key]
        out = torch.ones(batch, stop - start, dtype=torch.bool)
        if self.mask is not None and start < self.mask.shape[1]:
            declared = self.mask[:, start:stop]
            out[:, : declared.shape[1]] = declared
        if len(self._reals) >= self.KEPT:  # the oldest range goes: a decode step asks a new one every time
            del self._reals[next(iter(self._reals))]
        self._reals[key] = out
        return out

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this object holds (the mask and the ranges it keeps worked out), for memory accounting."""
        return [*([self.mask] if self.mask is not None else []), *self._reals.values()]

    def count(self, start: int, stop: int, batch: int) -> list[int]:
        """Per row: real tokens among positions ``[start, stop)`` (no tensor work when nothing is declared)."""
        return [count for count, _, _ in self.spans(start, stop, batch)]

    def select(self, rows: list[int]) -> None:
        if self.mask is not None:
            self.mask = self.mask[rows]
