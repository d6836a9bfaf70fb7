"""DDP's reducer for the sequential runner: the gradients of a step are reduced over the
processes while the backward pass of the step's last micro-batch still runs.

``torch.nn.parallel.DistributedDataParallel`` wraps the device model; every
micro-batch of a step but the last runs under ``no_sync()`` (gradients accumulate
locally), the last one's backward fires DDP's bucketed all-reduces as gradients become
ready. DDP's own C++ reduction averages over the processes (no Python runs per bucket);
the device program knows that (``AVERAGES``) and turns the average into PopTorch's
Mean / Sum over every replica of every process. DDP neither broadcasts at construction
nor syncs buffers: the compile step and ``broadcastBuffers`` do that (``replicas``).
``find_unused_parameters`` lets a model leave some parameters unused in a step, as it
may in one process.
"""
import contextlib
from typing import Any, List, Optional

import torch

from ..program.runner import LossOf, SequentialRunner


class SyncOnLastMicrobatch:
    """Runs a sequential runner whose forward is a DDP module so that only the last
    micro-batch of each step (``per_step`` of them) synchronises gradients."""

    def __init__(self, inner: SequentialRunner, ddp: Any, per_step: int) -> None:
        self.inner = inner
        self.ddp = ddp
        self.per_step = per_step
        self.count = 0

    def begin_step(self) -> None:
        """Called before the micro-batches of a training step."""
        self.count = 0

    def __call__(self, microbatches: List[Any], loss_of: Optional[LossOf]) -> List[Any]:
        if loss_of is None:
            return self.inner(microbatches, None)
        outputs: List[Any] = []
        for microbatch in microbatches:
            self.count += 1
            last = self.count % self.per_step == 0
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                outputs.extend(self.inner([microbatch], loss_of))
        return outputs


def wrap_for_ddp(runner: SequentialRunner, model: torch.nn.Module, group: Any,
                 per_step: int, device: torch.device) -> SyncOnLastMicrobatch:
    """Make ``runner`` run ``model`` through DDP (see module docstring)."""
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None,
        process_group=group, broadcast_buffers=False, init_sync=False,
        find_unused_parameters=True)
    runner.forward = ddp
    return SyncOnLastMicrobatch(runner, ddp, per_step)
