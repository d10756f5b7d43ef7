"""Needles by length: synthetic retrieval documents in the style of RULER, written offline from a seed.

Each document is an instruction, a haystack of real text (WikiText-2 test, the filler of :mod:`.passkey`) with a
needle block inserted at a chosen depth, and a question whose answer is a short continuation::

    A special magic number is hidden in the following text. Memorize it. ...

    <filler> The special magic number for quiet-lantern is: 4718254. <filler>

    What is the special magic number for quiet-lantern mentioned in the provided text? The special magic number
    for quiet-lantern mentioned in the provided text is| 4718254

Three kinds (:data:`KINDS`):

- ``single``: one needle; the wrong choices are numbers of the same form found nowhere in the document.
- ``multikey``: :data:`KEYS` needles with distinct keys and values, one key asked; the choices are the values of
  all of them (a model that copies some number of the block, not the asked one, scores chance).
- ``variables``: :data:`CHAINS` chains of :data:`HOPS` + 1 assignments (``VAR QXZTB = 40713.``, then
  ``VAR LMOPA = VAR QXZTB.``, ...), the chains' links interleaved in one block in order; asked the value of the
  last variable of one chain (``VAR LMOPA =`` | `` 40713``); the choices are the chains' values.

Like :mod:`.passkey`, ``context`` ends without a space and ``target`` is ``" " + answer``: scored by the
log-likelihood of the target (``acc``: the target is the greedy continuation), or as multiple choice over
``choices`` (``gold`` the right one's index), where a model that holds nothing of the needle scores ``chance`` =
``1 / len(choices)``. Every number and name of the needle block and of the choices occurs in the context only
where the block and the question put it.

Length: ``context_tokens`` is the context's token count (the tokenizer's, without special tokens), equal to the
asked ``length`` where token merges at the joins allow it, else within :data:`LENGTH_TOLERANCE`. Depth ``d``: the
block is put after about ``d`` of the haystack's tokens, moved to the nearest sentence start within
:data:`SNAP` tokens, else to the nearest word start; its first token (``needle_token``) lies within
:data:`DEPTH_TOLERANCE` tokens of ``intro tokens + d * haystack tokens``. Depth 0 puts the block right after the
instruction, depth 1 right before the question.
"""

from __future__ import annotations

import bisect
import random
import re
from dataclasses import dataclass

from kvquant.errors import KVQuantError, check_int
from kvquant.experiment.long_config import KINDS, needle_task
from kvquant.scoring.passkey import _filler, _token_spans

KEYS = 4  # needles of a multikey document (and choices of a single-needle one)
CHAINS, HOPS = 2, 4  # variable chains of a document, and the copies after each chain's value
LENGTH_TOLERANCE = 2  # tokens a document may differ from its length where merges at the joins prevent exactness
SNAP = 16  # tokens the needle may move to start a sentence
DEPTH_TOLERANCE = SNAP + 4  # tokens between the needle's first token and its depth (the snap, plus merges)

INTROS = {
    "single": "A special magic number is hidden in the following text. Memorize it. I will quiz you about the "
              "number afterwards.\n\n",
    "multikey": "Some special magic numbers are hidden in the following text. Memorize them. I will quiz you about "
                "one of them afterwards.\n\n",
    "variables": "Memorize and track the chains of variable assignments hidden in the following text.\n\n",
}
NEEDLE = "The special magic number for {key} is: {value}."
QUESTION = ("\n\nWhat is the special magic number for {key} mentioned in the provided text? The special magic "
            "number for {key} mentioned in the provided text is")
VARIABLE_QUESTION = "\n\nQuestion: what is the value of VAR {name}? Answer: VAR {name} ="
ADJECTIVES = ("quiet", "bright", "hollow", "rapid", "gentle", "silver", "crooked", "ancient", "frozen", "humble",
              "lively", "narrow", "patient", "rustic", "tender", "vivid")
NOUNS = ("lantern", "otter", "harbor", "meadow", "compass", "thimble", "falcon", "orchard", "ladder", "pebble",
         "violin", "kettle", "glacier", "saddle", "beacon", "walnut")


