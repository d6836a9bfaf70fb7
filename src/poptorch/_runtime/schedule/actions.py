"""The actions of a schedule: what one step of any execution strategy is made of.

As ``torch.distributed.pipelining`` writes a schedule as ``_Action`` over
``_ComputationType``, a step here is a list of :class:`Action` over :class:`ActionKind`:
compute (``F``, ``B``, its halves ``I`` / ``W``, ``U``), communication between stages or
replicas, and memory movement (load / store a stage's state, drop a materialised copy).
Plain data: schedules are built, compared, printed and checked before anything runs.
"""
from __future__ import annotations

from enum import Enum
from typing import NamedTuple

__all__ = ["MEMORY", "Action", "ActionKind"]


class ActionKind(str, Enum):
    """What an action does. A ``str`` mix-in: ``ActionKind.FORWARD == "F"``."""
    FORWARD = "F"
    BACKWARD = "B"
    INPUT_HALF = "I"  # a split backward's input half
    WEIGHT_HALF = "W"  # ... and its weight half, run later on the same lane
    UPDATE = "U"  # the optimizer step of the stage's parameters
    SEND = "SEND"  # activations (after F) or input gradients (after B / I) to a peer
    RECV = "RECV"  # ... received from a peer before the F / B that reads them
    ALL_REDUCE = "AR"  # gradients summed over the replicas
    REDUCE_SCATTER = "RS"  # gradients summed, each replica keeping its shard
    ALL_GATHER = "AG"  # a sharded tensor made whole on every replica
    BROADCAST = "BC"  # replica 0's buffers sent to every replica (broadcastBuffers)
    LOAD = "LOAD"  # weights or optimizer state moved to the stage's device
    STORE = "STORE"  # ... moved back to host memory
    DROP = "DROP"  # a materialised (gathered / loaded) copy freed

    __hash__ = str.__hash__  # equal to its letter, so hashed as it: ("F", s, m) keys

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


MEMORY = frozenset({ActionKind.LOAD, ActionKind.STORE, ActionKind.DROP})


class Action(NamedTuple):
    """``kind`` of ``stage`` on ``microbatch`` (-1: none, as an update or a load) by
    ``lane`` (a device worker, a replica, a process; -1: its stage's lane)."""
    kind: ActionKind
    stage: int
    microbatch: int = -1
    lane: int = -1

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}" + (f".{self.microbatch}" if self.microbatch >= 0 else "")

