"""The stages one after another in the calling thread: the runtime of the models the
engine cannot run.

The engine (``engine.py``) runs stage modules split from the captured graph. A model
that cannot be captured (data-dependent control flow, ``*args`` signatures), phased
execution whose phases hold several stages, sharded stages that revisit an earlier
stage, and a call whose non-tensor arguments differ from the captured ones run here
instead: each micro-batch runs the model's own ``forward`` under a
:class:`~.stagerun.StageRun`, which moves every tensor to the device of the stage the
forward pass is in, then (training) its backward pass; the next micro-batch follows.
One device is busy at a time, as in sharded execution.

Phased execution streams a phase's weights in as the forward pass reaches the phase;
its forward is cut at phase boundaries so that each phase's backward runs with that
phase's weights in place (the others stay in host memory), and every streamed weight
goes back to the host at the end of the step.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from ..program.overlapped_io import FirstForwardCheck
from .partition import Partition
from .phased import StreamingMemory
from .pipeline import BACKWARD, FORWARD, SEQUENTIAL, ScheduleEvent, ScheduleRecord
from .stagerun import StageRun, listening

LossOf = Callable[[Any], torch.Tensor]


class SequentialStages:
    """Runs the micro-batches of a step through the stages of ``partition``, one after
    another (module docstring); ``check``: the overlap markers' check of the first
    forward, for a model whose markers were not checked on a captured graph."""

    def __init__(self, model: torch.nn.Module, partition: Partition,
                 devices: list[torch.device], streaming: StreamingMemory | None,
                 check: FirstForwardCheck | None) -> None:
        self.model = model
        self.partition = partition
        self.devices = devices
        self.streaming = streaming
        self.check = check
        phased = streaming is not None
        # Phased: units are phases (cut between them); else units are stages (uncut).
        self.unit_of_stage = ([s.phase or 0 for s in partition.stages] if phased
                              else list(range(partition.num_stages)))
        self.num_units = max(self.unit_of_stage) + 1
        self._resident: int | None = None

    def __call__(self, microbatches: list[tuple], loss_of: LossOf | None
                 ) -> tuple[list[Any], ScheduleRecord]:
        """The outputs of the micro-batches, and the schedule executed."""
        record = ScheduleRecord(self.num_units, runtime=SEQUENTIAL)
        outputs = []
        self._resident = None  # the phase whose weights are in place
        try:
            for m, (args, kwargs) in enumerate(microbatches):
                outputs.append(self._microbatch(m, args, kwargs, loss_of, record))
        finally:
            if self.streaming is not None:
                self.streaming.offload_all()
        return outputs, record

    def _microbatch(self, m: int, args: tuple, kwargs: dict, loss_of: LossOf | None,
                    record: ScheduleRecord) -> Any:
        streaming, clock = self.streaming, time.perf_counter
        reached: list[tuple[int, float]] = []  # (unit, time) as the forward reached it

        def reach(unit: int) -> None:
            reached.append((unit, clock()))
            self._stream_in(unit)

        run = StageRun(self.partition, self.devices, self.unit_of_stage,
                       cut=streaming is not None, on_unit=reach)
        scope = (streaming.activation_scope(self.devices) if streaming is not None
                 else contextlib.nullcontext())
        with scope:
            with listening(run), run:
                run.start()
                out = self._forward(args, kwargs)
                loss = loss_of(out) if loss_of is not None else None
            ends = [t for _, t in reached[1:]] + [clock()]
            for (unit, start), end in zip(reached, ends, strict=True):
                record.events.append(ScheduleEvent(0, FORWARD, unit, m, start, end))
            units = [unit for unit, _ in reached]
            if loss is None:
                return out
            if streaming is None:  # one graph through every stage: one backward call
                start = clock()
                loss.backward()
                end = clock()
                record.events += [ScheduleEvent(0, BACKWARD, unit, m, start, end)
                                  for unit in reversed(units)]
                return out
            run.loss = loss
            for unit in reversed(units):
                start = clock()
                self._stream_in(unit)
                run.backward_unit(unit)
                record.events.append(ScheduleEvent(0, BACKWARD, unit, m, start, clock()))
        return out

    def _stream_in(self, unit: int) -> None:
        """Phased: ``unit``'s weights onto its devices, the previous phase's off."""
        if self.streaming is not None:
            self.streaming.enter(unit, self._resident)
            self._resident = unit

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        check = self.check
        if check is None:
            return self.model(*args, **kwargs)
        out = check.run(self.model, args, kwargs)
        self.check = None  # checked: later forwards run as they are
        return out
