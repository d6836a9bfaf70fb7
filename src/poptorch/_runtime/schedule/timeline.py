"""Schedules drawn in time: the plan of a step and the record of what it ran.

:class:`Timeline` lays per-lane action lists out in time slots (``schedules.layout``)
and draws them as text, or gives the cells to ``scripts/schedule_svg.py``.
:class:`ScheduleRecord` is what a step executed, in order and timed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .actions import Action, ActionKind
from .schedules import COST, Topology, layout

__all__ = ["ENGINE", "PROCESSES", "SEQUENTIAL", "ScheduleEvent", "ScheduleRecord", "Timeline"]

#: ``ScheduleRecord.runtime`` of a step run by the per-device engine, by the stages one
#: after another in the calling thread (a model that was not captured), or by one
#: process per stage.
ENGINE, SEQUENTIAL, PROCESSES = "engine", "sequential", "processes"


@dataclass(frozen=True)
class Timeline:
    """A schedule (``lanes[d]``: device ``d``'s actions in order) laid out in time."""
    name: str
    lanes: tuple[tuple[Action, ...], ...]
    topology: Topology

    @staticmethod
    def of(name: str, lanes: Sequence[Sequence[Action]], topology: Topology) -> Timeline:
        return Timeline(name, tuple(tuple(lane) for lane in lanes), topology)

    def cells(self) -> list[list[tuple[int, int, Action]]]:
        """Per lane: ``(start slot, slots, action)`` in order."""
        starts = layout(self.lanes, self.topology)
        return [[(t, COST.get(op.kind, 1), op) for op, t in zip(lane, lane_starts, strict=True)]
                for lane, lane_starts in zip(self.lanes, starts, strict=True)]

    def span(self) -> int:
        """Slots from the first action's start to the last one's end."""
        return max((t + w for lane in self.cells() for t, w, _ in lane), default=0)

    def bubble_fraction(self) -> float:
        """Idle fraction of the busy lanes' slots."""
        cells = [lane for lane in self.cells() if lane]
        span = self.span()
        busy = sum(w for lane in cells for _, w, _ in lane)
        return 0.0 if not cells or not span else 1.0 - busy / (span * len(cells))

    def render(self, row: str = "device", per_stage: bool = False) -> str:
        """One row per lane (``row`` names them), one column per slot: ``F1.3`` is the
        forward of stage 1 on micro-batch 3 (``B`` backward, ``I`` / ``W`` its input /
        weight half; ``per_stage``: the stage left out, ``F3``), ``LOAD1`` / ``STORE1``
        stage 1's weights loaded to its device / stored to the host, ``-`` the rest of
        an action longer than a slot, ``.`` idle."""
        cells = self.cells()
        span = self.span()

        def label(op: Action) -> str:
            return f"{op.kind}{op.microbatch}" if per_stage and op.microbatch >= 0 \
                else str(op)

        width = max([len(label(op)) for lane in cells for *_, op in lane] + [1])
        lines = [f"{self.name} schedule:"]
        for d, lane in enumerate(cells):
            if not lane and not per_stage:
                continue
            text = ["."] * span
            for t, w, op in lane:
                text[t:t + w] = [label(op)] + ["-"] * (w - 1)
            lines.append(f"{row} {d}: " + " ".join(c.rjust(width) for c in text))
        lines.append(f"bubble fraction: {self.bubble_fraction():.3f}")
        return "\n".join(lines)

    __str__ = render


@dataclass
class ScheduleEvent:
    """One executed action: ``kind`` of ``stage`` on ``microbatch`` by ``lane``."""
    lane: int
    kind: ActionKind
    stage: int
    microbatch: int
    start: float
    end: float = 0.0


@dataclass
class ScheduleRecord:
    """The actions a step executed, in the order they started (an input half recorded
    as its stage's backward; the weight halves apart, in ``weight_events``), and the
    planned schedule it ran (``plan``; None for the process runtime)."""
    num_stages: int
    events: list[ScheduleEvent] = field(default_factory=list)
    weight_events: list[ScheduleEvent] = field(default_factory=list)
    runtime: str = ENGINE
    plan: Timeline | None = None
    topology: Topology | None = None  # (None: stage s reads stage s - 1)

    def stage_order(self, stage: int) -> list[tuple[ActionKind, int]]:
        """``[(kind, microbatch), ...]`` executed by ``stage``, in order."""
        return [(e.kind, e.microbatch) for e in self.events if e.stage == stage]

    def executed(self) -> Timeline:
        """The executed actions per stage (one row per stage)."""
        lanes = [[Action(k, s, m, s) for k, m in self.stage_order(s)]
                 for s in range(self.num_stages)]
        topology = self.topology or Topology.chain(self.num_stages)
        return Timeline.of(f"executed ({self.runtime})", lanes, topology)

    def bubble_fraction(self) -> float:
        """Idle fraction of the stage-time slots of the executed order."""
        return self.executed().bubble_fraction()

    def render(self) -> str:
        """The planned timeline (one row per device), then the executed order per
        stage (``F3``: forward of micro-batch 3, ``B3`` its backward, ``.`` idle)."""
        executed = self.executed().render(row="stage", per_stage=True)
        return executed if self.plan is None else self.plan.render() + "\n\n" + executed

    __str__ = render
