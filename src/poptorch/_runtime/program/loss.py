"""Which tensor of a training model's output is the loss.

PopTorch trains on the loss the model computes. In order of preference:

1. a tensor marked by :py:func:`poptorch.identity_loss` during the forward pass and
   returned by the model (several marked and returned losses are summed);
2. the output itself, when the model returns a single tensor with one element;
3. the last element of a returned tuple or list, when it is a one-element tensor
   (the ``(output, loss)`` convention), else its first element, when that is one
   (Hugging Face's ``(loss, logits, ...)`` convention);
4. the ``"loss"`` entry of a returned mapping (a dict, or a dict-like output such as
   Hugging Face's ``ModelOutput``), when it is a one-element tensor.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...errors import Error

_NO_LOSS = (
    "A training model must compute its loss: return the loss, or (output, loss), or "
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
        candidate = output[-1]
        if not _is_scalar(candidate) and _is_scalar(output[0]):
            candidate = output[0]
    elif isinstance(output, Mapping):
        candidate = output.get("loss")
    if isinstance(candidate, torch.Tensor) and candidate.numel() == 1:
        if not candidate.requires_grad:
            raise Error(
                "The loss returned by the training model does not depend on any trainable "
                "parameter (it has no gradient): check that the model's parameters have "
                "requires_grad=True and that the loss is computed from the model's output.")
        return candidate if candidate.dim() == 0 else candidate.reshape(())
    return _raise_no_loss(output)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1


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
