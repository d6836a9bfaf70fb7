"""``poptorch.DataLoader``: a ``torch.utils.data.DataLoader`` whose batches hold the data
of one call of a PopTorch model, and ``AsynchronousDataAccessor``.

One call of a model consumes a *combined batch* of
``batch_size x deviceIterations x replicationFactor x gradientAccumulation`` items; the
loader yields batches of that size (see ``docs/data.md``). With
``Options.Distributed`` (several processes) each process reads its own share of the data
set, and every process gets the same number of batches.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import TYPE_CHECKING, cast

import torch
import torch.utils.data

from .._logging import info_once
from .._runtime.distributed.world import shared_random_seed
from .._typing import DatasetKey, OptionValue, UserInput
from ..enums import DataLoaderMode
from ..errors import (
    Error,
    PoptorchAssertionError,
    PoptorchTypeError,
    PoptorchValueError,
)
from .accessor import AsynchronousDataAccessor
from .combine import Batches, MicroBatchJoiner
from .faults import (
    as_worker_death,
    install_sigchld_translation,
    release_ended_workers,
    stop_torch_workers,
)
from .generators import portable_generators
from .resume import STATE_VERSION, ResumableIndexSampler, check_state
from .samplers import BatchIndices, CombinedBatchSampler, DistributedPartitionSampler

if TYPE_CHECKING:
    from ..options.options import Options

__all__ = ["AsynchronousDataAccessor", "DataLoader"]

_ASYNC_OPTIONS = {"buffer_size", "miss_sleep_time_in_ms", "load_indefinitely",
                  "early_preload", "sharing_strategy", "rebatched_size"}


class DataLoaderArgumentError(PoptorchAssertionError, ValueError):
    """A ``DataLoader`` argument that upstream PopTorch refuses with an ``assert``
    (``rebatched_worker_size``, ``rebatched_size`` in ``async_options``): an
    ``AssertionError`` and a ``poptorch.Error``, and the ``ValueError`` that earlier
    OpenPopTorch releases raised."""


class DataLoaderOptionsError(PoptorchAssertionError, TypeError):
    """A first argument that is no ``poptorch.Options``: upstream's ``assert
    isinstance(options, Options)`` (``AssertionError``), a ``poptorch.Error``, and the
    ``TypeError`` that earlier OpenPopTorch releases raised."""


class _SyncView:
    """Iterates a ``poptorch.DataLoader`` synchronously: what the asynchronous worker
    process reads (whatever the loader's own mode)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        self.rebatched_drop_last = loader.rebatched_drop_last

    def __iter__(self) -> Iterator[UserInput]:
        return self.loader._combined(torch.utils.data.DataLoader.__iter__(self.loader))

    def __len__(self) -> int:
        if self.loader._batch_sampler_groups is not None:
            return self.loader._batch_sampler_groups.combined_len()
        return torch.utils.data.DataLoader.__len__(self.loader)

    # Called in the worker process (see worker): resuming and position.
    def apply_resume(self, position: dict) -> bool:
        """Starts the next pass at ``position``; False if the batches to skip must be
        read and dropped instead (an iterable data set)."""
        sampler = self.loader._resumable_sampler()
        if sampler is None:
            return False
        sampler.owns_global_rng = True  # in the worker the global RNG is the loader's
        sampler.resume = position if position["start"] is not None else None
        return position["start"] is not None or position["consumed"] == 0

    def position_start(self) -> dict | None:
        sampler = self.loader._resumable_sampler()
        return sampler.last_start if sampler is not None else None


class _PassIterator:
    """One synchronous pass: counts the batches handed out (the loader's position),
    reports dead torch workers as ``poptorch.Error`` and drops the batches a resumed pass
    of an iterable data set must skip. (No reference to the loader: a cycle through
    torch's iterator would leave its workers to the garbage collector.)"""

    def __init__(self, inner: Batches, skip: int, consumed: int,
                 batches: Batches | None = None) -> None:
        self._inner = inner  # torch's iterator (its workers tell how they ended)
        self._batches = inner if batches is None else batches
        self._skip = skip
        self.consumed = consumed
        self.finished = False

    def __iter__(self) -> _PassIterator:
        return self

    def __len__(self) -> int:
        return len(self._batches)

    def __next__(self) -> UserInput:
        try:
            while self._skip:
                next(self._batches)
                self._skip -= 1
            batch = next(self._batches)
        except StopIteration:
            self.finished = True
            raise
        except (RuntimeError, OSError, EOFError, Error) as error:
            death = self._as_death(error)
            if death is None or death is error:
                raise
            raise death from error
        self.consumed += 1
        return batch

    def _as_death(self, error: BaseException) -> Error | None:
        """The ``poptorch.Error`` for a dead torch worker (None for other errors); torch's
        SIGCHLD handler may raise the same death again while this runs."""
        for _ in range(3):
            try:
                death = as_worker_death(error, self._inner)
                if death is not None:
                    stop_torch_workers(self._inner)
                return death
            except RuntimeError as again:
                error = again
        return as_worker_death(error, self._inner)


def _read_options(options: Options) -> tuple[int, int, int, int, int, int | None]:
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
        raise DataLoaderOptionsError(
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

    def __init__(self, options: Options, dataset: torch.utils.data.Dataset,
                 batch_size: int | None = 1, shuffle: bool | None = None, num_workers: int = 0,
                 drop_last: bool = True, persistent_workers: bool | None = None,
                 auto_distributed_partitioning: bool = True,
                 mode: DataLoaderMode = DataLoaderMode.Sync,
                 async_options: dict[str, OptionValue] | None = None,
                 rebatched_worker_size: int | None = None,
                 batch_sampler: BatchIndices | None = None, **kwargs: OptionValue) -> None:
        (device_iterations, replication_factor, gradient_accumulation, process_id,
         num_processes, seed) = _read_options(options)
        try:
            mode = DataLoaderMode(mode)
        except ValueError:
            raise PoptorchValueError(f"mode must be a poptorch.DataLoaderMode; got {mode!r}.") \
                from None
        shuffle = bool(shuffle)
        _check_arguments(num_workers, rebatched_worker_size, async_options)
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        micro_batches = device_iterations * replication_factor * gradient_accumulation
        factors = (device_iterations, replication_factor, gradient_accumulation)
        distributed = num_processes > 1 and auto_distributed_partitioning
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        rebatch = mode == DataLoaderMode.AsyncRebatched and iterable
        self.batch_sampler_drop_last = drop_last
        self.rebatched_drop_last = drop_last
        self._micro_batches = micro_batches
        self._batch_sampler_groups: CombinedBatchSampler | None = None
        loader_args: dict[str, OptionValue] = {}

        if batch_sampler is not None:
            self._check_batch_sampler_args(batch_size, shuffle, iterable, kwargs)
            micro = getattr(batch_sampler, "batch_size", None)
            self._combined_batch_size = (micro * micro_batches
                                         if isinstance(micro, int) else None)
            self._batch_sampler_groups = CombinedBatchSampler(
                batch_sampler, micro_batches, drop_last, process_id,
                num_processes if distributed else 1)
            loader_args["batch_sampler"] = self._batch_sampler_groups
        elif batch_size is None:
            # torch's "no automatic batching": each item of the data set is a batch
            self._combined_batch_size = None
            if not iterable:
                sampler = self._make_sampler(len(cast(Sized, dataset)), shuffle, seed, False,
                                             process_id, num_processes, distributed,
                                             kwargs, step=1)
                if sampler is not None:
                    loader_args["sampler"] = sampler
                elif shuffle:
                    loader_args["shuffle"] = True
                    if seed is not None and "generator" not in kwargs:
                        loader_args["generator"] = torch.Generator().manual_seed(seed)
            elif distributed:
                raise PoptorchAssertionError(_ITERABLE_DISTRIBUTED)
            if rebatch:
                raise PoptorchValueError("DataLoaderMode.AsyncRebatched needs an integer "
                                 "batch_size: it cuts the data into combined batches "
                                 "of batch_size x deviceIterations x replicationFactor "
                                 "x gradientAccumulation rows.")
            loader_args.update(batch_size=None, drop_last=False)
        else:
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) \
                    or batch_size < 1:
                raise PoptorchValueError("poptorch.DataLoader needs an integer batch_size >= 1 "
                                 f"(the micro-batch size); got {batch_size!r}.")
            combined = batch_size * micro_batches
            self._combined_batch_size = combined
            loader_batch, loader_drop_last = combined, drop_last
            if iterable:
                if distributed:
                    raise PoptorchAssertionError(_ITERABLE_DISTRIBUTED)
                if rebatch:
                    loader_batch = self._worker_batch_size(rebatched_worker_size, combined)
                    loader_drop_last = False  # the accessor drops (or keeps) the tail
                items = _length_or_none(dataset)
            else:
                items = len(cast(Sized, dataset))  # (a map-style data set)
                sampler = self._make_sampler(items, shuffle, seed, drop_last,
                                             process_id, num_processes, distributed,
                                             kwargs, step=combined)
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
        # Position of the synchronous pass (state_dict); the pass being counted.
        self._pass: _PassIterator | None = None
        self._started_before = 0
        self._previous_position: dict = {"start": None, "consumed": 0, "finished": False}
        self._resume_next: dict | None = None
        self._accessor: AsynchronousDataAccessor | None = None
        if mode != DataLoaderMode.Sync:
            accessor_args = dict(async_options or {})
            if "rebatched_size" in accessor_args:  # (upstream: an assert, in every mode)
                raise DataLoaderArgumentError(
                    "async_options must not set rebatched_size: the DataLoader chooses it "
                    "(with DataLoaderMode.AsyncRebatched the combined batch size). Remove "
                    "it, or wrap a loader in poptorch.AsynchronousDataAccessor yourself.")
            if rebatch:
                accessor_args["rebatched_size"] = self._combined_batch_size
            unknown = set(accessor_args) - _ASYNC_OPTIONS
            if unknown:
                raise PoptorchTypeError(f"Unknown async_options {sorted(unknown)}: they are "
                                "AsynchronousDataAccessor's keyword arguments "
                                f"{sorted(_ASYNC_OPTIONS)}.")
            self._accessor = AsynchronousDataAccessor(_SyncView(self), **accessor_args)
        # As in PopTorch: the loader's batching was read from the options, so a later
        # change would not reach it; the options are frozen (``opts.clone()`` to change).
        freeze = getattr(options, "_freeze", None)
        if callable(freeze):
            freeze()

    # -- construction helpers -----------------------------------------------------------
    @staticmethod
    def _check_batch_sampler_args(batch_size: int | None, shuffle: bool, iterable: bool,
                                  kwargs: dict[str, object]) -> None:
        # as torch's DataLoader: the defaults (batch_size=1, shuffle=False, sampler=None)
        # may be passed explicitly, as re-instantiating code such as Lightning's does
        if batch_size != 1 or shuffle or kwargs.get("sampler") is not None:
            raise PoptorchValueError("batch_sampler is mutually exclusive with batch_size, "
                             "shuffle and sampler: the batch sampler decides the "
                             "micro-batches.")
        if iterable:
            raise PoptorchValueError("batch_sampler needs a map-style data set; an "
                             "IterableDataset decides its own order.")

    def _worker_batch_size(self, rebatched_worker_size: int | None, combined: int) -> int:
        if rebatched_worker_size is None:
            return combined
        if isinstance(rebatched_worker_size, bool) or \
                not isinstance(rebatched_worker_size, int) or \
                not 1 <= rebatched_worker_size <= combined:
            raise DataLoaderArgumentError(
                "rebatched_worker_size must be an integer between 1 and the "
                f"combined batch size ({combined}); got {rebatched_worker_size!r}.")
        return rebatched_worker_size

    @staticmethod
    def _make_sampler(items: int, shuffle: bool, seed: int | None, drop_last: bool,
                      process_id: int, num_processes: int, distributed: bool,
                      kwargs: dict[str, object], step: int) -> DistributedPartitionSampler | None:
        if not distributed:
            return None
        if "sampler" in kwargs:
            raise PoptorchValueError("A custom sampler cannot be combined with automatic "
                             "distributed partitioning: partition it yourself and pass "
                             "auto_distributed_partitioning=False.")
        if shuffle and seed is None:  # the processes must draw the same order
            seed = shared_random_seed(process_id, num_processes)
        return DistributedPartitionSampler(items, process_id, num_processes, shuffle,
                                           seed, pad=not drop_last, step=step)

    # -- public API -----------------------------------------------------------------------
    @property
    def combinedBatchSize(self) -> int | None:
        """Total number of elements consumed from the dataset for a single
        execution of the model (None with a ``batch_sampler`` that has no
        ``batch_size``)."""
        return self._combined_batch_size

    @property
    def options(self) -> Options:
        """A reference to the options that were used to initialise this instance."""
        return self._options

    def __len__(self) -> int:
        if self._batch_sampler_groups is not None:
            return self._batch_sampler_groups.combined_len()
        if not self._rebatch:
            return super().__len__()
        items = _length_or_none(self.dataset)
        if items is None:
            raise PoptorchTypeError("This IterableDataset has no len().")
        assert self._combined_batch_size is not None  # (set when rebatching)
        full, rest = divmod(items, self._combined_batch_size)
        return full if self.rebatched_drop_last or rest == 0 else full + 1

    def __iter__(self) -> Iterator[UserInput]:  # type: ignore[override]  # (a counting pass iterator or the accessor's, not torch's iterator class)
        if self._accessor is not None:
            return iter(self._accessor)
        if getattr(self._iterator, "_shutdown", False):
            self._iterator = None  # its workers were stopped after one of them died
        resume, self._resume_next = self._resume_next, None
        skip = 0
        sampler = self._resumable_sampler()
        if resume is not None:
            if sampler is not None and resume["start"] is not None:
                sampler.resume = resume
                sampler.global_rng_before_iterator = torch.get_rng_state()
            elif not resume["finished"]:
                skip = resume["consumed"]  # read and dropped: no sampler to skip with
        previous = resume if resume is not None else self._sync_position()
        self._started_before = sampler.epochs_started if sampler is not None else 0
        consumed = 0 if resume is None or resume["finished"] else resume["consumed"]
        inner = super().__iter__()
        self._pass = _PassIterator(inner, skip, consumed, self._combined(inner))
        if self.num_workers > 0:
            install_sigchld_translation()
        self._previous_position = previous
        return self._pass

    def _combined(self, inner: Batches) -> Batches:
        """Torch's iterator, or with a ``batch_sampler`` its collated micro-batches joined
        into combined batches (see ``combine``)."""
        groups = self._batch_sampler_groups
        if groups is None:
            return inner
        try:
            length = groups.combined_len()
        except TypeError:
            length = None
        drop_short_last = (self._micro_batches == 1 and self.batch_sampler_drop_last
                           and groups._last_micro_batch_is_short())
        return MicroBatchJoiner(inner, self._micro_batches, self.batch_sampler_drop_last,
                                length, drop_short_last)

    @property
    def _index_sampler(self) -> Iterable[DatasetKey]:
        # torch's iterators read the batches of indices from here: a wrapper that can
        # record and restore the loader's position (map-style data sets only).
        inner = super()._index_sampler
        if isinstance(self.dataset, torch.utils.data.IterableDataset):
            return inner
        wrapper = self.__dict__.get("_resumable")
        if wrapper is None or wrapper.inner is not inner:
            wrapper = ResumableIndexSampler(inner, self)
            if self._batch_sampler_groups is not None:
                wrapper.index_batches_per_batch = self._micro_batches
            self.__dict__["_resumable"] = wrapper
        return wrapper

    def _resumable_sampler(self) -> ResumableIndexSampler | None:
        sampler = self._index_sampler
        return sampler if isinstance(sampler, ResumableIndexSampler) else None

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """The loader's position in its stream of batches, to resume from in a new
        process with :meth:`load_state_dict` (see docs/data.md, "Checkpoint and resume"):
        the random state the current epoch's order was drawn from (so the shuffle order
        is the same), how many of its batches were handed out, and whether it ended."""
        if self._accessor is not None:
            position = self._accessor.position()
        elif self._resume_next is not None:
            position = dict(self._resume_next)
        else:
            position = self._sync_position()
        return {"version": STATE_VERSION, **position}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """The next ``iter()`` continues where the loader that saved ``state`` was: it
        skips the batches already handed out without loading them (a map-style data
        set: only their indices are drawn) or, for an iterable data set, by reading and
        dropping them. Build the loader with the same arguments, options and seed."""
        check_state(state)
        position = {key: state[key] for key in ("start", "consumed", "finished")}
        if self._accessor is not None:
            self._accessor.resume_at(position)
        else:
            self._resume_next = position

    def _sync_position(self) -> dict:
        if self._pass is None:
            return {"start": None, "consumed": 0, "finished": False}
        sampler = self._resumable_sampler()
        start = None
        if sampler is not None:
            if sampler.epochs_started > self._started_before:
                start = sampler.last_start
            else:
                # this pass has not drawn its order yet: the position is where the
                # previous pass left off (or the position it resumes from)
                return dict(self._previous_position)
        return {"start": start, "consumed": self._pass.consumed,
                "finished": self._pass.finished}

    def terminate(self) -> None:
        """Stops the worker processes: the asynchronous accessor's
        (``mode=DataLoaderMode.Async``), or torch's persistent workers in Sync mode
        (upstream: no effect in Sync mode; stopping them frees their memory and the
        next ``iter()`` starts new ones)."""
        if self._accessor is not None:
            self._accessor.terminate()
        elif self._iterator is not None:
            shutdown = getattr(self._iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()  # (a worker that does not stop in time is killed)
                release_ended_workers(self._iterator)
            self._iterator = None

    def __getstate__(self) -> dict:
        # Pickled for a spawned worker process: the copy there reads synchronously.
        state = self.__dict__.copy()
        state["_accessor"] = None
        state["_iterator"] = None
        state["_pass"] = None
        # A seeded torch.Generator (Options.randomSeed with shuffle=True) cannot travel
        # to a spawned process through torch's shared-memory pickler: its state does.
        portable: dict = {}
        for key in ("generator", "sampler", "batch_sampler", "_resumable"):
            if key in state:
                state[key] = portable_generators(state[key], portable)
        return state


_ITERABLE_DISTRIBUTED = (
    "auto_distributed_partitioning is not supported for an IterableDataset: each process "
    "would read the whole data set. Read only this process's share in your __iter__ (use "
    "options.Distributed.processId and numProcesses) and pass "
    "auto_distributed_partitioning=False.")


def _check_arguments(num_workers: object, rebatched_worker_size: object,
                     async_options: object) -> None:
    """Rejects argument types torch would fail on later with an unrelated message."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or \
            num_workers < 0:
        raise PoptorchValueError(f"num_workers must be an integer >= 0; got {num_workers!r}.")
    if rebatched_worker_size is not None and (
            isinstance(rebatched_worker_size, bool) or
            not isinstance(rebatched_worker_size, int) or rebatched_worker_size < 1):
        raise DataLoaderArgumentError("rebatched_worker_size must be None or an integer >= 1; got "
                         f"{rebatched_worker_size!r}.")
    if async_options is not None and not isinstance(async_options, dict):
        raise PoptorchTypeError("async_options must be a dict of AsynchronousDataAccessor keyword "
                        f"arguments or None; got {type(async_options).__name__}.")


def _length_or_none(dataset: object) -> int | None:
    try:
        return len(cast(Sized, dataset))  # (no len: TypeError)
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

