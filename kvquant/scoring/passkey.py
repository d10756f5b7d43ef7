"""Long-range probe: pass-key retrieval across D tokens of real text, as loglikelihood documents.

KV-cache quantization and eviction fail first where the model must read far back. Each document states a random
five-digit pass key, then D tokens of WikiText-2 (test) filler, then asks for the key::

    There is an important pass key hidden in this text. Remember it.
    The pass key is 71432. Remember it. 71432 is the pass key.

     <filler from a random WikiText-2 paragraph start>

    What is the pass key? The pass key is| 71432

``context`` ends at ``is``, ``target`` is ``" 71432"``; scored like LAMBADA (``acc`` = the whole target is the
greedy continuation, teacher-forced). The distance D counts the model tokenizer's tokens from the first token of
the key's last occurrence to the end of the context, so the model must attend at least D tokens back. With
``baseline=True`` the two key sentences are left out (same filler and question): the no-information score.

Full precision (the identity baseline): SmolLM2-135M-Instruct, GGUF Q4_1 weights, fp32 compute, ``DynamicCache``,
seed 0, 6 documents per distance (``experiments/probe_calibration.py``, ``reports/probe_calibration/report.md``):
acc 1.00 at D = 256, 512, 1024 and 4096, 0.83 at 2048 (29/30 over all); no-information baseline 0.00. A repeated
random word sequence (whole-repeat acc 0/2, 50% of its tokens at D = 4096) and a name-to-number lookup (acc 1/3
at D = 512) were weaker in a pilot.
"""

from __future__ import annotations

import functools
import random

from kvquant.errors import KVQuantError
from kvquant.paths import data_dir

FILLER = "text/wikitext-2-raw-v1/wiki.test.raw"
INTRO = "There is an important pass key hidden in this text. Remember it.\n"
STATEMENT = "The pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"


def _filler_text() -> str:
    """WikiText-2 test (raw) from the data directory, or an error saying where it was looked for."""
    root = data_dir()
    path = root / FILLER if root is not None else None
    if path is None or not path.is_file():
        where = f"{path} does not exist" if path is not None else "no data directory"
        raise KVQuantError(f"the long-range probe needs WikiText-2 as filler: {where} (set KVQUANT_DATA to a folder "
                           f"holding {FILLER})")
    return path.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=2)
def _filler(tokenizer) -> tuple[str, list[tuple[int, int]], list[int]]:
    """The filler text, its token spans and the tokens where a paragraph (not a heading) starts (the filler of a
    document begins at one of these); kept for the last tokenizers (tokenizing it takes seconds)."""
    filler = _filler_text()
    spans = _token_spans(tokenizer, filler)
    starts = [i for i, (a, b) in enumerate(spans)
              if a > 0 and filler[a - 1] == "\n" and filler[a:b].strip() and not filler[a:b].strip().startswith("=")]
    return filler, spans, starts


def _token_spans(tokenizer, text: str) -> list[tuple[int, int]]:
    """Character span ``(start, end)`` of each token of ``text`` (needs a fast tokenizer)."""
    if not getattr(tokenizer, "is_fast", False):
        raise KVQuantError("the long-range probe needs a fast tokenizer (it cuts the filler at token offsets)")
    return tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)["offset_mapping"]


def _distance(tokenizer, context: str, char: int) -> int:
    """Tokens from the one holding character ``char`` of ``context`` to the end of the context."""
    spans = _token_spans(tokenizer, context)
    return len(spans) - next(i for i, (_, end) in enumerate(spans) if end > char)


def _fit(tokenizer, head: str, key_char: int, filler: str, spans: list[tuple[int, int]], start: int,
         distance: int) -> str | None:
    """The context ``head + filler tokens from start + QUESTION`` with exactly ``distance`` tokens from the key's
    last occurrence (character ``key_char``) to its end, or None where token merges at the joins prevent it."""
    n = distance - len(_token_spans(tokenizer, head[key_char:] + QUESTION))  # first guess of the filler's tokens
    for _ in range(4):
        if n < 1 or start + n > len(spans):
            return None
        context = head + filler[spans[start][0] : spans[start + n - 1][1]] + QUESTION
        measured = _distance(tokenizer, context, key_char)
        if measured == distance:
            return context
        n += distance - measured
    return None


