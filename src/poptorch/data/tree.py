"""Batches as trees: split a batch into its tensors and a picklable skeleton, and back.

The asynchronous loader moves only the tensors of a batch through shared memory; the rest
of the batch (its nesting of tuples, lists, dicts and named tuples, and any non-tensor
values) travels as a small pickled *skeleton* in which every tensor is replaced by a
:class:`TensorRef` holding its position in the flat list of tensors.
"""
from __future__ import annotations

from collections.abc import Hashable

import torch

from .._runtime.batching.structures import register_mapping_outputs
from .._runtime.torch_internals import pytree
from .._typing import UserInput
from ..errors import Error

__all__ = ["Rebatcher", "Skeleton", "TensorRef", "flatten", "flatten_keyed", "unflatten"]

# A user's batch with each tensor replaced by a TensorRef: of the batch's own structure.
Skeleton = UserInput


class TensorRef(int):
    """Position of a tensor in the flat tensor list of a batch skeleton."""

    def __repr__(self) -> str:
        return f"TensorRef({int(self)})"

    def __reduce__(self) -> tuple[type[TensorRef], tuple[int]]:
        return (TensorRef, (int(self),))


def flatten(batch: UserInput) -> tuple[Skeleton, list[torch.Tensor]]:
    """Returns ``(skeleton, tensors)``: ``batch`` with each tensor replaced by a
    :class:`TensorRef`, and the tensors in depth-first order (``torch.utils._pytree``'s
    order; dict-like classes it does not know are registered first, see
    ``_runtime/batching/structures.py``)."""
    register_mapping_outputs(batch)
    leaves, spec = pytree.tree_flatten(batch)
    tensors: list[torch.Tensor] = []
    skeleton_leaves = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            skeleton_leaves.append(TensorRef(len(tensors)))
            tensors.append(leaf.detach())
        else:
            skeleton_leaves.append(leaf)
    return pytree.tree_unflatten(skeleton_leaves, spec), tensors


_SHAPES: dict[Hashable, Skeleton] = {}  # key -> skeleton of the common batch structures


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach() if tensor.requires_grad else tensor


def flatten_keyed(batch: UserInput) -> tuple[Skeleton, list[torch.Tensor], Hashable | None]:
    """:func:`flatten`, plus a hashable *key* equal for two batches exactly when their
    skeletons are equal (None when that is not cheap to know: then the skeleton must be
    sent). Fast paths for a tensor, and a tuple, list or dict of tensors (what
    ``default_collate`` makes of most data sets): no tree walk, a cached skeleton."""
    kind = type(batch)
    key: Hashable
    if kind is torch.Tensor:
        return TensorRef(0), [_plain(batch)], kind
    if kind is tuple or kind is list:
        if all(type(value) is torch.Tensor for value in batch):
            key = (kind, len(batch))
            skeleton = _SHAPES.get(key)
            if skeleton is None:
                skeleton = _SHAPES[key] = kind(TensorRef(i) for i in range(len(batch)))
            return skeleton, [_plain(value) for value in batch], key
    elif kind is dict and all(type(value) is torch.Tensor for value in batch.values()):
        key = (kind, tuple(batch))
        skeleton = _SHAPES.get(key)
        if skeleton is None:
            if len(_SHAPES) > 256:
                _SHAPES.clear()
            skeleton = _SHAPES[key] = {name: TensorRef(i)
                                       for i, name in enumerate(batch)}
        return skeleton, [_plain(value) for value in batch.values()], key
    skeleton, tensors = flatten(batch)
    return skeleton, tensors, None


def unflatten(skeleton: Skeleton, tensors: list[torch.Tensor]) -> UserInput:
    """Inverse of :func:`flatten`."""
    kind = type(skeleton)
    if kind is tuple and all(type(ref) is TensorRef for ref in skeleton):
        return tuple(tensors[int(ref)] for ref in skeleton)  # (the common case, fast)
    if isinstance(skeleton, TensorRef):
        return tensors[int(skeleton)]
    register_mapping_outputs(skeleton)  # (a class first seen in this process)
    return pytree.tree_map(
        lambda leaf: tensors[int(leaf)] if isinstance(leaf, TensorRef) else leaf, skeleton)


class Rebatcher:
    """Concatenates incoming batches along dimension 0 and cuts them into batches of
    exactly ``size`` rows (the last one may be smaller, see :meth:`flush`).

    Every leaf of the incoming batches must be a tensor with a batch dimension, and all
    batches must share one structure: rebatching cannot merge other values.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._skeleton: Skeleton = None
        self._pending: list[list[torch.Tensor]] = []
        self._rows = 0

    def push(self, batch: UserInput) -> list[UserInput]:
        """Adds ``batch``; returns the complete batches it made available."""
        skeleton, tensors = flatten(batch)
        self._check(skeleton, tensors)
        if tensors[0].shape[0] == 0:
            return []
        self._pending.append(tensors)
        self._rows += tensors[0].shape[0]
        ready = []
        while self._rows >= self.size:
            ready.append(self._take(self.size))
        return ready

    def flush(self, drop_last: bool) -> list[UserInput]:
        """Ends an epoch: returns the leftover rows as one smaller batch unless
        ``drop_last``, and forgets them either way."""
        leftover = [] if drop_last or self._rows == 0 else [self._take(self._rows)]
        self._pending, self._rows, self._skeleton = [], 0, None
        return leftover

    def _take(self, rows: int) -> UserInput:
        columns = [torch.cat(parts) for parts in zip(*self._pending, strict=False)]
        taken = [column[:rows] for column in columns]
        rest = [column[rows:] for column in columns]
        self._rows -= rows
        self._pending = [rest] if self._rows else []
        return unflatten(self._skeleton, taken)

    def _check(self, skeleton: Skeleton, tensors: list[torch.Tensor]) -> None:
        if not tensors or _has_non_tensor_leaf(skeleton):
            raise Error(
                "Rebatching (DataLoaderMode.AsyncRebatched or rebatched_size) needs every "
                "value of a batch to be a tensor with a batch dimension; got a batch of "
                f"structure {skeleton!r}. Return tensors from the data set, or use "
                "DataLoaderMode.Async.")
        rows = {t.shape[0] if t.dim() else None for t in tensors}
        if len(rows) != 1 or None in rows:
            raise Error(
                "Rebatching needs all tensors of a batch to have the same size in "
                f"dimension 0; got shapes {[tuple(t.shape) for t in tensors]}.")
        if self._skeleton is None:
            self._skeleton = skeleton
        elif skeleton != self._skeleton:
            raise Error(
                "Rebatching needs every batch to have the same structure; got "
                f"{skeleton!r} after {self._skeleton!r}.")


def _has_non_tensor_leaf(skeleton: Skeleton) -> bool:
    return any(not isinstance(leaf, TensorRef) for leaf in pytree.tree_leaves(skeleton))
