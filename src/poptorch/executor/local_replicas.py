"""How the local replicas of one process run: one after another, or concurrently.

``replicationFactor(r)`` gives a process ``r`` replicas. Each needs its own buffers
(``ReplicaBuffers``) and its group's value of replica-grouped weights
(``replica_groups``); by default they are lanes of the one-stage interpreter's schedule
on one device (``LOAD`` / ``STORE`` of each lane's state around its micro-batches).
When the ``r`` IPUs are different GPUs, the lanes run concurrently, one per GPU
(``ReplicaCopies``); ``POPTORCH_CONCURRENT_REPLICAS=1`` asks for that on the CPU
too (threads over CPU copies, which stand in for GPUs) and ``=0`` turns it off.
"""
from __future__ import annotations

import torch

from .. import _devices
from .._logging import info_once
from .._runtime.batching.plan import BatchPlan
from .._runtime.config import RuntimeConfig
from .._runtime.program.concurrent_replicas import ReplicaCopies
from .._runtime.program.interpreter import Interpreter
from .._runtime.program.replica_groups import grouped_parameters
from .._runtime.program.runner import ReplicaBuffers, ReplicaState
from .._typing import OptionsView
from ..errors import Error

CONCURRENT_ENV = "POPTORCH_CONCURRENT_REPLICAS"


def _replica_devices(device_options: OptionsView, replicas: int) -> list[torch.device] | None:
    """The devices of replicas ``0 .. r-1`` if they should run concurrently, else None."""
    setting = _devices.env_setting(CONCURRENT_ENV)
    if setting is False:
        return None
    devices = [_devices.ipu_device(k, device_options) for k in range(replicas)]
    if setting:
        return devices
    distinct = {str(d) for d in devices}
    return devices if devices[0].type == "cuda" and len(distinct) > 1 else None


def concurrent_replicas(model: torch.nn.Module, device_options: OptionsView,
                        config: RuntimeConfig, groupings: dict | None,
                        interpreter: Interpreter, plan: BatchPlan) -> ReplicaCopies | None:
    """Give the one-stage interpreter's lanes model copies of their own on their own
    devices, run concurrently, when the ``r`` local replicas' IPUs are different devices
    (module docstring); return the copies (None: the lanes share the one device)."""
    r = plan.replication_factor
    if r < 2 or groupings or config.anchored_tensors:
        return None
    devices = _replica_devices(device_options, r)
    if devices is None:
        return None
    info_once(("concurrent-replicas", tuple(map(str, devices))),
              "%d local replicas run concurrently, on %s.", r, ", ".join(map(str, devices)))
    copies = ReplicaCopies(model, devices, config.distributed.broadcast_buffers)
    interpreter.run_lanes_on(copies)
    return copies


def replica_lanes(model: torch.nn.Module, config: RuntimeConfig, groupings: dict | None,
                  interpreter: Interpreter | None, plan: BatchPlan,
                  first_replica: int, processes: int) -> ReplicaBuffers | None:
    """Give the interpreter's schedule one lane per local replica with its own state
    (buffers, replica-grouped weights) where the replicas need one; return the
    per-replica buffers (None when the replicas share one set). ``first_replica``: the
    global index of this process's replica 0."""
    r = plan.replication_factor
    groupings = groupings or {}
    broadcast = config.distributed.broadcast_buffers
    grouped = grouped_parameters(model, groupings, first_replica, r,
                                 r * processes) if groupings else []
    if grouped and interpreter is None:
        raise Error("replicaGrouping needs the default execution (one model per "
                    "replica); it does not combine with execution strategies or "
                    "block annotations.")
    has_buffers = r > 1 and next(model.buffers(), None) is not None
    if not grouped and not has_buffers:
        return None
    if interpreter is None:
        info_once(("shared-replica-buffers",),
                  "Model-parallel execution with replicationFactor(%d): the replicas "
                  "share one set of buffers (broadcastBuffers has no effect).", r)
        return None
    states: list[ReplicaState] = list(grouped)
    buffers = None
    if has_buffers:
        buffers = ReplicaBuffers(model, r, broadcast)
        states.append(buffers)
    interpreter.use_lanes(states, broadcast and has_buffers)
    return buffers
