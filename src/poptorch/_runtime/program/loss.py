"""Which tensor of a training model's output is the loss.

PopTorch trains on the loss the model computes. In order of preference:

1. a tensor marked by :py:func:`poptorch.identity_loss` during the forward pass and
   returned by the model (several marked and returned losses are summed, except those
   that another marked loss is computed from: those are parts of the final loss);
2. the output itself, when the model returns a single 0-dim tensor;
3. in a returned tuple or list, a 0-dim tensor chosen in this order: one that
   depends on the parameters before one that does not (``(loss, accuracy)``), the last
   element before the first (the ``(output, loss)`` convention), then the last such
   element in between;
4. the ``"loss"`` entry of a returned mapping (a dict, or a dict-like output such as
   Hugging Face's ``ModelOutput``), or the ``loss`` attribute of another returned object
   (a PyTorch Geometric ``Data`` the model filled in), when it is a one-element tensor
   (named a loss).

Only 0-dim tensors count in rules 2 and 3: a reduced loss (``mean``, ``sum``, every
``torch.nn`` loss) is 0-dim whatever the batch size, while a prediction is not, even
when a micro-batch of one row makes it a one-element tensor. Whether a model has a loss
therefore never depends on the micro-batch size (a model that forgets its loss raises
"Couldn't find a loss" with one row as with two).

A loss that depends on no trainable parameter is accepted, as in PopTorch: its
gradients are zero (see ``DeviceProgram``).

A model that marks no loss must compute one final loss, as in PopTorch: two torch.nn
losses of which neither is computed from the other (``nll_loss(a) + mse_loss(b)``)
raise "Multiple independent losses found in graph" at its first call
(:py:func:`check_single_loss`); wrapping their combination in ``identity_loss`` is the
fix PopTorch asks for.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TypeGuard

import torch

from ..._typing import UserOutput
from ...errors import Error
from ..torch_internals import pytree

_NO_LOSS = (
    "Couldn't find a loss in graph: a training model must compute its loss: return the "
    "loss, or (output, loss), or mark it with poptorch.identity_loss(loss, reduction). "
    "This model returned {what}.")


class LossNeedsEager(Exception):
    """Raised by :py:func:`find_loss` inside a ``torch.compile`` capture (``traced``)
    when the choice needs the autograd graph, which a capture cannot read."""


# The autograd nodes of PyTorch's loss kernels (F.nll_loss / cross_entropy, mse_loss,
# binary_cross_entropy[_with_logits], smooth_l1 / huber, soft / multi margin, ctc):
# PopTorch makes each of these losses a loss of the graph, as identity_loss does.
_LOSS_NODES = frozenset({
    "NllLossBackward0", "NllLoss2DBackward0", "MseLossBackward0",
    "BinaryCrossEntropyBackward0", "BinaryCrossEntropyWithLogitsBackward0",
    "SmoothL1LossBackward0", "HuberLossBackward0", "SoftMarginLossBackward0",
    "MultiMarginLossBackward0", "MultilabelMarginLossBackward0", "CtcLossBackward0"})

_SEVERAL_LOSSES = (
    "Multiple independent losses found in graph. Graph must have one final loss. Wrap "
    "final graph loss in poptorch.identity_loss. This model computes {count} losses "
    "({names}) of which none is computed from the others: return "
    "poptorch.identity_loss(total, reduction='sum') of their combination instead.")


def check_single_loss(output: UserOutput) -> None:
    """As PopTorch, for a model that marks no loss with ``identity_loss``: its torch.nn
    losses (``_LOSS_NODES``) must form one final loss; two that are not computed one
    from the other (``loss_a + loss_b``, or both returned) raise ``poptorch.Error``."""
    losses = [node for node in autograd_nodes(
        t.grad_fn for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor))
        if type(node).__name__ in _LOSS_NODES]
    if len(losses) < 2:
        return
    below = _nodes_below(losses)  # nodes some loss is computed from
    final = [loss for loss in losses if loss not in below]
    if len(final) > 1:
        names = ", ".join(sorted({type(n).__name__.removesuffix("Backward0") for n in final}))
        raise Error(_SEVERAL_LOSSES.format(count=len(final), names=names))


def find_loss(output: UserOutput, marked: list, traced: bool = False,
              check: bool = False) -> torch.Tensor:
    """Return the loss tensor of one forward pass (see module docstring); ``check``:
    also apply PopTorch's one-final-loss rule (:py:func:`check_single_loss`) to a model
    that marks no loss (done once per model: the rule is about its graph)."""
    if check and not marked and not traced:
        check_single_loss(output)
    if marked:
        returned = {id(t) for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)}
        in_output = [t for t in marked if id(t) in returned]
        chosen = in_output or marked[-1:]
        if len(chosen) > 1:
            if traced:
                raise LossNeedsEager("several identity_loss values are returned")
            chosen = _final_losses(chosen)
        # reduction='none' leaves a tensor: back-propagate a gradient of ones (its sum)
        loss = chosen[0] if chosen[0].dim() == 0 else chosen[0].sum()
        for extra in chosen[1:]:
            loss = loss + extra.sum()
        return loss
    candidate = output
    if isinstance(output, (tuple, list)) and output:
        candidate = _tuple_loss(output)
    elif isinstance(output, Mapping):
        named = output.get("loss")
        if isinstance(named, torch.Tensor) and named.numel() == 1:
            return named.reshape(())
        return _raise_no_loss(output)
    elif not isinstance(output, torch.Tensor):
        named = getattr(output, "loss", None)
        if isinstance(named, torch.Tensor) and named.numel() == 1:
            return named.reshape(())
    if _is_scalar(candidate):
        return candidate
    return _raise_no_loss(output)


def _final_losses(losses: list) -> list:
    """The marked losses that no other marked loss is computed from (PopTorch keeps
    only these: an ``identity_loss`` used inside the final loss's expression is an
    ordinary value of that expression, even when the model returns it too)."""
    below = _nodes_below([t.grad_fn for t in losses if t.grad_fn is not None])
    return [t for t in losses if t.grad_fn is None or t.grad_fn not in below]


def _nodes_below(nodes: list) -> set:
    """The autograd nodes strictly below ``nodes`` (what they are computed from)."""
    return set(autograd_nodes(fn for node in nodes for fn, _ in node.next_functions))


def autograd_nodes(roots: Iterable) -> Iterator:
    """Every autograd node reachable from ``roots`` (``grad_fn`` values; None, the
    ``grad_fn`` of a tensor without history, is skipped), each once."""
    seen: set = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(fn for fn, _ in node.next_functions)


def _is_scalar(value: object) -> TypeGuard[torch.Tensor]:
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _tuple_loss(output: tuple | list) -> UserOutput:
    """The loss of a returned tuple or list (rule 3 of the module docstring)."""
    first, last = output[0], output[-1]

    def with_grad(v: object) -> bool:
        return _is_scalar(v) and v.requires_grad

    for candidate in (last, first):
        if with_grad(candidate):
            return candidate
    inner = [t for t in output if with_grad(t)]
    if inner:
        return inner[-1]
    for candidate in (last, first):
        if _is_scalar(candidate):
            return candidate
    return last


def _raise_no_loss(output: object) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        what = f"a tensor of shape {tuple(output.shape)} (not a 0-dim loss)"
    elif isinstance(output, (tuple, list)):
        what = (f"a {type(output).__name__} of {len(output)} elements none of which is a "
                "0-dim tensor")
    elif isinstance(output, Mapping):
        what = (f"a {type(output).__name__} with keys {list(output.keys())} and no scalar "
                "tensor under 'loss'")
    else:
        what = f"an object of type {type(output).__name__}"
    raise Error(_NO_LOSS.format(what=what))
