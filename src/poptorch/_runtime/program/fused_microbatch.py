"""A training micro-batch's forward, loss and backward as one compiled graph.

The compiled backend's compute of a training micro-batch (``compiled_step``), run by
the step's interpreter (``interpreter.py``). Its ``F`` action is one call of a
``torch.compile``'d function that computes the model's output, its loss
(``find_loss``) times PopTorch's mean scale and the loss scale, and the gradients of
the trainable parameters (``torch.autograd.grad``, traced into the same graph under
dynamo's ``trace_autograd_ops``); its ``B`` action accumulates them into ``.grad`` as
autograd's ``AccumulateGrad`` does: the first micro-batch's gradient becomes ``.grad``,
the next ones are added to it in place, and a parameter no micro-batch reaches keeps
``grad=None``. One graph per micro-batch and no autograd engine between the forward and
the backward pass: the cheapest call a compiled training step can make, compiled once
whatever ``deviceIterations`` and ``gradientAccumulation`` are.

Where the micro-batch cannot be one graph (a graph break in the model: data-dependent
control flow, host work; several returned ``identity_loss`` values; a loss that depends
on no trainable parameter), the compute switches for good, with one INFO line, to the
*split* micro-batch: the forward and the loss compiled (graph breaks allowed), the
backward run by autograd through the backward pass AOTAutograd compiled with them.
Nothing has run when a capture fails, so the switch happens inside the step.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..._logging import describe_error, info_once
from ..._typing import UserOutput
from .. import context
from ..torch_internals import dynamo, dynamo_config_patch, dynamo_eager_numerics, pytree
from .loss import LossNeedsEager, find_loss
from .optimizer import OptimizerBinding
from .runner import LossOf

__all__ = ["FusedCompute", "Uncapturable"]


class Uncapturable(Exception):
    """Raised while a piece is traced when its graph would differ from the eager step."""


def fused_function(model: torch.nn.Module) -> Callable[..., tuple[UserOutput, tuple]]:
    """The Python function the fused micro-batch traces (module docstring):
    ``(args, kwargs, params, multiplier, scale) -> (detached output, gradients)``."""
    def fused_microbatch(args: tuple, kwargs: dict, params: tuple, multiplier: float,
                         scale: torch.Tensor | None) -> tuple[UserOutput, tuple]:
        out = model(*args, **kwargs)
        try:
            loss = find_loss(out, context.take_marked_losses(), traced=True)
        except LossNeedsEager as error:
            raise Uncapturable(str(error)) from None
        if not loss.requires_grad:
            raise Uncapturable("the loss depends on no trainable parameter")
        if multiplier != 1.0:
            loss = loss * multiplier
        if scale is not None:
            loss = loss * scale.to(loss.dtype)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), out), grads
    return fused_microbatch


def _capture_failure(error: BaseException) -> bool:
    """Whether ``error`` says the micro-batch cannot be traced as one graph (nothing
    ran), as opposed to a failure of the compiler or of compiled code."""
    exc = dynamo().exc
    return isinstance(error, Uncapturable) or (
        isinstance(error, exc.TorchDynamoException)
        and not isinstance(error, exc.BackendCompilerFailed))


class FusedCompute:
    """The compiled backend's compute of a training micro-batch (module docstring):
    ``F`` runs the fused graph (output and gradients), ``B`` accumulates its gradients
    into ``.grad``; after a capture failure, ``F`` runs the split forward and loss and
    ``B`` autograd's backward from that loss."""

    def __init__(self, compiled: Callable[..., tuple[UserOutput, tuple]],
                 forward_loss: Callable[[tuple, dict], tuple[UserOutput, torch.Tensor]],
                 params: list[torch.nn.Parameter], binding: OptimizerBinding | None,
                 label: str) -> None:
        self._compiled = compiled  # torch.compile of fused_function(model), fullgraph
        self._forward_loss = forward_loss  # the split micro-batch's compiled piece
        self._params = params
        self._binding = binding
        self._label = label
        self._traced = False  # (dynamo's settings apply to the first trace only)
        self.split_reason: str | None = None
        self._scale: torch.Tensor | None = None
        self._scale_value: float | None = None
        self._grads: tuple[torch.Tensor | None, ...] = ()  # the last F's, for its B
        self._loss: torch.Tensor | None = None  # ... or its loss (split)

    def forward(self, args: tuple, kwargs: dict, loss_of: LossOf | None) -> UserOutput:
        assert loss_of is not None  # (the compute of training micro-batches)
        if self.split_reason is None:
            try:
                out, self._grads = self._run(args, kwargs, self._trainable(),
                                             loss_of.multiplier, self._scale_tensor())
                return out
            except Exception as error:
                if not _capture_failure(error):
                    raise
                self._use_split(error)
        out, self._loss = self._forward_loss(args, kwargs)
        return out

    def backward(self, output: UserOutput, loss_of: LossOf) -> None:
        loss, self._loss = self._loss, None
        if loss is not None:
            loss_of.finish(loss).backward()
            return
        grads, self._grads = self._grads, ()
        for p, grad in zip(self._trainable(), grads, strict=True):
            if grad is not None:
                if p.grad is None:
                    p.grad = grad
                else:
                    p.grad.add_(grad)

    def _trainable(self) -> tuple[torch.nn.Parameter, ...]:
        return tuple(p for p in self._params if p.requires_grad)

    def _run(self, args: tuple, kwargs: dict, params: tuple, multiplier: float,
             scale: torch.Tensor | None) -> tuple[UserOutput, tuple]:
        """One call; dynamo traces ``torch.autograd.grad`` under its setting only, so a
        retrace (a guard failed) that cannot trace it is tried once more with it."""
        if self._traced:
            try:
                return self._compiled(args, kwargs, params, multiplier, scale)
            except Exception as error:
                if not _capture_failure(error):
                    raise
        with dynamo_config_patch(trace_autograd_ops=True, **dynamo_eager_numerics()):
            result = self._compiled(args, kwargs, params, multiplier, scale)
        self._traced = True
        return result

    def _scale_tensor(self) -> torch.Tensor | None:
        """The loss scale as a tensor input (its value changes; the graph does not)."""
        scaler = None if self._binding is None else self._binding.scaler
        if scaler is None:
            return None
        value = scaler.scale_value
        if self._scale is None or self._scale_value != value:
            self._scale = torch.tensor(value, dtype=torch.float32)
            self._scale_value = value
        return self._scale

    def _use_split(self, error: BaseException) -> None:
        self.split_reason = describe_error(error)
        info_once(("split-microbatch", self._label), "%s: a micro-batch's forward and "
                  "backward passes cannot be one graph (%s): its forward pass and loss "
                  "are compiled, autograd runs the backward pass.", self._label,
                  self.split_reason)
