"""Samplers behind :py:class:`poptorch.DataLoader`: per-process partitions of a data set
for distributed execution, and the grouping of a user's ``batch_sampler`` into combined
batches."""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, TypeVar

import torch
from torch.utils.data import Sampler

__all__ = ["CombinedBatchSampler", "DistributedPartitionSampler", "partition"]


def _share(total: int, num_processes: int, step: int) -> int:
    return step * (total // (step * num_processes))


T = TypeVar("T")


class BatchIndices(Protocol):
    """A batch sampler: micro-batches of data-set indices, and how many."""

    def __iter__(self) -> Iterator[list[int]]: ...
    def __len__(self) -> int: ...


def partition(items: Sequence[T], process_id: int, num_processes: int,
              pad: bool, step: int = 1) -> list[T]:
    """The contiguous share of ``items`` that process ``process_id`` reads.

    Every process gets the same number of items: the largest multiple of ``step`` (the
    combined batch size) not above ``len(items) / num_processes``, so that process k
    reads items ``[k * share, (k + 1) * share)`` and every share is whole combined
    batches (the rest is not read), or with ``pad`` ``ceil(len(items) / num_processes)``,
    the last shares wrapping round to the start so that every item is read at least once.
    """
    total = len(items)
    share = math.ceil(total / num_processes) if pad else \
        _share(total, num_processes, step)
    start = process_id * share
    return [items[(start + i) % total] for i in range(share)] if total else []


class DistributedPartitionSampler(Sampler[int]):
    """Indices of one process's share of a map-style data set.

    With ``shuffle`` every process draws the same permutation of the whole data set
    (from ``seed`` and the epoch number, so the seed must be the same on every process)
    and takes its share of it; a new permutation is drawn at each epoch.
    """

    def __init__(self, length: int, process_id: int, num_processes: int, shuffle: bool,
                 seed: int | None, pad: bool, step: int = 1) -> None:
        self.length = length
        self.step = step
        self.process_id = process_id
        self.num_processes = num_processes
        self.shuffle = shuffle
        self.seed = seed
        self.pad = pad
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            seed = (int(self.seed or 0) + self.epoch) % 2**64
            generator = torch.Generator().manual_seed(seed)
            order = torch.randperm(self.length, generator=generator).tolist()
        else:
            order = list(range(self.length))
        self.epoch += 1
        return iter(partition(order, self.process_id, self.num_processes, self.pad,
                              self.step))

    def __len__(self) -> int:
        if self.pad:
            return math.ceil(self.length / self.num_processes)
        return _share(self.length, self.num_processes, self.step)


class CombinedBatchSampler(Sampler[list[int]]):
    """The micro-batches (index lists of a user's ``batch_sampler``) that this process
    reads, in groups of ``micro_batches``: each group becomes one combined batch once its
    micro-batches are collated and joined (see ``combine``).

    Groups are shared between processes as items are (contiguous shares). The final group
    of an epoch is *incomplete* when it has fewer micro-batches than a combined batch
    needs; ``drop_last`` drops it here. (A final group whose last micro-batch is short is
    incomplete too: the joiner drops it after collation, where a padding ``collate_fn``
    may have made it whole.)
    """

    def __init__(self, batch_sampler: BatchIndices, micro_batches: int, drop_last: bool,
                 process_id: int = 0, num_processes: int = 1) -> None:
        self.batch_sampler = batch_sampler
        self.micro_batches = micro_batches
        self.drop_last = drop_last
        self.process_id = process_id
        self.num_processes = num_processes

    def _groups(self) -> Iterator[list[list[int]]]:
        group: list[list[int]] = []
        for micro_batch in self.batch_sampler:
            group.append(micro_batch)
            if len(group) == self.micro_batches:
                yield group
                group = []
        if group and not self.drop_last:
            yield group

    def __iter__(self) -> Iterator[list[int]]:
        groups: Iterable[list[list[int]]] = self._groups()
        if self.num_processes > 1:
            groups = partition(list(groups), self.process_id, self.num_processes,
                               pad=not self.drop_last)
        for group in groups:
            yield from group

    def __len__(self) -> int:
        """Micro-batches per epoch (torch's iterator reads them one by one)."""
        total = len(self.batch_sampler)
        if self.num_processes == 1:
            return total if not self.drop_last else \
                total - total % self.micro_batches
        groups = self._group_count(total, complete_only=False)
        share = (groups // self.num_processes if self.drop_last
                 else math.ceil(groups / self.num_processes))
        return share * self.micro_batches  # an upper bound when the last is partial

    def combined_len(self) -> int:
        """Combined batches per epoch (``len()`` of the loader)."""
        total = len(self.batch_sampler)
        groups = self._group_count(total, complete_only=self.drop_last)
        if self.drop_last and total % self.micro_batches == 0 and \
                self._last_micro_batch_is_short():
            groups -= 1
        if self.num_processes > 1:
            return (groups // self.num_processes if self.drop_last
                    else math.ceil(groups / self.num_processes))
        return groups

    def _group_count(self, micro_batches: int, complete_only: bool) -> int:
        full, rest = divmod(micro_batches, self.micro_batches)
        return full if complete_only or rest == 0 else full + 1

    def _last_micro_batch_is_short(self) -> bool:
        """True when a torch-style batch sampler (``batch_size``, ``drop_last`` and
        ``sampler`` attributes) ends with a smaller micro-batch."""
        sampler = self.batch_sampler
        size = getattr(sampler, "batch_size", None)
        if getattr(sampler, "drop_last", True) or not isinstance(size, int):
            return False
        try:
            return len(getattr(sampler, "sampler", None)) % size != 0  # type: ignore[arg-type]  # (no len: TypeError)
        except (AttributeError, TypeError):
            return False
