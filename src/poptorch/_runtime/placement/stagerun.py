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

Units are entered through a *gate* (a :class:`~.pipeline.LaneScheduler`), which blocks
until the schedule lets this micro-batch run that unit.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from ..torch_internals import pytree

from . import markers
from .partition import BlockNamer, Partition
from .pipeline import FORWARD, LaneScheduler

_ORIGIN = "_poptorch_origin"


class StageRun(TorchFunctionMode):
    """One micro-batch going through the stages (module docstring)."""

    def __init__(self, partition: Partition, devices: List[torch.device], microbatch: int,
                 unit_of_stage: List[int], gate: Optional[LaneScheduler],
                 cut: bool) -> None:
        super().__init__()
        self.partition = partition
        self.devices = devices
        self.microbatch = microbatch
        self.unit_of_stage = unit_of_stage
        self.num_units = max(unit_of_stage) + 1
        self.gate = gate
        self.cut = cut
        self.namer = BlockNamer()
        self.stage: Optional[int] = None
        self.unit = -1
        self.device = devices[partition.stages[0].ipu]
        self._token = object()
        self._copies: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        self._sends: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
        self.loss: Optional[torch.Tensor] = None
        self.stage_trail: List[int] = []  # stages entered, in order (sharded record)

    # ---------------------------------------------------------------- block listener
    def reset_auto_id(self) -> None:
        self.namer.reset_auto_id()

    def begin_block(self, user_id, ipu_id, layer=None) -> None:
        block = self.namer.name(user_id)
        stage = self.partition.block_stage.get(block)
        if stage is None:
            raise _unknown_block(block, self.partition)
        self._enter_stage(stage)

    def checkpoint(self, tensors: list) -> list:
        return tensors

    # ---------------------------------------------------------------- stage switching
    def _enter_stage(self, stage: int) -> None:
        if stage == self.stage:
            return
        unit = self.unit_of_stage[stage]
        if unit != self.unit:
            self._advance_to_unit(unit)
        self.stage = stage
        self.device = self.devices[self.partition.stages[stage].ipu]
        self.stage_trail.append(stage)

    def _advance_to_unit(self, unit: int) -> None:
        if self.gate is None:
            self.unit = unit
            return
        # Units are entered in ascending order (checked at compile time); a unit the
        # micro-batch skips is entered and left at once so the schedule moves on.
        while self.unit < unit:
            if self.unit >= 0:
                self.gate.release(FORWARD, self.unit, self.microbatch)
            self.unit += 1
            self.gate.acquire(FORWARD, self.unit, self.microbatch)

    def start(self) -> None:
        """Enter the stage where the model's forward pass begins."""
        self._enter_stage(self.partition.block_stage[self.partition.sequence[0]])

    def finish_forward(self) -> None:
        """After the model returned: pass through the remaining units to the last one
        (where the loss is computed)."""
        if self.gate is not None:
            self._advance_to_unit(self.num_units - 1)

    def release_forward(self) -> None:
        if self.gate is not None:
            self.gate.release(FORWARD, self.unit, self.microbatch)

    # ---------------------------------------------------------------- torch function mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        args, kwargs = pytree.tree_map_only(torch.Tensor, self._adopt, (args, kwargs))
        out = func(*args, **kwargs)
        origin = (self._token, self.unit)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                try:
                    setattr(t, _ORIGIN, origin)
                except (AttributeError, RuntimeError):  # tensors without a __dict__
                    pass
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
        copy = t.detach().to(self.device)
        if t.requires_grad and torch.is_grad_enabled():
            copy.requires_grad_(True)
            self._sends.setdefault(source_unit, []).append((t, copy))
        setattr(copy, _ORIGIN, (self._token, self.unit))
        self._copies[key] = (t, copy)
        return copy

    # ---------------------------------------------------------------- backward
    def backward_unit(self, unit: int) -> None:
        """Backward pass of ``unit``: from the loss (last unit) and from the gradients
        that later units left on the copies of this unit's tensors."""
        roots: List[torch.Tensor] = []
        grads: List[Any] = []
        if unit == self.num_units - 1 and self.loss is not None:
            roots.append(self.loss)
            grads.append(None)
        for original, copy in self._sends.pop(unit, []):
            if copy.grad is not None:
                roots.append(original)
                grads.append(copy.grad.to(original.device))
        if roots:
            torch.autograd.backward(roots, grads)
        if unit == 0:
            self._copies.clear()
            self.loss = None


def _unknown_block(block: str, partition: Partition) -> Exception:
    from ...errors import Error  # pylint: disable=import-outside-toplevel
    return Error(f"Block {block!r} was not entered when PopTorch traced the model at compile "
                 f"time (blocks then: {partition.sequence}): every call must run the same "
                 "blocks. Recompile (a new poptorch model) if the structure changed.")


class listening:
    """Context manager installing a block listener on this thread."""

    def __init__(self, listener: Any) -> None:
        self.listener = listener
        self.previous = None

    def __enter__(self):
        self.previous = markers.set_listener(self.listener)
        return self.listener

    def __exit__(self, *exc) -> None:
        markers.set_listener(self.previous)
