"""Needles by length (issue 40, item 2): documents reproducible from their seed, of the length and depth they
claim as two real tokenizers cut them, the answer where the needle was put, chance levels, and one-line errors."""

import json
import re

import pytest
from transformers import AutoTokenizer

from kvquant.errors import KVQuantError
from kvquant.paths import data_dir
from kvquant.scoring.needles import INTROS, needle_documents

KINDS = ["single", "multikey", "variables"]
LENGTHS = {"single": [480, 1500], "multikey": [760, 2000], "variables": [700, 2000]}
DEPTHS = [0.0, 0.25, 0.5, 0.9, 1.0]
CHANCE = {"single": 1 / 4, "multikey": 1 / 4, "variables": 1 / 2}


@pytest.fixture(scope="module", params=["stories260K", "smollm2"])
def any_tokenizer(request, tokenizer):
    """The tiny model's tokenizer (512 pieces) and SmolLM2's (49,152, byte-level BPE), from the data directory."""
    if request.param == "stories260K":
        return tokenizer
    return AutoTokenizer.from_pretrained(data_dir() / "models/smollm2-135m-instruct",
                                         gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def spans(tokenizer, text):
    return tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]


def count(tokenizer, text):
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def resolve_chain(block: str, question: str) -> str:
    """The value of the variable the question asks, following the block's assignments (independent of needles.py)."""
    value = dict(re.findall(r"VAR ([A-Z]{5}) = (\d+)\.", block))
    copy = dict(re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})\.", block))
    assert len(value) + len(copy) == block.count("VAR ") - block.count("= VAR ")  # every assignment parsed
    name = re.fullmatch(r"\n\nQuestion: what is the value of VAR ([A-Z]{5})\? Answer: VAR \1 =", question).group(1)
    hops = 0
    while name in copy:
        name, hops = copy[name], hops + 1
    assert hops == 4  # the asked variable is the last of its chain
    return value[name]


@pytest.mark.parametrize("kind", KINDS)
def test_documents_are_reproducible_from_the_seed(tokenizer, kind):
    lengths = LENGTHS[kind]
    docs = needle_documents(tokenizer, kind, lengths, [0.0, 0.5], 2, seed=3)
    again = needle_documents(tokenizer, kind, lengths, [0.0, 0.5], 2, seed=3)
    assert json.dumps(docs) == json.dumps(again)
    other = needle_documents(tokenizer, kind, lengths, [0.0, 0.5], 2, seed=4)
    assert all(a["context"] != b["context"] and a["needle"] != b["needle"] for a, b in zip(docs, other))
    assert [(d["length"], d["depth"], d["index"]) for d in docs] == [
        (n, d, i) for n in lengths for d in [0.0, 0.5] for i in range(2)]
    # a document depends on its cell and index only: more lengths, depths or documents change no other
    assert needle_documents(tokenizer, kind, lengths[1:], [0.5], 3, seed=3)[:2] == docs[6:8]


@pytest.mark.parametrize("kind", KINDS)
def test_length_depth_and_answer_by_value(any_tokenizer, kind):
    tok = any_tokenizer
    from kvquant.scoring.passkey import FILLER

    filler = (data_dir() / FILLER).read_text(encoding="utf-8")
    docs = needle_documents(tok, kind, LENGTHS[kind], DEPTHS, 2, seed=11)
    exact = 0
    for doc in docs:
        context, block, question, answer = doc["context"], doc["needle"], doc["question"], doc["target"][1:]
        tokens = count(tok, context)
        assert doc["context_tokens"] == tokens and abs(tokens - doc["length"]) <= 2
        exact += tokens == doc["length"]
        # the context is the instruction, real WikiText with the block inside it, and the question
        intro = INTROS[kind]
        assert context.startswith(intro) and context.endswith(question) and context.count(block) == 1
        char = context.index(block)
        before, after = context[len(intro) : char], context[char + len(block) : len(context) - len(question)]
        haystacks = {before + after, before + after[1:], before[:-1] + after}  # one space may join the block
        assert any(h in filler for h in haystacks)
        # the needle's first token sits at its depth of the haystack
        first = next(i for i, (_, end) in enumerate(spans(tok, context)) if end > char)
        hay = tokens - count(tok, intro) - count(tok, block) - count(tok, question)
        assert doc["needle_token"] == first and abs(first - count(tok, intro) - doc["depth"] * hay) <= 20
        assert hay >= count(tok, intro + block + " " + question) - 6  # no shorter than its own text (+- joins)
        if doc["depth"] == 0.0:
            assert context.startswith(intro + block)
        if doc["depth"] == 1.0:
            assert context.endswith(block + question)
        # the answer is in the block, once in the whole context; the choices are of its form
        assert context.count(answer) == 1 and char <= context.index(answer) < char + len(block)
        assert doc["choices"][doc["gold"]] == doc["target"] and len(set(doc["choices"])) == len(doc["choices"])
        assert all(re.fullmatch(rf" \d{{{len(answer)}}}", c) for c in doc["choices"])
        assert doc["chance"] == CHANCE[kind] == 1 / len(doc["choices"])
        wrong = [c[1:] for c in doc["choices"] if c != doc["target"]]
        assert all(context.count(w) == (0 if kind == "single" else 1) for w in wrong)
        assert all(block.count(w) == (0 if kind == "single" else 1) for w in wrong)
    assert exact >= 0.9 * len(docs)


