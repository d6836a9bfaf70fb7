"""Schedules and the scheduler that runs stages of different micro-batches concurrently.

A *schedule* gives, for each *lane* (a device, or a group of devices that runs one op
at a time), the ordered list of ops ``(kind, stage, microbatch)`` it executes, where
``kind`` is ``"F"`` (forward of the stage) or ``"B"`` (its backward).

* :func:`gpipe_schedule`: every forward, then every backward (GPipe).
* :func:`one_f_one_b_schedule`: warm-up forwards, then one forward / one backward
  alternately, then the remaining backwards (1F1B, PipeDream-flush): at most
  ``num_stages`` micro-batches are in flight, so fewer activations are alive.

Each micro-batch runs in its own worker thread; before a stage runs an op the worker
waits until that op is at the head of its lane (:class:`LaneScheduler`). Ops of
different lanes therefore run at the same time, in exactly the scheduled order, and
the :class:`ScheduleRecord` shows what was executed.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ...errors import Error

FORWARD, BACKWARD = "F", "B"
# A backward split in two (``split_backward``): the input half hands the gradients of
# the stage's inputs over (recorded as the stage's "B"); the weight half runs later.
INPUT_HALF, WEIGHT_HALF = "I", "W"
Op = Tuple[str, int, int]  # (kind, stage, microbatch)

#: Longest time a worker waits for its turn before declaring the schedule stalled.
WAIT_TIMEOUT_S = 600.0


def gpipe_schedule(num_stages: int, num_microbatches: int, training: bool) -> List[List[Op]]:
    """Per-stage op order of GPipe: all forwards, then all backwards."""
    lanes = []
    for s in range(num_stages):
        ops = [(FORWARD, s, m) for m in range(num_microbatches)]
        if training:
            ops += [(BACKWARD, s, m) for m in range(num_microbatches)]
        lanes.append(ops)
    return lanes


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> List[List[Op]]:
    """Per-stage op order of 1F1B: stage ``s`` runs ``num_stages - s - 1`` warm-up
    forwards, then alternates forward and backward, then cools down with backwards."""
    lanes = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        ops: List[Op] = [(FORWARD, s, m) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            ops += [(FORWARD, s, warmup + i), (BACKWARD, s, i)]
        ops += [(BACKWARD, s, m) for m in range(num_microbatches - warmup, num_microbatches)]
        lanes.append(ops)
    return lanes



def stage_schedules(schedule: str, num_stages: int, num_microbatches: int,
                    training: bool) -> List[List[Op]]:
    """Each stage's actions for the named schedule (``strategy.schedule_name``): 1F1B
    when training asks for it, GPipe otherwise (inference has no backwards to
    interleave)."""
    if training and schedule == "1F1B":
        return one_f_one_b_schedule(num_stages, num_microbatches)
    return gpipe_schedule(num_stages, num_microbatches, training)

def sequential_schedule(stage_order: List[int], num_microbatches: int,
                        training: bool) -> List[List[Op]]:
    """One lane running stage after stage, all micro-batches of a stage together
    (forward in ``stage_order``, backward in reverse): used by serial phased execution."""
    ops = [(FORWARD, s, m) for s in stage_order for m in range(num_microbatches)]
    if training:
        ops += [(BACKWARD, s, m) for s in reversed(stage_order) for m in range(num_microbatches)]
    return [ops]


@dataclass
class ScheduleEvent:
    lane: int
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float = 0.0


@dataclass
class ScheduleRecord:
    """The ops a step actually executed, in the order they started."""
    num_stages: int
    events: List[ScheduleEvent] = field(default_factory=list)
    # the weight halves of split backwards (kind "W"), run after their "B" event
    weight_events: List[ScheduleEvent] = field(default_factory=list)

    def stage_order(self, stage: int) -> List[Tuple[str, int]]:
        """``[(kind, microbatch), ...]`` executed by ``stage``, in order."""
        return [(e.kind, e.microbatch) for e in self.events if e.stage == stage]

    def timeline(self) -> List[List[Optional[Tuple[str, int]]]]:
        """The executed order laid out in unit time slots (each op takes one slot; an op
        starts once its stage is free and its inputs are ready): ``grid[stage][slot]``."""
        done: Dict[Tuple[str, int, int], int] = {}
        free = [0] * self.num_stages
        grid: List[Dict[int, Tuple[str, int]]] = [dict() for _ in range(self.num_stages)]
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
                        deps = [(FORWARD, s - 1, m)] if s > 0 else []
                    else:
                        deps = [(FORWARD, s, m)]
                        if s < last_stage:
                            deps.append((BACKWARD, s + 1, m))
                    if any(d not in done for d in deps):
                        break
                    slot = max([free[s]] + [done[d] + 1 for d in deps])
                    grid[s][slot] = (kind, m)
                    done[(kind, s, m)] = slot
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


class ScheduleAborted(Exception):
    """Raised in waiting workers once another worker failed."""


class LaneScheduler:
    """Admits ops to their lanes in schedule order; thread-safe.

    ``acquire`` blocks until the op is at the head of its lane (or raises once any
    worker has failed, or after :data:`WAIT_TIMEOUT_S`); ``release`` moves the lane on.
    ``on_start(op)`` is called (under no lock) just before an admitted op runs.
    """

    def __init__(self, lanes: List[List[Op]], num_stages: int,
                 on_start: Optional[Callable[[Op], None]] = None,
                 timeout: float = WAIT_TIMEOUT_S) -> None:
        self._lanes = lanes
        self._lane_of: Dict[Op, int] = {op: i for i, ops in enumerate(lanes) for op in ops}
        self._pos = [0] * len(lanes)
        self._cond = threading.Condition()
        self._failed: Optional[BaseException] = None
        self._on_start = on_start
        self._timeout = timeout
        self._open: Dict[Op, ScheduleEvent] = {}
        self.record = ScheduleRecord(num_stages)

    def acquire(self, kind: str, stage: int, microbatch: int) -> None:
        op = (kind, stage, microbatch)
        lane = self._lane_of.get(op)
        if lane is None:
            raise Error(f"Internal schedule error: op {op} is not in the schedule.")
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while True:
                if self._failed is not None:
                    raise ScheduleAborted()
                ops = self._lanes[lane]
                if self._pos[lane] < len(ops) and ops[self._pos[lane]] == op:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    head = ops[self._pos[lane]] if self._pos[lane] < len(ops) else None
                    raise Error(f"Pipeline schedule stalled: {kind}{microbatch} of stage "
                                f"{stage} waited {self._timeout:.0f}s for lane {lane}, whose "
                                f"next op is {head}. Does every micro-batch run the same "
                                "blocks in the same order?")
                self._cond.wait(min(remaining, 1.0))
            event = ScheduleEvent(lane, kind, stage, microbatch, time.perf_counter())
            self._open[op] = event
            self.record.events.append(event)
        if self._on_start is not None:
            self._on_start(op)

    def release(self, kind: str, stage: int, microbatch: int) -> None:
        op = (kind, stage, microbatch)
        with self._cond:
            event = self._open.pop(op)
            event.end = time.perf_counter()
            self._pos[self._lane_of[op]] += 1
            self._cond.notify_all()

    def abort(self, exc: BaseException) -> None:
        """Make every waiting and future ``acquire`` raise: a worker failed."""
        with self._cond:
            if self._failed is None:
                self._failed = exc
            self._cond.notify_all()


def run_workers(count: int, work: Callable[[int], object], scheduler: LaneScheduler,
                timeout: float = WAIT_TIMEOUT_S) -> List[object]:
    """Run ``work(i)`` for ``i < count`` in one thread each; return results in order.

    The first exception raised by a worker is re-raised here (the others are told to
    stop through the scheduler).
    """
    results: List[object] = [None] * count
    errors: List[Tuple[int, BaseException]] = []
    lock = threading.Lock()

    def target(i: int) -> None:
        try:
            results[i] = work(i)
        except ScheduleAborted:
            pass
        except BaseException as exc:  # propagate to the caller's thread
            with lock:
                errors.append((i, exc))
            scheduler.abort(exc)

    threads = [threading.Thread(target=target, args=(i, ), name=f"poptorch-microbatch-{i}",
                                daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        scheduler.abort(Error("pipeline timed out"))
        raise Error(f"Pipeline workers did not finish within {timeout:.0f}s.")
    if errors:
        raise errors[0][1]
    return results
