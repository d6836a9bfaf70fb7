"""The training step: the one sequence every backend's steps run.

One optimizer step over the micro-batches of a device iteration is, in order:

1. forward, loss and backward of each micro-batch (``backward``: a step runner, see
   ``runner.py``; it takes each micro-batch's loss from the :py:class:`LossRule` and
   leaves the summed gradients in the parameters' ``.grad``);
2. the gradient reduction between processes (``cross``, several processes only);
3. PopTorch's Mean / Sum: the summed gradients divided or multiplied once;
4. the loss scaler's unscale, which may skip the update (non-finite gradients);
5. the optimizer update (``update``), then the buffers' sync between processes.

Buffers are device state, as on an IPU: a value a forward pass writes into a buffer is
kept, its autograd history is not (``runner.drop_history``): the next micro-batch and
the next step read it as a plain tensor.

:py:func:`train_step` is that sequence; a backend (``backends.py``) supplies only its
runner and its update.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..._logging import log_once
from ..._typing import UserOutput
from ...enums import MeanReductionStrategy, ReductionType
from ...errors import Error
from .. import context
from ..config import TrainingConfig
from ..torch_internals import foreach_div_, foreach_mul_
from .loss import find_loss
from .optimizer import OptimizerBinding
from .runner import drop_history

__all__ = ["GradientScaling", "LossRule", "scale_gradients", "train_step"]

Backward = Callable[[list, "LossRule"], list]


class ProcessWorld(Protocol):
    """The processes a reduction spans (``distributed.world.World``)."""

    @property
    def size(self) -> int: ...


class CrossProcess(Protocol):
    """The cross-process side of a training program, as a step sees it: the processes'
    replicas of the whole model (``distributed.replicas.DataParallelGroup``) or of one
    stage (``distributed.stage_processes.StageReplicaGroup``)."""

    @property
    def world(self) -> ProcessWorld: ...

    @property
    def averaged_over(self) -> int:
        """How many processes the reduced gradients were divided by (DDP averages)."""
        ...

    def begin_step(self) -> None: ...

    def reduce_gradients(self) -> None: ...

    def sync_buffers(self) -> None: ...


class StepProgram(Protocol):
    """What a step reads of its device program (``device_loop.DeviceProgram``)."""

    @property
    def cross(self) -> CrossProcess | None: ...

    @property
    def params(self) -> list[torch.nn.Parameter]: ...

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]: ...

    def gradient_scaling(self) -> GradientScaling: ...


@dataclass(frozen=True)
class GradientScaling:
    """How the summed gradients of a step become PopTorch's Mean / Sum."""
    loss_multiplier: float  # each micro-batch loss times this (Running / PostAndLoss)
    divide_by: int  # the summed gradients divided by this before the update (Post)
    multiply_by: int  # ... or multiplied (undoing an average over processes for Sum)

    @classmethod
    def of(cls, training: TrainingConfig, microbatches: int, processes: int,
           averaged: int) -> GradientScaling:
        """For ``microbatches`` per step on each of ``processes`` processes, when the
        cross-process reduction already divided the gradients by ``averaged`` (DDP)."""
        reduction = training.reduction
        if reduction == ReductionType.NoReduction:
            raise Error(
                "Training.accumulationAndReplicationReductionType(NoReduction) is not "
                "valid for gradients: use ReductionType.Mean (the default) or Sum.")
        n = microbatches * processes
        mean = reduction == ReductionType.Mean and n > 1
        # Post: sum the gradients, divide once before the update. Running / PostAndLoss:
        # scale each micro-batch loss by 1/n (the same mean, rounded differently).
        post = mean and training.mean_strategy == MeanReductionStrategy.Post
        return cls(loss_multiplier=1.0 / n if mean and not post else 1.0,
                   divide_by=n // averaged if post else 1,
                   multiply_by=1 if post else averaged)


class LossRule:
    """Which tensor of a micro-batch's output is the loss (``loss.find_loss``) and what
    it is multiplied by before its backward pass: PopTorch's mean scale and the loss
    scale of the bound optimizer."""

    def __init__(self, params: list[torch.nn.Parameter], binding: OptimizerBinding) -> None:
        self.params = params
        self.binding = binding
        self.multiplier = 1.0
        self._checked = False  # PopTorch's one-final-loss rule, checked at the first call

    def __call__(self, output: UserOutput) -> torch.Tensor:
        """The loss to back-propagate from ``output`` (a runner that runs the model)."""
        if self._checked:
            return self.finish(find_loss(output, context.take_marked_losses()))
        loss = find_loss(output, context.take_marked_losses(), check=True)
        self._checked = True
        return self.finish(loss)

    def finish(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (found by the caller) scaled for its backward pass."""
        if not loss.requires_grad:
            loss = self._zero_gradient_loss(loss)
        if self.multiplier != 1.0:
            loss = loss * self.multiplier
        scaler = self.binding.scaler
        if scaler is not None:
            loss = scaler.scale(loss)
        return loss

    def _zero_gradient_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss that depends on no trainable parameter (PopTorch accepts it): every
        parameter gets a zero gradient, so the optimizer still steps (weight decay,
        momentum) as PopTorch's would."""
        log_once(logging.WARNING, ("loss without gradient",),
                 "The training model's loss does not depend on any trainable parameter: "
                 "its gradients are zero.")
        if not self.params:  # nothing to train (all frozen): the backward pass is a no-op
            return loss.detach() + torch.zeros((), device=loss.device, requires_grad=True)
        anchor = sum((p.reshape(-1)[0] * 0.0 for p in self.params),
                     torch.zeros((), device=loss.device))
        return loss.detach() + anchor


def scale_gradients(params: list[torch.nn.Parameter], scaling: GradientScaling) -> None:
    """Step 3: turn the summed gradients into PopTorch's Mean / Sum (in place)."""
    divide_by, multiply_by = scaling.divide_by, scaling.multiply_by
    if divide_by != 1 or multiply_by != 1:
        grads = [p.grad for p in params if p.grad is not None]
        if grads and divide_by != 1:
            foreach_div_(grads, float(divide_by))
        if grads and multiply_by != 1:
            foreach_mul_(grads, float(multiply_by))


def train_step(program: StepProgram, microbatches: list, backward: Backward,
               loss_rule: LossRule,
               update: Callable[[], object]) -> list:
    """One optimizer step of ``program`` (a ``DeviceProgram``) over ``microbatches``
    (module docstring); returns the micro-batches' outputs (not detached)."""
    cross = program.cross
    if cross is not None:
        cross.begin_step()
    scaling = program.gradient_scaling()
    loss_rule.multiplier = scaling.loss_multiplier
    params = program.params
    for p in params:
        p.grad = None
    outputs = backward(microbatches, loss_rule)
    buffers = program.buffers
    if buffers:
        drop_history(buffers)  # (buffers are device state between steps)
    if cross is not None:
        cross.reduce_gradients()
    scale_gradients(params, scaling)
    scaler = loss_rule.binding.scaler
    if scaler is None or scaler.unscale_(params):
        update()
    if cross is not None:
        cross.sync_buffers()
    return outputs

