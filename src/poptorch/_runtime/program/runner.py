"""Step runners: run the micro-batches of one optimizer step (or inference iteration).

A :py:class:`StepRunner` is any callable
``runner(microbatches, loss_of) -> outputs``: it runs the model on every micro-batch
and, in training, calls ``loss_of(output).backward()`` for each of them, choosing when.
Model parallelism (``_runtime/placement/``) supplies runners that pipeline, shard or
phase the model; the default below runs micro-batches one after the other.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..batching.plan import Microbatch
from ..torch_internals import foreach_copy_
from .overlapped_io import FirstForwardCheck


class LossOf(Protocol):
    """A micro-batch's loss for its backward pass (``step.LossRule``)."""

    multiplier: float  # PopTorch's mean scale of this step's losses

    def __call__(self, output: Any) -> torch.Tensor:
        """The loss found in ``output``, scaled."""
        ...

    def finish(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss found by the caller, scaled."""
        ...


class StepRunner(Protocol):
    """Runs forward (and backward) over the micro-batches of one step."""

    def __call__(self, microbatches: list[Microbatch],
                 loss_of: LossOf | None) -> list[Any]:
        ...


def drop_history(buffers: tuple[torch.Tensor, ...]) -> None:
    """Buffers are device state: a value written into one during a forward pass (from
    tensors that carry gradients) is kept, its autograd history is not. Called where no
    backward pass still needs it: before each training micro-batch of a sequential
    runner (the previous micro-batch's backward is done) and at the end of each step."""
    for buffer in buffers:
        if buffer.grad_fn is not None:
            buffer.detach_()


class SequentialRunner:
    """Runs each micro-batch's forward, then its backward, on one device.

    ``forward`` is the model (or a compiled forward); ``forward_loss``, when given,
    returns a training micro-batch's output and its loss in one call (the compiled
    backend compiles the two together), else the loss comes from ``loss_of(output)``.
    ``buffers``: the model's buffers, whose history a micro-batch does not see from
    the one before (:py:func:`drop_history`). ``check``: PopTorch's rules of the overlap
    markers, checked on the first forward (``overlapped_io.FirstForwardCheck``)."""

    def __init__(self, forward: Callable[..., Any],
                 forward_loss: Callable[[tuple, dict], tuple[Any, torch.Tensor]] | None
                 = None, buffers: tuple[torch.Tensor, ...] = (),
                 check: FirstForwardCheck | None = None) -> None:
        self.forward = forward
        self.forward_loss = forward_loss
        self.buffers = buffers
        self.check = check

    def __call__(self, microbatches: list[Microbatch],
                 loss_of: LossOf | None) -> list[Any]:
        outputs = []
        forward, forward_loss, buffers = self.forward, self.forward_loss, self.buffers
        for args, kwargs in microbatches:
            if loss_of is not None and buffers:
                drop_history(buffers)
            if forward_loss is not None and loss_of is not None:
                out, loss = forward_loss(args, kwargs)
                loss_of.finish(loss).backward()
            else:
                out = forward(*args, **kwargs) if self.check is None \
                    else self._checked(args, kwargs)
                if loss_of is not None:
                    loss_of(out).backward()
            outputs.append(out)
        return outputs

    def _checked(self, args: tuple, kwargs: dict) -> Any:
        """The first forward, under the overlap markers' check."""
        check = self.check
        assert check is not None  # (called while set)
        out = check.run(self.forward, args, kwargs)
        self.check = None
        return out


class ReplicaState(Protocol):
    """Something each simulated replica holds its own copy of (buffers, replica-grouped
    weights). The per-replica runner calls, around each micro-batch of replica ``k``:
    ``select(k)``; after it ``after_microbatch(k, training)``; after each step
    ``end_step()``; and ``restore()`` at the end of the runner call."""

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


class PerReplicaRunner:
    """Wraps a runner so that micro-batch ``n`` (replica ``n % r``) runs with that
    replica's own state (:py:class:`ReplicaState`: buffers, replica-grouped weights);
    ``end_step`` runs after every ``per_step`` micro-batches (one optimizer step or
    inference iteration). The model is left on replica 0's state."""

    def __init__(self, runner: SequentialRunner, states: list, replicas: int,
                 per_step: int) -> None:
        self.inner = runner
        self.states = states
        self.replicas = replicas
        self.per_step = per_step

    def __call__(self, microbatches: list[Microbatch],
                 loss_of: LossOf | None) -> list[Any]:
        outputs: list[Any] = []
        training = loss_of is not None
        states, run = self.states, self.inner
        try:
            for n, microbatch in enumerate(microbatches):
                replica = n % self.replicas
                for state in states:
                    state.select(replica)
                outputs.extend(run([microbatch], loss_of))
                for state in states:
                    state.after_microbatch(replica, training)
                if (n + 1) % self.per_step == 0:
                    for state in states:
                        state.end_step()
        finally:
            for state in states:
                state.restore(training)
        return outputs
