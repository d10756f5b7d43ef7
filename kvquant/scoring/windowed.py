"""A pass over a perplexity set's windows in groups, each group's result kept on its own: so a pass interrupted
after ``k`` groups resumes at group ``k`` and scores only the windows it had not finished.

A group is one batch of rows of :meth:`~kvquant.scoring.scorer.Scorer.score_many` of all the windows
(:func:`pass_groups`: longest first, as that call sorts them), measured by one call of its own, in an uninterrupted pass
as in a resumed one; each window's values go back to its own place. So the rows batched together are the same
either way, and the same as in one call of all the windows, and the assembled result is bit-identical to both (a
window's values move by float rounding with the rows batched beside it: ``docs/parallel.md``), where the scorer
prefills no context apart from its rows (simulated mode, or one-token contexts as the ``documents`` layout's).
What a pass keeps of a group is its ``keep`` callback's business (:meth:`kvquant.scoring.session.Session`'s: a
signed file per group, :meth:`kvquant.runner.store.ResultStore.window_groups`).
"""

from __future__ import annotations

from collections.abc import Callable

from tqdm import tqdm

from kvquant.cache.reads import Reads
from kvquant.scoring.data import Window


#: ``keep(start, stop, group, compute)``: the result of the group of windows ``group``, which holds the places
#: ``start`` to ``stop`` of the pass's order (:func:`pass_groups`, group after group), reused or ``compute()``
Keep = Callable[[int, int, list, Callable[[], object]], object]


def requests(windows: list[Window]) -> list[tuple[list[int], list[int]]]:
    """Each window as a request of :meth:`~kvquant.scoring.scorer.Scorer.score_many`: (context, scored tokens)."""
    return [(w.ids[: w.score_from], w.ids[w.score_from :]) for w in windows]


def pass_groups(scorer, windows: list[Window], most: int | None = None) -> list[list[int]]:
    """The groups of a pass of ``scorer`` over ``windows`` (indices into them), in order: the batches of rows that
    one :meth:`~kvquant.scoring.scorer.Scorer.score_many` of all of them runs
    (:meth:`~kvquant.scoring.scorer.Scorer.batches`); with ``most``, of each run of ``most`` consecutive windows
    (a divergence pass holds at most that many windows' distributions), run after run."""
    most = most or max(1, len(windows))
    return [[first + i for i in batch] for first in range(0, len(windows), most)
            for batch in scorer.batches(requests(windows[first : first + most]))]


def keep_nothing(start: int, stop: int, windows: list, compute: Callable[[], object]) -> object:
    """The :data:`Keep` that keeps nothing: every group is computed."""
    return compute()


def in_groups(windows: list[Window], groups: list[list[int]], compute: Callable[[list], object],
              keep: Keep | None = None, desc: str | None = None, shown: bool = True) -> list:
    """``compute(group)`` of the windows of each of ``groups`` (indices into ``windows``: :func:`pass_groups`), through
    ``keep``, in order; one progress bar over the windows (``desc``; ``shown``: this process shows it), which counts
    a reused group's windows as done."""
    keep = keep or keep_nothing
    parts, start = [], 0
    with tqdm(total=len(windows), desc=desc, leave=False, disable=desc is None or not shown) as bar:
        for indices in groups:
            group = [windows[i] for i in indices]
            parts.append(keep(start, start + len(group), group, lambda group=group: compute(group)))
            start += len(group)
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


def join_groups(parts: list[dict], groups: list[list[int]], lists: tuple[str, ...]) -> dict:
    """Groups' results as one pass's: each per-window value of ``lists`` (and ``lengths``) of ``parts[g]`` put
    back at its window's place (``groups[g]``: :func:`in_groups`'s), ``reads`` summed."""
    reads = Reads()
    for part in parts:
        reads = reads.add(Reads(**part["reads"]))
    joined: dict[str, list] = {}
    for key in (*lists, "lengths"):
        joined[key] = [None] * sum(map(len, groups))
        for part, indices in zip(parts, groups):
            for i, value in zip(indices, part[key], strict=True):
                joined[key][i] = value
    return {**joined, "reads": reads.to_dict()}
