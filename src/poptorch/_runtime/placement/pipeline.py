"""Pipeline schedules as data, and the record of the schedule a step executed.

A schedule is an ordered list of :class:`Action` per stage (or per *lane*: a device, or
a group of devices that runs one action at a time), as ``torch.distributed.pipelining``
writes its ``_Action`` lists: the forward of a stage on a micro-batch (``F``), its
backward (``B``), or the two halves of a split backward (``I``: the gradients of the
stage's inputs, recorded as its ``B``; ``W``: its weights' gradients, later).

* :func:`gpipe_schedule`: every forward, then every backward (GPipe).
* :func:`one_f_one_b_schedule`: warm-up forwards, then one forward / one backward
  alternately, then the remaining backwards (1F1B, PipeDream-flush): at most
  ``num_stages`` micro-batches are in flight, so fewer activations are alive.

The runners fill a :class:`ScheduleRecord` with what they executed, in order; it lays
the actions out in unit time slots (``timeline``, ``bubble_fraction``, ``render``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple


class ActionKind(str, Enum):
    """What an action computes. A ``str`` mix-in: ``ActionKind.FORWARD == "F"``."""
    FORWARD = "F"
    BACKWARD = "B"
    INPUT_HALF = "I"  # a split backward's input half (``split_backward``)
    WEIGHT_HALF = "W"  # ... and its weight half, run later on the same lane

    __hash__ = str.__hash__  # equal to its letter, so hashed as it: ("F", s, m) keys

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Action(NamedTuple):
    """One action of a schedule: ``kind`` of ``stage`` on ``microbatch``."""
    kind: ActionKind
    stage: int
    microbatch: int


FORWARD, BACKWARD = ActionKind.FORWARD, ActionKind.BACKWARD
INPUT_HALF, WEIGHT_HALF = ActionKind.INPUT_HALF, ActionKind.WEIGHT_HALF


def gpipe_schedule(num_stages: int, num_microbatches: int,
                   training: bool) -> list[list[Action]]:
    """Per-stage action order of GPipe: all forwards, then all backwards."""
    lanes = []
    for s in range(num_stages):
        ops = [Action(FORWARD, s, m) for m in range(num_microbatches)]
        if training:
            ops += [Action(BACKWARD, s, m) for m in range(num_microbatches)]
        lanes.append(ops)
    return lanes


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Per-stage action order of 1F1B: stage ``s`` runs ``num_stages - s - 1`` warm-up
    forwards, then alternates forward and backward, then cools down with backwards."""
    lanes = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        ops = [Action(FORWARD, s, m) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            ops += [Action(FORWARD, s, warmup + i), Action(BACKWARD, s, i)]
        ops += [Action(BACKWARD, s, m)
                for m in range(num_microbatches - warmup, num_microbatches)]
        lanes.append(ops)
    return lanes


def stage_schedules(schedule: str, num_stages: int, num_microbatches: int,
                    training: bool) -> list[list[Action]]:
    """Each stage's actions for the named schedule (``strategy.schedule_name``): 1F1B
    when training asks for it, GPipe otherwise (inference has no backwards to
    interleave)."""
    if training and schedule == "1F1B":
        return one_f_one_b_schedule(num_stages, num_microbatches)
    return gpipe_schedule(num_stages, num_microbatches, training)


def sequential_schedule(stage_order: list[int], num_microbatches: int,
                        training: bool) -> list[list[Action]]:
    """One lane running stage after stage, all micro-batches of a stage together
    (forward in ``stage_order``, backward in reverse): serial phased execution."""
    ops = [Action(FORWARD, s, m) for s in stage_order for m in range(num_microbatches)]
    if training:
        ops += [Action(BACKWARD, s, m) for s in reversed(stage_order)
                for m in range(num_microbatches)]
    return [ops]


@dataclass
class ScheduleEvent:
    lane: int
    kind: ActionKind
    stage: int
    microbatch: int
    start: float
    end: float = 0.0


#: ``ScheduleRecord.runtime`` of a step run by the per-device engine (``engine.py``),
#: by the stages one after another in the calling thread (``sequential.py``), or by
#: one process per stage (``processes.py``).
ENGINE, SEQUENTIAL, PROCESSES = "engine", "sequential", "processes"


@dataclass
class ScheduleRecord:
    """The actions a step actually executed, in the order they started."""
    num_stages: int
    events: list[ScheduleEvent] = field(default_factory=list)
    # the weight halves of split backwards (kind "W"), run after their "B" event
    weight_events: list[ScheduleEvent] = field(default_factory=list)
    runtime: str = ENGINE  # which runtime executed the step (constants above)

    def stage_order(self, stage: int) -> list[tuple[ActionKind, int]]:
        """``[(kind, microbatch), ...]`` executed by ``stage``, in order."""
        return [(e.kind, e.microbatch) for e in self.events if e.stage == stage]

    def timeline(self) -> list[list[tuple[ActionKind, int] | None]]:
        """The executed order laid out in unit time slots (each action takes one slot;
        an action starts once its stage is free and its inputs are ready):
        ``grid[stage][slot]``."""
        done: dict[Action, int] = {}
        free = [0] * self.num_stages
        grid: list[dict[int, tuple[ActionKind, int]]] = [{} for _ in range(self.num_stages)]
        pending = {s: self.stage_order(s) for s in range(self.num_stages)}
        cursor = [0] * self.num_stages
        last_stage = self.num_stages - 1
        progress = True
        while progress:
            progress = False
            for s in range(self.num_stages):
                while cursor[s] < len(pending[s]):
                    kind, m = pending[s][cursor[s]]
                    if kind == FORWARD:
                        deps = [Action(FORWARD, s - 1, m)] if s > 0 else []
                    else:
                        deps = [Action(FORWARD, s, m)]
                        if s < last_stage:
                            deps.append(Action(BACKWARD, s + 1, m))
                    if any(d not in done for d in deps):
                        break
                    slot = max([free[s]] + [done[d] + 1 for d in deps])
                    grid[s][slot] = (kind, m)
                    done[Action(kind, s, m)] = slot
                    free[s] = slot + 1
                    cursor[s] += 1
                    progress = True
        width = max(free) if free else 0
        return [[row.get(t) for t in range(width)] for row in grid]

    def bubble_fraction(self) -> float:
        """Idle fraction of the stage-time slots of :meth:`timeline`."""
        grid = self.timeline()
        total = sum(len(row) for row in grid)
        busy = sum(cell is not None for row in grid for cell in row)
        return 0.0 if total == 0 else 1.0 - busy / total

    def render(self) -> str:
        """A text chart: one row per stage, one column per time slot (``F3``: forward
        of micro-batch 3, ``B3``: its backward, ``.``: idle)."""
        grid = self.timeline()
        width = max([len(f"{k}{m}") for row in grid for c in row if c for k, m in [c]] + [1])
        lines = []
        for s, row in enumerate(grid):
            cells = [(f"{c[0]}{c[1]}" if c else ".").rjust(width) for c in row]
            lines.append(f"stage {s}: " + " ".join(cells))
        lines.append(f"bubble fraction: {self.bubble_fraction():.3f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()

