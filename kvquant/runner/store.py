"""What a run keeps on disk between restarts: its partial results (:class:`ResultStore`, one signed JSON file per
(candidate, metric), checked before a model loads by :func:`check_partial`) and its lock (:class:`RunLock`); and its
warnings (:func:`warn`), printed once and kept for the report."""

from __future__ import annotations

import collections
import fcntl
import hashlib
import hmac
import json
import os
import stat
import sys
import time
from pathlib import Path

from kvquant.scoring import parallel
from kvquant.errors import KVQuantError, one_line
from kvquant.fs import fresh_dir, read_file, real_dir, set_aside, write_file
from kvquant.signing import result_key

LOCK = ".lock"


def warn(warnings: list[str], message: str) -> None:
    """Print a warning now (process 0 of several) and keep it for the report."""
    if parallel.current().is_main_process:
        print(f"kvquant: warning: {message}", file=sys.stderr)
    warnings.append(message)


class ResultStore:
    """One JSON file per (candidate, metric), written atomically, reused only when its inputs and the code version
    (:func:`kvquant.experiment.provenance.code_version`) are unchanged and its signature verifies: an HMAC of the key
    and the result under this user's private key (:func:`kvquant.signing.result_key`), so a result edited by hand or
    written by another user or machine is recomputed, never trusted. The key names the result's own candidate and
    metric, so a file copied from another (``ppl/x`` to ``kl/x``) is never reused. An unreadable, unverified or copied
    file is named in a warning, set aside (``*.json.corrupt``, never overwriting an earlier one) and recomputed. A
    finished result of other inputs or code is not deleted when this run replaces it: it is moved to
    ``<directory>.old-<time>/`` (:meth:`note_retired` warns once how many, and where). Counts what it reused and
    computed. Under several processes, process 0 alone reads and writes the files: it hands every process the saved
    result, or all of them compute it together (``compute`` shares its scoring out). A result measured elsewhere becomes
    this store's own only when the user adopts it (:meth:`adopt`, ``python -m kvquant.adopt``). ``watch`` (a
    :class:`~kvquant.experiment.provenance.SourceWatch`, or None) is checked before every signed write: a change of the
    measuring sources under the run stops it there, what is written kept and nothing mixed. :attr:`report` ties every
    result to its report folder (:mod:`kvquant.runner.lookplan` sets it)."""

    def __init__(self, directory: Path, code: dict, warnings: list[str], processes: parallel.Processes = parallel.ONE,
                 watch=None, secret: bytes | None = None):
        self.directory, self.code, self.warnings, self.processes = directory, code, warnings, processes
        self.watch = watch
        #: written once, before the first signed write (a run's first plan, :mod:`kvquant.runner.lookplan`), so a
        #: run that writes nothing leaves nothing behind
        self.first_write = None
        self.reused, self.computed, self.set_aside = 0, 0, []
        self.ahead: set[Path] = set()  # results :meth:`store_ahead` stored that their turn has not read yet
        self.retired, self.retired_dir, self.written, self.noted = 0, None, set(), False
        #: ``secret``: the key to verify with (a reader that must not make one: :func:`result_key`'s, existing)
        self.secret = secret if secret is not None else result_key() if processes.is_main_process else b""
        #: the report folder's id (its plan's, :mod:`kvquant.runner.lookplan`), signed into every result: a result
        #: signed for another folder is never reused here; "" (none) for a folder older than these ids
        self.report = ""
        #: how long each (candidate, metric) took to measure, where known: this run's own, or what the run that
        #: measured a reused result noted (informational, outside the signature: it only prices more documents)
        self.seconds: dict[tuple[str, str], float] = {}
        self._window_groups: ResultStore | None = None

    def window_groups(self) -> ResultStore:
        """The store of the finished groups of windows of this store's perplexity and divergence passes
        (:mod:`kvquant.scoring.windowed`): ``<directory>/../windows/<candidate>/<metric>@<first>-<stop>.json``, kept,
        signed, set aside and retired as this store's results are, for this store's report folder; a pass
        interrupted between groups resumes from them. Its first signed write is this store's (the plan first)."""
        if self._window_groups is None:
            self._window_groups = ResultStore(self.directory.parent / "windows", self.code, self.warnings,
                                              self.processes, secret=self.secret)
            self._window_groups.check_sources = self.check_sources
        self._window_groups.report = self.report
        return self._window_groups

    def check_sources(self) -> None:
        """Before a signed write: the measuring sources are still the ones the run started with (else one line)."""
        if self.watch is not None:
            self.watch.check()
        if self.first_write is not None:
            first, self.first_write = self.first_write, None
            first()

    def _path(self, candidate: str, metric: str) -> Path:
        return self.directory / candidate / result_name(metric)

    def _sign(self, digest: str, result, report: str | None = None) -> str:
        """The signature of ``result`` of key ``digest`` in the report folder ``report`` (None: this store's)."""
        report = self.report if report is None else report
        text = (f"{report}\0" if report else "") + digest + json.dumps(result, sort_keys=True, default=str)
        return hmac.new(self.secret, text.encode(), hashlib.sha256).hexdigest()

    def _signed_for(self, saved: dict, digest: str) -> str | None:
        """The report folder id ``saved`` (a result file of key ``digest``) is signed for under this user's key
        ("": a result older than these ids), else None (no signature of this key: edited, or another's)."""
        report = saved.get("report", "")
        if not isinstance(report, str) or not report.isascii() or not hmac.compare_digest(
                str(saved.get("signature")), self._sign(digest, saved["result"], report)):
            return None
        return report

    def _inputs(self, candidate: str, metric: str, key: dict) -> tuple[dict, str]:
        inputs = {**key, "code": self.code, "result_of": [candidate, metric]}
        return inputs, inputs_digest(inputs)

    def reusable(self, candidate: str, metric: str, key: dict) -> bool:
        """Whether :meth:`get_or_compute` would reuse the saved result of (``candidate``, ``metric``, ``key``):
        read only (nothing set aside, nothing written; the cost preview asks)."""
        path = self._path(candidate, metric)
        try:
            saved = json.loads(read_file(path).decode("utf-8"))
            digest = self._inputs(candidate, metric, key)[1]
            return isinstance(saved, dict) and "result" in saved and saved.get("key") == digest and \
                self._signed_for(saved, digest) == self.report
        except (OSError, ValueError, RecursionError):
            return False

    def get_or_compute(self, candidate: str, metric: str, key: dict, compute):
        path = self._path(candidate, metric)
        inputs, digest = self._inputs(candidate, metric, key)
        saved = self.processes.broadcast(self._read(path, digest, inputs["result_of"]) if self.processes.is_main_process
                                         else None)
        if saved is not None:
            if path in self.ahead:  # stored by this run ahead of its turn (:meth:`store_ahead`): not reused
                self.ahead.discard(path)
            else:
                self.reused += 1
            if _is_seconds(saved.get("seconds")):
                self.seconds[candidate, metric] = float(saved["seconds"])
            return saved["result"]
        start = time.monotonic()
        result = compute()
        self.seconds[candidate, metric] = round(time.monotonic() - start, 3)  # as it is written, and read back
        self.computed += 1
        if not self.processes.is_main_process:
            return result
        self.check_sources()
        real_dir(self.directory, "partial results")
        real_dir(path.parent, "partial results")
        stored = json.loads(json.dumps(result, default=str))  # as a later run reads it back
        if os.path.lexists(path) and path not in self.written:  # of other inputs or code: kept, not replaced
            self._retire(path)
        write_file(path, json.dumps({"key": digest, "inputs": inputs, "result": stored, **_report_field(self.report),
                                     "signature": self._sign(digest, stored),
                                     "seconds": self.seconds[candidate, metric]}, default=str))
        self.written.add(path)
        return result

    def store_ahead(self, candidate: str, metric: str, key: dict, result) -> None:
        """Store ``result``, computed ahead of its turn (a divergence computed beside another candidate's), as
        :meth:`get_or_compute` would: kept if the run is interrupted before its turn, and counted as computed, not
        reused, when its turn reads it."""
        self.get_or_compute(candidate, metric, key, lambda: result)
        self.ahead.add(self._path(candidate, metric))

    def adopt(self, candidate: str, metric: str, saved: dict) -> bool:
        """Place ``saved`` (``key``, ``inputs`` and ``result`` another machine or session wrote, checked by the
        caller: :mod:`kvquant.runner.travel`) here as this store's own, signed under this user's key, so a run
        reuses it like one it computed. A result already here that verifies for the same inputs is kept (returns
        False; True: placed); one that does not verify is set aside as :meth:`get_or_compute` sets it aside, one of
        other inputs retired (:meth:`note_retired`)."""
        path, digest = self._path(candidate, metric), saved["key"]
        if self._read(path, digest, [candidate, metric], "replaced by the adopted one") is not None:
            return False
        self.check_sources()
        real_dir(self.directory, "partial results")
        real_dir(path.parent, "partial results")
        if os.path.lexists(path):
            self._retire(path)
        took = saved.get("seconds")  # how long it took there, if noted (informational, as in get_or_compute)
        write_file(path, json.dumps({"key": digest, "inputs": saved["inputs"], "result": saved["result"],
                                     **_report_field(self.report), "signature": self._sign(digest, saved["result"]),
                                     **({"seconds": float(took)} if _is_seconds(took) else {})}, default=str))
        return True

    def verified_result(self, path: Path) -> dict | None:
        """The result at ``path`` (under this store's folder) if this user's key signed it, for whichever report
        folder (its ``report``), and its key is the digest of the inputs it holds, whatever those inputs; else None.
        Nothing is moved."""
        try:
            saved = json.loads(read_file(path).decode("utf-8"))
            if not (isinstance(saved, dict) and "result" in saved and isinstance(saved.get("inputs"), dict)):
                return None
            digest = str(saved.get("key"))
            signed = self._signed_for(saved, digest) is not None
        except (OSError, ValueError, RecursionError):
            return None
        return saved if signed and digest == inputs_digest(saved["inputs"]) else None

    def reports(self) -> collections.Counter:
        """How many of the results in this store's folder (:meth:`verified_result`) were signed for each report folder
        id ("": older than these ids). Nothing is moved."""
        paths = sorted(self.directory.glob("*/*.json")) if self.directory.is_dir() else []
        found = (self.verified_result(p) for p in paths if not p.name.startswith(".") and not p.is_symlink())
        return collections.Counter(saved.get("report", "") for saved in found if saved is not None)

    def _retire(self, path: Path) -> None:
        """Move a finished result of other inputs or code into this run's ``<directory>.old-<time>/``."""
        if self.retired_dir is None:
            self.retired_dir = fresh_dir(self.directory.parent,
                                         f"{self.directory.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        set_aside(path, "", real_dir(self.retired_dir / path.parent.name, "partial results"))
        self.retired += 1

    def note_retired(self) -> None:
        """Warn (once) how many finished results of other inputs or code this run replaced, and where they are."""
        if self.retired and not self.noted:
            self.noted = True
            many = f"{self.retired} finished partial results" if self.retired > 1 else "1 finished partial result"
            warn(self.warnings, f"{many} of other inputs or code (config, data or kvquant version) replaced by this "
                 f"run's; the earlier ones are kept in {self.retired_dir}")

    def _read(self, path: Path, digest: str, owner: list[str], instead: str = "recomputed") -> dict | None:
        """The saved result of ``digest`` at ``path``, else None (absent, of other inputs, or set aside);
        ``owner``: the (candidate, metric) it must be the result of; ``instead``: what the warning says becomes of
        one set aside."""
        if not os.path.lexists(path):
            return None
        if stat.S_ISDIR(os.lstat(path).st_mode):
            raise KVQuantError(f"partial result {path} is a folder, not a file kvquant wrote; move it away")
        try:
            saved = json.loads(read_file(path).decode("utf-8"))
            if not isinstance(saved, dict) or "result" not in saved:
                raise ValueError("holds no result")
            if saved.get("key") != digest:
                inputs = saved.get("inputs")
                of = inputs.get("result_of") if isinstance(inputs, dict) else None
                if of is not None and of != owner:
                    raise ValueError(f"it is the result of {' '.join(map(str, of))[:80]}, copied here")
                return None  # measured with other inputs or code: recomputed, and retired when replaced
            report = self._signed_for(saved, digest)
            if report is None:
                raise ValueError("its signature does not verify: edited, or written by another user or machine")
            if report != self.report:
                raise ValueError("it was measured in another report folder and copied here (python -m "
                                 "kvquant.adopt makes another folder's results this one's)")
            return saved
        except (OSError, ValueError, RecursionError) as err:
            aside = set_aside(path)
            self.set_aside.append(str(path.relative_to(self.directory)))
            warn(self.warnings, f"partial result {path} is unusable ({one_line(err)[:120]}); moved to "
                 f"{aside.name} and {instead}")
            return None


def _report_field(report: str) -> dict:
    """A result file's field naming the report folder it is signed for (none for a folder older than these ids)."""
    return {"report": report} if report else {}


def _is_seconds(value) -> bool:
    """Whether a noted time is one: a finite, non-negative number (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")


def result_name(metric: str) -> str:
    """The file name of ``metric``'s result in its candidate's folder (``ppl/wiki`` -> ``ppl__wiki.json``)."""
    return metric.replace("/", "__") + ".json"


def inputs_digest(inputs: dict) -> str:
    """A result's key: the SHA-256 of its inputs (with the code version and what it is the result of) as JSON."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def check_partial(directory: Path) -> None:
    """Before a model loads, what a run would read, set aside or replace under ``directory`` (``partial/``): a
    real folder of real candidate folders this user can enter and write, each ``*.json`` in them a file (or a
    symlink, which is set aside, never followed), and its plan (:func:`plan_file`); else :class:`KVQuantError`
    naming it (was: an internal error once the first measurement was done). A name starting with ``.`` is none
    kvquant writes or reads there (its candidates, metrics and results start with a letter or digit): a stray
    ``.DS_Store``, ``.nfs…`` file or an editor's swap file is left alone."""
    if not os.path.lexists(directory):
        return
    if not stat.S_ISDIR(os.lstat(directory).st_mode):
        raise KVQuantError(f"partial results: {directory} is not a folder; move it away or write elsewhere "
                           "(--set name=... or --set output_dir=...)")
    candidates = [Path(e.path) for e in os.scandir(directory) if not e.name.startswith(".") and not plan_file(e)]
    for folder in [directory, *candidates]:
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode):
            raise KVQuantError(f"partial results: {folder} is {'a symlink' if stat.S_ISLNK(info.st_mode) else 'a file'}"
                               f"; {directory} holds one folder per candidate, so move it away")
        if not os.access(folder, os.R_OK | os.W_OK | os.X_OK):
            raise KVQuantError(f"partial results: cannot read and write {folder}; give yourself access or move it")
    for entry in (e for folder in candidates for e in os.scandir(folder) if not e.name.startswith(".")):
        if entry.name.endswith(".json") and not (entry.is_symlink() or entry.is_file(follow_symlinks=False)):
            raise KVQuantError(f"partial results: {entry.path} is {'a folder' if entry.is_dir() else 'not a file'}, "
                               "not a result kvquant wrote; move it away")


