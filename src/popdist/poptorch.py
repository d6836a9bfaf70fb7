"""``popdist.poptorch.Options``: a ``poptorch.Options`` set up for this instance."""
from __future__ import annotations

import os
from typing import Any

import poptorch
import poptorch.options.distributed as _distributed

from . import (
    IPUS_PER_REPLICA_ENV,
    PopdistError,
    getInstanceIndex,
    getNumInstances,
    getNumIpusPerReplica,
    getNumLocalReplicas,
    isPopdistEnvSet,
)

__all__ = ["Options"]


def _blocked(name: str) -> PopdistError:
    return PopdistError(f"Cannot call `{name}` with popdist.poptorch.Options: PopDist sets "
                        "it from the launcher (poprun --num-replicas / --num-instances). "
                        "Change the launch command, or use poptorch.Options.")


class _PopdistDistributed(_distributed._DistributedOptions):
    """``Options.Distributed`` fixed to this instance's place."""

    def _lock(self) -> None:
        object.__setattr__(self, "_popdist_locked", True)

    def _locked(self) -> bool:
        return getattr(self, "_popdist_locked", False)

    def disable(self) -> Any:
        if self._locked():
            raise _blocked("Distributed.disable")
        return super().disable()

    def setEnvVarNames(self, var_num_processes: str, var_process_id: str) -> Any:
        if self._locked():
            raise _blocked("Distributed.setEnvVarNames")
        return super().setEnvVarNames(var_num_processes, var_process_id)

    def configureProcessId(self, process_id: int, num_processes: int) -> Any:
        if self._locked():
            raise _blocked("Distributed.configureProcessId")
        return super().configureProcessId(process_id, num_processes)


class Options(poptorch.Options):
    """``poptorch.Options`` with ``replicationFactor`` = this instance's replicas
    (:func:`popdist.getNumLocalReplicas`) and ``Distributed`` = its index among the
    instances. Those, and ``useIpuId``, cannot be changed afterwards (PopDist's rule).

    ``ipus_per_replica`` is the program's IPUs (pipeline / sharding stages) per replica;
    under ``poprun --ipus-per-replica`` the two must agree.
    """

    def __init__(self, ipus_per_replica: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if ipus_per_replica is not None:
            if isinstance(ipus_per_replica, bool) or not isinstance(ipus_per_replica, int) \
                    or ipus_per_replica < 1:
                raise PopdistError("popdist.poptorch.Options: ipus_per_replica must be an "
                                   f"integer >= 1, got {ipus_per_replica!r}.")
            if isPopdistEnvSet() and ipus_per_replica != getNumIpusPerReplica() and \
                    _launched_with_ipus_per_replica():
                raise PopdistError(
                    f"popdist.poptorch.Options(ipus_per_replica={ipus_per_replica}) "
                    f"disagrees with poprun --ipus-per-replica {getNumIpusPerReplica()}: "
                    "give both the same value.")
        self.ipus_per_replica = ipus_per_replica or getNumIpusPerReplica()
        distributed = _PopdistDistributed()
        distributed.configureProcessId(getInstanceIndex(), getNumInstances())
        distributed._lock()
        object.__setattr__(self, "_distributed", distributed)
        super().replicationFactor(getNumLocalReplicas())

    def replicationFactor(self, replication_factor: int) -> Options:
        raise _blocked("replicationFactor")

    def useIpuId(self, ipu_id: int) -> Options:
        raise _blocked("useIpuId")


def _launched_with_ipus_per_replica() -> bool:
    return IPUS_PER_REPLICA_ENV in os.environ
