"""Several processes of one run (``torchrun`` / ``accelerate launch``, gloo on CPUs, NCCL on GPUs): which share of
the work is this process's, and gathering what every process computed so that each ends up holding all of it.

One process is rank 0 of 1, and every operation is then the identity: code written against :class:`Processes`
runs unchanged alone. A collective that fails because another process ended raises :class:`PeerEnded`, which
unwinds like Ctrl-C (the run keeps its finished results and says how to resume).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

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
    def main(self) -> bool:
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


def start(cpu: bool) -> Processes:
    """Start the run's process group (once; later calls and :func:`current` reuse it): gloo on CPUs when ``cpu``
    (a config whose model runs on the CPU, even where there are GPUs), else one GPU per process with NCCL."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return ONE
    from accelerate import PartialState

    state = PartialState(cpu=cpu or not torch.cuda.is_available())  # accelerate must be told to use gloo on CPUs
    return Processes(state.process_index, state.num_processes) if state.num_processes > 1 else ONE


def current() -> Processes:
    """The processes of this run: several when launched by ``torchrun`` or ``accelerate launch`` (``WORLD_SIZE``
    above 1; the process group is started by :func:`start`, or here on GPUs where there are any), else :data:`ONE`."""
    return start(cpu=False)


def device() -> str | None:
    """This process's GPU when the run's processes each drive one (``cuda:<local rank>``), else None."""
    if current().world == 1:
        return None
    from accelerate import PartialState

    placed = PartialState().device
    return str(placed) if placed.type == "cuda" else None
