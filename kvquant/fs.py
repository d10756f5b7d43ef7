"""The trust boundary on the filesystem: folders kvquant loads from, and files it writes.

- **Loaded from**: lm-eval executes what its task YAMLs name (``!function``), and the fused kernel is a shared
  library; both come only from folders no other user can write (:func:`private_dir`).
- **Written**: reports, partial results and error logs are written to a fresh temporary name (``O_EXCL``) and
  renamed into place, so a symlink planted at the target is replaced, never followed, and another user's file
  there is refused, never replaced; a directory kvquant writes into (under ``output_dir``, a benchmark's
  ``--out``) must be a real directory of this user's that no one else can write (:func:`real_dir`,
  :func:`output_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

from kvquant.compat.lm_eval import yaml_base_loader
from kvquant.errors import KVQuantError


def _unsafe_ancestor(path: Path) -> str | None:
    """Why another user could replace ``path`` through one of its ancestors, else None: an ancestor another user
    owns, or one that every user may write without the sticky bit (``/tmp`` is fine)."""
    uid = os.getuid()
    for parent in path.parents:
        info = parent.stat()
        if info.st_uid not in (uid, 0):
            return f"{parent} belongs to another user (uid {info.st_uid})"
        if info.st_mode & stat.S_ISVTX:
            continue  # sticky (as /tmp): others may add entries, never rename or remove ours
        if info.st_mode & stat.S_IWOTH:
            return f"{parent} is writable by every user"
        if info.st_mode & stat.S_IWGRP and info.st_gid != os.getgid():
            return f"{parent} is writable by the users of group {info.st_gid}"
    return None


def _why_untrusted(item: Path) -> str | None:
    """Why another user could change what ``item`` (already resolved) holds, else None."""
    info = item.stat()
    if info.st_uid not in (os.getuid(), 0):
        return f"{item} belongs to another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{item} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _task_file_refs(path: Path, what: str) -> tuple[list[Path], list[Path]]:
    """What lm-eval reads because of the task YAML ``path``, found as lm-eval finds it (its own YAML base loader,
    the whole file, any encoding it accepts) but without running anything: each ``include:`` (any file, relative
    to this file's folder) and the module file of each ``!function`` (:func:`_function_module`)."""
    import yaml

    includes: list[Path] = []
    functions: list[str] = []

    class Recording(yaml_base_loader()):
        pass

    def function(loader, node):
        functions.append(loader.construct_scalar(node))
        return None

    Recording.add_constructor("!function", function)
    try:
        with path.open("rb") as f:
            doc = yaml.load(f, Loader=Recording)  # noqa: S506  (a safe base; !function is only recorded)
    except (yaml.YAMLError, ValueError, UnicodeError):
        doc = None  # lm-eval cannot load it either (what it named before the error is still checked)
    named = doc.get("include") if isinstance(doc, dict) else None
    for inc in named if isinstance(named, list) else [named] if named else []:
        if isinstance(inc, str):
            includes.append(path.parent / inc)
    return includes, [_function_module(path, name, what) for name in functions]


def _function_module(path: Path, name: str, what: str) -> Path:
    """The module file of the task YAML ``path``'s ``!function name``: ``mod.sub.fn`` -> ``mod/sub.py`` beside the
    file (or an absolute path), as lm-eval looks first. It must be there: where it is not, lm-eval imports
    ``mod.sub`` from wherever Python finds it (a ``mod.py`` another user left in the working directory, any
    installed module), so that is refused, naming ``what``."""
    module = name.rpartition(".")[0]
    file = path.parent / f"{module.replace('.', '/')}.py"
    if not module or not file.is_file():
        raise KVQuantError(f"{what}: {path}: `!function {name}` names no module file beside it ({file} does not "
                           "exist), so lm-eval would import it from anywhere on Python's path; put the module beside "
                           "the task file (mod.fn -> mod.py)")
    return file


def check_trusted(path: str | Path, what: str) -> Path:
    """A task file or folder the user names for lm-eval to load, which may run Python it names (``!function``,
    imported from the file's folder): every file it reaches (under a folder, through a symlink, or by a YAML's
    ``include:``), each file's folder and their ancestors must be owned by this user (or root), writable by no one
    else, and every ``!function`` must name a module file beside its YAML; else :class:`KVQuantError` naming
    ``what``. Returns the resolved path."""
    top = Path(path).expanduser().resolve()
    todo, seen, included = [top], set(), set()
    while todo:
        item = todo.pop().resolve()
        if item in seen or not item.exists():  # a missing include is lm-eval's own error
            continue
        seen.add(item)
        if item.is_dir():
            todo += [Path(root) / n for root, dirs, files in os.walk(item) for n in [*dirs, *files]]
        elif item == top or item.suffix in (".yaml", ".yml") or item in included:
            includes, modules = _task_file_refs(item, what)  # an included file is a task YAML whatever its name
            included.update(r.resolve() for r in includes)
            todo += [*includes, *modules]
        folder = item if item.is_dir() else item.parent
        reason = _why_untrusted(item) or _why_untrusted(folder) or _unsafe_ancestor(folder)
        if reason:
            raise KVQuantError(f"{what}: refusing {top}: {reason}; lm-eval runs code that task files name, so they "
                               "must be files only you can write")
    return top


def private_dir(path: str | Path, what: str) -> Path:
    """``path`` as a folder only this user can write, created (mode 0700) where missing.

    An existing folder must be a real directory (not a symlink), owned by this user, not writable by group or
    others, under ancestors no other user can swap; else :class:`KVQuantError` naming ``what`` (e.g. the
    environment variable that set it)."""
    path = Path(path).expanduser().absolute()
    # nothing is created inside a folder another user could change: where ``path`` is missing, its nearest existing
    # ancestor is checked first (with that folder's own ancestors), so a refused folder leaves no trace there
    existing = None if os.path.lexists(path) else next((p for p in path.parents if p.exists()), None)
    early = _unsafe_ancestor(existing / "_") if existing is not None else None
    if early:
        raise KVQuantError(f"{what}: refusing {path}: {early}; kvquant loads code and data from it, so it must be a "
                           "folder only you can write")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path = path.parent.resolve() / path.name
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        info = os.lstat(path)
        reason = _unsafe_ancestor(path)
    except (OSError, ValueError) as err:
        raise KVQuantError(f"{what}: cannot use {path} ({getattr(err, 'strerror', None) or err})") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        reason = f"{path} is {'a symlink' if stat.S_ISLNK(info.st_mode) else 'not a directory'}"
    elif info.st_uid != os.getuid():
        reason = f"{path} belongs to another user (uid {info.st_uid})"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        reason = f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    if reason:
        raise KVQuantError(f"{what}: refusing {path}: {reason}; kvquant loads code and data from it, so it must be "
                           "a folder only you can write")
    return path


def env_dir(name: str) -> Path | None:
    """The folder the environment variable ``name`` sets (``~`` expanded), None where it is unset or empty. A
    relative one is refused, before anything is created: kvquant's private folders must not move with the folder a
    command runs from."""
    value = os.environ.get(name)
    if not value:
        return None
    path = Path(value).expanduser()
    if not path.is_absolute():
        raise KVQuantError(f"${name}: {value!r} is a relative path; set an absolute one (a private folder of "
                           "kvquant must not depend on the folder you run from)")
    return path


#: the environment variables that set kvquant's private folders
PRIVATE_DIRS = ("KVQUANT_CACHE_DIR", "KVQUANT_TASK_DIR", "KVQUANT_KERNEL_DIR")


def check_env_dirs() -> None:
    """Before anything loads: every private folder an environment variable sets is absolute (:func:`env_dir`);
    nothing is created."""
    for name in PRIVATE_DIRS:
        env_dir(name)


def cache_dir(sub: str, env: str | None = None) -> Path:
    """kvquant's private cache folder ``sub`` (under ``$KVQUANT_CACHE_DIR``, default ``~/.cache/kvquant``), or the
    folder the environment variable ``env`` names; checked by :func:`private_dir` (a relative one: :func:`env_dir`)."""
    chosen = env_dir(env) if env else None
    if chosen is not None:
        return private_dir(chosen, f"${env}")
    root = env_dir("KVQUANT_CACHE_DIR")
    return private_dir((root or Path.home() / ".cache" / "kvquant") / sub,
                       "$KVQUANT_CACHE_DIR" if root is not None else "cache")


def _foreign_writer(path: Path, info: os.stat_result) -> str | None:
    """Why another user could change what the directory ``path`` (its ``lstat`` ``info``) holds, else None: it
    belongs to another user, or every user, or the users of a group not this user's own, may write it."""
    if info.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {info.st_uid})"
    if info.st_mode & stat.S_IWOTH:
        return f"{path} is writable by every user (mode {stat.S_IMODE(info.st_mode):o})"
    if info.st_mode & stat.S_IWGRP and info.st_gid != os.getgid():
        return f"{path} is writable by the users of group {info.st_gid}"
    return None