@dataclass(frozen=True)
class Needle:
    """What a document asks: the block hidden in the haystack, the question ending the context, the answer and
    the choices (the answer among them), and ``marks``: strings that may occur only in the block and question."""

    block: str
    question: str
    answer: str
    choices: tuple[str, ...]
    marks: tuple[str, ...]


def _numbers(rng: random.Random, digits: int, count: int) -> list[str]:
    """``count`` distinct ``digits``-digit numbers."""
    return [str(n) for n in rng.sample(range(10 ** (digits - 1), 10**digits), count)]


def _keys(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct keys like ``quiet-lantern`` (WikiText writes its hyphens `` @-@ ``: never one of them)."""
    pairs = rng.sample(range(len(ADJECTIVES) * len(NOUNS)), count)
    return [f"{ADJECTIVES[p // len(NOUNS)]}-{NOUNS[p % len(NOUNS)]}" for p in pairs]


def _single(rng: random.Random) -> Needle:
    key, = _keys(rng, 1)
    values = _numbers(rng, 7, KEYS)  # the first is the answer; the others appear nowhere in the document
    return Needle(NEEDLE.format(key=key, value=values[0]), QUESTION.format(key=key), values[0], tuple(values),
                  (key, *values))


def _multikey(rng: random.Random) -> Needle:
    keys, values = _keys(rng, KEYS), _numbers(rng, 7, KEYS)
    asked = rng.randrange(KEYS)
    block = " ".join(NEEDLE.format(key=k, value=v) for k, v in zip(keys, values))
    return Needle(block, QUESTION.format(key=keys[asked]), values[asked], tuple(values), (*keys, *values))


def _variables(rng: random.Random) -> Needle:
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names: list[str] = []
    while len(names) < CHAINS * (HOPS + 1):
        name = "".join(rng.choice(letters) for _ in range(5))
        names += [name] if name not in names else []
    values = _numbers(rng, 5, CHAINS)
    chains = [[f"VAR {names[c * (HOPS + 1)]} = {values[c]}."]
              + [f"VAR {names[c * (HOPS + 1) + h]} = VAR {names[c * (HOPS + 1) + h - 1]}." for h in range(1, HOPS + 1)]
              for c in range(CHAINS)]
    order = [c for c in range(CHAINS) for _ in range(HOPS + 1)]
    rng.shuffle(order)  # the chains' links interleaved, each chain's in its own order
    block = " ".join(chains[c].pop(0) for c in order)
    asked = rng.randrange(CHAINS)
    question = VARIABLE_QUESTION.format(name=names[asked * (HOPS + 1) + HOPS])
    return Needle(block, question, values[asked], tuple(values), (*names, *values))


MAKERS = {"single": _single, "multikey": _multikey, "variables": _variables}


def _cut(hay: str, token_starts: list[int], depth: float) -> int:
    """The character of ``hay`` where the needle goes: the start of the sentence nearest to token
    ``round(depth * tokens)`` within :data:`SNAP` tokens, else of the nearest word; 0 or ``len(hay)`` at the ends.
    ``token_starts``: the character where each of the haystack's tokens starts."""
    n = len(token_starts)
    k = round(depth * n)
    if k == 0 or k == n:
        return 0 if k == 0 else len(hay)
    token = lambda char: bisect.bisect_right(token_starts, char) - 1  # noqa: E731
    sentences = [m.end() for m in re.finditer(r"(?:[.!?] +|\n\s*)(?=\S)", hay)]
    near = [c for c in sentences if 0 < c < len(hay) and abs(token(c) - k) <= SNAP]
    if not near:
        near = [m.start() for m in re.finditer(r"(?<=\s)\S", hay)] or [len(hay)]
    return min(near, key=lambda c: (abs(token(c) - k), c))


def _assemble(intro: str, needle: Needle, hay: str, cut: int) -> tuple[str, int]:
    """The context and the character where the needle block starts in it (a space between the block and the
    haystack, unless the haystack has whitespace there)."""
    if cut == len(hay):
        space = "" if hay[-1:].isspace() else " "
        return intro + hay + space + needle.block + needle.question, len(intro) + len(hay) + len(space)
    space = "" if hay[cut:cut + 1].isspace() else " "
    return intro + hay[:cut] + needle.block + space + hay[cut:] + needle.question, len(intro) + cut


def _clean(context: str, needle: Needle) -> bool:
    """Every mark of the needle occurs in ``context`` only where the block and the question put it."""
    own = needle.block + needle.question
    return all(context.count(m) == own.count(m) for m in needle.marks)


def _attempt(tokenizer, intro: str, needle: Needle, start: int, length: int, depth: float,
             own: int) -> tuple[str, int, int] | None:
    """``(context, needle character, tokens)`` with the haystack from filler token ``start``: exactly ``length``
    tokens, else the first within :data:`LENGTH_TOLERANCE`, else None (or where the filler holds a mark)."""
    filler, spans, _ = _filler(tokenizer)
    n, near = length - own, None
    for _ in range(6):
        if n < 1 or start + n > len(spans):
            break
        base = spans[start][0]
        hay = filler[base : spans[start + n - 1][1]]
        cut = _cut(hay, [a - base for a, _ in spans[start : start + n]], depth)
        context, char = _assemble(intro, needle, hay, cut)
        tokens = len(_token_spans(tokenizer, context))
        if not _clean(context, needle):
            return None
        if tokens == length:
            return context, char, tokens
        if near is None and abs(tokens - length) <= LENGTH_TOLERANCE:
            near = context, char, tokens
        n += length - tokens
    return near


def _own_tokens(tokenizer, kind: str, needle: Needle) -> int:
    """Tokens of a document's own text: instruction, needle block and question."""
    return len(_token_spans(tokenizer, INTROS[kind] + needle.block + " " + needle.question))


def _draw(kind: str, length: int, depth: float, index: int, seed: int) -> tuple[random.Random, Needle]:
    """The random source and needle of document ``index`` of the cell ``(length, depth)``."""
    rng = random.Random(f"kvquant-needles:{seed}:{kind}:{length}:{depth!r}:{index}")
    return rng, MAKERS[kind](rng)


def _document(tokenizer, kind: str, length: int, depth: float, index: int, seed: int) -> dict:
    """Document ``index`` of the cell ``(length, depth)`` (see :func:`needle_documents`)."""
    _, spans, starts = _filler(tokenizer)
    rng, needle = _draw(kind, length, depth, index, seed)
    own = _own_tokens(tokenizer, kind, needle)
    for _ in range(20):  # another paragraph where this one cannot be cut to the length, or holds a mark
        found = _attempt(tokenizer, INTROS[kind], needle, rng.choice(starts), length, depth, own)
        if found is not None:
            break
    else:
        raise KVQuantError(f"needle length {length}: cannot cut the filler to {length} tokens (longer than the "
                           f"{len(spans)}-token filler text?)")
    context, char, tokens = found
    order = list(needle.choices)
    rng.shuffle(order)
    choices = [" " + c for c in order]
    return {"kind": kind, "length": length, "depth": depth, "index": index, "seed": seed, "context": context,
            "target": " " + needle.answer, "choices": choices, "gold": order.index(needle.answer),
            "chance": 1 / len(choices), "context_tokens": tokens,
            "needle_token": next(i for i, (_, end) in enumerate(_token_spans(tokenizer, context)) if end > char),
            "needle": needle.block, "question": needle.question}


def _check(kind: str, lengths: list[int], depths: list[float], per_cell: int, seed: int) -> list[float]:
    """The depths as floats, after one-line errors for a bad kind, length, depth, count or seed."""
    if kind not in KINDS:
        raise KVQuantError(f"needle kind {kind!r} is unknown (kinds: {', '.join(KINDS)})")
    if not lengths or not depths:
        raise KVQuantError(f"needle documents need lengths and depths, got lengths {lengths!r}, depths {depths!r}")
    for i, length in enumerate(lengths):
        check_int(f"needle length {length!r}", length, minimum=1)
        if i and length <= lengths[i - 1]:
            raise KVQuantError(f"needle lengths must increase: {length} after {lengths[i - 1]}")
    for depth in depths:
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
            raise KVQuantError(f"needle depth {depth!r} is not a number in [0, 1] (the fraction of the haystack "
                               "before the needle)")
    if len({float(d) for d in depths}) < len(depths):
        raise KVQuantError(f"needle depths repeat: {depths!r}")
    check_int("needle documents per cell", per_cell, minimum=1)
    check_int("needle seed", seed)
    return [float(d) for d in depths]


def needle_documents(tokenizer, kind: str, lengths: list[int], depths: list[float], per_cell: int,
                     seed: int = 0) -> list[dict]:
    """``per_cell`` documents of ``kind`` for each length and depth, in that order (lengths outer).

    Each is a dict (see the module docstring): ``kind``, ``length`` (asked tokens), ``depth`` (asked, a float),
    ``index`` (in its cell), ``seed``, ``context`` (str), ``target`` (``" " + answer``), ``choices`` (list of str,
    the target among them), ``gold`` (the target's index in ``choices``), ``chance`` (``1 / len(choices)``),
    ``context_tokens`` (the context's tokens as ``tokenizer`` cuts it, no special tokens), ``needle_token`` (index
    of the needle block's first token in the context), ``needle`` (the block) and ``question`` (the text ending the
    context). A document depends only on ``(seed, kind, length, depth, index)``: adding lengths, depths or
    documents leaves the others unchanged. Needs a fast tokenizer and the WikiText-2 filler.

    Refused with one line (:class:`KVQuantError`): an unknown kind, lengths not positive and increasing, a depth
    outside [0, 1] or repeated, and a length whose haystack would be shorter than the document's own text
    (instruction, needle block and question) for any of its documents.
    """
    depths = _check(kind, lengths, depths, per_cell, seed)
    _check_haystack(tokenizer, kind, lengths, [(d, i) for d in depths for i in range(per_cell)], seed)
    return [_document(tokenizer, kind, length, depth, index, seed)
            for length in lengths for depth in depths for index in range(per_cell)]


def _check_haystack(tokenizer, kind: str, lengths: list[int], cells: list[tuple[float, int]], seed: int) -> None:
    """One line for a length whose haystack would be shorter than the needle's own text for any document
    ``(depth, index)`` of ``cells``; the filler text must exist."""
    _filler(tokenizer)  # the filler text exists (else one error saying where it was looked for)
    for length in lengths:
        own = max(_own_tokens(tokenizer, kind, _draw(kind, length, d, i, seed)[1]) for d, i in cells)
        if length - own < own:
            raise KVQuantError(f"needle length {length} leaves a haystack of {max(length - own, 0)} tokens, shorter "
                               f"than the {kind} needle's own text (instruction, needle and question: {own} tokens "
                               f"with this tokenizer); a length of about {2 * own} or more fits")


#: The depths of a needle task's documents, in turn: document ``i`` is at ``DEPTHS[i % 5]``, the ``i // 5``-th of
#: its cell, so the first ``n`` documents spread over every depth and a longer ``limit`` only adds documents.
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: Needle tasks' documents are drawn from this seed (fixed: a task name names the same documents in every run).
TASK_SEED = 0


def task_documents(tokenizer, name: str, count: int) -> list[dict]:
    """The first ``count`` documents of needle task ``name`` (:func:`needle_task`): document ``i`` is at depth
    ``DEPTHS[i % len(DEPTHS)]``, index ``i // len(DEPTHS)`` of its cell (:func:`needle_documents`), so it depends on
    ``(name, i)`` alone. Refused with one line as :func:`needle_documents` refuses (a haystack shorter than the
    needle's own text)."""
    kind, length = needle_task(name)
    check_int("needle documents", count, minimum=1)
    cells = [(DEPTHS[i % len(DEPTHS)], i // len(DEPTHS)) for i in range(count)]
    _check_haystack(tokenizer, kind, [length], cells, TASK_SEED)
    return [_document(tokenizer, kind, length, depth, index, TASK_SEED) for depth, index in cells]


def needle_chance(name: str) -> float:
    """What a model that holds nothing of the needle scores on needle task ``name``: one over its choices."""
    kind, _ = needle_task(name)
    return 1 / (CHAINS if kind == "variables" else KEYS)
