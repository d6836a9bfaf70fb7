"""``poptorch.DataLoader``: a ``torch.utils.data.DataLoader`` whose batches hold the data
of one call of a PopTorch model, and ``AsynchronousDataAccessor``.

One call of a model consumes a *combined batch* of
``batch_size x deviceIterations x replicationFactor x gradientAccumulation`` items; the
loader yields batches of that size (see ``docs/data.md``). With
``Options.Distributed`` (several processes) each process reads its own share of the data
set, and every process gets the same number of batches.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.utils.data

from .accessor import AsynchronousDataAccessor
from .samplers import CombinedBatchSampler, DistributedPartitionSampler
from .._runtime.distributed.world import shared_random_seed
from .._logging import info_once
from ..enums import DataLoaderMode
from ..errors import Error

__all__ = ["DataLoader", "AsynchronousDataAccessor"]

_ASYNC_OPTIONS = {"buffer_size", "miss_sleep_time_in_ms", "load_indefinitely",
                  "early_preload", "sharing_strategy", "rebatched_size"}


class _SyncView:
    """Iterates a ``poptorch.DataLoader`` synchronously: what the asynchronous worker
    process reads (whatever the loader's own mode)."""

    def __init__(self, loader: "DataLoader") -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        self.rebatched_drop_last = loader.rebatched_drop_last

    def __iter__(self):
        return torch.utils.data.DataLoader.__iter__(self.loader)

    def __len__(self) -> int:
        return torch.utils.data.DataLoader.__len__(self.loader)


def _read_options(options: Any) -> tuple[int, int, int, int, int, int | None]:
    """``(deviceIterations, replicationFactor, gradientAccumulation, process id,
    process count, random seed or None)`` from a ``poptorch.Options``."""
    try:
        seed = options.random_seed if options.exists("random_seed") else None
        # Replicas of one input group (inputReplicaGrouping) read the same micro-batch:
        # a call consumes micro-batches for replication_factor / input_group_size of them.
        reading_replicas = options.replication_factor // max(1, options.input_group_size)
        return (options.device_iterations, reading_replicas,
                options.Training.gradient_accumulation, options.Distributed.processId,
                options.Distributed.numProcesses, seed)
    except AttributeError:
        raise TypeError(
            "poptorch.DataLoader needs a poptorch.Options as its first argument, as in "
            "poptorch.DataLoader(poptorch.Options(), dataset, batch_size=...); got "
            f"{type(options).__name__}.") from None


class DataLoader(torch.utils.data.DataLoader):
    """Thin wrapper around the traditional `torch.utils.data.DataLoader` to
    abstract away some of the batch sizes calculations.

    Each batch holds ``combinedBatchSize = batch_size x deviceIterations x
    replicationFactor x gradientAccumulation`` items: the data of one call of a model
    compiled with the same options.

    If this data loader is used in a distributed execution environment, it will
    ensure that each process uses a different subset of the dataset, providing
    you first call ``options.randomSeed(N)`` with an integer N which is the same
    across all hosts (needed only with ``shuffle=True``).

    Args:
        options: Options that will be used to compile and run the model.
        dataset: The dataset to get the data from (map-style or iterable).
        batch_size: This is the batch size in the conventional sense of being the size
            that runs through an operation in the model at any given time
            (the micro-batch size).
        shuffle: Whether or not the dataset should be shuffled. Reproducible from
            ``options.randomSeed`` when it is set.
        num_workers: Number of worker processes to use to read the data.
        drop_last: If True and the number of elements in the dataset is not a multiple
            of the combined batch size then the incomplete batch at the end will be
            dropped. If False it is returned with fewer rows.
        persistent_workers: Re-use workers between iterations if True (default: True
            when ``num_workers > 0``).
        auto_distributed_partitioning: If True, partitions the dataset for distributed
            execution automatically. Otherwise, it is assumed that partitioning has been
            handled manually.
        mode: ``DataLoaderMode.Sync`` reads the data set in the calling process;
            ``Async`` uses an :py:class:`AsynchronousDataAccessor`; ``AsyncRebatched``
            also builds the combined batches in the accessor from smaller worker
            batches so that iterable data sets lose no data across workers.
        async_options: Keyword arguments for the :py:class:`AsynchronousDataAccessor`.
        rebatched_worker_size: When using AsyncRebatched: batch size of the tensors
            loaded by the workers. Default to the combined batch size. If specified the
            ``rebatched_worker_size`` must be less than or equal to the combined batch
            size.
        batch_sampler: Defines the strategy to draw samples from the dataset. Returns a
            batch of indices (one micro-batch) at a time; consecutive micro-batches are
            joined into combined batches. Mutually exclusive with ``batch_size``,
            ``shuffle`` and ``sampler``.
        kwargs: Other options to pass to PyTorch's ``DataLoader`` constructor.
    """

    def __init__(self, options: Any, dataset: torch.utils.data.Dataset,
                 batch_size: int = 1, shuffle: bool | None = None, num_workers: int = 0,
                 drop_last: bool = True, persistent_workers: bool | None = None,
                 auto_distributed_partitioning: bool = True,
                 mode: DataLoaderMode = DataLoaderMode.Sync,
                 async_options: dict[str, Any] | None = None,
                 rebatched_worker_size: int | None = None, batch_sampler: Any = None,
                 **kwargs: Any) -> None:
        (device_iterations, replication_factor, gradient_accumulation, process_id,
         num_processes, seed) = _read_options(options)
        try:
            mode = DataLoaderMode(mode)
        except ValueError:
            raise ValueError(f"mode must be a poptorch.DataLoaderMode; got {mode!r}.") \
                from None
        shuffle = bool(shuffle)
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        micro_batches = device_iterations * replication_factor * gradient_accumulation
        factors = (device_iterations, replication_factor, gradient_accumulation)
        distributed = num_processes > 1 and auto_distributed_partitioning
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        rebatch = mode == DataLoaderMode.AsyncRebatched and iterable
        self.batch_sampler_drop_last = drop_last
        self.rebatched_drop_last = drop_last
        loader_args: dict[str, Any] = {}

        if batch_sampler is not None:
            self._check_batch_sampler_args(batch_size, shuffle, iterable, kwargs)
            micro = getattr(batch_sampler, "batch_size", None)
            self._combined_batch_size = (micro * micro_batches
                                         if isinstance(micro, int) else None)
            loader_args["batch_sampler"] = CombinedBatchSampler(
                batch_sampler, micro_batches, drop_last, process_id,
                num_processes if distributed else 1)
        else:
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) \
                    or batch_size < 1:
                raise ValueError("poptorch.DataLoader needs an integer batch_size >= 1 "
                                 f"(the micro-batch size); got {batch_size!r}.")
            combined = batch_size * micro_batches
            self._combined_batch_size = combined
            loader_batch, loader_drop_last = combined, drop_last
            if iterable:
                if distributed:
                    raise Error(
                        "auto_distributed_partitioning is not supported for an "
                        "IterableDataset: each process would read the whole data set. "
                        "Read only this process's share in your __iter__ (use "
                        "options.Distributed.processId and numProcesses) and pass "
                        "auto_distributed_partitioning=False.")
                if rebatch:
                    loader_batch = self._worker_batch_size(rebatched_worker_size,
                                                           combined)
                    loader_drop_last = False  # the accessor drops (or keeps) the tail
                items = _length_or_none(dataset)
            else:
                items = len(dataset)
                sampler = self._make_sampler(items, shuffle, seed, drop_last,
                                             process_id, num_processes, distributed,
                                             kwargs)
                if sampler is not None:
                    loader_args["sampler"] = sampler
                    items = len(sampler)
                elif shuffle:
                    loader_args["shuffle"] = True
                    if seed is not None and "generator" not in kwargs:
                        loader_args["generator"] = torch.Generator().manual_seed(seed)
            if rebatched_worker_size is not None and not rebatch:
                info_once("dataloader_rebatched_worker_size",
                          "poptorch.DataLoader: rebatched_worker_size only applies to an "
                          "IterableDataset in DataLoaderMode.AsyncRebatched; ignored here.")
            if items is not None and drop_last and items < combined:
                raise Error(_too_small_message(items, batch_size, factors,
                                               num_processes if distributed else 1))
            loader_args.update(batch_size=loader_batch, drop_last=loader_drop_last)

        super().__init__(dataset, num_workers=num_workers,
                         persistent_workers=persistent_workers, **loader_args, **kwargs)
        self._options = options
        self._mode = mode
        self._rebatch = rebatch
        self._accessor: AsynchronousDataAccessor | None = None
        if mode != DataLoaderMode.Sync:
            accessor_args = dict(async_options or {})
            if rebatch:
                if "rebatched_size" in accessor_args:
                    raise ValueError("async_options must not set rebatched_size with "
                                     "DataLoaderMode.AsyncRebatched: the combined batch "
                                     "size is used.")
                accessor_args["rebatched_size"] = self._combined_batch_size
            unknown = set(accessor_args) - _ASYNC_OPTIONS
            if unknown:
                raise TypeError(f"Unknown async_options {sorted(unknown)}: they are "
                                "AsynchronousDataAccessor's keyword arguments "
                                f"{sorted(_ASYNC_OPTIONS)}.")
            self._accessor = AsynchronousDataAccessor(_SyncView(self), **accessor_args)

    # -- construction helpers -----------------------------------------------------------
    @staticmethod
    def _check_batch_sampler_args(batch_size, shuffle, iterable, kwargs) -> None:
        if batch_size != 1 or shuffle or "sampler" in kwargs:
            raise ValueError("batch_sampler is mutually exclusive with batch_size, "
                             "shuffle and sampler: the batch sampler decides the "
                             "micro-batches.")
        if iterable:
            raise ValueError("batch_sampler needs a map-style data set; an "
                             "IterableDataset decides its own order.")

    def _worker_batch_size(self, rebatched_worker_size: int | None, combined: int) -> int:
        if rebatched_worker_size is None:
            return combined
        if isinstance(rebatched_worker_size, bool) or \
                not isinstance(rebatched_worker_size, int) or \
                not 1 <= rebatched_worker_size <= combined:
            raise ValueError("rebatched_worker_size must be an integer between 1 and the "
                             f"combined batch size ({combined}); got "
                             f"{rebatched_worker_size!r}.")
        return rebatched_worker_size

    @staticmethod
    def _make_sampler(items, shuffle, seed, drop_last, process_id, num_processes,
                      distributed, kwargs):
        if not distributed:
            return None
        if "sampler" in kwargs:
            raise ValueError("A custom sampler cannot be combined with automatic "
                             "distributed partitioning: partition it yourself and pass "
                             "auto_distributed_partitioning=False.")
        if shuffle and seed is None:  # the processes must draw the same order
            seed = shared_random_seed(process_id, num_processes)
        return DistributedPartitionSampler(items, process_id, num_processes, shuffle,
                                           seed, pad=not drop_last)

    # -- public API -----------------------------------------------------------------------
    @property
    def combinedBatchSize(self) -> int | None:
        """Total number of elements consumed from the dataset for a single
        execution of the model (None with a ``batch_sampler`` that has no
        ``batch_size``)."""
        return self._combined_batch_size

    @property
    def options(self) -> Any:
        """A reference to the options that were used to initialise this instance."""
        return self._options

    def __len__(self) -> int:
        if not self._rebatch:
            return super().__len__()
        items = _length_or_none(self.dataset)
        if items is None:
            raise TypeError("This IterableDataset has no len().")
        full, rest = divmod(items, self._combined_batch_size)
        return full if self.rebatched_drop_last or rest == 0 else full + 1

    def __iter__(self):
        if self._accessor is not None:
            return iter(self._accessor)
        return super().__iter__()

    def terminate(self) -> None:
        """If `mode==DataLoaderMode.Async`, kills the worker process in the
        underlying :py:class:`~poptorch.AsynchronousDataAccessor` manually,
        otherwise has no effect."""
        if self._accessor is not None:
            self._accessor.terminate()

    def __getstate__(self) -> dict:
        # Pickled for a spawned worker process: the copy there reads synchronously.
        state = self.__dict__.copy()
        state["_accessor"] = None
        state["_iterator"] = None
        return state


def _length_or_none(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def _too_small_message(items: int, batch_size: int, factors: tuple[int, int, int],
                       num_processes: int) -> str:
    device_iterations, replication_factor, gradient_accumulation = factors
    combined = batch_size * device_iterations * replication_factor * gradient_accumulation
    where = (f"{items} items per process ({num_processes} processes)"
             if num_processes > 1 else f"{items} items")
    return (f"The data set has {where}, fewer than one combined batch of {combined} = "
            f"batch_size ({batch_size}) x deviceIterations ({device_iterations}) x "
            f"replicationFactor ({replication_factor}) x gradientAccumulation "
            f"({gradient_accumulation}). Use a larger data set, reduce one of these "
            "factors, or pass drop_last=False to get one incomplete batch.")

