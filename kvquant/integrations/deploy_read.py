"""``results.json`` as ``python -m kvquant.export`` reads it: only a file this user's own run wrote, and only a
document whose every value export uses is what the runner writes.

- **Whose file**: the report directory must be a real directory (not a symlink: the runner refuses one too) and
  ``results.json`` a regular file (not a symlink, FIFO or device), both owned by this user, the file at most
  :data:`MAX_BYTES`.
- **Signed**: its signature must verify under this user's key (:mod:`kvquant.signing`), unless the caller trusts
  an unsigned file (``--trust-unsigned``: a report of an older kvquant, or one copied from another machine).
- **Well formed** (defence in depth, and for files of older kvquants): the types of every value export reads; a
  chosen setting only under a PASS decision, with a PASS verdict, every gated metric passing at finite values;
  per-layer keys ``N`` or ``N-M`` (``N <= M``) naming layers the model has (the report's per-layer memory says
  how many, at most :data:`MAX_LAYERS`), no layer named twice; static scales finite and positive in float32.

Every refusal is one :class:`KVQuantError` line naming the file, the key and the value. What passes is typed
(:class:`Report`, :class:`CandidateRecord`, :class:`MetricRecord`): the renderers read nothing else.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from kvquant.cache.build import layer_bounds
from kvquant.errors import KVQuantError, is_python_int, one_line
from kvquant.signing import why_unverified

MAX_BYTES = 256 * 2**20
#: more layers than any model has (a bound, so that no edited file makes a DEPLOY.md of megabytes)
MAX_LAYERS = 4096
#: more KV heads per layer than any model has (per-head scales are one per KV head)
MAX_HEADS = 4096
#: more gated metrics than any report has (each is a row of DEPLOY.md's table, its name cut at 200 characters)
MAX_GATED = 1024
DECISIONS = ("pass", "fail", "inconclusive")
#: the form of a per-layer key the runner writes (``N`` or ``N-M``, ASCII digits, no spaces): export refuses any other
#: key a config could spell (``" 5"``, ``"0 - 3"``); :func:`kvquant.cache.build.layer_bounds` reads the layers
SELECTOR = re.compile(r"[0-9]{1,7}(?:-[0-9]{1,7})?")
SCALES = ("k_scale", "v_scale")
WROTE = "not a results.json this kvquant writes (rerun python -m kvquant.run)"


def _own(info: os.stat_result, what: Path) -> None:
    if info.st_uid != os.getuid():
        raise KVQuantError(f"{what} belongs to another user (uid {info.st_uid}); kvquant exports only reports your "
                           "own runs wrote")


def _open_dir(report_dir: Path) -> int:
    """A descriptor of ``report_dir``: a real directory of this user's, never reached through a symlink."""
    try:
        info = os.lstat(report_dir)
    except (OSError, ValueError) as err:
        raise KVQuantError(f"{report_dir} is not a kvquant report directory ({getattr(err, 'strerror', None) or err})"
                           ) from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise KVQuantError(f"{report_dir} is {kind}; kvquant exports only from a real report directory (the runner "
                           "refuses a symlinked one too): name the directory itself")
    _own(info, report_dir)
    try:
        fd = os.open(report_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise KVQuantError(f"cannot open {report_dir} ({err.strerror})") from None
    if not os.path.samestat(info, os.fstat(fd)):
        os.close(fd)
        raise KVQuantError(f"{report_dir} was replaced while kvquant opened it; export it again")
    return fd


def open_results(report_dir: Path, limit: int = MAX_BYTES, reader: str = "a report holds") -> int:
    """A descriptor of ``report_dir/results.json``, opened for reading once the directory and the file are checked
    (see the module docstring: whose file, how large: at most ``limit`` bytes, what ``reader`` says of it)."""
    path, dir_fd = report_dir / "results.json", _open_dir(report_dir)
    try:
        fd = os.open("results.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as err:
        why = "a symlink is refused" if os.path.islink(path) else err.strerror
        raise KVQuantError(f"{report_dir} is not a kvquant report directory: cannot read {path.name} ({why})"
                           ) from None
    finally:
        os.close(dir_fd)
    info = os.fstat(fd)
    try:
        if not stat.S_ISREG(info.st_mode):  # a directory, FIFO or device (a directory opens, but cannot be read)
            raise KVQuantError(f"{path} is not a regular file; kvquant exports only the results.json its runner "
                               "wrote")
        _own(info, path)
        if info.st_size > limit:
            raise KVQuantError(f"{path} is {info.st_size:,} bytes, more than the {limit:,} {reader}; {WROTE}")
    except KVQuantError:
        os.close(fd)
        raise
    return fd


def read_results(report_dir: Path, limit: int = MAX_BYTES, reader: str = "a report holds") -> bytes:
    """The bytes of ``report_dir/results.json`` (:func:`open_results`), at most ``limit``."""
    with os.fdopen(open_results(report_dir, limit, reader), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # grown since it was checked
        raise KVQuantError(f"{report_dir / 'results.json'} is more than the {limit:,} bytes {reader}; {WROTE}")
    return data


def load_report(report_dir: Path, trust_unsigned: bool = False) -> Report:
    """``results.json`` of a report directory, read, verified, checked and typed (see the module docstring), or one
    line naming what is wrong."""
    doc = verified_document(report_dir, trust_unsigned, "export deploys only what your own run decided")
    return checked_report(doc, report_dir / "results.json")


def verified_document(report_dir: Path, trust_unsigned: bool, why_signed: str, limit: int = MAX_BYTES,
                      reader: str = "a report holds") -> dict:
    """``results.json`` of a report directory, read and parsed, its signature verified under this user's key
    unless ``trust_unsigned`` (else one line: ``why_signed`` says why the command needs it); at most ``limit``
    bytes (``reader``: who bounds it so, for the refusal)."""
    path = report_dir / "results.json"
    data = read_results(report_dir, limit, reader)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeError, ValueError, RecursionError) as err:
        raise KVQuantError(f"{path} is not a kvquant results.json (not JSON: {one_line(err)[:80]})") from None
    if not isinstance(doc, dict):
        raise KVQuantError(f"{path} is not a kvquant results.json (not a JSON object but {type(doc).__name__})")
    if not trust_unsigned:
        try:
            why = why_unverified(doc)
        except RecursionError:
            why = "it is nested too deep to verify"
        if why:
            raise KVQuantError(f"{path}: {why}; {why_signed}: rerun python -m kvquant.run, or pass --trust-unsigned "
                               "once you have checked this file")
    return doc


def quote(text, limit: int = 80) -> str:
    """A name from the file for a message: its ``repr`` (control characters escaped), cut at ``limit``."""
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[:limit]}...'"


def _type_and_repr(value) -> str:
    with contextlib.suppress(Exception):
        text = one_line(repr(value[:100] if isinstance(value, str | list) else value))
        return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
    return type(value).__name__


def need(ok: bool, path: Path, where: str, wanted: str, value) -> None:
    """One line naming ``where`` in the file at ``path`` unless ``ok``."""
    if not ok:
        raise KVQuantError(f"{path}: {where} must be {wanted}, got {_type_and_repr(value)}; {WROTE}")


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value) -> bool:
    """A number (not a bool) that is finite as a float (a JSON integer of 400 digits is not)."""
    try:
        return is_number(value) and math.isfinite(value)
    except OverflowError:
        return False


