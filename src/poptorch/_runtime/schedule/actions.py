"""The actions of a schedule: what one step of any execution strategy is made of.

As ``torch.distributed.pipelining`` writes a schedule as ``_Action`` over
``_ComputationType``, a step here is a list of :class:`Action` over
:class:`ActionKind`. Three families of kinds:

* compute: the forward of a stage on a micro-batch (``F``), its backward (``B``), or
  the two halves of a split backward (``I``: the gradients of the stage's inputs,
  ``W``: its weights' gradients), and the optimizer update (``U``);
* communication: send / receive of activations or gradients between stages on
  different processes; all-reduce, reduce-scatter, all-gather and broadcast between
  replicas;
* memory movement: load a stage's weights or optimizer state to its device, store
  them back to host memory, or drop a materialised copy.

An action names its ``stage``, its ``microbatch`` (``-1``: not tied to one, as an
update or a load) and its ``lane`` (who runs it: a device worker, a local replica, a
process; ``-1``: the lane of its stage). The types are plain data: schedules are built
once, compared, printed and checked (:func:`check_order`) before anything runs.
"""
from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import NamedTuple

__all__ = ["COMMUNICATION", "COMPUTE", "MEMORY", "Action", "ActionKind", "check_order"]


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


COMPUTE = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.INPUT_HALF,
                     ActionKind.WEIGHT_HALF, ActionKind.UPDATE})
COMMUNICATION = frozenset({ActionKind.SEND, ActionKind.RECV, ActionKind.ALL_REDUCE,
                           ActionKind.REDUCE_SCATTER, ActionKind.ALL_GATHER,
                           ActionKind.BROADCAST})
MEMORY = frozenset({ActionKind.LOAD, ActionKind.STORE, ActionKind.DROP})


class Action(NamedTuple):
    """One action of a schedule: ``kind`` of ``stage`` on ``microbatch`` by ``lane``."""
    kind: ActionKind
    stage: int
    microbatch: int = -1
    lane: int = -1

    def __str__(self) -> str:
        mb = "" if self.microbatch < 0 else str(self.microbatch)
        return f"{self.kind}{self.stage}.{mb}" if mb else f"{self.kind}{self.stage}"


def check_order(actions: Iterable[Action], needs: dict[Action, list[Action]]) -> None:
    """Raise ``ValueError`` naming the first action that comes before an action it
    consumes (``needs[action]``: what it reads), in the order ``actions`` run."""
    done: set[Action] = set()
    for action in actions:
        key = action._replace(lane=-1)
        for need in needs.get(key, ()):
            if need._replace(lane=-1) not in done:
                raise ValueError(f"schedule runs {action} before {need}, which it reads")
        done.add(key)
