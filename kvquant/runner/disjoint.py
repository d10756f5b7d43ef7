"""Calibration data and evaluation data never overlap (issue 58): checked before the model loads.

What a run fits to its data (static scales: ``calibrate``; a per-layer map: ``search``) reads the calibration split:
the windows after each gated perplexity set's ``limit`` and the search's task documents after each gated task's
limit. What it judges reads every evaluated set: each perplexity set's windows, ``eval.long_context``'s documents and
each task's documents (every sequential look included). A set is not cut alike from another just because it reads
the same text (another ``max_length``, layout or stride, or the long documents cut from a set's rows), so where two
of them read one text the calibration windows of one can be the evaluation windows of the other; the scales or the
map would then be judged on the data they were fitted to. Every read is placed on the text it comes from, as
(row, character) positions of that text's rows, and any calibration read that meets an evaluation read is refused.

A text is a file (its real path; two sets reading one file read the same rows, whatever field they take, so rows
are compared where the fields differ) or a hub dataset (id, config and split). Task documents: the offline copies'
data files are taken as read whole (their few-shot examples are drawn from the whole file), ``tinystories_lastword``
as the stories its documents come from (all 500 of them with few-shot examples). Generated tasks (passkey, needles)
are left out: their filler is cut at random places of another file.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

from kvquant.errors import KVQuantError
from kvquant.paths import data_dir
from kvquant.experiment.gate_config import looks
from kvquant.scoring import data

END = (1 << 62, 0)  # past every row


@dataclass(frozen=True)
class Read:
    """What one measurement reads of one text: ``text`` (its identity), ``field`` (None: whole rows, compared by
    rows) and the positions ``[low, high)`` as (row, character) pairs; ``what`` names it in a refusal."""

    what: str
    text: tuple
    field: str | None
    low: tuple[int, int]
    high: tuple[int, int]

    def meets(self, other: Read) -> bool:
        if self.text != other.text:
            return False
        if self.field is not None and self.field == other.field:
            return self.low < other.high and other.low < self.high
        rows = lambda r: (r.low[0], r.high[0] + (r.high[1] > 0))  # noqa: E731  the rows touched, [first, stop)
        (a, b), (c, d) = rows(self), rows(other)
        return a < d and c < b

    def rows(self) -> str:
        last = self.high[0] - (self.high[1] == 0)
        return "every row" if self.high == END else f"rows {self.low[0] + 1}-{last + 1}"


def text_of(pset) -> tuple:
    """The identity of what a perplexity set reads: its file's real path, else its hub dataset."""
    path = data._find_source(pset)
    return ("file", os.path.realpath(path)) if path else ("hub", pset.hub, pset.hub_config, pset.split)


def set_read(what: str, pset, tokenizer, maxlen: int, rows: list[str], first: int, count: int | None) -> Read:
    """The part of ``rows`` that windows ``first .. first + count`` (None: all) of ``pset`` read, cut as
    :func:`kvquant.scoring.data.windows` cuts them."""
    if pset.layout == "documents":
        kept = [i for i, r in enumerate(rows) if r and r.strip()]
        chosen = kept[first : None if count is None else first + count]
        low, high = ((chosen[0], 0), (chosen[-1] + 1, 0)) if chosen else ((0, 0), (0, 0))
        return Read(what, text_of(pset), None, low, high)
    joined = pset.separator.join(rows)
    encoded = tokenizer(joined, return_offsets_mapping=True) if getattr(tokenizer, "is_fast", False) else None
    length = min(pset.max_length, maxlen or pset.max_length)
    stride = pset.stride or length
    ids = encoded.input_ids if encoded is not None else tokenizer(joined).input_ids
    begin = min(first * stride, len(ids))
    end = len(ids) if count is None else min((first + count - 1) * stride + length, len(ids))
    starts = [0]
    for row in rows[:-1]:
        starts.append(starts[-1] + len(row) + len(pset.separator))
    if encoded is None:  # no offsets: characters in proportion to tokens, a row's slack either side
        to_char = lambda t, _: round(t * len(joined) / max(len(ids), 1))  # noqa: E731
        low, high = position(starts, rows, to_char(begin, 0)), position(starts, rows, to_char(end, 0))
        return Read(what, text_of(pset), None, (max(low[0] - 1, 0), 0), (high[0] + 1, 0))
    spans = [s for s in encoded.offset_mapping[begin:end] if s[1] > s[0]]
    if not spans:
        return Read(what, text_of(pset), pset.text_field, (0, 0), (0, 0))
    return Read(what, text_of(pset), pset.text_field, position(starts, rows, spans[0][0]),
                position(starts, rows, spans[-1][1]))


