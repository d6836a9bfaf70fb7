"""Small pieces of a call of a PopTorch model that need no executor state: checking
inference options, choosing the backend, moving inputs and outputs between host and
device, and the snapshot that undoes a failed first call."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

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
    (``compiled_step.BackendTrial``), or eager where no compiler is present."""
    name = options.Jit.backend_name
    if name is None:
        return automatic_backend(device)
    if name not in ("eager", "inductor", "fastest"):
        raise Error(f"Unknown backend {name!r}: use 'eager', 'inductor' or 'fastest' "
                    "(Options.Jit.backend or POPTORCH_BACKEND).")
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
        self.opt_state = None if optimizer is None else getattr(  # host state only
            optimizer, "get_state_dict", optimizer.state_dict)()
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
