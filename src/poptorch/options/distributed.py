"""``Options.Distributed``: this process's place among several processes."""
from __future__ import annotations

import os

from .store import (
    OptionChoiceError,
    OptionNameError,
    OptionsDict,
    check_bool,
    check_int,
    check_str,
)


class _DistributedOptions(OptionsDict):
    """Options related to running over several processes.

    ``processId`` / ``numProcesses`` come from ``configureProcessId``, else from the
    OpenMPI variables ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE`` (upstream's
    default), else from torchrun's ``RANK`` / ``WORLD_SIZE``.

    >>> opts = poptorch.Options()
    >>> opts.Distributed.configureProcessId(0, 2)
    """

    def __init__(self) -> None:
        super().__init__(num_distributed_processes=1, distributed_process_id=0,
                         ipuof_configs={}, stages_on_processes=False)
        if "OMPI_COMM_WORLD_SIZE" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
            self.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")
        elif "WORLD_SIZE" in os.environ or "RANK" in os.environ:
            self.setEnvVarNames("WORLD_SIZE", "RANK")

    def disable(self) -> _DistributedOptions:
        """Ignore the environment and run as a single process."""
        self.set(num_distributed_processes=1, distributed_process_id=0)
        return self

    def setEnvVarNames(self, var_num_processes: str,
                       var_process_id: str) -> _DistributedOptions:
        """Read ``numProcesses`` and ``processId`` from these environment variables."""
        values = []
        for var, default in ((var_num_processes, "1"), (var_process_id, "0")):
            check_str("Distributed.setEnvVarNames", var, error=OptionNameError)
            raw = os.environ.get(var, default)
            try:
                values.append(int(raw))
            except ValueError:
                raise OptionChoiceError(f"Distributed.setEnvVarNames: environment "
                                        f"variable {var}={raw!r} is not an integer."
                                        ) from None
        return self.configureProcessId(values[1], values[0])

    def configureProcessId(self, process_id: int,
                           num_processes: int) -> _DistributedOptions:
        """Set this process's id and the total number of processes."""
        check_int("Distributed.configureProcessId num_processes", num_processes, minimum=1)
        check_int("Distributed.configureProcessId process_id", process_id, minimum=0,
                  maximum=num_processes - 1)
        self.set(distributed_process_id=process_id, num_distributed_processes=num_processes)
        return self

    def stagesOnProcesses(self, enabled: bool = True) -> _DistributedOptions:
        """Run each stage of a ``PipelinedExecution`` model in a process of its own
        (an OpenPopTorch addition). The processes of the run (``torchrun``) are then
        ``stages x replicas``: process ``p`` runs stage ``p % stages`` of pipeline replica
        ``p // stages``, activations and gradients travel between the processes with
        ``torch.distributed.pipelining``, and a pipeline can span machines. See
        ``docs/parallel.md``. Read back as ``opts.Distributed.stages_on_processes``."""
        self.set(stages_on_processes=check_bool("Distributed.stagesOnProcesses", enabled))
        return self

    def toDict(self) -> dict:
        """The option values; ``stages_on_processes`` (ours) only once enabled."""
        out = super().toDict()
        if not out.get("stages_on_processes"):
            out.pop("stages_on_processes", None)
        return out

    @property
    def processId(self) -> int:
        """Id of the current process."""
        return self._values["distributed_process_id"]

    @property
    def numProcesses(self) -> int:
        """Total number of processes the execution is distributed over."""
        return self._values["num_distributed_processes"]


# --------------------------------------------------------------------------------------
# Settings in a TensorLocationSettings dict that have no meaning on our devices.
