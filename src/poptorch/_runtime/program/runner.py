"""What runs the micro-batches of one optimizer step (or inference iteration).

A :py:class:`StepRunner` is any callable ``runner(microbatches, loss_of) -> outputs``:
it runs the model on every micro-batch and, in training, back-propagates
``loss_of(output)`` for each of them, choosing when. The one-stage interpreter
(``interpreter.py``) runs a step's schedule in the calling thread; model parallelism
(``_runtime/placement/``) runs the schedules of several stages on per-device workers.
This module holds the protocols they share and the per-replica state they switch.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..._typing import UserOutput
from ..batching.plan import Microbatch
from ..torch_internals import foreach_copy_


class LossOf(Protocol):
    """A micro-batch's loss for its backward pass (``step.LossRule``)."""

    multiplier: float  # PopTorch's mean scale of this step's losses

    def __call__(self, output: UserOutput) -> torch.Tensor:
        """The loss found in ``output``, scaled."""
        ...

    def finish(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss found by the caller, scaled."""
        ...


class StepRunner(Protocol):
    """Runs forward (and backward) over the micro-batches of one step."""

    def __call__(self, microbatches: list[Microbatch],
                 loss_of: LossOf | None) -> list[UserOutput]:
        ...


def drop_history(buffers: tuple[torch.Tensor, ...]) -> None:
    """Buffers are device state: a value written into one during a forward pass (from
    tensors that carry gradients) is kept, its autograd history is not. Called where no
    backward pass still needs it: before each training micro-batch of a sequential
    runner (the previous micro-batch's backward is done) and at the end of each step."""
    for buffer in buffers:
        if buffer.grad_fn is not None:
            buffer.detach_()


class ReplicaState(Protocol):
    """Something each simulated replica holds its own copy of (buffers, replica-grouped
    weights). The interpreter (``interpreter.py``) runs the actions of replica ``k``'s
    lane on it: ``LOAD`` is ``select(k)``, ``STORE`` ``after_microbatch(k, training)``,
    ``BROADCAST`` (after each step) ``end_step()`` and ``DROP`` (at the end of the
    runner call) ``restore(training)``."""

    def select(self, replica: int) -> None: ...

    def after_microbatch(self, replica: int, training: bool) -> None: ...

    def end_step(self) -> None: ...

    def restore(self, training: bool) -> None: ...


class ReplicaBuffers:
    """One copy of the model's buffers per simulated replica, as ``r`` devices would hold.

    Replica 0's copy is the model's own storage (what the host sees); the others are
    clones. :py:meth:`select` points every buffer at a replica's copy by swapping its
    ``.data``, so in-place updates in ``forward`` (BatchNorm's running statistics)
    reach that replica's copy only. With ``broadcast`` replica 0's copy is copied to every
    replica after each step.
    """

    def __init__(self, model: torch.nn.Module, replicas: int, broadcast: bool) -> None:
        self.buffers = list(model.buffers())
        self.copies = [[b.data for b in self.buffers]] + [
            [b.detach().clone() for b in self.buffers] for _ in range(replicas - 1)]
        self.current = 0
        self.broadcast_each_step = broadcast

    def select(self, replica: int) -> None:
        """Make the model use ``replica``'s buffers."""
        if replica != self.current:
            for buffer, data in zip(self.buffers, self.copies[replica], strict=False):
                buffer.data = data
            self.current = replica

    def after_microbatch(self, replica: int, training: bool) -> None:
        return None

    def end_step(self) -> None:
        if self.broadcast_each_step:
            self.broadcast()

    def restore(self, training: bool) -> None:
        self.select(0)

    def broadcast(self) -> None:
        """Copy replica 0's buffers to every other replica (and select replica 0)."""
        self.select(0)
        with torch.no_grad():
            for copies in self.copies[1:]:
                foreach_copy_(copies, self.copies[0])
