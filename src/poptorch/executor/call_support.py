"""Small pieces of a call of a PopTorch model that need no executor state: checking
inference options, choosing the backend, moving inputs and outputs between host and
device, and the snapshot that undoes a failed first call."""
from __future__ import annotations

from typing import Any

import torch
from .._runtime.torch_internals import pytree

from .._runtime.program.backend_choice import automatic_backend
from ..annotations.strategies import PipelinedExecution, ShardedExecution
from ..errors import Error
from ..options.options import Options


def check_inference_accumulation(options: Options) -> None:
    """PopTorch refuses an inferenceModel whose options accumulate gradients, when the
    model is wrapped."""
    g = options.Training.gradient_accumulation
    if g == 1:
        return
    message = ("You must set poptorch.Options().Training.gradientAccumulation to 1 or leave "
               "it as its default value (1) when running a poptorch.inferenceModel().")
    strategy = options._execution_strategy
    if isinstance(strategy, PipelinedExecution) and \
            not isinstance(strategy, ShardedExecution):
        message += (" Use poptorch.Options().deviceIterations to process a sufficient "
                    "number of batches each run for pipelined execution instead.")
    raise Error(f"{message} (It is {g}; for example use opts.clone() then "
                "opts.Training.gradientAccumulation(1) for inference.)")


def backend_name(options: Options, device: torch.device) -> str:
    """The backend that runs the model: Options.Jit.backend, POPTORCH_BACKEND, else the
    automatic choice (``_runtime/program/backend_choice.py``): ``fastest``, the
    compiled program kept only where its first calls show it beats the eager loop
    (``backend_trial.BackendTrial``), or eager where no compiler is present."""
    name = options.Jit.backend_name  # (POPTORCH_BACKEND is parsed there, only there)
    if name is None:
        return automatic_backend(device)
    return name


def to_device(structure: Any, device: torch.device) -> Any:
    """Every tensor of ``structure`` on ``device`` (pinned, non-blocking copies)."""
    def move(t):
        if not isinstance(t, torch.Tensor) or t.device == device:
            return t
        return t.pin_memory().to(device, non_blocking=True)
    return pytree.tree_map(move, structure)


def count_tensors(structure: Any) -> int:
    """How many tensors ``structure`` holds."""
    return sum(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(structure))


def to_cpu(structure: Any) -> Any:
    """Every tensor of ``structure`` on the CPU."""
    return pytree.tree_map(
        lambda t: t.to("cpu") if isinstance(t, torch.Tensor) else t, structure)


class CallRollback:
    """The state a later call may change, kept while it runs and put back in place if
    it fails, so that a failing call leaves nothing half-updated (all or nothing, as the
    first call, see :py:class:`Snapshot`). In place: a compiled program keeps using the
    same tensors.

    ``weights=False`` keeps only the buffers: enough for a call of one optimizer step
    (one device iteration: any number of micro-batches), which changes the parameters
    and the optimizer state only once every forward and backward has succeeded. The
    loss scaler's state is kept as well (the program's random stream rolls itself
    back, see ``RngScope``)."""

    __slots__ = ("tensors", "optimizer", "opt_values", "opt_groups", "scaler",
                 "scaler_state")

    def __init__(self, params: list, buffers: list, optimizer: Any, scaler: Any) -> None:
        tensors = params + buffers
        self.optimizer = optimizer
        if optimizer is not None:
            # per parameter: its state's keys, tensors (copied) and other values
            self.opt_values = {p: dict(s) for p, s in optimizer.state.items()}
            for s in self.opt_values.values():
                tensors.extend(v for v in s.values() if isinstance(v, torch.Tensor))
            self.opt_groups = [{k: v for k, v in g.items() if k != "params"}
                               for g in optimizer.param_groups]
        self.tensors = [(t, t.detach().clone()) for t in tensors]
        self.scaler = scaler
        self.scaler_state = None if scaler is None else scaler.state_dict()

    @classmethod
    def for_call(cls, program: Any, buffers: list) -> "CallRollback | None":
        """What a call of ``program`` must be able to undo: everything when it runs
        more than one optimizer step (or checks its outputs after the step); the buffers
        (which a forward may update before it fails) otherwise; None when there is
        nothing to undo."""
        plan = program.plan
        # Several updates per call, or a check that may fail after the update.
        weights = program.training and plan.factor > 1 and (
            plan.device_iterations > 1 or program.finite_check is not None)
        if not weights and not buffers and program.scaler is None:
            return None
        return cls(program.params if weights else [], list(buffers),
                   program.optimizer if weights else None, program.scaler)

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.tensors:
                t.copy_(saved)
        optimizer = self.optimizer
        if optimizer is not None:
            state = optimizer.state
            for p in [p for p in state if p not in self.opt_values]:
                del state[p]  # state the failed call created
            for p, values in self.opt_values.items():
                current = state[p]
                current.clear()
                current.update(values)  # the same tensors, their values put back
            for group, values in zip(optimizer.param_groups, self.opt_groups, strict=False):
                group.update(values)
        if self.scaler is not None:
            self.scaler.load_state_dict(self.scaler_state)


class Snapshot:
    """Model and optimizer state before the first call, restored if that call fails,
    so that a failing call leaves nothing half-updated."""

    def __init__(self, model: torch.nn.Module, optimizer: Any,
                 user_optimizer: Any = None, user_state: Any = None) -> None:
        self.tensors = [(t, t.detach().clone()) for t in
                        list(model.parameters()) + list(model.buffers())]
        # which tensor each module registers under each buffer name
        self.buffers = [(prefix, module, dict(module._buffers))
                        for prefix, module in model.named_modules()]
        self.optimizer = optimizer
        self.opt_state = None if optimizer is None else _cloned(getattr(  # host state
            optimizer, "get_state_dict", optimizer.state_dict)())
        # the user's optimizer as it was before compiling (which may initialize state)
        self.user_optimizer = user_optimizer
        self.user_state = user_state

    def check_buffers(self) -> None:
        """As PopTorch: the first call (when the model is compiled) must keep every
        registered buffer; ``forward`` may update one in place (``copy_``) but not delete
        it or bind its name to another tensor, which would leave the host and the
        compiled program holding different tensors."""
        for prefix, module, registered in self.buffers:
            for name, tensor in registered.items():
                qualified = f"{prefix}.{name}" if prefix else name
                if name not in module._buffers:
                    raise Error(f"Buffer {qualified} is removed from the model when calling "
                                f"the forward method. This is not supported: keep the "
                                f"buffer registered (update it in place instead).")
                if module._buffers[name] is not tensor:
                    raise Error(f"Buffer {qualified} is reassigned within the model when "
                                f"calling the forward method. This is not supported. "
                                f"Consider using self.{name}.copy_(src) to copy data from a "
                                f"source tensor, where src is the name of the source tensor.")

    def restore(self) -> None:
        for _, module, registered in self.buffers:
            for name in [n for n in module._buffers if n not in registered]:
                del module._buffers[name]
            module._buffers.update(registered)
        with torch.no_grad():
            for t, saved in self.tensors:
                t.copy_(saved)
        if self.optimizer is not None:
            getattr(self.optimizer, "set_state_dict", self.optimizer.load_state_dict)(
                self.opt_state)
        if self.user_optimizer is not None:
            getattr(self.user_optimizer, "set_state_dict",
                    self.user_optimizer.load_state_dict)(self.user_state)


def _cloned(state: Any) -> Any:
    """``state`` with its tensors copied: an optimizer's ``state_dict()`` holds its live
    state tensors, which the optimizer then updates in place."""
    return pytree.tree_map(
        lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, state)
