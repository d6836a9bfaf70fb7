"""PopTorch optimizers: torch.optim's algorithms with PopTorch's extras.

Every optimizer here works both with :py:func:`poptorch.trainingModel` and as an
ordinary optimizer in a plain PyTorch loop, where ``step()`` gives the same result as
the matching ``torch.optim`` optimizer. The extras:

* ``loss_scaling``: the training model multiplies the loss by it before the
  backward pass and divides the gradients by it before the update (see
  ``poptorch._runtime.numerics.loss_scaling``); a plain loop is unaffected.
* ``velocity_scaling`` / ``use_combined_accum`` (SGD): PopTorch's combined variant,
  one tensor holding ``velocity_scaling * velocity`` in the parameter dtype.
* ``accum_type``, ``velocity_accum_type``, ``first_order_momentum_accum_type``,
  ``second_order_momentum_accum_type``: dtypes of the gradients used by the update
  and of the optimizer state (default ``torch.float32``).
* ``max_grad_norm``: clip the global gradient norm before the update.
* constant and variable attributes (``variable_attrs``), see
  ``poptorch.optim.attributes``.

Arguments default to ``None``: use the torch default and mark the attribute constant.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

from .._typing import UserOutput
from ..errors import PoptorchValueError
from . import updates
from .attributes import VariableAttributes
from .base import AttrDefaults, Optimizer

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

__all__ = ["LAMB", "SGD", "Adam", "AdamW", "Optimizer", "RMSprop", "VariableAttributes"]

_F32 = torch.float32
_INF = float("inf")


def _arguments(frame_locals: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in frame_locals.items()
            if k not in ("self", "params", "__class__")}


def _run_closure(closure: Callable[[], UserOutput] | None) -> UserOutput:
    """The closure's result: the user's loss, whatever it returns."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class SGD(Optimizer, torch.optim.SGD):
    """Stochastic gradient descent with optional momentum, loss and velocity scaling.

    ``use_combined_accum=False`` (default, the *separate* variant) keeps the velocity
    in its own tensor of ``velocity_accum_type``; ``velocity_scaling`` is ignored.
    ``use_combined_accum=True`` keeps one tensor per parameter, in the parameter
    dtype, holding ``velocity_scaling * velocity``; ``velocity_accum_type`` is
    ignored. Both give torch.optim.SGD's trajectory in exact arithmetic.
    ``velocity_scaling`` may differ between param groups.
    """

    _group_attrs: ClassVar[AttrDefaults] = {
        "lr": None, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
        "nesterov": False, "maximize": False, "velocity_scaling": 1.0}
    _optimizer_attrs: ClassVar[AttrDefaults] = {"loss_scaling": 1.0, "max_grad_norm": _INF}
    _structural_attrs: ClassVar[AttrDefaults] = {"use_combined_accum": False, "accum_type": _F32,
                         "velocity_accum_type": _F32}

    def __init__(self, params: ParamsT, lr: float, momentum: float | None = None,
                 dampening: float | None = None, weight_decay: float | None = None,
                 nesterov: bool | None = None, maximize: bool | None = None,
                 foreach: bool | None = None, differentiable: bool | None = None,
                 loss_scaling: float | None = None,
                 velocity_scaling: float | None = None,
                 use_combined_accum: bool | None = None,
                 accum_type: torch.dtype | None = None,
                 velocity_accum_type: torch.dtype | None = None,
                 max_grad_norm: float | None = None) -> None:
        passed = _arguments(locals())
        params, hp = self._prepare(params, passed)
        torch.optim.SGD.__init__(self, params, lr=lr, momentum=hp["momentum"],
                                 dampening=hp["dampening"],
                                 weight_decay=hp["weight_decay"],
                                 nesterov=hp["nesterov"], maximize=hp["maximize"],
                                 foreach=foreach, differentiable=bool(differentiable))
        self._finish(passed)

    def _initial_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each state tensor of ``p`` before the first step (see ``ipu_state``)."""
        dtype = p.dtype if self.use_combined_accum else self.velocity_accum_type
        return {"momentum_buffer": torch.zeros_like(p, dtype=dtype)}

    @torch.no_grad()
    def step(self, closure: Callable[[], UserOutput] | None = None) -> UserOutput:
        """Perform a single optimization step."""
        loss = _run_closure(closure)
        grads = self._gradients()
        for group in self.param_groups:
            for p in group["params"]:
                if p in grads:
                    updates.sgd(p, grads[p], group, self.state[p],
                                combined=self.use_combined_accum,
                                velocity_dtype=self.velocity_accum_type)
        return loss


class _AdamBase(Optimizer):
    """Shared step of Adam and AdamW."""

    _decoupled = False

    def _check_amsgrad(self) -> None:
        if any(group.get("amsgrad") for group in self.param_groups):
            # upstream: a ValueError when the model is compiled
            raise PoptorchValueError(f"poptorch.optim.{type(self).__name__} does not "
                                     f"support amsgrad=True; use amsgrad=False (the default).")

    def _initial_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each state tensor of ``p`` before the first step (see ``ipu_state``)."""
        return {"step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, dtype=self.first_order_momentum_accum_type),
                "exp_avg_sq": torch.zeros_like(
                    p, dtype=self.second_order_momentum_accum_type)}

    @torch.no_grad()
    def step(self, closure: Callable[[], UserOutput] | None = None) -> UserOutput:
        """Perform a single optimization step."""
        self._check_amsgrad()
        loss = _run_closure(closure)
        grads = self._gradients()
        for group in self.param_groups:
            for p in group["params"]:
                if p in grads:
                    updates.adam(p, grads[p], group, self.state[p],
                                 decoupled=self._decoupled,
                                 bias_correction=getattr(self, "bias_correction", True),
                                 first_dtype=self.first_order_momentum_accum_type,
                                 second_dtype=self.second_order_momentum_accum_type)
        return loss


