"""``python -m kvquant.plan --context-from REPORT:CANDIDATE``: plan at the longest context a run showed a cache
setting safe at (the length verdict of ``results.json``'s ``long_context``, issue 40), so a user sizes a server for
the context the setting was shown to keep, not a longer one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvquant.errors import KVQuantError, visible
from kvquant.formats.quantizers import CACHE_OPTIONS, QUANTIZERS
from kvquant.planner.shapes import MAX_CONTEXT


@dataclass(frozen=True)
class FittedContext:
    """What ``--context-from`` takes from a report: the ``length`` its candidate ``label`` passes up to, the length
    verdict's ``summary``, the ``model`` the run measured (its config's ``model.path``, or None where the report
    does not say) and the candidate's cache ``setting`` (the options it was made with), as a ``--cache`` text."""

    label: str
    length: int
    summary: str
    model: str | None
    setting: str


def derived_names(quantizer) -> set[str]:
    """The names of what ``quantizer`` derives from a head size beside its options: the same names at every head
    size it takes, read at the first of 64, 128, 256, then every multiple of 8 up to 512, that it takes (none of
    them: an empty set)."""
    for head_dim in sorted(range(8, 513, 8), key=lambda d: (d not in (64, 128, 256), d)):
        try:
            return set(quantizer.derived_settings(head_dim))
        except KVQuantError:
            continue
    return set()


def candidate_setting(doc: dict, label: str, folder) -> str:
    """The cache options ``label`` was measured with in the report ``doc``, as the planner's ``--cache`` mapping
    text: its settings less what the quantizer derived from the model's head_dim beside them (``key_group``,
    llama.cpp's ``key_rotation_block``, ...: :meth:`kvquant.cache.KVQuantCache.derived_settings`), which are the
    settings that are neither the quantizer's options nor the cache's. One line where the candidate failed the
    report's gate (its length verdict is no safe context then) or the report does not record its settings."""
    found = [c for c in doc.get("candidates", []) if isinstance(c, dict) and c.get("name") == label]
    if len(found) != 1 or not isinstance(found[0].get("settings"), dict):
        raise KVQuantError(f"--context-from: {folder} records no cache settings for {visible(label, 80)}, so the "
                           "planner cannot plan the setting it measured")
    if found[0].get("verdict") == "fail":
        raise KVQuantError(f"--context-from: {visible(label, 80)} FAILED the gate in {folder}; a setting the report "
                           "rejected has no safe context to plan for")
    settings = found[0]["settings"]
    try:
        options = {*QUANTIZERS.options(settings.get("quantizer")), *CACHE_OPTIONS, "quantizer"}
        own = {k: v for k, v in settings.items() if k in options and k not in (*CACHE_OPTIONS, "quantizer")}
        unknown = sorted(set(settings) - options - derived_names(QUANTIZERS.build(settings["quantizer"], **own)))
    except KVQuantError as e:
        raise KVQuantError(f"--context-from: {folder}: {visible(label, 80)}'s settings: {e}") from None
    if unknown:
        raise KVQuantError(f"--context-from: {folder}: {visible(label, 80)} was measured with "
                           f"{', '.join(visible(k, 40) for k in unknown)}, no option of {settings['quantizer']} here "
                           "(a report of another kvquant version?); the planner plans only the setting measured")
    return json.dumps({k: v for k, v in settings.items() if k in options}, sort_keys=True)


#: The largest results.json ``--context-from`` reads: verifying one is a parse and a canonical dump of the whole
#: file, ~0.07 s per MiB on 2 cores, so the planner answers within its 10 s (the largest committed report: 0.24 MiB;
#: export reads up to 256 MiB).
PLAN_MAX_BYTES = 16 * 2**20


def fitted_context(text: str, trust_unsigned: bool = False) -> FittedContext:
    """``REPORT_DIR:CANDIDATE`` → the candidate's ``passes_up_to`` in that report, its summary, the model and the
    setting it was measured with (:class:`FittedContext`), read from the report's ``results.json`` signed by this
    user's run (or, with ``trust_unsigned``, any); one line where the report has no length verdict for it, it passes
    at no length, or it failed the report's gate."""
    from kvquant.integrations.deploy_read import verified_document

    folder, sep, label = text.rpartition(":")
    if not sep or not folder or not label:
        raise KVQuantError(f"--context-from: {text[:120]!r} must be REPORT_DIR:CANDIDATE, e.g. "
                           "reports/smollm2-long-gate:int4-g32")
    doc = verified_document(Path(folder), trust_unsigned, "the planner takes a context only from your own run",
                            PLAN_MAX_BYTES, "the planner reads (a report's results.json holds well under 1 MiB)")
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
    if not isinstance(length, int) or isinstance(length, bool) or not 1 <= length <= MAX_CONTEXT:
        raise KVQuantError(f"--context-from: {folder}: {label}'s passes_up_to is {str(length)[:40]}, not a number "
                           f"of tokens in 1..{MAX_CONTEXT:,}")
    config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    model = config.get("model", {}).get("path") if isinstance(config.get("model"), dict) else None
    return FittedContext(label, length, str(found.get("summary", "")), model if isinstance(model, str) else None,
                         candidate_setting(doc, label, folder))
