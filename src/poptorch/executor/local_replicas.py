"""How the local replicas of one process run: one after another, or concurrently.

``replicationFactor(r)`` gives a process ``r`` replicas. Each needs its own buffers
(``ReplicaBuffers``) and its group's value of replica-grouped weights
(``replica_groups``); by default they run one after another on one device
(``PerReplicaRunner``). When the ``r`` IPUs are different GPUs, the replicas run
concurrently, one per GPU (``ConcurrentReplicas``); ``POPTORCH_CONCURRENT_REPLICAS=1``
asks for that on the CPU too (threads over CPU copies, which stand in for GPUs) and
``=0`` turns it off.
"""
from __future__ import annotations

from typing import Any

import torch

from .. import _devices
from .._logging import info_once
from .._runtime.batching.plan import BatchPlan
from .._runtime.config import RuntimeConfig
from .._runtime.program.concurrent_replicas import ConcurrentReplicas
from .._runtime.program.replica_groups import grouped_parameters
from .._runtime.program.runner import PerReplicaRunner, ReplicaBuffers, SequentialRunner
from ..errors import Error

CONCURRENT_ENV = "POPTORCH_CONCURRENT_REPLICAS"


def _replica_devices(options: Any, replicas: int) -> list[torch.device] | None:
    """The devices of replicas ``0 .. r-1`` if they should run concurrently, else None."""
    setting = _devices.env_setting(CONCURRENT_ENV)
    if setting is False:
        return None
    devices = [_devices.ipu_device(k, options) for k in range(replicas)]
    if setting:
        return devices
    distinct = {str(d) for d in devices}
    return devices if devices[0].type == "cuda" and len(distinct) > 1 else None


def local_replica_runner(model: torch.nn.Module, options: Any, config: RuntimeConfig,
                         groupings: dict | None, runner: Any, plan: BatchPlan,
                         cross: Any) -> tuple[Any, Any]:
    """The runner of the process's ``r`` local replicas (see module docstring) and their
    per-replica buffers (None when they share one set); ``runner`` itself when there is
    nothing per replica (one replica, no buffers, no groupings). ``options`` name the
    devices (``_devices.ipu_device``), ``config`` is the rest as compiled."""
    r = plan.replication_factor
    processes = cross.world.size if cross is not None else 1
    groupings = groupings or {}
    broadcast = config.distributed.broadcast_buffers
    grouped = grouped_parameters(
        model, groupings, (cross.world.rank if cross is not None else 0) * r, r,
        r * processes) if groupings else []
    plain = isinstance(runner, SequentialRunner) and runner.forward is model
    if grouped and not plain:
        raise Error("replicaGrouping needs the default execution (one model per "
                    "replica); it does not combine with execution strategies or "
                    "block annotations.")
    devices = _replica_devices(options, r) if r > 1 and plain and not grouped else None
    if devices is not None and not config.anchored_tensors:
        info_once(("concurrent-replicas", tuple(map(str, devices))),
                  "%d local replicas run concurrently, on %s.", r,
                  ", ".join(map(str, devices)))
        check = runner.check if isinstance(runner, SequentialRunner) else None
        concurrent = ConcurrentReplicas(model, devices, broadcast, plan.per_step, check)
        return concurrent, concurrent
    has_buffers = r > 1 and next(model.buffers(), None) is not None
    if not grouped and not has_buffers:
        return runner, None
    if not plain:
        info_once(("shared-replica-buffers",),
                  "Model-parallel execution with replicationFactor(%d): the replicas "
                  "share one set of buffers (broadcastBuffers has no effect).", r)
        return runner, None
    states: list[Any] = list(grouped)
    buffers = None
    if has_buffers:
        buffers = ReplicaBuffers(model, r, broadcast)
        states.append(buffers)
    return PerReplicaRunner(runner, states, r, plan.per_step), buffers