def probe_documents(tokenizer, distances: list[int], per_distance: int, seed: int = 0,
                    baseline: bool = False) -> list[dict]:
    """``per_distance`` pass-key documents for each distance, in order of ``distances``.

    Each is ``{"context": str, "target": " NNNNN", "distance": D}`` with D exactly as measured by ``tokenizer`` on
    the context (see the module docstring). A document depends only on ``(seed, D, its index)``, so adding
    distances or documents leaves the others unchanged. ``baseline=True`` gives the same documents without the key
    sentences (the ``distance`` field keeps the informed document's D). A distance shorter than the probe's own
    text is refused with the shortest one this tokenizer allows (:func:`shortest_distance`).
    """
    _filler(tokenizer)  # the filler text exists (else one error saying where it was looked for)
    docs = []
    for d in distances:
        need = _own_tokens(tokenizer, d, per_distance, seed)
        if d < need:
            shortest = shortest_distance(tokenizer, per_distance, seed, start=need)
            raise KVQuantError(f"probe distance {d} is shorter than the probe's own text from the key on ({need} "
                               "tokens with this tokenizer, at least one filler token included); the shortest "
                               f"distance this tokenizer allows is {shortest} (passkey_{shortest})")
        docs += [_document(tokenizer, d, index, seed, baseline) for index in range(per_distance)]
    return docs


def shortest_distance(tokenizer, per_distance: int, seed: int = 0, start: int = 1) -> int:
    """The shortest distance D >= ``start`` whose ``per_distance`` documents this tokenizer can write (their key
    is drawn from D, so the probe's own text can change length with D)."""
    for d in range(start, start + 1000):
        if _own_tokens(tokenizer, d, per_distance, seed) <= d:
            try:
                for index in range(per_distance):
                    _document(tokenizer, d, index, seed, False)
                return d
            except KVQuantError:
                continue
    raise KVQuantError(f"no probe distance from {start} to {start + 999} can be cut with this tokenizer")


def _head(d: int, index: int, seed: int) -> tuple[random.Random, str, str, int]:
    """Document ``index`` of distance ``d``: its random source, key, text up to the filler and the key's last
    character offset in it."""
    rng = random.Random(f"kvquant-probe:{seed}:{d}:{index}")
    key = str(rng.randint(10000, 99999))
    head = INTRO + STATEMENT.format(key=key)
    return rng, key, head, head.rindex(key)


def _own_tokens(tokenizer, d: int, per_distance: int, seed: int) -> int:
    """The fewest tokens from the key on that every document of distance ``d`` needs: its own text from the key
    to the question's end, plus one filler token."""
    return max(len(_token_spans(tokenizer, head[key_char:] + QUESTION)) + 1
               for _, _, head, key_char in (_head(d, index, seed) for index in range(per_distance)))


def _document(tokenizer, d: int, index: int, seed: int, baseline: bool) -> dict:
    """Document ``index`` of distance ``d`` (``d`` at least its own text: :func:`_own_tokens`)."""
    filler, spans, starts = _filler(tokenizer)
    rng, key, head, key_char = _head(d, index, seed)
    for _ in range(20):  # another paragraph where this one's end cannot be cut to exactly d tokens
        context = _fit(tokenizer, head, key_char, filler, spans, rng.choice(starts), d)
        if context is not None:
            break
    else:
        raise KVQuantError(f"distance {d}: cannot cut the filler to exactly {d} tokens (longer than the "
                           f"{len(spans)}-token filler text?)")
    return {"context": context[len(head):] if baseline else context, "target": " " + key, "distance": d}
