"""Several processes of one run (``torchrun`` / ``accelerate launch``, gloo on CPUs, NCCL on GPUs): which share of
the work is this process's, and gathering what every process computed so that each ends up holding all of it.

One process is rank 0 of 1, and every operation is then the identity: code written against :class:`Processes`
runs unchanged alone. A collective that fails because another process ended raises :class:`PeerEnded`, which
unwinds like Ctrl-C (the run keeps its finished results and says how to resume).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvquant.errors import KVQuantError

T = TypeVar("T")


class PeerEnded(KeyboardInterrupt):
    """Another process of the run ended (failed, interrupted or killed) while this one waited for it."""

    def __str__(self) -> str:
        return "another process of this run ended"


@dataclass(frozen=True)
class Processes:
    """This process's ``rank`` among ``world`` processes."""

    rank: int = 0
    world: int = 1

    @property
    def is_main_process(self) -> bool:
        """Whether this is rank 0: the process that writes results, locks and reports."""
        return self.rank == 0

    def share(self, items: list[T]) -> list[T]:
        """This rank's items: every ``world``-th from ``rank`` (items sorted by cost share it evenly)."""
        return items[self.rank :: self.world]

    def gather(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        _collective(torch.distributed.all_gather_object, out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        _collective(torch.distributed.broadcast_object_list, box, src=0)
        return box[0]


ONE = Processes()


def digest(obj: Any) -> str:
    """A short hash of ``obj`` as JSON (keys sorted; what JSON cannot hold, as its text)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def agree(processes: Processes, parts: dict[str, str]) -> None:
    """Every process of several holds the same ``parts`` (a name -> a digest of what it runs with), before any
    measures: processes started with another config, kvquant version or data would otherwise score their shares of
    other things and blend them into one result. Else every process raises the same one-line
    :class:`KVQuantError`, naming what differs and which processes."""
    if processes.world == 1:
        return
    everyone = processes.gather(parts)
    for rank, theirs in enumerate(everyone[1:], start=1):
        differ = [name for name in everyone[0] if theirs.get(name) != everyone[0][name]]
        if differ or theirs.keys() != everyone[0].keys():
            what = ", ".join(differ or sorted(theirs.keys() ^ everyone[0].keys()))
            raise KVQuantError(f"the {processes.world} processes of this run do not run the same thing: process "
                               f"{rank} differs from process 0 in its {what}; start every process with the same "
                               "config, kvquant version, data and model files (nothing was measured)")


def code_digest() -> str:
    """A digest of :func:`kvquant.experiment.provenance.code_version`: kvquant's sources and the versions of torch,
    transformers and lm-eval."""
    from kvquant.experiment.provenance import code_version

    return digest(code_version())


def files_digest(path: str) -> str:
    """The names and sizes of a model folder's files, and the bytes of its JSON files (config, tokenizer), without
    reading the weights; the path itself for a hub id."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return digest([path, folder.stat().st_size if folder.is_file() else None])
    found = []
    for file in sorted(p for p in folder.iterdir() if p.is_file()):
        size = file.stat().st_size
        small_json = file.suffix == ".json" and size <= 64 << 20
        found.append([file.name, size, hashlib.sha256(file.read_bytes()).hexdigest() if small_json else None])
    return digest(found)


def run_parts(cfg, rows: dict[str, list[str]]) -> dict[str, str]:
    """What the processes of one run of ``cfg`` must agree on (:func:`agree`): the config as loaded (``--set``
    included), the code (:func:`kvquant.experiment.provenance.code_version`: kvquant's sources, torch, transformers,
    lm-eval), the
    perplexity text and offline task data, and the model's files."""
    from kvquant.scoring.models import resolve_model_path
    from kvquant.paths import resolve
    from kvquant.scoring.tasks import task_data_digest

    return {"config": digest(dataclasses.asdict(cfg)), "code": code_digest(),
            "data": digest([rows, {task: task_data_digest(task) for task in cfg.eval.tasks.names}]),
            "model files": files_digest(resolve_model_path(cfg.model)),
            "tokenizer files": files_digest(resolve(cfg.model.tokenizer)) if cfg.model.tokenizer else ""}


def check_same_run(cfg, rows: dict[str, list[str]]) -> None:
    """:func:`agree` on :func:`run_parts` among this run's processes (nothing to do for one)."""
    processes = current()
    if processes.world > 1:
        agree(processes, run_parts(cfg, rows))


#: what gloo and NCCL say when a peer's connection closed or a collective timed out
PEER_GONE = ("connection", "closed", "reset by peer", "broken pipe", "timed out", "timeout", "nccl communicator")


def _collective(op, *args, **kwargs) -> None:
    try:
        op(*args, **kwargs)
    except ConnectionError as err:
        raise PeerEnded from err
    except RuntimeError as err:
        if any(words in str(err).lower() for words in PEER_GONE):
            raise PeerEnded from err
        raise  # anything else (out of memory, an object that does not pickle) is this process's own error


#: Seconds a process other than 0 waits for process 0's rendezvous (``$MASTER_ADDR:$MASTER_PORT``) before it gives
#: up with one line (``$KVQUANT_RENDEZVOUS_S`` overrides it): a process started without its process 0 (or with the
#: wrong address) would otherwise wait for it for half an hour, deaf to SIGTERM.
RENDEZVOUS_S = 300


def env_int(name: str, default: int, low: int = 0) -> int:
    """The whole number in ``$name`` (``default`` where unset): one line naming the variable where it is not one."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise KVQuantError(f"${name} is {text[:60]!r}, not a whole number of at least {low}: it is set by the launcher "
                           "(torchrun, accelerate launch); unset it to run one process")
    return value


def _await_process_0(rank: int) -> None:
    """Where this is not process 0: wait (at most :data:`RENDEZVOUS_S`, in short tries so that signals such as
    SIGTERM are handled between them) until something listens at process 0's rendezvous address, else one line."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if rank == 0 or not host or not port:
        return  # process 0 hosts the store; without an address torch.distributed says what is missing
    number, limit = env_int("MASTER_PORT", 0), env_int("KVQUANT_RENDEZVOUS_S", RENDEZVOUS_S, low=1)
    deadline = time.monotonic() + limit
    while True:
        try:
            socket.create_connection((host, number), timeout=1).close()
            return
        except OSError:  # refused, unreachable, timed out, unknown host: nothing answers yet
            if time.monotonic() >= deadline:
                raise KVQuantError(f"process {rank} waited {limit} s for process 0 at {host}:{port} "
                                   "($MASTER_ADDR:$MASTER_PORT), which never answered: start every process of the "
                                   "run with a launcher (torchrun, accelerate launch), or set "
                                   "$KVQUANT_RENDEZVOUS_S to wait longer") from None
            time.sleep(0.5)


def start(cpu: bool) -> Processes:
    """Start the run's process group (once; later calls and :func:`current` reuse it): gloo on CPUs when ``cpu``
    (a config whose model runs on the CPU, even where there are GPUs), else one GPU per process with NCCL.
    ``$WORLD_SIZE``, ``$RANK``, ``$LOCAL_RANK`` and ``$LOCAL_WORLD_SIZE`` that are not whole numbers are refused in
    one line, and a process other than 0 waits for process 0 at most :data:`RENDEZVOUS_S` seconds."""
    world = env_int("WORLD_SIZE", 1, low=1)
    if world <= 1:
        return ONE
    rank = env_int("RANK", 0)
    env_int("LOCAL_RANK", 0)
    env_int("LOCAL_WORLD_SIZE", world, low=1)
    if rank >= world:
        raise KVQuantError(f"$RANK is {rank}, but $WORLD_SIZE is {world}: ranks run 0..{world - 1}")
    if not torch.distributed.is_initialized():
        _await_process_0(rank)
    from accelerate import PartialState

    state = PartialState(cpu=cpu or not torch.cuda.is_available())  # accelerate must be told to use gloo on CPUs
    return Processes(state.process_index, state.num_processes) if state.num_processes > 1 else ONE


def current() -> Processes:
    """The processes of this run: several when launched by ``torchrun`` or ``accelerate launch`` (``WORLD_SIZE``
    above 1; the process group is started by :func:`start`, or here on GPUs where there are any), else :data:`ONE`."""
    return start(cpu=False)


def process_gpu() -> str | None:
    """This process's GPU when the run's processes each drive one (``cuda:<local rank>``), else None."""
    if current().world == 1:
        return None
    from accelerate import PartialState

    placed = PartialState().device
    return str(placed) if placed.type == "cuda" else None
