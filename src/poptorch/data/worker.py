"""The process behind :py:class:`poptorch.AsynchronousDataAccessor`.

It iterates the data set and writes each batch into a ring of ``buffer_size`` slots of
shared-memory tensors. The main process reads a slot in place and hands it back when it
asks for the next batch. Protocol:

* main -> worker, on the ``commands`` pipe (pickled tuples): ``("start", epoch,
  resume)`` begin epoch ``epoch`` (abandoning an older one still running) at the
  position ``resume`` (a ``DataLoader.state_dict()``, or None: from the start),
  ``("stop",)`` shut down. Freed slots travel through the ``BatchRing`` (see ``ring``).
* worker -> main: a batch with the structure of the previous one and nothing else to
  carry is *published* through the ``BatchRing`` as ``(epoch, slot)`` (the receiver
  keeps the last structure); every other message goes through the ``results`` pipe:
  ``("batch", epoch, slot, skeleton, tensors_or_None, start_or_None)`` (``tensors`` is
  sent only when the slot's shared tensors had to be (re)allocated; ``start``, the
  random state the epoch's order was drawn from, with the first batch of an epoch of a
  ``poptorch.DataLoader``), ``("end", epoch)``, ``("error", epoch, description,
  traceback, pickled_type, message)``.

A light batch then costs the two processes well under a microsecond of hand-over and no
system call, instead of tens of microseconds of pipe traffic and process wake-ups.

The worker ignores SIGINT (the main process decides when it stops), turns SIGTERM into a
clean exit (so the data set's own worker processes are joined), and exits by itself when
the main process disappears.
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import multiprocessing
import os
import pickle
import signal
import traceback
from collections.abc import Hashable, Iterable
from multiprocessing.connection import Connection
from types import FrameType
from typing import Literal, NoReturn, overload

import torch

from .._typing import UserInput
from .faults import as_worker_death, install_sigchld_translation, pickled_type, stop_torch_workers
from .ring import BatchRing
from .tree import Rebatcher, flatten_keyed

__all__ = ["DatasetFile", "WorkerConfig", "run_worker"]

_LIVENESS_CHECK_S = 0.5
_SLOT_WAIT_S = 0.05  # a worker waiting for a free slot reads its commands this often


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    buffer_size: int
    load_indefinitely: bool
    early_preload: bool
    rebatched_size: int | None
    rebatched_drop_last: bool
    # The caller's default start method, for the data set's own (torch) workers: they
    # start as they would in the caller, not as this process was started.
    start_method: str


@dataclasses.dataclass(frozen=True)
class DatasetFile:
    """A data set pickled to ``path`` (``SharingStrategy.FileSystem``); the worker loads
    it and deletes the file."""
    path: str

    def load(self) -> UserInput:  # the user's data set
        try:
            with open(self.path, "rb") as handle:
                return pickle.load(handle)
        finally:
            os.unlink(self.path)


class _Stop(Exception):
    """The main process asked the worker to stop (or went away)."""


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    raise SystemExit(0)


def run_worker(source: Iterable[UserInput] | DatasetFile, commands: Connection,
               results: Connection, ring: BatchRing,
               config: WorkerConfig, callers_ends: tuple[Connection, ...] = ()) -> None:
    """Entry point of the worker process (``callers_ends``: the caller's ends of the
    pipes, which a forked worker inherits and closes)."""
    for end in callers_ends:
        end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # Objects inherited from a forked caller are the caller's to finalize: never collect
    # them here (a torch iterator's __del__ would try to stop the caller's workers).
    gc.freeze()
    if multiprocessing.get_start_method(allow_none=True) != config.start_method:
        multiprocessing.set_start_method(config.start_method, force=True)
    # Like torch's own DataLoader workers: leave the cores to the model.
    torch.set_num_threads(1)
    try:
        dataset = source.load() if isinstance(source, DatasetFile) else source
        _Worker(dataset, commands, results, ring, config).run()
    except _Stop:
        pass


class _Worker:

    def __init__(self, dataset: Iterable[UserInput], commands: Connection, results: Connection,
                 ring: BatchRing, config: WorkerConfig) -> None:
        self.dataset = dataset
        self.commands = commands
        self.results = results
        self.ring = ring
        self.config = config
        self.free = collections.deque(range(config.buffer_size))
        self.slots: list[list[torch.Tensor] | None] = [None] * config.buffer_size
        self.layouts: list[list[tuple] | None] = [None] * config.buffer_size
        self.latest_start = -1  # newest epoch the main process asked for
        self.resume_at: dict[int, dict] = {}  # epoch -> position to start it at
        self.send_start = False  # the next batch is the first of its pass
        self.emitted_before_start = False
        self.started: set[int] = set()  # passes run (or running)
        self.sent_key: Hashable | None = None  # key of the last skeleton sent (see flatten_keyed)
        self.unpolled = 0  # batches since the commands were last read
        self.parent = multiprocessing.parent_process()

    def run(self) -> None:
        # The first pass starts at once: its first batch reaches the constructor (and
        # with early_preload the ring fills); see _hold_until_asked.
        epoch: int | None = 0
        while True:
            if epoch is None:
                epoch = self._wait_for_start()
            epoch = self._run_epoch(epoch)

    # -- commands -------------------------------------------------------------------
    @overload
    def _next_command(self, block: Literal[True]) -> tuple: ...
    @overload
    def _next_command(self, block: bool) -> tuple | None: ...

    def _next_command(self, block: bool) -> tuple | None:
        """The next command (a tuple, unpickled), waiting for it with ``block``; else
        None when none is waiting."""
        while True:
            try:
                if self.commands.poll(_LIVENESS_CHECK_S if block else 0):
                    return self.commands.recv()
            except (OSError, EOFError):  # the main process went away
                raise _Stop() from None
            if not block:
                return None
            if self.parent is not None and not self.parent.is_alive():
                raise _Stop()

    def _send(self, message: tuple) -> None:
        """Sends ``message`` through the results pipe (see ``ring`` for the order)."""
        self.ring.announce()
        try:
            self.results.send(message)
        except (OSError, EOFError):  # the main process went away
            raise _Stop() from None

    def _handle(self, command: tuple, running: int | None) -> int | None:
        """Applies ``command``; returns an epoch to switch to, if it asks for one."""
        kind = command[0]
        if kind == "stop":
            raise _Stop()
        epoch = command[1]  # "start"
        if command[2] is not None:
            self.resume_at[epoch] = command[2]
        if epoch > self.latest_start:
            self.latest_start = epoch
            # (the first pass may have run before it was asked for: not again)
            if (running is None or epoch > running) and epoch not in self.started:
                return epoch
        return None

    def _wait_for_start(self) -> int:
        while True:
            switch = self._handle(self._next_command(block=True), None)
            if switch is not None:
                return switch
            last = max(self.started, default=-1)
            if self.config.load_indefinitely and 0 <= last <= self.latest_start:
                return last + 1  # the pass that ran early was asked for: preload on

    def _poll(self, running: int) -> int | None:
        switch = None
        while (command := self._next_command(block=False)) is not None:
            requested = self._handle(command, running)
            if requested is not None:
                switch = requested
        return switch

    # -- one pass over the data set -------------------------------------------------
    def _run_epoch(self, epoch: int) -> int | None:
        """Streams one epoch; returns the next epoch to run (None: wait for a start)."""
        rebatcher = (Rebatcher(self.config.rebatched_size)
                     if self.config.rebatched_size else None)
        iterator = None
        self.started.add(epoch)
        skip = self._prepare_resume(self.resume_at.pop(epoch, None))
        self.send_start = True
        try:
            iterator = iter(self.dataset)
            install_sigchld_translation()
            for batch in iterator:
                ready = rebatcher.push(batch) if rebatcher else [batch]
                if skip:  # a resumed pass the data set cannot skip by itself
                    dropped = min(skip, len(ready))
                    ready, skip = ready[dropped:], skip - dropped
                for out in ready:
                    switch = self._emit(epoch, out)
                    if switch is not None:
                        return switch
                if self.emitted_before_start and not self.config.early_preload:
                    switch = self._hold_until_asked(epoch)  # before reading more
                    if switch is not None:
                        return switch
                # Commands (freed slots, a new pass, stop) are read when the ring is
                # full (in _emit) and at least every buffer_size batches: one system
                # call per batch less than reading them after every batch.
                self.unpolled += 1
                if self.unpolled >= self.config.buffer_size:
                    self.unpolled = 0
                    switch = self._poll(epoch)
                    if switch is not None:
                        return switch
            for out in (rebatcher.flush(self.config.rebatched_drop_last)
                        if rebatcher else []):
                switch = self._emit(epoch, out)
                if switch is not None:
                    return switch
        except (_Stop, SystemExit):
            raise
        except BaseException as error:  # reported to the main process, which re-raises
            for _ in range(3):  # torch's SIGCHLD handler may raise again meanwhile
                try:
                    self._report(epoch, error, iterator)
                    break
                except (_Stop, SystemExit):
                    raise
                except BaseException as again:
                    error = again
            return None
        finally:
            del iterator  # joins the data set's worker processes, if any
        self._send(("end", epoch))
        # Preload the next pass, but never more than one past the newest one asked for.
        if self.config.load_indefinitely and epoch <= self.latest_start:
            return epoch + 1
        return None

    def _prepare_resume(self, resume: dict | None) -> int:
        """Starts the next pass at ``resume``; returns how many of its batches to read and
        drop here (when the data set cannot skip them without loading them)."""
        if resume is None:
            return 0
        apply = getattr(self.dataset, "apply_resume", None)
        if apply is not None and apply(resume):
            return 0
        return 0 if resume["finished"] else resume["consumed"]

    def _hold_until_asked(self, epoch: int) -> int | None:
        """Without early_preload only the first batch is loaded before the first pass
        is asked for: wait for that (or for a switch to another pass)."""
        while self.latest_start < 0:
            switch = self._handle(self._next_command(block=True), epoch)
            if switch is not None:
                return switch
        return None

    def _emit(self, epoch: int, batch: UserInput) -> int | None:
        skeleton, tensors, key = flatten_keyed(batch)
        switch = self._wait_for_slot(epoch)
        if switch is not None:
            return switch
        slot = self.free.popleft()
        layout = [(t.shape, t.dtype) for t in tensors]
        if layout == self.layouts[slot]:
            for target, tensor in zip(self.slots[slot] or (), tensors, strict=False):
                target.copy_(tensor)
            fresh = None
        else:
            fresh = [t.clone(memory_format=torch.contiguous_format).share_memory_()
                     for t in tensors]
            self.slots[slot], self.layouts[slot] = fresh, layout
        start = None
        if self.send_start:
            self.send_start = False
            position_start = getattr(self.dataset, "position_start", None)
            start = position_start() if position_start is not None else None
        if key is not None and key == self.sent_key and fresh is None and start is None:
            self.ring.publish(epoch, slot)
        else:
            self._send(("batch", epoch, slot, skeleton, fresh, start))
            self.sent_key = key
        if self.latest_start < 0:
            self.emitted_before_start = True
        return None

    def _wait_for_slot(self, epoch: int) -> int | None:
        """Waits until a slot is free (reading commands meanwhile); returns an epoch to
        switch to, if a command asks for one."""
        while not self.free:
            slot = self.ring.take_freed(_SLOT_WAIT_S)  # (no wait if one is freed)
            if slot is not None:
                self.free.append(slot)
                break
            switch = self._poll(epoch)
            if switch is not None:
                return switch
            if self.parent is not None and not self.parent.is_alive():
                raise _Stop()
        return None

    def _report(self, epoch: int, error: BaseException, iterator: object) -> None:
        description = (f"the AsynchronousDataAccessor worker process "
                       f"(pid {os.getpid()})")
        # one of the data set's torch workers died
        death = as_worker_death(error, getattr(iterator, "_inner", iterator))
        if death is not None:
            stop_torch_workers(iterator)  # no more SIGCHLD reports from its workers
            death.__traceback__ = error.__traceback__
            error = death
        error_type = pickled_type(error)
        text = "".join(traceback.format_exception(type(error), error,
                                                  error.__traceback__))
        self._send(("error", epoch, description, text, error_type, str(error)))
