"""Stages, phases and the four execution strategies (configuration only).

A :py:class:`Stage` is one or more blocks run on one IPU; a :py:class:`Phase` is one or
more stages run at the same time. An execution strategy says how the stages of a model
are scheduled. These classes only describe the partition: ``poptorch._runtime.placement``
resolves it against the blocks the model actually enters and enforces the rules.
"""
from __future__ import annotations

import copy
from typing import Any, cast

from .._runtime.placement import strategy as _kinds
from .._runtime.schedule import schedules as _schedules
from .._runtime.schedule.timeline import ScheduleRecord
from ..enums import AutoStage, Liveness
from ..errors import Error

__all__ = [
    "BlockId",
    "ParallelPhasedExecution",
    "Phase",
    "PipelinedExecution",
    "SerialPhasedExecution",
    "ShardedExecution",
    "Stage",
    "_IExecutionStrategy",
    "_IPhasedExecution",
]

BlockId = str


def _block_id(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError("Block ids must be strings (the user_id given to Block/BeginBlock), "
                        f"got {type(value).__name__} ({value!r})")
    return str(value)


class Stage:
    """One or more blocks (by ``user_id``) that run on one IPU.

    >>> poptorch.Stage("A", "B").ipu(1)
    """

    def __init__(self, *block_ids: BlockId | int | list | tuple) -> None:
        if len(block_ids) == 1 and isinstance(block_ids[0], (list, tuple)):
            block_ids = tuple(block_ids[0])
        if not block_ids:
            raise Error("A Stage needs at least one block id, e.g. poptorch.Stage('A').")
        self._blocks: list[str] = [_block_id(b) for b in block_ids]
        self._ipu: int | None = None

    @property
    def blocks(self) -> list[str]:
        """List of blocks this stage is made of."""
        return list(self._blocks)

    def ipu(self, ipu: int) -> Stage:
        """Set the IPU on which this stage will run (returns the stage, for chaining)."""
        if isinstance(ipu, bool) or not isinstance(ipu, int) or ipu < 0:
            raise ValueError(f"Stage.ipu expects an IPU index >= 0, got {ipu!r}")
        self._ipu = ipu
        return self

    def __repr__(self) -> str:
        ids = ", ".join(repr(b) for b in self._blocks)
        return f"Stage({ids})" + ("" if self._ipu is None else f".ipu({self._ipu})")


class Phase:
    """A processing unit of phased execution: stages that run at the same time.

    ``Phase(Stage("A").ipu(0), Stage("B").ipu(1))`` has two stages;
    ``Phase("A", "B")`` has one stage made of two blocks.
    """

    def __init__(self, *arg: Stage | BlockId | int | list | tuple) -> None:
        if len(arg) == 1 and isinstance(arg[0], (list, tuple)):
            arg = tuple(arg[0])
        if not arg:
            raise Error("A Phase needs at least one Stage or block id.")
        if all(isinstance(a, Stage) for a in arg):
            self.stages: list[Stage] = cast("list[Stage]", list(arg))
        elif any(isinstance(a, Stage) for a in arg):
            raise Error("Phase arguments must be either all poptorch.Stage objects or all "
                        f"block ids (strings), got {[type(a).__name__ for a in arg]}")
        else:
            self.stages = [Stage(*cast("tuple[BlockId | int, ...]", arg))]

    def stage(self, idx: int) -> Stage:
        """The ``idx``-th stage of this phase."""
        if not isinstance(idx, int) or not 0 <= idx < len(self.stages):
            raise IndexError(f"Phase has {len(self.stages)} stage(s); no stage {idx!r}")
        return self.stages[idx]

    def ipus(self, *ipus: int) -> Phase:
        """Assign one IPU to each stage of this phase (as many IPUs as stages)."""
        if len(ipus) != len(self.stages):
            raise Error(f"Phase contains {len(self.stages)} stage(s) but {len(ipus)} IPU(s) "
                        "were given to Phase.ipus(): give exactly one IPU per stage.")
        for stage, ipu in zip(self.stages, ipus, strict=False):
            stage.ipu(ipu)
        return self

    def __repr__(self) -> str:
        return "Phase(" + ", ".join(repr(s) for s in self.stages) + ")"


class _IExecutionStrategy:
    """Base of the execution strategies.

    ``onStartTracing`` / ``onEndTracing`` bracket the pass in which PopTorch discovers
    the model's blocks; ``backendOptions`` gives the strategy's settings as a dict.
    """

    #: execution_mode value of the strategy in backendOptions (upstream numbering)
    _execution_mode = 0
    #: the schedule the runtime runs (poptorch._runtime.placement.strategy)
    schedule_kind = _kinds.PIPELINED
    #: the schedule of the last step run with this strategy (``print`` it)
    last_schedule: ScheduleRecord | None = None

    def __init__(self) -> None:
        self._tracing = False

    def stage(self, block_id: BlockId) -> Stage:
        """The stage containing the block ``block_id`` (explicit stages only)."""
        block_id = _block_id(block_id)
        for stage in self._explicit_stages():
            if block_id in stage.blocks:
                return stage
        raise Error(f"No stage of {type(self).__name__} contains block {block_id!r}; its "
                    f"stages are {self._explicit_stages()}.")

    def _explicit_stages(self) -> list[Stage]:
        return []

    def backendOptions(self) -> dict:
        """The strategy's settings (``execution_mode``: 0 pipelined, 1 sharded, 2 phased)."""
        return {"execution_mode": self._execution_mode}

    def onStartTracing(self) -> None:
        """Called when PopTorch starts discovering the model's blocks."""
        self._tracing = True

    def onEndTracing(self) -> None:
        """Called when PopTorch has discovered the model's blocks."""
        self._tracing = False

    def __deepcopy__(self, memo: dict) -> _IExecutionStrategy:
        # Options are copied when a model is wrapped; the copy remembers the user's
        # object (``_origin``) so that the runtime can publish ``last_schedule`` there.
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for key, value in vars(self).items():
            kept = value if key in ("_origin", "last_schedule") else copy.deepcopy(value, memo)
            object.__setattr__(clone, key, kept)
        object.__setattr__(clone, "_origin", getattr(self, "_origin", None) or self)
        return clone


class PipelinedExecution(_IExecutionStrategy):
    """Pipeline the stages over their IPUs (the default strategy).

    ``PipelinedExecution()`` or ``PipelinedExecution(AutoStage.SameAsIpu)``: one stage
    per block, stage id = the block's ``ipu_id``. ``AutoStage.AutoIncrement``: stage ids
    increase with each new block. ``PipelinedExecution("A", "B")`` or
    ``PipelinedExecution(Stage("A", "B"), Stage("C"))``: explicit stages, in order
    (stage ``i`` runs on IPU ``i`` unless ``Stage.ipu`` says otherwise).

    :param args: either an :py:class:`~poptorch.AutoStage` or a list of stages / block ids.
    """

    _execution_mode = 0

    def __init__(self, *args: AutoStage | Stage | BlockId | int | list) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], list):
            args = tuple(args[0])
        self.auto_stage: AutoStage | None = None
        self.pipeline_schedule = _schedules.DEFAULT
        self.last_schedule = None
        self._stages: list[Stage] = []
        if not args:
            self.auto_stage = AutoStage.SameAsIpu
        elif len(args) == 1 and isinstance(args[0], AutoStage):
            self.auto_stage = args[0]
        else:
            for arg in args:
                if isinstance(arg, AutoStage):
                    raise Error(f"{type(self).__name__} takes either one AutoStage or a list "
                                "of stages / block ids, not both.")
                self._stages.append(arg if isinstance(arg, Stage) else Stage(arg))
            _check_unique_blocks(self._stages, type(self).__name__)

    def _explicit_stages(self) -> list[Stage]:
        return list(self._stages)

    def setSchedule(self, schedule: str) -> PipelinedExecution:
        """Choose the pipeline schedule of training steps (an OpenPopTorch addition;
        the names are case-insensitive):

        * ``"1F1B"`` (default): warm-up forwards, then one forward / one backward;
          at most as many micro-batches in flight as stages;
        * ``"GPipe"``: all forwards, then all backwards;
        * ``"Interleaved1F1B"``: several stages per device, blocks placed on devices
          0, 1, 0, 1, ... (``BeginBlock(..., ipu_id=...)``); each block is its own
          stage (``AutoStage.AutoIncrement``) and each device alternates its stages'
          forwards and backwards, which shortens the pipeline's fill and drain;
        * ``"ZeroBubble"``: each backward split into the input-gradient half (which
          the earlier stage waits for) and the weight-gradient half, run where the
          stage would otherwise wait.

        All give the same results. Inference always runs forwards in order.
        ``poptorch.Error`` for another name (the message lists the valid ones)."""
        try:
            self.pipeline_schedule = _schedules.schedule_name_of(schedule)
        except ValueError as exc:
            raise Error(str(exc)) from None
        if self.pipeline_schedule == "Interleaved1F1B" and \
                self.auto_stage == AutoStage.SameAsIpu:
            self.auto_stage = AutoStage.AutoIncrement  # blocks 0, 1, 0, 1: four stages
        return self

    def __repr__(self) -> str:
        inside = repr(self.auto_stage) if self.auto_stage is not None else ", ".join(
            repr(s) for s in self._stages)
        return f"{type(self).__name__}({inside})"


