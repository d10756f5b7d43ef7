"""The inputs this config's run keys each partial result with, rebuilt from the config, the model's config and its
tokenizer without loading the weights, so ``python -m kvquant.adopt`` refuses a result the run would never reuse
(:meth:`Expected.difference`).

The run builds these keys in :meth:`kvquant.scoring.session.Session.measure` (with its ``_perplexity``,
``_divergence``, ``_long``, ``_task`` and ``_memory``), :func:`kvquant.scoring.calibrate.with_calibration` and
the runner's ``serve_stages``. They are rebuilt here rather than shared, because any edit under ``kvquant/scoring/``
changes every result's code version; ``tests/test_adopt.py`` holds the two equal on a real run. Not known without the
model, so :data:`ANY` here: the weights' digest (``weights``), the settings of the maps a search measures and of the
map it chooses, the per-layer scales calibration finds (``settings.layers``). A cache that stores keys before RoPE
takes RoPE from the model's modules, so its settings are read from the model built without its weights
(:func:`model_without_weights`).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import asdict

from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM

from kvquant.cache import make_cache
from kvquant.errors import KVQuantError, one_line
from kvquant.experiment.config import SEARCH_PREFIX, Candidate, ExperimentConfig, Stage
from kvquant.runner.plausible import Shape
from kvquant.runner.search import CALIBRATION_BASELINE
from kvquant.scoring.calibrate import calibration_documents, calibration_key, calibration_split, calibration_windows
from kvquant.scoring import data
from kvquant.scoring.models import load_tokenizer, quiet_transformers
from kvquant.scoring.session import (BASELINE, cache_settings, evaluation_split, probe_tokens, sampler_key,
                                     shares_prefix, windows_digest)
from kvquant.scoring.tasks import task_data_digest


class _Any:
    def __repr__(self) -> str:
        return "ANY"


#: an input this module cannot know without the model's weights: any value is taken
ANY = _Any()
#: what a difference in a field usually means
HINTS = {"windows": "other text, tokenizer or window settings", "probe": "other text or tokenizer",
         "data": "another copy of the task's documents", "max_length": "another model config or model.max_length",
         "settings": "another cache setting, or a model of other shapes"}


def model_without_weights(model_config):
    """The model of ``model_config`` (a copy: building a model writes to its config) without its weights: its
    parameters on the meta device, its buffers computed (the rotary embedding's frequencies, which a cache that
    stores keys before RoPE is built on). A config transformers cannot build a model from is one
    :class:`KVQuantError`."""
    try:
        with init_empty_weights(include_buffers=False), quiet_transformers():
            return AutoModelForCausalLM.from_config(copy.deepcopy(model_config), trust_remote_code=False)
    except Exception as err:  # transformers raises many types for a config it cannot build
        raise KVQuantError(f"cannot build the model's modules from its config "
                           f"({getattr(model_config, 'model_type', None)!r}): {one_line(err)[:300]}") from None


class NotThisRun(Exception):
    """A (candidate, metric) this config's run does not measure."""


def plain(value):
    """``value`` as JSON reads it back (what a stored result's inputs hold), :data:`ANY` kept where it is."""
    if value is ANY:
        return ANY
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return json.loads(json.dumps(value, default=str))


def difference(expected, found, where: str = "inputs") -> str | None:
    """The first way the inputs ``found`` differ from ``expected`` (:func:`plain`; :data:`ANY`: any value), as one
    phrase naming the field; None where they agree. Values are compared as JSON text (``1`` is not ``1.0``, as
    the keys they make differ)."""
    if expected is ANY:
        return None
    if isinstance(expected, dict) and isinstance(found, dict):
        for name in sorted(expected.keys() | found.keys()):
            if name not in found:
                return f"{where} lack {name!r}, which this config's run keys its results with"
            if name not in expected:
                return f"{where}.{name} is no input of this config's run"
            reason = difference(expected[name], found[name], f"{where}.{name}")
            if reason:
                return reason
        return None
    if json.dumps(expected, sort_keys=True) == json.dumps(found, sort_keys=True):
        return None
    top = where.split(".")[1] if where.count(".") else where
    hint = f" ({HINTS[top]})" if top in HINTS else ""
    return f"{where} is {_short_json(found)}, this config's run would use {_short_json(expected)}{hint}"