def check_document(doc: dict, path: Path) -> None:
    """The types of every value export reads, and the chosen setting (:func:`check_chosen`)."""
    if not {"decision", "chosen", "candidates"} <= set(doc):
        raise KVQuantError(f"{path} is not a kvquant results.json (no decision, chosen or candidates)")
    need(doc["decision"] in DECISIONS, path, "decision", f"one of {', '.join(DECISIONS)}", doc["decision"])
    for key in ("chosen", "reason", "command", "run_id"):
        need(doc.get(key) is None or isinstance(doc[key], str), path, key, "a string", doc.get(key))
    model = doc.get("config", {})
    need(isinstance(model, dict), path, "config", "an object", model)
    need(isinstance(model.get("model", {}), dict), path, "config.model", "an object", model.get("model"))
    need(isinstance(model.get("model", {}).get("path", ""), str), path, "config.model.path", "a string",
         model.get("model", {}).get("path"))
    need(isinstance(doc["candidates"], list), path, "candidates", "a list", doc["candidates"])
    for i, candidate in enumerate(doc["candidates"]):
        check_recorded_candidate(candidate, path, f"candidates[{i}]")
    if doc["chosen"] is not None:
        check_chosen(doc, path)


def check_recorded_candidate(candidate, path: Path, where: str) -> None:
    """What export reads of every candidate (its name, settings, bits and verdict, its metrics' types)."""
    need(isinstance(candidate, dict), path, where, "an object", candidate)
    need(isinstance(candidate.get("name"), str), path, f"{where}.name", "a string", candidate.get("name"))
    settings = candidate.get("settings")
    need(isinstance(settings, dict), path, f"{where}.settings", "an object", settings)
    need(isinstance(settings.get("quantizer"), str), path, f"{where}.settings.quantizer", "a string",
         settings.get("quantizer"))
    need(isinstance(settings.get("layers") or {}, dict), path, f"{where}.settings.layers", "an object",
         settings.get("layers"))
    bits = candidate.get("bits_per_element")
    need(is_finite(bits) and bits >= 0, path, f"{where}.bits_per_element", "a finite number >= 0", bits)
    need(isinstance(candidate.get("verdict"), str), path, f"{where}.verdict", "a string", candidate.get("verdict"))
    metrics = candidate.get("metrics")
    need(isinstance(metrics, dict), path, f"{where}.metrics", "an object", metrics)
    for name, metric in metrics.items():
        at = f"{where}.metrics[{quote(name)}]"
        need(isinstance(metric, dict), path, at, "an object", metric)
        need(isinstance(metric.get("gated", False), bool), path, f"{at}.gated", "true or false", metric.get("gated"))
        need(isinstance(metric.get("verdict"), str), path, f"{at}.verdict", "a string", metric.get("verdict"))
        for key in ("value", "baseline"):  # NaN where nothing was measured; never a float's overflow
            value = metric.get(key)
            need(is_finite(value) or isinstance(value, float), path, f"{at}.{key}", "a number", value)


