"""``popart`` for OpenPopTorch: only the PopART enums that PopTorch programs pass to
``poptorch.Options`` (``opts._Popart.set(name, int(popart.X.Y))``,
``opts.enableSyntheticData(int(popart.SyntheticDataMode.Z))``).

OpenPopTorch has no PopART: ``Options._Popart`` values are recorded and logged, not
applied, except the few that act on our devices too, such as ``syntheticDataMode``
(see the project's docs/options.md), so these enums only need to exist with PopART's
member values. Nothing else of PopART's API is provided; a program that needs
more gets an ``AttributeError`` naming what is missing.
"""
from __future__ import annotations

import enum

__all__ = ["AccumulateOuterFragmentSchedule", "BatchSerializationBatchSchedule",
           "RecomputationType", "SubgraphCopyingStrategy", "SyntheticDataMode",
           "VirtualGraphMode"]


class AccumulateOuterFragmentSchedule(enum.IntEnum):
    """How the ops of the accumulate outer fragment are scheduled across IPUs."""
    Scheduler = 0
    Serial = 1
    OverlapCycleOptimized = 2
    OverlapMemoryOptimized = 3


class BatchSerializationBatchSchedule(enum.IntEnum):
    """How the sub-graphs of a serialised batch are scheduled before outlining."""
    Scheduler = 0
    Isomorphic = 1
    OverlapOnIo = 2
    OverlapOnCompute = 3
    N = 4


class RecomputationType(enum.IntEnum):
    """Which operations automatic recomputation recomputes in the backward pass
    (PopART's ``None`` is ``NoRecompute`` in Python)."""
    NoRecompute = 0
    Standard = 1
    NormOnly = 2
    Pipeline = 3
    RecomputeAll = 4
    N = 5


class SubgraphCopyingStrategy(enum.IntEnum):
    """When the inputs and outputs of subgraphs are copied."""
    OnEnterAndExit = 0
    JustInTime = 1


class SyntheticDataMode(enum.IntEnum):
    """Where input tensors come from (real data, zeros or N(0, 1) samples)."""
    Off = 0
    Zeros = 1
    RandomNormal = 2


class VirtualGraphMode(enum.IntEnum):
    """How operations are placed on virtual graphs (IPUs)."""
    Off = 0
    Manual = 1
    Auto = 2
    ExecutionPhases = 3
    N = 4


def __getattr__(name: str):
    raise AttributeError(
        f"popart.{name} is not available: OpenPopTorch's popart module only provides "
        f"the enums programs pass to poptorch.Options ({', '.join(__all__)}). PopART's "
        "other APIs have no equivalent here.")