def real_dir(path: Path, what: str) -> Path:
    """``path`` as a real directory of this user's, created where missing; a symlink (or anything else) there is
    refused, and so is a directory another user owns or may write (:func:`_foreign_writer`): that user could swap
    what kvquant writes into it (``partial/`` for a link) between a check and a write."""
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
        info = os.lstat(path)
    except (OSError, ValueError) as err:
        raise KVQuantError(f"{what}: cannot create {path} ({getattr(err, 'strerror', None) or err})") from None
    if not stat.S_ISDIR(info.st_mode):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise KVQuantError(f"{what}: {path} is {kind}; kvquant writes only into directories it can trust, so move "
                           "it away or write elsewhere (--set name=... or --set output_dir=...)")
    reason = _foreign_writer(path, info)
    if reason:
        raise KVQuantError(f"{what}: refusing {path}: {reason}; kvquant writes only into directories no one else "
                           "can change, so write elsewhere")
    return path


def output_dir(path: str | Path, what: str) -> Path:
    """A command's output folder ``path`` (a benchmark's ``--out``): its parents created where missing (a
    symlink among them is yours to make), the folder itself checked by :func:`real_dir`."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as err:
        raise KVQuantError(f"{what}: cannot create {path.parent} ({getattr(err, 'strerror', None) or err})") from None
    return real_dir(path, what)


def _foreign_file(path: Path, info: os.stat_result) -> str | None:
    """Why ``path`` (``info``: its lstat) must not be replaced: another user's file (a symlink is replaced, never
    followed, so its owner does not matter); None where it may be."""
    if not stat.S_ISLNK(info.st_mode) and info.st_uid != os.getuid():
        return f"refusing to replace {path}: it belongs to another user (uid {info.st_uid})"
    return None


def writable_target(path: Path, what: str) -> Path:
    """``path`` as a file a command will write once its work is done, checked before the work: its folder exists
    and is a directory, and neither a directory nor another user's file is at ``path`` (:func:`write_file` would
    refuse it only after the work)."""
    try:
        folder, info = os.stat(path.parent), os.lstat(path) if os.path.lexists(path) else None
    except OSError as err:
        raise KVQuantError(f"{what}: cannot write {path} ({err.strerror or err})") from None
    if not stat.S_ISDIR(folder.st_mode):
        raise KVQuantError(f"{what}: cannot write {path}: {path.parent} is not a directory")
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise KVQuantError(f"{what}: {path} is a directory, not a file to write")
    if info is not None and (refusal := _foreign_file(path, info)):
        raise KVQuantError(f"{what}: {refusal}")
    return path


def marked_section(path: Path, begin: str, end: str, what: str) -> tuple[str, str]:
    """The text of ``path`` before ``begin`` and from ``end`` on (a generated section between the two markers),
    read with :func:`read_file`; one :class:`KVQuantError` naming ``what`` where the file or a marker is missing."""
    try:
        text = read_file(path).decode("utf-8")
    except (OSError, ValueError) as err:
        raise KVQuantError(f"{what}: cannot read {path} ({getattr(err, 'strerror', None) or err}); run from the "
                           "repository's root") from None
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise KVQuantError(f"{what}: {path} does not hold the section {begin} ... {end} once")
    return text[:text.index(begin)], text[text.index(end) + len(end):]


def write_file(path: Path, content: str | bytes) -> None:
    """Put ``content`` at ``path`` atomically (:func:`write_together` of one file)."""
    write_together(path.parent, {path.name: content})


def write_together(directory: Path, files: dict[str, str | bytes]) -> None:
    """Write every file to a fresh temporary name in ``directory`` (``O_EXCL``), then rename them all into place:
    a symlink at a target is replaced, never written through, and no file is in place before all are written. A
    target another user owns is refused before anything is written (:class:`KVQuantError`)."""
    for name in files:
        try:
            info = os.lstat(directory / name)
        except FileNotFoundError:
            continue
        except OSError as err:
            raise KVQuantError(f"cannot write {directory / name} ({err.strerror or err})") from None
        if refusal := _foreign_file(directory / name, info):
            raise KVQuantError(f"{refusal}; move it away or write elsewhere")
    staged = []
    try:
        for name, content in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
            staged.append((tmp, directory / name))
            with os.fdopen(fd, "wb") as f:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
            os.chmod(tmp, 0o666 & ~_umask())
        for tmp, path in staged:
            os.replace(tmp, path)
    finally:
        for tmp, _ in staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fresh_dir(parent: Path, name: str) -> Path:
    """A folder this call creates under ``parent``: ``name``, or ``name.1``, ``name.2``, ... where that exists."""
    for n in range(10_000):
        path = parent / (name + (f".{n}" if n else ""))
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        except OSError as err:
            raise KVQuantError(f"cannot create {path} ({err.strerror or err})") from None
        return path
    raise KVQuantError(f"{parent}: 10,000 folders named {name}.* already exist; clean them up")


def read_file(path: Path) -> bytes:
    """The bytes of the regular file at ``path``, never through a symlink (``OSError`` ELOOP) or from a FIFO or
    device (``OSError`` EINVAL)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return f.read()


