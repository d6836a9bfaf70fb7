"""A schedule run in the calling thread by a model that has no stage modules.

What the engine (``engine.py``) cannot run (``build.py`` lists the cases) runs here:
:func:`run_in_calling_thread` interprets a ``schedules.sharded`` action list with the
model's own ``forward``, under a :class:`~.stagerun.StageRun` that moves every tensor to
the device of the stage the forward pass is in. A micro-batch's forward cannot be cut
into calls per unit, so it runs whole at its first ``F`` action (the later ones are the
units it crossed); a ``B`` action runs its unit's backward (phased: cut at phase
boundaries, each phase's backward with its weights in place) or, uncut, the loss's one
backward at the micro-batch's first ``B``. Phased execution streams a phase's weights
in as the forward pass reaches it, and all back to the host at the end of the step.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from ..._typing import UserOutput
from ..program.runner import LossOf
from ..schedule.actions import Action, ActionKind
from ..schedule.timeline import ScheduleEvent, ScheduleRecord
from .markers import listening
from .partition import Partition
from .phased import StreamingMemory
from .stagerun import StageRun

Forward = Callable[[tuple, dict], UserOutput]  # the model's forward on (args, kwargs)

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


def units_of(partition: Partition, phased: bool) -> list[int]:
    """The unit of each stage: its phase (phased: the forward is cut between phases),
    else the stage itself (uncut)."""
    if phased:
        return [s.phase or 0 for s in partition.stages]
    return list(range(partition.num_stages))


def run_in_calling_thread(ops: list[Action], forward: Forward, partition: Partition,
                          devices: list[torch.device], streaming: StreamingMemory | None,
                          microbatches: list[tuple], loss_of: LossOf | None,
                          record: ScheduleRecord) -> list[UserOutput]:
    """Run ``ops`` (units as stages) over ``microbatches``; the outputs per
    micro-batch, the executed actions appended to ``record`` (module docstring)."""
    unit_of_stage = units_of(partition, streaming is not None)
    resident: list[int | None] = [None]  # the phase whose weights are in place

    def stream_in(unit: int) -> None:
        if streaming is not None:
            streaming.enter(unit, resident[0])
            resident[0] = unit

    outputs: list[UserOutput] = [None] * len(microbatches)
    runs: dict[int, tuple[StageRun, list[int]]] = {}  # micro-batch -> its run, units
    scope = (streaming.activation_scope(devices) if streaming is not None
             else contextlib.nullcontext())
    try:
        with scope:
            for op in ops:
                m = op.microbatch
                if op.kind == F and m not in runs:
                    run = StageRun(partition, devices, unit_of_stage,
                                   cut=streaming is not None, on_unit=stream_in)
                    units, out = _forward(run, forward, microbatches[m], m, loss_of,
                                          record)
                    runs[m] = (run, units)
                    outputs[m] = out
                elif op.kind == B and m in runs:
                    _backward(op.stage, m, runs, streaming is not None, stream_in, record)
    finally:
        if streaming is not None:
            streaming.offload_all()
    return outputs


def _forward(run: StageRun, forward: Forward, microbatch: tuple, m: int,
             loss_of: LossOf | None, record: ScheduleRecord
             ) -> tuple[list[int], UserOutput]:
    """Micro-batch ``m``'s whole forward (and loss); the units it crossed, in order."""
    clock = time.perf_counter
    reached: list[tuple[int, float]] = []
    hook = run.on_unit

    def reach(unit: int) -> None:
        reached.append((unit, clock()))
        if hook is not None:
            hook(unit)

    run.on_unit = reach
    args, kwargs = microbatch
    with listening(run), run:
        run.start()
        out = forward(args, kwargs)
        run.loss = loss_of(out) if loss_of is not None else None
    ends = [t for _, t in reached[1:]] + [clock()]
    for (unit, start), end in zip(reached, ends, strict=True):
        record.events.append(ScheduleEvent(0, F, unit, m, start, end))
    return [unit for unit, _ in reached], out


def _backward(unit: int, m: int, runs: dict[int, tuple[StageRun, list[int]]], cut: bool,
              stream_in: Callable[[int], None], record: ScheduleRecord) -> None:
    clock = time.perf_counter
    run, units = runs[m]
    if run.loss is None and not cut:
        return
    start = clock()
    if not cut:  # one graph through every unit: the loss's one backward, at the first B
        loss, run.loss = run.loss, None
        assert loss is not None
        loss.backward()
        end = clock()
        record.events += [ScheduleEvent(0, B, u, m, start, end) for u in reversed(units)]
        return
    if unit not in units:
        return  # (the forward never reached it)
    stream_in(unit)
    run.backward_unit(unit)
    record.events.append(ScheduleEvent(0, B, unit, m, start, clock()))
