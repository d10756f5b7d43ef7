"""The measuring sources a run's results come from (:data:`MEASURING`), and a result's provenance: the code version
every result is keyed by (:func:`code_version`), the digest of those sources on disk (:func:`source_digest`, re-read
only where a file's stat changed), a run's watch over them (:class:`SourceWatch`: a change under a running run stops
it before its next signed write, so no result or report mixes two versions of the code), and the git commit that
holds them (:func:`commit_provenance`: a report names a bare commit only where that commit's measuring sources are
the ones recorded).
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
from importlib import metadata
from pathlib import Path, PurePosixPath

from kvquant.errors import KVQuantError

#: The subpackages whose code computes or decides measured values (the cache, the formats, scoring, the
#: compatibility modules, and the experiment's vocabulary: a candidate's cache setting, the documents each look
#: scores, which names are needle tasks), hashed whole: a module added to one of them is part of the code version
#: without anyone listing it. Everything else (the commands, runner, planner, report, integrations) orchestrates,
#: checks or renders: it runs afresh every time and decides no measured value, so a change there keeps finished
#: results reusable.
MEASURING = ("cache", "compat", "experiment", "formats", "scoring")
#: The package whose sources are hashed (``kvquant/``), and the folder its git checkout is rooted at.
PACKAGE = Path(__file__).resolve().parents[1]
SUFFIXES = (".py", ".cpp")

#: The last digest :func:`source_digest` computed, keyed by every file's (path, stat): a check reads the bytes
#: again only where a file was added, removed or touched (size, times or inode changed).
_last: dict = {"stats": None, "digest": None}


def _files(root: Path) -> list[Path]:
    return sorted(path for package in MEASURING for path in (root / package).rglob("*")
                  if path.suffix in SUFFIXES and path.is_file())


def digest_of(contents: dict[str, bytes]) -> str:
    """The code version's source digest of ``contents`` (a measuring file's path under ``kvquant/``, posix, to its
    bytes): the first 16 hex digits of a SHA-256 over every file in path order."""
    digest = hashlib.sha256()
    for name in sorted(contents, key=PurePosixPath):  # as paths sort (by part), as the code version always has
        digest.update(name.encode() + b"\0" + contents[name] + b"\0")
    return digest.hexdigest()[:16]


def source_files(root: Path = PACKAGE) -> dict[str, bytes]:
    """Every measuring file under ``root`` (``kvquant/``) by its posix path there, with its bytes."""
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in _files(root)}


def source_digest(root: Path = PACKAGE) -> str:
    """The digest of the measuring sources on disk now (:func:`digest_of`). Each call lists and stats them (about
    a hundred files); the bytes are read and hashed again only where a stat changed since the last call."""
    files = _files(root)
    stats = tuple((str(p), s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino) for p in files for s in [p.stat()])
    if stats != _last["stats"]:
        _last["digest"] = digest_of({p.relative_to(root).as_posix(): p.read_bytes() for p in files})
        _last["stats"] = stats
    return _last["digest"]


class SourceWatch:
    """The measuring sources as a run found them at its start; :meth:`check`, before each signed write, stops the
    run with one line where they changed since (a checkout switched or a file edited under the running process):
    what is already written stays whole and signed under the version that measured it, and nothing of the new
    version is mixed in."""

    def __init__(self, root: Path = PACKAGE):
        self.root = root
        self.files = source_files(root)
        self.digest = digest_of(self.files)

    def check(self) -> None:
        if source_digest(self.root) == self.digest:
            return
        now = source_files(self.root)
        changed = sorted(n for n in {*now, *self.files} if now.get(n) != self.files.get(n))
        raise KVQuantError(
            f"kvquant's measuring sources changed under this run ({_names(changed)}: sources {self.digest} at its "
            f"start, {digest_of(now)} now); stopped before writing anything of the new code: the results written so "
            "far are kept, signed under the code that measured them; rerun to go on with the code now on disk")


def _names(files: list[str], most: int = 4) -> str:
    shown = ", ".join(f"kvquant/{name}" for name in files[:most])
    return shown + (f" and {len(files) - most} more" if len(files) > most else "") if files else "no file named"


def _git(root: Path, *args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(["git", *args], cwd=root, input=data, capture_output=True, check=True).stdout


def commit_files(commit: str, root: Path = PACKAGE) -> dict[str, bytes]:
    """The measuring files of ``commit`` in the git checkout holding ``root`` (``kvquant/``), as
    :func:`source_files` gives the disk's."""
    top = Path(_git(root, "rev-parse", "--show-toplevel").decode().strip())
    prefix = root.relative_to(top).as_posix()
    listed = _git(top, "ls-tree", "-r", "-z", "--name-only", commit, "--",
                  *(f"{prefix}/{package}" for package in MEASURING)).decode().split("\0")
    names = [n for n in listed if n and n.endswith(SUFFIXES)]
    if not names:
        return {}
    out = _git(top, "cat-file", "--batch", data="".join(f"{commit}:{n}\n" for n in names).encode())
    files, at = {}, 0
    for name in names:  # each: "<sha> blob <size>\n<bytes>\n"
        end = out.index(b"\n", at)
        size = int(out[at:end].split()[2])
        files[name[len(prefix) + 1:]] = out[end + 1:end + 1 + size]
        at = end + 1 + size + 1
    return files


def commit_provenance(recorded: str, root: Path = PACKAGE) -> str:
    """What a report records as its git commit, given the measuring-source digest ``recorded`` (the one its results
    are keyed with): ``HEAD``'s commit where that commit's measuring sources hash to ``recorded`` (with "uncommitted
    changes outside the measuring sources" where other tracked files differ); else the commit and which measuring
    files the run's sources hold uncommitted; else (the disk no longer holds them either) that the sources
    recorded are neither the commit's nor the checkout's. ``unknown`` outside a git checkout."""
    try:
        commit = _git(root, "rev-parse", "HEAD").decode().strip()
        theirs = commit_files(commit, root)
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no").decode().strip()
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return "unknown"
    if digest_of(theirs) == recorded:
        return commit + (" (with uncommitted changes outside the measuring sources)" if dirty else "")
    disk = source_files(root)
    if digest_of(disk) != recorded:
        return (f"{commit} (measured with sources {recorded}, which neither this commit nor this checkout holds: "
                "it changed after the run started)")
    changed = sorted(n for n in {*disk, *theirs} if disk.get(n) != theirs.get(n))
    return f"{commit} (with uncommitted changes: {_names(changed, 8)})"


def version_of(package: str) -> str:
    """``package``'s installed version, or "not installed"."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, str]:
    """What measured a result: kvquant's version and a hash of every file in the :data:`MEASURING` subpackages
    (their ``*.py`` and the C++ kernel's source), and the versions of torch, transformers and lm-eval. Part of
    every resume key, so results of other code are recomputed."""
    return {"kvquant": version_of("kvquant"), "kvquant_source_sha256": source_digest(),
            **{pkg: version_of(pkg) for pkg in ("torch", "transformers", "lm_eval")}}
