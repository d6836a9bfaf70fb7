"""On-device control flow: ``for_loop`` and ``cond``.

Eagerly both are plain Python control flow. While ``torch.compile`` captures the
model, ``cond`` becomes ``torch.cond`` so the branch is chosen on the device.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .._runtime import context
from ..errors import Error

__all__ = ["cond", "for_loop"]


def _as_list(outputs: object, op: str) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)) and all(isinstance(o, torch.Tensor)
                                                  for o in outputs):
        return list(outputs)
    raise Error(f"{op}: the body must return a tensor or a list/tuple of tensors, got "
                f"{type(outputs).__name__}.")


class ControlFlowArgumentError(Error, ValueError):
    """A ``for_loop`` / ``cond`` argument of the wrong kind (a ``poptorch.Error`` and,
    as in PopTorch, a ``ValueError``)."""


def _refuse_in_training(op: str) -> None:
    """PopTorch compiles ``cond`` / ``for_loop`` for inference only: a training model
    that calls one fails (outside a PopTorch model both run as plain Python)."""
    if context.is_running_training():
        raise Error(f"poptorch.{op}() is only supported in inference. Wrap the model with "
                    f"poptorch.inferenceModel, or write the {op} as plain Python control "
                    "flow in a training model.")


def _check_inputs(inputs: object, op: str, name: str) -> list[torch.Tensor]:
    """PopTorch's rule: the inputs are a list (or tuple) of tensors."""
    if not isinstance(inputs, (list, tuple)):
        raise ControlFlowArgumentError(
            f"{op}: {name} must be a list of tensors (Object is not list), got "
            f"{type(inputs).__name__}; write [x] for a single tensor.")
    for index, tensor in enumerate(inputs):
        if not isinstance(tensor, torch.Tensor):
            raise ControlFlowArgumentError(
                f"{op}: {name}[{index}] must be a tensor, got {type(tensor).__name__} "
                f"(Object contained in list at index {index} is not torch.tensor).")
    return list(inputs)


def for_loop(count: int, body: Callable[..., object],
             inputs: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Run ``body`` ``count`` times, feeding each iteration's outputs to the next.

    ``inputs`` is a list of tensors (a bare tensor is refused, as upstream); ``body``
    takes as many tensors as it returns, with the same shapes and dtypes, and receives
    copies (in-place updates do not reach the caller's tensors). Returns the outputs of
    the last iteration as a list (copies of ``inputs`` when ``count`` is 0).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise Error(f"for_loop: count must be an int >= 0, got {count!r}.")
    # Inputs are passed by value, as upstream: in-place updates inside the body do not
    # reach the caller's tensors.
    state = [t.clone() for t in _check_inputs(inputs, "for_loop", "inputs")]
    _refuse_in_training("for_loop")
    for _ in range(count):
        outputs = _as_list(body(*state), "for_loop")
        if len(outputs) != len(state):
            raise Error(f"for_loop: the body takes {len(state)} inputs but returned "
                        f"{len(outputs)} outputs; it must return one output per input.")
        for index, (new, old) in enumerate(zip(outputs, state, strict=False)):
            if new.shape != old.shape or new.dtype != old.dtype:
                raise Error(f"for_loop: output {index} of the body has shape "
                            f"{tuple(new.shape)} and dtype {new.dtype}, but its input has "
                            f"shape {tuple(old.shape)} and dtype {old.dtype}.")
        state = outputs
    return state


def cond(condition: torch.Tensor, then_body: Callable[..., object],
         then_inps: list[torch.Tensor] | tuple[torch.Tensor, ...],
         else_body: Callable[..., object],
         else_inps: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Run ``then_body(*then_inps)`` if ``condition`` is true, else ``else_body(*else_inps)``.

    ``condition`` is a one-element boolean tensor. Both bodies must return the same
    number of tensors; the result is a list of them. Inputs are passed by value: to
    update a tensor, return its new value from the body.
    """
    if not isinstance(condition, torch.Tensor) or condition.numel() != 1:
        raise Error("cond: condition must be a one-element boolean tensor, got "
                    f"{condition!r}.")
    then_inps = _check_inputs(then_inps, "cond", "then_inps")
    else_inps = _check_inputs(else_inps, "cond", "else_inps")
    _refuse_in_training("cond")
    if torch.compiler.is_compiling():
        split = len(then_inps)
        return list(torch.cond(condition.reshape(()).bool(),
                               lambda *ops: tuple(_as_list(then_body(*ops[:split]), "cond")),
                               lambda *ops: tuple(_as_list(else_body(*ops[split:]), "cond")),
                               tuple(then_inps + else_inps)))
    # Inputs are passed by copy, as upstream does: in-place updates inside a body do
    # not reach the caller's tensors.
    if bool(condition.reshape(()).item()):
        return _as_list(then_body(*[t.clone() for t in then_inps]), "cond")
    return _as_list(else_body(*[t.clone() for t in else_inps]), "cond")