def plan_file(entry: os.DirEntry) -> bool:
    """Whether ``entry`` of a ``partial/`` folder is its plan (``plan.json``, :mod:`kvquant.runner.lookplan`) or one
    set aside: a regular file, beside the candidates' folders."""
    return (entry.name == "plan.json" or entry.name.startswith("plan.json.corrupt")) and \
        entry.is_file(follow_symlinks=False)


class RunLock:
    """``<report dir>/.lock``, held with ``fcntl.flock`` while the run lives: a second run into the same directory
    is refused. The kernel releases the lock when its process ends, however it ends, so a lock left by a dead
    process is taken over in the same single step that takes a free one (no read-unlink-link race). The file
    names its holder's process id, for the message. A report directory this run created and left empty is
    removed again (except after an internal error: it receives the error log)."""

    def __init__(self, directory: Path):
        self.directory, self.path = directory, directory / LOCK
        self.created, self.fd = False, None

    def __enter__(self) -> RunLock:
        self.created = not os.path.lexists(self.directory)
        try:
            self.directory.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise KVQuantError(f"output_dir: cannot create {self.directory.parent} ({err.strerror or err})") from None
        real_dir(self.directory, "output_dir/name")
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as err:
                self._cleanup()
                raise KVQuantError(f"cannot open the lock {self.path} ({err.strerror}); a symlink there is refused"
                                   ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _lock_owner(fd)
                os.close(fd)
                self._cleanup()
                raise KVQuantError(
                    f"{self.directory} is in use by another run (process {owner or 'starting'}, lock {self.path}); "
                    "wait for it to finish or write elsewhere (--set name=... or --set output_dir=...)") from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder removed it between our open and our lock: take the new one
        owner = _lock_owner(fd)
        if owner and owner != os.getpid():
            print(f"kvquant: note: taking over {self.path} from process {owner}, which is no longer running",
                  file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # while still holding it: a waiting run retries on the new file
            os.close(self.fd)
            self.fd = None
        if exc_type is None or issubclass(exc_type, (KVQuantError, KeyboardInterrupt)):
            self._cleanup()  # after an internal error the directory stays, for its error.log

    def _cleanup(self) -> None:
        if self.created and self.directory.is_dir() and not any(self.directory.iterdir()):
            self.directory.rmdir()


def _lock_owner(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except OSError:
        return False