def chosen_candidate(doc: dict) -> dict | None:
    """The candidate the decision chose (the first of its name), else None."""
    return next((c for c in doc["candidates"] if c["name"] == doc["chosen"]), None)


def check_chosen(doc: dict, path: Path) -> None:
    """A chosen setting only under a PASS decision, itself passed on every gated metric at finite values, its
    per-layer settings naming layers the model has and its static scales usable."""
    chosen, name = chosen_candidate(doc), doc["chosen"]
    if chosen is None:
        raise KVQuantError(f"{path}: the chosen setting {quote(name)} is not among its candidates")
    if doc["decision"] != "pass" or chosen["verdict"] != "pass" or chosen.get("passed", True) is not True:
        raise KVQuantError(f"{path}: the decision is {doc['decision'].upper()} and {quote(name)}'s verdict "
                           f"{quote(chosen['verdict'])}, yet it names {quote(name)} as chosen: a setting is chosen "
                           f"only under a PASS decision, with a pass verdict; {WROTE}")
    gated = {k: m for k, m in chosen["metrics"].items() if m.get("gated")}
    need(len(gated) <= MAX_GATED, path, f"{quote(name)}'s gated metrics", f"at most {MAX_GATED:,}",
         f"{len(gated):,} of them")
    for metric, m in gated.items():
        at = f"{quote(name)}'s metric {quote(metric)}"
        need(m["verdict"] in ("pass", "not gated"), path, f"{at} verdict", "pass (the setting passed)", m["verdict"])
        if m["verdict"] == "pass":
            for key in ("value", "baseline"):
                need(is_finite(m[key]), path, f"{at} {key}", "finite (it passed)", m[key])
    if not any(m["verdict"] == "pass" for m in gated.values()):
        raise KVQuantError(f"{path}: {quote(name)} passed no gated metric, yet it is chosen; {WROTE}")
    layers = model_layers(doc, chosen, path)
    for candidate in doc["candidates"]:  # the chosen one's, and those export compares it with
        layer_map(candidate["settings"], layers, path, candidate["name"])
    check_scales(chosen["settings"], path, name)