def position(starts: list[int], rows: list[str], char: int) -> tuple[int, int]:
    """A character of the joined text as (row, character in it); one in a separator is its row's end."""
    row = bisect.bisect_right(starts, char) - 1
    return row, min(char - starts[row], len(rows[row]))


def task_reads(cfg, name: str, documents: range | None, what: str) -> list[Read]:
    """What task ``name`` reads of a text a perplexity set could read too (``documents``: None, every document it
    may evaluate, sequential looks included)."""
    from kvquant.scoring.tasks import LASTWORD, LASTWORD_SOURCE, LASTWORD_STORIES, OFFLINE_TASKS, _lastword_docs

    root = data_dir()
    if root is None:
        return []
    if name in OFFLINE_TASKS and (root / OFFLINE_TASKS[name][2]).is_file():
        return [Read(what, ("file", os.path.realpath(root / OFFLINE_TASKS[name][2])), None, (0, 0), END)]
    if name != LASTWORD or not (root / LASTWORD_SOURCE).is_file():
        return []
    text = ("file", os.path.realpath(root / LASTWORD_SOURCE))
    first, stop = LASTWORD_STORIES.start, LASTWORD_STORIES.stop
    if documents is None and cfg.eval.tasks.fewshot_for(name):  # examples come from any of the stories
        return [Read(what, text, None, (first, 0), (stop, 0))]
    from kvquant.scoring.tasks import _stories

    stories = _stories(root)
    kept = [first + i for i, s in enumerate(stories[LASTWORD_STORIES]) if _lastword_docs([s])]
    most = documents_read(cfg, name)
    chosen = kept[documents.start : documents.stop] if documents is not None else kept[:most]
    return [Read(what, text, None, (chosen[0], 0), (chosen[-1] + 1, 0))] if chosen else []


def documents_read(cfg, task: str) -> int | None:
    """The most documents of ``task`` the run evaluates (a sequential gate's last look; None: all)."""
    limit = cfg.eval.tasks.limit_for(task)
    if limit is not None and cfg.gate.max_documents is not None and task in cfg.gated_tasks():
        return looks(limit, cfg.gate.max_documents)[-1]
    return limit


def evaluation_reads(cfg, tokenizer, maxlen: int, rows: dict) -> list[Read]:
    """Everything the run evaluates, as reads of their texts."""
    out = [set_read(f"perplexity set {p.name!r}", p, tokenizer, maxlen, rows[p.name], 0, p.limit)
           for p in cfg.eval.perplexity]
    long = cfg.eval.long_context
    if long is not None:
        pset = next(p for p in cfg.eval.perplexity if p.name == long.text)
        import dataclasses

        pset = dataclasses.replace(pset, layout="stream", max_length=long.lengths[-1], stride=None)
        out.append(set_read(f"eval.long_context (text {long.text!r})", pset, tokenizer, maxlen, rows[long.text], 0,
                            long.documents))
    for task in cfg.eval.tasks.names:
        out += task_reads(cfg, task, None, f"task {task!r}")
    return out


def calibration_reads(cfg, tokenizer, maxlen: int, rows: dict) -> list[Read]:
    """Everything the run fits to: the calibration windows of ``calibrate``, and the search's windows and task
    documents."""
    from kvquant.scoring.calibrate import calibration_documents, calibration_windows

    asked = []
    if cfg.calibration is not None and any(c.reads_calibration for c in [*cfg.candidates, *cfg.stages]):
        asked.append(("calibration.windows", cfg.calibration.windows))
    if cfg.search is not None:
        asked.append(("search.windows", cfg.search.windows))
    out = []
    for key, count in asked:
        for name, (start, windows) in calibration_windows(cfg, tokenizer, maxlen, rows, count, key).items():
            pset = next(p for p in cfg.eval.perplexity if p.name == name)
            out.append(set_read(f"{key}: the calibration windows of perplexity set {name!r}", pset, tokenizer,
                                maxlen, rows[name], start, len(windows)))
    if cfg.search is not None:
        for task, docs in calibration_documents(cfg).items():
            out += task_reads(cfg, task, docs, f"search.documents: task {task!r} documents {docs.start}-"
                                               f"{docs.stop - 1}")
    return out


def check_disjoint(cfg, tokenizer, maxlen: int, rows: dict) -> None:
    """Refuse a run whose calibration windows or search documents are also evaluated (one line naming both)."""
    fitted = calibration_reads(cfg, tokenizer, maxlen, rows)
    if not fitted:
        return
    judged = evaluation_reads(cfg, tokenizer, maxlen, rows)
    for f in fitted:
        for j in judged:
            if f.meets(j):
                raise KVQuantError(f"{f.what} ({f.rows()} of {f.text[1]}) are evaluated too, by {j.what} "
                                   f"({j.rows()}): what is fitted would be judged on its own data; give the sets "
                                   "limits that leave the calibration text apart, or calibrate on another text")
