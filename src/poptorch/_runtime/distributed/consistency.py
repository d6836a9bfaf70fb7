"""Every process must compile the same program: a difference in the options that shape
it (replicas, device iterations, accumulation, strategy, ...) or in the model's
parameters would make the collectives of the processes disagree, which ends in a hang
or in wrong numbers. The check runs once at compile time on every process and raises the
same :py:class:`poptorch.Error` everywhere.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist

from ...errors import Error
from .collectives import failures_as_errors
from .world import World


def check_same_everywhere(world: World, values: Mapping[str, object]) -> None:
    """Raise on every process when some entry of ``values`` differs between processes;
    the message names the entry and each process's value."""
    if not world.distributed:
        return
    gathered: list = [None] * world.size
    with failures_as_errors("Comparing the options of the processes"):
        dist.all_gather_object(gathered, values, group=world.group)
    problems = []
    for name in values:
        seen = [g.get(name, "<missing>") for g in gathered]
        if any(v != seen[0] for v in seen[1:]):
            per_process = ", ".join(f"process {rank} has {value!r}"
                                    for rank, value in enumerate(seen))
            problems.append(f"{name}: {per_process}")
    if problems:
        raise Error("The processes of this run compiled different programs; every process "
                    "must use the same options and model. Differences: "
                    + "; ".join(problems) + ".")