def _short_json(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


class Expected:
    """What ``cfg``'s run would key each (candidate, metric) with; ``model_config``: the model's transformers
    config (:func:`kvquant.scoring.models.check_model`), ``maxlen``: the longest sequence the run feeds. The
    tokenizer and the perplexity text are read on first need."""

    def __init__(self, cfg: ExperimentConfig, model_config, maxlen: int):
        self.cfg, self.model_config, self.maxlen = cfg, model_config, maxlen
        self.given = {c.label: c for c in cfg.stages or cfg.candidates}

    def difference(self, candidate: str, metric: str, inputs: dict) -> str | None:
        """How a stored result's ``inputs`` differ from those this run would key ``(candidate, metric)`` with
        (its code version and ``result_of`` aside), or that the run measures no such result; None: they agree."""
        try:
            with quiet_transformers():  # a text longer than the model: cut into windows, as the run cuts it
                expected = plain(self.inputs(candidate, metric))
        except NotThisRun as err:
            return str(err)
        return difference(expected, {k: v for k, v in inputs.items() if k not in ("code", "result_of")})

    def inputs(self, label: str, metric: str) -> dict:
        """The inputs of ``(label, metric)`` (:data:`ANY` where unknown); :class:`NotThisRun` where the run
        measures no such result."""
        if metric == "serving":
            return self._serving(label)
        if metric == "calibration":
            return self._calibration(label)
        split, settings, candidate = self._measurement(label)
        cfg = self.cfg
        key = {"model": asdict(cfg.model), "weights": ANY, "mode": cfg.eval.mode, "chunk_size": cfg.eval.chunk_size,
               "batch_size": cfg.eval.batch_size, "seed": cfg.eval.seed, "max_length": self.maxlen, "split": split,
               "settings": settings, **({} if shares_prefix(candidate) else {"prefix_sharing": False})}
        kind, _, name = metric.partition("/")
        if kind in ("ppl", "kl") and name and not (kind == "kl" and candidate is BASELINE):
            return {**key, "windows": self._windows(split, name, label, metric)}
        if kind == "task" and name:
            return {**key, **self._task(split, name, label, metric)}
        long = cfg.eval.long_context
        if kind == "long" and split == "evaluation" and candidate is not BASELINE and long and name == long.text:
            return {**key, "windows": windows_digest(self._evaluation.long, long=True)}
        if metric == "memory" and split == "evaluation":
            return {**key, "probe": probe_tokens(cfg, self._evaluation, self._text[0], self.maxlen)}
        raise NotThisRun(f"this config's run measures no {metric} of {label}")

    def shape(self, label: str, metric: str, inputs: dict) -> Shape | None:
        """What the result of ``(label, metric)`` keyed with ``inputs`` (checked equal to :meth:`inputs`) holds one
        value for (:class:`~kvquant.runner.plausible.Shape`): the scored tokens of each window it read, or its
        documents; None for a result without such a shape (memory, calibration, serving)."""
        kind, _, name = metric.partition("/")
        split = inputs.get("split")
        if kind in ("ppl", "kl"):
            windows = self._evaluation.windows.get(name) if split == "evaluation" else \
                self._search_windows.get(name, (None, None))[1]
            return Shape(tokens=tuple(len(w.ids) - w.score_from for w in windows)) if windows else None
        if kind == "long":
            return Shape(tokens=tuple(len(w.ids) for w in self._evaluation.long))
        if kind == "task":
            span = inputs.get("documents")
            if isinstance(span, list) and len(span) == 2:
                return Shape(documents=span[1] - span[0], exact=True)
            return Shape(documents=inputs.get("limit"))
        return None

    def _measurement(self, label: str) -> tuple[str, object, Candidate | None]:
        """``label``'s split, cache settings (as :func:`kvquant.scoring.session.cache_settings` gives them) and
        setting (None: one a search finds)."""
        search = self.cfg.search
        if label in (BASELINE.label, *self.given):
            return "evaluation", self._settings(label), self.given.get(label, BASELINE)
        if search and label == CALIBRATION_BASELINE:
            return "calibration", self._settings(BASELINE.label), BASELINE
        if search and label == search.name:
            return "evaluation", ANY, None
        if search and re.fullmatch(re.escape(SEARCH_PREFIX) + "[0-9a-f]{16}", label):
            return "calibration", ANY, None
        measured = [BASELINE.label, *self.given, *([search.name, SEARCH_PREFIX + "..."] if search else [])]
        raise NotThisRun(f"this config's run measures no candidate {label!r} (it measures {', '.join(measured)})")

    @functools.cached_property
    def _without_weights(self):
        """:func:`model_without_weights` of this model, built once for every pre-RoPE setting."""
        return model_without_weights(self.model_config)

    @functools.cache  # noqa: B019  (one object per command)
    def _settings(self, label: str):
        """A given setting's cache settings on this model; a calibrating one's per-layer scales are :data:`ANY`."""
        candidate = self.given.get(label, BASELINE)
        model = self._without_weights if candidate.spec.pre_rope else self.model_config  # make_cache takes RoPE there
        settings = cache_settings(make_cache(model, candidate.spec))
        return {**settings, "layers": ANY} if candidate.calibrate else settings

    def _windows(self, split: str, name: str, label: str, metric: str) -> str:
        if split == "evaluation" and name in self._evaluation.windows:
            return windows_digest(self._evaluation.windows[name])
        if split == "calibration" and name in self._search_windows:
            return windows_digest(self._search_windows[name][1])
        raise NotThisRun(f"this config's run measures no {metric} of {label} (no such perplexity set on its "
                         f"{split} split)")

    def _task(self, split: str, name: str, label: str, metric: str) -> dict:
        """A task result's own inputs: the task, its documents, shots and data file."""
        cfg, (task, _, part) = self.cfg, name.partition("@")
        looks = task in cfg.gated_tasks() and cfg.gate.max_documents is not None
        span = re.fullmatch(r"(\d+)-(\d+)", part)
        if task not in cfg.eval.tasks.names:
            which = None
        elif split == "calibration":
            which = None if part or task not in calibration_documents(cfg) else {
                "documents": [calibration_documents(cfg)[task].start, calibration_documents(cfg)[task].stop]}
        elif part:  # a sequential look's documents: the look's bounds are checked against its name only
            which = {"documents": [int(span[1]), int(span[2])]} if looks and span else None
        else:
            which = {"limit": cfg.eval.tasks.limit_for(task)}
        if which is None:
            raise NotThisRun(f"this config's run measures no {metric} of {label}")
        return {"task": task, **which, "num_fewshot": cfg.eval.tasks.fewshot_for(task), **sampler_key(cfg),
                "data": task_data_digest(task)}

    def _calibration(self, label: str) -> dict:
        """A calibrating setting's observed ranges (as :func:`kvquant.scoring.calibrate.with_calibration` keys
        them)."""
        candidate = self.given.get(label)
        if candidate is None or not candidate.calibrate:
            raise NotThisRun(f"this config's run calibrates no {label!r}")
        tokenizer, rows = self._text
        windows = calibration_split(self.cfg, candidate, tokenizer, self.maxlen, rows)
        return calibration_key(self.cfg, candidate, windows, ANY)

    def _serving(self, label: str) -> dict:
        """A staged run's serving measurement of a stage or the baseline (as the runner's ``serve_stages``)."""
        cfg = self.cfg
        if not cfg.stages or label not in (BASELINE.label, *self.given):
            raise NotThisRun(f"this config's run measures no serving of {label!r}")
        stage = self.given.get(label) or Stage(BASELINE.quantizer, {}, BASELINE.label)
        pset = next(p for p in cfg.eval.perplexity if cfg.serving.text in (None, p.name))
        return {"model": asdict(cfg.model), "serving": asdict(cfg.serving), "stage": asdict(stage), "text": pset.name}

    @functools.cached_property
    def _text(self) -> tuple:
        """The tokenizer and every perplexity set's rows of text, as preflight reads them."""
        return load_tokenizer(self.cfg.model), {p.name: data.load_rows(p) for p in self.cfg.eval.perplexity}

    @functools.cached_property
    def _evaluation(self):
        tokenizer, rows = self._text
        return evaluation_split(self.cfg, tokenizer, self.maxlen, rows)

    @functools.cached_property
    def _search_windows(self) -> dict:
        """The search's calibration windows per gated perplexity set (none without a search)."""
        if not self.cfg.search:
            return {}
        tokenizer, rows = self._text
        return calibration_windows(self.cfg, tokenizer, self.maxlen, rows)