class ShardedExecution(PipelinedExecution):
    """Run the stages one after another, each on its IPU (one IPU busy at a time).

    Takes the same arguments as :py:class:`PipelinedExecution`.
    """

    _execution_mode = 1
    schedule_kind = _kinds.SHARDED


class _IPhasedExecution(_IExecutionStrategy):
    """Common part of the phased strategies: a list of :py:class:`Phase`."""

    _execution_mode = 2

    def __init__(self, *phases: Phase | Stage | BlockId | int | list | tuple) -> None:
        super().__init__()
        if len(phases) == 1 and isinstance(phases[0], list):
            phases = tuple(phases[0])
        self._tensors_liveness = Liveness.AlwaysLive
        self.last_schedule = None
        self._separate_backward_phase = False
        self._phases: list[Phase] = []
        for phase in phases:
            if isinstance(phase, Phase):
                self._phases.append(phase)
            elif isinstance(phase, Stage):
                self._phases.append(Phase(phase))
            elif isinstance(phase, (list, tuple)):
                self._phases.append(Phase(*phase))
            else:
                self._phases.append(Phase(phase))
        _check_unique_blocks([s for p in self._phases for s in p.stages], type(self).__name__)

    @property
    def phases(self) -> list[Phase]:
        """The phases, in execution order."""
        return list(self._phases)

    def phase(self, phase: int) -> Phase:
        """The phase with index ``phase``."""
        if isinstance(phase, bool) or not isinstance(phase, int) or phase < 0:
            raise ValueError(f"Phases are identified by integers >= 0, got {phase!r}")
        if phase >= len(self._phases):
            raise IndexError(f"{type(self).__name__} has {len(self._phases)} phase(s); no "
                             f"phase {phase}")
        return self._phases[phase]

    def useSeparateBackwardPhase(self, use: bool = True) -> None:
        """Give each backward phase its own phase instead of sharing the forward one's."""
        if not isinstance(use, bool):
            raise TypeError(f"use must be a bool, got {type(use).__name__}")
        self._separate_backward_phase = use

    @property
    def tensors_liveness(self) -> Liveness:
        """Where tensors of inactive phases live (see :py:class:`~poptorch.Liveness`)."""
        return self._tensors_liveness

    @property
    def separate_backward_phase(self) -> bool:
        return self._separate_backward_phase

    def _explicit_stages(self) -> list[Stage]:
        return [s for p in self._phases for s in p.stages]

    def backendOptions(self) -> dict:
        return {
            "execution_mode": self._execution_mode,
            "separate_backward_phase": self._separate_backward_phase,
            "tensors_liveness": int(self._tensors_liveness),
            "serial_phases_execution": isinstance(self, SerialPhasedExecution),
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(" + ", ".join(repr(p) for p in self._phases) + ")"


class SerialPhasedExecution(_IPhasedExecution):
    """All the phases run one after another on a single group of IPUs.

    Stage ``j`` of every phase runs on IPU ``j`` unless ``Phase.ipus`` says otherwise.
    """

    schedule_kind = _kinds.SERIAL_PHASED

    def setTensorsLiveness(self, liveness: Liveness) -> None:
        """See :py:class:`~poptorch.Liveness`."""
        if not isinstance(liveness, Liveness):
            raise TypeError(f"liveness must be a poptorch.Liveness, got {liveness!r}")
        self._tensors_liveness = liveness


class ParallelPhasedExecution(_IPhasedExecution):
    """Phases alternate between two groups of IPUs: even phases on even IPUs, odd
    phases on odd IPUs. Stage ``j`` of phase ``p`` runs on IPU ``2*j + p % 2`` unless
    ``Phase.ipus`` says otherwise.
    """

    schedule_kind = _kinds.PARALLEL_PHASED

    def sendTensorsOffChipAfterFwd(self, off_chip: bool = True) -> None:
        """Move tensors off chip after the forward pass (``Liveness.OffChipAfterFwd``),
        or keep them live (``off_chip=False``: ``Liveness.AlwaysLive``)."""
        if not isinstance(off_chip, bool):
            raise TypeError(f"off_chip must be a bool, got {type(off_chip).__name__}")
        self._tensors_liveness = Liveness.OffChipAfterFwd if off_chip else Liveness.AlwaysLive


def _check_unique_blocks(stages: list[Stage], owner: str) -> None:
    seen: dict = {}
    for stage in stages:
        for block in stage.blocks:
            if block in seen:
                raise Error(f"Block {block!r} appears in two stages of {owner} "
                            f"({seen[block]!r} and {stage!r}): a block belongs to one stage.")
            seen[block] = stage


StrategyArg = AutoStage | str | Stage
