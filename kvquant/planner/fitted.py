"""``python -m kvquant.plan --context-from REPORT:CANDIDATE``: plan at the longest context a run showed a cache
setting safe at (the length verdict of ``results.json``'s ``long_context``, issue 40), so a user sizes a server for
the context the setting was shown to keep, not a longer one."""

from __future__ import annotations

from pathlib import Path

from kvquant.errors import KVQuantError


def fitted_context(text: str, trust_unsigned: bool = False) -> tuple[int, str]:
    """``REPORT_DIR:CANDIDATE`` → (the candidate's ``passes_up_to`` in that report, its summary), read from the
    report's ``results.json`` signed by this user's run (or, with ``trust_unsigned``, any); one line where the report
    has no length verdict for it, or it passes at no length."""
    from kvquant.integrations.deploy_read import verified_document

    folder, sep, label = text.rpartition(":")
    if not sep or not folder or not label:
        raise KVQuantError(f"--context-from: {text[:120]!r} must be REPORT_DIR:CANDIDATE, e.g. "
                           "reports/smollm2-long-gate:int4-g32")
    doc = verified_document(Path(folder), trust_unsigned, "the planner takes a context only from your own run")
    verdicts = doc.get("long_context", {}).get("candidates") if isinstance(doc.get("long_context"), dict) else None
    if not isinstance(verdicts, dict) or not verdicts:
        raise KVQuantError(f"--context-from: {folder} holds no length verdict (its run measured no long context: "
                           "eval.long_context or needle tasks)")
    found = verdicts.get(label)
    if not isinstance(found, dict):
        raise KVQuantError(f"--context-from: {folder} has no length verdict for {label!r}; it has "
                           f"{', '.join(map(str, verdicts))}")
    length = found.get("passes_up_to")
    if length is None:
        raise KVQuantError(f"--context-from: {label} is shown safe at no context in {folder} "
                           f"({found.get('summary', 'no summary')}); there is no fitted context to plan for")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise KVQuantError(f"--context-from: {folder}: {label}'s passes_up_to is {length!r}, not a positive number "
                           "of tokens")
    return length, str(found.get("summary", ""))
