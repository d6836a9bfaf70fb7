"""Samplers behind :py:class:`poptorch.DataLoader`: per-process partitions of a data set
for distributed execution, and the grouping of a user's ``batch_sampler`` into combined
batches."""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from ..errors import Error

__all__ = ["partition", "DistributedPartitionSampler", "CombinedBatchSampler"]


def partition(items: Sequence[Any], process_id: int, num_processes: int,
              pad: bool) -> list[Any]:
    """The contiguous share of ``items`` that process ``process_id`` reads.

    Every process gets the same number of items: ``len(items) // num_processes`` (the
    few left over are not read), or with ``pad`` ``ceil(len(items) / num_processes)``,
    the last shares wrapping round to the start so that every item is read at least once.
    """
    total = len(items)
    share = math.ceil(total / num_processes) if pad else total // num_processes
    start = process_id * share
    return [items[(start + i) % total] for i in range(share)] if total else []


class DistributedPartitionSampler(Sampler[int]):
    """Indices of one process's share of a map-style data set.

    With ``shuffle`` every process draws the same permutation of the whole data set
    (from ``seed`` and the epoch number, so the seed must be the same on every process)
    and takes its share of it; a new permutation is drawn at each epoch.
    """

    def __init__(self, length: int, process_id: int, num_processes: int, shuffle: bool,
                 seed: int | None, pad: bool) -> None:
        self.length = length
        self.process_id = process_id
        self.num_processes = num_processes
        self.shuffle = shuffle
        self.seed = seed
        self.pad = pad
        self.epoch = 0

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            seed = (int(self.seed) + self.epoch) % 2**64
            generator = torch.Generator().manual_seed(seed)
            order = torch.randperm(self.length, generator=generator).tolist()
        else:
            order = list(range(self.length))
        self.epoch += 1
        return iter(partition(order, self.process_id, self.num_processes, self.pad))

    def __len__(self) -> int:
        if self.pad:
            return math.ceil(self.length / self.num_processes)
        return self.length // self.num_processes


class CombinedBatchSampler(Sampler[list[int]]):
    """Joins ``micro_batches`` consecutive index batches of a user's ``batch_sampler``
    into the indices of one combined batch, and gives each process its share of them.

    The micro-batches of a combined batch must have the same size (the model splits the
    combined batch evenly); only the final combined batch of an epoch may differ. It is
    incomplete when it has fewer micro-batches or fewer rows than the first, and then
    dropped if ``drop_last``.
    """

    def __init__(self, batch_sampler: Any, micro_batches: int, drop_last: bool,
                 process_id: int = 0, num_processes: int = 1) -> None:
        self.batch_sampler = batch_sampler
        self.micro_batches = micro_batches
        self.drop_last = drop_last
        self.process_id = process_id
        self.num_processes = num_processes

    def _groups(self) -> list[list[list[int]]]:
        groups: list[list[list[int]]] = [[]]
        for micro_batch in self.batch_sampler:
            if len(groups[-1]) == self.micro_batches:
                groups.append([])
            groups[-1].append(list(micro_batch))
        for group in groups[:-1]:
            if len({len(micro_batch) for micro_batch in group}) > 1:
                raise Error(
                    f"The batch_sampler gave micro-batches of sizes "
                    f"{[len(m) for m in group]} for one combined batch of "
                    f"{self.micro_batches} micro-batches (deviceIterations x "
                    "replicationFactor x gradientAccumulation); the model splits a "
                    "combined batch evenly, so they must all have the same size.")
        last = groups[-1]
        if not last or (self.drop_last and (len(last) < self.micro_batches
                                            or _rows(last) < _rows(groups[0]))):
            groups.pop()
        return groups

    def __iter__(self) -> Iterator[list[int]]:
        groups = self._groups()
        if self.num_processes > 1:
            groups = partition(groups, self.process_id, self.num_processes,
                               pad=not self.drop_last)
        for group in groups:
            yield [index for micro_batch in group for index in micro_batch]

    def __len__(self) -> int:
        micro_batches = len(self.batch_sampler)
        full, rest = divmod(micro_batches, self.micro_batches)
        if rest == 0 and self.drop_last and self._last_micro_batch_is_short():
            full -= 1
        total = full if self.drop_last or rest == 0 else full + 1
        if self.num_processes > 1:
            return (total // self.num_processes if self.drop_last
                    else math.ceil(total / self.num_processes))
        return total

    def _last_micro_batch_is_short(self) -> bool:
        """True when a torch-style batch sampler (``batch_size``, ``drop_last`` and
        ``sampler`` attributes) ends with a smaller micro-batch."""
        sampler = self.batch_sampler
        size = getattr(sampler, "batch_size", None)
        if getattr(sampler, "drop_last", True) or not isinstance(size, int):
            return False
        try:
            return len(sampler.sampler) % size != 0
        except (AttributeError, TypeError):
            return False


def _rows(group: list[list[int]]) -> int:
    return sum(len(micro_batch) for micro_batch in group)
