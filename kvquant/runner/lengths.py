"""The longest context a candidate is shown safe at, from its verdicts per length (issue 40; ``docs/gate.md``):
:class:`LengthVerdict` and :func:`longest_passing`, pure functions over verdict strings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvquant.errors import is_python_int
from kvquant.runner.counts import TOO_FEW

PASS, FAIL, INCONCLUSIVE, NOT_EXERCISED = "pass", "fail", "inconclusive", "not exercised"


def _length(tokens: int) -> str:
    """A length as a report writes it: ``4K`` for a multiple of 1024, else the number."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


@dataclass(frozen=True)
class LengthVerdict:
    """One candidate's verdict over context lengths (:func:`longest_passing`): ``passes_up_to`` the longest
    length shown safe (None: none), ``fails_from`` the shortest failing length (None: none fails), and the lengths
    between the two that are undecided: ``inconclusive``, ``too_few`` (too few documents to decide:
    ``kvquant.runner.counts``) and ``not_exercised`` (each increasing); ``shortfall``: ``(documents, needed)`` of
    the too-few lengths (the fewest documents among them), for the text."""

    passes_up_to: int | None
    fails_from: int | None
    inconclusive: tuple[int, ...] = ()
    not_exercised: tuple[int, ...] = ()
    too_few: tuple[int, ...] = ()
    shortfall: tuple[int, int] | None = None

    def describe(self) -> str:
        """E.g. ``passes up to 4K, fails from 16K, inconclusive at 8K``; ``no length buckets`` for none."""
        if self == LengthVerdict(None, None):
            return "no length buckets"
        parts = [f"passes up to {_length(self.passes_up_to)}" if self.passes_up_to else "passes at no length"]
        parts += [f"fails from {_length(self.fails_from)}"] if self.fails_from else []
        for name, lengths in (("inconclusive", self.inconclusive), (TOO_FEW, self.too_few),
                              ("not exercised", self.not_exercised)):
            parts += [f"{name} at {', '.join(_length(n) for n in lengths)}"] if lengths else []
        if self.too_few and self.shortfall:
            parts[-2 if self.not_exercised else -1] += " (n = {} of the {} needed)".format(*self.shortfall)
        return ", ".join(parts)


def _bucket_status(length: int, verdicts: Mapping[str, str]) -> str:
    """A length bucket's status from its gated metrics' verdicts, with :func:`status`'s precedence."""
    unknown = sorted(set(verdicts.values()) - {PASS, FAIL, INCONCLUSIVE, TOO_FEW, NOT_EXERCISED})
    if unknown:
        raise ValueError(f"length bucket {length}: verdicts must be pass, fail, inconclusive, too few documents or "
                         f"not exercised, got {', '.join(map(repr, unknown))}")
    found = set(verdicts.values())
    return next((s for s in (FAIL, INCONCLUSIVE, TOO_FEW, NOT_EXERCISED) if s in found), PASS)


def longest_passing(buckets: Sequence[tuple[int, Mapping[str, str]]]) -> LengthVerdict:
    """The longest context one candidate is shown safe at, from its per-length-bucket verdicts.

    ``buckets``: ``(length, {gated long-context metric: verdict})`` ordered by length (strictly increasing
    positive integers), each with at least one metric (a bucket is judged on the metrics it has: needles may be
    measured at some lengths only); a verdict is :data:`PASS`,
    :data:`FAIL`, :data:`INCONCLUSIVE`, :data:`TOO_FEW` or :data:`NOT_EXERCISED`. Anything else is a ``ValueError``.

    The rule: a bucket **passes** only if every one of its metrics passes; it **fails** if any metric fails;
    else it is **inconclusive** if any metric is, else **too few documents** if any is, else **not exercised**
    (some metric read too little of the cache quantized). None of these is a pass: each stops the claim. Then:

    - ``passes_up_to`` = the longest length L such that every bucket up to L passes: the last of the passing
      buckets at the start (None if the first bucket does not pass). A shorter bucket that does not pass caps it,
      even where longer buckets pass again;
    - ``fails_from`` = the shortest failing bucket (None if none fails);
    - ``inconclusive`` / ``not_exercised`` / ``too_few`` = the lengths with that status after ``passes_up_to``
      and before ``fails_from`` (all after ``passes_up_to`` where nothing fails): what more documents could decide.

    No bucket gives ``LengthVerdict(None, None)``.
    """
    statuses = []
    for i, (length, verdicts) in enumerate(buckets):
        if not is_python_int(length) or length < 1:
            raise ValueError(f"length bucket {length!r} is not a positive integer")
        if i and length <= buckets[i - 1][0]:
            raise ValueError(f"length buckets out of order or repeated: {length} after {buckets[i - 1][0]}")
        if not verdicts:
            raise ValueError(f"length bucket {length} has no gated long-context metric")
        statuses.append((length, _bucket_status(length, verdicts)))
    passes_up_to = None
    for length, s in statuses:
        if s != PASS:
            break
        passes_up_to = length
    fails_from = next((length for length, s in statuses if s == FAIL), None)
    between = [(n, s) for n, s in statuses
               if (passes_up_to is None or n > passes_up_to) and (fails_from is None or n < fails_from)]
    return LengthVerdict(passes_up_to, fails_from, tuple(n for n, s in between if s == INCONCLUSIVE),
                         tuple(n for n, s in between if s == NOT_EXERCISED),
                         tuple(n for n, s in between if s == TOO_FEW))
