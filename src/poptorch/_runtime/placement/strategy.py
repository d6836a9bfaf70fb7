"""What the runtime needs to know of an execution strategy.

The strategy classes users configure (``poptorch.PipelinedExecution``,
``ShardedExecution``, ``SerialPhasedExecution``, ``ParallelPhasedExecution``) live in
the public layer (``poptorch.annotations.strategies``). The runtime reads them through
this small protocol instead of importing them: each class names its schedule with a
``schedule_kind`` class attribute.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ...enums import AutoStage, Liveness
from ..schedule.schedules import DEFAULT
from ..schedule.timeline import ScheduleRecord

PIPELINED = "pipelined"
SHARDED = "sharded"
SERIAL_PHASED = "serial_phased"
PARALLEL_PHASED = "parallel_phased"


class StageView(Protocol):
    """A ``poptorch.Stage`` as the runtime reads it: its blocks, and its IPU (None:
    placed automatically)."""

    _ipu: int | None

    @property
    def blocks(self) -> list[str]: ...


class PhaseView(Protocol):
    """A ``poptorch.Phase`` as the runtime reads it: its stages."""

    @property
    def stages(self) -> Sequence[StageView]: ...


class ExecutionStrategy(Protocol):
    """The attributes of a strategy object that the runtime reads."""

    schedule_kind: str
    # read per kind: pipelined / sharded (auto_stage), phased (phases, tensors_liveness);
    # last_schedule is written by the runner for inspection
    auto_stage: AutoStage | None
    last_schedule: ScheduleRecord | None

    @property
    def phases(self) -> Sequence[PhaseView]: ...

    @property
    def tensors_liveness(self) -> Liveness: ...

    def onStartTracing(self) -> None: ...

    def onEndTracing(self) -> None: ...

    def _explicit_stages(self) -> Sequence[StageView]: ...


def is_phased(strategy: ExecutionStrategy) -> bool:
    """True for the serial and parallel phased strategies."""
    return strategy.schedule_kind in (SERIAL_PHASED, PARALLEL_PHASED)


def schedule_name(strategy: ExecutionStrategy) -> str:
    """The pipeline schedule a pipelined strategy asks for (one of
    ``schedules.SCHEDULES``)."""
    return getattr(strategy, "pipeline_schedule", DEFAULT)


def publish_schedule(strategy: ExecutionStrategy, record: ScheduleRecord) -> None:
    """Show the schedule just run as ``last_schedule`` on the strategy in force and on
    the strategy object the user made (the options hold a copy of it: ``_origin``)."""
    strategy.last_schedule = record
    origin = getattr(strategy, "_origin", None)
    if origin is not None:
        origin.last_schedule = record
