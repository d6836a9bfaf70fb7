"""``AsynchronousDataAccessor``: load batches in another process while the model runs.

The accessor starts one worker process (see ``worker``) that iterates the data set
and fills a ring of ``buffer_size`` shared-memory slots. Iterating the accessor returns
the tensors of a slot in place: they stay valid until the next batch is requested, after
which the slot is refilled (clone a tensor to keep it).

The worker starts as torch's ``DataLoader`` starts its workers (the platform's default
start method: ``fork`` on Linux) unless a ``sharing_strategy`` asks otherwise, and the
data set's own torch workers inside it start as they would in the caller: a spawned or
forkserver-started interpreter imports torch again, which costs seconds per process.

The worker is shut down by :meth:`AsynchronousDataAccessor.terminate`, when the accessor
is garbage collected, and at interpreter exit (also after Ctrl-C). A worker that dies is
noticed within a second and reported as a :py:class:`poptorch.Error` naming the signal;
an exception raised by the data set is re-raised in the main process with the worker named
and the original traceback in its message.
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.util
import os
import pickle
import sys
import tempfile
import weakref
from collections.abc import Iterable, Sized
from multiprocessing.connection import Connection
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext
from typing import cast

import torch
import torch.multiprocessing

from .._logging import info_once
from .._typing import UserInput
from ..enums import SharingStrategy
from ..errors import Error, PoptorchTypeError, PoptorchValueError
from .faults import WorkerDiedError, exit_code_description, rebuild_worker_exception, start_failure
from .ring import ON_PIPE, BatchRing
from .tree import Skeleton, unflatten
from .worker import DatasetFile, WorkerConfig, run_worker

__all__ = ["AsynchronousDataAccessor"]

_START_METHODS = {
    SharingStrategy.SharedMemory: "spawn",
    SharingStrategy.FileSystem: "spawn",
    SharingStrategy.Fork: "fork",
    SharingStrategy.ForkServer: "forkserver",
}
# The strategy used when none is given: that of the caller's default start method, which
# torch's DataLoader uses for its workers too.
_DEFAULT_STRATEGIES = {
    "fork": SharingStrategy.Fork,
    "forkserver": SharingStrategy.ForkServer,
    "spawn": SharingStrategy.SharedMemory,
}
_LIVENESS_CHECK_S = 0.5
_POLITE_JOIN_S = 5.0   # a worker stops at once, then joins its own torch workers
_JOIN_TIMEOUT_S = 5.0  # after SIGTERM, which the worker turns into a clean exit

# Finalizers of the live accessors. Our atexit hook is registered after multiprocessing's
# own (imported above), so it runs first: multiprocessing joins non-daemonic children at
# exit, which would wait forever for a worker nobody told to stop.
_live_workers: set[weakref.finalize] = set()


@atexit.register
def _terminate_all_workers() -> None:
    for finalizer in list(_live_workers):
        finalizer()


def _shutdown_worker(owner_pid: int, process: multiprocessing.process.BaseProcess,
                     commands: Connection, results: Connection,
                     dataset_file: str | None) -> None:
    """Stops the worker: politely, then SIGTERM (clean exit), then SIGKILL."""
    if os.getpid() != owner_pid:  # a forked copy of the owner: not ours to stop
        return
    try:
        if process.is_alive():
            with contextlib.suppress(ValueError, OSError):
                commands.send(("stop",))
            process.join(_POLITE_JOIN_S)
        if process.is_alive():
            process.terminate()
            process.join(_JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
    finally:
        for channel in (commands, results):
            channel.close()
        if dataset_file is not None and os.path.exists(dataset_file):
            os.unlink(dataset_file)


class AsynchronousDataAccessor:
    """A data loader which launches the data loading process on a separate
    process to allow for the data to be preprocessed asynchronously on CPU while the
    model runs.

    This works by loading the data into a ring buffer of shared memory. When the model
    needs another batch it uses the data ready in the ring buffer. The memory is shared
    so will be used in-place and won't be freed until the next batch is requested.
    Behind the scenes the worker process fills the unready elements of the ring buffer.

    .. note:: When using a ``torch.utils.data.Dataset`` with ``rebatched_size``
        the accessor will default to ``drop_last=True``, to change that
        behaviour wrap the dataset into a
        ``poptorch.DataLoader(..., drop_last=False)``.

    Args:
        dataset: The data set to pull data from: any iterable, typically a
            ``poptorch.DataLoader`` or ``torch.utils.data.DataLoader``.
        buffer_size: Number of batches the ring buffer holds.
        miss_sleep_time_in_ms: Upstream, how long the worker sleeps before checking
            again when the buffer is full. Here the worker blocks until a slot is freed
            and wakes at once, so the value is recorded but has no effect.
        load_indefinitely: If True, the worker starts the next pass over the data set
            as soon as one ends, preloading the next epoch; if False, it waits until
            the accessor is iterated again.
        early_preload: If True, start filling the ring buffer as soon as the worker is
            created; if False, when the accessor is first iterated.
        sharing_strategy: How the data set reaches the worker process:
            ``Fork`` and ``ForkServer`` start it with the matching multiprocessing
            start method; ``SharedMemory`` spawns it and passes the data set's
            tensors through shared memory; ``FileSystem`` spawns it and passes the
            data set through a temporary file. All but ``Fork`` pickle the data set.
            None (the default) starts the worker as torch's DataLoader starts its
            workers: the platform's default start method (``Fork`` on Linux). Upstream
            defaults to ``ForkServer``, which starts a fresh interpreter that imports
            torch again (seconds before the first batch): pass it to get it.
        rebatched_size: If not None, the batches of ``dataset`` are concatenated and
            cut into batches of exactly this many rows (the last one is dropped
            unless ``dataset.rebatched_drop_last`` is False).
    """

    def __init__(self, dataset: Iterable, buffer_size: int = 3,
                 miss_sleep_time_in_ms: float = 0.1, load_indefinitely: bool = True,
                 early_preload: bool = False,
                 sharing_strategy: SharingStrategy | None = None,
                 rebatched_size: int | None = None) -> None:
        # any object Python can iterate: __iter__, or __getitem__ from 0 until IndexError
        # (or StopIteration), as a map-style torch Dataset whose items are read one by one
        if not isinstance(dataset, Iterable) and \
                not hasattr(type(dataset), "__getitem__"):
            raise PoptorchTypeError("AsynchronousDataAccessor needs an iterable data set (for "
                            "example a poptorch.DataLoader) or an indexable one; got "
                            f"{type(dataset).__name__}.")
        _check_positive_int("buffer_size", buffer_size)
        if rebatched_size is not None:
            _check_positive_int("rebatched_size", rebatched_size)
        try:
            sharing_strategy = (_default_strategy() if sharing_strategy is None
                                else SharingStrategy(sharing_strategy))
        except ValueError:
            raise PoptorchValueError(f"sharing_strategy must be a poptorch.SharingStrategy; got "
                             f"{sharing_strategy!r}.") from None
        if isinstance(miss_sleep_time_in_ms, bool) or \
                not isinstance(miss_sleep_time_in_ms, (int, float)) or \
                not miss_sleep_time_in_ms >= 0:
            raise PoptorchValueError("miss_sleep_time_in_ms must be a number >= 0; got "
                             f"{miss_sleep_time_in_ms!r}.")
        if miss_sleep_time_in_ms != 0.1:
            info_once("async_miss_sleep_time",
                      "AsynchronousDataAccessor: miss_sleep_time_in_ms=%s is recorded but "
                      "has no effect: the worker blocks until a buffer slot is freed "
                      "instead of polling.", miss_sleep_time_in_ms)
        self.rebatched_size = rebatched_size
        self.miss_sleep_time_in_ms = miss_sleep_time_in_ms
        self.load_indefinitely = load_indefinitely
        self.early_preload = early_preload
        self.sharing_strategy = sharing_strategy
        self.buffer_size = buffer_size
        self._drop_last = bool(getattr(dataset, "rebatched_drop_last", True))
        self._length = self._compute_length(dataset)
        self._epoch = -1           # epoch being consumed
        self._in_epoch = False     # True between __iter__ and the epoch's end
        self._consumed = 0         # batches of that epoch returned to the caller
        self._starts: dict[int, dict] = {}  # epoch -> random state its order came from
        self._resume_next: dict | None = None  # position to start the next pass at
        self._held_slot: int | None = None
        self._prestarted = False   # the worker started the first pass by itself
        self._slots: list[list[torch.Tensor] | None] = [None] * buffer_size
        self._early: tuple | None = None  # the first message, read by the constructor
        self._skeleton: Skeleton = None  # of the last batch received (see worker.decode)
        self._start_worker(dataset)
        self._wait_for_first_batch()

    # -- worker lifetime --------------------------------------------------------------
    def _start_worker(self, dataset: Iterable) -> None:
        method = _START_METHODS[self.sharing_strategy]
        context = cast("ForkContext | ForkServerContext | SpawnContext",
                       torch.multiprocessing.get_context(method))  # (_START_METHODS)
        if method == "forkserver":
            _preload_in_forkserver()
        # Two one-way pipes: no feeder thread (a multiprocessing.Queue's waits for the
        # GIL, up to a switch interval per batch) and no lock per message.
        commands_reader, self._commands = context.Pipe(duplex=False)
        self._results, results_writer = context.Pipe(duplex=False)
        self._ring = BatchRing(context, self.buffer_size)
        dataset_file = None
        source: Iterable | DatasetFile = dataset
        if self.sharing_strategy == SharingStrategy.FileSystem:
            handle, dataset_file = tempfile.mkstemp(
                prefix=f"poptorch_dataset_{os.getpid()}_", suffix=".pkl")
            with os.fdopen(handle, "wb") as out:
                pickle.dump(dataset, out)
            source = DatasetFile(dataset_file)
        config = WorkerConfig(self.buffer_size, bool(self.load_indefinitely),
                              bool(self.early_preload), self.rebatched_size,
                              self._drop_last, multiprocessing.get_start_method())
        self._process = context.Process(
            target=run_worker,
            args=(source, commands_reader, results_writer, self._ring, config,
                  (self._commands, self._results)),
            name="poptorch-async-data", daemon=False)
        try:
            try:
                self._process.start()
            finally:  # the worker's ends: only the worker keeps them open
                commands_reader.close()
                results_writer.close()
        except Exception as error:
            if dataset_file is not None and os.path.exists(dataset_file):
                os.unlink(dataset_file)
            raise Error(
                f"AsynchronousDataAccessor could not start its worker with "
                f"{self.sharing_strategy!r}: {error}. Strategies other than "
                "SharingStrategy.Fork pickle the data set: make it picklable "
                "(defined at module level) or use SharingStrategy.Fork.") from error
        self._finalizer = weakref.finalize(self, _shutdown_worker, os.getpid(),
                                           self._process, self._commands,
                                           self._results, dataset_file)
        _live_workers.difference_update([f for f in _live_workers if not f.alive])
        _live_workers.add(self._finalizer)

    def _wait_for_first_batch(self) -> None:
        """The worker loads the first batch of the first pass at once (as upstream's
        does, to lay out its buffers): a data set that cannot produce it fails here, in
        the constructor, with the worker's traceback on stderr and in the message."""
        self._epoch, self._prestarted = 0, True
        message = self._receive()
        if message[0] != "error":
            self._early = message
            return
        original = rebuild_worker_exception(*message[2:])
        # printed as Python reports a process's uncaught exception (upstream's worker
        # dies with it on stderr: "check above for details")
        print(f"AsynchronousDataAccessor worker process failed to load the first "
              f"batch:\n{message[3]}", file=sys.stderr, flush=True)
        self.terminate()
        raise start_failure(original) from original

    def terminate(self) -> None:
        """Stops the worker process (also done on garbage collection and at exit)."""
        self._finalizer()
        self._in_epoch = False

    def _check_alive(self) -> None:
        if not self._finalizer.alive:
            raise Error("This AsynchronousDataAccessor has been terminated: create a new "
                        "one (or a new poptorch.DataLoader) to load more data.")

    # -- iteration --------------------------------------------------------------------
    def __len__(self) -> int:
        if self._length is None:
            raise PoptorchTypeError("The data set of this AsynchronousDataAccessor has no len().")
        return self._length

    def __iter__(self) -> _PassIterator:
        """Starts a new pass over the data set (abandoning an unfinished one) and returns
        its iterator."""
        self._start_pass()
        return _PassIterator(self, self._epoch)

    def __next__(self) -> UserInput:
        """The next batch of the current pass (upstream's accessor is its own iterator);
        starts the first pass if none was started."""
        self._check_alive()
        if not self._in_epoch and self._prestarted:
            self._start_pass()
        return self._next_batch(self._epoch)

    def _start_pass(self) -> None:
        self._check_alive()
        self._release_slot()
        resume, self._resume_next = self._resume_next, None
        if self._prestarted and resume is None:
            # the first pass, which the worker started in the constructor
            self._prestarted = False
            self._in_epoch = True
            self._consumed = 0
            self._commands.send(("start", self._epoch, None))
            return
        self._prestarted = False
        # The worker preloads at most the pass after the newest one asked for: a resumed
        # pass gets a number past it, so that none of the preloaded batches is taken.
        self._epoch += 1 if resume is None else 2
        self._in_epoch = True
        self._consumed = 0
        if resume is not None:
            self._consumed = 0 if resume["finished"] else resume["consumed"]
            if resume["start"] is not None:
                self._starts[self._epoch] = resume["start"]
        self._commands.send(("start", self._epoch, resume))

    def _next_batch(self, epoch: int) -> UserInput:
        self._check_alive()
        if epoch != self._epoch:
            raise Error("This iterator's pass over the AsynchronousDataAccessor was "
                        "abandoned when a new iter() started: one pass at a time.")
        if not self._in_epoch:
            raise StopIteration
        self._release_slot()
        while True:
            message = self._receive()
            kind, epoch = message[0], message[1]
            if kind == "batch":
                _, _, slot, skeleton, fresh, start = message
                if fresh is not None:
                    self._slots[slot] = fresh
                if start is not None:
                    self._starts.setdefault(epoch, start)
                if epoch != self._epoch:  # left over from an abandoned pass
                    self._ring.free(slot)
                    continue
                self._held_slot = slot
                self._consumed += 1
                return unflatten(skeleton, self._slots[slot])
            if epoch != self._epoch:
                continue
            self._in_epoch = False
            if kind == "end":
                raise StopIteration
            raise rebuild_worker_exception(*message[2:])

    # -- position ---------------------------------------------------------------------
    def position(self) -> dict:
        """Where the caller is: ``{"start", "consumed", "finished"}`` of the current pass
        (see ``poptorch.DataLoader.state_dict``)."""
        if self._resume_next is not None:
            return dict(self._resume_next)
        if self._prestarted:  # no pass asked for yet
            return {"start": None, "consumed": 0, "finished": False}
        return {"start": self._starts.get(self._epoch), "consumed": self._consumed,
                "finished": not self._in_epoch}

    def resume_at(self, position: dict) -> None:
        """The next pass starts at ``position`` (from :meth:`position`)."""
        self._check_alive()
        self._in_epoch = False
        self._resume_next = dict(position)

    def _release_slot(self) -> None:
        if self._held_slot is not None:
            self._ring.free(self._held_slot)
            self._held_slot = None

    def _receive(self) -> tuple:
        """The worker's next message (see ``worker``), noticing a dead worker within
        about a second."""
        if self._early is not None:
            message, self._early = self._early, None
            return message
        while True:
            news = self._ring.next_message(_LIVENESS_CHECK_S)
            if news is ON_PIPE:
                return self._receive_from_pipe()
            if news is not None:
                epoch, slot = cast(tuple[int, int], news)
                return ("batch", epoch, slot, self._skeleton, None, None)
            if not self._process.is_alive():
                raise self._worker_died()

    def _receive_from_pipe(self) -> tuple:
        """The pipe's next message, which the worker is sending."""
        while True:
            try:
                if self._results.poll(_LIVENESS_CHECK_S):
                    message = self._results.recv()
                    if message[0] == "batch":
                        self._skeleton = message[3]
                    return message
            except (OSError, EOFError) as error:
                # Receiving a batch's shared memory needs the worker: it died mid-send.
                self._process.join(_LIVENESS_CHECK_S)
                if self._process.is_alive():
                    raise Error("Lost the connection to the AsynchronousDataAccessor "
                                f"worker process (pid {self._process.pid}): {error}") \
                        from error
                raise self._worker_died() from error
            if not self._process.is_alive() and not self._results.poll(0):
                raise self._worker_died()

    def _worker_died(self) -> Error:
        code = self._process.exitcode
        self.terminate()
        return WorkerDiedError(
            f"The AsynchronousDataAccessor worker process (pid {self._process.pid}) "
            f"{exit_code_description(code)}; the batches it was loading are lost. "
            "Create a new loader (or resume from a checkpoint, see docs/data.md).")

    def _compute_length(self, dataset: Iterable) -> int | None:
        try:
            length = len(cast(Sized, dataset))  # (an iterable without len: TypeError)
        except TypeError:
            return None
        if self.rebatched_size is None:
            return length
        inner = getattr(dataset, "dataset", None)
        try:
            rows = len(cast(Sized, inner))  # (None or no len: TypeError)
        except TypeError:
            rows = length * (getattr(dataset, "batch_size", None) or 1)
        full, rest = divmod(rows, self.rebatched_size)
        return full if self._drop_last or rest == 0 else full + 1


class _PassIterator:
    """The iterator of one pass over an accessor (iterating it again does not restart)."""

    def __init__(self, accessor: AsynchronousDataAccessor, epoch: int) -> None:
        self._accessor = accessor
        self._epoch = epoch

    def __iter__(self) -> _PassIterator:
        return self

    def __next__(self) -> UserInput:
        return self._accessor._next_batch(self._epoch)

    def __len__(self) -> int:
        return len(self._accessor)


def _default_strategy() -> SharingStrategy:
    return _DEFAULT_STRATEGIES.get(multiprocessing.get_start_method(),
                                   SharingStrategy.SharedMemory)


def _preload_in_forkserver() -> None:
    """Has the forkserver (when this process has not started it yet, and nobody chose
    what it preloads) import torch and our worker once, so that every worker it forks
    starts with them loaded instead of importing torch again."""
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", 1) is None and \
            getattr(server, "_preload_modules", None) == ["__main__"]:
        server.set_forkserver_preload(["__main__", "poptorch.data.worker"])


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PoptorchValueError(f"{name} must be an integer >= 1; got {value!r}.")