_ADAM_GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
               "amsgrad": False, "maximize": False}
_MOMENT_TYPES = {"accum_type": _F32, "first_order_momentum_accum_type": _F32,
                 "second_order_momentum_accum_type": _F32}


class Adam(_AdamBase, torch.optim.Adam):
    """Adam optimizer, matching torch.optim.Adam, with optional loss scaling.

    AMSGrad is not supported (must be False).
    """

    _group_attrs: ClassVar[AttrDefaults] = dict(_ADAM_GROUP)
    _optimizer_attrs: ClassVar[AttrDefaults] = {"loss_scaling": 1.0, "max_grad_norm": _INF}
    _structural_attrs: ClassVar[AttrDefaults] = dict(_MOMENT_TYPES)

    def __init__(self, params: ParamsT, lr: float | None = None,
                 betas: tuple[float, float] | None = None, eps: float | None = None,
                 weight_decay: float | None = None, amsgrad: bool | None = None,
                 foreach: bool | None = None, maximize: bool | None = None,
                 capturable: bool | None = None, differentiable: bool | None = None,
                 fused: bool | None = None, loss_scaling: float | None = None,
                 accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 max_grad_norm: float | None = None) -> None:
        passed = _arguments(locals())
        params, hp = self._prepare(params, passed)
        torch.optim.Adam.__init__(self, params, lr=hp["lr"], betas=hp["betas"],
                                  eps=hp["eps"], weight_decay=hp["weight_decay"],
                                  amsgrad=hp["amsgrad"], foreach=foreach,
                                  maximize=hp["maximize"], capturable=bool(capturable),
                                  differentiable=bool(differentiable), fused=None)
        self._finish(passed)
        self._check_amsgrad()


class AdamW(_AdamBase, torch.optim.AdamW):
    """Adam with decoupled weight decay, matching torch.optim.AdamW, with optional
    loss scaling; ``bias_correction=False`` drops Adam's bias correction.

    AMSGrad is not supported (must be False).
    """

    _decoupled = True
    _group_attrs: ClassVar[AttrDefaults] = {**_ADAM_GROUP, "weight_decay": 1e-2}
    _optimizer_attrs: ClassVar[AttrDefaults] = {
        "loss_scaling": 1.0, "bias_correction": True, "max_grad_norm": _INF}
    _structural_attrs: ClassVar[AttrDefaults] = dict(_MOMENT_TYPES)

    def __init__(self, params: ParamsT, lr: float | None = None,
                 betas: tuple[float, float] | None = None, eps: float | None = None,
                 weight_decay: float | None = None, amsgrad: bool | None = None,
                 maximize: bool | None = None, foreach: bool | None = None,
                 capturable: bool | None = None, differentiable: bool | None = None,
                 fused: bool | None = None, loss_scaling: float | None = None,
                 bias_correction: bool | None = None,
                 accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 max_grad_norm: float | None = None) -> None:
        passed = _arguments(locals())
        params, hp = self._prepare(params, passed)
        torch.optim.AdamW.__init__(self, params, lr=hp["lr"], betas=hp["betas"],
                                   eps=hp["eps"], weight_decay=hp["weight_decay"],
                                   amsgrad=hp["amsgrad"], maximize=hp["maximize"],
                                   foreach=foreach, capturable=bool(capturable),
                                   differentiable=bool(differentiable), fused=None)
        self._finish(passed)
        self._check_amsgrad()


