"""What a backend is: the two pieces of a step that differ between eager and compiled.

The device program (``device_loop.py``) runs every call the same way whatever the
backend: it splits the inputs, loops over device iterations, runs each step
(``step.train_step``: micro-batches, reduction, Mean / Sum, loss scale, update),
collects outputs and keeps perf counters. A :py:class:`Backend` supplies only

* ``runner``: the forward (and backward) passes of a step's micro-batches, and
* ``update()``: the optimizer step.

:py:class:`EagerBackend` runs the model as it is, through whatever runner the options
call for (pipelines, replicas, ...). ``compiled_step.CompiledBackend`` runs compiled
pieces. ``fallback.Probation`` wraps the compiled one during its first calls, and
``backend_trial.BackendSelector`` picks the backend of each call. On GPUs
``cuda_graphs.CudaGraphCall`` replays a whole call of the backend in force.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .optimizer import OptimizerBinding
from .runner import StepRunner

__all__ = ["Backend", "EagerBackend", "compile_blocker"]


class Backend(Protocol):
    """The pieces of a step a backend supplies (module docstring)."""

    name: str  # "eager" or "compiled"

    @property
    def runner(self) -> StepRunner:
        """Runs the forward (and backward) passes of a step's micro-batches."""
        ...

    def update(self) -> None:
        """The optimizer step of a training step."""
        ...


class EagerBackend:
    """The model as it is: the program's runner and the optimizer's own step (or the
    managed step of sharded / off-chip optimizer state)."""

    name = "eager"

    def __init__(self, runner: StepRunner, binding: OptimizerBinding | None,
                 managed_step: Callable[[], object] | None) -> None:
        self.runner = runner
        self._binding = binding
        self.managed_step = managed_step

    def update(self) -> None:
        if self.managed_step is not None:
            self.managed_step()
            return
        assert self._binding is not None  # (only training steps update)
        self._binding.step()


def compile_blocker(plain: bool, wraps_calls: bool) -> str | None:
    """Why the micro-batches of a program cannot be compiled, or None when they can:
    compiled pieces run one micro-batch at a time on one device, with nothing of ours
    around the forward pass (``plain``: the program's runner is the one-stage
    interpreter over the model itself, ``ProgramSpec.plain``)."""
    if not plain:
        return ("model parallelism or replicas with their own buffers run micro-batches "
                "outside one device program")
    if wraps_calls:
        return ("precision casting, strided group norm, profiling, or weights sharded "
                "over the processes or streamed from host memory wrap every call")
    return None
