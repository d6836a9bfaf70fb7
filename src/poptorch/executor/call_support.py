"""Small pieces of a call of a PopTorch model that need no executor state: checking
inference options, choosing the backend, moving inputs and outputs between host and
device, undoing a failed call and the first call's buffer rule."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from .._runtime.device_faults import translate as translate_device_fault
from .._runtime.program.backend_choice import automatic_backend
from .._runtime.program.undo import StateUndo
from .._runtime.torch_internals import pytree
from .._typing import UserInput, UserOutput
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


def to_device(structure: UserInput, device: torch.device) -> UserInput:
    """Every tensor of ``structure`` on ``device`` (pinned, non-blocking copies)."""
    def move(t: object) -> object:
        if not isinstance(t, torch.Tensor) or t.device == device:
            return t
        return t.pin_memory().to(device, non_blocking=True)
    return pytree.tree_map(move, structure)


def count_tensors(structure: object) -> int:
    """How many tensors ``structure`` holds."""
    return sum(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(structure))


def to_cpu(structure: UserOutput) -> UserOutput:
    """Every tensor of ``structure`` on the CPU."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to("cpu"), structure)


@contextlib.contextmanager
def undone_on_failure(undo: StateUndo | None,
                      cleanup: Callable[[], None] | None = None) -> Iterator[None]:
    """Around a call: if it raises, everything ``undo`` copied is put back, then
    ``cleanup()`` runs, and a device fault is raised as PopTorch's error
    (:py:func:`raise_device_fault`)."""
    try:
        yield
    except BaseException as error:
        if undo is not None:
            undo.restore()
        if cleanup is not None:
            cleanup()
        raise_device_fault(error)
        raise


def raise_device_fault(error: BaseException) -> None:
    """Raise PopTorch's error for ``error`` when it is a device fault (out of memory, a
    lost device or peer, a timed-out collective: ``_runtime/device_faults.py``, with
    ``error`` as its cause); return otherwise, for the caller to re-raise ``error``."""
    fault = translate_device_fault(error)
    if fault is not None:
        raise fault from error


def check_buffers(undo: StateUndo) -> None:
    """As PopTorch: the first call (when the model is compiled) must keep every
    registered buffer; ``forward`` may update one in place (``copy_``) but not delete it
    or bind its name to another tensor, which would leave the host and the compiled
    program holding different tensors."""
    for name, change in undo.buffer_changes():
        if change == "removed":
            raise Error(f"Buffer {name} is removed from the model when calling the forward "
                        "method. This is not supported: keep the buffer registered (update "
                        "it in place instead).")
        short = name.rsplit(".", 1)[-1]
        raise Error(f"Buffer {name} is reassigned within the model when calling the "
                    f"forward method. This is not supported. Consider using "
                    f"self.{short}.copy_(src) to copy data from a source tensor, where src "
                    f"is the name of the source tensor.")