def model_layers(doc: dict, chosen: dict, path: Path) -> int:
    """How many layers the model has: the chosen setting's (else the baseline's) per-layer memory entries."""
    for owner in (chosen, doc.get("baseline")):
        memory = owner.get("memory") if isinstance(owner, dict) else None
        layers = memory.get("per_layer") if isinstance(memory, dict) else None
        if layers is not None:
            need(isinstance(layers, list) and 1 <= len(layers) <= MAX_LAYERS, path, "memory.per_layer",
                 f"a list of 1 to {MAX_LAYERS} layers", layers if not isinstance(layers, list) else
                 f"{len(layers)} entries")
            return len(layers)
    raise KVQuantError(f"{path}: no per-layer memory (memory.per_layer) says how many layers the model has; {WROTE}")


def layer_map(settings: dict, layers: int, path: Path, name: str) -> dict[int, dict]:
    """Each layer a ``layers`` key of candidate ``name``'s settings names (``N`` or ``N-M``, ``N <= M < layers``)
    with its own settings; a layer named twice is refused."""
    found: dict[int, dict] = {}
    for selector, own in (settings.get("layers") or {}).items():
        at = f"{quote(name)}'s settings.layers[{quote(selector)}]"
        need(SELECTOR.fullmatch(selector) is not None, path, f"{at}'s key", "a layer N or a range N-M", selector)
        low, high = layer_bounds(selector)
        need(low <= high, path, f"{at}'s range", "low-high (low <= high)", selector)
        need(high < layers, path, f"{at}'s layers", f"below {layers} (the model's layers)", selector)
        need(isinstance(own, dict), path, at, "an object", own)
        need(isinstance(own.get("quantizer", ""), str), path, f"{at}.quantizer", "a string", own.get("quantizer"))
        twice = next((i for i in range(low, high + 1) if i in found), None)
        need(twice is None, path, f"{at}", f"the only key naming layer {twice}", selector)
        found.update(dict.fromkeys(range(low, high + 1), own))
    return found


def check_scales(settings: dict, path: Path, name: str) -> None:
    """Every static scale (``k_scale``, ``v_scale``, at the top and per layer): a number, or one per KV head,
    finite and positive as float32 (what the checkpoint stores)."""
    layers = settings.get("layers") or {}
    owners = [("settings", settings), *((f"settings.layers[{quote(k)}]", v) for k, v in layers.items())]
    for where, own in owners:
        for key in SCALES:
            if key not in own:
                continue
            value, at = own[key], f"{quote(name)}'s {where}.{key}"
            flat = value if isinstance(value, list) else [value]
            need(1 <= len(flat) <= MAX_HEADS and all(is_finite(v) for v in flat), path, at,
                 f"a finite number or a list of 1 to {MAX_HEADS} finite numbers", value)
            as_stored = torch.tensor([float(v) for v in flat], dtype=torch.float64).to(torch.float32)
            need(bool(torch.isfinite(as_stored).all() and (as_stored > 0).all()), path, at,
                 "finite and > 0 in float32 (a scale divides the states)", value)


