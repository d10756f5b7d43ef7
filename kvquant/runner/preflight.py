"""The checks before a model loads that ``python -m kvquant.run`` and ``python -m kvquant.adopt`` share: the report
directory a run writes into, and the longest sequence it feeds; and the run's warnings from them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvquant.errors import KVQuantError
from kvquant.experiment.config import Candidate, ExperimentConfig
from kvquant.runner.counts import count_warnings
from kvquant.runner.store import check_partial
from kvquant.scoring import parallel
from kvquant.scoring.models import DEFAULT_MAX_LENGTH, trained_context


def context_length(cfg: ExperimentConfig, model_config) -> int:
    """Longest sequence the run feeds, before the model loads (as :func:`kvquant.scoring.models.max_length` once it
    has)."""
    return cfg.model.max_length or trained_context(model_config) or DEFAULT_MAX_LENGTH


def check_report_dir(out_dir: Path) -> None:
    """The report directory can be created and written (checked without creating anything); kvquant does not
    write through a symlink at the report directory or its ``partial/``, and what it would read or replace in
    ``partial/`` is its own (:func:`kvquant.runner.store.check_partial`)."""
    for path in (out_dir, out_dir / "partial"):
        if path.is_symlink():
            raise KVQuantError(f"output_dir/name: {path} is a symlink; kvquant writes only into directories it can "
                               "trust, so move it away or write elsewhere (--set name=... or --set output_dir=...)")
    existing = next(p for p in [out_dir, *out_dir.parents] if p.exists() or p == Path(p.anchor))
    if not existing.is_dir():
        raise KVQuantError(f"output_dir/name: {existing} exists and is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise KVQuantError(f"output_dir/name: cannot write into {existing}")
    check_partial(out_dir / "partial")


def context_warnings(cfg: ExperimentConfig, model_config) -> list[str]:
    """Sequences past the model's trained context, and perplexity windows cut shorter than configured."""
    trained = trained_context(model_config)
    out = []
    if trained and cfg.model.max_length and cfg.model.max_length > trained:
        out.append(f"model.max_length {cfg.model.max_length} is past the model's trained context ({trained} "
                   "positions): scores on longer sequences measure extrapolation, not the model")
    limit = context_length(cfg, model_config)
    out += [f"perplexity set {p.name!r}: max_length {p.max_length} is cut to the model's {limit} tokens"
            for p in cfg.eval.perplexity if p.max_length > limit]
    return out


def preflight_warnings(cfg: ExperimentConfig, model_config, evicting: list[Candidate]) -> list[str]:
    """What preflight warns of, printed once the run is cleared to start (:func:`say`, so that a refusal is one
    line): the model's context against the config's lengths, fewer windows or long documents than a verdict needs
    (:func:`kvquant.runner.counts.count_warnings`), and a chunk wider than an evicting setting's window."""
    warnings = [*context_warnings(cfg, model_config), *count_warnings(cfg)]
    for c in evicting:
        window = c.spec.eviction.window
        if cfg.eval.chunk_size > window:
            warnings.append(f"{c.label}: eval.chunk_size {cfg.eval.chunk_size} is above its window {window}: a "
                            "chunk reads up to chunk_size - 1 tokens beyond the window")
    return warnings


def say(warnings: list[str]) -> None:
    """Print preflight's warnings (process 0 of several)."""
    if parallel.current().main:
        for message in warnings:
            print(f"kvquant: warning: {message}", file=sys.stderr)
