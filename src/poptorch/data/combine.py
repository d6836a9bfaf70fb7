"""Joining collated micro-batches into combined batches (a user's ``batch_sampler``).

With a ``batch_sampler`` the loader's ``collate_fn`` runs on each micro-batch (as
torch's DataLoader would for that sampler), so a ``collate_fn`` may pad or reshape it;
then ``deviceIterations x replicationFactor x gradientAccumulation`` consecutive collated
micro-batches are joined along dimension 0 into one combined batch. Joining follows the
batch's structure: tensors are concatenated, tuples / named tuples / lists / dicts and
types registered with ``poptorch.registerCustomArgParser`` (pytree nodes) are joined
field by field, lists of non-tensor values (``default_collate``'s strings) are
concatenated, and any other value must be the same in every micro-batch.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

import torch

from .._runtime.torch_internals import pytree
from .._typing import UserInput
from ..errors import Error

__all__ = ["Batches", "MicroBatchJoiner", "join"]


class Batches(Iterator[UserInput], Protocol):
    """Batches of one pass, and how many (torch's iterator, or the joiner below)."""

    def __len__(self) -> int: ...


def _rows(batch: UserInput) -> int | None:
    """Dimension 0 of the first tensor of a collated micro-batch (None: no tensor)."""
    leaves = pytree.tree_leaves(batch)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    return None


def join(parts: list[UserInput]) -> UserInput:
    """The micro-batches ``parts`` joined into one batch (see the module docstring)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(p, torch.Tensor) and p.dim() > 0 for p in parts):
            raise Error("Joining micro-batches into a combined batch needs tensors with "
                        "a batch dimension in the same place of every micro-batch; got "
                        f"{[type(p).__name__ for p in parts]}.")
        return torch.cat(parts)
    kind = type(first)
    if any(type(p) is not kind for p in parts):
        raise Error("The micro-batches of one combined batch have different structures: "
                    f"{[type(p).__name__ for p in parts]}.")
    if kind is list and not any(isinstance(leaf, torch.Tensor)
                                for p in parts for leaf in pytree.tree_leaves(p)):
        return [value for p in parts for value in p]
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return kind(*(join(list(column)) for column in zip(*parts, strict=False)))
    if isinstance(first, (tuple, list)):
        if len({len(p) for p in parts}) != 1:
            raise Error("The micro-batches of one combined batch have different "
                        f"lengths: {[len(p) for p in parts]}.")
        return kind(join(list(column)) for column in zip(*parts, strict=False))
    if isinstance(first, Mapping):
        keys = list(first.keys())
        if any(list(p.keys()) != keys for p in parts):
            raise Error("The micro-batches of one combined batch have different keys: "
                        f"{[list(p.keys()) for p in parts]}.")
        return kind((key, join([p[key] for p in parts])) for key in keys)
    node = pytree.SUPPORTED_NODES.get(kind)
    if node is not None:  # e.g. a type registered with poptorch.registerCustomArgParser
        flat = [node.flatten_fn(p) for p in parts]
        children = [join(list(column)) for column in zip(*(f[0] for f in flat), strict=False)]
        return node.unflatten_fn(children, flat[0][1])
    if all(p is first or p == first for p in parts[1:]):
        return first
    raise Error("Joining micro-batches into a combined batch: a value of type "
                f"{kind.__name__} differs between micro-batches and is not a tensor; "
                "return tensors (or register the type with "
                "poptorch.registerCustomArgParser).")


class MicroBatchJoiner:
    """Iterates combined batches made of ``micro_batches`` consecutive collated
    micro-batches from ``inner`` (one pass of torch's iterator).

    With several micro-batches per combined batch, every micro-batch must have the rows
    (dimension 0) of the pass's first one, except the pass's very last micro-batch, which
    may be shorter. A final combined batch with fewer micro-batches or a short
    micro-batch is incomplete and is dropped when ``drop_last``. With one micro-batch per
    combined batch the micro-batches pass unchanged (any sizes, as torch gives them);
    ``drop_short_last`` drops the last one (a torch ``BatchSampler(drop_last=False)``
    whose last batch is short, under ``drop_last=True``).
    """

    def __init__(self, inner: Iterable[UserInput], micro_batches: int, drop_last: bool,
                 combined_len: int | None = None, drop_short_last: bool = False) -> None:
        self._inner = iter(inner)
        self._micro_batches = micro_batches
        self._drop_last = drop_last
        self._combined_len = combined_len
        self._drop_short_last = drop_short_last
        self._full_rows: int | None = None
        self._short_seen = False  # a short micro-batch was read: it must be the last
        self._pending: UserInput = None  # one micro-batch read ahead (micro_batches == 1)
        self._has_pending = False

    def __iter__(self) -> MicroBatchJoiner:
        return self

    def __len__(self) -> int:
        if self._combined_len is None:
            raise TypeError("The batch_sampler of this loader has no len().")
        return self._combined_len

    def __next__(self) -> UserInput:
        if self._micro_batches == 1:
            return self._next_single()
        parts: list[UserInput] = []
        for micro_batch in self._inner:
            self._check_rows(micro_batch, parts)
            parts.append(micro_batch)
            if len(parts) == self._micro_batches:
                break
        if not parts:
            raise StopIteration
        incomplete = len(parts) < self._micro_batches or self._short_seen
        if incomplete and self._drop_last:
            raise StopIteration
        return join(parts)

    def _next_single(self) -> UserInput:
        if not self._drop_short_last:
            return next(self._inner)
        if not self._has_pending:  # read one ahead to know which one is the last
            self._pending, self._has_pending = next(self._inner), True
        try:
            following = next(self._inner)
        except StopIteration:
            self._has_pending = False
            raise
        current, self._pending = self._pending, following
        return current

    def _check_rows(self, micro_batch: UserInput, parts: list[UserInput]) -> None:
        rows = _rows(micro_batch)
        if rows is None:
            return
        if self._short_seen:
            raise Error(self._uneven_message(
                f"a micro-batch of {self._full_rows} rows was followed by more data "
                "after a shorter one"))
        if self._full_rows is None:
            self._full_rows = rows
        elif rows > self._full_rows:
            raise Error(self._uneven_message(
                f"got {rows} rows after micro-batches of {self._full_rows} "
                f"(in a combined batch of {len(parts) + 1} so far)"))
        elif rows < self._full_rows:
            self._short_seen = True

    def _uneven_message(self, what: str) -> str:
        return ("The batch_sampler (after collate_fn) gave micro-batches of different "
                f"sizes for combined batches of {self._micro_batches} micro-batches "
                f"(deviceIterations x replicationFactor x gradientAccumulation): {what}. "
                "The model splits a combined batch evenly, so they must all have the "
                "same size (only the epoch's last micro-batch may be smaller): pad them "
                "in collate_fn or make the batch_sampler's batches equal.")