@pytest.mark.parametrize("kind", ["single", "multikey"])
def test_the_asked_key_holds_the_answer(tokenizer, kind):
    for doc in needle_documents(tokenizer, kind, LENGTHS[kind], [0.3, 0.7], 3, seed=5):
        key = re.fullmatch(r"\n\nWhat is the special magic number for ([a-z]+-[a-z]+) mentioned in the provided "
                           r"text\? The special magic number for \1 mentioned in the provided text is",
                           doc["question"]).group(1)
        needles = dict(re.findall(r"The special magic number for ([a-z]+-[a-z]+) is: (\d{7})\.", doc["needle"]))
        assert len(needles) == (1 if kind == "single" else 4) and " " + needles[key] == doc["target"]
        assert doc["context"].count(key) == 3  # in its needle and twice in the question only
        if kind == "multikey":
            assert sorted(" " + v for v in needles.values()) == sorted(doc["choices"])


def test_the_variable_chain_gives_the_answer(tokenizer):
    docs = needle_documents(tokenizer, "variables", LENGTHS["variables"], [0.0, 0.6], 4, seed=9)
    for doc in docs:
        assert " " + resolve_chain(doc["needle"], doc["question"]) == doc["target"]
        values = re.findall(r"VAR [A-Z]{5} = (\d+)\.", doc["needle"])
        assert sorted(" " + v for v in values) == sorted(doc["choices"])
        names = re.findall(r"VAR ([A-Z]{5}) =", doc["needle"])
        assert len(set(names)) == 10 and all(doc["context"].count(n) == doc["needle"].count(n)
                                             + doc["question"].count(n) for n in names)
    assert len({d["gold"] for d in docs}) == 2  # the right value is not always shown in the same place


@pytest.mark.parametrize("args, message", [
    (("double", [600], [0.5], 1), r"^needle kind 'double' is unknown \(kinds: single, multikey, variables\)$"),
    (("single", [600], [1.5], 1), r"^needle depth 1.5 is not a number in \[0, 1\]"),
    (("single", [600], [-0.1], 1), r"^needle depth -0.1 is not a number in \[0, 1\]"),
    (("single", [600], [float("nan")], 1), r"^needle depth nan is not a number in \[0, 1\]"),
    (("single", [600], [True], 1), r"^needle depth True is not a number"),
    (("single", [600], [0.5, 0.5], 1), r"^needle depths repeat: \[0.5, 0.5\]$"),
    (("single", [0, 600], [0.5], 1), r"^needle length 0 must be an integer >= 1, got int 0$"),
    (("single", [-600], [0.5], 1), r"^needle length -600 must be an integer >= 1"),
    (("single", [600.0], [0.5], 1), r"^needle length 600.0 must be an integer >= 1, got float 600.0$"),
    (("single", [2000, 600], [0.5], 1), r"^needle lengths must increase: 600 after 2000$"),
    (("single", [600, 600], [0.5], 1), r"^needle lengths must increase: 600 after 600$"),
    (("single", [], [0.5], 1), r"^needle documents need lengths and depths"),
    (("single", [600], [0.5], 0), r"^needle documents per cell must be an integer >= 1, got int 0$"),
])
def test_bad_input_is_one_line_naming_it(tokenizer, args, message):
    with pytest.raises(KVQuantError, match=message):
        needle_documents(tokenizer, *args, seed=0)


@pytest.mark.parametrize("kind, length", [("single", 300), ("multikey", 400), ("variables", 20)])
def test_a_needle_longer_than_its_haystack_is_refused(tokenizer, kind, length):
    with pytest.raises(KVQuantError, match=rf"^needle length {length} leaves a haystack of \d+ tokens, shorter than "
                       rf"the {kind} needle's own text \(instruction, needle and question: \d+ tokens") as err:
        needle_documents(tokenizer, kind, [length, 5000], [0.5], 2)
    haystack, own = map(int, re.search(r"haystack of (\d+) .* question: (\d+) tokens", str(err.value)).groups())
    assert haystack == max(length - own, 0) < own and f"a length of about {2 * own} or more fits" in str(err.value)
    for doc in needle_documents(tokenizer, kind, [2 * own + 20], [0.5], 2):  # the length it suggests (with room)
        assert count(tokenizer, INTROS[kind] + doc["needle"] + " " + doc["question"]) <= own + 10
