"""Cache quantizers, found by name in a registry: the codec and quantizer base classes, the rotation around any
codec, and the registry (kvquant's own formats are in :mod:`kvquant.formats.research`, the serving engines' in
:mod:`kvquant.formats.vllm` and :mod:`kvquant.formats.sglang`, llama.cpp's in :mod:`kvquant.formats.llamacpp`).

A *quantizer* is a small frozen dataclass whose fields are its options (``Int4(group_size=32)``). For a
given head dimension it builds two *codecs*, one for the key stream and one for the value stream. A codec
turns a block of states ``[B, H, T, D]`` into a dict of stored tensors whose dim 2 counts *units*
(``tokens_per_unit`` tokens each) and writes the dequantized block back into a preallocated view.
Appending units never touches those already stored.

Adding a quantizer is one class (its codecs in ``_codecs``) plus ``@register_quantizer("name")``; every
quantizer takes ``rotation="hadamard"`` (:class:`RotatedCodec` around its codecs) without code of its own. A codec
around another (:class:`WrappingCodec`) forwards what it does not change to it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from collections.abc import Callable, Mapping
from typing import ClassVar

import torch

from kvquant.formats import ops
from kvquant.formats.roles import StorageRole
from kvquant.errors import KVQuantError, check_int, is_python_int
from kvquant.registry import Registry

Encoded = dict[str, torch.Tensor]
ROTATIONS = ("hadamard",)
MAX_ROTATION_SEED = 2**63 - 1  # what torch.Generator.manual_seed takes (an experiment seed is numpy's: config.MAX_SEED)
#: The most tokens any size option of a cache may name (sinks, residual window, a group of tokens, an eviction window
#: or budget): 2**24, beyond any model's context today. Sinks are also bounded by the model's context.
MAX_TOKENS = 1 << 24
#: Largest finite float32: engine formats and rotations compute in float32 at least.
F32_MAX = torch.finfo(torch.float32).max
#: make_cache's options of which tokens a cache keeps at full precision or drops: the residual window, the sinks and
#: an eviction policy with its window and budget (kvquant's own: no serving engine has them)
TOKEN_OPTIONS = ("residual_length", "sink_tokens", "window", "budget", "eviction")
#: make_cache's own options (the others are the quantizer's; :class:`kvquant.cache.CacheSpec` sorts them out): the
#: token options, per-layer overrides and pre-RoPE keys (:mod:`kvquant.cache.prerope`, for the whole cache),
#: alphabetical. Here, below the cache, so a quantizer that holds other quantizers can refuse them inside.
CACHE_OPTIONS = tuple(sorted((*TOKEN_OPTIONS, "layers", "pre_rope")))


def check_tokens(name: str, value, minimum: int = 0) -> int:
    """``value`` when it is a Python integer in ``[minimum, MAX_TOKENS]`` (a size option counted in tokens); else one
    :class:`KVQuantError` line naming ``name``, the range and the value."""
    if is_python_int(value):
        if minimum <= value <= MAX_TOKENS:
            return value
        if value > MAX_TOKENS or value.bit_length() > 190:
            raise KVQuantError(f"{name} must be an integer in {minimum}-{MAX_TOKENS} (tokens; kvquant's maximum for a "
                               f"size option), got {type(value).__name__} {short_repr(value)}")
    return check_int(name, value, minimum)  # not an integer, or below the minimum


def short_repr(value) -> str:
    """``repr(value)`` on one short line: a very long one cut, an integer too long to print (Python refuses more
    than 4,300 digits) by its size."""
    if isinstance(value, int) and value.bit_length() > 190:
        return f"of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    try:
        text = re.sub(r"\s+", " ", repr(value))
    except ValueError:  # an integer too long to print inside a list
        return f"{type(value).__name__} too long to print"
    return text if len(text) <= 60 else text[:57] + "..."


class Codec:
    """Stores one stream (keys or values) of one layer. Shapes: states ``[B, H, T, D]``."""

    #: Tokens covered by one stored unit; ``encode`` only receives whole units.
    tokens_per_unit: int = 1
    #: Largest |state| the stored form can hold; larger values raise instead of overflowing.
    max_abs: float = float("inf")
    #: What sets ``max_abs``, as a refusal says it ("keys reach |x| = 1e+06, beyond the ±65504 <max_abs_reason>").
    max_abs_reason: str = "its scales and zero points can hold (scale_dtype='float32' holds more)"
    #: head_dim must be a multiple of this, and why (codes packed several per byte, channels in blocks).
    channel_multiple: tuple[int, str] = (1, "")
    #: The storage role of every tensor :meth:`encode` may return (its key -> :class:`StorageRole`): which
    #: ``memory_report()`` category its bytes go to. A key not declared here is refused at the first write.
    roles: ClassVar[Mapping[str, StorageRole]] = {}

    def check(self, x: torch.Tensor, name: str) -> None:
        """Raise, before anything is stored, for states ``x`` within ``max_abs`` that still cannot be encoded
        (``name``: keys or values). Most codecs: nothing more to check."""

    def check_heads(self, heads: int, name: str) -> None:
        """Raise if this codec cannot store a layer of ``heads`` KV heads (``name``: keys or values), e.g. per-head
        scales of another count; checked by make_cache where the model's heads are known. Most codecs: any count."""

    def checked_above(self, head_dim: int, dtype: torch.dtype) -> float:
        """States ``[..., head_dim]`` of ``dtype`` within ``±`` this pass :meth:`check` without being looked at (a
        rotation around this codec rotates only states beyond it to check them)."""
        return float("inf")

    def encode(self, x: torch.Tensor) -> Encoded:  # pragma: no cover - interface
        raise NotImplementedError

    def decode_into(self, enc: Encoded, out: torch.Tensor) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def decode_slots_into(self, pool: Encoded, table: torch.Tensor, out: torch.Tensor) -> None:
        """Decode units held in a pool of slots (``pool[role]`` ``[N, H, *u]``: what :meth:`encode` returns per
        unit, the unit dimension removed) through ``table`` ``[B, U]`` (slot numbers; -1 reads slot 0) into ``out``
        ``[B, H, U * tokens_per_unit, D]``: the units gathered, then :meth:`decode_into`."""
        batch, width = table.shape
        index = table.clamp(min=0).flatten()
        enc = {}
        for role, p in pool.items():
            picked = p.index_select(0, index.to(p.device))
            enc[role] = picked.view(batch, width, *p.shape[1:]).transpose(1, 2).contiguous()
        self.decode_into(enc, out)


