"""Text for perplexity: local files or ``datasets`` ids, cut into identical token windows for every cache."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvquant.experiment.config import PerplexitySet
from kvquant.yaml_reader import read_text_file
from kvquant.errors import KVQuantError, one_line
from kvquant.paths import resolve


@dataclass(frozen=True)
class Window:
    """One scored sequence: ``ids`` are fed to the model, the tokens at ``ids[score_from:]`` are predicted."""

    ids: list[int]
    score_from: int


def load_rows(spec: PerplexitySet) -> list[str]:
    """The rows of text of a perplexity set, from ``source`` or, when it cannot be found, from ``hub``.

    A source that exists but is unreadable, binary, malformed or holds no text is an error naming the file (never
    a silent switch to the hub); so is a set with no non-empty text.
    """
    try:
        path = _find_source(spec)
        rows = _read_file(path, spec.text_field) if path else _read_hub(spec)
        where = path or f"{spec.hub!r} (field {spec.text_field!r})"
        if not any(r.strip() for r in rows):
            raise KVQuantError(f"{where} holds no text (every row is empty or whitespace)")
        for i, row in enumerate(rows, 1):
            check_text(row, f"{where}: row {i}")
        check_text(spec.separator, "separator")
    except KVQuantError as err:
        raise KVQuantError(f"perplexity set {spec.name!r}: {err}") from None
    return rows


def _find_source(spec: PerplexitySet) -> Path | None:
    """The local file of ``source``; None where it cannot be found and ``hub`` can stand in."""
    if not spec.source:
        return None
    try:
        path = Path(resolve(spec.source)).expanduser()
    except KVQuantError:
        if spec.hub:
            return None
        raise
    if not path.exists():
        if spec.hub:
            return None
        raise KVQuantError(f"source {spec.source!r} does not exist")
    if not path.is_file():
        raise KVQuantError(f"source {path} is not a file")
    return path


def _read_hub(spec: PerplexitySet) -> list[str]:
    import datasets

    try:
        ds = datasets.load_dataset(spec.hub, spec.hub_config, split=spec.split)
    except Exception as err:  # datasets raises many types for "not reachable" / "not found"
        missing = f"source {spec.source!r} does not exist and " if spec.source else ""
        raise KVQuantError(f"{missing}cannot load {spec.hub!r} from the hub: "
                           f"{one_line(err)[:300]}") from None
    if spec.text_field not in ds.column_names:
        raise KVQuantError(f"{spec.hub!r} has no field {spec.text_field!r} "
                           f"(fields: {', '.join(ds.column_names)})")
    return _texts(ds[spec.text_field], f"{spec.hub!r}", spec.text_field)


def _read_file(path: Path, text_field: str) -> list[str]:
    suffix = path.suffix.lower()
    if suffix in (".txt", ".raw"):
        return [read_text_file(path, "text file")]
    if suffix == ".jsonl":
        lines = read_text_file(path, "text file").splitlines()
        rows = [_json(line, f"{path}, line {i}") for i, line in enumerate(lines, 1) if line.strip()]
    elif suffix == ".json":
        rows = _json(read_text_file(path, "text file"), str(path))
        if not isinstance(rows, list):
            raise KVQuantError(f"{path}: a .json text file must hold a list of rows, got {type(rows).__name__}")
    elif suffix == ".parquet":
        rows = _parquet(path)
    else:
        raise KVQuantError(f"{path}: unsupported text file type {suffix!r} (use .txt, .raw, .jsonl, .json, .parquet)")
    return _texts(rows, str(path), text_field)


#: The share of control characters (Unicode category Cc; tabs and line breaks aside) above which a row is not text.
MAX_CONTROL_SHARE = 0.01
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def check_text(text: str, where: str) -> None:
    """``text`` is text a tokenizer can read: valid Unicode (no lone surrogates), no NUL, and at most
    :data:`MAX_CONTROL_SHARE` control characters (a binary file read as text scores absurd perplexities)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise KVQuantError(f"{where} is not text: it holds a lone surrogate at character {err.start}") from None
    control = len(_CONTROL.findall(text))
    if "\0" in text or control > MAX_CONTROL_SHARE * len(text):
        raise KVQuantError(f"{where} is not text: {control} of its {len(text)} characters are control characters"
                           + (" (NUL among them)" if "\0" in text else ""))


