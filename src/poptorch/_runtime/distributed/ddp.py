"""DDP's reducer for the sequential runner: the gradients of a step are summed over the
processes while the backward pass of the step's last micro-batch still runs.

``torch.nn.parallel.DistributedDataParallel`` wraps the device model; every
micro-batch of a step but the last runs under ``no_sync()`` (gradients accumulate
locally), the last one's backward fires DDP's bucketed all-reduces as gradients become
ready. A communication hook sums (DDP's default hook averages over processes; the
device program applies PopTorch's Mean / Sum itself, over every replica of every
process). DDP neither broadcasts at construction nor syncs buffers: the compile step
and ``broadcastBuffers`` do that (``replicas``). ``find_unused_parameters`` lets a
model leave some parameters unused in a step, as it may in one process.
"""
import contextlib
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from ..program.runner import LossOf, SequentialRunner


def _sum_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the sum over processes, not the mean. (No postponed
    annotations in this module: DDP checks this signature's annotations.)"""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


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
        find_unused_parameters=__import__('os').environ.get('EXP_FUP','1')=='1')
    if __import__('os').environ.get('EXP_HOOK','py')=='py':
        ddp.register_comm_hook(group, _sum_hook)
    runner.forward = ddp
    return SyncOnLastMicrobatch(runner, ddp, per_step)
