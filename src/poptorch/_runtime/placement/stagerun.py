"""Running one micro-batch's forward pass split at its block boundaries.

:class:`StageRun` is both the block listener of the annotations and a torch function
mode. It knows the stage the model is in (block boundaries switch it) and sees every
tensor an operation uses:

* a tensor made by an earlier *unit* (a pipeline stage, or a phase) is replaced, once,
  by a detached copy on the current stage's device: the forward pass is cut at unit
  boundaries, so each unit's backward pass can be run on its own
  (:meth:`StageRun.backward_unit`), when the schedule says so;
* a tensor on another device (a model input, or a tensor from another stage of the
  same unit) is moved to the current stage's device.

``on_unit(unit)`` is called as the forward pass enters each unit (phased execution
streams the phase's weights in there).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection

import torch
from torch.overrides import TorchFunctionMode

from ...errors import Error
from ..torch_internals import pytree
from . import markers
from .partition import Partition

_ORIGIN = "_poptorch_origin"


def cut_copy(t: torch.Tensor, device: torch.device,
             pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``t`` cut off its autograd graph at a stage boundary, on ``device``: when ``t``
    needs a gradient, the copy requires one too and ``(t, copy)`` joins ``pairs`` (the
    copy's gradient goes on through ``t`` in the producer's backward pass)."""
    copy = t.detach().to(device)
    if t.requires_grad and torch.is_grad_enabled():
        copy.requires_grad_(True)
        pairs.append((t, copy))
    return copy


class StageRun(TorchFunctionMode, markers.BlockListener):
    """One micro-batch going through the stages (module docstring)."""

    def __init__(self, partition: Partition, devices: list[torch.device],
                 unit_of_stage: list[int], cut: bool,
                 on_unit: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.partition = partition
        self.devices = devices
        self.unit_of_stage = unit_of_stage
        self.on_unit = on_unit
        self.cut = cut
        self.stage: int | None = None
        self.unit = -1
        self.device = devices[partition.stages[0].ipu]
        self._token = object()
        self._copies: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._sends: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.loss: torch.Tensor | None = None

    # ---------------------------------------------------------------- block listener
    def begin_block(self, user_id: markers.BlockId, ipu_id: int | None,
                    layer: torch.nn.Module | None = None) -> None:
        block = self.block_id(user_id)
        stage = self.partition.block_stage.get(block)
        if stage is None:
            raise Error(f"Block {block!r} was not entered when PopTorch traced the model at "
                        f"compile time (blocks then: {self.partition.sequence}): every call "
                        "must run the same blocks. Recompile (a new poptorch model) if the "
                        "structure changed.")
        self._enter_stage(stage)

    # ---------------------------------------------------------------- stage switching
    def _enter_stage(self, stage: int) -> None:
        if stage == self.stage:
            return
        unit = self.unit_of_stage[stage]
        if unit != self.unit:
            if self.on_unit is not None:
                self.on_unit(unit)
            self.unit = unit
        self.stage = stage
        self.device = self.devices[self.partition.stages[stage].ipu]

    def start(self) -> None:
        """Enter the stage where the model's forward pass begins."""
        self._enter_stage(self.partition.block_stage[self.partition.sequence[0]])

    # ---------------------------------------------------------------- torch function mode
    def __torch_function__(self, func: Callable[..., object], types: Collection[type],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        args, kwargs = pytree.tree_map_only(torch.Tensor, self._adopt, (args, kwargs))
        out = func(*args, **kwargs)
        origin = (self._token, self.unit)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                with contextlib.suppress(AttributeError, RuntimeError):  # no __dict__
                    setattr(t, _ORIGIN, origin)
        return out

    def _adopt(self, t: torch.Tensor) -> torch.Tensor:
        origin = getattr(t, _ORIGIN, None) if not isinstance(t, torch.nn.Parameter) else None
        if origin is not None and origin[0] is self._token and origin[1] != self.unit \
                and self.cut:
            return self._cut(t, origin[1])
        if t.device != self.device:
            return t.to(self.device)
        return t

    def _cut(self, t: torch.Tensor, source_unit: int) -> torch.Tensor:
        key = (id(t), self.unit)
        cached = self._copies.get(key)
        if cached is not None and cached[0] is t:
            return cached[1]
        copy = cut_copy(t, self.device, self._sends.setdefault(source_unit, []))
        setattr(copy, _ORIGIN, (self._token, self.unit))
        self._copies[key] = (t, copy)
        return copy

    # ---------------------------------------------------------------- backward
    def backward_unit(self, unit: int) -> None:
        """Backward pass of ``unit`` (cut runs): from the loss (computed in the unit the
        forward pass ended in) and from the gradients that later units left on the
        copies of this unit's tensors."""
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if unit == self.unit and self.loss is not None:
            roots.append(self.loss)
            grads.append(None)
        for original, copy in self._sends.pop(unit, []):
            if copy.grad is not None:
                roots.append(original)
                grads.append(copy.grad.to(original.device))
        if roots:
            torch.autograd.backward(roots, grads)
        if unit == self.unit:
            self.loss = None
