"""The long-context part of a config (issue 40): ``eval.long_context`` (divergence by position on long documents),
the needle tasks among ``eval.tasks.names`` (``needle_<kind>_<length>``) and ``gate.min_context`` (the context every
long-context metric must be shown to pass up to). Checked when the config is read; what needs the model (lengths
beyond its context) and its tokenizer (a needle longer than its haystack) by preflight, before the model loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvquant.errors import KVQuantError, is_python_int
from kvquant.experiment.binding import require
from kvquant.experiment.metric import divergence_limits

MAX_LONG_DOCUMENTS = 10_000
#: The needle tasks' kinds (:mod:`kvquant.scoring.needles` writes their documents).
KINDS = ("single", "multikey", "variables")
#: A needle task's name: ``needle_<kind>_<length>`` (a length without leading zeros), e.g. ``needle_single_4096``.
TASK = re.compile(r"needle_([a-z]+)_([0-9]+)")


@dataclass(frozen=True)
class LongContextConfig:
    """``documents`` windows of ``lengths[-1]`` tokens cut from perplexity set ``text``'s rows (joined as its stream
    layout, whatever its own layout), fed through the baseline's and every candidate's cache ``eval.chunk_size``
    tokens at a time; each candidate's KL divergence from the baseline and top-1 agreement with it are kept per
    position and judged per position bucket: bucket ``i`` holds positions ``lengths[i-1]..lengths[i] - 1`` (the
    first from 0), named after its end."""

    text: str
    lengths: list[int]
    documents: int = 4

    def __post_init__(self):
        require(bool(self.lengths), "lengths: at least one bucket end is needed, e.g. [1024, 2048, 4096]")
        for i, length in enumerate(self.lengths):
            require(is_python_int(length) and length >= 2, f"lengths[{i}] must be an integer >= 2 (tokens), got "
                    f"{length!r}")
            require(i == 0 or length > self.lengths[i - 1], f"lengths must increase (position buckets in order, "
                    f"none repeated): {length} after {self.lengths[i - 1]}")
        require(2 <= self.documents <= MAX_LONG_DOCUMENTS,
                f"documents must be in 2..{MAX_LONG_DOCUMENTS} (the intervals are over documents; one shows no "
                f"spread), got {self.documents!r}")


def needle_task(name: str) -> tuple[str, int] | None:
    """``(kind, length)`` of a needle task name, None for any other name; a name of the form with an unknown kind,
    a zero length or a length with leading zeros is refused with one line."""
    match = TASK.fullmatch(name)
    if match is None:
        return None
    kind, length = match.group(1), int(match.group(2))
    if kind not in KINDS:
        raise KVQuantError(f"{name!r}: needle kind {kind!r} is unknown (kinds: {', '.join(KINDS)})")
    if length < 1 or name != f"needle_{kind}_{length}":
        raise KVQuantError(f"{name!r}: write needle_{kind}_<length> with a positive length of tokens, without "
                           "leading zeros (one spelling per task, so none is measured and gated twice)")
    return kind, length


def needle_lengths(task_names: list[str]) -> dict[str, int]:
    """``{needle task: its length}`` among ``task_names``."""
    return {name: found[1] for name in task_names if (found := needle_task(name)) is not None}


def check_long_context(cfg) -> None:
    """The long-context parts of an :class:`~kvquant.experiment.config.ExperimentConfig` agree: the long text is a
    perplexity set, and ``gate.min_context`` has a long-context metric to judge (divergence buckets with a KL or
    top-1 threshold, or a gated needle task) at a length it names."""
    long, gate = cfg.eval.long_context, cfg.gate
    try:
        needles = needle_lengths(cfg.gated_tasks())
    except KVQuantError as err:
        raise type(err)(f"eval.tasks.names: {err}") from None
    if long is not None:
        names = [p.name for p in cfg.eval.perplexity]
        require(long.text in names, f"eval.long_context.text: {long.text!r} is not among eval.perplexity "
                f"({', '.join(names) or 'none'}); name the perplexity set whose text the long documents are cut from")
    if gate.min_context is None:
        return
    bucketed = long is not None and bool(divergence_limits(gate, bucketed=True))
    require(bucketed or bool(needles), "gate.min_context: no long-context metric to judge: set eval.long_context "
            "with gate.max_kl_divergence (or gate.min_top1_agreement), or gate a needle task "
            "(eval.tasks.names: needle_<kind>_<length>)")
    if bucketed:  # a needle's length is a bucket's end, so "passes up to L" covers the positions before L
        off = sorted({f"{name} ({length})" for name, length in needles.items() if length not in long.lengths})
        ends = ", ".join(map(str, long.lengths))
        require(not off, f"gate.min_context: the needle tasks {', '.join(off)} end inside a position bucket; with "
                f"eval.long_context gated, give needles the lengths of bucket ends ({ends}) or add their lengths to "
                "eval.long_context.lengths")
    lengths = sorted({*(long.lengths if bucketed else ()), *needles.values()})
    require(gate.min_context in lengths, f"gate.min_context {gate.min_context} is no length measured here; the "
            f"long-context metrics are judged at {', '.join(map(str, lengths))} tokens")