def _inner_attribute(name: str) -> property:
    """A read-only attribute that is ``self.inner``'s of the same name."""
    return property(lambda self: getattr(self.inner, name), doc=f"``inner.{name}``.")


@dataclass(frozen=True, eq=False)
class WrappingCodec(Codec):
    """A codec around another, ``inner``, that stores what ``inner`` stores: its units, storage roles, bound and what
    sets it (``max_abs_reason``), and channel multiple are ``inner``'s unless a subclass says otherwise.
    ``eq=False``: equality and hashing are each subclass's own dataclass choice (identity here)."""

    inner: Codec
    tokens_per_unit = _inner_attribute("tokens_per_unit")
    roles = _inner_attribute("roles")
    max_abs = _inner_attribute("max_abs")
    max_abs_reason = _inner_attribute("max_abs_reason")
    channel_multiple = _inner_attribute("channel_multiple")


@dataclass(frozen=True, eq=False)
class RotatedCodec(WrappingCodec):
    """Another codec applied to the states rotated along head_dim (``x @ R``, R orthonormal: see
    :func:`kvquant.formats.ops.hadamard_rotation`); reads rotate back (``y @ R.T``). Same stored tensors and bytes as
    the
    inner codec. Shapes as :class:`Codec`; ``matrix`` ``[D, D]``."""

    matrix: torch.Tensor
    #: :class:`Codec`'s, not forwarded to ``inner``: :meth:`Quantizer.codecs` checks the inner codecs' channel
    #: multiple before rotating
    channel_multiple = Codec.channel_multiple

    @property
    def max_abs_reason(self) -> str:
        """What sets :attr:`max_abs`, as a refusal says it: the inner codec's bound (in its own words: a codebook's
        per-vector scales, an integer codec's scales and zero points) times ``sqrt(block)``: a rotation spreads a
        value over at most ``block`` channels, so states beyond it cannot fit once rotated."""
        block = round(float(self.matrix.abs().max()) ** -2)
        inner = self.inner.max_abs_reason.split(" (")[0].replace("its ", "their ", 1)
        return f"{inner} times sqrt({block}) (a rotation spreads a value over at most {block} channels)"

    @property
    def max_abs(self) -> float:
        """States beyond this cannot fit once rotated (a rotated block keeps its norm, so its largest |y| is at
        least |x| / sqrt(block)); states below it are checked after the rotation, in :meth:`encode`."""
        return self.inner.max_abs / float(self.matrix.abs().max())  # max entry = 1 / sqrt(block)

    def check(self, x, name):
        """States within ``limit / sqrt(block)`` fit once rotated (``|y| <= sqrt(block) max|x|``), and pass the inner
        codec's own check unexamined within its bound over ``sqrt(block)``; the others are rotated to see. The limit:
        what the inner codec holds, the states' own dtype's range (the rotation is computed in it), or what rotates
        back within float32, the smallest."""
        if x.device.type == "meta" or not x.numel():
            return
        amax, shrink = float(x.abs().amax()), float(self.matrix.abs().max())  # max entry = 1 / sqrt(block)
        if amax > min(self._limit(x.dtype)[0], self.inner.checked_above(x.shape[-1], x.dtype)) * shrink:
            y = ops.rotate(x, self.matrix)
            self._check_rotated(y, name)
            self.inner.check(y, name)

    def _limit(self, dtype: torch.dtype) -> tuple[float, str]:
        """The largest |y| rotated states may reach, and what sets it (as a refusal says it)."""
        back = F32_MAX * float(self.matrix.abs().max()) / 2  # |y @ R.T| <= sqrt(block) max|y|, with room to round up
        return min((self.inner.max_abs, self.inner.max_abs_reason.replace("its ", "their ", 1)),
                   (torch.finfo(dtype).max, f"of the states' dtype {dtype}"),
                   (back, "that rotate back within float32"), key=lambda pair: pair[0])

    def _check_rotated(self, y, name):
        if y.device.type == "meta" or not y.numel():
            return
        amax, (limit, reason) = float(y.abs().amax()), self._limit(y.dtype)
        if not amax <= limit:  # inf too: the rotation overflowed the states' dtype
            raise KVQuantError(f"rotated {name} reach |y| = {amax:.4g}, beyond the ±{limit:.4g} {reason}")

    def encode(self, x):
        y = ops.rotate(x, self.matrix)
        self._check_rotated(y, "states")
        return self.inner.encode(y)

    def decode_into(self, enc, out):
        """Dequantized in fp32 at least, rotated back, then rounded once to ``out``'s dtype."""
        if out.dtype in (torch.float16, torch.bfloat16):
            work = torch.empty(out.shape, dtype=torch.float32, device=out.device)
            self.inner.decode_into(enc, work)
            ops.store_clamped(out, ops.rotate(work, self.matrix.T))
        else:
            self.inner.decode_into(enc, out)
            out.copy_(ops.rotate(out, self.matrix.T))


