"""Samplers behind :py:class:`poptorch.DataLoader`: per-process partitions of a data set
for distributed execution, and the grouping of a user's ``batch_sampler`` into combined
batches."""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from .errors import Error

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
    combined batch evenly); only the final combined batch of an epoch may differ, and it
    is kept (incomplete) unless ``drop_last``.
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
        if not groups[-1] or (self.drop_last and len(groups[-1]) < self.micro_batches):
            groups.pop()
        return groups

    def __iter__(self) -> Iterator[list[int]]:
        groups = self._groups()
        for number, group in enumerate(groups):
            sizes = {len(micro_batch) for micro_batch in group}
            if len(sizes) > 1 and number != len(groups) - 1:
                raise Error(
                    f"The batch_sampler gave micro-batches of sizes "
                    f"{[len(m) for m in group]} for one combined batch of "
                    f"{self.micro_batches} micro-batches (deviceIterations x "
                    "replicationFactor x gradientAccumulation); the model splits a "
                    "combined batch evenly, so they must all have the same size.")
        if self.num_processes > 1:
            groups = partition(groups, self.process_id, self.num_processes,
                               pad=not self.drop_last)
        for group in groups:
            yield [index for micro_batch in group for index in micro_batch]

    def __len__(self) -> int:
        full, rest = divmod(len(self.batch_sampler), self.micro_batches)
        total = full if self.drop_last or rest == 0 else full + 1
        if self.num_processes > 1:
            return (total // self.num_processes if self.drop_last
                    else math.ceil(total / self.num_processes))
        return total