def _texts(rows, where: str, text_field: str) -> list[str]:
    """``row[text_field]`` of every row (rows are mappings; a text is a string); errors name the row."""
    texts = []
    for i, row in enumerate(rows, 1):
        text = row.get(text_field) if isinstance(row, dict) else row if isinstance(row, str) else None
        if isinstance(row, dict) and text_field in row and not isinstance(text, str):
            raise KVQuantError(f"{where}: row {i}: field {text_field!r} is {type(text).__name__} {text!r:.40}, "
                               "not text")
        if not isinstance(text, str):
            raise KVQuantError(f"{where}: row {i} has no text field {text_field!r}"
                               + (f" (fields: {', '.join(map(str, row))})" if isinstance(row, dict) else ""))
        texts.append(text)
    return texts


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise KVQuantError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise KVQuantError(f"{where}: JSON nested too deeply to read (thousands of levels); rows are flat") from None
    except ValueError:  # an integer past Python's digit limit
        raise KVQuantError(f"{where}: a number of more than {sys.get_int_max_str_digits():,} digits, which Python "
                           "does not read; rows hold text") from None


def _parquet(path: Path) -> list[dict]:
    import pandas as pd

    try:
        return pd.read_parquet(path).to_dict("records")
    except Exception as err:  # pyarrow raises its own types for a file that is not parquet
        raise KVQuantError(f"{path}: not a readable parquet file ({one_line(err)[:200]})") from None


def windows(spec: PerplexitySet, tokenizer, max_length: int | None = None,
            rows: list[str] | None = None) -> list[Window]:
    """Token windows of a perplexity set, identical for the baseline and every candidate.

    documents: each non-empty row is ``tokenizer(row)`` (BOS included where the tokenizer adds it), cut at
    ``max_length``; every token after the first is predicted.
    stream: rows joined by ``separator``, tokenized once, windows of ``max_length`` every ``stride`` tokens;
    each window predicts only the tokens the previous window did not (the rest is context).
    ``rows``: the set's rows when already read (:func:`load_rows`). A set that yields no window of two or more
    tokens is an error, never a result with ``n = 0``.
    """
    length = min(spec.max_length, max_length or spec.max_length)
    rows = load_rows(spec) if rows is None else rows
    if spec.layout == "documents":
        texts = [r for r in rows if r and r.strip()][: spec.limit]
        out = [Window(ids[:length], 1) for ids in (tokenizer(t).input_ids for t in texts)]
        return _some([w for w in out if len(w.ids) > 1], spec)
    ids = tokenizer(spec.separator.join(rows)).input_ids
    stride = spec.stride or length
    if not 0 < stride <= length:
        raise KVQuantError(f"perplexity set {spec.name!r}: stride must be in 1..{length}, got {stride}")
    out, scored_until = [], 1
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + length, len(ids))
        out.append(Window(ids[begin:end], max(scored_until - begin, 1)))
        scored_until = end
        if end == len(ids) or (spec.limit is not None and len(out) >= spec.limit):
            break
    return _some(out, spec)


def _some(out: list[Window], spec: PerplexitySet) -> list[Window]:
    if not out:
        raise KVQuantError(f"perplexity set {spec.name!r}: no text of two or more tokens to score")
    return out


def windows_digest(windows: list[Window], long: bool = False) -> str:
    """What a result over ``windows`` is keyed by: their tokens and where scoring starts (``long``: tokens only, as
    the long documents' results are keyed)."""
    kept = [w.ids for w in windows] if long else [[w.ids, w.score_from] for w in windows]
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()