@dataclass(frozen=True)
class MetricRecord:
    """A candidate's metric as results.json records it: its name (as the report names it), value, the baseline's,
    the gate's verdict and whether it was gated."""

    name: str
    value: float
    baseline: float
    verdict: str
    gated: bool


@dataclass(frozen=True)
class CandidateRecord:
    """A candidate as results.json records it: its name, its cache settings as the runner records them (the
    quantizer's and the cache's options, what they derived, per-layer ``layers``), bits per element as stored, the
    gate's verdict, its metrics in the report's order, and each layer a ``layers`` key names with its own settings
    (:func:`layer_map`)."""

    name: str
    settings: dict
    bits_per_element: float
    verdict: str
    metrics: tuple[MetricRecord, ...]
    layers: dict[int, dict]

    @property
    def quantizer(self) -> str:
        return self.settings["quantizer"]

    @classmethod
    def read(cls, candidate: dict, layers: int, path: Path) -> CandidateRecord:
        """A candidate of a checked document (:func:`check_document`) on a model of ``layers`` layers."""
        metrics = tuple(MetricRecord(name, m["value"], m["baseline"], m["verdict"], m.get("gated", False))
                        for name, m in candidate["metrics"].items())
        return cls(candidate["name"], candidate["settings"], candidate["bits_per_element"], candidate["verdict"],
                   metrics, layer_map(candidate["settings"], layers, path, candidate["name"]))


@dataclass(frozen=True)
class Report:
    """A checked results.json (at ``path``) as export reads it: the decision, the setting it chose (None: none),
    and where it chose one, every candidate (the chosen one among them, first of its name) and the model's layers;
    the run's id, the gate's reason, the command and the model's path (None, None, None and ``?`` where the file
    has none)."""

    path: Path
    decision: str
    chosen: CandidateRecord | None
    candidates: tuple[CandidateRecord, ...]
    layers: int | None
    run_id: str | None
    reason: str | None
    command: str | None
    model: str
    #: the chosen setting's length verdict (:func:`chosen_lengths`): (longest context shown safe, shortest shown to
    #: fail), either None; None where the run measured no long context for it
    lengths: tuple[int | None, int | None] | None = None


#: more tokens than any model's context (a bound on a length read from results.json)
MAX_LENGTH = 2**31


def chosen_lengths(doc: dict, name: str | None, path: Path) -> tuple[int | None, int | None] | None:
    """The length verdict results.json's ``long_context`` holds for the candidate ``name``: (``passes_up_to``,
    ``fails_from``), each a positive number of tokens or None; None where it holds none for it."""
    found = doc.get("long_context", {}).get("candidates", {}) if isinstance(doc.get("long_context"), dict) else {}
    entry = found.get(name) if isinstance(found, dict) and name is not None else None
    if entry is None:
        return None
    need(isinstance(entry, dict), path, f"long_context.candidates.{_type_and_repr(name)}", "an object", entry)
    out = []
    for key in ("passes_up_to", "fails_from"):
        value = entry.get(key)
        need(value is None or is_python_int(value) and 0 < value <= MAX_LENGTH, path,
             f"long_context.candidates.{_type_and_repr(name)}.{key}", f"null or a number of tokens in 1..{MAX_LENGTH}",
             value)
        out.append(value)
    return out[0], out[1]


def checked_report(doc: dict, path: Path) -> Report:
    """A parsed results.json (``path``: where it is, for the messages), checked (:func:`check_document`) and
    typed."""
    check_document(doc, path)
    chosen, candidates, layers = chosen_candidate(doc), (), None
    if chosen is not None:
        layers = model_layers(doc, chosen, path)
        candidates = tuple(CandidateRecord.read(candidate, layers, path) for candidate in doc["candidates"])
    return Report(path, doc["decision"], next((c for c in candidates if c.name == doc["chosen"]), None), candidates,
                  layers, doc.get("run_id"), doc.get("reason"), doc.get("command"),
                  doc.get("config", {}).get("model", {}).get("path", "?"), chosen_lengths(doc, doc.get("chosen"), path))
