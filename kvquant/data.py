"""Text for perplexity: local files or ``datasets`` ids, cut into identical token windows for every cache."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import PerplexitySet
from .errors import KVQuantError
from .paths import resolve


@dataclass(frozen=True)
class Window:
    """One scored sequence: ``ids`` are fed to the model, the tokens at ``ids[score_from:]`` are predicted."""

    ids: list[int]
    score_from: int


def load_rows(spec: PerplexitySet) -> list[str]:
    """The rows of text of a perplexity set, from ``source`` or, when it cannot be resolved, from ``hub``."""
    if spec.source:
        try:
            return _read_file(Path(resolve(spec.source)), spec.text_field)
        except KVQuantError:
            if not spec.hub:
                raise
    if not spec.hub:
        raise KVQuantError(f"perplexity set {spec.name!r} has neither a source nor a hub id")
    import datasets

    try:
        ds = datasets.load_dataset(spec.hub, spec.hub_config, split=spec.split)
    except Exception as err:  # datasets raises many types for "not reachable" / "not found"
        raise KVQuantError(f"perplexity set {spec.name!r}: cannot load {spec.hub!r} from the hub: {err}") from err
    return list(ds[spec.text_field])


def _read_file(path: Path, text_field: str) -> list[str]:
    suffix = path.suffix.lower()
    if suffix in (".txt", ".raw"):
        return [path.read_text(encoding="utf-8")]
    if suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()] if suffix == ".jsonl" else json.load(f)
    elif suffix == ".parquet":
        import pandas as pd

        rows = pd.read_parquet(path).to_dict("records")
    else:
        raise KVQuantError(f"{path}: unsupported text file type {suffix!r} (use .txt, .raw, .jsonl, .json, .parquet)")
    try:
        return [row[text_field] for row in rows]
    except (KeyError, TypeError):
        raise KVQuantError(f"{path}: rows have no field {text_field!r}") from None


def windows(spec: PerplexitySet, tokenizer, max_length: int | None = None) -> list[Window]:
    """Token windows of a perplexity set, identical for the baseline and every candidate.

    documents: each non-empty row is ``tokenizer(row)`` (BOS included where the tokenizer adds it), cut at
    ``max_length``; every token after the first is predicted.
    stream: rows joined by ``separator``, tokenized once, windows of ``max_length`` every ``stride`` tokens;
    each window predicts only the tokens the previous window did not (the rest is context).
    """
    length = min(spec.max_length, max_length or spec.max_length)
    rows = load_rows(spec)
    if spec.layout == "documents":
        texts = [r for r in rows if r and r.strip()][: spec.limit]
        out = [Window(ids[:length], 1) for ids in (tokenizer(t).input_ids for t in texts)]
        return [w for w in out if len(w.ids) > 1]
    ids = tokenizer(spec.separator.join(rows)).input_ids
    stride = spec.stride or length
    if not 0 < stride <= length:
        raise KVQuantError(f"perplexity set {spec.name!r}: stride must be in 1..{length}, got {stride}")
    out, scored_until = [], 1
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + length, len(ids))
        out.append(Window(ids[begin:end], max(scored_until - begin, 1)))
        scored_until = end
        if end == len(ids) or (spec.limit and len(out) >= spec.limit):
            break
    return out
