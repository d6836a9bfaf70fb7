"""The hand-over of batches between ``AsynchronousDataAccessor`` and its worker process.

The batches themselves live in the ring's shared-memory slots (see ``worker``); this
module carries the small news about them without a system call in the common case:

* the worker *publishes* a batch that needs nothing but its slot and pass number (the
  usual one: same structure as the previous batch) by writing ``(message number, pass,
  slot)`` into a shared log; every other message (a batch with new tensors or a new
  structure, the end of a pass, an error) goes through the results pipe;
* the main process *frees* a slot by writing its number into a second shared log.

Each message, wherever it travels, releases one token of the ``ready`` semaphore, and
each freed slot one token of ``freed``: a POSIX semaphore is an atomic counter that
enters the kernel only to wake a sleeper, and its release/acquire order the writes to the
logs, so the reader sees the entry its token stands for (on any memory model). Messages
are numbered in the order the worker emits them; after taking a token for message ``i``,
the main process finds it in the log if the log's next entry is numbered ``i``, and
otherwise it is the next message of the pipe (whose token is released just before it is
sent, so that a message bigger than the pipe's buffer cannot deadlock the two).

A log never holds more than ``slots`` unread entries: each entry stands for a slot, and
there are ``slots`` of them.

A waiting main process first spins briefly (yielding the core) on ``ready`` as long as
messages keep coming that soon: a light batch arrives every few tens of microseconds,
sooner than a sleeping process is woken (on a 2-core virtual machine, waking the main
process for every batch halved the throughput of a light data set; see
``benchmarks/bench_data.py``).
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext
    from multiprocessing.synchronize import Semaphore

__all__ = ["ON_PIPE", "BatchRing"]

ON_PIPE = object()  # ``BatchRing.next_message``: the message is the pipe's next one
_SPIN_S = 0.0002  # how long a waiting main process spins before it sleeps
_ENTRY = 3  # log entry: message number, pass, slot


class BatchRing:
    """Shared logs and semaphores of one accessor and its worker (see module docstring).

    Made by the accessor and passed to the worker process; each side keeps its own
    cursors (a fresh copy in the worker)."""

    def __init__(self, context: BaseContext, slots: int) -> None:
        self.slots = slots
        # [0, slots): freed slot numbers; then ``slots`` batch entries of _ENTRY numbers
        self._shared = context.RawArray("q", slots * (1 + _ENTRY))
        for entry in range(slots):  # numbered -1: no message is in the log yet
            self._shared[slots + entry * _ENTRY] = -1
        self._ready = context.Semaphore(0)  # worker -> main: messages emitted
        self._freed = context.Semaphore(0)  # main -> worker: slots freed
        self._reset_cursors()

    def _reset_cursors(self) -> None:
        self._emitted = 0      # worker: messages numbered so far
        self._published = 0    # worker: batch-log entries written
        self._frees_read = 0   # worker: free-log entries read
        self._received = 0     # main: messages taken
        self._log_read = 0     # main: batch-log entries read
        self._frees_written = 0  # main: free-log entries written
        self._spin_pays = True   # main: the last wait ended soon (see next_message)

    def __getstate__(self) -> dict:
        return {"slots": self.slots, "_shared": self._shared, "_ready": self._ready,
                "_freed": self._freed}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_cursors()

    # -- the worker's side ------------------------------------------------------------
    def publish(self, epoch: int, slot: int) -> None:
        """Hands over a batch that needs only its slot and pass number."""
        base = self.slots + (self._published % self.slots) * _ENTRY
        shared = self._shared
        shared[base + 1] = epoch
        shared[base + 2] = slot
        shared[base] = self._emitted
        self._published += 1
        self._emitted += 1
        self._ready.release()

    def announce(self) -> None:
        """Numbers the message about to be sent through the pipe (call just before)."""
        self._emitted += 1
        self._ready.release()

    def take_freed(self, timeout: float | None = 0.0) -> int | None:
        """A slot the main process freed, or None if none is freed within ``timeout``
        seconds (0: do not wait)."""
        if not (self._freed.acquire(False) if not timeout
                else self._freed.acquire(True, timeout)):
            return None
        slot = self._shared[self._frees_read % self.slots]
        self._frees_read += 1
        return slot

    # -- the main process's side ------------------------------------------------------
    def free(self, slot: int) -> None:
        """Gives ``slot`` back to the worker."""
        self._shared[self._frees_written % self.slots] = slot
        self._frees_written += 1
        self._freed.release()

    def next_message(self, timeout: float) -> tuple[int, int] | object | None:
        """Waits up to ``timeout`` seconds for the next message: ``(epoch, slot)`` of a
        published batch, :py:data:`ON_PIPE`, or None (nothing came)."""
        ready = self._ready
        if not ready.acquire(False) and not self._spin(ready):
            start = time.perf_counter()
            if not ready.acquire(True, timeout):
                return None
            # Spin next time only if this message came soon after spinning would have
            # given up: a slow loader (heavy items, busy torch workers) leaves the core
            # to them instead.
            self._spin_pays = time.perf_counter() - start < _SPIN_S
        number = self._received
        self._received += 1
        base = self.slots + (self._log_read % self.slots) * _ENTRY
        shared = self._shared
        if shared[base] != number:
            return ON_PIPE
        self._log_read += 1
        return shared[base + 1], shared[base + 2]

    def _spin(self, ready: Semaphore) -> bool:
        """Spins (yielding the core) for up to ``_SPIN_S`` while that has been paying
        off; True if a message came meanwhile (its token taken)."""
        if not self._spin_pays:
            return False
        deadline = time.perf_counter() + _SPIN_S
        while time.perf_counter() < deadline:
            os.sched_yield()
            if ready.acquire(False):
                return True
        return False
