"""``popart`` for OpenPopTorch: only the PopART enums that PopTorch programs pass to
``poptorch.Options`` (``opts._Popart.set(name, int(popart.X.Y))``,
``opts.enableSyntheticData(int(popart.SyntheticDataMode.Z))``).

OpenPopTorch has no PopART: ``Options._Popart`` values are recorded and logged, not
applied (see the project's docs/options.md), so these enums only need to exist with
PopART's member values. Nothing else of PopART's API is provided; a program that needs
more gets an ``AttributeError`` naming what is missing.
"""
from __future__ import annotations

import enum

__all__ = ["AccumulateOuterFragmentSchedule", "SubgraphCopyingStrategy",
           "SyntheticDataMode"]


class AccumulateOuterFragmentSchedule(enum.IntEnum):
    """How the ops of the accumulate outer fragment are scheduled across IPUs."""
    Scheduler = 0
    Serial = 1
    OverlapCycleOptimized = 2
    OverlapMemoryOptimized = 3


class SubgraphCopyingStrategy(enum.IntEnum):
    """When the inputs and outputs of subgraphs are copied."""
    OnEnterAndExit = 0
    JustInTime = 1


class SyntheticDataMode(enum.IntEnum):
    """Where input tensors come from (real data, zeros or N(0, 1) samples)."""
    Off = 0
    Zeros = 1
    RandomNormal = 2


def __getattr__(name: str):
    raise AttributeError(
        f"popart.{name} is not available: OpenPopTorch's popart module only provides "
        f"the enums programs pass to poptorch.Options ({', '.join(__all__)}). PopART's "
        "other APIs have no equivalent here.")