# --------------------------------------------------------------------------------------------------
# Registry


def _check_class(name: str, cls: type) -> None:
    if "codecs" in cls.__dict__:  # Quantizer.codecs adds the rotation around _codecs
        raise KVQuantError(f"quantizer {name!r}: define _codecs(head_dim), not codecs")


QUANTIZERS = Registry("quantizer", _check_class)
#: Class decorator: make a :class:`Quantizer` subclass available under a name.
register_quantizer = QUANTIZERS.register
#: Names accepted by :func:`get_quantizer` and ``make_cache(quantizer=...)``.
available_quantizers = QUANTIZERS.names
#: The options of a quantizer with their defaults.
quantizer_options = QUANTIZERS.options
#: Build a quantizer by name with options; an option it does not have is an error naming the valid ones.
get_quantizer = QUANTIZERS.build


@dataclass(frozen=True)
class Serving:
    """How a serving engine runs a format exactly: what ``python -m kvquant.export`` writes in ``DEPLOY.md`` for it
    (:mod:`kvquant.integrations.deploy`), declared by the format's class (:attr:`Quantizer.serving`)."""

    #: the engine (``"vLLM"``, ``"SGLang"``)
    engine: str
    #: its ``--kv-cache-dtype`` value
    flag: str
    #: what else the engine needs to run it (a backend, a GPU, checkpoint scales)
    needs: str
    #: the format's per-layer static ``k_scale``/``v_scale`` ship as checkpoint tensors (compressed-tensors names)
    layer_scales: bool = False
    #: why static scales other than 1.0 are not exported (with :attr:`layer_scales`: one scale for all layers);
    #: None: the format takes no static scales
    unshipped_scales: str | None = None
    #: layers the engine keeps at model precision on its own at each end of a model of at least twice as many
    boundary_layers: int = 0

    @property
    def takes_scales(self) -> bool:
        """Whether the format takes static ``k_scale``/``v_scale`` at all."""
        return self.layer_scales or self.unshipped_scales is not None