def read_json(path: Path, what: str, missing: dict | None = None) -> dict:
    """The JSON object in the regular file ``path`` (:func:`read_file`: never through a symlink, never a FIFO);
    ``missing`` where there is no file (None: that is refused too); anything else is one :class:`KVQuantError`
    naming ``what``."""
    import json

    try:
        doc = json.loads(read_file(path))
    except FileNotFoundError:
        if missing is not None:
            return missing
        raise KVQuantError(f"{what}: {path} does not exist") from None
    except (OSError, ValueError, RecursionError) as err:
        raise KVQuantError(f"{what}: {path} is not a JSON file this command reads "
                           f"({getattr(err, 'strerror', None) or str(err)[:100]})") from None
    if not isinstance(doc, dict):
        raise KVQuantError(f"{what}: {path} holds a JSON {type(doc).__name__}, not the object this command writes")
    return doc


def set_aside(path: Path, suffix: str = ".corrupt", folder: Path | None = None) -> Path:
    """Move ``path`` (a file or a symlink, not followed) to ``<path><suffix>`` (in ``folder`` where given, else
    beside it), or ``<path><suffix>.1``, ``.2``, ... where that is taken: an earlier set-aside file is never
    overwritten. Returns the new name."""
    folder = path.parent if folder is None else folder
    for n in range(10_000):
        aside = folder / (path.name + suffix + (f".{n}" if n else ""))
        try:
            os.link(path, aside, follow_symlinks=False)
        except FileExistsError:
            continue
        os.unlink(path)
        return aside
    raise KVQuantError(f"{path}: 10,000 set-aside copies already exist beside it; clean them up")
