"""The checks before a model loads that ``python -m kvquant.run`` and ``python -m kvquant.adopt`` share: the report
directory a run writes into, and the longest sequence it feeds."""

from __future__ import annotations

import os
from pathlib import Path

from kvquant.errors import KVQuantError
from kvquant.runner.config import ExperimentConfig
from kvquant.runner.store import check_partial
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