class RMSprop(Optimizer, torch.optim.RMSprop):
    """RMSprop with optional L2 penalty, matching torch.optim.RMSprop, with optional
    loss scaling. ``use_tf_variant=True`` follows TensorFlow instead: the mean square
    starts at one, eps goes inside the square root and the learning rate is
    accumulated in the momentum buffer.

    ``first_order_momentum_accum_type`` is the dtype of the momentum buffer and of
    the gradient average (``centered``); ``second_order_momentum_accum_type`` the
    dtype of the mean square.
    """

    _group_attrs: ClassVar[AttrDefaults] = {
        "lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0,
        "centered": False, "maximize": False}
    _optimizer_attrs: ClassVar[AttrDefaults] = {"loss_scaling": 1.0, "use_tf_variant": False}
    _structural_attrs: ClassVar[AttrDefaults] = dict(_MOMENT_TYPES)

    def __init__(self, params: ParamsT, lr: float | None = None,
                 alpha: float | None = None, eps: float | None = None,
                 weight_decay: float | None = None, momentum: float | None = None,
                 centered: bool | None = None, foreach: bool | None = None,
                 maximize: bool | None = None, differentiable: bool | None = None,
                 loss_scaling: float | None = None,
                 accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 use_tf_variant: bool | None = None) -> None:
        passed = _arguments(locals())
        params, hp = self._prepare(params, passed)
        torch.optim.RMSprop.__init__(self, params, lr=hp["lr"], alpha=hp["alpha"],
                                     eps=hp["eps"], weight_decay=hp["weight_decay"],
                                     momentum=hp["momentum"], centered=hp["centered"],
                                     foreach=foreach, maximize=hp["maximize"],
                                     differentiable=bool(differentiable))
        self._finish(passed)

    def _initial_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each state tensor of ``p`` before the first step (see ``ipu_state``)."""
        first, second = (self.first_order_momentum_accum_type,
                         self.second_order_momentum_accum_type)
        return {"step": torch.tensor(0.0),
                "square_avg": torch.full_like(p, 1.0 if self.use_tf_variant else 0.0,
                                              dtype=second),
                "momentum_buffer": torch.zeros_like(p, dtype=first),
                **({"grad_avg": torch.zeros_like(p, dtype=first)}
                   if any(g["centered"] for g in self.param_groups) else {})}

    @torch.no_grad()
    def step(self, closure: Callable[[], UserOutput] | None = None) -> UserOutput:
        """Perform a single optimization step."""
        loss = _run_closure(closure)
        grads = self._gradients()
        for group in self.param_groups:
            for p in group["params"]:
                if p in grads:
                    updates.rmsprop(p, grads[p], group, self.state[p],
                                    tf_variant=self.use_tf_variant,
                                    first_dtype=self.first_order_momentum_accum_type,
                                    second_dtype=self.second_order_momentum_accum_type)
        return loss


class LAMB(Optimizer, torch.optim.Optimizer):
    """Layer-wise Adaptive Moments (LAMB) optimizer (biased version).

    Based on "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes" (https://arxiv.org/abs/1904.00962). The scaling function phi(z) is fixed
    as min(z, max_weight_norm); ``max_weight_norm=None`` (default) disables the cap.
    Weight decay (default 0.01) is added to the Adam direction before the trust ratio.
    """

    # max_weight_norm is per param group, as upstream (optimum-graphcore gives biases
    # max_weight_norm=0.0: phi = 0, trust ratio 1, i.e. no layer-wise scaling)
    _group_attrs: ClassVar[AttrDefaults] = {
        "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2,
        "max_weight_norm": None}
    _optimizer_attrs: ClassVar[AttrDefaults] = {"loss_scaling": 1.0, "bias_correction": True}
    _structural_attrs: ClassVar[AttrDefaults] = dict(_MOMENT_TYPES)

    def __init__(self, params: ParamsT, lr: float | None = None,
                 betas: tuple[float, float] | None = None, eps: float | None = None,
                 weight_decay: float | None = None,
                 bias_correction: bool | None = None,
                 loss_scaling: float | None = None,
                 max_weight_norm: float | None = None,
                 accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None) -> None:
        passed = _arguments(locals())
        params, hp = self._prepare(params, passed)
        _check_range("lr", hp["lr"], 0.0)
        _check_range("eps", hp["eps"], 0.0)
        _check_range("weight_decay", hp["weight_decay"], 0.0)
        if not all(0.0 <= b < 1.0 for b in hp["betas"]):
            raise PoptorchValueError(f"Invalid betas for LAMB: {hp['betas']} (each must be "
                                     f"in [0, 1)).")
        for group in [hp] + [g for g in params if isinstance(g, dict)]:
            norm = group.get("max_weight_norm")
            if norm is not None and not norm >= 0:
                raise PoptorchValueError(f"Invalid max_weight_norm for LAMB: {norm} (must "
                                         f"be >= 0, or None to disable the cap).")
        torch.optim.Optimizer.__init__(self, params, dict(hp))
        self._finish(passed)

    def _initial_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each state tensor of ``p`` before the first step (see ``ipu_state``)."""
        return {"step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, dtype=self.first_order_momentum_accum_type),
                "exp_avg_sq": torch.zeros_like(
                    p, dtype=self.second_order_momentum_accum_type)}

    @torch.no_grad()
    def step(self, closure: Callable[[], UserOutput] | None = None) -> UserOutput:
        """Perform a single optimization step."""
        loss = _run_closure(closure)
        grads = self._gradients()
        for group in self.param_groups:
            for p in group["params"]:
                if p in grads:
                    updates.lamb(p, grads[p], group, self.state[p],
                                 bias_correction=self.bias_correction,
                                 max_weight_norm=group["max_weight_norm"],
                                 first_dtype=self.first_order_momentum_accum_type,
                                 second_dtype=self.second_order_momentum_accum_type)
        return loss


def _check_range(name: str, value: float, minimum: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= minimum):
        raise PoptorchValueError(f"Invalid {name} for LAMB: {value!r} (must be a finite "
                                 f"number >= {minimum}).")