@dataclass(frozen=True)
class Quantizer:
    """Options of one cache quantizer; builds the key and value codecs for a head dimension."""

    name: ClassVar[str]
    #: Most recent tokens kept in full precision unless ``make_cache(residual_length=...)`` says otherwise.
    default_residual_length: ClassVar[int] = 0
    #: How a serving engine runs this exact format (:class:`Serving`); None: a research format no engine runs
    #: (:mod:`kvquant.integrations.deploy`). Only the class that declares it: a subclass may store something else.
    serving: ClassVar[Serving | None] = None
    #: ``"hadamard"``: quantize K and V rotated along head_dim by a seeded random-sign (block) Hadamard matrix
    #: and rotate back on read (QuaRot-style; spreads outlier channels over the block). None: no rotation.
    rotation: str | None = dataclasses.field(default=None, kw_only=True)
    rotation_seed: int = dataclasses.field(default=0, kw_only=True)

    def __post_init__(self):
        self._check_rotation()

    def _check_rotation(self) -> None:
        if self.rotation is not None:
            check_choice(self.name, "rotation", self.rotation, ROTATIONS)
        check_int_option(self.name, "rotation_seed", self.rotation_seed, minimum=0, maximum=MAX_ROTATION_SEED)

    def _scale_dtype(self) -> torch.dtype:
        if not isinstance(self.scale_dtype, str) or self.scale_dtype not in ops.SCALE_DTYPES:
            raise KVQuantError(f"{self.name}: scale_dtype must be one of {sorted(ops.SCALE_DTYPES)}, "
                               f"got {self.scale_dtype!r}")
        return ops.SCALE_DTYPES[self.scale_dtype]

    def codecs(self, head_dim: int) -> tuple[Codec, Codec]:
        """The key and value codecs at ``head_dim``, rotated where ``rotation`` asks for it."""
        self._check_rotation()  # also where a subclass's __post_init__ forgot to
        key, value = self._codecs(head_dim)
        for codec in (key, value):
            multiple, why = codec.channel_multiple
            if head_dim % multiple:
                raise KVQuantError(f"{self.name}: head_dim {head_dim} is not a multiple of {multiple} ({why})")
        if self.rotation is None:
            return key, value
        matrix = ops.hadamard_rotation(head_dim, self.rotation_seed)
        return RotatedCodec(key, matrix), RotatedCodec(value, matrix)

    def _codecs(self, head_dim: int) -> tuple[Codec, Codec]:  # pragma: no cover - interface
        raise NotImplementedError

    def for_model(self, model_or_config) -> Quantizer:
        """This quantizer as it runs on ``model_or_config`` (a transformers model or config): the options it takes
        from the model where they were not given, which ``make_cache(model, ...)`` applies to every quantizer of a
        setting (llama.cpp's K channel order: :meth:`kvquant.formats.llamacpp.LlamaCppQuantizer.for_model`). Most
        quantizers take nothing from the model: itself."""
        return self

    def describe(self) -> dict[str, object]:
        """Name and options, enough to rebuild it with :func:`get_quantizer`."""
        return {"quantizer": self.name, **dataclasses.asdict(self)}

    def derived_settings(self, head_dim: int) -> dict[str, object]:
        """Settings this quantizer derives for a head dimension (e.g. the groups actually used)."""
        return {"rotation_block": head_dim & -head_dim} if self.rotation else {}

    @classmethod
    def kernel_layout(cls, settings: Mapping[str, object]) -> str | None:
        """What a kernel would store to run this format as a report measured it, in words, from the report's
        recorded ``settings`` (options and :meth:`derived_settings`): said where no engine runs it
        (:mod:`kvquant.integrations.deploy`). None where the class does not say it."""
        return None


@dataclass(frozen=True)
class Alike(Quantizer):
    """A format of no options that stores keys and values alike, each with ``codec()``."""

    codec: ClassVar[Callable[[], Codec]]

    def _codecs(self, head_dim):
        codec = type(self).codec  # from the class: on an instance a functools.partial binds it (Python >= 3.14)
        return codec(), codec()


def check_int_option(owner: str, field: str, value, allowed=None, minimum: int | None = None,
                     maximum: int | None = None) -> None:
    """One-line errors for an option that must be an integer (never a bool or a float)."""
    check_int(f"{owner}: {field}", value, minimum, maximum)
    if allowed is not None and value not in allowed:
        choices = f"{', '.join(map(str, allowed[:-1]))} or {allowed[-1]}"
        raise KVQuantError(f"{owner}: {field} must be {choices}, got {value!r}")


def check_choice(owner: str, field: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise KVQuantError(f"{owner}: {field} must be one of {', '.join(map(repr, choices))}, got {value!r}")
