"""Static and automatic loss scaling.

The loss is multiplied by the current scale before the backward pass and the
gradients are divided by it before the update, so in exact arithmetic the training
trajectory does not change, while small float16 gradients are lifted out of the
underflow range.

Where the gradients are divided: float32 (or wider) gradients are divided in place.
Lower-precision gradients of a ``poptorch.optim`` optimizer are left scaled and marked;
the optimizer divides them after converting them to its ``accum_type`` (float32 by
default), so a gradient too small for float16 survives the unscaling too.

Automatic loss scaling (``Options.Training.setAutomaticLossScaling(True)``) starts from
``optimizer.loss_scaling`` and adjusts the scale after every step:

* if any gradient is inf or NaN, the step is skipped (weights and optimizer state
  are untouched) and the scale is multiplied by ``backoff_factor`` (0.5);
* after ``growth_interval`` (200) consecutive good steps the scale is multiplied by
  ``growth_factor`` (2.0), up to ``max_scale`` (2**24).

Powers of two keep the scaling exact. With static scaling the gradients are not
checked, as in PopTorch: an overflow shows up as inf/NaN weights and losses.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, cast

import torch

from ..._typing import StateDict
from ...errors import Error
from .precision import is_low_precision_aware

__all__ = ["PENDING_UNSCALE_ATTR", "LossScaler"]

# Attribute set on a low-precision gradient tensor: divide it by this value (in the
# accumulator dtype) before using it. Read by poptorch.optim optimizers.
PENDING_UNSCALE_ATTR = "_poptorch_pending_unscale"
_STATE_KEY = "poptorch_loss_scaler"


class _ScaledOptimizer(Protocol):
    """The user's optimizer with the scaler's state-dict hooks noted on it."""
    _poptorch_scaler_hooks: tuple[object, object]


class LossScaler:
    """Scales the loss and unscales the gradients for one training optimizer.

    Args:
        optimizer: the optimizer of the training model; its ``loss_scaling``
            (1.0 if it has none, as torch.optim optimizers) is the initial scale, and a
            new value set through ``setOptimizer`` restarts the scale from it.
        automatic: adjust the scale automatically and skip steps that overflow.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, automatic: bool, *,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 200, max_scale: float = 2.0 ** 24) -> None:
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError("LossScaler needs growth_factor > 1 and 0 < backoff_factor < 1.")
        if growth_interval < 1:
            raise ValueError("LossScaler needs growth_interval >= 1.")
        self.optimizer = optimizer
        self.automatic = bool(automatic)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.max_scale = float(max_scale)
        self._configured = self._optimizer_scale()
        self._scale = self._configured
        self._good_steps = 0
        self.skipped_steps = 0
        self._install_state_hooks()

    # --- the scale --------------------------------------------------------------
    def _optimizer_scale(self) -> float:
        scale = getattr(self.optimizer, "loss_scaling", None)
        scale = 1.0 if scale is None else float(scale)
        if not scale > 0.0 or scale == float("inf"):
            raise Error(f"loss_scaling must be a positive finite number, got {scale}.")
        return scale

    @property
    def scale_value(self) -> float:
        """The loss scale the next step uses."""
        configured = self._optimizer_scale()
        if configured != self._configured:
            # setOptimizer (or the user) set a new loss_scaling: start again from it.
            self._configured = self._scale = configured
            self._good_steps = 0
        return self._scale if self.automatic else configured

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` multiplied by the current scale."""
        scale = self.scale_value
        return loss if scale == 1.0 else loss * scale

    def unscale_(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide the gradients of ``params`` by the scale; False if the step must be
        skipped (automatic scaling only: a gradient is inf or NaN)."""
        scale = self.scale_value
        grads = [p.grad for p in params if p.grad is not None]
        if self.automatic and not self._all_finite(grads):
            self._scale = max(self._scale * self.backoff_factor, torch.finfo(torch.float32).tiny)
            self._good_steps = 0
            self.skipped_steps += 1
            return False
        if scale != 1.0:
            self._divide(grads, scale)
        if self.automatic:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self._scale = min(self._scale * self.growth_factor, self.max_scale)
                self._good_steps = 0
        return True

    @staticmethod
    def _all_finite(grads: list) -> bool:
        if not grads:
            return True
        flags = torch.stack([torch.isfinite(g).all().to(device=grads[0].device)
                             for g in grads])
        return bool(flags.all())

    def _divide(self, grads: list, scale: float) -> None:
        defer = is_low_precision_aware(self.optimizer)
        for g in grads:
            if defer and torch.finfo(g.dtype).bits < 32:
                setattr(g, PENDING_UNSCALE_ATTR, scale)
            else:
                g.div_(scale)

    # --- checkpointing ----------------------------------------------------------------
    def state_dict(self) -> dict[str, float | int]:
        """The scaler's progress (saved in the optimizer's state_dict too)."""
        return {"scale": self._scale, "configured": self._configured,
                "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: StateDict) -> None:
        """Restore the progress saved by :meth:`state_dict`."""
        self._scale = float(state["scale"])
        self._configured = float(state["configured"])
        self._good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def _install_state_hooks(self) -> None:
        """Save the automatic scale with the optimizer's state_dict, so a checkpoint
        restores it. One scaler per optimizer: a new scaler replaces the old hooks."""
        if not self.automatic:
            return
        for handle in getattr(self.optimizer, "_poptorch_scaler_hooks", ()):
            handle.remove()
        save = self.optimizer.register_state_dict_post_hook(self._save_hook)
        load = self.optimizer.register_load_state_dict_pre_hook(self._load_hook)
        optimizer = cast(_ScaledOptimizer, self.optimizer)  # (our attribute on it)
        optimizer._poptorch_scaler_hooks = (save, load)  # removed above when set again
        extra: dict | None = getattr(self.optimizer, "_extra_state", None)
        if extra and _STATE_KEY in extra:
            # The optimizer was loaded from a checkpoint before this scaler existed.
            self.load_state_dict(extra[_STATE_KEY])

    def _save_hook(self, optimizer: torch.optim.Optimizer, state: StateDict) -> StateDict:
        state[_STATE_KEY] = self.state_dict()
        return state

    def _load_hook(self, optimizer: torch.optim.Optimizer, state: StateDict) -> StateDict | None:
        if _STATE_KEY in state:
            self.load_state_dict(state[_STATE_KEY])
        return None
