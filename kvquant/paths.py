"""Where local copies of models and data live, so the same configs work offline and with a hub.

A reference ``local:PATH`` (in configs: ``model: {path: local:models/stories260K/hf}``) names a file under the
data directory: ``$KVQUANT_DATA`` when set, else ``../shared/data`` beside the project checkout. A reference
``package:NAME`` names a model installed as a Python package (:mod:`kvquant.packaged`): the folder of its
assembled, verified GGUF file in kvquant's cache. Anything else is used as given: a filesystem path or a Hugging
Face hub id.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvquant.errors import KVQuantError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
LOCAL_PREFIX = "local:"
#: A file or folder name holds at most 255 bytes (ext4, XFS, btrfs, tmpfs), a path at most 4,096 (Linux PATH_MAX).
NAME_MAX, PATH_MAX = 255, 4096
#: The longest name kvquant turns into a file or folder name (run, candidate, perplexity set, search, task): it
#: adds up to 45 bytes around it (``task__<task>@1000000-1000000.json``, its temporary and set-aside names), which
#: must still fit :data:`NAME_MAX`.
MAX_NAME_BYTES = 128
#: The longest ``output_dir``: with a report's own folders and files below it, a path stays within :data:`PATH_MAX`.
MAX_FOLDER_BYTES = 2048


def folder_problem(path: str) -> str | None:
    """Why ``path`` cannot be a folder's path on this system (a NUL, a name past :data:`NAME_MAX` bytes, the
    whole past :data:`MAX_FOLDER_BYTES`), else None."""
    if "\0" in path:
        return f"{path!r:.60} holds a NUL character, which no file name can"
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError as err:
        return f"{path!r:.60} holds a lone surrogate (character {err.start}), which no file name can"
    long = next((part for part in path.split("/") if len(part.encode("utf-8")) > NAME_MAX), None)
    if long is not None:
        return (f"the folder name {long[:24]!r}... is {len(long.encode('utf-8'))} bytes long; a file or folder name "
                f"holds at most {NAME_MAX}")
    if size > MAX_FOLDER_BYTES:
        return f"{path[:24]!r}... is {size} bytes long; a report folder's path holds at most {MAX_FOLDER_BYTES}"
    return None


def data_dir() -> Path | None:
    """The local data directory, or None when there is none."""
    env = os.environ.get("KVQUANT_DATA")
    if env:
        return Path(env).expanduser().resolve()
    shared = (PROJECT_ROOT.parent / "shared" / "data").resolve()
    return shared if shared.is_dir() else None


def resolve(ref: str) -> str:
    """Turn ``local:REL`` into an absolute path under :func:`data_dir` and ``package:NAME`` into the folder of
    that packaged model's verified file; return other references unchanged."""
    from kvquant.packaged import PACKAGE_PREFIX, package_folder

    if ref.startswith(PACKAGE_PREFIX):
        return package_folder(ref)
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
