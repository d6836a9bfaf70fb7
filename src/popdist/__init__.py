"""PopDist for OpenPopTorch: where this instance of a program stands among the others,
answered from torchrun's environment and ``torch.distributed``.

Graphcore's PopDist told a program started by PopRun how many instances (processes)
run, which one it is and how many replicas each drives. Here an instance is a torchrun
process (``RANK`` of ``WORLD_SIZE``, ``LOCAL_RANK`` on its host) and the replica counts
come from ``poprun`` (``POPDIST_NUM_TOTAL_REPLICAS``, ``POPDIST_NUM_IPUS_PER_REPLICA``)
or default to one replica per instance under a plain ``torchrun``.

>>> import popdist, popdist.poptorch
>>> if popdist.isPopdistEnvSet():
...     popdist.init()
...     opts = popdist.poptorch.Options(ipus_per_replica=1)
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

import poptorch

__all__ = [
    "PopdistError", "execute_on_instances", "finalizeBackend", "getDeviceId",
    "getInstanceIndex", "getNumInstances", "getNumIpusPerReplica", "getNumLocalReplicas",
    "getNumTotalReplicas", "getReplicaIndexOffset", "init", "isPopdistEnvSet",
    "isUsingPopdist", "synchronize",
]

# Set by poprun (the names PopRun used).
TOTAL_REPLICAS_ENV = "POPDIST_NUM_TOTAL_REPLICAS"
IPUS_PER_REPLICA_ENV = "POPDIST_NUM_IPUS_PER_REPLICA"


class PopdistError(poptorch.Error, RuntimeError):
    """A program misused PopDist (a ``poptorch.Error`` that is also the
    ``RuntimeError`` PopDist raised)."""


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise PopdistError(f"popdist: environment variable {name}={raw!r} is not an "
                           "integer.") from None
    if value < 0 or (value == 0 and name != "RANK" and name != "LOCAL_RANK"):
        raise PopdistError(f"popdist: environment variable {name}={raw!r} must be "
                           "positive.")
    return value


def isPopdistEnvSet() -> bool:
    """True when the program was started by ``poprun`` or ``torchrun`` (or any launcher
    that sets ``RANK`` and ``WORLD_SIZE``)."""
    return TOTAL_REPLICAS_ENV in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ)


def isUsingPopdist() -> bool:
    """True once :func:`init` ran in a PopDist environment."""
    return _initialised and isPopdistEnvSet()


def getNumInstances() -> int:
    """How many instances (processes) run the program: torchrun's ``WORLD_SIZE``."""
    return _env_int("WORLD_SIZE", 1)


def getInstanceIndex() -> int:
    """This instance's index, ``0 .. getNumInstances() - 1``: torchrun's ``RANK``."""
    index = _env_int("RANK", 0)
    if index >= getNumInstances():
        raise PopdistError(f"popdist: RANK={index} is not below WORLD_SIZE="
                           f"{getNumInstances()}.")
    return index


def getNumTotalReplicas() -> int:
    """Replicas of all instances together (``poprun --num-replicas``; one per instance
    under a plain torchrun)."""
    instances = getNumInstances()
    total = _env_int(TOTAL_REPLICAS_ENV, instances)
    if total % instances:
        raise PopdistError(
            f"popdist: {total} replicas ({TOTAL_REPLICAS_ENV}) cannot be shared by "
            f"{instances} instances: the number of replicas must be a multiple of the "
            "number of instances (poprun --num-replicas / --num-instances).")
    return total


def getNumLocalReplicas() -> int:
    """Replicas of this instance: total replicas / instances (its
    ``replicationFactor``)."""
    return getNumTotalReplicas() // getNumInstances()


def getReplicaIndexOffset() -> int:
    """Global index of this instance's first replica."""
    return getInstanceIndex() * getNumLocalReplicas()


def getNumIpusPerReplica() -> int:
    """IPUs per replica (``poprun --ipus-per-replica``, default 1): the program's
    pipeline / sharding stages per replica."""
    return _env_int(IPUS_PER_REPLICA_ENV, 1)


def getDeviceId() -> int:
    """This instance's device on its host: torchrun's ``LOCAL_RANK`` (upstream: the id of
    the multi-IPU device of its replicas). OpenPopTorch places each process on its own
    share of the host's GPUs itself (docs/scaling-out.md), so programs need not pass it
    to ``useIpuId``."""
    return _env_int("LOCAL_RANK", 0)


_initialised = False


def init() -> None:
    """Join the instances' ``torch.distributed`` process group (the one the models
    also use: gloo for CPU tensors, and NCCL for CUDA tensors on GPU hosts). Outside a
    PopDist environment, or with one instance, nothing to join."""
    global _initialised
    _check_replicas()
    if getNumInstances() > 1 and not (dist.is_available() and dist.is_initialized()):
        from poptorch._runtime.distributed.world import join
        join(getInstanceIndex(), getNumInstances(), torch.device("cpu"))
    _initialised = True


def finalizeBackend() -> None:
    """Leave the process group :func:`init` joined (also done at exit)."""
    global _initialised
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _initialised = False


def _check_replicas() -> None:
    getNumTotalReplicas()
    getNumIpusPerReplica()
    getInstanceIndex()


def _group_ready(what: str) -> bool:
    if getNumInstances() == 1:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        raise PopdistError(f"popdist.{what}: the instances are not connected yet; call "
                           "popdist.init() first.")
    return True


def synchronize() -> None:
    """Wait until every instance reaches this point (a barrier)."""
    if _group_ready("synchronize"):
        dist.barrier()


def execute_on_instances(instances: Iterable[int], fn: Callable[..., Any], *args: Any,
                         **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on the listed instances only (such as ``{0}`` to
    write a checkpoint once), then wait for every instance, so none goes on before the
    work is done. Returns ``fn``'s result there, None on the other instances."""
    try:
        chosen = {int(i) for i in instances}
    except (TypeError, ValueError):
        raise PopdistError("popdist.execute_on_instances: instances must be a set of "
                           f"instance indices, such as {{0}}; got {instances!r}.") from None
    if not callable(fn):
        raise PopdistError(f"popdist.execute_on_instances: fn must be callable, got "
                           f"{fn!r}.")
    count = getNumInstances()
    bad = sorted(i for i in chosen if not 0 <= i < count)
    if bad:
        raise PopdistError(f"popdist.execute_on_instances: instances {bad} do not exist: "
                           f"there are {count} instances (0 .. {count - 1}).")
    distributed = _group_ready("execute_on_instances")
    result = None
    try:
        if getInstanceIndex() in chosen:
            result = fn(*args, **kwargs)
    finally:
        if distributed:
            dist.barrier()
    return result
