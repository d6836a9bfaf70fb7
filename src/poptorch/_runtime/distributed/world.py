"""This process's place among the processes of a run, on ``torch.distributed``.

A run started by ``torchrun`` (or any launcher setting ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` / ``MASTER_PORT``), or configured with
``Options.Distributed.configureProcessId``, has ``replicationFactor x processes`` global
replicas. The executor joins the default process group (gloo for CPU devices, NCCL for
CUDA) at its first compile, or reuses one the user made.
"""
from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ... import _logging
from ...errors import Error

TIMEOUT_ENV = "POPTORCH_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True)
class World:
    """The processes of a run. ``group`` is None for a run of one process."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None

    @property
    def distributed(self) -> bool:
        """True when there is more than one process."""
        return self.size > 1


SINGLE_PROCESS = World(0, 1, None)


def timeout() -> datetime.timedelta:
    """How long a collective may wait for the other processes before it fails
    (``POPTORCH_DISTRIBUTED_TIMEOUT`` seconds, default 300): a dead process then ends
    the run with an error instead of a hang."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_SECONDS)
    try:
        seconds = float(raw)
    except ValueError:
        raise Error(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds.") from None
    if seconds <= 0:
        raise Error(f"{TIMEOUT_ENV} must be positive, got {raw!r}.")
    return datetime.timedelta(seconds=seconds)


def join(process_id: int, num_processes: int, device: torch.device) -> World:
    """The world of this process: the default process group when one exists or is
    needed (``num_processes > 1``), joined here if nobody has yet."""
    if dist.is_available() and dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
        if num_processes > 1 and (rank, size) != (process_id, num_processes):
            raise Error(
                f"Options.Distributed says process {process_id} of {num_processes}, but "
                f"the torch.distributed process group says rank {rank} of {size}: leave "
                "Options.Distributed at its default under torchrun, or make them agree.")
        return World(rank, size, dist.group.WORLD) if size > 1 else SINGLE_PROCESS
    if num_processes == 1:
        return SINGLE_PROCESS
    if not dist.is_available():
        raise Error("Running over several processes needs torch.distributed, which this "
                    "build of PyTorch does not have.")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise Error(
            f"Options.Distributed asks for {num_processes} processes but "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: start "
            "the program with torchrun (torchrun --nproc_per_node=N prog.py), or set "
            "MASTER_ADDR and MASTER_PORT to the address of process 0.")
    # gloo for CPU tensors; with CUDA, NCCL for CUDA tensors as well (one group serves
    # both, whichever joins first: a DataLoader agreeing a seed or the executor).
    cuda = device.type == "cuda" or (torch.cuda.is_available() and dist.is_nccl_available())
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=process_id, world_size=num_processes,
                            timeout=timeout())
    global _created_here
    _created_here = True
    _logging.info_once(("process group", process_id, num_processes),
                       "Joined the %s process group as process %d of %d.", backend,
                       process_id, num_processes)
    return World(process_id, num_processes, dist.group.WORLD)


_leave_callbacks: list = []
_created_here = False


def on_leave(callback: Callable[[], object]) -> None:
    """Run ``callback()`` at interpreter exit, before the process group is left."""
    _leave_callbacks.append(callback)


def _leave() -> None:
    """At exit, while the interpreter is whole: release what holds the process group
    (DDP's reducers), then destroy the group if this package created it. Left to
    interpreter finalization, gloo's threads can abort the process or deadlock on the
    GIL (pytorch/pytorch#56297) and torchrun would report a failed run."""
    for callback in _leave_callbacks:
        callback()
    if _created_here and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


atexit.register(_leave)


def shared_random_seed(process_id: int, num_processes: int) -> int:
    """A random seed drawn by process 0 and known to every process (joins the process
    group if needed): shuffling then gives every process the same order."""
    world = join(process_id, num_processes, torch.device("cpu"))
    seed: list[Any] = [int(torch.randint(0, 2**62, ()).item()) if world.rank == 0 else None]
    if world.distributed:
        dist.broadcast_object_list(seed, src=0, group=world.group)
    return int(seed[0])
