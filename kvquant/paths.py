"""Where local copies of models and data live, so the same configs work offline and with a hub.

A reference ``local:PATH`` (in configs: ``model: {path: local:models/stories260K/hf}``) names a file under the
data directory: ``$KVQUANT_DATA`` when set, else ``../shared/data`` beside the project checkout. Anything
else is used as given: a filesystem path or a Hugging Face hub id.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import KVQuantError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
LOCAL_PREFIX = "local:"


def data_dir() -> Path | None:
    """The local data directory, or None when there is none."""
    env = os.environ.get("KVQUANT_DATA")
    if env:
        return Path(env).expanduser().resolve()
    shared = (PROJECT_ROOT.parent / "shared" / "data").resolve()
    return shared if shared.is_dir() else None


def resolve(ref: str) -> str:
    """Turn ``local:REL`` into an absolute path under :func:`data_dir`; return other references unchanged."""
    if not ref.startswith(LOCAL_PREFIX):
        return ref
    root = data_dir()
    if root is None:
        raise KVQuantError(
            f"{ref!r} needs a local data directory: set KVQUANT_DATA to a folder holding {ref[len(LOCAL_PREFIX):]}"
        )
    path = root / ref[len(LOCAL_PREFIX) :]
    if not path.exists():
        raise KVQuantError(f"{ref!r}: {path} does not exist (data directory {root}; set KVQUANT_DATA to change it)")
    return str(path)
