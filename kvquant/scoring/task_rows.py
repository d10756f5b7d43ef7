"""The rows an offline task can score (:func:`kvquant.scoring.tasks.check_task_data` reads each row of a task's data
file
through :func:`row_problem`): each field the task reads there, of the type and value it needs."""

from __future__ import annotations

import re

#: the fields a task reads that are not strings (the others must be)
NOT_STRINGS = {"endings", "label", "choices"}


def row_problem(task: str, row: dict, fields: tuple[str, ...]) -> str | None:
    """What keeps ``task`` from scoring ``row`` (a missing one of the ``fields`` it reads, or one of the wrong type
    or value), else None."""
    missing = [f for f in fields if f not in row]
    if missing:
        return f"no field {missing[0]!r} (the task reads {', '.join(fields)})"
    wrong = [f for f in fields if f not in NOT_STRINGS and not isinstance(row[f], str)]
    if wrong:
        return f"field {wrong[0]!r} is {_short_repr(row[wrong[0]])}, not a string"
    return ROW_CHECKS.get(task, lambda _: None)(row)


def _short_repr(value) -> str:
    """``value`` for a message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _string_list(value) -> bool:
    """``value`` is a non-empty list of strings."""
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def _hellaswag(row: dict) -> str | None:
    """``endings``: the choices; ``label``: the index of the right one, an int or a string of digits (lm-eval
    renders it and reads the digits back)."""
    endings, label = row["endings"], row["label"]
    if not _string_list(endings):
        return f"field 'endings' is {_short_repr(endings)}, not a non-empty list of strings"
    digits = isinstance(label, str) and re.fullmatch(r"0|[1-9][0-9]*", label)
    index = label if type(label) is int else int(label) if digits else None
    if index is None or not 0 <= index < len(endings):
        return f"field 'label' is {_short_repr(label)}, not the index of one of the {len(endings)} endings"
    return None


def _arc(row: dict) -> str | None:
    """``choices``: ``{"text": [...], "label": [...]}`` of the same length; ``answerKey``: one of the labels."""
    choices = row["choices"]
    if not (isinstance(choices, dict) and _string_list(choices.get("text")) and _string_list(choices.get("label"))
            and len(choices["text"]) == len(choices["label"])):
        return (f"field 'choices' is {_short_repr(choices)}, not an object of two string lists of the same length, "
                "'text' and 'label'")
    if row["answerKey"] not in choices["label"]:
        return f"field 'answerKey' is {row['answerKey']!r}, not one of choices.label ({', '.join(choices['label'])})"
    return None


def _binary_label(row: dict) -> str | None:
    """``label``: the index of the right one of two choices (``true``/``false`` or 0/1)."""
    label = row["label"]
    if type(label) not in (bool, int) or label not in (0, 1):
        return f"field 'label' is {_short_repr(label)}, not 0, 1, true or false"
    return None


def _winogrande(row: dict) -> str | None:
    """``sentence``: a blank ``_`` (where an option goes) and the words after it (the scored part); ``answer``:
    ``'1'`` or ``'2'``."""
    sentence = row["sentence"]
    if not sentence.partition("_")[2].strip():
        return f"field 'sentence' is {_short_repr(sentence)}, not a sentence with a blank '_' and words after it"
    if row["answer"] not in ("1", "2"):
        return f"field 'answer' is {_short_repr(row['answer'])}, not '1' or '2'"
    return None


def _lambada(row: dict) -> str | None:
    """``text``: ends in a word, the one the task predicts (after the last space)."""
    if not row["text"].split(" ")[-1].strip():
        return f"field 'text' is {_short_repr(row['text'])}, which does not end in a word to predict"
    return None


#: task -> its checks of a row beyond the fields being there and the string fields being strings
ROW_CHECKS = {"hellaswag": _hellaswag, "arc_easy": _arc, "arc_challenge": _arc, "piqa": _binary_label,
              "boolq": _binary_label, "winogrande": _winogrande, "lambada_openai": _lambada}
