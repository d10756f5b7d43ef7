"""What a run could have written as a partial result, checked before ``python -m kvquant.adopt`` signs one: the
fields its kind of result holds, shaped as its inputs say (one value per window, per document or per position)
and in their domain (an accuracy is 0 or 1, a token count is the window's, a log-likelihood or a time is finite).

A run writes these results in :mod:`kvquant.scoring.session` (``_perplexity``, ``_divergence``, ``_long``,
``_task``, ``_memory``); :class:`Shape` is what :class:`~kvquant.runner.expected.Expected` knows of a result's
inputs without the model. Adopting still vouches for the values themselves (docs/trust.md, "Results that travel"):
a plausible number edited by hand is not caught here, a number no run writes is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvquant.experiment.metric import ACCURACY

#: the largest integer a result holds (bytes, counts): beyond it a number is no count a run made
MAX_INT = 2**53
#: the longest time one result takes, in seconds (a year)
MAX_SECONDS = 365 * 24 * 3600.0
#: a KL divergence a float32 sum may leave below zero by rounding
KL_ROUNDING = -1e-4


@dataclass(frozen=True)
class Shape:
    """What a result's inputs say of its shape: ``tokens``, the scored tokens of each window read (perplexity and
    divergence results), or of each long document (their lengths); ``documents``, the documents of a task result
    (``exact``: the look's range; else at most that many, the task's limit)."""

    tokens: tuple[int, ...] | None = None
    documents: int | None = None
    exact: bool = False


def problem(kind: str, result: dict, shape: Shape | None, seconds) -> str | None:
    """Why ``result`` (with its ``seconds``) is no result of ``kind`` (``ppl``, ``kl``, ``long``, ``task``,
    ``memory``, or another kind: numbers checked only) a run could have written for ``shape``; None: it could."""
    found = _numbers(result, "result") or _seconds(seconds) or _reads(result)
    if found or kind == "memory":
        return found or _memory(result)
    check = {"ppl": _perplexity, "kl": _divergence, "long": _long, "task": _task}.get(kind)
    return check(result, shape) if check and shape is not None else None


#: what a result's ``reads`` holds (:class:`kvquant.cache.reads.Reads`): counts of the keys and values attention read
READS = ("keys_quantized", "keys", "values_quantized", "values")


def _reads(result: dict) -> str | None:
    """Why a result's ``reads`` (where it has them) and ``lengths`` are no counts a run wrote, else None."""
    reads, lengths = result.get("reads"), result.get("lengths")
    if reads is not None:
        if not (isinstance(reads, dict) and set(reads) == set(READS)
                and all(isinstance(reads[k], int) and not isinstance(reads[k], bool) and reads[k] >= 0 for k in READS)
                and reads["keys_quantized"] <= reads["keys"] and reads["values_quantized"] <= reads["values"]):
            return f"its 'reads' are not the four counts a run writes ({', '.join(READS)}; quantized <= read)"
    if lengths is not None and not (isinstance(lengths, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in lengths)):
        return "its 'lengths' are not request lengths (positive numbers of tokens)"
    return None


#: what a memory result must hold (what the report reads of it): each a number >= 0
MEMORY = ("total_bytes", "ratio", "bits_per_element", "tokens")


def _memory(result: dict) -> str | None:
    missing = [k for k in MEMORY if not (_is_number(result.get(k)) and result[k] >= 0)]
    return f"its memory result holds no {', '.join(missing)} (numbers >= 0)" if missing else None


def _numbers(value, where: str, depth: int = 0) -> str | None:
    """The first number under ``value`` that is not finite, or an integer past :data:`MAX_INT`."""
    if depth > 64:
        return f"{where} nests deeper than any result"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    if isinstance(value, int):
        return None if abs(value) <= MAX_INT else f"{where} holds an integer of {len(str(abs(value)))} digits"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where} holds {value}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return next((p for k, v in items if (p := _numbers(v, f"{where}.{k}", depth + 1))), None)


def _seconds(seconds) -> str | None:
    if seconds is None:
        return None
    ok = isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds <= MAX_SECONDS
    return None if ok else f"its seconds are {str(seconds)[:40]}, not a time one result takes (0 to a year)"


def _list(result: dict, name: str, length: int | None) -> tuple[list | None, str | None]:
    value = result.get(name)
    if not isinstance(value, list):
        return None, f"it holds no list {name!r}"
    if length is not None and len(value) != length:
        return None, f"its {name!r} has {len(value)} values where its inputs read {length}"
    return value, None


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _perplexity(result: dict, shape: Shape) -> str | None:
    windows = len(shape.tokens)
    nll, why = _list(result, "nll", windows)
    tokens, why = (None, why) if why else _list(result, "tokens", windows)
    if why:
        return why
    if list(tokens) != list(shape.tokens):
        return (f"its token counts {str(tokens)[:60]} are not those of the windows it read "
                f"{str(list(shape.tokens))[:60]}")
    if not all(_is_number(x) and x >= 0 for x in nll):
        return "its 'nll' holds a value that is no negative log-likelihood (a number >= 0)"
    return None


def _divergence(result: dict, shape: Shape) -> str | None:
    why = _perplexity({"nll": result.get("nll", [0.0] * len(shape.tokens)), "tokens": result.get("tokens")}, shape)
    kl, why = (None, why) if why else _list(result, "kl", len(shape.tokens))
    top1, why = (None, why) if why else _list(result, "top1", len(shape.tokens))
    if why:
        return why
    for i, (window, agree, n) in enumerate(zip(kl, top1, shape.tokens)):
        if not isinstance(window, list) or len(window) != n:
            return f"its 'kl' of window {i} is not one value per scored token ({n})"
        if not all(_is_number(x) and x >= KL_ROUNDING for x in window):
            return f"its 'kl' of window {i} holds a value that is no KL divergence (a number >= 0)"
        if not (_is_number(agree) and float(agree).is_integer() and 0 <= agree <= n):
            return f"its 'top1' of window {i} is {str(agree)[:20]}, not a count of 0 to {n} positions"
    return None


def _long(result: dict, shape: Shape) -> str | None:
    kl, why = _list(result, "kl", len(shape.tokens))
    top1, why = (None, why) if why else _list(result, "top1", len(shape.tokens))
    if why:
        return why
    for i, (doc, agree, n) in enumerate(zip(kl, top1, shape.tokens)):
        if not (isinstance(doc, list) and isinstance(agree, list) and len(doc) == len(agree) and 0 < len(doc) <= n):
            return f"its long document {i} has no 'kl' and 'top1' of one value per position (at most {n})"
        if not all(_is_number(x) and x >= KL_ROUNDING for x in doc) or not all(x in (0, 1) for x in agree):
            return f"its long document {i} holds a KL below 0 or a top-1 agreement other than 0 or 1"
    return None


def _task(result: dict, shape: Shape) -> str | None:
    found = [m for m in ACCURACY.measures if m in result]
    if not found:
        return "it holds neither 'acc' nor 'acc_norm'"
    for measure in found:
        scores, why = _list(result, measure, shape.documents if shape.exact else None)
        if why:
            return why
        if not shape.exact and not 0 < len(scores) <= (shape.documents or len(scores)):
            return f"its {measure!r} has {len(scores)} documents where its inputs allow 1 to {shape.documents}"
        if not all(_is_number(x) and x in (0, 1) for x in scores):
            return f"its {measure!r} holds a document's score other than 0 or 1 (right or wrong)"
    lengths = [len(result[m]) for m in found]
    return None if len(set(lengths)) == 1 else f"its {' and '.join(found)} count other documents ({lengths})"
