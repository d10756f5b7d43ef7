"""A pass over a perplexity set's windows in groups, each group's result kept on its own: so a pass interrupted
after ``k`` groups resumes at group ``k`` and scores only the windows it had not finished.

A group is measured by one call of its own (:meth:`~kvquant.scoring.scorer.Scorer.score_many` of its windows), in
an uninterrupted pass as in a resumed one, so the rows batched together are the same either way and the assembled
result is bit-identical (a window's values move by float rounding with the rows batched beside it:
``docs/parallel.md``). What a pass keeps of a group is its ``keep`` callback's business
(:meth:`kvquant.scoring.session.Session`'s: a signed file per group, :meth:`kvquant.runner.store.ResultStore.windows`).
"""

from __future__ import annotations

from collections.abc import Callable

from tqdm import tqdm

from kvquant.cache.reads import Reads


#: ``keep(start, stop, windows, compute)``: the result of the group ``windows[start:stop]``, reused or ``compute()``
Keep = Callable[[int, int, list, Callable[[], object]], object]


def group_size(scorer, windows: list) -> int:
    """Windows per group of a pass of ``scorer``: the rows of one of its batches (``batch_size``, fewer where their
    logits would be too many: :meth:`~kvquant.scoring.scorer.Scorer.rows_per_batch`), so a group is one forward's
    rows and at most that many windows are measured again after an interruption."""
    return scorer.rows_per_batch(max((len(w.ids) - w.score_from for w in windows), default=1))


def keep_nothing(start: int, stop: int, windows: list, compute: Callable[[], object]) -> object:
    """The :data:`Keep` that keeps nothing: every group is computed."""
    return compute()


def in_groups(windows: list, size: int, compute: Callable[[list], object], keep: Keep | None = None,
              desc: str | None = None, shown: bool = True) -> list:
    """``compute(group)`` of each run of ``size`` consecutive ``windows`` (through ``keep``), in order; one
    progress bar over the windows (``desc``; ``shown``: this process shows it), which counts a reused group's
    windows as done."""
    keep = keep or keep_nothing
    parts = []
    with tqdm(total=len(windows), desc=desc, leave=False, disable=desc is None or not shown) as bar:
        for start in range(0, len(windows), size):
            group = windows[start : start + size]
            parts.append(keep(start, start + len(group), group, lambda group=group: compute(group)))
            bar.update(len(group))
    return parts


def tallies(scorer) -> tuple[dict[str, int], int]:
    """Where ``scorer``'s tallies stand now (what it read, how many lengths it scored), for :func:`tallies_since`."""
    return scorer.reads.to_dict(), len(scorer.lengths)


def tallies_since(scorer, since: tuple[dict[str, int], int]) -> dict:
    """What ``scorer`` read (``reads``) and the lengths it scored (``lengths``) since :func:`tallies` gave ``since``:
    one group's own, which :func:`join_groups` sums and concatenates."""
    before, count = since
    now = scorer.reads.to_dict()
    return {"reads": {k: now[k] - before[k] for k in now}, "lengths": scorer.lengths[count:]}


def join_groups(parts: list[dict], lists: tuple[str, ...]) -> dict:
    """Groups' results as one pass's: the per-window ``lists`` (and ``lengths``) concatenated in order, ``reads``
    summed."""
    reads = Reads()
    for part in parts:
        reads = reads.add(Reads(**part["reads"]))
    return {**{k: [x for part in parts for x in part[k]] for k in (*lists, "lengths")}, "reads": reads.to_dict()}
