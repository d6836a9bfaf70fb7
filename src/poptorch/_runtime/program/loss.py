"""Which tensor of a training model's output is the loss.

PopTorch trains on the loss the model computes. In order of preference:

1. a tensor marked by :py:func:`poptorch.identity_loss` during the forward pass and
   returned by the model (several marked and returned losses are summed);
2. the output itself, when the model returns a single tensor with one element;
3. in a returned tuple or list, a one-element tensor chosen in this order: one that
   depends on the parameters before one that does not (``(loss, accuracy)``), a 0-dim
   tensor before a one-element one (Hugging Face's ``(loss, logits, ...)`` with a
   single-row ``logits``), the last element before the first (the ``(output, loss)``
   convention), then the last such element in between;
4. the ``"loss"`` entry of a returned mapping (a dict, or a dict-like output such as
   Hugging Face's ``ModelOutput``), when it is a one-element tensor.

A loss that depends on no trainable parameter is accepted, as in PopTorch: its
gradients are zero (see ``DeviceProgram``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...errors import Error

_NO_LOSS = (
    "Couldn't find a loss in graph: a training model must compute its loss: return the loss, or (output, loss), or "
    "mark it with poptorch.identity_loss(loss, reduction). This model returned {what}.")


def find_loss(output: Any, marked: list) -> torch.Tensor:
    """Return the loss tensor of one forward pass (see module docstring)."""
    if marked:
        returned = {id(t) for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)}
        in_output = [t for t in marked if id(t) in returned]
        chosen = in_output or marked[-1:]
        # reduction='none' leaves a tensor: back-propagate a gradient of ones (its sum)
        loss = chosen[0] if chosen[0].dim() == 0 else chosen[0].sum()
        for extra in chosen[1:]:
            loss = loss + extra.sum()
        return loss
    candidate = output
    if isinstance(output, (tuple, list)) and output:
        candidate = _tuple_loss(output)
    elif isinstance(output, Mapping):
        candidate = output.get("loss")
    if _is_scalar(candidate):
        return candidate if candidate.dim() == 0 else candidate.reshape(())
    return _raise_no_loss(output)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1


def _tuple_loss(output: Any) -> Any:
    """The loss of a returned tuple or list (rule 3 of the module docstring)."""
    first, last = output[0], output[-1]

    def with_grad(v: Any) -> bool:
        return _is_scalar(v) and v.requires_grad

    for test in (lambda v: with_grad(v) and v.dim() == 0, with_grad):
        for candidate in (last, first):
            if test(candidate):
                return candidate
    inner = [t for t in output if with_grad(t)]
    if inner:
        return inner[-1]
    for test in (lambda v: _is_scalar(v) and v.dim() == 0, _is_scalar):
        for candidate in (last, first):
            if test(candidate):
                return candidate
    return last


def _raise_no_loss(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        what = f"a tensor of shape {tuple(output.shape)} (not a scalar)"
    elif isinstance(output, (tuple, list)):
        what = (f"a {type(output).__name__} of {len(output)} elements whose first and last "
                "are not scalar tensors")
    elif isinstance(output, Mapping):
        what = (f"a {type(output).__name__} with keys {list(output.keys())} and no scalar "
                "tensor under 'loss'")
    else:
        what = f"an object of type {type(output).__name__}"
    raise Error(_NO_LOSS.format(what=what))
